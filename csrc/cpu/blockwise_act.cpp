// CPU kernel of the activations with a blockwise FP8 output (csrc/blockwise_act.h): a = act(x)
// with the CPU GLU kernels' math (glu_math.h, its host transcendentals: exp and tanh in double,
// rounded once to float; GELU is GeGLU's gate, gelu_tanh with that tanh), rounded to the input
// dtype into a host scratch, which the CPU blockwise quantizer (blockwise.cpp) reads:
// activation-then-quantize by construction, the reference the CUDA kernel is held to. (The CPU
// GELU casts of cast_fused.cpp take the C library's tanhf, whose last bits differ: invisible at
// a per-tensor scale, not under a tile's scale of up to 2^127, so the twin's double tanh here.)
#include <vector>

#include "../blockwise_act.h"
#include "../dtype_switch.h"
#include "../gelu_math.h"
#include "../glu_math.h"

namespace graphfp8 {
namespace {

template <typename T>
void activate(const BlockActParams& p, T* a) {
  const auto* x = static_cast<const T*>(p.x);
  const int64_t f = p.cols;
  for (int64_t r = 0; r < p.rows; ++r) {
    for (int64_t c = 0; c < f; ++c) {
      float v = 0.0f;
      if (p.act == BlockAct::kGelu) {
        v = gelu_tanh(static_cast<float>(x[r * f + c]), GluTanh{});
      } else {
        const float g = static_cast<float>(x[r * 2 * f + c]);
        const float u = static_cast<float>(x[r * 2 * f + f + c]);
        v = p.act == BlockAct::kSwiglu ? glu_forward<GluAct::kSwiglu>(g, u)
                                       : glu_forward<GluAct::kGeglu>(g, u);
      }
      a[r * f + c] = T(v);  // rounded to the dtype
    }
  }
}

}  // namespace

Status block_act_cpu(const BlockActParams& p) {
  std::vector<uint8_t> a(static_cast<size_t>(p.rows * p.cols * hp_bytes(p.dtype)));
  GRAPHFP8_SWITCH_HP(p.dtype, "block_act_cpu", T, activate<T>(p, reinterpret_cast<T*>(a.data()));)
  return block_quantize_cpu(tile_quantize_params(a.data(), p.dtype, p.dst, p.rows, p.cols));
}

}  // namespace graphfp8
