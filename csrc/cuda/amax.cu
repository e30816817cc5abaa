// CUDA: the amax pass of current scaling, amax = max(amax, max |f(x)|) with f of common.h's
// FusedAct (fused_act.cuh: the same f as the casts), NaN ignored. It only reads: no FP8 bytes,
// no transpose, no dbias (the throwaway cast it replaces wrote 1-2 bytes per element).
//
// Grid: a grid-stride loop of 256-thread blocks, at most 8 per SM; each thread issues kUnroll
// 16-byte loads (kUnroll more of act_in for dGELU) before it uses any, so ~64-128 bytes per
// thread are in flight; the tail (or a misaligned tensor) goes element by element. Each block
// reduces its amax in registers and shared memory and issues one atomic max. max is
// order-independent, so the result is the cast kernels' amax bit for bit.
#include "../common.h"
#include "../dtype_switch.h"
#include "fp8_util.cuh"
#include "fused_act.cuh"
#include "vec.cuh"

namespace graphfp8 {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;
constexpr int kBlocksPerSm = 8;

template <typename T>
__device__ __forceinline__ void to_floats(const uint4& r, float (&f)[cuda::Vec<T>::N]) {
  if constexpr (sizeof(T) == 4) {
    cuda::unpack(r, f);
  } else {
    cuda::unpack<T>(r, f);
  }
}

// Folds max |f| of the kLoads vectors in r (and h, dGELU) into amax.
template <typename T, FusedAct kAct, int kLoads>
__device__ __forceinline__ void fold(const uint4 (&r)[kLoads], const uint4 (&h)[kLoads],
                                     float& amax) {
  constexpr int N = cuda::Vec<T>::N;
#pragma unroll
  for (int u = 0; u < kLoads; ++u) {
    float f[N], g[N];
    to_floats<T>(r[u], f);
    if constexpr (kAct == FusedAct::kDgelu) to_floats<T>(h[u], g);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float v = cuda::apply_act<T, kAct>(f[k], kAct == FusedAct::kDgelu ? g[k] : 0.0f);
      amax = fmaxf(amax, fabsf(v));
    }
  }
}

template <typename T, FusedAct kAct>
__global__ void __launch_bounds__(kThreads)
    amax_kernel(const T* __restrict__ x, const T* __restrict__ act_in, float* amax_p,
                const float* noop, int64_t n, bool vectorized) {
  if (noop != nullptr && *noop == 1.0f) return;
  constexpr int N = cuda::Vec<T>::N;
  constexpr bool kIn = kAct == FusedAct::kDgelu;
  float amax = 0.0f;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t n_vec = vectorized ? n / N : 0;
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  const uint4* hv = reinterpret_cast<const uint4*>(act_in);
  int64_t i = first;
  for (; i + (kUnroll - 1) * stride < n_vec; i += kUnroll * stride) {
    uint4 r[kUnroll], h[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      r[u] = __ldg(xv + i + u * stride);
      if constexpr (kIn) h[u] = __ldg(hv + i + u * stride);
    }
    fold<T, kAct, kUnroll>(r, h, amax);
  }
  for (; i < n_vec; i += stride) {
    uint4 r[1], h[1];
    r[0] = __ldg(xv + i);
    if constexpr (kIn) h[0] = __ldg(hv + i);
    fold<T, kAct, 1>(r, h, amax);
  }
  for (int64_t j = n_vec * N + first; j < n; j += stride) {
    const float v = cuda::apply_act<T, kAct>(cuda::to_float(x[j]),
                                             kIn ? cuda::to_float(act_in[j]) : 0.0f);
    amax = fmaxf(amax, fabsf(v));
  }
  cuda::block_amax_atomic(amax, amax_p);
}

template <typename T, FusedAct kAct>
Status launch(const AmaxParams& p, cudaStream_t stream) {
  constexpr int N = cuda::Vec<T>::N;
  const bool vec = cuda::aligned16(p.x) && (p.act_in == nullptr || cuda::aligned16(p.act_in));
  const int64_t items = vec ? cuda::ceil_div(p.numel / N, kUnroll) : p.numel;
  const int grid = cuda::grid_size(cuda::ceil_div(items, kThreads), kBlocksPerSm);
  amax_kernel<T, kAct><<<grid, kThreads, 0, stream>>>(
      static_cast<const T*>(p.x), static_cast<const T*>(p.act_in), p.amax, p.noop, p.numel, vec);
  return cuda::check_launch("amax_kernel");
}

}  // namespace

Status amax_cuda(const AmaxParams& p, void* stream_ptr) {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  GRAPHFP8_SWITCH_HP(p.dtype, "amax", T,
    switch (p.act) {
      case FusedAct::kNone: return launch<T, FusedAct::kNone>(p, stream);
      case FusedAct::kGelu: return launch<T, FusedAct::kGelu>(p, stream);
      case FusedAct::kDgelu: return launch<T, FusedAct::kDgelu>(p, stream);
    })
  return Status{"amax", "unsupported activation"};
}

}  // namespace graphfp8
