// CUDA: the GLU activation (SwiGLU, GeGLU) fused with the FP8 cast-transpose of its output, and
// its backward fused with the FP8 cast-transpose of the fc1 gradient and dbias (glu.h has the
// contract, glu_math.h the math):
//
//   glu_fwd:  h = [g | u] (rows, 2F) -> a = act(g) * u: out (rows, F), out_t (F, rows), amax
//   glu_bwd:  da (rows, F), h -> dh = [dg | du]: out (rows, 2F), out_t (2F, rows), amax, dbias
//
// Values are computed in fp32 and rounded to the input dtype before they are scaled, folded into
// amax or summed, like the other fused cast-transposes (cast_transpose.cu).
//
// Grid: one 256-thread block per tile of tile.cuh (128x64 vector tiles, 64x64 scalar ones) of the
// (rows, F) grid of a and da, block b taking tile first_tile + b. A block loads columns
// c0..c0+63 of g, u (and da) for its rows, so every input element is read once: the forward
// writes one FP8 tile and, through a shared tile, its transpose; the backward writes dg's tile at
// columns c0.. and du's at F + c0.. of dh, and both transposes through two shared tiles.
// dbias: per-thread column sums in registers, added per block in a fixed order in shared memory
// into one row of an fp32 workspace per row of tiles, then summed by dbias.cuh's kernel or (kernel
// switch DBIAS_IN_KERNEL) by the last block of each column of tiles.
// Kernel switch GLU_V2: vector tiles take glu_v2.cuh's kernels instead (the same bytes).
#include "../dtype_switch.h"
#include "../glu.h"
#include "glu_tile.cuh"
#include "glu_v2.cuh"

