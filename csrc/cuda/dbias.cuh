// The second pass of every fused dbias: the column sums of an fp32 workspace of per-tile partial
// sums (one row per row of tiles), each column summed in row order and rounded to the dbias dtype.
// No atomics in the sums: they are the same run to run, so graphed and eager runs agree bit for
// bit.
//
// Two ways to run it, with the same sums in the same order (so the same bits):
//   - dbias_reduce_kernel: a second launch, one thread per column, 256-thread blocks,
//     grid-stride over the columns;
//   - dbias_finish (kernel switch DBIAS_IN_KERNEL): inside the tile kernel that wrote the
//     partials. The blocks of a column of tiles count themselves on a device counter (one per
//     column of tiles); the one that arrives last, after a fence, sums that column's workspace
//     rows and resets its counter to zero. No second launch: one graph node fewer per dbias.
//     The counters are per stream (dbias_counters), zero between kernels; a launch that gets no
//     counters (first use on a stream inside a graph capture) takes the second kernel.
#pragma once

#include "fp8_util.cuh"
#include "vec.cuh"

namespace graphfp8::cuda {

template <typename OutT>
__global__ void __launch_bounds__(256)
    dbias_reduce_kernel(const float* __restrict__ workspace, OutT* __restrict__ dbias,
                        int64_t partial_rows, int64_t cols) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < cols;
       c += stride) {
    float s = 0.0f;
    for (int64_t r = 0; r < partial_rows; ++r) s += workspace[r * cols + c];
    dbias[c] = from_float<OutT>(s);
  }
}

// dbias (cols,) = the column sums of workspace (partial_rows, cols).
template <typename OutT>
inline Status launch_dbias_reduce(const float* workspace, void* dbias, int64_t partial_rows,
                                  int64_t cols, cudaStream_t stream) {
  const int grid = grid_size(ceil_div(cols, 256), 1024);
  dbias_reduce_kernel<OutT><<<grid, 256, 0, stream>>>(workspace, static_cast<OutT*>(dbias),
                                                      partial_rows, cols);
  return check_launch("dbias_reduce_kernel");
}

// Counters for in-kernel dbias reductions on `stream`: `count` int32 zeros (each kernel leaves
// them zero), or nullptr when there are none to give - count above the capacity, or the stream
// is capturing a graph before any eager use on it made them (a capture cannot allocate and
// zero them in order); the caller then launches dbias_reduce_kernel. Defined in dbias.cu.
int* dbias_counters(cudaStream_t stream, int64_t count);

// The in-kernel second pass. Every thread of the block calls it, after the block wrote its
// workspace row: the last block of the column of tiles (of partial_rows blocks) sums workspace
// column col_of(i) over the rows in order for i < n (col_of returns -1 for a column out of
// range) into dbias, exactly as dbias_reduce_kernel sums it, and resets *counter.
template <typename OutT, typename ColOf>
__device__ __forceinline__ void dbias_finish(const float* workspace, OutT* __restrict__ dbias,
                                             int* counter, int64_t partial_rows, int64_t cols,
                                             int n, ColOf col_of) {
  __shared__ int last;
  __threadfence();  // this block's workspace row, visible before its arrival is counted
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(counter, 1) == partial_rows - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();  // every other block's row, visible to the loads below (from L2: __ldcg)
  const int64_t c = threadIdx.x < n ? col_of(static_cast<int>(threadIdx.x)) : -1;
  if (c >= 0) {
    constexpr int kBatch = 8;  // loads in flight; the adds stay in row order
    float s = 0.0f;
    int64_t r = 0;
    for (; r + kBatch <= partial_rows; r += kBatch) {
      float v[kBatch];
#pragma unroll
      for (int k = 0; k < kBatch; ++k) v[k] = __ldcg(workspace + (r + k) * cols + c);
#pragma unroll
      for (int k = 0; k < kBatch; ++k) s += v[k];
    }
    for (; r < partial_rows; ++r) s += __ldcg(workspace + r * cols + c);
    dbias[c] = from_float<OutT>(s);
  }
  if (threadIdx.x == 0) *counter = 0;  // for the next kernel on this stream
}

}  // namespace graphfp8::cuda
