// CUDA: the LayerNorm / RMSNorm backward with several rows in flight per block (kernel switch
// NORM_BWD_BATCHED), computing exactly the sums of norm_bwd.cu, bit for bit.
//
// norm_bwd.cu gives each row `tpr` lanes (norm.cuh's row_layout: lane L takes loads L + k tpr)
// and sums in a fixed tree: per lane in load order, a butterfly over each warp of lanes, then the
// warps of the row in order; the rows of a block slot in grid-stride order go into its column
// sums, the slots of a block in order, then one workspace row per block. This kernel keeps every
// one of those orders and changes only what runs when:
//   - lanes are virtual: P = min(tpr, 256) threads per row, each holding V = tpr / P lanes
//     (thread t holds lanes t + j P, which fall in the same lane of a warp, so one physical
//     butterfly sums all V of them), so blocks are 256 threads whatever the hidden size and two
//     of them fit on an SM (norm_bwd.cu ran 1024-thread blocks at 8192, one per SM);
//   - each slot takes R of its rows at a time: all their loads are issued before the row sums,
//     whose two barriers then cover R rows; the column sums still take the rows in order;
//   - the second kernel sums each column over the workspace rows in the same order, but stages
//     all of them in shared memory first (every load in flight together, hidden / 16 blocks),
//     instead of one thread per column walking 256 rows on a few SMs (46 us for 2 MB at
//     8192 x 1024 on the H200).
// Kernel switch NORM_BWD_STAGED hands vectorised rows of up to two pieces per thread to
// norm_bwd_staged.cu (the same sums again, the next rows staged in shared memory); kernel switch
// NORM_BWD_V2, ahead of it, vectorised 16-bit rows to hidden 4096 to norm_bwd_v2.cu (the same
// sums, two batches of rows in flight in registers).
#include "../common.h"
#include "../dtype_switch.h"
#include "fp8_util.cuh"
#include "norm.cuh"
#include "norm_bwd_rows.cuh"
#include "vec.cuh"

namespace graphfp8 {
namespace {

using namespace norm_bwd;  // NOLINT: the row machinery (norm_bwd_rows.cuh)
using cuda::norm::bwd_loads;
using cuda::norm::Elems;
using cuda::norm::RowLayout;
using cuda::norm::row_layout;
using cuda::norm::bwd_terms;

template <typename T, bool kVec, int V>
__global__ void __launch_bounds__(kThreads, (min_blocks<T, kVec, V>()))
    norm_bwd_batched_kernel(NormBwdParams p, RowLayout layout) {
  using E = Elems<T, kVec>;
  constexpr int kLoads = bwd_loads<T, kVec>();
  constexpr int kCols = kLoads * E::N;  // columns per lane
  constexpr int R = rows_in_flight<kVec, V>();
  __shared__ float scratch[2 * R][32];
  const int tpr = layout.tpr;
  const int P = tpr / V;
  const int slot = threadIdx.x / P;
  const int t = threadIdx.x % P;
  const int64_t loads = p.hidden / E::N;
  const float h = static_cast<float>(p.hidden);
  float dgamma[V][kCols], dbeta[V][kCols];
#pragma unroll
  for (int j = 0; j < V; ++j) {
#pragma unroll
    for (int c = 0; c < kCols; ++c) dgamma[j][c] = dbeta[j][c] = 0.0f;
  }
  const int64_t step = static_cast<int64_t>(gridDim.x) * layout.rows_per_block;
  for (int64_t row0 = static_cast<int64_t>(blockIdx.x) * layout.rows_per_block; row0 < p.rows;
       row0 += R * step) {
    typename E::Frag dy_raw[R][V][kLoads], x_raw[R][V][kLoads];
    float mu[R], rsigma[R];
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int64_t r = row0 + slot + i * step;
      const bool valid = r < p.rows;
      mu[i] = valid && !p.rms ? p.mu[r] : 0.0f;
      rsigma[i] = valid ? p.rsigma[r] : 0.0f;
#pragma unroll
      for (int j = 0; j < V; ++j) {
#pragma unroll
        for (int k = 0; k < kLoads; ++k) {
          const int64_t v = t + j * P + static_cast<int64_t>(k) * tpr;
          if (!valid || v >= loads) continue;
          dy_raw[i][j][k] = E::load(static_cast<const T*>(p.dy) + r * p.hidden + v * E::N);
          x_raw[i][j][k] = E::load(static_cast<const T*>(p.x) + r * p.hidden + v * E::N);
        }
      }
    }
    float s[V][2 * R];  // per lane and row: sum of dyg xhat, sum of dyg
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const bool valid = row0 + slot + i * step < p.rows;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        s[j][2 * i] = s[j][2 * i + 1] = 0.0f;
#pragma unroll
        for (int k = 0; k < kLoads; ++k) {
          const int64_t v = t + j * P + static_cast<int64_t>(k) * tpr;
          if (!valid || v >= loads) continue;
          float xhat[E::N], dy[E::N], dyg[E::N];
          bwd_terms<T, kVec>(p, v, x_raw[i][j][k], dy_raw[i][j][k], mu[i], rsigma[i], xhat, dy,
                             dyg);
#pragma unroll
          for (int e = 0; e < E::N; ++e) {
            s[j][2 * i] = __fadd_rn(s[j][2 * i], __fmul_rn(dyg[e], xhat[e]));
            s[j][2 * i + 1] = __fadd_rn(s[j][2 * i + 1], dyg[e]);
          }
        }
      }
    }
    row_sums_virtual<V, 2 * R>(s, tpr, P, scratch);
#pragma unroll
    for (int i = 0; i < R; ++i) {  // the rows in order: the column sums take them so
      const int64_t r = row0 + slot + i * step;
      if (r >= p.rows) continue;
      const float c1 = __fdiv_rn(s[0][2 * i], h);
      const float c2 = p.rms ? 0.0f : __fdiv_rn(s[0][2 * i + 1], h);
#pragma unroll
      for (int j = 0; j < V; ++j) {
#pragma unroll
        for (int k = 0; k < kLoads; ++k) {
          const int64_t v = t + j * P + static_cast<int64_t>(k) * tpr;
          if (v >= loads) continue;
          const int64_t at = r * p.hidden + v * E::N;
          float xhat[E::N], dy[E::N], dyg[E::N], dx[E::N], dres[E::N];
          bwd_terms<T, kVec>(p, v, x_raw[i][j][k], dy_raw[i][j][k], mu[i], rsigma[i], xhat, dy,
                             dyg);
          if (p.dresidual != nullptr) {
            E::to_floats(E::load(static_cast<const T*>(p.dresidual) + at), dres);
          }
#pragma unroll
          for (int e = 0; e < E::N; ++e) {
            const float tc = __fmul_rn(xhat[e], c1);
            const float g = p.rms ? __fsub_rn(dyg[e], tc) : __fsub_rn(__fsub_rn(dyg[e], c2), tc);
            dx[e] = __fmul_rn(g, rsigma[i]);
            if (p.dresidual != nullptr) dx[e] = __fadd_rn(dx[e], dres[e]);
            dgamma[j][k * E::N + e] = __fadd_rn(dgamma[j][k * E::N + e], __fmul_rn(dy[e], xhat[e]));
            dbeta[j][k * E::N + e] = __fadd_rn(dbeta[j][k * E::N + e], dy[e]);
          }
          E::store(static_cast<T*>(p.dx) + at, E::from_floats(dx));
        }
      }
    }
  }
  store_column_sums<V, kLoads, E::N>(p, layout, P, loads, dgamma, dbeta);
}

