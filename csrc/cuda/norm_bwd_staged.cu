// CUDA: the batched norm backward with each thread's next rows staged in shared memory by
// cp.async (kernel switch NORM_BWD_STAGED), bit for bit norm_bwd_batched.cu's sums, and its
// parameter gradients summed by the last blocks to finish instead of a second launch (kernel
// switch NORM_BWD_PARAM_IN_KERNEL).
//
// What ncu said of norm_bwd_batched_kernel on the H200 (8192 x 1024 and 8192 x 4096 bf16,
// notes/PERF.md): 123-128 registers, so 2 blocks of 256 threads per SM and the 256-block grid one
// wave; ~1 eligible warp per scheduler and none half the time, loads in flight only at the start
// of each batch of rows; ~54 instructions per element. This kernel keeps its threads, lanes,
// slots and grid, hence every sum in the same order, and changes:
//   - the loads: each thread copies the 16-byte pieces it will read of its slot's next rows (x,
//     dy, dresidual, and the row's mean and rsigma) into a ring of `nb` batches of kRows rows in
//     shared memory with cp.async, nb - 1 batches ahead. A thread reads back only what it copied,
//     so the ring needs no barrier, and the bytes in flight need no registers;
//   - the work per element: gamma (+1 when zero-centred) read once per thread; RMSNorm taken as
//     mean 0 and c2 0 (x - 0 and dyg - 0 are exact: the same bits); the row sums divided by a
//     power-of-two hidden size by multiplying with its reciprocal (the same correctly rounded
//     quotient);
//   - with counters: each block counts itself done after writing its workspace row; the last
//     `reducers` blocks to arrive wait until all have, sum the workspace's columns
//     (param_grad_columns: param_grad_batched_kernel's order), and the last of them zeroes the
//     counters. Only those blocks wait, so the kernel cannot hang while more than `reducers` of
//     its blocks fit on the GPU at once: the launcher takes at most half of what fits.
#include <algorithm>
#include <atomic>
#include <type_traits>

#include "../common.h"
#include "dbias.cuh"
#include "fp8_util.cuh"
#include "norm.cuh"
#include "norm_bwd_rows.cuh"
#include "vec.cuh"

namespace graphfp8::norm_bwd {
namespace {

constexpr int kRows = 2;                // rows of a slot per batch: one row-sum reduction
constexpr int kMaxReducers = 128;       // blocks that sum the parameter gradients, at most
constexpr int kTileBytes = 2 * kNormBwdMaxBlocks * kStage2Cols * sizeof(float);

struct StagedArgs {
  NormBwdParams p;
  RowLayout layout;
  int nb;             // batches in the ring
  int arrays;         // staged arrays: x, dy (, dresidual)
  float inv_hidden;   // 1 / hidden when hidden is a power of two, else 0
  int* counters;      // 2 zeros (blocks done, reducers done), or nullptr: a second kernel sums
  int reducers;
};

// cp.async of kBytes (16: around L1, the streamed rows; 4: through it, the row statistics that
// every thread of a row reads); before sm_80, plain copies: the same values, nothing in flight.
template <int kBytes>
__device__ __forceinline__ void copy_async(void* dst, const void* src) {
  using Word = std::conditional_t<kBytes == 16, uint4, float>;
#if __CUDA_ARCH__ >= 800
  const auto d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  if constexpr (kBytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(d), "l"(src) : "memory");
  }
#else
  *static_cast<Word*>(dst) = *static_cast<const Word*>(src);
#endif
}
__device__ __forceinline__ void commit() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void wait_groups() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}
// Waits until at most n of this thread's cp.async groups are pending (n < 4).
__device__ __forceinline__ void wait_all_but(int n) {
  if (n >= 3) {
    wait_groups<3>();
  } else if (n == 2) {
    wait_groups<2>();
  } else if (n == 1) {
    wait_groups<1>();
  } else {
    wait_groups<0>();
  }
}

// A thread's place in the rows (norm_bwd_batched_kernel's lanes and slots) and in the ring:
// piece f of row i of ring batch s, array a, lies at pieces[(((s A + a) kRows + i) F + f) 256 + tid]
// (consecutive threads, consecutive 16 bytes); the row's mean and rsigma at
// stats[((s 2 + 0 or 1) kRows + i) 256 + tid].
template <int F>
struct Place {
  int tpr, P, slot, t, nb, arrays, batches;
  int64_t loads, step, first;  // first: this slot's first row
  uint4* pieces;
  float* stats;

  __device__ int64_t row(int b, int i) const {
    return first + (static_cast<int64_t>(b) * kRows + i) * step;
  }
  __device__ int64_t load(int j, int k) const { return t + j * P + static_cast<int64_t>(k) * tpr; }
  __device__ uint4* piece(int s, int a, int i, int f) const {
    return pieces + (((s * arrays + a) * kRows + i) * F + f) * kThreads + threadIdx.x;
  }
  __device__ float* stat(int s, int which, int i) const {
    return stats + ((s * 2 + which) * kRows + i) * kThreads + threadIdx.x;
  }
};

