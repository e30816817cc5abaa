// CPU kernel: RoPE's backward fused into the FP8 cast-transpose of the fused QKV gradient
// (rope_cast.h has the math). A reference-speed loop: each token's gradient row is rotated into a
// scratch row exactly as rope_fp8_bwd_cpu writes it, then cast as cast_transpose_fused_cpu casts
// a row (the same amax, bytes and column sums in row order), so switch on equals switch off.
#include <cmath>
#include <vector>

#include "../dtype_switch.h"
#include "../rope_cast.h"
#include "fp8_convert.h"
#include "fused_act.h"
#include "rope_rotate.h"

namespace graphfp8 {
namespace {

// Row `token` of the fused QKV gradient, rotated back and rounded to T, into row (cols floats).
template <typename T>
void gradient_row(const RopeCastParams& p, int64_t token, std::vector<float>& row) {
  const int64_t half = p.head_dim / 2;
  const int64_t s = token % p.seq;
  const int64_t per_token = p.heads + 2 * p.kv_heads;
  for (int64_t j = 0; j < per_token; ++j) {
    const RopeHead h = rope_head(j, p.heads, p.kv_heads);
    const T* g = static_cast<const T*>(p.grad[h.part]) + (token * h.part_heads + h.head) * p.head_dim;
    float* out = row.data() + j * p.head_dim;
    for (int64_t i = 0; i < half; ++i) {
      float lo = static_cast<float>(g[i]);
      float hi = static_cast<float>(g[i + half]);
      if (h.part < 2 && p.cos != nullptr) {
        cpu::rotate(lo, hi, p.cos + s * p.head_dim, p.sin + s * p.head_dim, i, half, true);
      }
      out[i] = static_cast<float>(T(lo));
      out[i + half] = static_cast<float>(T(hi));
    }
  }
}

template <typename T, bool kE4M3>
void rope_cast_loop(const RopeCastParams& p) {
  const CastParams& c = p.fused.cast;
  const bool amax_only = c.out == nullptr;
  const float scale = amax_only ? 0.0f : *c.scale;
  auto* out = static_cast<uint8_t*>(c.out);
  auto* out_t = static_cast<uint8_t*>(c.out_t);
  std::vector<float> row(c.cols);
  std::vector<float> col_sum(p.fused.dbias != nullptr ? c.cols : 0, 0.0f);
  float amax = 0.0f;
  for (int64_t r = 0; r < c.rows; ++r) {
    gradient_row<T>(p, r, row);
    for (int64_t col = 0; col < c.cols; ++col) {
      const float v = row[col];
      amax = std::fmax(amax, std::fabs(v));  // fmax ignores NaN, as fmaxf does on the GPU
      if (amax_only) continue;
      const uint8_t q = cpu::quantize<kE4M3>(v * scale);
      out[r * c.cols + col] = q;
      out_t[col * c.rows + r] = q;
      if (!col_sum.empty()) col_sum[col] += v;
    }
  }
  cpu::fold_amax(c.amax, amax);
  if (amax_only) return;
  *c.scale_inv = 1.0f / scale;
  auto* dbias = static_cast<T*>(p.fused.dbias);
  for (size_t col = 0; col < col_sum.size(); ++col) dbias[col] = T(col_sum[col]);
}

}  // namespace

Status rope_cast_cpu(const RopeCastParams& p) {
  const CastParams& c = p.fused.cast;
  if (c.out != nullptr) cpu::update_current_scale(c.current);
  GRAPHFP8_SWITCH_HP(c.x_dtype, "rope_cast_cpu", T,
    GRAPHFP8_SWITCH_FP8(c.out_dtype, "rope_cast_cpu", kE4M3, rope_cast_loop<T, kE4M3>(p);))
  return Status{};
}

}  // namespace graphfp8
