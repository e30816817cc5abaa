// CUDA: the blockwise FP8 quantizers (csrc/blockwise.h) in one pass over x: 1x128 tiles of x
// and, from the same read, of x^T; 128x128 blocks of x and their transpose.
//
// Grid: one 256-thread block per 128x128 region of x, with blockwise_io.cuh's tile loops: 1x128
// tiles are its phase 1 (each row's tile) and, with out_t, phase 2 (the columns' tiles from
// shared memory); 128x128 blocks first reduce the region's amax over the block, then write the
// rows from shared memory and, with out_t, the columns at the block's scale.
// Amaxes are maxima of |x|'s bit patterns (abs_bits: NaN above inf), so the integer warp
// reduction __reduce_max_sync serves and a tile holding a NaN gets scale 1, as the twin's.
#include <atomic>

#include "../blockwise.h"
#include "../dtype_switch.h"
#include "blockwise_io.cuh"
#include "fp8_util.cuh"

namespace graphfp8 {
namespace {

using namespace cuda::blockwise;  // NOLINT: the shared tile constants and I/O

template <typename T, bool kE4M3, bool kBlocks, bool kTranspose>
__global__ void __launch_bounds__(kThreads)
    block_quantize_kernel(const T* __restrict__ x, BlockOut dst, const float* noop, int64_t rows,
                          int64_t cols, bool vec_x, bool vec_out, bool vec_out_t) {
  extern __shared__ float tile[];  // [kTile][kStride]
  __shared__ uint32_t part[2][kTile];
  __shared__ uint32_t warp_amax[kWarps];
  if (noop != nullptr && *noop == 1.0f) return;
  const Region g = region(rows, cols);
  float f[kRowsPerWarp][4];
  load_rows(x, cols, g, vec_x, f);
  if constexpr (!kBlocks) {
    quantize_rows<kE4M3>(f, tile, g, dst, vec_out);
    if constexpr (kTranspose) quantize_columns<kE4M3>(tile, part, g, dst, vec_out_t);
    return;
  }
  // 128x128 blocks: the region's amax over the block, then its rows from shared memory.
  constexpr float kMax = kE4M3 ? kE4M3Max : kE5M2Max;
  uint32_t a = 0u;
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    keep_row(tile, g, i, f[i]);
#pragma unroll
    for (int k = 0; k < 4; ++k) a = max(a, abs_bits(f[i][k]));
  }
  a = warp_max(a);
  if (g.lane == 0) warp_amax[g.warp] = a;
  __syncthreads();
  a = 0u;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) a = max(a, warp_amax[w]);
  const float s = block_scale(a, kMax, dst.power_2_scale);
  if (threadIdx.x == 0) {
    dst.scale_inv[g.strip * g.col_tiles + g.col_tile] = 1.0f / s;
    if (kTranspose) dst.scale_inv_t[g.col_tile * g.row_tiles + g.strip] = 1.0f / s;
  }
  for (int r = g.warp; r < g.nr; r += kWarps) {
    const float4 v = *reinterpret_cast<const float4*>(tile + r * kStride + g.c);
    const uint8_t q[4] = {cuda::quantize<kE4M3>(v.x * s), cuda::quantize<kE4M3>(v.y * s),
                          cuda::quantize<kE4M3>(v.z * s), cuda::quantize<kE4M3>(v.w * s)};
    store4(static_cast<uint8_t*>(dst.out) + (g.r0 + r) * cols + g.c0 + g.c, q, g.valid,
           g.whole && vec_out);
  }
  if constexpr (kTranspose) write_columns<kE4M3>(tile, s, g, dst.out_t, vec_out_t);
}

template <typename T, bool kE4M3, bool kBlocks, bool kTranspose>
Status launch(const BlockQuantizeParams& p, cudaStream_t stream) {
  auto kernel = block_quantize_kernel<T, kE4M3, kBlocks, kTranspose>;
  static std::atomic<uint64_t> done{0};
  const Status st = allow_tile_smem(kernel, done, "block_quantize (shared memory)");
  if (!st.ok()) return st;
  kernel<<<region_grid(p.rows, p.cols), kThreads, kSmemBytes, stream>>>(
      static_cast<const T*>(p.x), p.dst, p.noop, p.rows, p.cols, vec_rows(p.cols, p.x),
      vec_rows(p.cols, p.dst.out), vec_columns(p.rows, p.dst.out_t));
  return cuda::check_launch("block_quantize");
}

}  // namespace

Status block_quantize_cuda(const BlockQuantizeParams& p, void* stream_ptr) {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  if (cuda::ceil_div(p.cols, kTile) > 65535) {
    return Status{"block_quantize", "more than 65535 column tiles (cols > 8388480)"};
  }
  GRAPHFP8_SWITCH_HP(p.x_dtype, "block_quantize", T,
    GRAPHFP8_SWITCH_FP8(p.dst.out_dtype, "block_quantize", kE4M3,
      GRAPHFP8_SWITCH_BOOL(p.block_rows == kBlockTile, kBlocks,
        GRAPHFP8_SWITCH_BOOL(p.dst.out_t != nullptr, kTranspose,
          return launch<T, kE4M3, kBlocks, kTranspose>(p, stream);))))
  return Status{};
}

}  // namespace graphfp8
