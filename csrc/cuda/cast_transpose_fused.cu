// CUDA: cast-transpose of f(x) fused with an activation and/or a bias gradient.
//
//   cast_transpose_dbias:        f = dy                          and dbias = sum_rows f
//   gelu_cast_transpose:         f = gelu_tanh(x)
//   dgelu_cast_transpose_dbias:  f = dy * gelu_tanh'(x)          and dbias = sum_rows f
//
// out = saturate(f * scale) (rows, cols), out_t = out^T (cols, rows), amax = max(amax, max |f|),
// scale_inv = 1 / scale. f is computed in fp32 and rounded to the input dtype first, as torch's
// activation kernels store it, so each op equals "torch activation, then cast_transpose".
//
// Grid: one 256-thread block per tile, blockIdx.x = tile_row * tiles_c + tile_col. Vector path
// (rows and cols multiples of 16, 16-byte-aligned pointers): 128x64 tiles in cast_transpose.cu's
// scheme - thread tid owns column group tid % (64 / N) of the tile (N elements per 16-byte load)
// and rows tid / (64 / N) + k * (256 * N / 64); it loads all its vectors, writes the row-major FP8
// bytes and the swizzled shared tile; after a barrier thread (j = tid / 4, quarter = tid % 4)
// writes 32 bytes of out_t row j. Other shapes take a scalar 64x64-tile twin.
//
// dbias: no atomics, so the sums are deterministic (graphed and eager runs agree bit for bit).
// Each thread sums its own rows per column in registers; the block adds those partials in a fixed
// order in shared memory and writes row tile_row of an fp32 workspace (row tiles, cols); a second
// kernel, one thread per column, sums the workspace rows in order and rounds to dbias's dtype.
#include <stdexcept>

#include "../common.h"
#include "../gelu_math.h"
#include "fp8_util.cuh"
#include "tile.cuh"
#include "vec.cuh"

namespace graphfp8 {
namespace {

constexpr int kThreads = 256;
constexpr int kTile = 64;  // scalar path: 64x64 tiles
using cuda::kVecCols;
using cuda::kVecRows;
using cuda::swizzle;

template <typename InT>
struct FusedArgs {
  const InT* __restrict__ x;       // (rows, cols): dy for kNone / kDgelu, the GELU input for kGelu
  const InT* __restrict__ act_in;  // (rows, cols): the GELU input (kDgelu only)
  uint8_t* __restrict__ out;       // (rows, cols) FP8
  uint8_t* __restrict__ out_t;     // (cols, rows) FP8
  const float* scale;
  float* scale_inv;
  float* amax;
  float* workspace;                // (row tiles, cols) fp32 column partials, or nullptr
  int64_t rows;
  int64_t cols;
};

// f(x) for one element, rounded to InT (a no-op for the identity and for fp32).
template <typename InT, FusedAct kAct>
__device__ __forceinline__ float apply(float x, float act_in) {
  if constexpr (kAct == FusedAct::kGelu) {
    return cuda::to_float(cuda::from_float<InT>(gelu_tanh(x)));
  } else if constexpr (kAct == FusedAct::kDgelu) {
    return cuda::to_float(cuda::from_float<InT>(dgelu_tanh(x, act_in)));
  } else {
    return x;
  }
}

template <typename InT>
__device__ __forceinline__ void unpack_any(const uint4& raw, float (&f)[cuda::Vec<InT>::N]) {
  if constexpr (sizeof(InT) == 4) {
    cuda::unpack(raw, f);
  } else {
    cuda::unpack<InT>(raw, f);
  }
}

// Thread (j = tid / 4, quarter = tid % 4) writes 32 bytes of out_t row c0 + j: the tile's input
// rows quarter * 32 .. + 31.
template <typename InT>
__device__ __forceinline__ void store_transposed_vec(const FusedArgs<InT>& a,
                                                     const uint8_t (&tile)[kVecRows][kVecCols],
                                                     int64_t r0, int64_t c0) {
  const int j = threadIdx.x / 4;
  const int quarter = threadIdx.x % 4;
  const int64_t gj = c0 + j;
  if (gj >= a.cols) return;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int i0 = quarter * 32 + half * 16;
    const int64_t gi = r0 + i0;
    if (gi < a.rows) {
      uint8_t b[16];
#pragma unroll
      for (int k = 0; k < 16; ++k) b[k] = tile[i0 + k][swizzle(i0 + k, j)];
      cuda::store_bytes<16>(a.out_t + gj * a.rows + gi, b);
    }
  }
}

template <typename InT, bool kE4M3, FusedAct kAct, bool kDbias>
__global__ void __launch_bounds__(kThreads) cast_transpose_fused_vec_kernel(FusedArgs<InT> a) {
  constexpr int N = cuda::Vec<InT>::N;             // elements per 16-byte load
  constexpr int kVecPerRow = kVecCols / N;         // threads per tile row
  constexpr int kRowGroups = kThreads / kVecPerRow;  // tile rows covered by one pass
  constexpr int kLoads = kVecRows / kRowGroups;
  constexpr bool kHasActIn = kAct == FusedAct::kDgelu;
  __shared__ __align__(16) uint8_t tile[kVecRows][kVecCols];
  __shared__ float partial[kDbias ? kRowGroups : 1][kVecCols];
  const int tid = threadIdx.x;
  const int64_t tiles_c = (a.cols + kVecCols - 1) / kVecCols;
  const int64_t tile_r = blockIdx.x / tiles_c;
  const int64_t r0 = tile_r * kVecRows;
  const int64_t c0 = (blockIdx.x % tiles_c) * kVecCols;
  const int group = tid / kVecPerRow;
  const int c = (tid % kVecPerRow) * N;
  const int64_t gc = c0 + c;  // cols % 16 == 0, so gc < cols means all N columns are in range
  const float scale = *a.scale;
  // Issue every load of the tile before using any of them: more bytes in flight per thread.
  uint4 raw[kLoads];
  uint4 raw_in[kHasActIn ? kLoads : 1];
#pragma unroll
  for (int l = 0; l < kLoads; ++l) {
    const int64_t gr = r0 + l * kRowGroups + group;
    if (gr < a.rows && gc < a.cols) {
      raw[l] = __ldg(reinterpret_cast<const uint4*>(a.x + gr * a.cols + gc));
      if constexpr (kHasActIn) {
        raw_in[l] = __ldg(reinterpret_cast<const uint4*>(a.act_in + gr * a.cols + gc));
      }
    }
  }
  float amax = 0.0f;
  float col_sum[N];
#pragma unroll
  for (int k = 0; k < N; ++k) col_sum[k] = 0.0f;
#pragma unroll
  for (int l = 0; l < kLoads; ++l) {
    const int r = l * kRowGroups + group;
    const int64_t gr = r0 + r;
    if (gr < a.rows && gc < a.cols) {
      float f[N];
      float g[N];
      unpack_any<InT>(raw[l], f);
      if constexpr (kHasActIn) unpack_any<InT>(raw_in[l], g);
      uint8_t q[N];
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const float v = apply<InT, kAct>(f[k], kHasActIn ? g[k] : 0.0f);
        amax = fmaxf(amax, fabsf(v));
        q[k] = cuda::quantize<kE4M3>(v * scale);
        if constexpr (kDbias) col_sum[k] += v;
      }
      cuda::store_bytes<N>(a.out + gr * a.cols + gc, q);
      cuda::store_bytes<N>(&tile[r][swizzle(r, c)], q);
    }
  }
  if constexpr (kDbias) {
#pragma unroll
    for (int k = 0; k < N; ++k) partial[group][c + k] = col_sum[k];
  }
  __syncthreads();
  store_transposed_vec(a, tile, r0, c0);
  if constexpr (kDbias) {
    if (tid < kVecCols && c0 + tid < a.cols) {
      float s = 0.0f;
      for (int g = 0; g < kRowGroups; ++g) s += partial[g][tid];
      a.workspace[tile_r * a.cols + c0 + tid] = s;
    }
  }
  cuda::block_amax_atomic(amax, a.amax);
  if (blockIdx.x == 0 && tid == 0) *a.scale_inv = 1.0f / scale;
}

