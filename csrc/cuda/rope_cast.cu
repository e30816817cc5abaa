// CUDA: RoPE's backward fused into the FP8 cast-transpose of the fused QKV gradient (rope_cast.h
// has the math; kernel switch ROPE_CAST_BWD chooses it in graphfp8/modules/_qkv_rope.py).
//
// The tile cast of cast_transpose.cu (tile_cast.cuh) on the 128 x 64 vector tiles of tile.cuh
// over the fused gradient (batch * seq, (heads + 2 * kv_heads) * head_dim), with one change: the
// thread's 16-byte loads come from dq, dk or dv (the tile column's head), and for dq and dk also
// the partner vector of the other half of the head (columns i +- head_dim / 2: the same tile at
// head_dim 64, the next one at 128, so from L1 or L2), rotated back with rope_math.cuh's
// arithmetic and rounded to the gradient's dtype as rope_fp8.cu's backward writes it. Everything
// after that value - the FP8 bytes, the shared tile and its transposed stores, amax, the dbias
// partials in the same thread / group / tile order, the current-scaling scale - is the cast's,
// so switch on equals switch off bit for bit. kAmaxOnly: the amax pass of current scaling (no
// stores, amax folded into the slot's H[0]).
// Applies where every load is a whole 16-byte vector within one half of a head: rows % 16 == 0,
// head_dim % (2 * 16 / sizeof(T)) == 0, 16-byte-aligned gradients and outputs (the caller checks:
// graphfp8/ops/rope_cast.py); the launcher refuses the rest.
#include "../common.h"
#include "../dtype_switch.h"
#include "../rope_cast.h"
#include "current_scale.cuh"
#include "fp8_util.cuh"
#include "rope_math.cuh"
#include "tile.cuh"
#include "tile_cast.cuh"
#include "vec.cuh"

