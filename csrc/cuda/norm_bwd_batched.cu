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
using cuda::norm::row_layout;
using cuda::norm::RowLayout;

constexpr int kThreads = 256;
constexpr int kStage2Cols = 16;  // columns per block of the second kernel

// Rows per slot in flight: what fits ~128 registers a thread (two blocks per SM).
template <bool kVec, int V>
constexpr int rows_in_flight() {
  return kVec ? (V >= 4 ? 1 : 4 / V) : (V >= 2 ? 1 : 2);
}

// norm.cuh's row_sums over virtual lanes: v[j][k] is value k of lane t + j P. The same tree:
// each warp of lanes by butterfly, then the warps of the row in order from shared memory.
template <int V, int K>
__device__ __forceinline__ void row_sums_virtual(float (&v)[V][K], int tpr, int P,
                                                 float (*scratch)[32]) {
  const int width = tpr < cuda::kWarpSize ? tpr : cuda::kWarpSize;
  for (int off = width / 2; off > 0; off /= 2) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        v[j][k] = __fadd_rn(v[j][k], __shfl_xor_sync(0xffffffffu, v[j][k], off));
      }
    }
  }
  if (tpr <= cuda::kWarpSize) return;
  const int pwarp = threadIdx.x / cuda::kWarpSize;
  const int warps_per_row = tpr / cuda::kWarpSize;
  if (threadIdx.x % cuda::kWarpSize == 0) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
#pragma unroll
      for (int k = 0; k < K; ++k) scratch[k][pwarp + j * (P / cuda::kWarpSize)] = v[j][k];
    }
  }
  __syncthreads();
  // V > 1 only with one row slot per block (tpr >= 512), whose warps start at 0.
  const int first = V == 1 ? (pwarp / warps_per_row) * warps_per_row : 0;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    float s = 0.0f;
    for (int w = 0; w < warps_per_row; ++w) s = __fadd_rn(s, scratch[k][first + w]);
#pragma unroll
    for (int j = 0; j < V; ++j) v[j][k] = s;
  }
  __syncthreads();  // scratch is reused by the next batch
}

// norm_bwd.cu's store_column_sums over virtual lanes (several slots only with V == 1).
template <int V, int kLoads, int N, int kCols = kLoads * N>
__device__ __forceinline__ void store_column_sums(const NormBwdParams& p, RowLayout layout, int P,
                                                  int64_t loads, float (&dgamma)[V][kCols],
                                                  float (&dbeta)[V][kCols]) {
  __shared__ float slots[2][V == 1 ? kThreads * kCols : 1];
  const int slot = threadIdx.x / P;
  const int t = threadIdx.x % P;
  if constexpr (V == 1) {
    if (layout.rows_per_block > 1) {
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        slots[0][threadIdx.x * kCols + c] = dgamma[0][c];
        slots[1][threadIdx.x * kCols + c] = dbeta[0][c];
      }
      __syncthreads();
      if (slot != 0) return;
      for (int o = 1; o < layout.rows_per_block; ++o) {
#pragma unroll
        for (int c = 0; c < kCols; ++c) {
          dgamma[0][c] = __fadd_rn(dgamma[0][c], slots[0][(o * P + t) * kCols + c]);
          dbeta[0][c] = __fadd_rn(dbeta[0][c], slots[1][(o * P + t) * kCols + c]);
        }
      }
    }
  }
  float* ws_gamma = p.workspace + static_cast<int64_t>(blockIdx.x) * p.hidden;
  float* ws_beta = ws_gamma + kNormBwdMaxBlocks * p.hidden;
#pragma unroll
  for (int j = 0; j < V; ++j) {
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      const int64_t v = t + j * P + static_cast<int64_t>(k) * layout.tpr;
      if (v >= loads) continue;
#pragma unroll
      for (int e = 0; e < N; ++e) {
        ws_gamma[v * N + e] = dgamma[j][k * N + e];
        ws_beta[v * N + e] = dbeta[j][k * N + e];
      }
    }
  }
}

// Two blocks per SM (<= 128 registers) where that costs no more than a small spill (16-bit
// vector loads); the wide unvectorised and fp32 variants take all the registers they need.
template <typename T, bool kVec, int V>
constexpr int min_blocks() {
  return (kVec && sizeof(T) == 2) || V == 1 ? 2 : 1;
}

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

// dgamma[c] (and dbeta[c]) = the workspace rows of column c summed in order, as norm_bwd.cu's
// norm_param_grad_kernel sums them. A block takes kStage2Cols columns: its 256 threads stage
// all partial rows of them in shared memory at once (every load in flight together, rows read as
// 64-byte segments), then one thread per column and array adds them up in row order.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    param_grad_batched_kernel(const float* __restrict__ workspace, T* __restrict__ dgamma,
                              T* __restrict__ dbeta, int64_t partial_rows, int64_t hidden) {
  __shared__ float tile[2][kNormBwdMaxBlocks][kStage2Cols];
  const int c = threadIdx.x % kStage2Cols;
  const int group = threadIdx.x / kStage2Cols;
  constexpr int kGroups = kThreads / kStage2Cols;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kStage2Cols + c;
  const int arrays = dbeta != nullptr ? 2 : 1;
  constexpr int kPerThread = kNormBwdMaxBlocks / kGroups;
  if (col < hidden) {
    for (int a = 0; a < arrays; ++a) {
      const float* w = workspace + a * kNormBwdMaxBlocks * hidden + col;
      float v[kPerThread];
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {  // all loads first: kPerThread in flight
        const int64_t r = group + i * kGroups;
        v[i] = r < partial_rows ? w[r * hidden] : 0.0f;
      }
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) tile[a][group + i * kGroups][c] = v[i];
    }
  }
  __syncthreads();
  const int a = threadIdx.x / kStage2Cols;  // threads 0..15 sum dgamma, 16..31 dbeta
  if (a >= arrays || col >= hidden) return;
  float s = 0.0f;
  for (int64_t r = 0; r < partial_rows; ++r) s = __fadd_rn(s, tile[a][r][c]);
  (a == 0 ? dgamma : dbeta)[col] = cuda::from_float<T>(s);
}

template <typename T, bool kVec, int V>
Status launch_v(const NormBwdParams& p, RowLayout layout, cudaStream_t stream) {
  const int64_t groups = cuda::ceil_div(p.rows, layout.rows_per_block);
  const int grid = static_cast<int>(groups < kNormBwdMaxBlocks ? groups : kNormBwdMaxBlocks);
  norm_bwd_batched_kernel<T, kVec, V><<<grid, kThreads, 0, stream>>>(p, layout);
  const Status st = cuda::check_launch("norm_bwd_batched_kernel");
  if (!st.ok()) return st;
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
