// CPU kernel of the MLP activations in the input dtype (csrc/mlp_act.h): per element, glu_math.h's
// host math (exp and tanh in double, rounded once to float; GELU with that tanh, as
// blockwise_act.cpp), rounded to the dtype. The reference the CUDA kernel is held to.
#include "../dtype_switch.h"
#include "../gelu_math.h"
#include "../glu_math.h"
#include "../mlp_act.h"

namespace graphfp8 {
namespace {

template <typename T, GluAct kAct>
void gated(const MlpActParams& p) {
  const auto* x = static_cast<const T*>(p.x);
  const auto* dy = static_cast<const T*>(p.dy);
  auto* out = static_cast<T*>(p.out);
  const int64_t f = p.cols;
  for (int64_t r = 0; r < p.rows; ++r) {
    const T* g = x + r * 2 * f;
    for (int64_t c = 0; c < f; ++c) {
      const float gv = static_cast<float>(g[c]), uv = static_cast<float>(g[f + c]);
      if (dy == nullptr) {
        out[r * f + c] = T(glu_forward<kAct>(gv, uv));
      } else {
        const GluGrad d = glu_backward<kAct>(static_cast<float>(dy[r * f + c]), gv, uv);
        out[r * 2 * f + c] = T(d.dg);
        out[r * 2 * f + f + c] = T(d.du);
      }
    }
  }
}

template <typename T>
void gelu(const MlpActParams& p) {
  const auto* x = static_cast<const T*>(p.x);
  const auto* dy = static_cast<const T*>(p.dy);
  auto* out = static_cast<T*>(p.out);
  const int64_t n = p.rows * p.cols;
  for (int64_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    out[i] = T(dy == nullptr ? gelu_tanh(v, GluTanh{})
                             : dgelu_tanh(static_cast<float>(dy[i]), v, GluTanh{}));
  }
}

template <typename T>
void run(const MlpActParams& p) {
  switch (p.act) {
    case MlpAct::kGelu: gelu<T>(p); break;
    case MlpAct::kSwiglu: gated<T, GluAct::kSwiglu>(p); break;
    case MlpAct::kGeglu: gated<T, GluAct::kGeglu>(p); break;
  }
}

}  // namespace

Status mlp_act_cpu(const MlpActParams& p) {
  GRAPHFP8_SWITCH_HP(p.dtype, "mlp_act_cpu", T, run<T>(p);)
  return Status{};
}

}  // namespace graphfp8
