// CUDA: FP8 transpose, out_t = x^T for an FP8 x (rows, cols), guarded by a device noop flag (when
// *noop == 1 nothing is written, so a graph can hold it and skip it on later microbatches).
//
// The cast-transpose tile machinery of tile.cuh with the cast left out: a block loads a tile's
// bytes (16-byte loads on the vector shape), stages them in the shared tile and writes the
// transpose; one block per tile, block b taking tile first_tile + b, like cast_transpose.
#include "../common.h"
#include "../dtype_switch.h"
#include "fp8_util.cuh"
#include "tile.cuh"
#include "vec.cuh"

namespace graphfp8 {
namespace {

using cuda::kTileThreads;

struct TransposeArgs {
  const uint8_t* __restrict__ x;
  uint8_t* __restrict__ out_t;
  const float* noop;
  int64_t rows;
  int64_t cols;
};

template <bool kNoop, bool kVec>
__global__ void __launch_bounds__(kTileThreads)
    fp8_transpose_kernel(TransposeArgs a, int64_t first_tile) {
  using S = cuda::TileShape<uint8_t, kVec>;
  if constexpr (kNoop) {
    if (*a.noop == 1.0f) return;
  }
  __shared__ cuda::SharedTile<kVec> tile;
  const cuda::TileGrid<S> g(a.rows, a.cols);
  const cuda::TilePos t = g.at(first_tile + blockIdx.x);
  typename S::Frag raw[S::kLoads];
  cuda::load_tile(a.x, g, t, raw);
  const int64_t gc = t.c0 + S::col();
#pragma unroll
  for (int l = 0; l < S::kLoads; ++l) {
    if (!g.in(t.r0 + S::row(l), gc)) continue;
    uint8_t q[S::N];
    cuda::frag_to_bytes<S>(raw[l], q);
    cuda::stage<S>(tile, S::row(l), q);
  }
  __syncthreads();
  cuda::store_transposed(tile, a.out_t, g, t);
}

template <bool kNoop, bool kVec>
Status launch(const TransposeArgs& a, cudaStream_t stream) {
  using S = cuda::TileShape<uint8_t, kVec>;
  return cuda::launch_tiles(cuda::TileGrid<S>(a.rows, a.cols).num_tiles, "fp8_transpose_kernel",
                            [&](int blocks, int64_t first) {
                              fp8_transpose_kernel<kNoop, kVec>
                                  <<<blocks, kTileThreads, 0, stream>>>(a, first);
                            });
}

}  // namespace

Status transpose_cuda(const TransposeParams& p, void* stream_ptr) {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  const TransposeArgs a{p.x, p.out_t, p.noop, p.rows, p.cols};
  const bool vec = cuda::vec_tiles_ok(p.rows, p.cols, p.x, p.out_t);
  GRAPHFP8_SWITCH_BOOL(p.noop != nullptr, kNoop,
    if (vec) return launch<kNoop, true>(a, stream);
    return launch<kNoop, false>(a, stream);)
}

}  // namespace graphfp8
