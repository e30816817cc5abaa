// CUDA: the LayerNorm / RMSNorm backward (common.h's NormBwdParams has the math).
//
// Grid and registers: norm.cuh (8 columns per thread). Per row: the two sums of dx, then dx
// (plus dresidual); per thread the column sums of dy xhat and dy over its rows; then the block's
// row slots in order in shared memory, one fp32 workspace row per block (a grid bounded by
// kNormBwdMaxBlocks, not by the GPU's SM count), and a second kernel sums each column over the
// workspace rows in order: no atomics, the same sums on every run and every GPU.
#include "../common.h"
#include "../dtype_switch.h"
#include "fp8_util.cuh"
#include "norm.cuh"
#include "vec.cuh"

namespace graphfp8 {
namespace {

using cuda::norm::bwd_loads;
using cuda::norm::bwd_terms;
using cuda::norm::Elems;
using cuda::norm::kMaxThreads;
using cuda::norm::row_layout;
using cuda::norm::row_sums;
using cuda::norm::RowLayout;

// Writes this block's column sums to its workspace rows: its row slots in order first (only
// 256-thread blocks hold several rows). Every thread of the block calls it.
template <int kLoads, int N, int kCols = kLoads * N>
__device__ __forceinline__ void store_column_sums(const NormBwdParams& p, RowLayout layout,
                                                  int64_t loads, float (&dgamma)[kCols],
                                                  float (&dbeta)[kCols]) {
  __shared__ float slots[2][256 * kCols];
  const int tpr = layout.tpr;
  const int slot = threadIdx.x / tpr;
  const int lane_r = threadIdx.x % tpr;
  if (layout.rows_per_block > 1) {
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      slots[0][threadIdx.x * kCols + c] = dgamma[c];
      slots[1][threadIdx.x * kCols + c] = dbeta[c];
    }
    __syncthreads();
    if (slot != 0) return;
    for (int o = 1; o < layout.rows_per_block; ++o) {
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        dgamma[c] = __fadd_rn(dgamma[c], slots[0][(o * tpr + lane_r) * kCols + c]);
        dbeta[c] = __fadd_rn(dbeta[c], slots[1][(o * tpr + lane_r) * kCols + c]);
      }
    }
  }
  float* ws_gamma = p.workspace + static_cast<int64_t>(blockIdx.x) * p.hidden;
  float* ws_beta = ws_gamma + kNormBwdMaxBlocks * p.hidden;
#pragma unroll
  for (int k = 0; k < kLoads; ++k) {
    const int64_t v = lane_r + static_cast<int64_t>(k) * tpr;
    if (v >= loads) continue;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      ws_gamma[v * N + j] = dgamma[k * N + j];
      ws_beta[v * N + j] = dbeta[k * N + j];
    }
  }
}

