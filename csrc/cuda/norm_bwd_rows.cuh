// The row machinery of the batched norm backward, shared by its kernels (norm_bwd_batched.cu,
// norm_bwd_staged.cu): rows in flight per slot, the row sums over virtual lanes, the per-block
// column sums, and the column sums of the per-block partial rows (the parameter gradients).
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
// kSyncAfter false: no barrier after the reads, for callers that alternate two scratch buffers
// (a buffer is written again only after the next call's barrier, which every reader has passed).
template <int V, int K, bool kSyncAfter = true>
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
  if constexpr (kSyncAfter) __syncthreads();  // scratch is reused by the next batch
}

// norm_bwd.cu's store_column_sums over virtual lanes (several slots only with V == 1). kBeta
// false: dbeta is not summed (RMSNorm, whose parameter-gradient kernel reads no dbeta rows).
template <int V, int kLoads, int N, bool kBeta = true, int kCols = kLoads * N>
__device__ __forceinline__ void store_column_sums(const NormBwdParams& p, RowLayout layout, int P,
                                                  int64_t loads, float (&dgamma)[V][kCols],
                                                  float (&dbeta)[V][kCols]) {
  __shared__ float slots[kBeta ? 2 : 1][V == 1 ? kThreads * kCols : 1];
  const int slot = threadIdx.x / P;
  const int t = threadIdx.x % P;
  if constexpr (V == 1) {
    if (layout.rows_per_block > 1) {
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        slots[0][threadIdx.x * kCols + c] = dgamma[0][c];
        if constexpr (kBeta) slots[1][threadIdx.x * kCols + c] = dbeta[0][c];
      }
      __syncthreads();
      if (slot != 0) return;
      for (int o = 1; o < layout.rows_per_block; ++o) {
#pragma unroll
        for (int c = 0; c < kCols; ++c) {
          dgamma[0][c] = __fadd_rn(dgamma[0][c], slots[0][(o * P + t) * kCols + c]);
          if constexpr (kBeta) {
            dbeta[0][c] = __fadd_rn(dbeta[0][c], slots[1][(o * P + t) * kCols + c]);
          }
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
        if constexpr (kBeta) ws_beta[v * N + e] = dbeta[j][k * N + e];
      }
    }
  }
}

// The staged kernel (norm_bwd_staged.cu, kernel switch NORM_BWD_STAGED): norm_bwd_batched_kernel's
// sums with its layout and grid, for vectorised rows of at most kStagedMaxPieces 16-byte pieces
// per thread and array (hidden sizes to 4096 in 16 bits, 1024 in fp32). *launched false: it could
// not run here (its shared memory), nothing was launched; *param_grads_done false: dgamma and
// dbeta still need param_grad_batched_kernel.
constexpr int kStagedMaxPieces = 2;
template <typename T, int V>
Status norm_bwd_staged(const NormBwdParams& p, RowLayout layout, int grid, bool* launched,
                       bool* param_grads_done, cudaStream_t stream);

// The v2 kernel (norm_bwd_v2.cu, kernel switch NORM_BWD_V2): norm_bwd_batched_kernel's sums with
// its layout and grid, for vectorised 16-bit rows of V <= 2 lanes per thread (hidden sizes to
// 4096); dgamma and dbeta still need param_grad_batched_kernel.
template <typename T, int V>
Status norm_bwd_v2(const NormBwdParams& p, RowLayout layout, int grid, cudaStream_t stream);

// Two blocks per SM (<= 128 registers) where that costs no more than a small spill (16-bit
// vector loads); the wide unvectorised and fp32 variants take all the registers they need.
template <typename T, bool kVec, int V>
constexpr int min_blocks() {
  return (kVec && sizeof(T) == 2) || V == 1 ? 2 : 1;
}

// dgamma[c] (and dbeta[c]) for the kStage2Cols columns from col0: the workspace rows of each
// column summed in order, as norm_bwd.cu's norm_param_grad_kernel sums them. Every thread of the
// block calls it: its 256 threads stage all partial rows of those columns in `tile` (every load
// in flight together; from L2, as other blocks may have just written them), then one thread per
// column and array adds them up in row order, 8 loads from shared memory ahead of the adds.
template <typename T>
__device__ __forceinline__ void param_grad_columns(const float* __restrict__ workspace,
                                                   T* __restrict__ dgamma, T* __restrict__ dbeta,
                                                   int64_t partial_rows, int64_t hidden,
                                                   int64_t col0,
                                                   float (*tile)[kNormBwdMaxBlocks][kStage2Cols]) {
  const int c = threadIdx.x % kStage2Cols;
  const int group = threadIdx.x / kStage2Cols;
  constexpr int kGroups = kThreads / kStage2Cols;
  constexpr int kPerThread = kNormBwdMaxBlocks / kGroups;
  const int64_t col = col0 + c;
  const int arrays = dbeta != nullptr ? 2 : 1;
  if (col < hidden) {
    for (int a = 0; a < arrays; ++a) {
      const float* w = workspace + a * kNormBwdMaxBlocks * hidden + col;
      float v[kPerThread];
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {  // all loads first: kPerThread in flight
        const int64_t r = group + i * kGroups;
        v[i] = r < partial_rows ? __ldcg(w + r * hidden) : 0.0f;
      }
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) tile[a][group + i * kGroups][c] = v[i];
    }
  }
  __syncthreads();
  const int a = threadIdx.x / kStage2Cols;  // threads 0..15 sum dgamma, 16..31 dbeta
  if (a < arrays && col < hidden) {
    constexpr int kAhead = 8;
    float s = 0.0f;
    int64_t r = 0;
    for (; r + kAhead <= partial_rows; r += kAhead) {
      float v[kAhead];
#pragma unroll
      for (int k = 0; k < kAhead; ++k) v[k] = tile[a][r + k][c];
#pragma unroll
      for (int k = 0; k < kAhead; ++k) s = __fadd_rn(s, v[k]);
    }
    for (; r < partial_rows; ++r) s = __fadd_rn(s, tile[a][r][c]);
    (a == 0 ? dgamma : dbeta)[col] = cuda::from_float<T>(s);
  }
  __syncthreads();  // the tile is reused by the caller's next columns
}

}  // namespace graphfp8::norm_bwd
