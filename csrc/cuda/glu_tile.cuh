// What the GLU cast-transpose kernels share (glu_cast_transpose.cu's first kernels and
// glu_v2.cuh's, kernel switch GLU_V2): their arguments, the loads of h's two halves, the
// rounding of each value to h's dtype, and the backward's dbias partials of both halves.
#pragma once

#include "../glu.h"
#include "dbias.cuh"
#include "fp8_util.cuh"
#include "tile.cuh"
#include "vec.cuh"

namespace graphfp8::cuda {

template <typename T>
struct GluArgs {
  const T* __restrict__ h;   // (rows, 2 * cols)
  const T* __restrict__ da;  // (rows, cols), backward only
  uint8_t* __restrict__ out;
  uint8_t* __restrict__ out_t;
  const float* scale;
  float* scale_inv;
  float* amax;
  float* workspace;  // (row tiles, 2 * cols) fp32, backward with dbias
  T* dbias;          // (2 * cols,), backward with dbias
  int* counters;     // (column tiles,) zeros: reduce in-kernel, or nullptr
  int64_t rows;
  int64_t cols;  // F
};

// tile.cuh's load_tile for a tensor whose rows are `row_stride` elements apart (g and u are the
// two halves of h's rows, 2F apart); columns and rows in range of the (rows, F) grid only.
template <typename S, typename T>
__device__ __forceinline__ void load_half(const T* __restrict__ x, int64_t row_stride,
                                          const TileGrid<S>& g, const TilePos& t,
                                          typename S::Frag (&raw)[S::kLoads]) {
  const int64_t gc = t.c0 + S::col();
#pragma unroll
  for (int l = 0; l < S::kLoads; ++l) {
    const int64_t gr = t.r0 + S::row(l);
    if (!g.in(gr, gc)) continue;
    const T* p = x + gr * row_stride + gc;
    if constexpr (S::N == 1) {
      raw[l] = *p;
    } else {
      raw[l] = __ldg(reinterpret_cast<const uint4*>(p));
    }
  }
}

template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return to_float(from_float<T>(v));
}

// The block's dbias partials of both halves (dg's columns c0.., du's F + c0..) into its
// workspace row, each column summed over the row groups in order.
// Every thread of the block must call it (it holds a barrier).
template <typename S>
__device__ __forceinline__ void write_partials(const float (&col_g)[S::N],
                                               const float (&col_u)[S::N],
                                               float (&partial)[S::kRowGroups][2 * S::kCols],
                                               float* workspace, int64_t cols,
                                               const TilePos& t) {
#pragma unroll
  for (int k = 0; k < S::N; ++k) {
    partial[S::group()][S::col() + k] = col_g[k];
    partial[S::group()][S::kCols + S::col() + k] = col_u[k];
  }
  __syncthreads();
  const int c = threadIdx.x;
  if (c >= 2 * S::kCols) return;
  const int64_t col = t.c0 + c % S::kCols;
  if (col >= cols) return;
  float s = 0.0f;
  for (int grp = 0; grp < S::kRowGroups; ++grp) s += partial[grp][c];
  workspace[t.tile_r * 2 * cols + (c < S::kCols ? 0 : cols) + col] = s;
}

// The last block of each column of tiles sums its dbias (kernel switch DBIAS_IN_KERNEL): dg's
// columns c0.. then du's F + c0.. Every thread of the block calls it.
template <typename S, typename T>
__device__ __forceinline__ void glu_dbias_finish(const GluArgs<T>& a, const TilePos& t) {
  const int64_t c0 = t.c0, f = a.cols;
  dbias_finish(a.workspace, a.dbias, a.counters + t.c0 / S::kCols, ceil_div(a.rows, S::kRows),
               2 * a.cols, 2 * S::kCols, [=](int i) {
                 const int64_t col = c0 + i % S::kCols;
                 return col < f ? col + (i < S::kCols ? 0 : f) : int64_t{-1};
               });
}

}  // namespace graphfp8::cuda
