// CPU kernel: the fused delayed-scaling update of every slot of an arena (docs/fp8.md's exact
// math, as cuda/scale_update.cu).
#include <cmath>

#include "../common.h"
#include "../scale_math.h"

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
    p.scale[s] = updated_scale(p.most_recent ? a : m, p.scale[s], p.scaled_max[s]);
  }
  return Status{};
}

}  // namespace graphfp8
