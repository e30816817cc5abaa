// CUDA: the fused delayed-scaling update of every slot of an arena, in one launch.
//
// For each slot s with history H (column s of the (L, S) row-major amax_history) and a = H[0]:
//   if a != 0: m = max(H[1..L-1], a) and H = [0, H[2], ..., H[L-1], a]   (in place)
//   else:      m = 0, H untouched
//   amax = most_recent ? a : m
//   scale[s] = isfinite(amax) && amax > 0 ? scaled_max[s] / amax : scale[s]; inf -> FLT_MAX
//
// Grid: block (SX, TY); threadIdx.x picks a slot (SX consecutive slots: the SX floats of one
// history row are one 32-byte sector for SX = 8), threadIdx.y a lane along the history. A block
// walks the history in tiles of TY * 8 rows: each thread loads its 8 rows H[r + 1] first (all in
// flight together), the block syncs, then writes them to H[r] - the in-place shift needs only
// that one barrier per tile because a tile reads rows (base, base + T] and writes [base, base + T).
// For L <= 1024 that is a single tile. The per-slot max is then reduced over TY in shared memory.
// The grid loops over slot groups when there are more groups than blocks.
#include "../common.h"
#include "../scale_math.h"
#include "fp8_util.cuh"

namespace graphfp8 {
namespace {

constexpr int kRowsPerThread = 8;
constexpr int kMaxThreads = 1024;
constexpr int kBlocksPerSm = 32;  // one pass for up to 33k+ slots on an H200; more slots loop

// One group of blockDim.x slots starting at s0 (every thread of the block calls it).
__device__ __forceinline__ void update_slots(const ScaleUpdateParams& p, int64_t s0,
                                             float* partial) {
  const int64_t L = p.history_len;
  const int64_t S = p.num_slots;
  const int tx = threadIdx.x;
  const int ty = threadIdx.y;
  const int TY = blockDim.y;
  const int64_t s = s0 + tx;
  const bool valid = s < S;
  float* h = p.amax_history + s;
  const float a = valid ? h[0] : 0.0f;
  const bool roll = valid && a != 0.0f;
  float m = 0.0f;
  const int64_t tile = static_cast<int64_t>(TY) * kRowsPerThread;
  for (int64_t base = 0; base < L; base += tile) {
    float v[kRowsPerThread];
#pragma unroll
    for (int k = 0; k < kRowsPerThread; ++k) {
      const int64_t r = base + static_cast<int64_t>(k) * TY + ty;
      v[k] = 0.0f;
      if (roll && r < L) {
        v[k] = r < L - 1 ? h[(r + 1) * S] : a;
        m = fmaxf(m, v[k]);
      }
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kRowsPerThread; ++k) {
      const int64_t r = base + static_cast<int64_t>(k) * TY + ty;
      if (roll && r < L) h[r * S] = r > 0 ? v[k] : 0.0f;
    }
  }
  partial[ty * blockDim.x + tx] = m;
  __syncthreads();
  for (int stride = TY / 2; stride > 0; stride /= 2) {
    if (ty < stride) {
      partial[ty * blockDim.x + tx] =
          fmaxf(partial[ty * blockDim.x + tx], partial[(ty + stride) * blockDim.x + tx]);
    }
    __syncthreads();
  }
  if (ty == 0 && valid) {
    p.scale[s] = updated_scale(p.most_recent ? a : partial[tx], p.scale[s], p.scaled_max[s]);
  }
}

__global__ void __launch_bounds__(kMaxThreads) scale_update_kernel(ScaleUpdateParams p) {
  __shared__ float partial[kMaxThreads];
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t s0 = static_cast<int64_t>(blockIdx.x) * blockDim.x; s0 < p.num_slots; s0 += step) {
    update_slots(p, s0, partial);
    __syncthreads();  // the next group reuses `partial`
  }
}

int pow2_at_least(int64_t n) {
  int p = 1;
  while (p < n) p *= 2;
  return p;
}

}  // namespace

Status scale_update_cuda(const ScaleUpdateParams& p, void* stream_ptr) {
  // TY lanes cover the history in one tile when L <= 128 * 8; SX fills the block up to 256
  // threads for short histories, never below 8 (one sector per history row).
  const int64_t lanes = (p.history_len + kRowsPerThread - 1) / kRowsPerThread;
  const int ty = pow2_at_least(lanes < 128 ? lanes : 128);
  int sx = 256 / ty < 8 ? 8 : 256 / ty;
  const int slots_p2 = pow2_at_least(p.num_slots);
  if (sx > slots_p2) sx = slots_p2 < 8 ? 8 : slots_p2;
  const dim3 block(sx, ty);
  const int grid = cuda::grid_size(cuda::ceil_div(p.num_slots, sx), kBlocksPerSm);
  scale_update_kernel<<<grid, block, 0, static_cast<cudaStream_t>(stream_ptr)>>>(p);
  return cuda::check_launch("scale_update_kernel");
}

}  // namespace graphfp8
