// The row machinery of the norm kernels (norm_fwd.cu, norm_bwd.cu): N-element loads, how the
// threads of a block map onto rows, and the per-row sums.
//
// `tpr` threads per row, a power of two, thread lane_r of a row taking its loads
// v = lane_r + k * tpr (k < kLoads) of N elements (16-byte loads, or N = 1 where the hidden size
// or an address does not allow them); blocks of max(256, tpr) threads hold block / tpr rows at a
// time and walk the rows. A thread keeps its part of the row in registers between the reductions
// (sums over the tpr threads: shuffles, then shared memory across warps in a fixed order), so x
// is read from memory once. Elementwise math uses explicitly rounded operations (no fused
// multiply-add), so given the same mu and rsigma the outputs equal the CPU kernel's.
#pragma once

#include <type_traits>

#include "../common.h"
#include "fp8_util.cuh"
#include "vec.cuh"

namespace graphfp8::cuda::norm {

constexpr int kMaxThreads = 1024;

// N elements of T as one load: a 16-byte vector, or one element.
template <typename T, bool kVec>
struct Elems {
  static constexpr int N = kVec ? Vec<T>::N : 1;
  using Frag = std::conditional_t<kVec, uint4, T>;

  __device__ static Frag load(const T* p) {
    if constexpr (kVec) {
      return __ldg(reinterpret_cast<const uint4*>(p));
    } else {
      return *p;
    }
  }
  __device__ static void store(T* p, const Frag& f) {
    if constexpr (kVec) {
      *reinterpret_cast<uint4*>(p) = f;
    } else {
      *p = f;
    }
  }
  __device__ static void to_floats(const Frag& f, float (&v)[N]) {
    if constexpr (!kVec) {
      v[0] = to_float(f);
    } else if constexpr (sizeof(T) == 4) {
      unpack(f, v);
    } else {
      unpack<T>(f, v);
    }
  }
  __device__ static Frag from_floats(const float (&v)[N]) {  // rounds to T like torch
    if constexpr (!kVec) {
      return from_float<T>(v[0]);
    } else {
      alignas(16) T t[N];
#pragma unroll
      for (int j = 0; j < N; ++j) t[j] = from_float<T>(v[j]);
      return *reinterpret_cast<const uint4*>(t);
    }
  }
};

// Loads per thread and row: the forward keeps up to 4 vectors of its row (8 elements
// unvectorised), the backward 8 columns (it also keeps two column sums per column); more spills
// registers. So the CUDA kernels take rows of up to kNormMaxHiddenCuda elements: 1024 threads x 8.
template <typename T, bool kVec>
constexpr int fwd_loads() { return kVec ? 4 : 8; }
template <typename T, bool kVec>
constexpr int bwd_loads() { return 8 / Elems<T, kVec>::N; }

struct RowLayout {
  int tpr;             // threads per row
  int block;           // threads per block
  int rows_per_block;  // rows a block holds at a time
};

inline RowLayout row_layout(int64_t loads_per_row, int max_loads) {
  const int64_t need = cuda::ceil_div(loads_per_row, max_loads);
  int tpr = 1;
  while (tpr < need) tpr *= 2;
  const int block = tpr > 256 ? tpr : 256;
  return {tpr, block, block / tpr};
}

// Sums each of the K values over the tpr threads of every row. Every thread of the block calls
// it (it synchronises the block when tpr > 32) and every thread of a row gets the row's sums, the
// same on every run (a fixed order; the xor butterfly gives all lanes the same sums because
// fp32 addition is commutative).
template <int K>
__device__ __forceinline__ void row_sums(float (&v)[K], int tpr, float (*scratch)[32]) {
  const int width = tpr < cuda::kWarpSize ? tpr : cuda::kWarpSize;
  for (int off = width / 2; off > 0; off /= 2) {
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] = __fadd_rn(v[k], __shfl_xor_sync(0xffffffffu, v[k], off));
  }
  if (tpr <= cuda::kWarpSize) return;
  const int warp = threadIdx.x / cuda::kWarpSize;
  const int warps_per_row = tpr / cuda::kWarpSize;
  if (threadIdx.x % cuda::kWarpSize == 0) {
#pragma unroll
    for (int k = 0; k < K; ++k) scratch[k][warp] = v[k];
  }
  __syncthreads();
  const int first = (warp / warps_per_row) * warps_per_row;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    float s = 0.0f;
    for (int w = 0; w < warps_per_row; ++w) s = __fadd_rn(s, scratch[k][first + w]);
    v[k] = s;
  }
  __syncthreads();  // scratch is reused by the next call
}

// xhat and dy g of the N elements of load v of a row (the backward's elementwise terms, shared
// by norm_bwd.cu and norm_bwd_batched.cu).
template <typename T, bool kVec>
__device__ __forceinline__ void bwd_terms(const NormBwdParams& p, int64_t v,
                                          const typename Elems<T, kVec>::Frag& x_raw,
                                          const typename Elems<T, kVec>::Frag& dy_raw, float mu,
                                          float rsigma, float (&xhat)[Elems<T, kVec>::N],
                                          float (&dy)[Elems<T, kVec>::N],
                                          float (&dyg)[Elems<T, kVec>::N]) {
  using E = Elems<T, kVec>;
  float x[E::N], g[E::N];
  E::to_floats(x_raw, x);
  E::to_floats(dy_raw, dy);
  E::to_floats(E::load(static_cast<const T*>(p.gamma) + v * E::N), g);
#pragma unroll
  for (int j = 0; j < E::N; ++j) {
    const float gj = p.zero_centered_gamma ? __fadd_rn(g[j], 1.0f) : g[j];
    xhat[j] = p.rms ? __fmul_rn(x[j], rsigma) : __fmul_rn(__fsub_rn(x[j], mu), rsigma);
    dyg[j] = __fmul_rn(dy[j], gj);
  }
}

// Whether the backward takes 16-byte loads: the hidden size a multiple of the vector width and
// every row pointer aligned (norm_bwd.cu and norm_bwd_batched.cu decide alike).
template <typename T>
inline bool bwd_vectorized(const NormBwdParams& p) {
  return p.hidden % Vec<T>::N == 0 && aligned16(p.dy) && aligned16(p.x) && aligned16(p.gamma) &&
         aligned16(p.dx) && (p.dresidual == nullptr || aligned16(p.dresidual));
}

}  // namespace graphfp8::cuda::norm
