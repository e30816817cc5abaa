// The FP8 cast-transpose of one tile, written once for the kernels that differ only in where a
// tile's values come from: cast_transpose.cu (the input, through an optional GELU / dGELU) and
// rope_cast.cu (the fused QKV gradient, rotated back by RoPE's backward).
//
//   cast_rows:   for each of the thread's loads of the tile (tile.cuh's TileShape), the kernel's
//                values(l) gives its N values as floats; they fold into amax and (kDbias) the
//                thread's per-column sums in row order, and their FP8 bytes go row-major to
//                `out` and to the shared tile (4 bytes per conversion with kPaired).
//   finish_tile: the block's per-column dbias partials into shared memory, a barrier, the
//                tile's transpose into out_t, the partials summed in a fixed order into row
//                tile_r of the fp32 workspace, the amax / scale_inv epilogue, and (DBIAS_IN_KERNEL)
//                the last block of each column of tiles reducing the workspace (dbias.cuh).
//   launch_tile_cast: launch_tiles over the grid, then the workspace's reduce for a dbias not
//                reduced in the kernel.
//
// The kernels' argument structs share the field names read here: out, out_t, scale_inv, amax,
// workspace, dbias, counters, rows, cols.
#pragma once

#include "dbias.cuh"
#include "fp8_util.cuh"
#include "tile.cuh"
#include "vec.cuh"

namespace graphfp8::cuda {

// Stores 1 or 2 words of FP8 bytes with one aligned store (the paired path).
template <int kWords>
__device__ __forceinline__ void store_words(uint8_t* dst, const uint32_t (&w)[kWords]) {
  if constexpr (kWords == 2) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
  } else {
    static_assert(kWords == 1, "8 or 4 bytes per load");
    *reinterpret_cast<uint32_t*>(dst) = w[0];
  }
}

// Casts the thread's loads of one tile (see above). values(l): the N values of load l as a
// function of k < N (called only for loads inside the tensor; vector tiles: cols % 16 == 0, so
// all N columns of a load are in range). Each value is cast as soon as it is computed: fewer
// registers live than computing all N first (the paired path needs its 4 values at once).
template <typename S, bool kE4M3, bool kDbias, bool kVec, bool kPaired, typename Values>
__device__ __forceinline__ void cast_rows(const Values& values, uint8_t* __restrict__ out,
                                          const TileGrid<S>& g, const TilePos& t,
                                          SharedTile<kVec>& tile, float scale, float& amax,
                                          float (&col_sum)[S::N]) {
  const int64_t gc = t.c0 + S::col();
#pragma unroll
  for (int l = 0; l < S::kLoads; ++l) {
    const int r = S::row(l);
    const int64_t gr = t.r0 + r;
    if (!g.in(gr, gc)) continue;
    const auto value = values(l);
    if constexpr (kPaired) {
      static_assert(kVec && S::N % 4 == 0, "paired quantization packs words of 4 bytes");
      float v[S::N];
#pragma unroll
      for (int k = 0; k < S::N; ++k) {
        v[k] = value(k);
        amax = fmaxf(amax, fabsf(v[k]));
        if constexpr (kDbias) col_sum[k] += v[k];
      }
      uint32_t w[S::N / 4];
#pragma unroll
      for (int m = 0; m < S::N / 4; ++m) {
        w[m] = quantize4<kE4M3>(v[4 * m] * scale, v[4 * m + 1] * scale, v[4 * m + 2] * scale,
                                v[4 * m + 3] * scale);
      }
      store_words(out + gr * g.cols + gc, w);
      store_words(tile.at(r, S::col()), w);
    } else {
      uint8_t q[S::N];
#pragma unroll
      for (int k = 0; k < S::N; ++k) {
        const float v = value(k);
        amax = fmaxf(amax, fabsf(v));
        q[k] = quantize<kE4M3>(v * scale);
        if constexpr (kDbias) col_sum[k] += v;
      }
      store_bytes<S::N>(out + gr * g.cols + gc, q);
      stage<S>(tile, r, q);
    }
  }
}

// The rest of the tile after cast_rows (see above); every thread of the block calls it.
// partial: the kernel's __shared__ (kDbias ? kRowGroups : 1, kCols) floats.
template <typename S, bool kDbias, bool kVec, bool kCurrent, bool kPaired, typename Args>
__device__ __forceinline__ void finish_tile(const Args& a, const TileGrid<S>& g, const TilePos& t,
                                            SharedTile<kVec>& tile,
                                            float (&partial)[kDbias ? S::kRowGroups : 1][S::kCols],
                                            const float (&col_sum)[S::N], float amax,
                                            float scale) {
  if constexpr (kDbias) {
#pragma unroll
    for (int k = 0; k < S::N; ++k) partial[S::group()][S::col() + k] = col_sum[k];
  }
  __syncthreads();
  if constexpr (kPaired) {
    store_transposed_words(tile, a.out_t, g, t);
  } else {
    store_transposed(tile, a.out_t, g, t);
  }
  if constexpr (kDbias) {
    const int c = threadIdx.x;
    if (c < S::kCols && t.c0 + c < a.cols) {
      float s = 0.0f;
      for (int grp = 0; grp < S::kRowGroups; ++grp) s += partial[grp][c];
      a.workspace[t.tile_r * a.cols + t.c0 + c] = s;
    }
  }
  cast_epilogue<kCurrent>(amax, a.amax, a.scale_inv, scale);
  if constexpr (kDbias) {
    if (a.counters != nullptr) {
      const int64_t c0 = t.c0, cols = a.cols;
      dbias_finish(a.workspace, a.dbias, a.counters + t.c0 / S::kCols, ceil_div(a.rows, S::kRows),
                   a.cols, S::kCols, [=](int i) { return c0 + i < cols ? c0 + i : int64_t{-1}; });
    }
  }
}

// Launches a tile cast kernel over a's (rows, cols): sets a.counters (a dbias reduced in the
// kernel) before launch_chunk(blocks, first_tile) launches the kernel with `a` (launch_tiles),
// then reduces the workspace into a.dbias (element type OutT) when the kernel did not.
template <typename S, typename OutT, bool kDbias, typename Args, typename LaunchChunk>
inline Status launch_tile_cast(Args& a, bool dbias_in_kernel, cudaStream_t stream,
                               const char* kernel, LaunchChunk&& launch_chunk) {
  const TileGrid<S> grid(a.rows, a.cols);
  a.counters = kDbias && dbias_in_kernel ? dbias_counters(stream, grid.tiles_c) : nullptr;
  const Status st = launch_tiles(grid.num_tiles, kernel, launch_chunk);
  if (!kDbias || !st.ok() || a.counters != nullptr) return st;
  return launch_dbias_reduce<OutT>(a.workspace, a.dbias, ceil_div(a.rows, S::kRows), a.cols,
                                   stream);
}

}  // namespace graphfp8::cuda
