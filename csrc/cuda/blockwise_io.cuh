// The tile constants, element I/O and tile loops of the blockwise CUDA kernels (blockwise.cu,
// blockwise_norm.cu, blockwise_act.cu): a 256-thread block per 128x128 region of a (rows, cols)
// tensor, each lane four consecutive columns.
//
// Phase 1 (load_rows, quantize_rows): warp w holds rows w, w + 8, ... of the region (all of its
// loads issued before any is used), keeps their values as floats in shared memory and writes
// each row's 1x128 tile: the warp's amax (an integer max of abs_bits), its scale_inv and one
// 4-byte store per lane. Phase 2 (quantize_columns, write_columns): thread (column c = tid % 128,
// half h = tid / 128) reads 64 rows of its column from shared memory (conflict-free: a warp reads
// 32 consecutive floats), the halves combine their amax, and each thread writes its 64 bytes of
// out_t's row c with 16-byte stores: the transpose's 1x128 tiles along the rows.
#pragma once

#include <atomic>
#include <cstdint>

#include "../blockwise.h"
#include "fp8_util.cuh"

namespace graphfp8::cuda::blockwise {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / cuda::kWarpSize;
constexpr int kTile = static_cast<int>(kBlockTile);
constexpr int kRowsPerWarp = kTile / kWarps;
constexpr int kStride = kTile + 4;  // shared row stride in floats: 16-byte rows, float4 stores
constexpr int kSmemBytes = kTile * kStride * static_cast<int>(sizeof(float));

// Four consecutive elements at p as floats; whole: all four exist and p is aligned for one load.
template <typename T>
__device__ __forceinline__ void load4(const T* p, int valid, bool whole, float (&f)[4]) {
  if (whole) {
    if constexpr (sizeof(T) == 4) {
      const float4 v = __ldg(reinterpret_cast<const float4*>(p));
      f[0] = v.x, f[1] = v.y, f[2] = v.z, f[3] = v.w;
    } else {
      const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
      const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
      for (int k = 0; k < 4; ++k) f[k] = cuda::to_float(e[k]);
    }
    return;
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) f[k] = k < valid ? cuda::to_float(p[k]) : 0.0f;
}

// Four FP8 bytes to dst (4-byte aligned when whole), the first `valid` of them otherwise.
__device__ __forceinline__ void store4(uint8_t* dst, const uint8_t (&q)[4], int valid, bool whole) {
  if (whole) {
    *reinterpret_cast<uint32_t*>(dst) = static_cast<uint32_t>(q[0]) | (uint32_t(q[1]) << 8) |
                                        (uint32_t(q[2]) << 16) | (uint32_t(q[3]) << 24);
    return;
  }
  for (int k = 0; k < valid; ++k) dst[k] = q[k];
}

__device__ __forceinline__ uint4 pack16(const uint8_t (&q)[16]) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    w[i] = uint32_t(q[4 * i]) | (uint32_t(q[4 * i + 1]) << 8) | (uint32_t(q[4 * i + 2]) << 16) |
           (uint32_t(q[4 * i + 3]) << 24);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ uint32_t warp_max(uint32_t v) {
  return __reduce_max_sync(0xffffffffu, v);
}

// The block's region of a (rows, cols) tensor (blockIdx.x its 128-row strip, blockIdx.y its
// 128-column tile) and the thread's place in it: rows warp + i * kWarps, columns c .. c + 3.
struct Region {
  int64_t rows, cols, strip, col_tile, r0, c0, row_tiles, col_tiles;
  int nr, nc;      // the region's rows and columns (fewer than 128 in a partial last tile)
  int warp, lane;
  int c, valid;    // the thread's first column and how many of its four exist
  bool whole;      // nc == 128
};

__device__ __forceinline__ Region region(int64_t rows, int64_t cols) {
  Region g;
  g.rows = rows, g.cols = cols, g.strip = blockIdx.x, g.col_tile = blockIdx.y;
  g.r0 = g.strip * kTile, g.c0 = g.col_tile * kTile;
  g.row_tiles = (rows + kTile - 1) / kTile, g.col_tiles = (cols + kTile - 1) / kTile;
  g.nr = static_cast<int>(rows - g.r0 < kTile ? rows - g.r0 : kTile);
  g.nc = static_cast<int>(cols - g.c0 < kTile ? cols - g.c0 : kTile);
  g.warp = threadIdx.x / cuda::kWarpSize, g.lane = threadIdx.x % cuda::kWarpSize;
  g.c = g.lane * 4, g.valid = max(0, min(4, g.nc - g.c));
  g.whole = g.nc == kTile;
  return g;
}

// Phase 1's loads: the thread's four columns of its rows of the region of x, whose rows are `ld`
// elements apart (zeros outside the region); vec: whole rows may be read with one vector load.
template <typename T>
__device__ __forceinline__ void load_rows(const T* x, int64_t ld, const Region& g, bool vec,
                                          float (&f)[kRowsPerWarp][4]) {
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int r = g.warp + i * kWarps;
#pragma unroll
    for (int k = 0; k < 4; ++k) f[i][k] = 0.0f;
    if (r < g.nr) load4(x + (g.r0 + r) * ld + g.c0 + g.c, g.valid, g.whole && vec, f[i]);
  }
}

