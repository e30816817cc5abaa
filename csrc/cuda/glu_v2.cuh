// The GLU cast-transposes on vector tiles with fewer instructions per byte (kernel switch
// GLU_V2, off until it has run on a GPU): the same tiles, loads, values, amax and dbias sums as
// glu_cast_transpose.cu's first kernels, and the same bytes, written as tile_cast.cuh's paired
// path writes a cast-transpose's (kernel switch PAIRED_QUANTIZE, bit-identical on the H200):
//   - each load's N values quantized four at a time (fp8_util.cuh's quantize4: two pair
//     converts and the NaN rewrite instead of four clamped single converts);
//   - the words stored as they come, to out and to the shared tile (no byte packing);
//   - the transpose read from the shared tile in words and transposed in registers
//     (tile.cuh's store_transposed_words: ~1 instruction per byte instead of ~3).
// The first kernels run at 0.57-0.66 of copy at Llama 1B / 8B, issue-bound rather than
// memory-bound: ~53 (forward) and ~100 (backward) instructions per element of a, against a budget
// of ~42 and ~69 at the copy rate (notes/PERF.md, "Issue 41: the SwiGLU kernels").
#pragma once

#include "glu_tile.cuh"
#include "tile_cast.cuh"

namespace graphfp8::cuda {

// The forward's values of one load: a = round(act(g) * u) for each of its N columns.
template <typename S, typename T, GluAct kAct>
struct GluFwdValues {
  typename S::Frag gate[S::kLoads], up[S::kLoads];

  __device__ __forceinline__ GluFwdValues(const GluArgs<T>& a, const TileGrid<S>& g,
                                          const TilePos& t) {
    load_half(a.h, 2 * a.cols, g, t, gate);
    load_half(a.h + a.cols, 2 * a.cols, g, t, up);
  }

