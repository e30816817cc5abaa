// The MLP activations and their gradients written in the input dtype, no FP8 (docs/fp8.md,
// "Blockwise scaling"): the blockwise LayerNormMLP's activation, whose output fc2 quantizes in
// 1x128 tiles, and its backward, whose output fc1's dgrad quantizes.
//   gelu    x (rows, F):             a = gelu_tanh(x)            dx = dy * gelu_tanh'(x)
//   swiglu  x = [g | u] (rows, 2 F): a = silu(g) * u             dx = [dg | du] (glu_math.h)
//   geglu   x = [g | u] (rows, 2 F): a = gelu_tanh(g) * u
// in float32 with the math of the fused per-tensor kernels (glu_math.h, gelu_math.h), rounded
// once to the dtype: a is the value blockwise_act.h quantizes (the same transcendentals: CUDA's
// expf / tanhf on the device, double exp / tanh rounded to float on the host), and [dg | du] the
// value the per-tensor GLU backward casts. The backward reads dy (rows, F) and x, and writes
// dx (x's shape) in one pass: dg and du side by side in each row, no concatenation.
// No torch headers (see common.h).
#pragma once

#include "common.h"

namespace graphfp8 {

enum class MlpAct : int { kGelu, kSwiglu, kGeglu };

struct MlpActParams {
  const void* x;   // (rows, F) for gelu, (rows, 2 F) for the gated ones; dtype, contiguous
  const void* dy;  // the backward's (rows, F) gradient of a, dtype; nullptr for the forward
  void* out;       // forward: a (rows, F); backward: dx, x's shape; dtype
  DType dtype;     // float32, bfloat16 or float16
  MlpAct act;
  int64_t rows;
  int64_t cols;    // F: the width of a
};

// Launchers assume csrc/ops/'s checks passed and a non-empty a.
Status mlp_act_cpu(const MlpActParams& p);
Status mlp_act_cuda(const MlpActParams& p, void* stream);

}  // namespace graphfp8
