// What the CPU casts share with their amax passes: f(x) of common.h's FusedAct rounded to the
// input dtype, and the scale a cast uses (its own, or the current-scaling update of its slot).
#pragma once

#include "../common.h"
#include "../gelu_math.h"
#include "../scale_math.h"
#include "fp8_convert.h"

namespace graphfp8::cpu {

// f(x) in fp32, rounded to T (a no-op for float inputs). act_in: the GELU input (kDgelu).
template <typename T>
inline float apply_act(FusedAct act, float x, float act_in) {
  float f = x;
  if (act == FusedAct::kGelu) {
    f = gelu_tanh(x);
  } else if (act == FusedAct::kDgelu) {
    f = dgelu_tanh(x, act_in);
  }
  return round_to<T>(f);
}

// Current scaling (common.h's CurrentScale): the slot's one-slot update, done before the cast
// (and before its noop check, as the separate update ran whatever the flag), so that the cast
// then reads the new scale from the slot.
inline void update_current_scale(const CurrentScale& c) {
  if (!c.on()) return;
  *c.scale = updated_scale(*c.amax, *c.scale, *c.scaled_max);
  *c.amax = 0.0f;
}

// Folds a cast's amax into *amax_out unless there is none (a current-scaling cast).
inline void fold_amax(float* amax_out, float amax) {
  if (amax_out != nullptr && *amax_out < amax) *amax_out = amax;
}

}  // namespace graphfp8::cpu
