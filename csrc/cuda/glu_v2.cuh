// The GLU cast-transposes on vector tiles with fewer instructions per element (kernel switch
// GLU_V2, off until it has run on a GPU): the same tiles, loads, values, amax and dbias sums as
// glu_cast_transpose.cu's first kernels, and the same bytes, written as tile_cast.cuh's paired
// path writes a cast-transpose's (kernel switch PAIRED_QUANTIZE, bit-identical on the H200):
//   - each load's N values quantized four at a time (fp8_util.cuh's quantize4: two pair
//     converts and the NaN rewrite instead of four clamped single converts);
//   - the words stored as they come, to out and to the shared tile (no byte packing);
//   - the transpose read from the shared tile in words and transposed in registers
//     (tile.cuh's store_transposed_words: ~1 instruction per byte instead of ~3).
// And (kernel switch GLU_V2_DIV, only with GLU_V2) SwiGLU's divisions without a branch per
// value. The device's IEEE division a / d (div.rn.f32) computes r0 = MUFU.RCP(d) (within 1 ulp of
// 1 / d), r = r0 + r0 (1 - d r0), q0 = a r, q = q0 + r (a - d q0) behind an FCHK that sends
// extreme operands to a slow path: a branch and a reconvergence point per value, so a load's N
// values run one after the other. Written out for a load whose gates all have |g| in
// [2^-32, 22] (d = 1 + exp(-g) in [1, 2^32]: operands and quotients of moderate exponents),
// that sequence is the correctly rounded quotient whenever r0 is not a power of two (checked
// on 4.5e8 quotients a / d and 1 / d with r0 either neighbour of 1 / d; it fails only where r0
// is the power of two just below 1 / d), so the load's values are kept unless some r0 is one,
// and otherwise recomputed by glu_math.h's functions, as are the loads with other gates. One
// reciprocal serves both divisions of the backward (g / d and 1 / d).
// The first kernels run at 0.57-0.66 of copy at Llama 1B / 8B, issue-bound rather than
// memory-bound (notes/PERF.md, "Issue 41: the SwiGLU kernels").
#pragma once

#include "glu_tile.cuh"
#include "tile_cast.cuh"

namespace graphfp8::cuda {

// Whether every gate of a load lies where the written-out division is the division (above):
// |g| in [2^-32, 22] (NaN, infinities, zeros and subnormals are outside).
template <int N>
__device__ __forceinline__ bool fast_gates(const float (&g)[N]) {
  constexpr uint32_t kLo = 0x2F800000u, kHi = 0x41B00000u;  // 2^-32, 22.0f
  uint32_t worst = 0;
#pragma unroll
  for (int k = 0; k < N; ++k) worst = max(worst, (__float_as_uint(g[k]) & 0x7FFFFFFFu) - kLo);
  return worst <= kHi - kLo;
}

// SwiGLU's parts for one gate g in fast_gates' range, as glu_math.h computes them:
// d = 1 + exp(-g) and the refined reciprocal r of the division (above).
struct SiluDiv {
  float d, r;
  uint32_t r0_mantissa;  // 0: MUFU.RCP returned a power of two, where the sequence can miss

  __device__ __forceinline__ explicit SiluDiv(float g) : d(rn_add(1.0f, exp_neg(g))) {
    float r0;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r0) : "f"(d));  // d >= 1: no subnormals
    r0_mantissa = __float_as_uint(r0) << 9;
    r = __fmaf_rn(r0, __fmaf_rn(-d, r0, 1.0f), r0);
  }
  // a / d for |a| in [2^-32, 22] or a = 1 (a r is never 0: the division's a r + 0)
  __device__ __forceinline__ float div(float a) const {
    const float q0 = __fmul_rn(a, r);
    return __fmaf_rn(r, __fmaf_rn(-d, q0, a), q0);
  }
};

// glu_math.h's SwiGLU glu_forward and glu_backward with the divisions of SiluDiv; each folds
// its r0's mantissa into `mantissas` (min: 0 if any was a power of two).
__device__ __forceinline__ float swiglu_fast(float g, float u, uint32_t& mantissas) {
  const SiluDiv q(g);
  mantissas = min(mantissas, q.r0_mantissa);
  return rn_mul(q.div(g), u);
}

__device__ __forceinline__ GluGrad dswiglu_fast(float da, float g, float u,
                                                uint32_t& mantissas) {
  const SiluDiv q(g);
  mantissas = min(mantissas, q.r0_mantissa);
  const float s = q.div(1.0f);
  const float dsilu = rn_mul(s, rn_add(1.0f, rn_mul(g, rn_sub(1.0f, s))));
  return {rn_mul(rn_mul(da, u), dsilu), rn_mul(da, q.div(g))};
}

// The forward's values of one load: a = round(act(g) * u) for each of its N columns.
template <typename S, typename T, GluAct kAct, bool kFastDiv>
struct GluFwdValues {
  static_assert(!kFastDiv || kAct == GluAct::kSwiglu, "the divisions are SwiGLU's");
  typename S::Frag gate[S::kLoads], up[S::kLoads];

