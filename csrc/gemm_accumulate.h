// Params and launchers of the FP8 GEMM that accumulates into its output in place: the
// weight-gradient GEMM of fuse_wgrad_accumulation (fp32 main_grad) and of WGRAD_INTO_GRAD (the
// parameter's own .grad; docs/fp8.md, "Weight-gradient accumulation"). No torch headers (see
// common.h).
//
//   out (m, n) = alpha * (a * a_scale_inv) @ (b * b_scale_inv) + beta * out
//
// a (m, k) FP8 row-major; b (k, n) FP8 column-major, i.e. b_t (n, k) row-major; out (m, n)
// row-major, float32, bfloat16 or float16. alpha_beta: nullptr for alpha = beta = 1 (the host
// constants), else two float32 device scalars read by the GEMM when it runs, so that one
// captured graph serves beta = 0 and beta = 1. beta = 0 ignores out's old values (NaN
// included), as cuBLAS does. CUDA: one cuBLASLt FP8 GEMM with C = D = out, fp32 accumulation,
// the sum rounded once to out's dtype (no separate add pass). CPU: each operand element decoded
// and scaled in fp32 (torch's _scaled_mm emulation), a dot product in k order in fp32, then
// alpha * dot (+ beta * out when beta != 0) in fp32, rounded once to out's dtype.
#pragma once

#include <cstdint>

#include "common.h"

namespace graphfp8 {

struct GemmAccumulateParams {
  const uint8_t* a;           // (m, k) row-major, a_dtype
  DType a_dtype;              // kE4M3 or kE5M2
  const uint8_t* b_t;         // (n, k) row-major (b column-major), b_dtype
  DType b_dtype;              // kE4M3 or kE5M2, not both kE5M2
  const float* a_scale_inv;   // (1,)
  const float* b_scale_inv;   // (1,)
  void* out;                  // (m, n) row-major, out_dtype, read (beta != 0) and written
  DType out_dtype;            // kFloat32, kBFloat16 or kFloat16
  const float* alpha_beta;    // nullptr (alpha = beta = 1), or (2,) {alpha, beta}, the device's
  int64_t m;
  int64_t n;
  int64_t k;
  void* workspace;            // CUDA: cuBLASLt's workspace (device), nullptr on the CPU
  int64_t workspace_bytes;
};

// cuBLASLt's workspace for one call (the size TransformerEngine gives Hopper's GEMMs).
constexpr int64_t kGemmWorkspaceBytes = 32 * 1024 * 1024;

Status fp8_gemm_accumulate_cpu(const GemmAccumulateParams& p);
Status fp8_gemm_accumulate_cuda(const GemmAccumulateParams& p, void* stream);

}  // namespace graphfp8
