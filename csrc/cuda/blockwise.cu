// CUDA: the blockwise FP8 quantizers (csrc/blockwise.h) in one pass over x: 1x128 tiles of x
// and, from the same read, of x^T; 128x128 blocks of x and their transpose.
//
// Grid: one 256-thread block per 128x128 region of x (blockIdx.x its 128-row strip, blockIdx.y
// its 128-column tile). Phase 1: warp w loads rows w, w + 8, ... of the region (all 16 loads
// issued before any is used), each lane four consecutive columns (one 16- or 8-byte load when
// the row is whole and aligned, else bounds-checked elements), keeps them as floats in shared
// memory and, for 1x128 tiles, reduces each row's amax over the warp, then writes the row's FP8
// bytes (one 4-byte store per lane) and its scale_inv. 128x128 blocks first reduce the region's
// amax over the block and then write the rows from shared memory. Phase 2 (out_t): thread (column c = tid % 128, half h = tid / 128) reads 64
// rows of its column from shared memory (conflict-free: a warp reads 32 consecutive floats), the
// two halves combine their amax through shared memory (tiles; blocks reuse the block's scale),
// and each thread writes its 64 bytes of out_t's row c with 16-byte stores.
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
    block_quantize_kernel(const T* __restrict__ x, uint8_t* __restrict__ out,
                          float* __restrict__ scale_inv, uint8_t* __restrict__ out_t,
                          float* __restrict__ scale_inv_t, const float* noop, int64_t rows,
                          int64_t cols, bool power_2_scale, bool vec_x, bool vec_out,
                          bool vec_out_t) {
  extern __shared__ float tile[];  // [kTile][kStride]
  __shared__ uint32_t part[2][kTile];
  __shared__ uint32_t warp_amax[kWarps];
  if (noop != nullptr && *noop == 1.0f) return;
  constexpr float kMax = kE4M3 ? kE4M3Max : kE5M2Max;
  const int64_t strip = blockIdx.x, col_tile = blockIdx.y;
  const int64_t r0 = strip * kTile, c0 = col_tile * kTile;
  const int nr = static_cast<int>(rows - r0 < kTile ? rows - r0 : kTile);
  const int nc = static_cast<int>(cols - c0 < kTile ? cols - c0 : kTile);
  const int64_t row_tiles = (rows + kTile - 1) / kTile, col_tiles = (cols + kTile - 1) / kTile;
  const int warp = threadIdx.x / cuda::kWarpSize, lane = threadIdx.x % cuda::kWarpSize;
  const int c = lane * 4, valid = max(0, min(4, nc - c));
  const bool whole = nc == kTile;
  uint32_t block_amax = 0u;
  // Phase 1: the rows, all of a warp's loads in flight before any is used.
  constexpr int kRowsPerWarp = kTile / kWarps;
  float f[kRowsPerWarp][4];
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int r = warp + i * kWarps;
#pragma unroll
    for (int k = 0; k < 4; ++k) f[i][k] = 0.0f;
    if (r < nr) load4(x + (r0 + r) * cols + c0 + c, valid, whole && vec_x, f[i]);
  }
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int r = warp + i * kWarps;
    *reinterpret_cast<float4*>(tile + r * kStride + c) =
        make_float4(f[i][0], f[i][1], f[i][2], f[i][3]);
    uint32_t a = 0u;