template <typename InT, bool kE4M3, FusedAct kAct, bool kDbias>
__global__ void __launch_bounds__(kThreads) cast_transpose_fused_scalar_kernel(FusedArgs<InT> a) {
  constexpr int kRowGroups = kThreads / kTile;
  __shared__ uint8_t tile[kTile][kTile + 1];  // +1: column reads hit distinct banks
  __shared__ float partial[kDbias ? kRowGroups : 1][kTile];
  const int tid = threadIdx.x;
  const int64_t tiles_c = (a.cols + kTile - 1) / kTile;
  const int64_t tile_r = blockIdx.x / tiles_c;
  const int64_t r0 = tile_r * kTile;
  const int64_t c0 = (blockIdx.x % tiles_c) * kTile;
  const int c = tid % kTile;  // kThreads is a multiple of kTile: a thread keeps one column
  const int64_t gc = c0 + c;
  const float scale = *a.scale;
  float amax = 0.0f;
  float col_sum = 0.0f;
  for (int r = tid / kTile; r < kTile; r += kRowGroups) {
    const int64_t gr = r0 + r;
    if (gr < a.rows && gc < a.cols) {
      const int64_t i = gr * a.cols + gc;
      const float act_in = kAct == FusedAct::kDgelu ? cuda::to_float(a.act_in[i]) : 0.0f;
      const float v = apply<InT, kAct>(cuda::to_float(a.x[i]), act_in);
      amax = fmaxf(amax, fabsf(v));
      const uint8_t q = cuda::quantize<kE4M3>(v * scale);
      a.out[i] = q;
      tile[r][c] = q;
      if constexpr (kDbias) col_sum += v;
    }
  }
  if constexpr (kDbias) partial[tid / kTile][c] = col_sum;
  __syncthreads();
  for (int e = tid; e < kTile * kTile; e += kThreads) {
    const int j = e / kTile;
    const int i = e % kTile;
    const int64_t gj = c0 + j;
    const int64_t gi = r0 + i;
    if (gj < a.cols && gi < a.rows) a.out_t[gj * a.rows + gi] = tile[i][j];
  }
  if constexpr (kDbias) {
    if (tid < kTile && c0 + tid < a.cols) {
      float s = 0.0f;
      for (int g = 0; g < kRowGroups; ++g) s += partial[g][tid];
      a.workspace[tile_r * a.cols + c0 + tid] = s;
    }
  }
  cuda::block_amax_atomic(amax, a.amax);
  if (blockIdx.x == 0 && tid == 0) *a.scale_inv = 1.0f / scale;
}