// The parameter gradients from the workspace (norm_bwd_rows.cuh's param_grad_columns): a block
// per kStage2Cols columns.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    param_grad_batched_kernel(const float* __restrict__ workspace, T* __restrict__ dgamma,
                              T* __restrict__ dbeta, int64_t partial_rows, int64_t hidden) {
  __shared__ float tile[2][kNormBwdMaxBlocks][kStage2Cols];
  param_grad_columns<T>(workspace, dgamma, dbeta, partial_rows, hidden,
                        static_cast<int64_t>(blockIdx.x) * kStage2Cols, tile);
}

template <typename T, bool kVec, int V>
Status launch_v(const NormBwdParams& p, RowLayout layout, cudaStream_t stream) {
  const int64_t groups = cuda::ceil_div(p.rows, layout.rows_per_block);
  const int grid = static_cast<int>(groups < kNormBwdMaxBlocks ? groups : kNormBwdMaxBlocks);
  bool launched = false, param_grads_done = false;
  if constexpr (kVec && sizeof(T) == 2 && V <= 2) {
    if (p.v2) {  // norm_bwd_v2.cu
      const Status st = norm_bwd_v2<T, V>(p, layout, grid, stream);
      if (!st.ok()) return st;
      launched = true;
    }
  }
  if constexpr (kVec && V * bwd_loads<T, kVec>() <= kStagedMaxPieces) {
    if (p.staged && !launched) {  // norm_bwd_staged.cu
      const Status st = norm_bwd_staged<T, V>(p, layout, grid, &launched, &param_grads_done, stream);
      if (!st.ok() || param_grads_done) return st;
    }
  }
  if (!launched) {
    norm_bwd_batched_kernel<T, kVec, V><<<grid, kThreads, 0, stream>>>(p, layout);
    const Status st = cuda::check_launch("norm_bwd_batched_kernel");
    if (!st.ok()) return st;
  }
  param_grad_batched_kernel<T>
      <<<static_cast<int>(cuda::ceil_div(p.hidden, kStage2Cols)), kThreads, 0, stream>>>(
          p.workspace, static_cast<T*>(p.dgamma), static_cast<T*>(p.dbeta), grid, p.hidden);
  return cuda::check_launch("param_grad_batched_kernel");
}

template <typename T, bool kVec>
Status launch(const NormBwdParams& p, cudaStream_t stream) {
  // norm_bwd.cu's layout (the same lanes, slots and grid), on 256-thread blocks.
  const RowLayout lanes = row_layout(p.hidden / Elems<T, kVec>::N, bwd_loads<T, kVec>());
  const RowLayout layout{lanes.tpr, kThreads, lanes.tpr >= kThreads ? 1 : kThreads / lanes.tpr};
  if (lanes.tpr <= kThreads) return launch_v<T, kVec, 1>(p, layout, stream);
  if (lanes.tpr == 2 * kThreads) return launch_v<T, kVec, 2>(p, layout, stream);
  return launch_v<T, kVec, 4>(p, layout, stream);
}

}  // namespace

Status norm_bwd_batched_cuda(const NormBwdParams& p, void* stream_ptr) {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  GRAPHFP8_SWITCH_HP(p.dtype, "norm_bwd_batched", T,
    if (cuda::norm::bwd_vectorized<T>(p)) return launch<T, true>(p, stream);
    return launch<T, false>(p, stream);)
  return Status{};
}

}  // namespace graphfp8
