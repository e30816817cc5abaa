// CUDA: FP8 cast-transpose (both layouts in one pass, fused amax and scale_inv) and FP8 transpose,
// both guarded by a device noop flag.
//
// cast_transpose: out = saturate(x * scale) (rows, cols) and out_t = out^T (cols, rows);
// fp8_transpose: out_t = x^T for an FP8 x. When *noop == 1 the kernel returns before touching
// anything, so a graph can hold it and skip it on later microbatches.
//
// Grid: a persistent loop over 64x64 tiles, 256 threads per block, up to 8 blocks per SM. For one
// tile a thread loads 16-byte vectors of input rows (all loads first, so they are in flight
// together), converts them, stores the row-major FP8 bytes straight to `out` and into a 64x64
// shared tile; after a barrier, thread (chunk = tid / 64, j = tid % 64) gathers 16 bytes of tile
// column j (a warp reads 32 consecutive bytes of one row per step: no bank conflicts) and writes
// them as one 16-byte store into row j of `out_t`. That vector path needs rows and cols to be
// multiples of 16 and 16-byte-aligned pointers; other shapes take a scalar twin of the same tiling.
#include <type_traits>

#include "../common.h"
#include "fp8_util.cuh"
#include "vec.cuh"

namespace graphfp8 {
namespace {

constexpr int kTile = 64;
constexpr int kThreads = 256;
constexpr int kBlocksPerSm = 8;

template <typename InT, bool kCast, bool kE4M3>
struct TileArgs {
  const InT* __restrict__ x;
  uint8_t* __restrict__ out;    // row-major FP8 (cast only)
  uint8_t* __restrict__ out_t;  // transposed FP8
  const float* scale;
  float* scale_inv;
  float* amax;
  const float* noop;
  int64_t rows;
  int64_t cols;
};

// Converts one loaded element: FP8 input bytes pass through, others are scaled and quantized.
template <typename InT, bool kCast, bool kE4M3>
__device__ __forceinline__ uint8_t convert(InT v, float scale, float& amax) {
  if constexpr (kCast) {
    const float f = cuda::to_float(v);
    amax = fmaxf(amax, fabsf(f));
    return cuda::quantize<kE4M3>(f * scale);
  } else {
    return v;
  }
}

template <typename InT, bool kCast, bool kE4M3>
__global__ void __launch_bounds__(kThreads)
    tile_kernel_vec(TileArgs<InT, kCast, kE4M3> a) {
  if (a.noop != nullptr && *a.noop == 1.0f) return;
  __shared__ __align__(16) uint8_t tile[kTile][kTile];
  constexpr int N = cuda::Vec<InT>::N;          // elements per 16-byte load
  constexpr int kVecPerRow = kTile / N;
  constexpr int kLoads = kTile * kVecPerRow / kThreads;
  const float scale = kCast ? *a.scale : 1.0f;
  float amax = 0.0f;
  const int tid = threadIdx.x;
  const int64_t tiles_c = (a.cols + kTile - 1) / kTile;
  const int64_t num_tiles = tiles_c * ((a.rows + kTile - 1) / kTile);
  for (int64_t t = blockIdx.x; t < num_tiles; t += gridDim.x) {
    const int64_t r0 = (t / tiles_c) * kTile;
    const int64_t c0 = (t % tiles_c) * kTile;
    uint4 raw[kLoads];
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      const int idx = l * kThreads + tid;
      const int64_t gr = r0 + idx / kVecPerRow;
      const int64_t gc = c0 + (idx % kVecPerRow) * N;
      if (gr < a.rows && gc < a.cols) {
        raw[l] = __ldg(reinterpret_cast<const uint4*>(a.x + gr * a.cols + gc));
      }
    }
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      const int idx = l * kThreads + tid;
      const int r = idx / kVecPerRow;
      const int c = (idx % kVecPerRow) * N;
      const int64_t gr = r0 + r;
      const int64_t gc = c0 + c;
      if (gr < a.rows && gc < a.cols) {
        uint8_t q[N];
        if constexpr (kCast) {
          float f[N];
          if constexpr (sizeof(InT) == 4) {
            cuda::unpack(raw[l], f);
          } else {
            cuda::unpack<InT>(raw[l], f);
          }
#pragma unroll
          for (int k = 0; k < N; ++k) {
            amax = fmaxf(amax, fabsf(f[k]));
            q[k] = cuda::quantize<kE4M3>(f[k] * scale);
          }
          cuda::store_bytes<N>(a.out + gr * a.cols + gc, q);
        } else {
          const uint32_t w[4] = {raw[l].x, raw[l].y, raw[l].z, raw[l].w};
#pragma unroll
          for (int k = 0; k < N; ++k) q[k] = static_cast<uint8_t>(w[k / 4] >> (8 * (k % 4)));
        }
        cuda::store_bytes<N>(&tile[r][c], q);
      }
    }
    __syncthreads();
    const int j = tid % kTile;
    const int chunk = tid / kTile;  // 16-row chunk of the tile
    const int64_t gj = c0 + j;
    const int64_t gi = r0 + chunk * 16;
    if (gj < a.cols && gi < a.rows) {
      uint8_t b[16];
#pragma unroll
      for (int k = 0; k < 16; ++k) b[k] = tile[chunk * 16 + k][j];
      cuda::store_bytes<16>(a.out_t + gj * a.rows + gi, b);
    }
    __syncthreads();
  }
  if constexpr (kCast) {
    cuda::block_amax_atomic(amax, a.amax);
    if (blockIdx.x == 0 && tid == 0) *a.scale_inv = 1.0f / scale;
  }
}

