// f(x) of the fused cast kernels for one element (common.h's FusedAct), rounded to the input
// dtype as torch's activation kernels store it. One definition for the cast-transposes and the
// amax passes of current scaling, so that both see the same f bit for bit.
#pragma once

#include "../common.h"
#include "../gelu_math.h"
#include "fp8_util.cuh"
#include "vec.cuh"

namespace graphfp8::cuda {

template <typename InT, FusedAct kAct>
__device__ __forceinline__ float apply_act(float x, float act_in) {
  if constexpr (kAct == FusedAct::kGelu) {
    return to_float(from_float<InT>(gelu_tanh(x)));
  } else if constexpr (kAct == FusedAct::kDgelu) {
    return to_float(from_float<InT>(dgelu_tanh(x, act_in)));
  } else {
    return x;
  }
}

}  // namespace graphfp8::cuda