// Copies batch b's pieces of this thread into its ring slot; one cp.async group, empty past the
// last batch, so that group g is always batch g.
template <typename T, int V>
__device__ __forceinline__ void issue_batch(const NormBwdParams& p, const Place<V * bwd_loads<T, true>()>& w,
                                            int b) {
  using E = Elems<T, true>;
  constexpr int kLoads = bwd_loads<T, true>();
  if (b < w.batches) {
    const int s = b % w.nb;
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int64_t r = w.row(b, i);
      if (r >= p.rows) continue;
      if (p.mu != nullptr) copy_async<4>(w.stat(s, 0, i), p.mu + r);
      copy_async<4>(w.stat(s, 1, i), p.rsigma + r);
#pragma unroll
      for (int j = 0; j < V; ++j) {
#pragma unroll
        for (int k = 0; k < kLoads; ++k) {
          const int64_t v = w.load(j, k);
          if (v >= w.loads) continue;
          const int64_t at = r * p.hidden + v * E::N;
          const int f = j * kLoads + k;
          copy_async<16>(w.piece(s, 0, i, f), static_cast<const T*>(p.x) + at);
          copy_async<16>(w.piece(s, 1, i, f), static_cast<const T*>(p.dy) + at);
          if (p.dresidual != nullptr) {
            copy_async<16>(w.piece(s, 2, i, f), static_cast<const T*>(p.dresidual) + at);
          }
        }
      }
    }
  }
  commit();
}

// Batch b from the ring: the row sums, dx, and the column sums (rows in order).
template <typename T, int V, int kCols>
__device__ __forceinline__ void process_batch(const StagedArgs& a,
                                              const Place<V * bwd_loads<T, true>()>& w, int b,
                                              const float (&gam)[V][kCols],
                                              float (&dgamma)[V][kCols], float (&dbeta)[V][kCols],
                                              float (*scratch)[32]) {
  using E = Elems<T, true>;
  constexpr int kLoads = bwd_loads<T, true>();
  const NormBwdParams& p = a.p;
  const int s = b % w.nb;
  float mu[kRows], rs[kRows], sums[V][2 * kRows];
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const bool valid = w.row(b, i) < p.rows;
    mu[i] = valid && p.mu != nullptr ? *w.stat(s, 0, i) : 0.0f;
    rs[i] = valid ? *w.stat(s, 1, i) : 0.0f;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      sums[j][2 * i] = sums[j][2 * i + 1] = 0.0f;
#pragma unroll
      for (int k = 0; k < kLoads; ++k) {
        if (!valid || w.load(j, k) >= w.loads) continue;
        float x[E::N], dy[E::N];
        E::to_floats(*w.piece(s, 0, i, j * kLoads + k), x);
        E::to_floats(*w.piece(s, 1, i, j * kLoads + k), dy);
#pragma unroll
        for (int e = 0; e < E::N; ++e) {
          const float xhat = __fmul_rn(__fsub_rn(x[e], mu[i]), rs[i]);
          const float dyg = __fmul_rn(dy[e], gam[j][k * E::N + e]);
          sums[j][2 * i] = __fadd_rn(sums[j][2 * i], __fmul_rn(dyg, xhat));
          sums[j][2 * i + 1] = __fadd_rn(sums[j][2 * i + 1], dyg);
        }
      }
    }
  }
  row_sums_virtual<V, 2 * kRows>(sums, w.tpr, w.P, scratch);
  const float h = static_cast<float>(p.hidden);
#pragma unroll
  for (int i = 0; i < kRows; ++i) {  // the rows in order: the column sums take them so
    const int64_t r = w.row(b, i);
    if (r >= p.rows) continue;
    const float c1 = a.inv_hidden != 0.0f ? __fmul_rn(sums[0][2 * i], a.inv_hidden)
                                          : __fdiv_rn(sums[0][2 * i], h);
    const float c2 = p.rms                 ? 0.0f
                     : a.inv_hidden != 0.0f ? __fmul_rn(sums[0][2 * i + 1], a.inv_hidden)
                                            : __fdiv_rn(sums[0][2 * i + 1], h);
#pragma unroll
    for (int j = 0; j < V; ++j) {
#pragma unroll
      for (int k = 0; k < kLoads; ++k) {
        const int64_t v = w.load(j, k);
        if (v >= w.loads) continue;
        const int f = j * kLoads + k;
        float x[E::N], dy[E::N], dx[E::N], dres[E::N];
        E::to_floats(*w.piece(s, 0, i, f), x);
        E::to_floats(*w.piece(s, 1, i, f), dy);
        if (p.dresidual != nullptr) E::to_floats(*w.piece(s, 2, i, f), dres);
#pragma unroll
        for (int e = 0; e < E::N; ++e) {
          const float xhat = __fmul_rn(__fsub_rn(x[e], mu[i]), rs[i]);
          const float dyg = __fmul_rn(dy[e], gam[j][k * E::N + e]);
          const float g = __fsub_rn(__fsub_rn(dyg, c2), __fmul_rn(xhat, c1));
          dx[e] = __fmul_rn(g, rs[i]);
          if (p.dresidual != nullptr) dx[e] = __fadd_rn(dx[e], dres[e]);
          dgamma[j][k * E::N + e] = __fadd_rn(dgamma[j][k * E::N + e], __fmul_rn(dy[e], xhat));
          dbeta[j][k * E::N + e] = __fadd_rn(dbeta[j][k * E::N + e], dy[e]);
        }
        E::store(static_cast<T*>(p.dx) + r * p.hidden + v * E::N, E::from_floats(dx));
      }
    }
  }
}

