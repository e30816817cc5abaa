// CPU kernel: the fused delayed-scaling update of every slot of an arena (docs/fp8.md's exact
// math, as cuda/scale_update.cu).
#include <cmath>
#include <limits>

#include "../common.h"

namespace graphfp8 {

Status scale_update_cpu(const ScaleUpdateParams& p) {
  const int64_t L = p.history_len;
  const int64_t S = p.num_slots;
  for (int64_t s = 0; s < S; ++s) {
    float* h = p.amax_history + s;  // element k of this slot's history is h[k * S]
    const float a = h[0];
    float m = 0.0f;
    if (a != 0.0f) {
      // Roll in place: H = [0, H[2], ..., H[L-1], a]; m = max(H[1], ..., H[L-1], a).
      m = a;
      for (int64_t k = 1; k < L; ++k) {
        m = std::fmax(m, h[k * S]);
        h[(k - 1) * S] = h[k * S];
      }
      h[(L - 1) * S] = a;
      h[0] = 0.0f;  // after the shift, so that L == 1 gives H = [0]
    }
    const float amax = p.most_recent ? a : m;
    float scale = p.scale[s];
    if (std::isfinite(amax) && amax > 0.0f) scale = p.scaled_max[s] / amax;
    if (std::isinf(scale)) scale = std::numeric_limits<float>::max();
    p.scale[s] = scale;
  }
  return Status{};
}

}  // namespace graphfp8
