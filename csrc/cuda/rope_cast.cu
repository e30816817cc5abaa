// CUDA: RoPE's backward fused into the FP8 cast-transpose of the fused QKV gradient (rope_cast.h
// has the math; kernel switch ROPE_CAST_BWD chooses it in graphfp8/modules/_qkv_rope.py).
//
// cast_transpose_kernel (cast_transpose.cu) on the 128 x 64 vector tiles of tile.cuh over the
// fused gradient (batch * seq, (heads + 2 * kv_heads) * head_dim), with one change: the thread's
// 16-byte loads come from dq, dk or dv (the tile column's head), and for dq and dk also the
// partner vector of the other half of the head (columns i +- head_dim / 2: the same tile at
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
#include "dbias.cuh"
#include "fp8_util.cuh"
#include "rope_math.cuh"
#include "tile.cuh"
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

// Stores 1 or 2 words of FP8 bytes with one aligned store (the paired path, as cast_transpose.cu).
template <int kWords>
__device__ __forceinline__ void store_words(uint8_t* dst, const uint32_t (&w)[kWords]) {
  if constexpr (kWords == 2) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
  } else {
    static_assert(kWords == 1, "8 or 4 bytes per load");
    *reinterpret_cast<uint32_t*>(dst) = w[0];
  }
}

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
#pragma unroll
  for (int l = 0; l < S::kLoads; ++l) {
    const int r = S::row(l);
    const int64_t gr = t.r0 + r;
    if (!g.in(gr, gc)) continue;
#pragma unroll
    for (int k = 0; k < S::N; ++k) {
      amax = fmaxf(amax, fabsf(v[l][k]));
      if constexpr (kDbias) col_sum[k] += v[l][k];
    }
    if constexpr (kAmaxOnly) continue;
    if constexpr (kPaired) {
      uint32_t w[S::N / 4];
#pragma unroll
      for (int m = 0; m < S::N / 4; ++m) {
        w[m] = cuda::quantize4<kE4M3>(v[l][4 * m] * scale, v[l][4 * m + 1] * scale,
                                      v[l][4 * m + 2] * scale, v[l][4 * m + 3] * scale);
      }
      store_words(a.out + gr * a.cols + gc, w);
      store_words(tile.at(r, S::col()), w);
    } else {
      uint8_t q[S::N];
#pragma unroll
      for (int k = 0; k < S::N; ++k) q[k] = cuda::quantize<kE4M3>(v[l][k] * scale);
      cuda::store_bytes<S::N>(a.out + gr * a.cols + gc, q);
      cuda::stage<S>(tile, r, q);
    }
  }
  if constexpr (kAmaxOnly) {
    cuda::block_amax_atomic(amax, a.amax);
    return;
  }
  if constexpr (kDbias) {
#pragma unroll
    for (int k = 0; k < S::N; ++k) partial[S::group()][S::col() + k] = col_sum[k];
  }
  __syncthreads();
  if constexpr (kPaired) {
    cuda::store_transposed_words(tile, a.out_t, g, t);
  } else {
    cuda::store_transposed(tile, a.out_t, g, t);
  }
  if constexpr (kDbias) {
    const int c = threadIdx.x;
    if (c < S::kCols && t.c0 + c < a.cols) {
      float s = 0.0f;
      for (int grp = 0; grp < S::kRowGroups; ++grp) s += partial[grp][c];
      a.workspace[t.tile_r * a.cols + t.c0 + c] = s;
    }
  }
  cuda::cast_epilogue<kCurrent>(amax, a.amax, a.scale_inv, scale);
  if constexpr (kDbias) {
    if (a.counters != nullptr) {
      const int64_t c0 = t.c0, cols = a.cols;
      cuda::dbias_finish(a.workspace, a.dbias, a.counters + t.c0 / S::kCols,
                         cuda::ceil_div(a.rows, S::kRows), a.cols, S::kCols,
                         [=](int i) { return c0 + i < cols ? c0 + i : int64_t{-1}; });
    }
  }
}

template <typename T, bool kE4M3, bool kDbias, bool kCurrent, bool kPaired, bool kAmaxOnly>
Status launch_variant(RopeTileArgs<T> a, bool dbias_in_kernel, cudaStream_t stream) {
  using S = cuda::TileShape<T, true>;
  const cuda::TileGrid<S> grid(a.rows, a.cols);
  a.counters = kDbias && dbias_in_kernel ? cuda::dbias_counters(stream, grid.tiles_c) : nullptr;
  const Status st = cuda::launch_tiles(
      grid.num_tiles, "rope_cast_kernel", [&](int blocks, int64_t first) {
        rope_cast_kernel<T, kE4M3, kDbias, kCurrent, kPaired, kAmaxOnly>
            <<<blocks, kTileThreads, 0, stream>>>(a, first);
      });
  if (!kDbias || !st.ok() || a.counters != nullptr) return st;
  return cuda::launch_dbias_reduce<T>(a.workspace, a.dbias, cuda::ceil_div(a.rows, S::kRows),
                                      a.cols, stream);
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
