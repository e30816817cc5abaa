// Params structs and launchers of the rotary embedding fused with the FP8 casts of q, k and v (the
// front of FP8 attention) and of its backward. No torch headers (see common.h). The rows of the
// fused QKV tensor and of the parts' own tensors: rope_layout.h.
//
// Forward, for each part p of a fused QKV tensor (q, k, v) and each element:
//   r = rotate(x) for q and k (common.h's RopeParams math, fp32, every product and sum rounded on
//       its own), x for v, or x for every part when no tables are given;
//   r is rounded to the QKV dtype (so the result equals rope_qkv followed by a cast);
//   out[p] = saturate(r * scale[p]) in FP8, amax[p] = max(amax[p], max |r|), scale_inv[p] = 1/scale.
// Backward, for each part p of the FP8 gradients (dq, dk, dv):
//   g = fp8_value * scale_inv[p] in fp32; dq and dk are rotated back (RopeParams' inverse
//   rotation), dv is not; the result is rounded once to the output dtype.
//   High-precision gradients (grad_dtype == out_dtype, no scale_inv: the bf16 attention path)
//   are read as they are: the result is rope_qkv's inverse of their concatenation, bit for bit.
#pragma once

#include <cstdint>

#include "common.h"
#include "rope_layout.h"

namespace graphfp8 {

struct RopeFp8Params {
  const void* qkv;           // (batch, seq, heads + 2 * kv_heads, head_dim), qkv_dtype
  DType qkv_dtype;           // float32, bfloat16 or float16
  const float* cos;          // (>= seq, head_dim) float32, or nullptr: no rotation
  const float* sin;          // like cos
  void* out[3];              // q (batch, seq, heads, head_dim), k and v (.., kv_heads, ..), contiguous
  DType out_dtype;           // E4M3 or E5M2
  const float* scale[3];     // (1,) each
  float* scale_inv[3];       // (1,) each: receives 1 / scale
  float* amax[3];            // (1,) each: receives max(amax, max |r|), NaN ignored
  int64_t batch;
  int64_t seq;
  int64_t heads;
  int64_t kv_heads;          // 1 <= kv_heads <= heads
  int64_t head_dim;          // even
};

struct RopeFp8BwdParams {
  const void* grad[3];       // dq (batch, seq, heads, head_dim), dk and dv (.., kv_heads, ..)
  DType grad_dtype;          // E4M3 or E5M2, or out_dtype (high precision)
  const float* scale_inv[3]; // (1,) each (FP8 gradients only)
  const float* cos;          // (>= seq, head_dim) float32, or nullptr: no rotation
  const float* sin;
  void* out;                 // dqkv: (batch, seq, heads + 2 * kv_heads, head_dim), out_dtype
  DType out_dtype;           // float32, bfloat16 or float16
  int64_t batch;
  int64_t seq;
  int64_t heads;
  int64_t kv_heads;          // 1 <= kv_heads <= heads
  int64_t head_dim;          // even
};

// Launchers assume csrc/ops/'s checks passed; a failed Status reports a launch error.
Status rope_fp8_cpu(const RopeFp8Params& p);
Status rope_fp8_bwd_cpu(const RopeFp8BwdParams& p);
Status rope_fp8_cuda(const RopeFp8Params& p, void* stream);
Status rope_fp8_bwd_cuda(const RopeFp8BwdParams& p, void* stream);

}  // namespace graphfp8
