// CUDA: the norm with a blockwise FP8 output (csrc/blockwise_norm.h) in two passes. First the
// norm kernel of norm_fwd.cu with no output (norm_stats_params: mu, rsigma and residual_out
// only, so the same per-row sums as the per-tensor norm); then one 256-thread block per 128x128
// region of z (x, or residual_out) recomputes y = ((z - mu) rsigma) g (+ beta) with norm_fwd.cu's
// roundings, rounds it to the input dtype and quantizes it with blockwise_io.cuh's tile loops
// (phase 1: each row's tile; phase 2, with out_t: the columns' tiles from shared memory). Per
// element: 2 bytes of z read twice and the FP8 layouts written, against the unfused path's
// z read, y written, y read (and the layouts written): the bf16 y is never written.
#include <atomic>

#include "../blockwise_norm.h"
#include "../dtype_switch.h"
#include "blockwise_io.cuh"
#include "fp8_util.cuh"
#include "vec.cuh"

namespace graphfp8 {
namespace {

using namespace cuda::blockwise;  // NOLINT: the shared tile constants and I/O

// g (gamma, + 1 when zero-centred) and beta of the four columns at c (zeros past `valid`).
template <typename T>
__device__ __forceinline__ void column_weights(const BlockNormParams& p, int64_t c, int valid,
                                               float (&g)[4], float (&b)[4]) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    g[k] = b[k] = 0.0f;
    if (k >= valid) continue;
    g[k] = cuda::to_float(static_cast<const T*>(p.gamma)[c + k]);
    if (p.zero_centered_gamma) g[k] = __fadd_rn(g[k], 1.0f);
    if (p.beta != nullptr) b[k] = cuda::to_float(static_cast<const T*>(p.beta)[c + k]);
  }
}

template <typename T, bool kE4M3, bool kTranspose>
__global__ void __launch_bounds__(kThreads)
    block_norm_kernel(BlockNormParams p, bool vec_z, bool vec_out, bool vec_out_t) {
  extern __shared__ float tile[];  // [kTile][kStride]: y rounded to T, as floats
  __shared__ uint32_t part[2][kTile];
  const T* z = static_cast<const T*>(p.residual_out != nullptr ? p.residual_out : p.x);
  const Region g = region(p.rows, p.hidden);
  float gw[4], b[4];
  column_weights<T>(p, g.c0 + g.c, g.valid, gw, b);
  float f[kRowsPerWarp][4];
  load_rows(z, p.hidden, g, vec_z, f);
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int r = g.warp + i * kWarps;
    if (r >= g.nr) continue;
    // norm_fwd.cu's norm_row, element by element
    const float mu = p.mu != nullptr ? p.mu[g.r0 + r] : 0.0f, rsigma = p.rsigma[g.r0 + r];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      float y = __fmul_rn(__fmul_rn(__fsub_rn(f[i][k], mu), rsigma), gw[k]);
      if (p.beta != nullptr) y = __fadd_rn(y, b[k]);
      f[i][k] = k < g.valid ? cuda::to_float(cuda::from_float<T>(y)) : 0.0f;
    }
  }
  quantize_rows<kE4M3>(f, tile, g, p.dst, vec_out);
  if constexpr (kTranspose) quantize_columns<kE4M3>(tile, part, g, p.dst, vec_out_t);
}

template <typename T, bool kE4M3, bool kTranspose>
Status launch(const BlockNormParams& p, cudaStream_t stream) {
  auto kernel = block_norm_kernel<T, kE4M3, kTranspose>;
  static std::atomic<uint64_t> done{0};
  const Status st = allow_tile_smem(kernel, done, "block_norm (shared memory)");
  if (!st.ok()) return st;
  const void* z = p.residual_out != nullptr ? p.residual_out : p.x;
  kernel<<<region_grid(p.rows, p.hidden), kThreads, kSmemBytes, stream>>>(
      p, vec_rows(p.hidden, z), vec_rows(p.hidden, p.dst.out), vec_columns(p.rows, p.dst.out_t));
  return cuda::check_launch("block_norm");
}

}  // namespace

Status block_norm_cuda(const BlockNormParams& p, void* stream_ptr) {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  const NormParams norm = norm_stats_params(p, p.workspace);  // out == nullptr
  const Status st = norm_fwd_cuda(norm, stream);
  if (!st.ok()) return st;
  if (cuda::ceil_div(p.hidden, kTile) > 65535) {
    return Status{"block_norm", "more than 65535 column tiles"};
  }
  GRAPHFP8_SWITCH_HP(p.dtype, "block_norm", T,
    GRAPHFP8_SWITCH_FP8(p.dst.out_dtype, "block_norm", kE4M3,
      GRAPHFP8_SWITCH_BOOL(p.dst.out_t != nullptr, kTranspose,
        return launch<T, kE4M3, kTranspose>(p, stream);)))
  return Status{};
}

}  // namespace graphfp8
