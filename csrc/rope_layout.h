// The row layout of a fused QKV tensor, shared by every RoPE kernel: cpu/rope.cpp, cpu/rope_fp8.cpp,
// cuda/rope.cu and both kernels of cuda/rope_fp8.cu (forward and backward). No torch headers.
//
// A fused QKV tensor (batch, seq, heads + 2 * kv_heads, head_dim) is a sequence of rows of
// head_dim elements, one per (batch, seq, head row); a token's head rows are heads q rows, then
// kv_heads k rows, then kv_heads v rows. The FP8 kernels keep each part in a tensor of its own:
// q (batch, seq, heads, head_dim), k and v (batch, seq, kv_heads, head_dim).
#pragma once

#include <cstdint>

#include "host_device.h"

namespace graphfp8 {

// Where head row j (< heads + 2 * kv_heads) of a token lives: its part, its head in that part,
// and the part's head count.
struct RopeHead {
  int part;  // 0 q, 1 k, 2 v
  int64_t head, part_heads;
};

GRAPHFP8_HOST_DEVICE RopeHead rope_head(int64_t j, int64_t heads, int64_t kv_heads) {
  if (j < heads) return {0, j, heads};
  if (j < heads + kv_heads) return {1, j - heads, kv_heads};
  return {2, j - heads - kv_heads, kv_heads};
}

// Where row r of a fused QKV tensor lives.
struct RopeRow {
  int part;             // 0 q, 1 k, 2 v
  bool rotated;         // part < 2 (q and k are rotated, v copied): for kernels without parts
  int64_t s;            // its position in the sequence: the row of the cos / sin tables
  int64_t part_offset;  // the offset of its vector in its part's own tensor
};

GRAPHFP8_HOST_DEVICE RopeRow rope_row(int64_t r, int64_t seq, int64_t heads, int64_t kv_heads,
                                      int64_t head_dim) {
  const int64_t per_token = heads + 2 * kv_heads;
  const int64_t token = r / per_token;  // batch * seq + s
  const int64_t j = r % per_token;
  const RopeHead h = rope_head(j, heads, kv_heads);
  return {h.part, j < heads + kv_heads, token % seq, (token * h.part_heads + h.head) * head_dim};
}

}  // namespace graphfp8
