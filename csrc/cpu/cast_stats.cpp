// CPU: the FP8 cast statistics (csrc/cast_stats.h), one sequential pass into out row 0 (the
// other rows, if any, are zeroed), in the CPU kernels' arithmetic.
#include <cmath>

#include "../cast_stats.h"
#include "../dtype_switch.h"
#include "../gelu_math.h"
#include "fp8_convert.h"

namespace graphfp8 {
namespace {

template <typename T>
float hp_value(const CastStatsParams& p, int64_t r, int64_t c) {
  const int64_t i = r * p.cols + c;
  const float x = static_cast<float>(static_cast<const T*>(p.x)[i]);
  switch (p.mode) {
    case kStatsGelu: return cpu::round_to<T>(gelu_tanh(x));
    case kStatsDgelu:
      return cpu::round_to<T>(dgelu_tanh(x, static_cast<float>(static_cast<const T*>(p.act_in)[i])));
    case kStatsLayerNorm:
    case kStatsRmsNorm: {
      float g = static_cast<float>(static_cast<const T*>(p.gamma)[c]);
      if (p.zero_centered_gamma) g = g + 1.0f;
      const float d = p.mode == kStatsLayerNorm ? x - p.mu[r] : x;
      float y = (d * p.rsigma[r]) * g;
      if (p.mode == kStatsLayerNorm) y = y + static_cast<float>(static_cast<const T*>(p.beta)[c]);
      return y;
    }
    default: return x;
  }
}

template <typename T, bool kE4M3>
void stats_loop(const CastStatsParams& p) {
  const float scale = *p.scale;
  const float scale_inv = 1.0f / scale;
  constexpr float max_val = kE4M3 ? kE4M3Max : kE5M2Max;
  double amax = 0.0, sat = 0.0, under = 0.0, nonzero = 0.0, signal = 0.0, noise = 0.0;
  for (int64_t r = 0; r < p.rows; ++r) {
    for (int64_t c = 0; c < p.cols; ++c) {
      const float v = hp_value<T>(p, r, c);
      if (std::isnan(v)) continue;
      const float y = v * scale;
      const float q = cpu::fp8_to_float<kE4M3>(cpu::quantize<kE4M3>(y));
      amax = std::fmax(amax, static_cast<double>(std::fabs(v)));
      sat += std::fabs(y) > max_val;
      under += (q == 0.0f && v != 0.0f);
      nonzero += v != 0.0f;
      const double e = static_cast<double>(v) - static_cast<double>(q * scale_inv);
      signal += static_cast<double>(v) * static_cast<double>(v);
      noise += e * e;
    }
  }
  const double row[kStatsColumns] = {amax,  sat, under, nonzero, signal, noise,
                                     scale, static_cast<double>(*p.recorded_amax)};
  for (int64_t u = 0; u < p.partials; ++u) {
    for (int k = 0; k < kStatsColumns; ++k) p.out[u * kStatsColumns + k] = u == 0 ? row[k] : 0.0;
  }
  if (p.partials > 0) {  // scale and recorded amax in every row
    for (int64_t u = 1; u < p.partials; ++u) {
      p.out[u * kStatsColumns + 6] = row[6];
      p.out[u * kStatsColumns + 7] = row[7];
    }
  }
}

}  // namespace

Status cast_stats_cpu(const CastStatsParams& p) {
  if (p.enabled != nullptr && *p.enabled == 0.0f) return Status{};
  if (p.skip != nullptr && *p.skip == 1.0f) return Status{};
  const DType fp8 = p.e4m3 ? DType::kE4M3 : DType::kE5M2;
  GRAPHFP8_SWITCH_HP(p.x_dtype, "cast_stats", T,
    GRAPHFP8_SWITCH_FP8(fp8, "cast_stats", kE4M3, stats_loop<T, kE4M3>(p); return Status{};))
  return Status{};
}

}  // namespace graphfp8