  __device__ __forceinline__ GluFwdValues(const GluArgs<T>& a, const TileGrid<S>& g,
                                          const TilePos& t) {
    load_half(a.h, 2 * a.cols, g, t, gate);
    load_half(a.h + a.cols, 2 * a.cols, g, t, up);
  }

  __device__ __forceinline__ auto operator()(int l) const {
    struct Row {
      float v[S::N];
      __device__ __forceinline__ float operator()(int k) const { return v[k]; }
    } row;
    float g[S::N], u[S::N];
    frag_to_floats<S, T>(gate[l], g);
    frag_to_floats<S, T>(up[l], u);
    uint32_t mantissas = 0;
    if (kFastDiv && fast_gates(g)) {
      mantissas = ~0u;
#pragma unroll
      for (int k = 0; k < S::N; ++k) row.v[k] = round_to<T>(swiglu_fast(g[k], u[k], mantissas));
    }
    if (mantissas == 0) {  // the division's own path
#pragma unroll
      for (int k = 0; k < S::N; ++k) row.v[k] = round_to<T>(glu_forward<kAct>(g[k], u[k]));
    }
    return row;
  }
};

// kFastDiv: SwiGLU only (above).
template <typename T, bool kE4M3, GluAct kAct, bool kFastDiv>
__global__ void __launch_bounds__(kTileThreads)
    glu_fwd_v2_kernel(GluArgs<T> a, int64_t first_tile) {
  using S = TileShape<T, true>;
  __shared__ SharedTile<true> tile;
  __shared__ float partial[1][S::kCols];  // finish_tile's, unused without dbias
  const TileGrid<S> g(a.rows, a.cols);
  const TilePos t = g.at(first_tile + blockIdx.x);
  const float scale = *a.scale;
  float amax = 0.0f, col_sum[S::N];
  const GluFwdValues<S, T, kAct, kFastDiv> values(a, g, t);
  cast_rows<S, kE4M3, false, true, true>(values, a.out, g, t, tile, scale, amax, col_sum);
  finish_tile<S, false, true, false, true>(a, g, t, tile, partial, col_sum, amax, scale);
}

// 16-bit inputs without dbias: at most 80 registers, three blocks per SM as the first kernel
// has (the written-out divisions would take 83 and two blocks); otherwise two, as it has.
template <typename T, bool kDbias>
constexpr int kGluBwdBlocksPerSm = sizeof(T) == 4 || kDbias ? 2 : 3;

template <typename T, bool kE4M3, GluAct kAct, bool kDbias, bool kFastDiv>
__global__ void __launch_bounds__(kTileThreads, kGluBwdBlocksPerSm<T, kDbias>)
    glu_bwd_v2_kernel(GluArgs<T> a, int64_t first_tile) {
  static_assert(!kFastDiv || kAct == GluAct::kSwiglu, "the divisions are SwiGLU's");
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
    GluGrad d[S::N];
    uint32_t mantissas = 0;
    if (kFastDiv && fast_gates(fg)) {
      mantissas = ~0u;
#pragma unroll
      for (int k = 0; k < S::N; ++k) d[k] = dswiglu_fast(fd[k], fg[k], fu[k], mantissas);
    }
    if (mantissas == 0) {  // the division's own path
#pragma unroll
      for (int k = 0; k < S::N; ++k) d[k] = glu_backward<kAct>(fd[k], fg[k], fu[k]);
    }
#pragma unroll
    for (int k = 0; k < S::N; ++k) {
      vg[k] = round_to<T>(d[k].dg);
      vu[k] = round_to<T>(d[k].du);
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

template <typename T, bool kE4M3, GluAct kAct, bool kFastDiv>
Status launch_fwd_v2(const GluArgs<T>& a, cudaStream_t stream) {
  using S = TileShape<T, true>;
  return launch_tiles(TileGrid<S>(a.rows, a.cols).num_tiles, "glu_fwd_v2_kernel",
                      [&](int blocks, int64_t first) {
                        glu_fwd_v2_kernel<T, kE4M3, kAct, kFastDiv>
                            <<<blocks, kTileThreads, 0, stream>>>(a, first);
                      });
}

template <typename T, bool kE4M3, GluAct kAct, bool kDbias, bool kFastDiv>
Status launch_bwd_v2(GluArgs<T> a, bool dbias_in_kernel, cudaStream_t stream) {
  using S = TileShape<T, true>;
  const TileGrid<S> grid(a.rows, a.cols);
  a.counters = kDbias && dbias_in_kernel ? dbias_counters(stream, grid.tiles_c) : nullptr;
  const Status st = launch_tiles(grid.num_tiles, "glu_bwd_v2_kernel", [&](int blocks,
                                                                          int64_t first) {
    glu_bwd_v2_kernel<T, kE4M3, kAct, kDbias, kFastDiv>
        <<<blocks, kTileThreads, 0, stream>>>(a, first);
  });
  if (!kDbias || !st.ok() || a.counters != nullptr) return st;
  return launch_dbias_reduce<T>(a.workspace, a.dbias, ceil_div(a.rows, S::kRows), 2 * a.cols,
                                stream);
}

}  // namespace graphfp8::cuda
