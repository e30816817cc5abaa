// CPU kernel: rotary position embedding of the q and k parts of a fused QKV tensor (common.h has
// the math). Reference-speed loops in fp32, each product and sum rounded on its own (setup.py
// builds with -ffp-contract=off), bit-identical to graphfp8/reference.py's rope_qkv.
#include "../common.h"
#include "../dtype_switch.h"
#include "../rope_layout.h"

namespace graphfp8 {
namespace {

template <typename T>
void rope_loop(const RopeParams& p) {
  const auto* x = static_cast<const T*>(p.x);
  auto* y = static_cast<T*>(p.out);
  const int64_t half = p.head_dim / 2;
  const int64_t rows = p.batch * p.seq * (p.heads + 2 * p.kv_heads);  // rope_layout.h's rows
  for (int64_t r = 0; r < rows; ++r) {
    const RopeRow at = rope_row(r, p.seq, p.heads, p.kv_heads, p.head_dim);
    const bool rotated = at.rotated;
    const int64_t base = r * p.head_dim;
    const float* c = p.cos + at.s * p.head_dim;
    const float* n = p.sin + at.s * p.head_dim;
    for (int64_t i = 0; i < half; ++i) {
      const float lo = static_cast<float>(x[base + i]);
      const float hi = static_cast<float>(x[base + i + half]);
      float out_lo = lo, out_hi = hi;
      if (rotated && !p.inverse) {
        out_lo = lo * c[i] - hi * n[i];
        out_hi = hi * c[i + half] + lo * n[i + half];
      } else if (rotated) {
        out_lo = lo * c[i] + hi * n[i + half];
        out_hi = hi * c[i + half] - lo * n[i];
      }
      y[base + i] = T(out_lo);
      y[base + i + half] = T(out_hi);
    }
  }
}

}  // namespace

Status rope_cpu(const RopeParams& p) {
  GRAPHFP8_SWITCH_HP(p.dtype, "rope_cpu", T, rope_loop<T>(p);)
  return Status{};
}

}  // namespace graphfp8
