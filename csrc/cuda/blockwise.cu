// CUDA: the blockwise FP8 quantizers (csrc/blockwise.h) in one pass over x: 1x128 tiles of x
// and, from the same read, of x^T; 128x128 blocks of x and their transpose.
//
// Grid: one 256-thread block per 128x128 region of x (blockIdx.x its 128-row strip, blockIdx.y
// its 128-column tile). Phase 1: warp w loads rows w, w + 8, ... of the region (all 16 loads
// issued before any is used), each lane four consecutive columns (one 8-byte load for 16-bit
// inputs, 16-byte for float, when the four exist and are aligned; else bounds-checked
// elements), and keeps them as raw input bits in registers. For 1x128 tiles it reduces each
// row's amax over the warp and writes the row's FP8 bytes (one 4-byte store per lane, a warp's
// row one 128-byte line) and its scale_inv; 128x128 blocks reduce the region's amax over the
// block and write the rows from the same registers after one barrier. With out_t each lane also
// keeps the running amax of its four columns and copies its raw values to shared memory in the
// input dtype (32 KB for 16-bit inputs, half a float tile: the 64 registers, not shared memory,
// bound the blocks per SM at four); the eight warps' column amaxes meet in a 4 KB array, whose
// maxima give the column tiles' scales after the barrier, so phase 2 only quantizes.
// Phase 2 (out_t): thread (j = lane % 8, column pair p) quantizes rows 16j..16j+15 of columns
// 2p, 2p+1 and writes 16 bytes to each of out_t's two rows: a warp's two stores fill eight whole
// 128-byte lines. The shared tile is stored in 2-element units, unit u of row r at
// u ^ (4 * (r / 16 % 8)), so that phase 1's row stores and phase 2's column reads (the 8 lanes
// of a pair read one row of each 16-row band) are both free of bank conflicts.
// Amaxes are maxima of |x|'s bit patterns (abs_bits: NaN above inf), so the integer warp
// reduction __reduce_max_sync serves and a tile holding a NaN gets scale 1, as the twin's.
#include <atomic>
#include <type_traits>

#include "../blockwise.h"
#include "../dtype_switch.h"
#include "blockwise_io.cuh"
#include "blockwise_staged.cuh"
#include "fp8_util.cuh"

namespace graphfp8 {
namespace {

using namespace cuda::blockwise;  // NOLINT: the shared tile constants and I/O

// The bits of one element as stored (16-bit inputs in the low half).
__device__ __forceinline__ uint32_t raw_bits(float v) { return __float_as_uint(v); }
__device__ __forceinline__ uint32_t raw_bits(__nv_bfloat16 v) { return __bfloat16_as_ushort(v); }
__device__ __forceinline__ uint32_t raw_bits(__half v) { return __half_as_ushort(v); }

// Element k of four consecutive elements held as raw words (two per word when 16-bit).
template <typename T>
__device__ __forceinline__ float raw_to_float(const uint32_t* w, int k) {
  if constexpr (sizeof(T) == 4) {
    return __uint_as_float(w[k]);
  } else {
    const auto bits = static_cast<unsigned short>(w[k / 2] >> (16 * (k % 2)));
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      return __bfloat162float(__ushort_as_bfloat16(bits));
    }
    return __half2float(__ushort_as_half(bits));
  }
}

// Four consecutive elements at p as raw words (sizeof(T) words); vec: all four exist and p is
// aligned for one load; else the first `valid` of them, zeros after.
template <typename T>
__device__ __forceinline__ void load4_raw(const T* p, int valid, bool vec, uint32_t* w) {
  if (vec) {
    if constexpr (sizeof(T) == 4) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
      w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
    } else {
      const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
      w[0] = v.x, w[1] = v.y;
    }
    return;
  }
#pragma unroll
  for (int k = 0; k < static_cast<int>(sizeof(T)); ++k) w[k] = 0u;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint32_t b = k < valid ? raw_bits(p[k]) : 0u;
    if constexpr (sizeof(T) == 4) {
      w[k] = b;
    } else {
      w[k / 2] |= b << (16 * (k % 2));
    }
  }
}

