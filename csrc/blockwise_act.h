// The MLP activations with the output quantized blockwise (docs/fp8.md, "Blockwise scaling"):
// a = act(x) of the fused per-tensor kernels' math, rounded to the input dtype (the value those
// kernels scale, and the unfused path hands to the quantizer), then 1x128 tiles of a along its
// columns and, with dst.out_t, of a^T along the rows, by csrc/blockwise.h's scale rule:
//   gelu    x (rows, F):             a = gelu_tanh(x)      (gelu_math.h)
//   swiglu  x = [g | u] (rows, 2 F): a = silu(g) * u       (glu_math.h; glu.h's kernels' value)
//   geglu   x = [g | u] (rows, 2 F): a = gelu_tanh(g) * u
// Bit-identical to the activation kernel's a rounded to x's dtype followed by block_quantize on
// the same device: on CUDA the GELU casts' (fused_act.cuh) and the GLU kernels', on the CPU the
// GLU kernels' host math for all three (GELU as GeGLU's gate: the double tanh rounded to float
// that graphfp8/reference's twins compute). No (rows, F) high-precision a is written on CUDA.
// No torch headers (see common.h).
#pragma once

#include "blockwise.h"
#include "common.h"

namespace graphfp8 {

enum class BlockAct : int { kGelu, kSwiglu, kGeglu };

struct BlockActParams {
  const void* x;   // (rows, F) for gelu, (rows, 2 F) for the gated ones; dtype, contiguous
  DType dtype;     // float32, bfloat16 or float16
  BlockAct act;
  BlockOut dst;    // a's 1x128 tiles (rows, F) and, with out_t, a^T's (F, rows)
  int64_t rows;
  int64_t cols;    // F: the width of a
};

// Launchers assume csrc/ops/'s checks passed and a non-empty a.
Status block_act_cpu(const BlockActParams& p);
Status block_act_cuda(const BlockActParams& p, void* stream);

}  // namespace graphfp8
