// CPU kernels: LayerNorm / RMSNorm forward with an FP8 output (optionally its transpose, the
// high-precision output and a residual add in front), and the norm backward.
//
// Reference-speed loops for CI and debugging, bit-identical to graphfp8/reference.py's twins:
// every mean and every column sum is a sequential float64 sum (divided in float64 for a mean)
// rounded once to float32, everything else float32 with one rounding per operation (setup.py
// builds with -ffp-contract=off).
#include <cmath>
#include <vector>

#include "../common.h"
#include "../dtype_switch.h"
#include "fp8_convert.h"
#include "fused_act.h"

namespace graphfp8 {
namespace {

// Sequential float64 mean of a * b over n float32 pairs, rounded to float32.
float seq_mean_of_products(const float* a, const float* b, int64_t n) {
  double s = 0.0;
  for (int64_t i = 0; i < n; ++i) s += static_cast<double>(a[i]) * static_cast<double>(b[i]);
  return static_cast<float>(s / static_cast<double>(n));
}

float seq_mean(const float* a, int64_t n) {
  double s = 0.0;
  for (int64_t i = 0; i < n; ++i) s += static_cast<double>(a[i]);
  return static_cast<float>(s / static_cast<double>(n));
}

template <typename T>
float weight(const NormParams& p, int64_t i) {
  const float g = static_cast<float>(static_cast<const T*>(p.gamma)[i]);
  return p.zero_centered_gamma ? g + 1.0f : g;
}

// z of row r as float32: x, or x + residual rounded to T (then also written to residual_out).
template <typename T>
void load_row(const NormParams& p, int64_t r, std::vector<float>& z) {
  const int64_t base = r * p.hidden;
  const auto* x = static_cast<const T*>(p.x) + base;
  for (int64_t i = 0; i < p.hidden; ++i) z[i] = static_cast<float>(x[i]);
  if (p.residual == nullptr) return;
  const auto* res = static_cast<const T*>(p.residual) + base;
  auto* res_out = p.amax_only ? nullptr : static_cast<T*>(p.residual_out) + base;
  for (int64_t i = 0; i < p.hidden; ++i) {
    const T zi = T(z[i] + static_cast<float>(res[i]));
    if (res_out != nullptr) res_out[i] = zi;
    z[i] = static_cast<float>(zi);
  }
}

template <typename T, bool kE4M3>
void norm_fwd_loop(const NormParams& p) {
  cpu::update_current_scale(p.current);
  const float scale = p.amax_only ? 1.0f : *p.scale;
  const int64_t H = p.hidden;
  auto* out = static_cast<uint8_t*>(p.out);
  auto* out_t = static_cast<uint8_t*>(p.out_t);
  auto* out_hp = static_cast<T*>(p.out_hp);
  std::vector<float> z(H), d(H);
  float amax = 0.0f;
  for (int64_t r = 0; r < p.rows; ++r) {
    load_row<T>(p, r, z);
    const float mu = p.rms ? 0.0f : seq_mean(z.data(), H);
    for (int64_t i = 0; i < H; ++i) d[i] = p.rms ? z[i] : z[i] - mu;
    const float rsigma = 1.0f / std::sqrt(seq_mean_of_products(d.data(), d.data(), H) + p.eps);
    if (p.mu != nullptr) p.mu[r] = mu;
    if (p.rsigma != nullptr) p.rsigma[r] = rsigma;
    for (int64_t i = 0; i < H; ++i) {
      float y = (d[i] * rsigma) * weight<T>(p, i);
      if (!p.rms) y = y + static_cast<float>(static_cast<const T*>(p.beta)[i]);
      amax = std::fmax(amax, std::fabs(y));  // fmax ignores NaN, as fmaxf does on the GPU
      if (p.amax_only) continue;
      const uint8_t q = cpu::quantize<kE4M3>(y * scale);
      out[r * H + i] = q;
      if (out_t != nullptr) out_t[i * p.rows + r] = q;
      if (out_hp != nullptr) out_hp[r * H + i] = T(y);
    }
  }
  cpu::fold_amax(p.amax, amax);
  if (!p.amax_only) *p.scale_inv = 1.0f / scale;
}

template <typename T>
void norm_bwd_loop(const NormBwdParams& p) {
  const int64_t H = p.hidden;
  std::vector<float> dy(H), xhat(H), dyg(H);
  std::vector<double> dgamma(H, 0.0), dbeta(H, 0.0);
  for (int64_t r = 0; r < p.rows; ++r) {
    const auto* dy_r = static_cast<const T*>(p.dy) + r * H;
    const auto* x_r = static_cast<const T*>(p.x) + r * H;
    const float mu = p.rms ? 0.0f : p.mu[r];
    const float rsigma = p.rsigma[r];
    for (int64_t i = 0; i < H; ++i) {
      dy[i] = static_cast<float>(dy_r[i]);
      const float x = static_cast<float>(x_r[i]);
      xhat[i] = p.rms ? x * rsigma : (x - mu) * rsigma;
      const float g = static_cast<float>(static_cast<const T*>(p.gamma)[i]);
      dyg[i] = dy[i] * (p.zero_centered_gamma ? g + 1.0f : g);
    }
    const float c1 = seq_mean_of_products(dyg.data(), xhat.data(), H);
    const float c2 = p.rms ? 0.0f : seq_mean(dyg.data(), H);
    auto* dx = static_cast<T*>(p.dx) + r * H;
    const auto* dres = static_cast<const T*>(p.dresidual);
    for (int64_t i = 0; i < H; ++i) {
      const float g = p.rms ? dyg[i] - xhat[i] * c1 : (dyg[i] - c2) - xhat[i] * c1;
      float grad = g * rsigma;
      if (dres != nullptr) grad = grad + static_cast<float>(dres[r * H + i]);
      dx[i] = T(grad);
      dgamma[i] += static_cast<double>(dy[i]) * static_cast<double>(xhat[i]);
      dbeta[i] += static_cast<double>(dy[i]);
    }
  }
  for (int64_t i = 0; i < H; ++i) {
    static_cast<T*>(p.dgamma)[i] = T(static_cast<float>(dgamma[i]));
    if (p.dbeta != nullptr) static_cast<T*>(p.dbeta)[i] = T(static_cast<float>(dbeta[i]));
  }
}

}  // namespace

Status norm_fwd_cpu(const NormParams& p) {
  GRAPHFP8_SWITCH_HP(p.dtype, "norm_fwd_cpu", T,
    GRAPHFP8_SWITCH_FP8(p.out_dtype, "norm_fwd_cpu", kE4M3, norm_fwd_loop<T, kE4M3>(p);))
  return Status{};
}

Status norm_bwd_cpu(const NormBwdParams& p) {
  GRAPHFP8_SWITCH_HP(p.dtype, "norm_bwd_cpu", T, norm_bwd_loop<T>(p);)
  return Status{};
}

}  // namespace graphfp8