// dbias[c] = sum over r of workspace[r][c], in row order, rounded to OutT. One thread per column.
template <typename OutT>
__global__ void __launch_bounds__(kThreads)
    dbias_reduce_kernel(const float* __restrict__ workspace, OutT* __restrict__ dbias,
                        int64_t partial_rows, int64_t cols) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  float s = 0.0f;
  for (int64_t r = 0; r < partial_rows; ++r) s += workspace[r * cols + c];
  dbias[c] = cuda::from_float<OutT>(s);
}

template <typename InT, bool kE4M3, FusedAct kAct, bool kDbias>
void launch_fused(const FusedCastTransposeParams& p, cudaStream_t stream) {
  const CastParams& cp = p.cast;
  const FusedArgs<InT> a{static_cast<const InT*>(cp.x),
                         static_cast<const InT*>(p.act_in),
                         static_cast<uint8_t*>(cp.out),
                         static_cast<uint8_t*>(cp.out_t),
                         cp.scale,
                         cp.scale_inv,
                         cp.amax,
                         p.workspace,
                         cp.rows,
                         cp.cols};
  const bool vec = a.rows % 16 == 0 && a.cols % 16 == 0 && cuda::aligned16(a.x) &&
                   (a.act_in == nullptr || cuda::aligned16(a.act_in)) && cuda::aligned16(a.out) &&
                   cuda::aligned16(a.out_t);
  const int64_t tile_rows = vec ? kVecRows : kTile;
  const int64_t row_tiles = (a.rows + tile_rows - 1) / tile_rows;
  const int64_t num_tiles = row_tiles * ((a.cols + kTile - 1) / kTile);  // kVecCols == kTile
  if (num_tiles > 0x7fffffff) throw std::runtime_error("graphfp8: fused cast-transpose too large");
  const int grid = static_cast<int>(num_tiles);
  if (vec) {
    cast_transpose_fused_vec_kernel<InT, kE4M3, kAct, kDbias><<<grid, kThreads, 0, stream>>>(a);
  } else {
    cast_transpose_fused_scalar_kernel<InT, kE4M3, kAct, kDbias><<<grid, kThreads, 0, stream>>>(a);
  }
  cuda::check_launch("cast_transpose_fused");
  if constexpr (kDbias) {
    const int reduce_grid = static_cast<int>((a.cols + kThreads - 1) / kThreads);
    dbias_reduce_kernel<InT><<<reduce_grid, kThreads, 0, stream>>>(
        p.workspace, static_cast<InT*>(p.dbias), row_tiles, a.cols);
    cuda::check_launch("dbias_reduce");
  }
}

// The three (activation, dbias) pairs that the ops use.
template <typename InT, bool kE4M3>
void dispatch_act(const FusedCastTransposeParams& p, cudaStream_t stream) {
  const bool dbias = p.dbias != nullptr;
  if (p.act == FusedAct::kNone && dbias) {
    launch_fused<InT, kE4M3, FusedAct::kNone, true>(p, stream);
  } else if (p.act == FusedAct::kGelu && !dbias) {
    launch_fused<InT, kE4M3, FusedAct::kGelu, false>(p, stream);
  } else if (p.act == FusedAct::kDgelu && dbias) {
    launch_fused<InT, kE4M3, FusedAct::kDgelu, true>(p, stream);
  } else {
    throw std::runtime_error("graphfp8: unsupported fused cast-transpose variant");
  }
}

template <typename InT>
void dispatch_format(const FusedCastTransposeParams& p, cudaStream_t stream) {
  if (p.cast.out_dtype == DType::kE4M3) {
    dispatch_act<InT, true>(p, stream);
  } else {
    dispatch_act<InT, false>(p, stream);
  }
}

}  // namespace

void cast_transpose_fused_cuda(const FusedCastTransposeParams& p, void* stream_ptr) {
  if (p.dbias != nullptr && p.workspace == nullptr) {
    throw std::runtime_error("graphfp8: a fused dbias needs its fp32 workspace");
  }
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  switch (p.cast.x_dtype) {
    case DType::kFloat32: dispatch_format<float>(p, stream); break;
    case DType::kBFloat16: dispatch_format<__nv_bfloat16>(p, stream); break;
    case DType::kFloat16: dispatch_format<__half>(p, stream); break;
    default: throw std::runtime_error("graphfp8: fused cast-transpose: unsupported input dtype");
  }
}

}  // namespace graphfp8