#pragma unroll
    for (int k = 0; k < 4; ++k) a = max(a, abs_bits(f[i][k]));
    if constexpr (kBlocks) {
      block_amax = max(block_amax, a);
    } else if (r < nr) {
      const float s = block_scale(warp_max(a), kMax, power_2_scale);
      if (lane == 0) scale_inv[(r0 + r) * col_tiles + col_tile] = 1.0f / s;
      uint8_t q[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) q[k] = cuda::quantize<kE4M3>(f[i][k] * s);
      store4(out + (r0 + r) * cols + c0 + c, q, valid, whole && vec_out);
    }
  }
  float block_s = 1.0f;
  if constexpr (kBlocks) {
    block_amax = warp_max(block_amax);
    if (lane == 0) warp_amax[warp] = block_amax;
  }
  __syncthreads();
  if constexpr (kBlocks) {
    uint32_t a = 0u;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) a = max(a, warp_amax[w]);
    block_s = block_scale(a, kMax, power_2_scale);
    if (threadIdx.x == 0) {
      scale_inv[strip * col_tiles + col_tile] = 1.0f / block_s;
      if (kTranspose) scale_inv_t[col_tile * row_tiles + strip] = 1.0f / block_s;
    }
    for (int r = warp; r < nr; r += kWarps) {
      const float4 v = *reinterpret_cast<const float4*>(tile + r * kStride + c);
      const uint8_t q[4] = {cuda::quantize<kE4M3>(v.x * block_s),
                            cuda::quantize<kE4M3>(v.y * block_s),
                            cuda::quantize<kE4M3>(v.z * block_s),
                            cuda::quantize<kE4M3>(v.w * block_s)};
      store4(out + (r0 + r) * cols + c0 + c, q, valid, whole && vec_out);
    }
  }
  if constexpr (!kTranspose) return;
  // Phase 2: the columns, as rows of out_t.
  const int tc = threadIdx.x % kTile, half = threadIdx.x / kTile, h0 = half * (kTile / 2);
  float s = block_s;
  if constexpr (!kBlocks) {
    uint32_t a = 0u;
    for (int i = 0; i < kTile / 2; ++i) a = max(a, abs_bits(tile[(h0 + i) * kStride + tc]));
    part[half][tc] = a;
    __syncthreads();
    s = block_scale(max(part[0][tc], part[1][tc]), kMax, power_2_scale);
    if (half == 0 && tc < nc) scale_inv_t[(c0 + tc) * row_tiles + strip] = 1.0f / s;
  }
  if (tc >= nc) return;
  uint8_t* dst = out_t + (c0 + tc) * rows + r0 + h0;
  const int n = max(0, min(kTile / 2, nr - h0));
  const bool vec = nr == kTile && vec_out_t;
  for (int i0 = 0; i0 < kTile / 2; i0 += 16) {
    uint8_t q[16];
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      q[k] = cuda::quantize<kE4M3>(tile[(h0 + i0 + k) * kStride + tc] * s);
    }
    if (vec) {
      *reinterpret_cast<uint4*>(dst + i0) = pack16(q);
    } else {
      for (int k = 0; k < 16 && i0 + k < n; ++k) dst[i0 + k] = q[k];
    }
  }
}

template <typename T, bool kE4M3, bool kBlocks, bool kTranspose>
Status launch(const BlockQuantizeParams& p, cudaStream_t stream) {
  // The shared-memory limit is set once per device and kernel (devices < 64).
  auto kernel = block_quantize_kernel<T, kE4M3, kBlocks, kTranspose>;
  static std::atomic<uint64_t> done{0};
  int device = 0;
  cudaGetDevice(&device);
  const uint64_t bit = uint64_t{1} << (device & 63);
  if (!(done.load() & bit)) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
    if (err != cudaSuccess) return Status{"block_quantize (shared memory)", cudaGetErrorString(err)};
    done.fetch_or(bit);
  }
  const dim3 grid(static_cast<unsigned>(cuda::ceil_div(p.rows, kTile)),
                  static_cast<unsigned>(cuda::ceil_div(p.cols, kTile)));
  const bool vec_x = p.cols % 4 == 0 && cuda::aligned16(p.x);
  const bool vec_out = p.cols % 4 == 0 && cuda::aligned16(p.out);
  const bool vec_out_t = p.out_t != nullptr && p.rows % 16 == 0 && cuda::aligned16(p.out_t);
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(
      static_cast<const T*>(p.x), static_cast<uint8_t*>(p.out), p.scale_inv,
      static_cast<uint8_t*>(p.out_t), p.scale_inv_t, p.noop, p.rows, p.cols, p.power_2_scale,
      vec_x, vec_out, vec_out_t);
  return cuda::check_launch("block_quantize");
}

}  // namespace

Status block_quantize_cuda(const BlockQuantizeParams& p, void* stream_ptr) {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  if (cuda::ceil_div(p.cols, kTile) > 65535) {
    return Status{"block_quantize", "more than 65535 column tiles (cols > 8388480)"};
  }
  GRAPHFP8_SWITCH_HP(p.x_dtype, "block_quantize", T,
    GRAPHFP8_SWITCH_FP8(p.out_dtype, "block_quantize", kE4M3,
      GRAPHFP8_SWITCH_BOOL(p.block_rows == kBlockTile, kBlocks,
        GRAPHFP8_SWITCH_BOOL(p.out_t != nullptr, kTranspose,
          return launch<T, kE4M3, kBlocks, kTranspose>(p, stream);))))
  return Status{};
}

}  // namespace graphfp8