// Word offset of 2-element unit u of tile row r in the swizzled shared tile (module comment).
template <typename T>
__device__ __forceinline__ int unit_word(int r, int u) {
  constexpr int kUnitWords = sizeof(T) / 2, kRowWords = kTile * sizeof(T) / 4;
  return r * kRowWords + (u ^ (((r >> 4) & 7) << 2)) * kUnitWords;
}

// Four FP8 bytes (one word, the first in the low byte) to dst: one store when vec, else the
// first `valid` bytes.
__device__ __forceinline__ void store_word(uint8_t* dst, uint32_t q, int valid, bool vec) {
  if (vec) {
    *reinterpret_cast<uint32_t*>(dst) = q;
    return;
  }
  for (int k = 0; k < valid; ++k) dst[k] = static_cast<uint8_t>(q >> (8 * k));
}

// Blocks per SM the registers must allow: four for 16-bit inputs (64 registers: 16 rows of
// raw bits in flight take 32), two for float (whose rows take 64).
template <typename T>
constexpr int kMinBlocks = sizeof(T) == 4 ? 2 : 4;

template <typename T>
constexpr int tile_smem_bytes() {
  return kTile * kTile * static_cast<int>(sizeof(T));
}

template <typename T, bool kE4M3, bool kBlocks, bool kTranspose>
__global__ void __launch_bounds__(kThreads, kMinBlocks<T>)
    block_quantize_kernel(const T* __restrict__ x, uint8_t* __restrict__ out,
                          float* __restrict__ scale_inv, uint8_t* __restrict__ out_t,
                          float* __restrict__ scale_inv_t, const float* noop, int64_t rows,
                          int64_t cols, bool power_2_scale, bool vec_x, bool vec_out,
                          bool vec_out_t) {
  extern __shared__ uint4 tile_smem[];  // with out_t: [kTile][kTile] T, swizzled units
  __shared__ uint4 part[kWarps][kTile / 4];  // with out_t: each warp's column amax bits
  __shared__ float col_s[kTile];
  __shared__ uint32_t warp_amax[kWarps];
  if (noop != nullptr && *noop == 1.0f) return;
  constexpr float kMax = kE4M3 ? kE4M3Max : kE5M2Max;
  constexpr int kWords = sizeof(T);  // raw words of a lane's four elements
  uint32_t* tile = reinterpret_cast<uint32_t*>(tile_smem);
  const int64_t strip = blockIdx.x, col_tile = blockIdx.y;
  const int64_t r0 = strip * kTile, c0 = col_tile * kTile;
  const int nr = static_cast<int>(rows - r0 < kTile ? rows - r0 : kTile);
  const int nc = static_cast<int>(cols - c0 < kTile ? cols - c0 : kTile);
  const int64_t row_tiles = (rows + kTile - 1) / kTile, col_tiles = (cols + kTile - 1) / kTile;
  const int warp = threadIdx.x / cuda::kWarpSize, lane = threadIdx.x % cuda::kWarpSize;
  const int c = lane * 4, valid = max(0, min(4, nc - c));
  // Phase 1: the rows, all of a warp's loads in flight before any is used.
  uint32_t raw[kRowsPerWarp][kWords];
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int r = warp + i * kWarps;
#pragma unroll
    for (int k = 0; k < kWords; ++k) raw[i][k] = 0u;
    if (r < nr) load4_raw(x + (r0 + r) * cols + c0 + c, valid, valid == 4 && vec_x, raw[i]);
  }
  uint32_t col_amax[4] = {0u, 0u, 0u, 0u}, block_amax = 0u;
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int r = warp + i * kWarps;
    float f[4];
    uint32_t a = 0u;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      f[k] = raw_to_float<T>(raw[i], k);
      a = max(a, abs_bits(f[k]));
      if constexpr (kTranspose && !kBlocks) col_amax[k] = max(col_amax[k], abs_bits(f[k]));
    }
    if constexpr (kTranspose) {  // zeros past the region: no amax, never written
      uint32_t* dst = tile + unit_word<T>(r, 2 * lane);
      if constexpr (sizeof(T) == 4) {
        *reinterpret_cast<uint4*>(dst) = make_uint4(raw[i][0], raw[i][1], raw[i][2], raw[i][3]);
      } else {
        *reinterpret_cast<uint2*>(dst) = make_uint2(raw[i][0], raw[i][1]);
      }
    }
    if constexpr (kBlocks) {
      block_amax = max(block_amax, a);
    } else if (r < nr) {
      const float s = block_scale(warp_max(a), kMax, power_2_scale);
      if (lane == 0) scale_inv[(r0 + r) * col_tiles + col_tile] = 1.0f / s;
      const uint32_t q = cuda::quantize4<kE4M3>(f[0] * s, f[1] * s, f[2] * s, f[3] * s);
      store_word(out + (r0 + r) * cols + c0 + c, q, valid, valid == 4 && vec_out);
    }
  }
  if constexpr (kTranspose && !kBlocks) {
    part[warp][lane] = make_uint4(col_amax[0], col_amax[1], col_amax[2], col_amax[3]);
  }
  if constexpr (kBlocks) {
    block_amax = warp_max(block_amax);
    if (lane == 0) warp_amax[warp] = block_amax;
  }
  if constexpr (kBlocks || kTranspose) __syncthreads();
  float block_s = 1.0f;
  if constexpr (kBlocks) {
    uint32_t a = 0u;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) a = max(a, warp_amax[w]);
    block_s = block_scale(a, kMax, power_2_scale);
    if (threadIdx.x == 0) {
      scale_inv[strip * col_tiles + col_tile] = 1.0f / block_s;
      if (kTranspose) scale_inv_t[col_tile * row_tiles + strip] = 1.0f / block_s;
    }
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int r = warp + i * kWarps;
      if (r >= nr) continue;
      float f[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) f[k] = raw_to_float<T>(raw[i], k) * block_s;
      const uint32_t q = cuda::quantize4<kE4M3>(f[0], f[1], f[2], f[3]);
      store_word(out + (r0 + r) * cols + c0 + c, q, valid, valid == 4 && vec_out);
    }
  }
  if constexpr (!kTranspose) return;
  if constexpr (!kBlocks) {  // the column tiles' scales, once per column
    if (threadIdx.x < kTile) {
      const int tc = threadIdx.x;
      const uint32_t* bits = reinterpret_cast<const uint32_t*>(part);
      uint32_t a = 0u;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) a = max(a, bits[w * kTile + tc]);
      const float s = block_scale(a, kMax, power_2_scale);
      col_s[tc] = s;
      if (tc < nc) scale_inv_t[(c0 + tc) * row_tiles + strip] = 1.0f / s;
    }
    __syncthreads();
  }
  // Phase 2: the columns, as rows of out_t.
  const int j = lane % 8, h0 = 16 * j, n = nr - h0;
  const bool vec = nr == kTile && vec_out_t;
  if (n <= 0) return;
