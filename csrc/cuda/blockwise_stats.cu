// CUDA: the per-block statistics of a blockwise quantization (csrc/blockwise.h,
// BlockStatsParams). One 128-thread block per tile or block of scale_inv: thread t takes column
// t of it over its rows (1 or up to 128), in float64; the block's sums are then reduced over the
// threads in a fixed tree (shared memory), so a result is the same on every run. A block whose
// *enabled == 0 returns at once (the numerics report switched off: an empty kernel).
#include "../blockwise.h"
#include "../dtype_switch.h"
#include "fp8_util.cuh"

namespace graphfp8 {
namespace {

constexpr int kThreads = 128;
constexpr int kSums = 6;  // amax, saturated, underflow, nonzero, signal, noise

// max(m, a) where a NaN sticks (torch's amax).
__device__ __forceinline__ double nan_max(double m, double a) {
  return isnan(m) ? m : (isnan(a) || a > m ? a : m);
}

template <typename T, bool kE4M3>
__global__ void __launch_bounds__(kThreads) block_stats_kernel(BlockStatsParams p) {
  __shared__ double sums[kSums][kThreads];
  if (*p.enabled == 0.0f) return;
  const double limit = kE4M3 ? kE4M3Max : kE5M2Max;
  const int64_t col_tiles = (p.cols + kBlockTile - 1) / kBlockTile;
  const int64_t b = blockIdx.x, i = b / col_tiles, j = b % col_tiles;
  const double inv = p.scale_inv[b];
  const int64_t c = j * kBlockTile + threadIdx.x;
  const int64_t r1 = min(p.rows, (i + 1) * p.block_rows);
  double v[kSums] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
  if (c < p.cols) {
    for (int64_t r = i * p.block_rows; r < r1; ++r) {
      const double x = cuda::to_float(static_cast<const T*>(p.x)[r * p.cols + c]);
      const double q = cuda::fp8_to_float<kE4M3>(p.x_fp8[r * p.cols + c]);
      const double a = fabs(x);
      v[0] = nan_max(v[0], a);
      v[1] += a / inv > limit;
      v[2] += x != 0.0 && q == 0.0;
      v[3] += x != 0.0;
      v[4] = __dadd_rn(v[4], __dmul_rn(x, x));
      const double e = __dsub_rn(x, __dmul_rn(q, inv));
      v[5] = __dadd_rn(v[5], __dmul_rn(e, e));
    }
  }
#pragma unroll
  for (int k = 0; k < kSums; ++k) sums[k][threadIdx.x] = v[k];
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) {
      const int o = threadIdx.x + half;
      sums[0][threadIdx.x] = nan_max(sums[0][threadIdx.x], sums[0][o]);
#pragma unroll
      for (int k = 1; k < kSums; ++k) sums[k][threadIdx.x] += sums[k][o];
    }
    __syncthreads();
  }
  if (threadIdx.x < kSums) p.out[b * kBlockStatsColumns + threadIdx.x] = sums[threadIdx.x][0];
  if (threadIdx.x == 0) p.out[b * kBlockStatsColumns + kSums] = inv;
}

}  // namespace

Status block_stats_cuda(const BlockStatsParams& p, void* stream_ptr) {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  const int64_t blocks = cuda::ceil_div(p.rows, p.block_rows) * cuda::ceil_div(p.cols, kBlockTile);
  if (blocks > 0x7FFFFFFF) return Status{"block_stats", "more than 2^31 - 1 blocks"};
  GRAPHFP8_SWITCH_HP(p.x_dtype, "block_stats", T,
    GRAPHFP8_SWITCH_FP8(p.fp8_dtype, "block_stats", kE4M3,
      block_stats_kernel<T, kE4M3><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
      return cuda::check_launch("block_stats");))
  return Status{};
}

}  // namespace graphfp8
