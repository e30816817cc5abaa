// CUDA: the 16-bit vectorised LayerNorm / RMSNorm backward at hidden sizes up to 4096 (kernel
// switch NORM_BWD_V2), bit for bit norm_bwd_batched.cu's dx and column sums.
//
// Why the batched kernel sits at ~0.42 of its floor (notes/PERF.md, issue 41): its 256 blocks
// (the sums' order fixes the grid) fit two per SM, and each thread loads a batch of rows, waits
// for it, then spends ~54 instructions per element with nothing in flight. This kernel keeps its
// threads, lanes, slots and grid, hence every sum in the same order, and changes what runs when:
//   - two batches of R rows per slot in flight in registers: a batch's 16-byte pieces become
//     floats (xhat, the row partial sums) as soon as they land, and the same registers take the
//     loads of the batch after next, so loads stay in flight through the row sums, dx and the
//     column sums (the batched kernel waited for each batch with nothing else to do);
//   - the per-element work specialised at compile time (RMSNorm or LayerNorm, dresidual or
//     not): gamma (+1) once per block into shared memory, xhat kept from the first pass, dx
//     packed two values per convert, the row sums divided by a power-of-two hidden size as a
//     multiplication by its reciprocal (the same correctly rounded quotient), RMSNorm's dbeta
//     sums skipped (no dbeta): ~14-20 instructions per element instead of ~54;
//   - one barrier per batch instead of two: the row sums alternate two scratch buffers.
// Grid: the batched kernel's (launch_v): blocks of 256 threads, at most kNormBwdMaxBlocks; a
// thread holds V = 1 or 2 lanes of 8 columns of its slot's rows first + i * step; the column sums
// then go to param_grad_batched_kernel through the workspace as the batched kernel's do.
#include <type_traits>

#include "../common.h"
#include "fp8_util.cuh"
#include "norm.cuh"
#include "norm_bwd_rows.cuh"
#include "vec.cuh"

namespace graphfp8::norm_bwd {
namespace {

constexpr int kN = 8;                // 16-bit elements per 16-byte piece
constexpr int kMaxLoads = 4096 / kN;  // pieces per row at the largest hidden size

// Rows per slot and batch: two batches in flight within 128 registers (two blocks per SM).
template <int V>
constexpr int v2_rows() {
  return V == 1 ? 2 : 1;
}

// One batch as loaded: this thread's pieces of its lanes in R rows, and the rows' statistics.
template <int V, int R, bool kDres>
struct Loaded {
  uint4 x[R][V], dy[R][V], dres[R][kDres ? V : 1];
  float mu[R], rs[R];
};

// One batch after its first pass: what dx and the column sums need.
template <int V, int R, bool kDres>
struct Pending {
  float xhat[R][V][kN];
  uint4 dy[R][V], dres[R][kDres ? V : 1];
  float rs[R];
};

// A thread's place: its lanes (norm_bwd_batched_kernel's t + j P), its slot's rows, and gamma
// (+1 when zero-centred) as floats in shared memory: piece v's first four at g[v], the last four
// at g[loads + v] (a warp's reads contiguous).
template <int V>
struct Lanes {
  int64_t col[V];   // first column of lane j
  int v[V];         // lane j's piece of a row
  bool ok[V];       // lane j holds columns (a hidden size not a power of two leaves some idle)
  int64_t first;    // the slot's first row
  int64_t step;     // rows between a slot's consecutive rows
  int loads;        // pieces per row
  const float4* g;  // shared memory
};

template <int V>
__device__ __forceinline__ void gamma_of(const Lanes<V>& w, int j, float (&g)[kN]) {
  const float4 lo = w.g[w.v[j]], hi = w.g[w.loads + w.v[j]];
  g[0] = lo.x, g[1] = lo.y, g[2] = lo.z, g[3] = lo.w;
  g[4] = hi.x, g[5] = hi.y, g[6] = hi.z, g[7] = hi.w;
}

template <typename T, int V, int R, bool kRms, bool kDres>
__device__ __forceinline__ void issue(const NormBwdParams& p, const Lanes<V>& w, int64_t row0,
                                      Loaded<V, R, kDres>& b) {
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int64_t r = row0 + i * w.step;
    if (r >= p.rows) continue;
    if constexpr (!kRms) b.mu[i] = p.mu[r];
    b.rs[i] = p.rsigma[r];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      if (!w.ok[j]) continue;
      const int64_t at = r * p.hidden + w.col[j];
      b.x[i][j] = __ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(p.x) + at));
      b.dy[i][j] = __ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(p.dy) + at));
      if constexpr (kDres) {
        const T* dres = static_cast<const T*>(p.dresidual) + at;
        b.dres[i][j] = __ldg(reinterpret_cast<const uint4*>(dres));
      }
    }
  }
}