#pragma unroll
  for (int it = 0; it < 2; ++it) {
    const int pair = it * (kTile / 4) + warp * 4 + lane / 8, tc = 2 * pair;
    if (tc >= nc) continue;
    const float s0 = kBlocks ? block_s : col_s[tc], s1 = kBlocks ? block_s : col_s[tc + 1];
    uint32_t q0[4], q1[4];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      float v0[4], v1[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const uint32_t* u = tile + unit_word<T>(h0 + 4 * m + k, pair);
        v0[k] = raw_to_float<T>(u, 0) * s0;
        v1[k] = raw_to_float<T>(u, 1) * s1;
      }
      q0[m] = cuda::quantize4<kE4M3>(v0[0], v0[1], v0[2], v0[3]);
      q1[m] = cuda::quantize4<kE4M3>(v1[0], v1[1], v1[2], v1[3]);
    }
    uint8_t* dst = out_t + (c0 + tc) * rows + r0 + h0;
    if (vec) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(q0[0], q0[1], q0[2], q0[3]);
      if (tc + 1 < nc) {
        *reinterpret_cast<uint4*>(dst + rows) = make_uint4(q1[0], q1[1], q1[2], q1[3]);
      }
      continue;
    }
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      store_word(dst + 4 * m, q0[m], min(4, max(0, n - 4 * m)), false);
      if (tc + 1 < nc) store_word(dst + rows + 4 * m, q1[m], min(4, max(0, n - 4 * m)), false);
    }
  }
}