// After every block wrote its workspace row: the last a.reducers blocks to get here sum the
// workspace's columns into dgamma and dbeta, once all blocks have got here.
template <typename T>
__device__ __forceinline__ void reduce_when_all_done(const StagedArgs& a, void* smem) {
  __shared__ int ticket;
  __threadfence();  // this block's workspace row, visible before its arrival is counted
  __syncthreads();
  if (threadIdx.x == 0) ticket = atomicAdd(a.counters, 1);
  __syncthreads();
  const int first_reducer = static_cast<int>(gridDim.x) - a.reducers;
  if (ticket < first_reducer) return;
  if (threadIdx.x == 0) {
    while (*reinterpret_cast<volatile int*>(a.counters) < static_cast<int>(gridDim.x)) {
      __nanosleep(256);
    }
  }
  __syncthreads();
  __threadfence();  // every block's row, visible to the loads below (from L2)
  auto* tile = reinterpret_cast<float(*)[kNormBwdMaxBlocks][kStage2Cols]>(smem);
  const int64_t col_blocks = cuda::ceil_div(a.p.hidden, kStage2Cols);
  for (int64_t cb = ticket - first_reducer; cb < col_blocks; cb += a.reducers) {
    param_grad_columns<T>(a.p.workspace, static_cast<T*>(a.p.dgamma), static_cast<T*>(a.p.dbeta),
                          gridDim.x, a.p.hidden, cb * kStage2Cols, tile);
  }
  if (threadIdx.x == 0 && atomicAdd(a.counters + 1, 1) == a.reducers - 1) {
    a.counters[0] = 0;  // every reducer has seen the full count: zeros for the next kernel
    a.counters[1] = 0;
  }
}

template <typename T, int V>
__global__ void __launch_bounds__(kThreads, 2) norm_bwd_staged_kernel(StagedArgs a) {
  using E = Elems<T, true>;
  constexpr int kLoads = bwd_loads<T, true>();
  constexpr int F = V * kLoads;
  constexpr int kCols = kLoads * E::N;  // columns per lane
  extern __shared__ uint4 smem[];
  __shared__ float scratch[2 * kRows][32];
  const NormBwdParams& p = a.p;
  Place<F> w;
  w.tpr = a.layout.tpr;
  w.P = w.tpr / V;
  w.slot = threadIdx.x / w.P;
  w.t = threadIdx.x % w.P;
  w.nb = a.nb;
  w.arrays = a.arrays;
  w.loads = p.hidden / E::N;
  w.step = static_cast<int64_t>(gridDim.x) * a.layout.rows_per_block;
  const int64_t first0 = static_cast<int64_t>(blockIdx.x) * a.layout.rows_per_block;
  w.first = first0 + w.slot;
  // Batches are the same for the whole block (slot 0 has the most rows): uniform barriers.
  w.batches = static_cast<int>(cuda::ceil_div(cuda::ceil_div(p.rows - first0, w.step), kRows));
  w.pieces = smem;
  w.stats = reinterpret_cast<float*>(smem + a.nb * a.arrays * kRows * F * kThreads);
  for (int b = 0; b + 1 < w.nb; ++b) issue_batch<T, V>(p, w, b);
  float gam[V][kCols], dgamma[V][kCols], dbeta[V][kCols];
#pragma unroll
  for (int j = 0; j < V; ++j) {
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      const int64_t v = w.load(j, k);
      float g[E::N] = {};
      if (v < w.loads) cuda::load_vec<T>(static_cast<const T*>(p.gamma) + v * E::N, g);
#pragma unroll
      for (int e = 0; e < E::N; ++e) {
        gam[j][k * E::N + e] = p.zero_centered_gamma ? __fadd_rn(g[e], 1.0f) : g[e];
        dgamma[j][k * E::N + e] = dbeta[j][k * E::N + e] = 0.0f;
      }
    }
  }
  for (int b = 0; b < w.batches; ++b) {
    issue_batch<T, V>(p, w, b + w.nb - 1);
    wait_all_but(w.nb - 1);  // batch b has landed
    process_batch<T, V, kCols>(a, w, b, gam, dgamma, dbeta, scratch);
  }
  wait_groups<0>();
  store_column_sums<V, kLoads, E::N>(p, a.layout, w.P, w.loads, dgamma, dbeta);
  if (a.counters != nullptr) reduce_when_all_done<T>(a, smem);
}