namespace graphfp8 {
namespace {

using cuda::GluArgs;
using cuda::kTileThreads;
using cuda::load_half;
using cuda::round_to;

template <typename T, bool kE4M3, GluAct kAct, bool kVec>
__global__ void __launch_bounds__(kTileThreads) glu_fwd_kernel(GluArgs<T> a, int64_t first_tile) {
  using S = cuda::TileShape<T, kVec>;
  __shared__ cuda::SharedTile<kVec> tile;
  const cuda::TileGrid<S> g(a.rows, a.cols);
  const cuda::TilePos t = g.at(first_tile + blockIdx.x);
  const float scale = *a.scale;
  typename S::Frag gate[S::kLoads], up[S::kLoads];
  load_half(a.h, 2 * a.cols, g, t, gate);
  load_half(a.h + a.cols, 2 * a.cols, g, t, up);
  float amax = 0.0f;
  const int64_t gc = t.c0 + S::col();
#pragma unroll
  for (int l = 0; l < S::kLoads; ++l) {
    const int r = S::row(l);
    const int64_t gr = t.r0 + r;
    if (!g.in(gr, gc)) continue;  // vector tiles: F % 16 == 0, so all N columns are in range
    float fg[S::N], fu[S::N];
    cuda::frag_to_floats<S, T>(gate[l], fg);
    cuda::frag_to_floats<S, T>(up[l], fu);
    uint8_t q[S::N];
#pragma unroll
    for (int k = 0; k < S::N; ++k) {
      const float v = round_to<T>(glu_forward<kAct>(fg[k], fu[k]));
      amax = fmaxf(amax, fabsf(v));
      q[k] = cuda::quantize<kE4M3>(v * scale);
    }
    cuda::store_bytes<S::N>(a.out + gr * a.cols + gc, q);
    cuda::stage<S>(tile, r, q);
  }
  __syncthreads();
  cuda::store_transposed(tile, a.out_t, g, t);
  cuda::amax_epilogue(amax, a.amax, a.scale_inv, scale);
}

template <typename T, bool kE4M3, GluAct kAct, bool kDbias, bool kVec>
__global__ void __launch_bounds__(kTileThreads) glu_bwd_kernel(GluArgs<T> a, int64_t first_tile) {
  using S = cuda::TileShape<T, kVec>;
  __shared__ cuda::SharedTile<kVec> tile_g, tile_u;
  __shared__ float partial[kDbias ? S::kRowGroups : 1][2 * S::kCols];
  const cuda::TileGrid<S> g(a.rows, a.cols);
  const cuda::TilePos t = g.at(first_tile + blockIdx.x);
  const float scale = *a.scale;
  typename S::Frag grad[S::kLoads], gate[S::kLoads], up[S::kLoads];
  cuda::load_tile(a.da, g, t, grad);
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
    if (!g.in(gr, gc)) continue;
    float fd[S::N], fg[S::N], fu[S::N];
    cuda::frag_to_floats<S, T>(grad[l], fd);
    cuda::frag_to_floats<S, T>(gate[l], fg);
    cuda::frag_to_floats<S, T>(up[l], fu);
    uint8_t q_g[S::N], q_u[S::N];
#pragma unroll
    for (int k = 0; k < S::N; ++k) {
      const GluGrad d = glu_backward<kAct>(fd[k], fg[k], fu[k]);
      const float dg = round_to<T>(d.dg), du = round_to<T>(d.du);
      amax = fmaxf(amax, fmaxf(fabsf(dg), fabsf(du)));
      q_g[k] = cuda::quantize<kE4M3>(dg * scale);
      q_u[k] = cuda::quantize<kE4M3>(du * scale);
      if constexpr (kDbias) {
        col_g[k] += dg;
        col_u[k] += du;
      }
    }
    uint8_t* row = a.out + gr * 2 * a.cols;
    cuda::store_bytes<S::N>(row + gc, q_g);
    cuda::store_bytes<S::N>(row + a.cols + gc, q_u);
    cuda::stage<S>(tile_g, r, q_g);
    cuda::stage<S>(tile_u, r, q_u);
  }
  if constexpr (kDbias) {
    cuda::write_partials<S>(col_g, col_u, partial, a.workspace, a.cols, t);
  }
  __syncthreads();
  cuda::store_transposed(tile_g, a.out_t, g, t);
  cuda::store_transposed(tile_u, a.out_t + a.cols * a.rows, g, t);
  cuda::amax_epilogue(amax, a.amax, a.scale_inv, scale);
  if constexpr (kDbias) {
    if (a.counters != nullptr) cuda::glu_dbias_finish<S>(a, t);
  }
}

template <typename T, bool kE4M3, GluAct kAct, bool kVec>
Status launch_fwd(const GluArgs<T>& a, cudaStream_t stream) {
  using S = cuda::TileShape<T, kVec>;
  return cuda::launch_tiles(cuda::TileGrid<S>(a.rows, a.cols).num_tiles, "glu_fwd_kernel",
                            [&](int blocks, int64_t first) {
                              glu_fwd_kernel<T, kE4M3, kAct, kVec>
                                  <<<blocks, kTileThreads, 0, stream>>>(a, first);
                            });
}

template <typename T, bool kE4M3, GluAct kAct, bool kDbias, bool kVec>
Status launch_bwd(GluArgs<T> a, bool dbias_in_kernel, cudaStream_t stream) {
  using S = cuda::TileShape<T, kVec>;
  const cuda::TileGrid<S> grid(a.rows, a.cols);
  a.counters = kDbias && dbias_in_kernel ? cuda::dbias_counters(stream, grid.tiles_c) : nullptr;
  const Status st = cuda::launch_tiles(
      grid.num_tiles, "glu_bwd_kernel", [&](int blocks, int64_t first) {
        glu_bwd_kernel<T, kE4M3, kAct, kDbias, kVec><<<blocks, kTileThreads, 0, stream>>>(a, first);
      });
  if (!kDbias || !st.ok() || a.counters != nullptr) return st;
  return cuda::launch_dbias_reduce<T>(a.workspace, a.dbias, cuda::ceil_div(a.rows, S::kRows),
                                      2 * a.cols, stream);
}

template <typename T, bool kE4M3, GluAct kAct, bool kFastDiv>
Status dispatch_v2(const GluArgs<T>& a, const GluParams& p, bool backward,
                   cudaStream_t stream) {
  if (!backward) return cuda::launch_fwd_v2<T, kE4M3, kAct, kFastDiv>(a, stream);
  const bool dbias = p.dbias != nullptr;
  GRAPHFP8_SWITCH_BOOL(dbias, kDbias,
    return cuda::launch_bwd_v2<T, kE4M3, kAct, kDbias, kFastDiv>(a, p.dbias_in_kernel, stream);)
  return Status{};
}

template <typename T, bool kE4M3, GluAct kAct>
Status dispatch(const GluParams& p, bool backward, cudaStream_t stream) {
  const GluArgs<T> a{static_cast<const T*>(p.x), static_cast<const T*>(p.dy),
                     static_cast<uint8_t*>(p.out), static_cast<uint8_t*>(p.out_t), p.scale,
                     p.scale_inv, p.amax, p.workspace, static_cast<T*>(p.dbias), nullptr,
                     p.rows, p.cols};
  const bool vec = cuda::vec_tiles_ok(p.rows, p.cols, p.x, p.dy, p.out, p.out_t);
  const bool dbias = p.dbias != nullptr;
  if (vec && p.v2) {  // glu_v2.cuh: vector tiles only; its divisions SwiGLU's only
    if constexpr (kAct == GluAct::kSwiglu) {
      if (p.v2_div) return dispatch_v2<T, kE4M3, kAct, true>(a, p, backward, stream);
    }
    return dispatch_v2<T, kE4M3, kAct, false>(a, p, backward, stream);
  }
  if (!backward) {
    GRAPHFP8_SWITCH_BOOL(vec, kVec, return launch_fwd<T, kE4M3, kAct, kVec>(a, stream);)
  }
  GRAPHFP8_SWITCH_BOOL(vec, kVec,
    GRAPHFP8_SWITCH_BOOL(dbias, kDbias,
      return launch_bwd<T, kE4M3, kAct, kDbias, kVec>(a, p.dbias_in_kernel, stream);))
  return Status{};
}

Status run(const GluParams& p, bool backward, void* stream_ptr) {
  if (backward && p.dbias != nullptr && p.workspace == nullptr) {
    return Status{"glu_bwd", "a fused dbias needs its fp32 workspace"};
  }
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  GRAPHFP8_SWITCH_HP(p.dtype, "glu", T,
    GRAPHFP8_SWITCH_FP8(p.out_dtype, "glu", kE4M3,
      if (p.act == GluAct::kSwiglu) return dispatch<T, kE4M3, GluAct::kSwiglu>(p, backward, stream);
      return dispatch<T, kE4M3, GluAct::kGeglu>(p, backward, stream);))
  return Status{};
}

}  // namespace

Status glu_fwd_cuda(const GluParams& p, void* stream) { return run(p, false, stream); }

Status glu_bwd_cuda(const GluParams& p, void* stream) { return run(p, true, stream); }

}  // namespace graphfp8