// The backward: dx of each row, and this block's column sums of dy xhat and dy.
template <typename T, bool kVec>
__global__ void __launch_bounds__(kMaxThreads) norm_bwd_kernel(NormBwdParams p, RowLayout layout) {
  using E = Elems<T, kVec>;
  constexpr int kLoads = bwd_loads<T, kVec>();
  constexpr int kCols = kLoads * E::N;  // columns per thread
  __shared__ float scratch[2][32];
  const int tpr = layout.tpr;
  const int lane_r = threadIdx.x % tpr;
  const int64_t loads = p.hidden / E::N;
  const float h = static_cast<float>(p.hidden);
  float dgamma[kCols], dbeta[kCols];
#pragma unroll
  for (int c = 0; c < kCols; ++c) dgamma[c] = dbeta[c] = 0.0f;
  const int64_t step = static_cast<int64_t>(gridDim.x) * layout.rows_per_block;
  for (int64_t row0 = static_cast<int64_t>(blockIdx.x) * layout.rows_per_block; row0 < p.rows;
       row0 += step) {
    const int64_t r = row0 + threadIdx.x / tpr;
    const bool valid = r < p.rows;
    const float mu = valid && !p.rms ? p.mu[r] : 0.0f;
    const float rsigma = valid ? p.rsigma[r] : 0.0f;
    typename E::Frag dy_raw[kLoads], x_raw[kLoads];
    float s[2] = {0.0f, 0.0f};  // sum of dyg xhat, sum of dyg
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      const int64_t v = lane_r + static_cast<int64_t>(k) * tpr;
      if (!valid || v >= loads) continue;
      dy_raw[k] = E::load(static_cast<const T*>(p.dy) + r * p.hidden + v * E::N);
      x_raw[k] = E::load(static_cast<const T*>(p.x) + r * p.hidden + v * E::N);
      float xhat[E::N], dy[E::N], dyg[E::N];
      bwd_terms<T, kVec>(p, v, x_raw[k], dy_raw[k], mu, rsigma, xhat, dy, dyg);
#pragma unroll
      for (int j = 0; j < E::N; ++j) {
        s[0] = __fadd_rn(s[0], __fmul_rn(dyg[j], xhat[j]));
        s[1] = __fadd_rn(s[1], dyg[j]);
      }
    }
    row_sums(s, tpr, scratch);
    const float c1 = __fdiv_rn(s[0], h);
    const float c2 = p.rms ? 0.0f : __fdiv_rn(s[1], h);
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      const int64_t v = lane_r + static_cast<int64_t>(k) * tpr;
      if (!valid || v >= loads) continue;
      const int64_t at = r * p.hidden + v * E::N;
      float xhat[E::N], dy[E::N], dyg[E::N], dx[E::N], dres[E::N];
      bwd_terms<T, kVec>(p, v, x_raw[k], dy_raw[k], mu, rsigma, xhat, dy, dyg);
      if (p.dresidual != nullptr) {
        E::to_floats(E::load(static_cast<const T*>(p.dresidual) + at), dres);
      }
#pragma unroll
      for (int j = 0; j < E::N; ++j) {
        const float t = __fmul_rn(xhat[j], c1);
        const float g = p.rms ? __fsub_rn(dyg[j], t) : __fsub_rn(__fsub_rn(dyg[j], c2), t);
        dx[j] = __fmul_rn(g, rsigma);
        if (p.dresidual != nullptr) dx[j] = __fadd_rn(dx[j], dres[j]);
        dgamma[k * E::N + j] = __fadd_rn(dgamma[k * E::N + j], __fmul_rn(dy[j], xhat[j]));
        dbeta[k * E::N + j] = __fadd_rn(dbeta[k * E::N + j], dy[j]);
      }
      E::store(static_cast<T*>(p.dx) + at, E::from_floats(dx));
    }
  }
  store_column_sums<kLoads, E::N>(p, layout, loads, dgamma, dbeta);
}

// dgamma[c] (and dbeta[c]) = the sum of the workspace rows of column c, in order, rounded to T.
template <typename T>
__global__ void __launch_bounds__(256)
    norm_param_grad_kernel(const float* __restrict__ workspace, T* __restrict__ dgamma,
                           T* __restrict__ dbeta, int64_t partial_rows, int64_t hidden) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < hidden;
       c += stride) {
    float g = 0.0f, b = 0.0f;
    for (int64_t r = 0; r < partial_rows; ++r) {
      g = __fadd_rn(g, workspace[r * hidden + c]);
      b = __fadd_rn(b, workspace[(kNormBwdMaxBlocks + r) * hidden + c]);
    }
    dgamma[c] = cuda::from_float<T>(g);
    if (dbeta != nullptr) dbeta[c] = cuda::from_float<T>(b);
  }
}

template <typename T, bool kVec>
Status launch_bwd(const NormBwdParams& p, cudaStream_t stream) {
  const RowLayout layout = row_layout(p.hidden / Elems<T, kVec>::N, bwd_loads<T, kVec>());
  // A fixed grid bound, not one from the SM count: the column sums come out the same on every
  // GPU as well as on every run.
  const int64_t groups = cuda::ceil_div(p.rows, layout.rows_per_block);
  const int grid = static_cast<int>(groups < kNormBwdMaxBlocks ? groups : kNormBwdMaxBlocks);
  norm_bwd_kernel<T, kVec><<<grid, layout.block, 0, stream>>>(p, layout);
  const Status st = cuda::check_launch("norm_bwd_kernel");
  if (!st.ok()) return st;
  norm_param_grad_kernel<T><<<cuda::grid_size(cuda::ceil_div(p.hidden, 256), 8), 256, 0,
                              stream>>>(p.workspace, static_cast<T*>(p.dgamma),
                                        static_cast<T*>(p.dbeta), grid, p.hidden);
  return cuda::check_launch("norm_param_grad_kernel");
}

}  // namespace

Status norm_bwd_cuda(const NormBwdParams& p, void* stream_ptr) {
  if (p.batched || p.v2) return norm_bwd_batched_cuda(p, stream_ptr);  // v2: norm_bwd_batched.cu
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  GRAPHFP8_SWITCH_HP(p.dtype, "norm_bwd", T,
    if (cuda::norm::bwd_vectorized<T>(p)) return launch_bwd<T, true>(p, stream);
    return launch_bwd<T, false>(p, stream);)
  return Status{};
}

}  // namespace graphfp8
