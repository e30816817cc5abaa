// CUDA: LayerNorm / RMSNorm forward with an FP8 output (common.h's NormParams has the math).
//
// Grid and registers: norm.cuh. Per row: the mean, then the sum of squared deviations (or of
// squares, RMSNorm), then y, the FP8 bytes (row-major), amax and the optional high-precision y;
// each block folds its amax into the slot with one atomic. kAmaxOnly (the amax pass of current
// scaling) computes the same y and writes only the amax; kCurrent computes its scale from the
// slot's amax first (current_scale.cuh) and folds no amax. The transpose, when asked for, is one
// pass of the tile machinery's fp8_transpose over the FP8 output (1 byte read and written per
// element), or, under the kernel switch NORM_FWD_TRANSPOSE, written by the band kernel below:
// each block takes a band of kBandRows (or more) consecutive rows, computes them exactly as
// norm_fwd_kernel does (the same threads per row, loads and sums, so the same bytes), stages
// their FP8 bytes in shared memory (band x hidden) and writes the band's columns of out_t with
// 16-byte stores: the second pass and its 2 bytes per element are gone (notes/PERF.md, issue 41).
// With out == nullptr (csrc/blockwise_norm.h's first pass) a row writes mu, rsigma and
// residual_out only.
#include "../common.h"
#include "../dtype_switch.h"
#include "current_scale.cuh"
#include "fp8_util.cuh"
#include "norm.cuh"
#include "tile.cuh"
#include "vec.cuh"

