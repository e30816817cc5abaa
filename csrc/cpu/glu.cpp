// CPU kernels: the GLU activation (SwiGLU, GeGLU) fused with the FP8 cast-transpose of its output,
// and its backward fused with the FP8 cast-transpose of the fc1 gradient and dbias (glu.h).
//
// Reference-speed loops for CI and debugging, bit-identical to graphfp8/reference.py's twins: the
// math of glu_math.h with its host transcendentals (double exp / tanh rounded to float), every
// other operation float32 with one rounding (setup.py builds with -ffp-contract=off), and dbias a
// sequential float64 column sum rounded to float32, then to the dtype.
#include <cmath>
#include <vector>

#include "../dtype_switch.h"
#include "../glu.h"
#include "fp8_convert.h"

namespace graphfp8 {
namespace {

// One FP8 value of a (rows, cols) tensor and its transpose, folding its amax.
template <bool kE4M3>
struct Fp8Writer {
  uint8_t* out;
  uint8_t* out_t;
  int64_t rows, cols;
  float scale, amax = 0.0f;

  void put(int64_t r, int64_t c, float v) {
    amax = std::fmax(amax, std::fabs(v));  // fmax ignores NaN, as fmaxf does on the GPU
    const uint8_t q = cpu::quantize<kE4M3>(v * scale);
    out[r * cols + c] = q;
    out_t[c * rows + r] = q;
  }

  void finish(const GluParams& p) const {
    if (*p.amax < amax) *p.amax = amax;
    *p.scale_inv = 1.0f / scale;
  }
};

template <bool kE4M3>
Fp8Writer<kE4M3> writer(const GluParams& p, int64_t cols) {
  return {static_cast<uint8_t*>(p.out), static_cast<uint8_t*>(p.out_t), p.rows, cols, *p.scale};
}

template <typename T, bool kE4M3, GluAct kAct>
void glu_fwd_loop(const GluParams& p) {
  const auto* h = static_cast<const T*>(p.x);
  const int64_t f = p.cols;
  auto w = writer<kE4M3>(p, f);
  for (int64_t r = 0; r < p.rows; ++r) {
    for (int64_t c = 0; c < f; ++c) {
      const float g = static_cast<float>(h[r * 2 * f + c]);
      const float u = static_cast<float>(h[r * 2 * f + f + c]);
      w.put(r, c, cpu::round_to<T>(glu_forward<kAct>(g, u)));
    }
  }
  w.finish(p);
}

template <typename T, bool kE4M3, GluAct kAct>
void glu_bwd_loop(const GluParams& p) {
  const auto* h = static_cast<const T*>(p.x);
  const auto* da = static_cast<const T*>(p.dy);
  const int64_t f = p.cols;
  auto w = writer<kE4M3>(p, 2 * f);
  std::vector<double> col_sum(p.dbias != nullptr ? 2 * f : 0, 0.0);
  for (int64_t r = 0; r < p.rows; ++r) {
    for (int64_t c = 0; c < f; ++c) {
      const float g = static_cast<float>(h[r * 2 * f + c]);
      const float u = static_cast<float>(h[r * 2 * f + f + c]);
      const GluGrad d = glu_backward<kAct>(static_cast<float>(da[r * f + c]), g, u);
      const float dg = cpu::round_to<T>(d.dg), du = cpu::round_to<T>(d.du);
      w.put(r, c, dg);
      w.put(r, f + c, du);
      if (!col_sum.empty()) {
        col_sum[c] += dg;
        col_sum[f + c] += du;
      }
    }
  }
  w.finish(p);
  auto* dbias = static_cast<T*>(p.dbias);
  for (size_t c = 0; c < col_sum.size(); ++c) dbias[c] = T(static_cast<float>(col_sum[c]));
}

template <typename T, bool kE4M3>
Status run(const GluParams& p, bool backward) {
  if (p.act == GluAct::kSwiglu) {
    backward ? glu_bwd_loop<T, kE4M3, GluAct::kSwiglu>(p) : glu_fwd_loop<T, kE4M3, GluAct::kSwiglu>(p);
  } else {
    backward ? glu_bwd_loop<T, kE4M3, GluAct::kGeglu>(p) : glu_fwd_loop<T, kE4M3, GluAct::kGeglu>(p);
  }
  return Status{};
}

}  // namespace

Status glu_fwd_cpu(const GluParams& p) {
  GRAPHFP8_SWITCH_HP(p.dtype, "glu_fwd_cpu", T,
    GRAPHFP8_SWITCH_FP8(p.out_dtype, "glu_fwd_cpu", kE4M3, return run<T, kE4M3>(p, false);))
  return Status{};
}

Status glu_bwd_cpu(const GluParams& p) {
  GRAPHFP8_SWITCH_HP(p.dtype, "glu_bwd_cpu", T,
    GRAPHFP8_SWITCH_FP8(p.out_dtype, "glu_bwd_cpu", kE4M3, return run<T, kE4M3>(p, true);))
  return Status{};
}

}  // namespace graphfp8
