// CUDA: the one cast-transpose kernel. For f in {identity, gelu_tanh, dgelu_tanh} (common.h):
//
//   cast_transpose:              f = x                       (noop flag optional)
//   cast_transpose_dbias:        f = dy                      and dbias = sum_rows f
//   gelu_cast_transpose:         f = gelu_tanh(x)
//   dgelu_cast_transpose_dbias:  f = dy * gelu_tanh'(x)      and dbias = sum_rows f
//
// out = saturate(f * scale) (rows, cols), out_t = out^T (cols, rows), amax = max(amax, max |f|),
// scale_inv = 1 / scale. f is computed in fp32 and rounded to the input dtype first, as torch's
// activation kernels store it, so each fused op equals "torch activation, then cast_transpose".
// With the noop flag set (*noop == 1) the kernel returns before touching anything, so a graph can
// hold the weight cast and skip it on later microbatches. The kCurrent variants compute their
// scale from the slot's amax first (current_scale.cuh; also under a set noop flag) and fold no
// amax.
//
// Grid: one 256-thread block per tile of tile.cuh (128x64 vector tiles, 64x64 scalar ones),
// block b taking tile first_tile + b (tile.cuh's launch_tiles). A thread loads all its vectors of
// the tile, writes the row-major FP8 bytes and the shared tile; after a barrier the block writes
// the tile's transpose (tile_cast.cuh, shared with rope_cast.cu: only the values differ).
//
// dbias: no atomics in the sums, so they are deterministic (graphed and eager runs agree bit for
// bit). Each thread sums its own rows per column in registers in row order; the block adds those
// partials in a fixed order in shared memory and writes row tile_r of an fp32 workspace
// (row tiles, cols); the workspace rows of each column are then summed in order and rounded to
// dbias's dtype by a second kernel, or (kernel switch DBIAS_IN_KERNEL) by the last block of each
// column of tiles (dbias.cuh).
#include "../common.h"
#include "../dtype_switch.h"
#include "current_scale.cuh"
#include "fp8_util.cuh"
#include "fused_act.cuh"
#include "tile.cuh"
#include "tile_cast.cuh"
#include "vec.cuh"

namespace graphfp8 {
namespace {

using cuda::kTileThreads;

template <typename InT>
struct TileArgs {
  const InT* __restrict__ x;       // (rows, cols): dy for kNone / kDgelu, the GELU input for kGelu
  const InT* __restrict__ act_in;  // (rows, cols): the GELU input (kDgelu only)
  uint8_t* __restrict__ out;       // (rows, cols) FP8
  uint8_t* __restrict__ out_t;     // (cols, rows) FP8
  const float* scale;
  float* scale_inv;
  float* amax;
  const float* noop;               // (1,), read only by the kNoop variant
  float* workspace;                // (row tiles, cols) fp32 column partials (kDbias)
  InT* dbias;                      // (cols,) (kDbias)
  int* counters;                   // (column tiles,) zeros: reduce in-kernel (kDbias), or nullptr
  int64_t rows;
  int64_t cols;
  CurrentScale current;            // read only by the kCurrent variants
};

// The values of the thread's loads of one tile: the loads issued first (ActValues(a, g, t)), then
// values(l)(k), element k of load l with the activation applied (rounded to InT as torch stores
// it).
template <typename S, typename InT, FusedAct kAct>
struct ActValues {
  static constexpr bool kHasActIn = kAct == FusedAct::kDgelu;
  typename S::Frag raw[S::kLoads];
  typename S::Frag raw_in[kHasActIn ? S::kLoads : 1];

  __device__ __forceinline__ ActValues(const TileArgs<InT>& a, const cuda::TileGrid<S>& g,
                                       const cuda::TilePos& t) {
    cuda::load_tile(a.x, g, t, raw);
    if constexpr (kHasActIn) cuda::load_tile(a.act_in, g, t, raw_in);
  }