// The first pass over a landed batch: xhat and each lane's partial row sums (sum of dyg xhat,
// then for LayerNorm sum of dyg, per row), in the batched kernel's order (bwd_terms' math).
template <typename T, int V, int R, bool kRms, bool kDres, int K>
__device__ __forceinline__ void first_pass(const NormBwdParams& p, const Lanes<V>& w,
                                           int64_t row0, const Loaded<V, R, kDres>& b,
                                           Pending<V, R, kDres>& q, float (&s)[V][K]) {
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const bool valid = row0 + i * w.step < p.rows;
    q.rs[i] = b.rs[i];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      float s0 = 0.0f, s1 = 0.0f;
      if (valid && w.ok[j]) {
        float x[kN], dy[kN], g[kN];
        gamma_of(w, j, g);
        cuda::unpack<T>(b.x[i][j], x);
        cuda::unpack<T>(b.dy[i][j], dy);
#pragma unroll
        for (int e = 0; e < kN; ++e) {
          const float xhat = kRms ? __fmul_rn(x[e], b.rs[i])
                                  : __fmul_rn(__fsub_rn(x[e], b.mu[i]), b.rs[i]);
          const float dyg = __fmul_rn(dy[e], g[e]);
          s0 = __fadd_rn(s0, __fmul_rn(dyg, xhat));
          if constexpr (!kRms) s1 = __fadd_rn(s1, dyg);
          q.xhat[i][j][e] = xhat;
        }
        q.dy[i][j] = b.dy[i][j];
        if constexpr (kDres) q.dres[i][j] = b.dres[i][j];
      }
      s[j][kRms ? i : 2 * i] = s0;
      if constexpr (!kRms) s[j][2 * i + 1] = s1;
    }
  }
}

// sum / hidden, correctly rounded (inv: 1 / hidden when that is a power of two, else 0).
__device__ __forceinline__ float mean_of(float sum, float inv, float h) {
  return inv != 0.0f ? __fmul_rn(sum, inv) : __fdiv_rn(sum, h);
}

// Two floats rounded to T (cuda::from_float's rounding and NaNs) as one word.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// The second pass, after the row sums: dx (plus dresidual) of each row, and the column sums,
// rows in order.
template <typename T, int V, int R, bool kRms, bool kDres, int K>
__device__ __forceinline__ void second_pass(const NormBwdParams& p, const Lanes<V>& w,
                                            int64_t row0, const Pending<V, R, kDres>& q,
                                            const float (&s)[V][K], float inv_hidden,
                                            float (&dgamma)[V][kN], float (&dbeta)[V][kN]) {
  const float h = static_cast<float>(p.hidden);
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int64_t r = row0 + i * w.step;
    if (r >= p.rows) continue;
    const float c1 = mean_of(s[0][kRms ? i : 2 * i], inv_hidden, h);
    const float c2 = kRms ? 0.0f : mean_of(s[0][2 * i + 1], inv_hidden, h);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      if (!w.ok[j]) continue;
      float dy[kN], dres[kN], dx[kN], g[kN];
      gamma_of(w, j, g);
      cuda::unpack<T>(q.dy[i][j], dy);
      if constexpr (kDres) cuda::unpack<T>(q.dres[i][j], dres);
#pragma unroll
      for (int e = 0; e < kN; ++e) {
        const float xhat = q.xhat[i][j][e];
        const float dyg = __fmul_rn(dy[e], g[e]);
        const float tc = __fmul_rn(xhat, c1);
        const float gr = kRms ? __fsub_rn(dyg, tc) : __fsub_rn(__fsub_rn(dyg, c2), tc);
        dx[e] = __fmul_rn(gr, q.rs[i]);
        if constexpr (kDres) dx[e] = __fadd_rn(dx[e], dres[e]);
        dgamma[j][e] = __fadd_rn(dgamma[j][e], __fmul_rn(dy[e], xhat));
        if constexpr (!kRms) dbeta[j][e] = __fadd_rn(dbeta[j][e], dy[e]);
      }
      const uint4 out = make_uint4(pack2<T>(dx[0], dx[1]), pack2<T>(dx[2], dx[3]),
                                   pack2<T>(dx[4], dx[5]), pack2<T>(dx[6], dx[7]));
      *reinterpret_cast<uint4*>(static_cast<T*>(p.dx) + r * p.hidden + w.col[j]) = out;
    }
  }
}

