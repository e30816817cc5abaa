// CUDA: blockwise_quantize's 1x128 tiles of a 16-bit x and of x^T with the next tile staged in
// shared memory by cp.async while one is quantized (kernel switch BLOCK_QUANTIZE_STAGED,
// docs/benchmarking.md): the bytes of block_quantize_kernel (blockwise.cu), whose module comment
// has the tile layout and amax rules, for rows of a width that is a multiple of 8 and x, out
// 16-byte aligned; blockwise.cu takes every other case.
//
// Grid: about as many 256-thread blocks as fit on the GPU at once (three per SM: 64 KB of shared
// memory each); block b quantizes the 128x128 regions b, b + gridDim.x, ... of x (region k: strip
// k % row_tiles, column tile k / row_tiles), every block the same number of them give or take
// one. Each region is copied into one of two shared buffers with 16-byte cp.async (zero-filled
// past x), the next region's copy issued as soon as the current one has landed, so one region per
// block is always in flight while the block quantizes (notes/PERF.md, "the staged kernel").
// The buffers keep blockwise.cu's swizzle: 16-byte chunk h of row r at h ^ (r / 16 % 8), which
// leaves its 2-element units at blockwise.cu's places.
// Phase 1: warp w takes rows w, w + 8, ..., each lane four columns (one 8-byte shared read); the
// row amax is a 16-bit integer max of |x|'s bits (abs bits order as the floats do, NaN above inf)
// reduced over the warp; lane j of a batch of 8 rows computes row j's scale and scale_inv, and
// the others take it by shuffle, so each lane divides once per 8 rows. The lanes' column maxima
// meet in shared memory as in blockwise.cu; phase 2 is its phase 2 on the staged buffer.
// A tile without NaN skips quantize4's NaN rewrite (satfinite converts of finite or infinite
// products never give a NaN code): the same bytes.
#pragma once

#include <atomic>
#include <cstdint>
#include <type_traits>

#include "../blockwise.h"
#include "blockwise_io.cuh"
#include "fp8_util.cuh"

namespace graphfp8::cuda::staged {

using blockwise::kThreads;
using blockwise::kTile;
using blockwise::kWarps;

constexpr int kBlocksPerSm = 3;
constexpr int kTileWords = kTile * kTile / 2;  // 16-bit elements, two per word
constexpr int kSmemBytes = 2 * kTileWords * 4;
constexpr int kBatch = 8;                       // rows per scale batch in phase 1
constexpr uint32_t kAbs2 = 0x7FFF7FFFu;

// cp.async of 16 bytes into shared memory, zeros when !valid (src is then not read); before
// sm_80, a plain copy: the same values, nothing in flight.
__device__ __forceinline__ void copy16(uint32_t* dst, const void* src, bool valid) {
#if __CUDA_ARCH__ >= 800
  const auto d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(n)
               : "memory");
#else
  *reinterpret_cast<uint4*>(dst) = valid ? *static_cast<const uint4*>(src) : make_uint4(0, 0, 0, 0);
#endif
}
__device__ __forceinline__ void commit() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_all() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
#endif
}

// Halfword-wise unsigned max of two words.
__device__ __forceinline__ uint32_t max2(uint32_t a, uint32_t b) {
#if __CUDA_ARCH__ >= 900
  uint32_t r;
  asm("max.u16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
#else
  return __vmaxu2(a, b);
#endif
}

// Element 0 (low half) or 1 of a word of two 16-bit elements, as a float.
template <typename T, int kHalf>
__device__ __forceinline__ float elem(uint32_t w) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __uint_as_float(kHalf == 0 ? w << 16 : w & 0xFFFF0000u);
  }
  return __half2float(__ushort_as_half(static_cast<unsigned short>(w >> (16 * kHalf))));
}

// abs_bits of the float of the largest |x| of a tile given as its 16-bit abs bits m.
template <typename T>
__device__ __forceinline__ uint32_t amax_bits(uint32_t m) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return m << 16;
  return abs_bits(__half2float(__ushort_as_half(static_cast<unsigned short>(m))));
}

// quantize4's bytes; its NaN rewrite only when the tile holds a NaN (module comment).
template <bool kE4M3>
__device__ __forceinline__ uint32_t quantize4_tile(float a, float b, float c, float d, bool nan) {
  if (nan) return cuda::quantize4<kE4M3>(a, b, c, d);
  uint16_t lo, hi;
  if constexpr (kE4M3) {
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b), "f"(a));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d), "f"(c));
  } else {
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b), "f"(a));
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d), "f"(c));
  }
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}

