// The row machinery of the batched norm backward (norm_bwd_batched.cu), shared by its two
// kernels: rows in flight per slot, the row sums over virtual lanes, the per-block column sums,
// and (for the pipelined kernel) one batch of rows loaded and processed as norm_bwd_batched.cu's
// loop body does it.
#pragma once

#include "../common.h"
#include "fp8_util.cuh"
#include "norm.cuh"
#include "vec.cuh"

namespace graphfp8::norm_bwd {

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

// R rows of a slot in registers: dy and x (and, prefetched, dresidual) as loaded, mu, rsigma.
template <typename T, bool kVec, int V, int R>
struct RowBatch {
  using E = Elems<T, kVec>;
  static constexpr int kLoads = bwd_loads<T, kVec>();
  typename E::Frag dy[R][V][kLoads], x[R][V][kLoads];
  float mu[R], rsigma[R];
};

// Where a thread's rows and lanes lie (one per kernel launch).
struct Lanes {
  int tpr, P, slot, t;
  int64_t loads, step;
};

// Issues every load of the batch's rows r = row0 + slot + i step, i < R.
template <typename T, bool kVec, int V, int R>
__device__ __forceinline__ void load_batch(const NormBwdParams& p, const Lanes& l, int64_t row0,
                                           RowBatch<T, kVec, V, R>& b) {
  using B = RowBatch<T, kVec, V, R>;
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int64_t r = row0 + l.slot + i * l.step;
    const bool valid = r < p.rows;
    b.mu[i] = valid && !p.rms ? p.mu[r] : 0.0f;
    b.rsigma[i] = valid ? p.rsigma[r] : 0.0f;
#pragma unroll
    for (int j = 0; j < V; ++j) {
#pragma unroll
      for (int k = 0; k < B::kLoads; ++k) {
        const int64_t v = l.t + j * l.P + static_cast<int64_t>(k) * l.tpr;
        if (!valid || v >= l.loads) continue;
        b.dy[i][j][k] = B::E::load(static_cast<const T*>(p.dy) + r * p.hidden + v * B::E::N);
        b.x[i][j][k] = B::E::load(static_cast<const T*>(p.x) + r * p.hidden + v * B::E::N);
      }
    }
  }
}

// The batch's row sums, dx and its column sums (rows in order), from its loaded values.
template <typename T, bool kVec, int V, int R, int kCols>
__device__ __forceinline__ void process_batch(const NormBwdParams& p, const Lanes& l,
                                              int64_t row0, const RowBatch<T, kVec, V, R>& b,
                                              float (&dgamma)[V][kCols], float (&dbeta)[V][kCols],
                                              float (*scratch)[32]) {
  using E = Elems<T, kVec>;
  constexpr int kLoads = RowBatch<T, kVec, V, R>::kLoads;
  const float h = static_cast<float>(p.hidden);
  float s[V][2 * R];  // per lane and row: sum of dyg xhat, sum of dyg
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const bool valid = row0 + l.slot + i * l.step < p.rows;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      s[j][2 * i] = s[j][2 * i + 1] = 0.0f;
#pragma unroll
      for (int k = 0; k < kLoads; ++k) {
        const int64_t v = l.t + j * l.P + static_cast<int64_t>(k) * l.tpr;
        if (!valid || v >= l.loads) continue;
        float xhat[E::N], dy[E::N], dyg[E::N];
        bwd_terms<T, kVec>(p, v, b.x[i][j][k], b.dy[i][j][k], b.mu[i], b.rsigma[i], xhat, dy,
                           dyg);
#pragma unroll
        for (int e = 0; e < E::N; ++e) {
          s[j][2 * i] = __fadd_rn(s[j][2 * i], __fmul_rn(dyg[e], xhat[e]));
          s[j][2 * i + 1] = __fadd_rn(s[j][2 * i + 1], dyg[e]);
        }
      }
    }
  }
  row_sums_virtual<V, 2 * R>(s, l.tpr, l.P, scratch);
#pragma unroll
  for (int i = 0; i < R; ++i) {  // the rows in order: the column sums take them so
    const int64_t r = row0 + l.slot + i * l.step;
    if (r >= p.rows) continue;
    const float c1 = __fdiv_rn(s[0][2 * i], h);
    const float c2 = p.rms ? 0.0f : __fdiv_rn(s[0][2 * i + 1], h);
#pragma unroll
    for (int j = 0; j < V; ++j) {
#pragma unroll
      for (int k = 0; k < kLoads; ++k) {
        const int64_t v = l.t + j * l.P + static_cast<int64_t>(k) * l.tpr;
        if (v >= l.loads) continue;
        const int64_t at = r * p.hidden + v * E::N;
        float xhat[E::N], dy[E::N], dyg[E::N], dx[E::N], dres[E::N];
        bwd_terms<T, kVec>(p, v, b.x[i][j][k], b.dy[i][j][k], b.mu[i], b.rsigma[i], xhat, dy,
                           dyg);
        if (p.dresidual != nullptr) {
          E::to_floats(E::load(static_cast<const T*>(p.dresidual) + at), dres);
        }
#pragma unroll
        for (int e = 0; e < E::N; ++e) {
          const float tc = __fmul_rn(xhat[e], c1);
          const float g = p.rms ? __fsub_rn(dyg[e], tc) : __fsub_rn(__fsub_rn(dyg[e], c2), tc);
          dx[e] = __fmul_rn(g, b.rsigma[i]);
          if (p.dresidual != nullptr) dx[e] = __fadd_rn(dx[e], dres[e]);
          dgamma[j][k * E::N + e] = __fadd_rn(dgamma[j][k * E::N + e], __fmul_rn(dy[e], xhat[e]));
          dbeta[j][k * E::N + e] = __fadd_rn(dbeta[j][k * E::N + e], dy[e]);
        }
        E::store(static_cast<T*>(p.dx) + at, E::from_floats(dx));
      }
    }
  }
}

}  // namespace graphfp8::norm_bwd