template <typename T, int V, int R, bool kRms, bool kDres>
__global__ void __launch_bounds__(kThreads, 2)
    norm_bwd_v2_kernel(NormBwdParams p, RowLayout layout, float inv_hidden) {
  constexpr int K = kRms ? R : 2 * R;  // row sums per lane and batch
  __shared__ float scratch[2][K][32];  // even batches, odd batches: one barrier per batch
  const int tpr = layout.tpr;
  const int P = tpr / V;
  const int slot = threadIdx.x / P;
  const int t = threadIdx.x % P;
  const int64_t loads = p.hidden / kN;
  Lanes<V> w;
  w.step = static_cast<int64_t>(gridDim.x) * layout.rows_per_block;
  const int64_t first0 = static_cast<int64_t>(blockIdx.x) * layout.rows_per_block;
  w.first = first0 + slot;
  // Batches are the same for the whole block (slot 0 has the most rows): uniform barriers.
  const int batches =
      static_cast<int>(cuda::ceil_div(cuda::ceil_div(p.rows - first0, w.step), R));
  const int64_t batch_rows = R * w.step;
  float dgamma[V][kN], dbeta[V][kN];
#pragma unroll
  for (int j = 0; j < V; ++j) {
    w.v[j] = t + j * P;
    w.ok[j] = w.v[j] < loads;
    w.col[j] = static_cast<int64_t>(w.v[j]) * kN;
#pragma unroll
    for (int e = 0; e < kN; ++e) dgamma[j][e] = dbeta[j][e] = 0.0f;
  }
  w.loads = static_cast<int>(loads);
  Loaded<V, R, kDres> a, b;
  Pending<V, R, kDres> q;
  float s[V][K];
  issue<T, V, R, kRms, kDres>(p, w, w.first, a);  // the first two batches' loads, then gamma
  if (batches > 1) issue<T, V, R, kRms, kDres>(p, w, w.first + batch_rows, b);
  __shared__ float4 gamma[2 * kMaxLoads];
  w.g = gamma;
  for (int v = threadIdx.x; v < w.loads; v += kThreads) {
    float gam[kN];
    cuda::load_vec<T>(static_cast<const T*>(p.gamma) + static_cast<int64_t>(v) * kN, gam);
#pragma unroll
    for (int e = 0; e < kN; ++e) gam[e] = p.zero_centered_gamma ? __fadd_rn(gam[e], 1.0f) : gam[e];
    gamma[v] = make_float4(gam[0], gam[1], gam[2], gam[3]);
    gamma[w.loads + v] = make_float4(gam[4], gam[5], gam[6], gam[7]);
  }
  __syncthreads();  // gamma
  // Batch n lands in a (n even) or b (n odd); once converted, its registers load batch n + 2.
  for (int n = 0; n < batches; n += 2) {
    int64_t row0 = w.first + n * batch_rows;
    first_pass<T, V, R, kRms, kDres, K>(p, w, row0, a, q, s);
    if (n + 2 < batches) issue<T, V, R, kRms, kDres>(p, w, row0 + 2 * batch_rows, a);
    row_sums_virtual<V, K, false>(s, tpr, P, scratch[0]);
    second_pass<T, V, R, kRms, kDres, K>(p, w, row0, q, s, inv_hidden, dgamma, dbeta);
    if (n + 1 >= batches) break;
    row0 += batch_rows;
    first_pass<T, V, R, kRms, kDres, K>(p, w, row0, b, q, s);
    if (n + 3 < batches) issue<T, V, R, kRms, kDres>(p, w, row0 + 2 * batch_rows, b);
    row_sums_virtual<V, K, false>(s, tpr, P, scratch[1]);
    second_pass<T, V, R, kRms, kDres, K>(p, w, row0, q, s, inv_hidden, dgamma, dbeta);
  }
  store_column_sums<V, 1, kN, !kRms>(p, layout, P, loads, dgamma, dbeta);
}

template <typename T, int V, bool kRms, bool kDres>
Status launch(const NormBwdParams& p, RowLayout layout, int grid, float inv_hidden,
              cudaStream_t stream) {
  norm_bwd_v2_kernel<T, V, v2_rows<V>(), kRms, kDres>
      <<<grid, kThreads, 0, stream>>>(p, layout, inv_hidden);
  return cuda::check_launch("norm_bwd_v2_kernel");
}

}  // namespace

template <typename T, int V>
Status norm_bwd_v2(const NormBwdParams& p, RowLayout layout, int grid, cudaStream_t stream) {
  static_assert(sizeof(T) == 2 && V <= 2, "norm_bwd_v2: 16-bit rows of up to 2 lanes a thread");
  const bool pow2 = (p.hidden & (p.hidden - 1)) == 0;
  const float inv = pow2 ? 1.0f / static_cast<float>(p.hidden) : 0.0f;
  const bool dres = p.dresidual != nullptr;
  if (p.rms) {
    return dres ? launch<T, V, true, true>(p, layout, grid, inv, stream)
                : launch<T, V, true, false>(p, layout, grid, inv, stream);
  }
  return dres ? launch<T, V, false, true>(p, layout, grid, inv, stream)
              : launch<T, V, false, false>(p, layout, grid, inv, stream);
}

template Status norm_bwd_v2<__nv_bfloat16, 1>(const NormBwdParams&, RowLayout, int, cudaStream_t);
template Status norm_bwd_v2<__nv_bfloat16, 2>(const NormBwdParams&, RowLayout, int, cudaStream_t);
template Status norm_bwd_v2<__half, 1>(const NormBwdParams&, RowLayout, int, cudaStream_t);
template Status norm_bwd_v2<__half, 2>(const NormBwdParams&, RowLayout, int, cudaStream_t);

}  // namespace graphfp8::norm_bwd
