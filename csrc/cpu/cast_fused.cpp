// CPU kernel: cast-transpose of f(x) (identity, GELU or dGELU) with optional dbias.
//
// Reference-speed loops for CI and debugging. The FP8 outputs, amax and scale_inv are bit-identical
// to graphfp8/reference.py; dbias sums each column in row order in fp32, the twin in torch's
// order, so the two agree to fp32 rounding (the tests say how closely).
#include <cmath>
#include <vector>

#include "../common.h"
#include "../gelu_math.h"
#include "fp8_convert.h"

namespace graphfp8 {
namespace {

// f(x) at flat index i in fp32, rounded to x's dtype (a no-op for fp32 inputs).
float fused_value(const FusedCastTransposeParams& p, int64_t i) {
  const DType dt = p.cast.x_dtype;
  const float x = cpu::load_as_float(p.cast.x, dt, i);
  float f = x;
  if (p.act == FusedAct::kGelu) {
    f = gelu_tanh(x);
  } else if (p.act == FusedAct::kDgelu) {
    f = dgelu_tanh(x, cpu::load_as_float(p.act_in, dt, i));
  }
  return cpu::round_to(dt, f);
}

}  // namespace

void cast_transpose_fused_cpu(const FusedCastTransposeParams& p) {
  const CastParams& c = p.cast;
  const float scale = *c.scale;
  const float max_val = cpu::fp8_max(c.out_dtype);
  auto* out = static_cast<uint8_t*>(c.out);
  auto* out_t = static_cast<uint8_t*>(c.out_t);
  std::vector<float> col_sum(p.dbias != nullptr ? c.cols : 0, 0.0f);
  float amax = 0.0f;
  for (int64_t r = 0; r < c.rows; ++r) {
    for (int64_t col = 0; col < c.cols; ++col) {
      const int64_t i = r * c.cols + col;
      const float v = fused_value(p, i);
      amax = std::fmax(amax, std::fabs(v));  // fmax ignores NaN, as fmaxf does on the GPU
      const uint8_t q = cpu::quantize(v * scale, c.out_dtype, max_val);
      out[i] = q;
      out_t[col * c.rows + r] = q;
      if (p.dbias != nullptr) col_sum[col] += v;
    }
  }
  if (*c.amax < amax) *c.amax = amax;
  *c.scale_inv = 1.0f / scale;
  for (int64_t col = 0; col < static_cast<int64_t>(col_sum.size()); ++col) {
    cpu::store_from_float(p.dbias, c.x_dtype, col, col_sum[col]);
  }
}

}  // namespace graphfp8
