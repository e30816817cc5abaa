// CPU kernels: FP8 cast (with optional transpose), FP8 transpose and dequantize.
//
// Reference-speed loops for CI and debugging; the CUDA files hold the fast versions. Results are
// bit-identical to graphfp8/reference.py, which the tests check.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "../common.h"
#include "fp8_convert.h"

namespace graphfp8 {

void cast_cpu(const CastParams& p) {
  if (p.noop != nullptr && *p.noop == 1.0f) return;
  const float scale = *p.scale;
  const float max_val = cpu::fp8_max(p.out_dtype);
  auto* out = static_cast<uint8_t*>(p.out);
  auto* out_t = static_cast<uint8_t*>(p.out_t);
  float amax = 0.0f;
  for (int64_t r = 0; r < p.rows; ++r) {
    for (int64_t c = 0; c < p.cols; ++c) {
      const int64_t i = r * p.cols + c;
      const float v = cpu::load_as_float(p.x, p.x_dtype, i);
      amax = std::fmax(amax, std::fabs(v));  // fmax ignores NaN, as fmaxf does on the GPU
      const uint8_t q = cpu::quantize(v * scale, p.out_dtype, max_val);
      out[i] = q;
      if (out_t != nullptr) out_t[c * p.rows + r] = q;
    }
  }
  if (*p.amax < amax) *p.amax = amax;
  *p.scale_inv = 1.0f / scale;
}

void transpose_cpu(const TransposeParams& p) {
  if (p.noop != nullptr && *p.noop == 1.0f) return;
  for (int64_t r = 0; r < p.rows; ++r) {
    for (int64_t c = 0; c < p.cols; ++c) p.out_t[c * p.rows + r] = p.x[r * p.cols + c];
  }
}

void dequantize_cpu(const DequantizeParams& p) {
  const float scale_inv = *p.scale_inv;
  for (int64_t i = 0; i < p.numel; ++i) {
    cpu::store_from_float(p.out, p.out_dtype, i, cpu::load_as_float(p.x, p.x_dtype, i) * scale_inv);
  }
}

}  // namespace graphfp8