namespace graphfp8 {
namespace {

using cuda::norm::Elems;
using cuda::norm::fwd_loads;
using cuda::norm::kMaxThreads;
using cuda::norm::row_layout;
using cuda::norm::row_sums;
using cuda::norm::RowLayout;

template <typename T>
struct FwdArgs {
  NormParams p;
  RowLayout layout;
};

// g = gamma (+ 1) of the N columns at element c.
template <typename T, bool kVec>
__device__ __forceinline__ void weights(const NormParams& p, int64_t c,
                                        float (&g)[Elems<T, kVec>::N]) {
  using E = Elems<T, kVec>;
  E::to_floats(E::load(static_cast<const T*>(p.gamma) + c), g);
  if (p.zero_centered_gamma) {
#pragma unroll
    for (int j = 0; j < E::N; ++j) g[j] = __fadd_rn(g[j], 1.0f);
  }
}

// Loads the thread's part of row r (z = x, or x + residual rounded to T, also written out).
template <typename T, bool kVec, int kLoads, bool kStore = true>
__device__ __forceinline__ void load_row(const NormParams& p, int64_t r, int lane_r, int tpr,
                                         bool valid, typename Elems<T, kVec>::Frag (&raw)[kLoads]) {
  using E = Elems<T, kVec>;
  const int64_t loads = p.hidden / E::N;
#pragma unroll
  for (int k = 0; k < kLoads; ++k) {
    const int64_t v = lane_r + static_cast<int64_t>(k) * tpr;
    if (valid && v < loads) raw[k] = E::load(static_cast<const T*>(p.x) + r * p.hidden + v * E::N);
  }
  if (p.residual == nullptr) return;
#pragma unroll
  for (int k = 0; k < kLoads; ++k) {
    const int64_t v = lane_r + static_cast<int64_t>(k) * tpr;
    if (!valid || v >= loads) continue;
    const int64_t at = r * p.hidden + v * E::N;
    float x[E::N], res[E::N];
    E::to_floats(raw[k], x);
    E::to_floats(E::load(static_cast<const T*>(p.residual) + at), res);
#pragma unroll
    for (int j = 0; j < E::N; ++j) x[j] = __fadd_rn(x[j], res[j]);
    raw[k] = E::from_floats(x);
    if constexpr (kStore) E::store(static_cast<T*>(p.residual_out) + at, raw[k]);
  }
}

// Sums over the thread's part of the row of z - shift (squared when kSquare), zero elsewhere.
template <typename T, bool kVec, int kLoads, bool kSquare>
__device__ __forceinline__ float part_sum(const typename Elems<T, kVec>::Frag (&raw)[kLoads],
                                          int64_t loads, int lane_r, int tpr, bool valid,
                                          float shift) {
  using E = Elems<T, kVec>;
  float s = 0.0f;
#pragma unroll
  for (int k = 0; k < kLoads; ++k) {
    if (!valid || lane_r + static_cast<int64_t>(k) * tpr >= loads) continue;
    float z[E::N];
    E::to_floats(raw[k], z);
#pragma unroll
    for (int j = 0; j < E::N; ++j) {
      const float d = __fsub_rn(z[j], shift);
      s = __fadd_rn(s, kSquare ? __fmul_rn(d, d) : d);
    }
  }
  return s;
}

// Row r of the norm (every thread of the block calls it: row_sums synchronises): mu and rsigma,
// the FP8 bytes to out (and to band_row, the row's place in a staged band, when given), y to
// out_hp, and the thread's amax. With kAmaxOnly only the amax.
template <typename T, bool kE4M3, bool kVec, bool kAmaxOnly>
__device__ __forceinline__ void norm_row(const NormParams& p, int tpr, int lane_r, int64_t r,
                                         float scale, float (*scratch)[32], float& amax,
                                         uint8_t* band_row) {
  using E = Elems<T, kVec>;
  constexpr int kLoads = fwd_loads<T, kVec>();
  const int64_t loads = p.hidden / E::N;
  const float h = static_cast<float>(p.hidden);
  const bool valid = r < p.rows;
  typename E::Frag raw[kLoads];
  load_row<T, kVec, kLoads, !kAmaxOnly>(p, r, lane_r, tpr, valid, raw);
  float s[1] = {0.0f};
  float mu = 0.0f;
  if (!p.rms) {
    s[0] = part_sum<T, kVec, kLoads, false>(raw, loads, lane_r, tpr, valid, 0.0f);
    row_sums(s, tpr, scratch);
    mu = __fdiv_rn(s[0], h);
  }
  s[0] = part_sum<T, kVec, kLoads, true>(raw, loads, lane_r, tpr, valid, mu);
  row_sums(s, tpr, scratch);
  const float rsigma = __frcp_rn(__fsqrt_rn(__fadd_rn(__fdiv_rn(s[0], h), p.eps)));
  if (!valid) return;
  if (!kAmaxOnly && lane_r == 0) {
    if (p.mu != nullptr) p.mu[r] = mu;
    p.rsigma[r] = rsigma;
  }
  if (!kAmaxOnly && p.out == nullptr) return;  // stats only: block_norm_cuda's first pass
#pragma unroll
  for (int k = 0; k < kLoads; ++k) {
    const int64_t v = lane_r + static_cast<int64_t>(k) * tpr;
    if (v >= loads) continue;
    float z[E::N], g[E::N], b[E::N];
    E::to_floats(raw[k], z);
    weights<T, kVec>(p, v * E::N, g);
    if (!p.rms) E::to_floats(E::load(static_cast<const T*>(p.beta) + v * E::N), b);
    uint8_t q[E::N];
#pragma unroll
    for (int j = 0; j < E::N; ++j) {
      float y = __fmul_rn(__fmul_rn(__fsub_rn(z[j], mu), rsigma), g[j]);
      if (!p.rms) y = __fadd_rn(y, b[j]);
      z[j] = y;
      amax = fmaxf(amax, fabsf(y));
      if constexpr (!kAmaxOnly) q[j] = cuda::quantize<kE4M3>(__fmul_rn(y, scale));
    }
    if constexpr (kAmaxOnly) continue;
    const int64_t at = r * p.hidden + v * E::N;
    cuda::store_bytes<E::N>(static_cast<uint8_t*>(p.out) + at, q);
    if (band_row != nullptr) cuda::store_bytes<E::N>(band_row + v * E::N, q);
    if (p.out_hp != nullptr) E::store(static_cast<T*>(p.out_hp) + at, E::from_floats(z));
  }
}

template <typename T, bool kE4M3, bool kVec, bool kCurrent, bool kAmaxOnly>
__global__ void __launch_bounds__(kMaxThreads) norm_fwd_kernel(FwdArgs<T> a) {
  __shared__ float scratch[1][32];
  const NormParams& p = a.p;
  const int tpr = a.layout.tpr;
  const int slot = threadIdx.x / tpr;
  const int lane_r = threadIdx.x % tpr;
  const float scale = kAmaxOnly ? 1.0f : cuda::cast_scale<kCurrent>(p.scale, p.current);
  float amax = 0.0f;
  const int64_t step = static_cast<int64_t>(gridDim.x) * a.layout.rows_per_block;
  for (int64_t row0 = static_cast<int64_t>(blockIdx.x) * a.layout.rows_per_block; row0 < p.rows;
       row0 += step) {
    norm_row<T, kE4M3, kVec, kAmaxOnly>(p, tpr, lane_r, row0 + slot, scale, scratch, amax,
                                        nullptr);
  }
  if constexpr (kAmaxOnly) {
    cuda::block_amax_atomic(amax, p.amax);
  } else {
    cuda::cast_epilogue<kCurrent>(amax, p.amax, p.scale_inv, scale);
  }
}

// Bands of this many rows at least (more when a block holds more rows at a time): 16 bytes per
// column of out_t per band, one vector store; the band's bytes fit the default 48 KB of shared
// memory beside the block's static scratch (ptxas: 144-256 B; 1 KB kept for it), up to hidden
// 2944 (at 3064 and 3072 the launch was refused, "invalid argument": H200, 2026-12-02).
constexpr int kBandRows = 16;
constexpr int64_t kBandMaxBytes = 47 * 1024;

// Transposes the 4 x 4 bytes of w (w[i] byte c: row i, column c) into columns (out[c] byte i).
__device__ __forceinline__ void transpose_4x4_bytes(const uint32_t (&w)[4], uint32_t (&out)[4]) {
  const uint32_t a = __byte_perm(w[0], w[1], 0x5140), b = __byte_perm(w[0], w[1], 0x7362);
  const uint32_t c = __byte_perm(w[2], w[3], 0x5140), d = __byte_perm(w[2], w[3], 0x7362);
  out[0] = __byte_perm(a, c, 0x5410);
  out[1] = __byte_perm(a, c, 0x7632);
  out[2] = __byte_perm(b, d, 0x5410);
  out[3] = __byte_perm(b, d, 0x7632);
}

// Writes the staged band (band x hidden bytes, rows b0 ..) into out_t (hidden, rows): item e is
// 4 columns (c4 = e % (hidden / 4), consecutive across a warp: conflict-free 4-byte shared
// reads) x 16 rows (e / (hidden / 4)); 16 words read, four 4x4 byte transposes, one 16-byte
// store per column. rows % 16 == 0, so a 16-row group is either all in range or all out.
__device__ __forceinline__ void store_band_transposed(const uint8_t* band_bytes, int band,
                                                      const NormParams& p, int64_t b0) {
  const int c4s = static_cast<int>(p.hidden / 4);  // hidden <= kBandMaxBytes / kBandRows
  const auto* words = reinterpret_cast<const uint32_t*>(band_bytes);
  auto* out_t = static_cast<uint8_t*>(p.out_t);
  for (int e = threadIdx.x; e < c4s * (band / 16); e += blockDim.x) {
    const int c4 = e % c4s;
    const int i0 = e / c4s * 16;
    if (b0 + i0 >= p.rows) continue;
    uint32_t col[4][4];  // col[c][q]: column 4 c4 + c, rows i0 + 4 q .. + 3
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      uint32_t w[4], t[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) w[k] = words[(i0 + 4 * q + k) * c4s + c4];
      transpose_4x4_bytes(w, t);
#pragma unroll
      for (int c = 0; c < 4; ++c) col[c][q] = t[c];
    }
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      *reinterpret_cast<uint4*>(out_t + static_cast<int64_t>(4 * c4 + c) * p.rows + b0 + i0) =
          make_uint4(col[c][0], col[c][1], col[c][2], col[c][3]);
    }
  }
}

