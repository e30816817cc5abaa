// Params and launchers of the FP8 GEMM that accumulates into an fp32 output in place: the
// weight-gradient GEMM of fuse_wgrad_accumulation (docs/fp8.md, "Weight-gradient accumulation").
// No torch headers (see common.h).
//
//   out (m, n) float32 += (a * a_scale_inv) @ (b * b_scale_inv)
//
// a (m, k) FP8 row-major; b (k, n) FP8 column-major, i.e. b_t (n, k) row-major; out (m, n)
// float32 row-major. CUDA: one cuBLASLt FP8 GEMM with C = D = out and beta = 1 (no separate
// add pass). CPU: each operand element decoded and scaled in fp32 (torch's _scaled_mm
// emulation), a dot product in k order in fp32, added to out.
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
  float* out;                 // (m, n) row-major, read and written
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