// Word offset of 2-element unit u of row r in a staged buffer (blockwise.cu's unit_word).
__device__ __forceinline__ int unit(int r, int u) {
  return r * (kTile / 2) + (u ^ (((r >> 4) & 7) << 2));
}

// One 128x128 region of x (row-major, `cols` wide) and what the block writes of it.
struct Region {
  int64_t strip, col_tile, r0, c0;
  int nr, nc;  // rows and columns it has (fewer in a partial last tile)
};

__device__ __forceinline__ Region region(int64_t k, int64_t rows, int64_t cols, int64_t row_tiles) {
  Region g;
  g.strip = k % row_tiles, g.col_tile = k / row_tiles;
  g.r0 = g.strip * kTile, g.c0 = g.col_tile * kTile;
  g.nr = static_cast<int>(rows - g.r0 < kTile ? rows - g.r0 : kTile);
  g.nc = static_cast<int>(cols - g.c0 < kTile ? cols - g.c0 : kTile);
  return g;
}

// Issues the copies of region g into buf (this thread's 8 chunks: two rows per warp and copy).
template <typename T>
__device__ __forceinline__ void stage(const T* x, int64_t cols, const Region& g, uint32_t* buf) {
#pragma unroll
  for (int i = 0; i < kTile * kTile / 8 / kThreads; ++i) {
    const int q = threadIdx.x + i * kThreads, r = q / 16, h = q % 16;
    const bool valid = r < g.nr && 8 * h < g.nc;
    const T* src = valid ? x + (g.r0 + r) * cols + g.c0 + 8 * h : x;
    copy16(buf + r * (kTile / 2) + ((h ^ ((r >> 4) & 7)) << 2), src, valid);
  }
  commit();
}

// Phase 1 on the staged region: rows' tiles of out and scale_inv, the lane's column maxima
// (16-bit abs bits, two per word) into part[warp][lane].
template <typename T, bool kE4M3>
__device__ __forceinline__ void quantize_rows(const uint32_t* buf, const Region& g, int64_t cols,
                                              int64_t col_tiles, uint8_t* out, float* scale_inv,
                                              bool power_2_scale, uint2 (*part)[32]) {
  constexpr float kMax = kE4M3 ? kE4M3Max : kE5M2Max;
  const int warp = threadIdx.x / cuda::kWarpSize, lane = threadIdx.x % cuda::kWarpSize;
  const bool has_cols = 4 * lane < g.nc;  // nc is a multiple of 8: all four or none
  uint32_t col0 = 0u, col1 = 0u;
#pragma unroll 1  // unrolled, ptxas hoists both batches' reads: 98 registers, not 76
  for (int b = 0; b < kTile / kWarps; b += kBatch) {
    uint2 v[kBatch];
    uint32_t m[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int r = warp + (b + k) * kWarps;
      v[k] = *reinterpret_cast<const uint2*>(buf + unit(r, 2 * lane));
      const uint32_t a0 = v[k].x & kAbs2, a1 = v[k].y & kAbs2, a = max2(a0, a1);
      col0 = max2(col0, a0), col1 = max2(col1, a1);
      m[k] = blockwise::warp_max(max(a & 0xFFFFu, a >> 16));
    }
    uint32_t mine = m[0];  // lane j's row of the batch: j = lane % kBatch
#pragma unroll
    for (int k = 1; k < kBatch; ++k) mine = lane % kBatch == k ? m[k] : mine;
    const float s_mine = block_scale(amax_bits<T>(mine), kMax, power_2_scale);
    const int r_mine = warp + (b + lane % kBatch) * kWarps;
    if (lane < kBatch && r_mine < g.nr) {
      scale_inv[(g.r0 + r_mine) * col_tiles + g.col_tile] = 1.0f / s_mine;
    }
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int r = warp + (b + k) * kWarps;
      const float s = __shfl_sync(0xFFFFFFFFu, s_mine, k);
      if (r >= g.nr || !has_cols) continue;
      const bool nan = amax_bits<T>(m[k]) > 0x7F800000u;
      const uint32_t q = quantize4_tile<kE4M3>(elem<T, 0>(v[k].x) * s, elem<T, 1>(v[k].x) * s,
                                               elem<T, 0>(v[k].y) * s, elem<T, 1>(v[k].y) * s, nan);
      *reinterpret_cast<uint32_t*>(out + (g.r0 + r) * cols + g.c0 + 4 * lane) = q;
    }
  }
  part[warp][lane] = make_uint2(col0, col1);
}

