// CUDA: the activations with a blockwise FP8 output (csrc/blockwise_act.h) in one pass: one
// 256-thread block per 128x128 region of a (rows, F) loads the region's x (GELU) or g and u (the
// two halves of x's rows, 2 F apart: SwiGLU, GeGLU), computes a with the per-tensor kernels' math
// (fused_act.cuh's GELU, glu_math.h's gated activations), rounds it to the input dtype and
// quantizes it with blockwise_io.cuh's tile loops (phase 1: each row's tile; phase 2, with
// out_t: the columns' tiles from shared memory). Per element of a: x read once (2 or 4 bytes of
// the dtype, twice that for the gated ones) and the FP8 layouts written, against the unfused
// path's x read, a written, a read (and the layouts written): the bf16 a is never written.
#include <atomic>

#include "../blockwise_act.h"
#include "../dtype_switch.h"
#include "../glu_math.h"
#include "blockwise_io.cuh"
#include "fp8_util.cuh"
#include "fused_act.cuh"
#include "vec.cuh"

namespace graphfp8 {
namespace {

using namespace cuda::blockwise;  // NOLINT: the shared tile constants and I/O

template <typename T, bool kE4M3, BlockAct kAct, bool kTranspose>
__global__ void __launch_bounds__(kThreads)
    block_act_kernel(const T* __restrict__ x, BlockOut dst, int64_t rows, int64_t cols,
                     bool vec_x, bool vec_out, bool vec_out_t) {
  extern __shared__ float tile[];  // [kTile][kStride]: a rounded to T, as floats
  __shared__ uint32_t part[2][kTile];
  const Region g = region(rows, cols);
  float f[kRowsPerWarp][4];
  if constexpr (kAct == BlockAct::kGelu) {
    load_rows(x, cols, g, vec_x, f);
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
#pragma unroll
      for (int k = 0; k < 4; ++k) f[i][k] = cuda::apply_act<T, FusedAct::kGelu>(f[i][k], 0.0f);
    }
  } else {
    constexpr GluAct kGlu = kAct == BlockAct::kSwiglu ? GluAct::kSwiglu : GluAct::kGeglu;
    float u[kRowsPerWarp][4];
    load_rows(x, 2 * cols, g, vec_x, f);
    load_rows(x + cols, 2 * cols, g, vec_x, u);
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        f[i][k] = cuda::to_float(cuda::from_float<T>(glu_forward<kGlu>(f[i][k], u[i][k])));
      }
    }
  }
  // act(0) is 0 (gelu_tanh(0) = 0, act(0) * 0 = 0): zeros outside the region stay zeros.
  quantize_rows<kE4M3>(f, tile, g, dst, vec_out);
  if constexpr (kTranspose) quantize_columns<kE4M3>(tile, part, g, dst, vec_out_t);
}

template <typename T, bool kE4M3, BlockAct kAct, bool kTranspose>
Status launch(const BlockActParams& p, cudaStream_t stream) {
  auto kernel = block_act_kernel<T, kE4M3, kAct, kTranspose>;
  static std::atomic<uint64_t> done{0};
  const Status st = allow_tile_smem(kernel, done, "block_act (shared memory)");
  if (!st.ok()) return st;
  // x's rows are F (GELU) or 2 F wide: aligned vector loads of g and u need F % 4 == 0 too.
  const bool vec_x = vec_rows(p.cols, p.x);
  kernel<<<region_grid(p.rows, p.cols), kThreads, kSmemBytes, stream>>>(
      static_cast<const T*>(p.x), p.dst, p.rows, p.cols, vec_x, vec_rows(p.cols, p.dst.out),
      vec_columns(p.rows, p.dst.out_t));
  return cuda::check_launch("block_act");
}

template <typename T, bool kE4M3, bool kTranspose>
Status launch_act(const BlockActParams& p, cudaStream_t stream) {
  switch (p.act) {
    case BlockAct::kGelu: return launch<T, kE4M3, BlockAct::kGelu, kTranspose>(p, stream);
    case BlockAct::kSwiglu: return launch<T, kE4M3, BlockAct::kSwiglu, kTranspose>(p, stream);
    case BlockAct::kGeglu: return launch<T, kE4M3, BlockAct::kGeglu, kTranspose>(p, stream);
  }
  return Status{"block_act", "unknown activation"};
}

}  // namespace

Status block_act_cuda(const BlockActParams& p, void* stream_ptr) {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  if (cuda::ceil_div(p.cols, kTile) > 65535) {
    return Status{"block_act", "more than 65535 column tiles"};
  }
  GRAPHFP8_SWITCH_HP(p.dtype, "block_act", T,
    GRAPHFP8_SWITCH_FP8(p.dst.out_dtype, "block_act", kE4M3,
      GRAPHFP8_SWITCH_BOOL(p.dst.out_t != nullptr, kTranspose,
        return launch_act<T, kE4M3, kTranspose>(p, stream);)))
  return Status{};
}

}  // namespace graphfp8
