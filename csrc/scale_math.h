// The scale update of one slot from its amax, shared by the fused delayed-scaling update
// (cpu/scale_update.cpp, cuda/scale_update.cu) and the casts that compute their own current
// scale (CurrentScale in common.h), so that every path computes docs/fp8.md's math bit for bit:
//   scale = isfinite(amax) && amax > 0 ? scaled_max / amax : scale;  an infinite scale -> FLT_MAX
#pragma once

#include <cfloat>
#include <cmath>

#include "host_device.h"

namespace graphfp8 {

GRAPHFP8_HOST_DEVICE float updated_scale(float amax, float scale, float scaled_max) {
#ifdef __CUDA_ARCH__
  if (isfinite(amax) && amax > 0.0f) scale = scaled_max / amax;
  if (isinf(scale)) scale = FLT_MAX;
#else
  if (std::isfinite(amax) && amax > 0.0f) scale = scaled_max / amax;
  if (std::isinf(scale)) scale = FLT_MAX;
#endif
  return scale;
}

}  // namespace graphfp8