// The column tiles' scales from the warps' maxima (threads < 128, one column each): col_s,
// col_nan and scale_inv_t.
template <typename T, bool kE4M3>
__device__ __forceinline__ void column_scales(const uint2 (*part)[32], const Region& g,
                                              int64_t row_tiles, float* scale_inv_t,
                                              bool power_2_scale, float* col_s, bool* col_nan) {
  constexpr float kMax = kE4M3 ? kE4M3Max : kE5M2Max;
  const int tc = threadIdx.x;
  if (tc >= kTile) return;
  uint32_t m = 0u;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    const uint2 p = part[w][tc / 4];
    m = max(m, ((tc / 2) % 2 ? p.y : p.x) >> (16 * (tc % 2)) & 0xFFFFu);
  }
  const uint32_t bits = amax_bits<T>(m);
  const float s = block_scale(bits, kMax, power_2_scale);
  col_s[tc] = s;
  col_nan[tc] = bits > 0x7F800000u;
  if (tc < g.nc) scale_inv_t[(g.c0 + tc) * row_tiles + g.strip] = 1.0f / s;
}

// Phase 2 on the staged region: blockwise.cu's phase 2 (thread (j = lane % 8, column pair p)
// writes rows 16j..16j+15 of columns 2p, 2p + 1 as 16 bytes of out_t's two rows).
template <typename T, bool kE4M3>
__device__ __forceinline__ void quantize_columns(const uint32_t* buf, const Region& g,
                                                 int64_t rows, uint8_t* out_t, bool vec_out_t,
                                                 const float* col_s, const bool* col_nan) {
  const int warp = threadIdx.x / cuda::kWarpSize, lane = threadIdx.x % cuda::kWarpSize;
  const int j = lane % 8, h0 = 16 * j, n = g.nr - h0;
  const bool vec = g.nr == kTile && vec_out_t;
  if (n <= 0) return;
#pragma unroll
  for (int it = 0; it < 2; ++it) {
    const int pair = it * (kTile / 4) + warp * 4 + lane / 8, tc = 2 * pair;
    if (tc >= g.nc) continue;  // nc is even: column tc + 1 exists too
    const float s0 = col_s[tc], s1 = col_s[tc + 1];
    const bool nan = col_nan[tc] || col_nan[tc + 1];
    uint32_t q0[4], q1[4];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      uint32_t u[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) u[k] = buf[unit(h0 + 4 * m + k, pair)];
      q0[m] = quantize4_tile<kE4M3>(elem<T, 0>(u[0]) * s0, elem<T, 0>(u[1]) * s0,
                                    elem<T, 0>(u[2]) * s0, elem<T, 0>(u[3]) * s0, nan);
      q1[m] = quantize4_tile<kE4M3>(elem<T, 1>(u[0]) * s1, elem<T, 1>(u[1]) * s1,
                                    elem<T, 1>(u[2]) * s1, elem<T, 1>(u[3]) * s1, nan);
    }
    uint8_t* dst = out_t + (g.c0 + tc) * rows + g.r0 + h0;
    if (vec) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(q0[0], q0[1], q0[2], q0[3]);
      *reinterpret_cast<uint4*>(dst + rows) = make_uint4(q1[0], q1[1], q1[2], q1[3]);
      continue;
    }
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const int valid = min(4, max(0, n - 4 * m));
      for (int k = 0; k < valid; ++k) {
        dst[4 * m + k] = static_cast<uint8_t>(q0[m] >> (8 * k));
        dst[rows + 4 * m + k] = static_cast<uint8_t>(q1[m] >> (8 * k));
      }
    }
  }
}