// The thread's values of row i of its rows, as shared tile row r (for phase 2 or a block scale).
__device__ __forceinline__ void keep_row(float* tile, const Region& g, int i, const float (&f)[4]) {
  const int r = g.warp + i * kWarps;
  *reinterpret_cast<float4*>(tile + r * kStride + g.c) = make_float4(f[0], f[1], f[2], f[3]);
}

// Phase 1 for 1x128 tiles: keeps the values (zeros outside the region) in the shared tile and
// writes each row's tile of dst.out and its scale_inv; vec_out: 4-byte stores on whole rows.
template <bool kE4M3>
__device__ __forceinline__ void quantize_rows(const float (&f)[kRowsPerWarp][4], float* tile,
                                              const Region& g, const BlockOut& dst,
                                              bool vec_out) {
  constexpr float kMax = kE4M3 ? kE4M3Max : kE5M2Max;
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    keep_row(tile, g, i, f[i]);
    const int r = g.warp + i * kWarps;  // the same for the whole warp
    if (r >= g.nr) continue;
    uint32_t a = 0u;
#pragma unroll
    for (int k = 0; k < 4; ++k) a = max(a, abs_bits(f[i][k]));
    const float s = block_scale(warp_max(a), kMax, dst.power_2_scale);
    if (g.lane == 0) dst.scale_inv[(g.r0 + r) * g.col_tiles + g.col_tile] = 1.0f / s;
    uint8_t q[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) q[k] = cuda::quantize<kE4M3>(f[i][k] * s);
    store4(static_cast<uint8_t*>(dst.out) + (g.r0 + r) * g.cols + g.c0 + g.c, q, g.valid,
           g.whole && vec_out);
  }
}

// Phase 2's stores: the thread's column of the shared tile scaled by s as its 64 bytes of
// out_t's row c0 + tc (16-byte stores when every row exists and vec_out_t).
template <bool kE4M3>
__device__ __forceinline__ void write_columns(const float* tile, float s, const Region& g,
                                              void* out_t, bool vec_out_t) {
  const int tc = threadIdx.x % kTile, h0 = (threadIdx.x / kTile) * (kTile / 2);
  if (tc >= g.nc) return;
  uint8_t* dst = static_cast<uint8_t*>(out_t) + (g.c0 + tc) * g.rows + g.r0 + h0;
  const int n = max(0, min(kTile / 2, g.nr - h0));
  const bool vec = g.nr == kTile && vec_out_t;
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

// Phase 2 for 1x128 tiles (after quantize_rows, by every thread of the block): the columns'
// amaxes from the shared tile, their scale_inv_t and out_t's bytes. part: shared scratch.
template <bool kE4M3>
__device__ __forceinline__ void quantize_columns(const float* tile, uint32_t (&part)[2][kTile],
                                                 const Region& g, const BlockOut& dst,
                                                 bool vec_out_t) {
  constexpr float kMax = kE4M3 ? kE4M3Max : kE5M2Max;
  __syncthreads();
  const int tc = threadIdx.x % kTile, half = threadIdx.x / kTile, h0 = half * (kTile / 2);
  uint32_t a = 0u;
  for (int i = 0; i < kTile / 2; ++i) a = max(a, abs_bits(tile[(h0 + i) * kStride + tc]));
  part[half][tc] = a;
  __syncthreads();
  const float s = block_scale(max(part[0][tc], part[1][tc]), kMax, dst.power_2_scale);
  if (half == 0 && tc < g.nc) dst.scale_inv_t[(g.c0 + tc) * g.row_tiles + g.strip] = 1.0f / s;
  write_columns<kE4M3>(tile, s, g, dst.out_t, vec_out_t);
}

// Whether a (rows, cols) tensor at p takes phase 1's 4-byte stores / loads (rows of 4-aligned
// width, 16-byte aligned base) and out_t phase 2's 16-byte stores.
inline bool vec_rows(int64_t cols, const void* p) { return cols % 4 == 0 && cuda::aligned16(p); }
inline bool vec_columns(int64_t rows, const void* out_t) {
  return out_t != nullptr && rows % 16 == 0 && cuda::aligned16(out_t);
}

// Raises `kernel`'s dynamic shared-memory limit to kSmemBytes once per device (devices < 64;
// `done`: the caller's static bits), so that no attribute call runs inside a later capture.
template <typename Kernel>
Status allow_tile_smem(Kernel kernel, std::atomic<uint64_t>& done, const char* what) {
  int device = 0;
  cudaGetDevice(&device);
  const uint64_t bit = uint64_t{1} << (device & 63);
  if (done.load() & bit) return Status{};
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (err != cudaSuccess) return Status{what, cudaGetErrorString(err)};
  done.fetch_or(bit);
  return Status{};
}

// The grid of 128x128 regions of a (rows, cols) tensor.
inline dim3 region_grid(int64_t rows, int64_t cols) {
  return dim3(static_cast<unsigned>(cuda::ceil_div(rows, kTile)),
              static_cast<unsigned>(cuda::ceil_div(cols, kTile)));
}

}  // namespace graphfp8::cuda::blockwise