// norm_fwd_kernel's rows a band at a time (vector loads only), out_t from the staged band.
template <typename T, bool kE4M3, bool kCurrent>
__global__ void __launch_bounds__(kMaxThreads) norm_fwd_band_kernel(FwdArgs<T> a, int band) {
  extern __shared__ uint4 staged[];  // band x hidden FP8 bytes, row-major
  __shared__ float scratch[1][32];
  auto* band_bytes = reinterpret_cast<uint8_t*>(staged);
  const NormParams& p = a.p;
  const int tpr = a.layout.tpr;
  const int slot = threadIdx.x / tpr;
  const int lane_r = threadIdx.x % tpr;
  const float scale = cuda::cast_scale<kCurrent>(p.scale, p.current);
  float amax = 0.0f;
  const int64_t step = static_cast<int64_t>(gridDim.x) * band;
  for (int64_t b0 = static_cast<int64_t>(blockIdx.x) * band; b0 < p.rows; b0 += step) {
    for (int i = slot; i < band; i += a.layout.rows_per_block) {
      norm_row<T, kE4M3, true, false>(p, tpr, lane_r, b0 + i, scale, scratch, amax,
                                      band_bytes + static_cast<int64_t>(i) * p.hidden);
    }
    __syncthreads();
    store_band_transposed(band_bytes, band, p, b0);
    __syncthreads();  // the next band overwrites the staged bytes
  }
  cuda::cast_epilogue<kCurrent>(amax, p.amax, p.scale_inv, scale);
}

