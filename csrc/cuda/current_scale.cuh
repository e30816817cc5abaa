// The scale a casting kernel uses, delayed or current (common.h's CurrentScale), and how a
// current-scaling cast publishes its slot's update without a second launch.
//
// Current scaling: the amax pass left a = H[0]; every block computes updated_scale(a, S) itself
// (scale_math.h) and block 0 publishes it: it stores the new scale, fences, then resets H[0] to
// 0. A block that reads H[0] after the reset reads 0 and, after its own fence, the new scale, and
// updated_scale(0, new) == new; a block that reads a before the reset gets the same value from
// the old or the new scale, because updated_scale(a, updated_scale(a, S)) == updated_scale(a, S).
// So every block casts with the same scale whatever the interleaving, and the slot ends as the
// one-slot scale_update would leave it (scale written, H[0] = 0). Launches of later tile chunks
// run after the reset and see 0 and the new scale. The loads bypass the non-coherent cache.
#pragma once

#include "../common.h"
#include "../scale_math.h"

namespace graphfp8::cuda {

// The block's scale. kCurrent: every thread of the block must call it (one barrier).
template <bool kCurrent>
__device__ __forceinline__ float cast_scale(const float* scale_p, const CurrentScale& c) {
  if constexpr (!kCurrent) {
    return *scale_p;
  } else {
    __shared__ float block_scale;
    if (threadIdx.x == 0 && threadIdx.y == 0) {
      const float a = *static_cast<volatile float*>(c.amax);
      __threadfence();
      const float s = updated_scale(a, *static_cast<volatile float*>(c.scale), *c.scaled_max);
      if (blockIdx.x == 0) {
        *static_cast<volatile float*>(c.scale) = s;
        __threadfence();
        *static_cast<volatile float*>(c.amax) = 0.0f;
      }
      block_scale = s;
    }
    __syncthreads();
    return block_scale;
  }
}

}  // namespace graphfp8::cuda
