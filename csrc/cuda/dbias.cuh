// The second pass of every fused dbias: the column sums of an fp32 workspace of per-tile partial
// sums (one row per row of tiles), each column summed in row order and rounded to the dbias dtype.
// No atomics: the sums are the same run to run, so graphed and eager runs agree bit for bit.
//
// Grid: one thread per column, 256-thread blocks, grid-stride over the columns.
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

}  // namespace graphfp8::cuda