  __device__ __forceinline__ auto operator()(int l) const {
    struct Row {
      float f[S::N];
      float h[S::N];
      __device__ __forceinline__ float operator()(int k) const {
        return cuda::apply_act<InT, kAct>(f[k], kHasActIn ? h[k] : 0.0f);
      }
    } row;
    cuda::frag_to_floats<S, InT>(raw[l], row.f);
    if constexpr (kHasActIn) cuda::frag_to_floats<S, InT>(raw_in[l], row.h);
    return row;
  }
};

template <typename InT, bool kE4M3, FusedAct kAct, bool kDbias, bool kNoop, bool kVec,
          bool kCurrent, bool kPaired>
__global__ void __launch_bounds__(kTileThreads)
    cast_transpose_kernel(TileArgs<InT> a, int64_t first_tile) {
  using S = cuda::TileShape<InT, kVec>;
  float scale = 0.0f;
  if constexpr (kCurrent) scale = cuda::cast_scale<true>(a.scale, a.current);
  if constexpr (kNoop) {
    if (*a.noop == 1.0f) return;
  }
  if constexpr (!kCurrent) scale = *a.scale;
  __shared__ cuda::SharedTile<kVec> tile;
  __shared__ float partial[kDbias ? S::kRowGroups : 1][S::kCols];
  const cuda::TileGrid<S> g(a.rows, a.cols);
  const cuda::TilePos t = g.at(first_tile + blockIdx.x);
  float amax = 0.0f;
  float col_sum[S::N];
#pragma unroll
  for (int k = 0; k < S::N; ++k) col_sum[k] = 0.0f;
  const ActValues<S, InT, kAct> values(a, g, t);
  cuda::cast_rows<S, kE4M3, kDbias, kVec, kPaired>(values, a.out, g, t, tile, scale, amax,
                                                   col_sum);
  cuda::finish_tile<S, kDbias, kVec, kCurrent, kPaired>(a, g, t, tile, partial, col_sum, amax,
                                                        scale);
}

template <typename InT, bool kE4M3, FusedAct kAct, bool kDbias, bool kNoop, bool kVec,
          bool kCurrent, bool kPaired>
Status launch_shape(TileArgs<InT> a, bool dbias_in_kernel, cudaStream_t stream) {
  using S = cuda::TileShape<InT, kVec>;
  return cuda::launch_tile_cast<S, InT, kDbias>(
      a, dbias_in_kernel, stream, "cast_transpose_kernel", [&](int blocks, int64_t first) {
        cast_transpose_kernel<InT, kE4M3, kAct, kDbias, kNoop, kVec, kCurrent, kPaired>
            <<<blocks, kTileThreads, 0, stream>>>(a, first);
      });
}

// The tile shape and the kernel variant: kCurrent (CurrentScale), kPaired (the kernel switch
// PAIRED_QUANTIZE, vector tiles only).
template <typename InT, bool kE4M3, FusedAct kAct, bool kDbias, bool kNoop>
Status launch(const TileArgs<InT>& a, const CastParams& cp, bool dbias_in_kernel,
              cudaStream_t stream) {
  const bool vec = cuda::vec_tiles_ok(a.rows, a.cols, a.x, a.act_in, a.out, a.out_t);
  const bool in_kernel = dbias_in_kernel;
  GRAPHFP8_SWITCH_BOOL(cp.current.on(), kCurrent,
    if (!vec) {
      return launch_shape<InT, kE4M3, kAct, kDbias, kNoop, false, kCurrent, false>(a, in_kernel,
                                                                                   stream);
    }
    if (cp.paired_quantize) {
      return launch_shape<InT, kE4M3, kAct, kDbias, kNoop, true, kCurrent, true>(a, in_kernel,
                                                                                 stream);
    }
    return launch_shape<InT, kE4M3, kAct, kDbias, kNoop, true, kCurrent, false>(a, in_kernel,
                                                                                stream);)
}

// The variants that the ops use: (activation, dbias, noop).
template <typename InT, bool kE4M3>
Status dispatch_variant(const FusedCastTransposeParams& p, cudaStream_t stream) {
  const CastParams& cp = p.cast;
  const TileArgs<InT> a{static_cast<const InT*>(cp.x), static_cast<const InT*>(p.act_in),
                        static_cast<uint8_t*>(cp.out), static_cast<uint8_t*>(cp.out_t),
                        cp.scale, cp.scale_inv, cp.amax, cp.noop, p.workspace,
                        static_cast<InT*>(p.dbias), nullptr, cp.rows, cp.cols, cp.current};
  const bool dbias = p.dbias != nullptr;
  const bool noop = cp.noop != nullptr;
  const bool ik = p.dbias_in_kernel;
  if (p.act == FusedAct::kNone && !dbias) {
    if (noop) return launch<InT, kE4M3, FusedAct::kNone, false, true>(a, cp, false, stream);
    return launch<InT, kE4M3, FusedAct::kNone, false, false>(a, cp, false, stream);
  }
  if (noop) return Status{"cast_transpose", "a noop flag only goes with the plain cast"};
  if (p.act == FusedAct::kNone && dbias) {
    return launch<InT, kE4M3, FusedAct::kNone, true, false>(a, cp, ik, stream);
  }
  if (p.act == FusedAct::kGelu && !dbias) {
    return launch<InT, kE4M3, FusedAct::kGelu, false, false>(a, cp, false, stream);
  }
  if (p.act == FusedAct::kDgelu && dbias) {
    return launch<InT, kE4M3, FusedAct::kDgelu, true, false>(a, cp, ik, stream);
  }
  return Status{"cast_transpose", "unsupported (activation, dbias) variant"};
}

}  // namespace

Status cast_transpose_fused_cuda(const FusedCastTransposeParams& p, void* stream_ptr) {
  if (p.dbias != nullptr && p.workspace == nullptr) {
    return Status{"cast_transpose", "a fused dbias needs its fp32 workspace"};
  }
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  GRAPHFP8_SWITCH_HP(p.cast.x_dtype, "cast_transpose", InT,
    GRAPHFP8_SWITCH_FP8(p.cast.out_dtype, "cast_transpose", kE4M3,
      return dispatch_variant<InT, kE4M3>(p, stream);))
  return Status{};
}

Status cast_transpose_cuda(const CastParams& p, void* stream) {
  return cast_transpose_fused_cuda(FusedCastTransposeParams{p, FusedAct::kNone, nullptr, nullptr,
                                                            nullptr, false},
                                   stream);
}

}  // namespace graphfp8