template <typename T, bool kE4M3, bool kBlocks, bool kTranspose>
Status launch(const BlockQuantizeParams& p, cudaStream_t stream) {
  // The shared-memory limit is set once per device and kernel (devices < 64): the float tile
  // passes the 48 KB default.
  auto kernel = block_quantize_kernel<T, kE4M3, kBlocks, kTranspose>;
  constexpr int smem = kTranspose ? tile_smem_bytes<T>() : 0;
  static std::atomic<uint64_t> done{0};
  int device = 0;
  cudaGetDevice(&device);
  const uint64_t bit = uint64_t{1} << (device & 63);
  if (!(done.load() & bit)) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return Status{"block_quantize (shared memory)", cudaGetErrorString(err)};
    done.fetch_or(bit);
  }
  const dim3 grid(static_cast<unsigned>(cuda::ceil_div(p.rows, kTile)),
                  static_cast<unsigned>(cuda::ceil_div(p.cols, kTile)));
  const BlockOut& d = p.dst;
  const bool vec_x = p.cols % 4 == 0 && cuda::aligned16(p.x);
  const bool vec_out = p.cols % 4 == 0 && cuda::aligned16(d.out);
  const bool vec_out_t = d.out_t != nullptr && p.rows % 16 == 0 && cuda::aligned16(d.out_t);
  kernel<<<grid, kThreads, smem, stream>>>(
      static_cast<const T*>(p.x), static_cast<uint8_t*>(d.out), d.scale_inv,
      static_cast<uint8_t*>(d.out_t), d.scale_inv_t, p.noop, p.rows, p.cols, d.power_2_scale,
      vec_x, vec_out, vec_out_t);
  return cuda::check_launch("block_quantize");
}

}  // namespace

Status block_quantize_cuda(const BlockQuantizeParams& p, void* stream_ptr) {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  if (cuda::ceil_div(p.cols, kTile) > 65535) {
    return Status{"block_quantize", "more than 65535 column tiles (cols > 8388480)"};
  }
  if (cuda::staged::applies(p)) {  // BLOCK_QUANTIZE_STAGED (blockwise_staged.cuh)
    if (p.x_dtype == DType::kBFloat16) {
      GRAPHFP8_SWITCH_FP8(p.dst.out_dtype, "block_quantize", kE4M3,
        return cuda::staged::launch<__nv_bfloat16, kE4M3>(p, stream);)
    }
    GRAPHFP8_SWITCH_FP8(p.dst.out_dtype, "block_quantize", kE4M3,
      return cuda::staged::launch<__half, kE4M3>(p, stream);)
  }
  GRAPHFP8_SWITCH_HP(p.x_dtype, "block_quantize", T,
    GRAPHFP8_SWITCH_FP8(p.dst.out_dtype, "block_quantize", kE4M3,
      GRAPHFP8_SWITCH_BOOL(p.block_rows == kBlockTile, kBlocks,
        GRAPHFP8_SWITCH_BOOL(p.dst.out_t != nullptr, kTranspose,
          return launch<T, kE4M3, kBlocks, kTranspose>(p, stream);))))
  return Status{};
}

}  // namespace graphfp8