// Whether this process set the kernel's shared-memory limit on `device` (devices < 64).
template <typename T, int V>
bool smem_limit_set(int device, int bytes) {
  static std::atomic<uint64_t> done{0};
  const uint64_t bit = uint64_t{1} << (device & 63);
  if (done.load() & bit) return true;
  auto kernel = norm_bwd_staged_kernel<T, V>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) !=
          cudaSuccess ||
      cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                           cudaSharedmemCarveoutMaxShared) != cudaSuccess) {
    return false;
  }
  done.fetch_or(bit);
  return true;
}

// Blocks that may wait for the others: half of what fits on the device at the largest ring
// (queried once per device), at most kMaxReducers, the grid and the column blocks; 0 when the
// query fails (then a second kernel sums).
template <typename T, int V>
int reducers_for(int device, int grid, int64_t hidden, int max_bytes) {
  static std::atomic<int> fits[64] = {};
  int n = fits[device & 63].load();
  if (n == 0) {
    int sms = 0, per_sm = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, norm_bwd_staged_kernel<T, V>,
                                                      kThreads, max_bytes) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    n = sms * per_sm;
    fits[device & 63].store(n);
  }
  const int64_t col_blocks = cuda::ceil_div(hidden, kStage2Cols);
  return static_cast<int>(std::min<int64_t>({n / 2, kMaxReducers, grid, col_blocks}));
}

}  // namespace

template <typename T, int V>
Status norm_bwd_staged(const NormBwdParams& p, RowLayout layout, int grid, bool* launched,
                       bool* param_grads_done, cudaStream_t stream) {
  constexpr int F = V * bwd_loads<T, true>();
  // Two blocks per SM of the H100/H200 (228 KB) beside the static shared memory
  // (store_column_sums' 16 KB when V is 1); where the limit cannot be set, the batched kernel.
  constexpr int kMaxBytes = 108 * 1024;
  constexpr int64_t kBudget = (V == 1 ? 84 : 108) * 1024;
  StagedArgs a{};
  a.p = p;
  a.layout = layout;
  a.arrays = p.dresidual != nullptr ? 3 : 2;
  const int64_t batch_bytes = (a.arrays * kRows * F * 16 + 2 * kRows * 4) * kThreads;
  a.nb = static_cast<int>(std::clamp<int64_t>(kBudget / batch_bytes, 2, 4));
  const size_t bytes = std::max<int64_t>(a.nb * batch_bytes, kTileBytes);
  const bool pow2 = (p.hidden & (p.hidden - 1)) == 0;
  a.inv_hidden = pow2 ? 1.0f / static_cast<float>(p.hidden) : 0.0f;
  int device = 0;
  *launched = false;
  if (cudaGetDevice(&device) != cudaSuccess || !smem_limit_set<T, V>(device, kMaxBytes)) {
    cudaGetLastError();
    return Status{};
  }
  a.reducers = p.param_grad_in_kernel ? reducers_for<T, V>(device, grid, p.hidden, kMaxBytes) : 0;
  a.counters = a.reducers > 0 ? cuda::dbias_counters(stream, 2) : nullptr;
  norm_bwd_staged_kernel<T, V><<<grid, kThreads, bytes, stream>>>(a);
  *launched = true;
  *param_grads_done = a.counters != nullptr;
  return cuda::check_launch("norm_bwd_staged_kernel");
}

template Status norm_bwd_staged<float, 1>(const NormBwdParams&, RowLayout, int, bool*, bool*,
                                          cudaStream_t);
template Status norm_bwd_staged<__nv_bfloat16, 1>(const NormBwdParams&, RowLayout, int, bool*, bool*,
                                                  cudaStream_t);
template Status norm_bwd_staged<__nv_bfloat16, 2>(const NormBwdParams&, RowLayout, int, bool*, bool*,
                                                  cudaStream_t);
template Status norm_bwd_staged<__half, 1>(const NormBwdParams&, RowLayout, int, bool*, bool*,
                                           cudaStream_t);
template Status norm_bwd_staged<__half, 2>(const NormBwdParams&, RowLayout, int, bool*, bool*,
                                           cudaStream_t);

}  // namespace graphfp8::norm_bwd
