// LayerNorm / RMSNorm with the output quantized blockwise (docs/fp8.md, "Blockwise scaling"):
// the norm of csrc/common.h's NormParams, its output y rounded to the input dtype (the value the
// unfused path hands to the quantizer), then 1x128 tiles of y along hidden and, with out_t, of
// y^T along rows, by csrc/blockwise.h's scale rule. Bit-identical to the norm kernel's out_hp
// followed by block_quantize on the same device; no (rows, hidden) high-precision y is written
// on CUDA. No torch headers (see common.h).
#pragma once

#include "blockwise.h"
#include "common.h"

namespace graphfp8 {

struct BlockNormParams {
  const void* x;          // (rows, hidden), dtype
  const void* residual;   // (rows, hidden), dtype, or nullptr
  void* residual_out;     // (rows, hidden), dtype: z = x + residual, when residual is given
  const void* gamma;      // (hidden,), dtype
  const void* beta;       // (hidden,), dtype (LayerNorm), nullptr for RMSNorm
  DType dtype;            // float32, bfloat16 or float16
  BlockOut dst;           // y's 1x128 tiles (rows, hidden) and, with out_t, y^T's (hidden, rows)
  float* mu;              // (rows,) fp32 (LayerNorm), nullptr for RMSNorm
  float* rsigma;          // (rows,) fp32
  float* workspace;       // CUDA: 3 floats, norm_stats_params' slots
  float eps;
  bool zero_centered_gamma;
  int64_t rows;
  int64_t hidden;
};

// Launchers assume csrc/ops/'s checks passed and a non-empty x.
Status block_norm_cpu(const BlockNormParams& p);
Status block_norm_cuda(const BlockNormParams& p, void* stream);

// The norm with only mu, rsigma and residual_out written (NormParams.out == nullptr): the first
// pass of block_norm_cuda (norm_fwd.cu), and with out / out_hp set block_norm_cpu's norm. slots:
// 3 floats, the per-tensor scale, amax and scale_inv the norm kernel reads and writes (unused).
NormParams norm_stats_params(const BlockNormParams& p, float* slots);

}  // namespace graphfp8