template <typename InT, bool kCast, bool kE4M3>
__global__ void __launch_bounds__(kThreads)
    tile_kernel_scalar(TileArgs<InT, kCast, kE4M3> a) {
  if (a.noop != nullptr && *a.noop == 1.0f) return;
  __shared__ uint8_t tile[kTile][kTile + 1];  // +1: column reads hit distinct banks
  const float scale = kCast ? *a.scale : 1.0f;
  float amax = 0.0f;
  const int tid = threadIdx.x;
  const int64_t tiles_c = (a.cols + kTile - 1) / kTile;
  const int64_t num_tiles = tiles_c * ((a.rows + kTile - 1) / kTile);
  for (int64_t t = blockIdx.x; t < num_tiles; t += gridDim.x) {
    const int64_t r0 = (t / tiles_c) * kTile;
    const int64_t c0 = (t % tiles_c) * kTile;
    for (int e = tid; e < kTile * kTile; e += kThreads) {
      const int r = e / kTile;
      const int c = e % kTile;
      const int64_t gr = r0 + r;
      const int64_t gc = c0 + c;
      if (gr < a.rows && gc < a.cols) {
        const uint8_t q = convert<InT, kCast, kE4M3>(a.x[gr * a.cols + gc], scale, amax);
        if constexpr (kCast) a.out[gr * a.cols + gc] = q;
        tile[r][c] = q;
      }
    }
    __syncthreads();
    for (int e = tid; e < kTile * kTile; e += kThreads) {
      const int j = e / kTile;
      const int i = e % kTile;
      const int64_t gj = c0 + j;
      const int64_t gi = r0 + i;
      if (gj < a.cols && gi < a.rows) a.out_t[gj * a.rows + gi] = tile[i][j];
    }
    __syncthreads();
  }
  if constexpr (kCast) {
    cuda::block_amax_atomic(amax, a.amax);
    if (blockIdx.x == 0 && tid == 0) *a.scale_inv = 1.0f / scale;
  }
}

template <typename InT, bool kCast, bool kE4M3>
void launch_tiles(const TileArgs<InT, kCast, kE4M3>& a, cudaStream_t stream) {
  const int64_t num_tiles = ((a.rows + kTile - 1) / kTile) * ((a.cols + kTile - 1) / kTile);
  const int64_t cap = static_cast<int64_t>(cuda::sm_count()) * kBlocksPerSm;
  const int grid = static_cast<int>(num_tiles < cap ? num_tiles : cap);
  const bool vec = a.rows % 16 == 0 && a.cols % 16 == 0 && cuda::aligned16(a.x) &&
                   cuda::aligned16(a.out_t) && (!kCast || cuda::aligned16(a.out));
  if (vec) {
    tile_kernel_vec<InT, kCast, kE4M3><<<grid, kThreads, 0, stream>>>(a);
  } else {
    tile_kernel_scalar<InT, kCast, kE4M3><<<grid, kThreads, 0, stream>>>(a);
  }
  cuda::check_launch(kCast ? "cast_transpose" : "fp8_transpose");
}

template <typename InT, bool kE4M3>
void launch_cast_transpose(const CastParams& p, cudaStream_t stream) {
  TileArgs<InT, true, kE4M3> a{static_cast<const InT*>(p.x),
                               static_cast<uint8_t*>(p.out),
                               static_cast<uint8_t*>(p.out_t),
                               p.scale,
                               p.scale_inv,
                               p.amax,
                               p.noop,
                               p.rows,
                               p.cols};
  launch_tiles(a, stream);
}

template <typename InT>
void dispatch_format(const CastParams& p, cudaStream_t stream) {
  if (p.out_dtype == DType::kE4M3) {
    launch_cast_transpose<InT, true>(p, stream);
  } else {
    launch_cast_transpose<InT, false>(p, stream);
  }
}

}  // namespace

void cast_transpose_cuda(const CastParams& p, void* stream_ptr) {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  switch (p.x_dtype) {
    case DType::kFloat32: dispatch_format<float>(p, stream); break;
    case DType::kBFloat16: dispatch_format<__nv_bfloat16>(p, stream); break;
    case DType::kFloat16: dispatch_format<__half>(p, stream); break;
    default: throw std::runtime_error("graphfp8.cast_transpose: unsupported input dtype");
  }
}

void transpose_cuda(const TransposeParams& p, void* stream_ptr) {
  TileArgs<uint8_t, false, true> a{p.x, nullptr, p.out_t, nullptr, nullptr, nullptr,
                                   p.noop, p.rows, p.cols};
  launch_tiles(a, static_cast<cudaStream_t>(stream_ptr));
}

}  // namespace graphfp8