namespace graphfp8 {
namespace {

using cuda::kTileThreads;

template <typename T>
struct RopeTileArgs {
  const T* grad[3];
  const float* cos;  // nullptr: no rotation
  const float* sin;
  int64_t seq, heads, kv_heads, head_dim;
  uint8_t* out;      // (rows, cols) FP8
  uint8_t* out_t;    // (cols, rows) FP8
  const float* scale;
  float* scale_inv;
  float* amax;
  float* workspace;  // (row tiles, cols) fp32 column partials (kDbias)
  T* dbias;          // (cols,) (kDbias)
  int* counters;     // (column tiles,) zeros: reduce in-kernel (kDbias), or nullptr
  int64_t rows, cols;
  CurrentScale current;
};

// The N gradient values of row gr, columns gc .. gc + N - 1 of the fused gradient, rotated back
// (q and k) and rounded to T, as floats. The loads are issued before any value is used.
template <typename S, typename T>
__device__ __forceinline__ void load_rotated(const RopeTileArgs<T>& a, int64_t gr, int64_t gc,
                                             float (&v)[S::N]) {
  const int64_t j = gc / a.head_dim;
  const int64_t i = gc % a.head_dim;
  const int64_t half = a.head_dim / 2;
  const RopeHead h = rope_head(j, a.heads, a.kv_heads);
  const T* base = a.grad[h.part] + (gr * h.part_heads + h.head) * a.head_dim;
  const uint4 own = __ldg(reinterpret_cast<const uint4*>(base + i));
  const bool rotated = h.part < 2 && a.cos != nullptr;
  const bool low = i < half;
  uint4 other = own;
  if (rotated) other = __ldg(reinterpret_cast<const uint4*>(base + (low ? i + half : i - half)));
  float f[S::N], p[S::N];
  cuda::frag_to_floats<S, T>(own, f);
  if (!rotated) {
#pragma unroll
    for (int k = 0; k < S::N; ++k) v[k] = f[k];
    return;
  }
  cuda::frag_to_floats<S, T>(other, p);
  const int64_t lo0 = (low ? i : i - half) + (gr % a.seq) * a.head_dim;  // the pair's low index
#pragma unroll
  for (int k = 0; k < S::N; ++k) {
    const int64_t at = lo0 + k;
    const float c_lo = __ldg(a.cos + at), c_hi = __ldg(a.cos + at + half);
    const float n_lo = __ldg(a.sin + at), n_hi = __ldg(a.sin + at + half);
    const RopePair r = low ? rope_rotate(f[k], p[k], c_lo, c_hi, n_lo, n_hi, true)
                           : rope_rotate(p[k], f[k], c_lo, c_hi, n_lo, n_hi, true);
    v[k] = cuda::to_float(cuda::from_float<T>(low ? r.lo : r.hi));
  }
}

template <typename T, bool kE4M3, bool kDbias, bool kCurrent, bool kPaired, bool kAmaxOnly>
__global__ void __launch_bounds__(kTileThreads)
    rope_cast_kernel(RopeTileArgs<T> a, int64_t first_tile) {
  using S = cuda::TileShape<T, true>;
  float scale = 0.0f;
  if constexpr (kCurrent) scale = cuda::cast_scale<true>(a.scale, a.current);
  if constexpr (!kCurrent && !kAmaxOnly) scale = *a.scale;
  __shared__ cuda::SharedTile<true> tile;
  __shared__ float partial[kDbias ? S::kRowGroups : 1][S::kCols];
  const cuda::TileGrid<S> g(a.rows, a.cols);
  const cuda::TilePos t = g.at(first_tile + blockIdx.x);
  float amax = 0.0f;
  float col_sum[S::N];
#pragma unroll
  for (int k = 0; k < S::N; ++k) col_sum[k] = 0.0f;
  const int64_t gc = t.c0 + S::col();
  float v[S::kLoads][S::N];
#pragma unroll
  for (int l = 0; l < S::kLoads; ++l) {
    const int64_t gr = t.r0 + S::row(l);
    if (g.in(gr, gc)) load_rotated<S, T>(a, gr, gc, v[l]);
  }
  if constexpr (kAmaxOnly) {
#pragma unroll
    for (int l = 0; l < S::kLoads; ++l) {
      if (!g.in(t.r0 + S::row(l), gc)) continue;
#pragma unroll
      for (int k = 0; k < S::N; ++k) amax = fmaxf(amax, fabsf(v[l][k]));
    }
    cuda::block_amax_atomic(amax, a.amax);
    return;
  }
  const auto values = [&](int l) { return [&v, l](int k) { return v[l][k]; }; };
  cuda::cast_rows<S, kE4M3, kDbias, true, kPaired>(values, a.out, g, t, tile, scale, amax,
                                                   col_sum);
  cuda::finish_tile<S, kDbias, true, kCurrent, kPaired>(a, g, t, tile, partial, col_sum, amax,
                                                        scale);
}

template <typename T, bool kE4M3, bool kDbias, bool kCurrent, bool kPaired, bool kAmaxOnly>
Status launch_variant(RopeTileArgs<T> a, bool dbias_in_kernel, cudaStream_t stream) {
  using S = cuda::TileShape<T, true>;
  return cuda::launch_tile_cast<S, T, kDbias>(
      a, dbias_in_kernel, stream, "rope_cast_kernel", [&](int blocks, int64_t first) {
        rope_cast_kernel<T, kE4M3, kDbias, kCurrent, kPaired, kAmaxOnly>
            <<<blocks, kTileThreads, 0, stream>>>(a, first);
      });
}

template <typename T, bool kE4M3>
Status dispatch(const RopeCastParams& p, cudaStream_t stream) {
  const CastParams& c = p.fused.cast;
  using S = cuda::TileShape<T, true>;
  bool ok = c.rows % 16 == 0 && p.head_dim % (2 * S::N) == 0 &&
            cuda::vec_tiles_ok(c.rows, c.cols, c.out, c.out_t);
  for (const void* g : p.grad) ok = ok && cuda::aligned16(g);
  if (!ok) {
    return Status{"rope_cast_kernel",
                  "needs rows % 16 == 0, head_dim % (32 / element size) == 0 and 16-byte-aligned "
                  "tensors"};
  }
  const RopeTileArgs<T> a{{static_cast<const T*>(p.grad[0]), static_cast<const T*>(p.grad[1]),
                           static_cast<const T*>(p.grad[2])},
                          p.cos, p.sin, p.seq, p.heads, p.kv_heads, p.head_dim,
                          static_cast<uint8_t*>(c.out), static_cast<uint8_t*>(c.out_t),
                          c.scale, c.scale_inv, c.amax, p.fused.workspace,
                          static_cast<T*>(p.fused.dbias), nullptr, c.rows, c.cols, c.current};
  const bool ik = p.fused.dbias_in_kernel;
  if (c.out == nullptr) return launch_variant<T, kE4M3, false, false, false, true>(a, false, stream);
  GRAPHFP8_SWITCH_BOOL(p.fused.dbias != nullptr, kDbias,
    GRAPHFP8_SWITCH_BOOL(c.current.on(), kCurrent,
      if (c.paired_quantize) {
        return launch_variant<T, kE4M3, kDbias, kCurrent, true, false>(a, ik, stream);
      }
      return launch_variant<T, kE4M3, kDbias, kCurrent, false, false>(a, ik, stream);))
  return Status{};
}

}  // namespace

Status rope_cast_cuda(const RopeCastParams& p, void* stream_ptr) {
  if (p.fused.dbias != nullptr && p.fused.workspace == nullptr) {
    return Status{"rope_cast_kernel", "a fused dbias needs its fp32 workspace"};
  }
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  GRAPHFP8_SWITCH_HP(p.fused.cast.x_dtype, "rope_cast_kernel", T,
    GRAPHFP8_SWITCH_FP8(p.fused.cast.out_dtype, "rope_cast_kernel", kE4M3,
      return dispatch<T, kE4M3>(p, stream);))
  return Status{};
}

}  // namespace graphfp8
