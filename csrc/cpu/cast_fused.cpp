// CPU kernel: cast-transpose of f(x) (identity, GELU or dGELU) with optional dbias.
//
// Reference-speed loops for CI and debugging. The FP8 outputs, amax and scale_inv are bit-identical
// to graphfp8/reference.py; dbias sums each column in row order in fp32, the twin in torch's
// order, so the two agree to fp32 rounding (the tests say how closely).
#include <cmath>
#include <vector>

#include "../common.h"
#include "../dtype_switch.h"
#include "fp8_convert.h"
#include "fused_act.h"

namespace graphfp8 {
namespace {

// f(x) at flat index i in fp32, rounded to T (a no-op for float inputs).
template <typename T>
float fused_value(const FusedCastTransposeParams& p, int64_t i) {
  const float x = static_cast<float>(static_cast<const T*>(p.cast.x)[i]);
  const float h = p.act_in != nullptr ? static_cast<float>(static_cast<const T*>(p.act_in)[i]) : 0;
  return cpu::apply_act<T>(p.act, x, h);
}

template <typename T, bool kE4M3>
void fused_loop(const FusedCastTransposeParams& p) {
  const CastParams& c = p.cast;
  const float scale = *c.scale;
  auto* out = static_cast<uint8_t*>(c.out);
  auto* out_t = static_cast<uint8_t*>(c.out_t);
  std::vector<float> col_sum(p.dbias != nullptr ? c.cols : 0, 0.0f);
  float amax = 0.0f;
  for (int64_t r = 0; r < c.rows; ++r) {
    for (int64_t col = 0; col < c.cols; ++col) {
      const int64_t i = r * c.cols + col;
      const float v = fused_value<T>(p, i);
      amax = std::fmax(amax, std::fabs(v));  // fmax ignores NaN, as fmaxf does on the GPU
      const uint8_t q = cpu::quantize<kE4M3>(v * scale);
      out[i] = q;
      out_t[col * c.rows + r] = q;
      if (p.dbias != nullptr) col_sum[col] += v;
    }
  }
  cpu::fold_amax(c.amax, amax);
  *c.scale_inv = 1.0f / scale;
  auto* dbias = static_cast<T*>(p.dbias);
  for (size_t col = 0; col < col_sum.size(); ++col) dbias[col] = T(col_sum[col]);
}

}  // namespace

Status cast_transpose_fused_cpu(const FusedCastTransposeParams& p) {
  cpu::update_current_scale(p.cast.current);
  if (p.cast.noop != nullptr && *p.cast.noop == 1.0f) return Status{};
  GRAPHFP8_SWITCH_HP(p.cast.x_dtype, "cast_transpose_fused_cpu", T,
    GRAPHFP8_SWITCH_FP8(p.cast.out_dtype, "cast_transpose_fused_cpu", kE4M3,
      fused_loop<T, kE4M3>(p);))
  return Status{};
}

}  // namespace graphfp8