// The band kernel's layout: the row kernel's threads per row (so the same sums), but blocks of
// up to 1024 threads that hold a whole 16-row band at once where they can (512 at h1024 in 16
// bits: the row kernel's rows in flight per SM, without a second pass over the band's rows).
inline RowLayout band_layout(const RowLayout& rows) {
  int block = kBandRows * rows.tpr;
  block = block < 256 ? 256 : (block > kMaxThreads ? kMaxThreads : block);
  return {rows.tpr, block, block / rows.tpr};
}

// The band for the fused transpose, or 0 where it does not apply (the two-pass path): vector
// loads, rows a multiple of 16 (whole 16-row groups), out_t 16-byte aligned, the band in the
// default shared memory.
template <bool kVec>
int band_rows(const NormParams& p, const RowLayout& layout) {
  if (!kVec || !p.transpose_in_kernel || p.out_t == nullptr || p.rows % 16 != 0 ||
      !cuda::aligned16(p.out_t)) {
    return 0;
  }
  const int band = layout.rows_per_block > kBandRows ? layout.rows_per_block : kBandRows;
  return band * p.hidden <= kBandMaxBytes ? band : 0;
}

template <typename T, bool kE4M3>
Status launch_band(const NormParams& p, const RowLayout& layout, int band, cudaStream_t stream) {
  const int grid = cuda::grid_size(cuda::ceil_div(p.rows, band), 2048 / layout.block);
  const FwdArgs<T> args{p, layout};
  const size_t smem = static_cast<size_t>(band) * p.hidden;
  if (p.current.on()) {
    norm_fwd_band_kernel<T, kE4M3, true><<<grid, layout.block, smem, stream>>>(args, band);
  } else {
    norm_fwd_band_kernel<T, kE4M3, false><<<grid, layout.block, smem, stream>>>(args, band);
  }
  return cuda::check_launch("norm_fwd_band_kernel");
}

template <typename T, bool kE4M3, bool kVec>
Status launch_fwd(const NormParams& p, cudaStream_t stream) {
  using E = Elems<T, kVec>;
  const RowLayout layout = row_layout(p.hidden / E::N, fwd_loads<T, kVec>());
  if (!p.amax_only) {
    const RowLayout banded = band_layout(layout);
    const int band = band_rows<kVec>(p, banded);
    if (band > 0) return launch_band<T, kE4M3>(p, banded, band, stream);
  }
  const int grid = cuda::grid_size(cuda::ceil_div(p.rows, layout.rows_per_block),
                                   2048 / layout.block);
  const FwdArgs<T> args{p, layout};
  if (p.amax_only) {
    norm_fwd_kernel<T, kE4M3, kVec, false, true><<<grid, layout.block, 0, stream>>>(args);
  } else if (p.current.on()) {
    norm_fwd_kernel<T, kE4M3, kVec, true, false><<<grid, layout.block, 0, stream>>>(args);
  } else {
    norm_fwd_kernel<T, kE4M3, kVec, false, false><<<grid, layout.block, 0, stream>>>(args);
  }
  const Status st = cuda::check_launch("norm_fwd_kernel");
  if (!st.ok() || p.out_t == nullptr) return st;
  const TransposeParams t{static_cast<const uint8_t*>(p.out), static_cast<uint8_t*>(p.out_t),
                          nullptr, p.rows, p.hidden};
  return transpose_cuda(t, stream);
}

}  // namespace

Status norm_fwd_cuda(const NormParams& p, void* stream_ptr) {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  GRAPHFP8_SWITCH_HP(p.dtype, "norm_fwd", T,
    GRAPHFP8_SWITCH_FP8(p.out_dtype, "norm_fwd", kE4M3,
      constexpr int N = cuda::Vec<T>::N;
      const bool vec = p.hidden % N == 0 && cuda::aligned16(p.x) && cuda::aligned16(p.gamma) &&
                       (p.beta == nullptr || cuda::aligned16(p.beta)) &&
                       (p.residual == nullptr || cuda::aligned16(p.residual)) &&
                       (p.residual_out == nullptr || cuda::aligned16(p.residual_out)) &&
                       (p.out_hp == nullptr || cuda::aligned16(p.out_hp)) &&
                       (p.out == nullptr || cuda::aligned16(p.out));
      if (vec) return launch_fwd<T, kE4M3, true>(p, stream);
      return launch_fwd<T, kE4M3, false>(p, stream);))
  return Status{};
}

}  // namespace graphfp8