// x: (rows, cols) bf16 or fp16, cols % 8 == 0, x and out 16-byte aligned; out (rows, cols) and
// out_t (cols, rows) FP8; scale_inv (rows, col_tiles), scale_inv_t (cols, row_tiles) float32.
template <typename T, bool kE4M3>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    staged_quantize_kernel(const T* __restrict__ x, uint8_t* __restrict__ out,
                           float* __restrict__ scale_inv, uint8_t* __restrict__ out_t,
                           float* __restrict__ scale_inv_t, const float* noop, int64_t rows,
                           int64_t cols, bool power_2_scale, bool vec_out_t) {
  extern __shared__ uint4 staged_smem[];  // two buffers of kTileWords words
  __shared__ uint2 part[kWarps][32];
  __shared__ float col_s[kTile];
  __shared__ bool col_nan[kTile];
  if (noop != nullptr && *noop == 1.0f) return;
  uint32_t* bufs = reinterpret_cast<uint32_t*>(staged_smem);
  const int64_t row_tiles = (rows + kTile - 1) / kTile, col_tiles = (cols + kTile - 1) / kTile;
  const int64_t tiles = row_tiles * col_tiles;
  int64_t k = blockIdx.x;
  if (k >= tiles) return;
  stage(x, cols, region(k, rows, cols, row_tiles), bufs);
  for (int b = 0; k < tiles; k += gridDim.x, b ^= 1) {
    wait_all();
    __syncthreads();  // region k landed; every thread is past the last reads of the other buffer
    if (k + gridDim.x < tiles) {
      stage(x, cols, region(k + gridDim.x, rows, cols, row_tiles), bufs + (b ^ 1) * kTileWords);
    }
    const Region here = region(k, rows, cols, row_tiles);
    const uint32_t* buf = bufs + b * kTileWords;
    quantize_rows<T, kE4M3>(buf, here, cols, col_tiles, out, scale_inv, power_2_scale, part);
    __syncthreads();
    column_scales<T, kE4M3>(part, here, row_tiles, scale_inv_t, power_2_scale, col_s, col_nan);
    __syncthreads();
    quantize_columns<T, kE4M3>(buf, here, rows, out_t, vec_out_t, col_s, col_nan);
  }
}

// Whether the staged kernel takes p: 16-bit x, 1x128 tiles with x^T's, rows a multiple of 8
// wide, x and out 16-byte aligned.
inline bool applies(const BlockQuantizeParams& p) {
  return p.staged && p.x_dtype != DType::kFloat32 && p.block_rows == 1 &&
         p.dst.out_t != nullptr && p.cols % 8 == 0 && cuda::aligned16(p.x) &&
         cuda::aligned16(p.dst.out);
}

// Launches the kernel on ceil(tiles / rounds) blocks, rounds = ceil(tiles / the blocks that fit
// on the device at once); the shared-memory limit and that count are set once per device
// (devices < 64), so that no attribute call runs inside a later capture.
template <typename T, bool kE4M3>
Status launch(const BlockQuantizeParams& p, cudaStream_t stream) {
  auto kernel = staged_quantize_kernel<T, kE4M3>;
  static std::atomic<uint64_t> done{0};
  static std::atomic<int> slots[64];
  int device = 0;
  cudaGetDevice(&device);
  const uint64_t bit = uint64_t{1} << (device & 63);
  if (!(done.load() & bit)) {
    cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
    int sms = 0, per_sm = 0;
    if (err == cudaSuccess) {
      err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    }
    if (err == cudaSuccess) {
      err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, kSmemBytes);
    }
    if (err != cudaSuccess) return Status{"block_quantize (staged)", cudaGetErrorString(err)};
    slots[device & 63] = sms * per_sm > 0 ? sms * per_sm : 1;
    done.fetch_or(bit);
  }
  const int64_t tiles = cuda::ceil_div(p.rows, kTile) * cuda::ceil_div(p.cols, kTile);
  const int64_t rounds = cuda::ceil_div(tiles, slots[device & 63].load());
  const BlockOut& d = p.dst;
  kernel<<<static_cast<unsigned>(cuda::ceil_div(tiles, rounds)), kThreads, kSmemBytes, stream>>>(
      static_cast<const T*>(p.x), static_cast<uint8_t*>(d.out), d.scale_inv,
      static_cast<uint8_t*>(d.out_t), d.scale_inv_t, p.noop, p.rows, p.cols, d.power_2_scale,
      p.rows % 16 == 0 && cuda::aligned16(d.out_t));
  return cuda::check_launch("block_quantize (staged)");
}

}  // namespace graphfp8::cuda::staged
