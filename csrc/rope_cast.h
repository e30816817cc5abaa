// Params and launchers of RoPE's backward fused into the FP8 cast-transpose of the fused QKV
// gradient (issue 41 item 4; docs/benchmarking.md, "Kernel switches"). No
// torch headers (see common.h).
//
// From the gradients of q, k, v (rope_layout.h's parts, high precision), per element of the fused
// QKV gradient g (batch * seq, (heads + 2 * kv_heads) * head_dim):
//   g = the inverse rotation of dq, dk (rope_fp8.h's backward, fp32, rounded once to the
//       gradient's dtype), dv as it is: exactly what rope_fp8_backward writes;
//   then what cast_transpose(_dbias) does with g: out = saturate(g * scale), out_t = out^T,
//   amax = max(amax, max |g|), scale_inv = 1 / scale, dbias = the column sums of g (each device in
//   its own cast_transpose_dbias order), current scaling (CurrentScale) as the casts take it.
// g itself is never written: one read of dq, dk, dv instead of rope_fp8_backward's write of g and
// the cast's read of it. With fused.cast.out == nullptr the kernel is the cast's amax pass only
// (current scaling): it folds max |g| into fused.cast.amax and writes nothing else.
#pragma once

#include <cstdint>

#include "common.h"
#include "rope_layout.h"

namespace graphfp8 {

struct RopeCastParams {
  const void* grad[3];  // dq (batch, seq, heads, head_dim), dk, dv (.., kv_heads, ..), contiguous
  const float* cos;     // (>= seq, head_dim) float32, or nullptr: no rotation
  const float* sin;     // like cos
  int64_t batch;
  int64_t seq;
  int64_t heads;
  int64_t kv_heads;     // 1 <= kv_heads <= heads
  int64_t head_dim;     // even
  // The cast: cast.x unused (the gradients above, of cast.x_dtype), rows = batch * seq,
  // cols = (heads + 2 * kv_heads) * head_dim, act kNone, act_in nullptr, out_t required with out.
  FusedCastTransposeParams fused;
};

// Launchers assume csrc/ops/'s checks passed; a failed Status reports a launch error.
Status rope_cast_cpu(const RopeCastParams& p);
Status rope_cast_cuda(const RopeCastParams& p, void* stream);

}  // namespace graphfp8