  __device__ __forceinline__ auto operator()(int l) const {
    struct Row {
      float g[S::N], u[S::N];
      __device__ __forceinline__ float operator()(int k) const {
        return round_to<T>(glu_forward<kAct>(g[k], u[k]));
      }
    } row;
    frag_to_floats<S, T>(gate[l], row.g);
    frag_to_floats<S, T>(up[l], row.u);
    return row;
  }
};

template <typename T, bool kE4M3, GluAct kAct>
__global__ void __launch_bounds__(kTileThreads)
    glu_fwd_v2_kernel(GluArgs<T> a, int64_t first_tile) {
  using S = TileShape<T, true>;
  __shared__ SharedTile<true> tile;
  __shared__ float partial[1][S::kCols];  // finish_tile's, unused without dbias
  const TileGrid<S> g(a.rows, a.cols);
  const TilePos t = g.at(first_tile + blockIdx.x);
  const float scale = *a.scale;
  float amax = 0.0f, col_sum[S::N];
  const GluFwdValues<S, T, kAct> values(a, g, t);
  cast_rows<S, kE4M3, false, true, true>(values, a.out, g, t, tile, scale, amax, col_sum);
  finish_tile<S, false, true, false, true>(a, g, t, tile, partial, col_sum, amax, scale);
}

template <typename T, bool kE4M3, GluAct kAct, bool kDbias>
__global__ void __launch_bounds__(kTileThreads)
    glu_bwd_v2_kernel(GluArgs<T> a, int64_t first_tile) {
  using S = TileShape<T, true>;
  constexpr int kWords = S::N / 4;
  __shared__ SharedTile<true> tile_g, tile_u;
  __shared__ float partial[kDbias ? S::kRowGroups : 1][2 * S::kCols];
  const TileGrid<S> g(a.rows, a.cols);
  const TilePos t = g.at(first_tile + blockIdx.x);
  const float scale = *a.scale;
  typename S::Frag grad[S::kLoads], gate[S::kLoads], up[S::kLoads];
  load_tile(a.da, g, t, grad);
  load_half(a.h, 2 * a.cols, g, t, gate);
  load_half(a.h + a.cols, 2 * a.cols, g, t, up);
  float amax = 0.0f, col_g[S::N], col_u[S::N];
#pragma unroll
  for (int k = 0; k < S::N; ++k) col_g[k] = col_u[k] = 0.0f;
  const int64_t gc = t.c0 + S::col();
#pragma unroll
  for (int l = 0; l < S::kLoads; ++l) {
    const int r = S::row(l);
    const int64_t gr = t.r0 + r;
    if (!g.in(gr, gc)) continue;  // vector tiles: F % 16 == 0, so all N columns are in range
    float fd[S::N], fg[S::N], fu[S::N], vg[S::N], vu[S::N];
    frag_to_floats<S, T>(grad[l], fd);
    frag_to_floats<S, T>(gate[l], fg);
    frag_to_floats<S, T>(up[l], fu);
#pragma unroll
    for (int k = 0; k < S::N; ++k) {
      const GluGrad d = glu_backward<kAct>(fd[k], fg[k], fu[k]);
      vg[k] = round_to<T>(d.dg);
      vu[k] = round_to<T>(d.du);
      amax = fmaxf(amax, fmaxf(fabsf(vg[k]), fabsf(vu[k])));
      if constexpr (kDbias) {
        col_g[k] += vg[k];
        col_u[k] += vu[k];
      }
    }
    uint32_t wg[kWords], wu[kWords];
#pragma unroll
    for (int m = 0; m < kWords; ++m) {
      const int k = 4 * m;
      wg[m] = quantize4<kE4M3>(vg[k] * scale, vg[k + 1] * scale, vg[k + 2] * scale,
                               vg[k + 3] * scale);
      wu[m] = quantize4<kE4M3>(vu[k] * scale, vu[k + 1] * scale, vu[k + 2] * scale,
                               vu[k + 3] * scale);
    }
    uint8_t* row = a.out + gr * 2 * a.cols;
    store_words(row + gc, wg);
    store_words(row + a.cols + gc, wu);
    store_words(tile_g.at(r, S::col()), wg);
    store_words(tile_u.at(r, S::col()), wu);
  }
  if constexpr (kDbias) write_partials<S>(col_g, col_u, partial, a.workspace, a.cols, t);
  __syncthreads();
  store_transposed_words(tile_g, a.out_t, g, t);
  store_transposed_words(tile_u, a.out_t + a.cols * a.rows, g, t);
  amax_epilogue(amax, a.amax, a.scale_inv, scale);
  if constexpr (kDbias) {
    if (a.counters != nullptr) glu_dbias_finish<S>(a, t);
  }
}

template <typename T, bool kE4M3, GluAct kAct>
Status launch_fwd_v2(const GluArgs<T>& a, cudaStream_t stream) {
  using S = TileShape<T, true>;
  return launch_tiles(TileGrid<S>(a.rows, a.cols).num_tiles, "glu_fwd_v2_kernel",
                      [&](int blocks, int64_t first) {
                        glu_fwd_v2_kernel<T, kE4M3, kAct>
                            <<<blocks, kTileThreads, 0, stream>>>(a, first);
                      });
}

template <typename T, bool kE4M3, GluAct kAct, bool kDbias>
Status launch_bwd_v2(GluArgs<T> a, bool dbias_in_kernel, cudaStream_t stream) {
  using S = TileShape<T, true>;
  const TileGrid<S> grid(a.rows, a.cols);
  a.counters = kDbias && dbias_in_kernel ? dbias_counters(stream, grid.tiles_c) : nullptr;
  const Status st = launch_tiles(grid.num_tiles, "glu_bwd_v2_kernel", [&](int blocks,
                                                                          int64_t first) {
    glu_bwd_v2_kernel<T, kE4M3, kAct, kDbias><<<blocks, kTileThreads, 0, stream>>>(a, first);
  });
  if (!kDbias || !st.ok() || a.counters != nullptr) return st;
  return launch_dbias_reduce<T>(a.workspace, a.dbias, ceil_div(a.rows, S::kRows), 2 * a.cols,
                                stream);
}

}  // namespace graphfp8::cuda
