// CPU kernels: FP8 cast (with optional transpose), its amax pass, FP8 transpose and dequantize.
//
// Reference-speed loops for CI and debugging; the CUDA files hold the fast versions. Results are
// bit-identical to graphfp8/reference.py, which the tests check.
#include <cmath>

#include "../common.h"
#include "../dtype_switch.h"
#include "fp8_convert.h"
#include "fused_act.h"

namespace graphfp8 {
namespace {

template <typename T, bool kE4M3>
void cast_loop(const CastParams& p) {
  const float scale = *p.scale;
  const auto* x = static_cast<const T*>(p.x);
  auto* out = static_cast<uint8_t*>(p.out);
  auto* out_t = static_cast<uint8_t*>(p.out_t);
  float amax = 0.0f;
  for (int64_t r = 0; r < p.rows; ++r) {
    for (int64_t c = 0; c < p.cols; ++c) {
      const int64_t i = r * p.cols + c;
      const float v = static_cast<float>(x[i]);
      amax = std::fmax(amax, std::fabs(v));  // fmax ignores NaN, as fmaxf does on the GPU
      const uint8_t q = cpu::quantize<kE4M3>(v * scale);
      out[i] = q;
      if (out_t != nullptr) out_t[c * p.rows + r] = q;
    }
  }
  cpu::fold_amax(p.amax, amax);
  *p.scale_inv = 1.0f / scale;
}

template <typename OutT, bool kE4M3>
void dequantize_loop(const DequantizeParams& p) {
  const float scale_inv = *p.scale_inv;
  auto* out = static_cast<OutT*>(p.out);
  for (int64_t i = 0; i < p.numel; ++i) out[i] = OutT(cpu::fp8_to_float<kE4M3>(p.x[i]) * scale_inv);
}

}  // namespace

Status cast_cpu(const CastParams& p) {
  cpu::update_current_scale(p.current);
  if (p.noop != nullptr && *p.noop == 1.0f) return Status{};
  GRAPHFP8_SWITCH_HP(p.x_dtype, "cast_cpu", T,
    GRAPHFP8_SWITCH_FP8(p.out_dtype, "cast_cpu", kE4M3, cast_loop<T, kE4M3>(p);))
  return Status{};
}

Status amax_cpu(const AmaxParams& p) {
  if (p.noop != nullptr && *p.noop == 1.0f) return Status{};
  GRAPHFP8_SWITCH_HP(p.dtype, "amax_cpu", T,
    const auto* x = static_cast<const T*>(p.x);
    const auto* h = static_cast<const T*>(p.act_in);
    float amax = 0.0f;
    for (int64_t i = 0; i < p.numel; ++i) {
      const float v = cpu::apply_act<T>(p.act, static_cast<float>(x[i]),
                                        h != nullptr ? static_cast<float>(h[i]) : 0.0f);
      amax = std::fmax(amax, std::fabs(v));
    }
    cpu::fold_amax(p.amax, amax);)
  return Status{};
}

Status transpose_cpu(const TransposeParams& p) {
  if (p.noop != nullptr && *p.noop == 1.0f) return Status{};
  for (int64_t r = 0; r < p.rows; ++r) {
    for (int64_t c = 0; c < p.cols; ++c) p.out_t[c * p.rows + r] = p.x[r * p.cols + c];
  }
  return Status{};
}

Status dequantize_cpu(const DequantizeParams& p) {
  GRAPHFP8_SWITCH_HP(p.out_dtype, "dequantize_cpu", OutT,
    GRAPHFP8_SWITCH_FP8(p.x_dtype, "dequantize_cpu", kE4M3, dequantize_loop<OutT, kE4M3>(p);))
  return Status{};
}

}  // namespace graphfp8
