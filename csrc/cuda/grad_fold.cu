// CUDA: the gradient fold of graphed callables (grad_fold.h): buffer = *first ? grad : buffer +
// grad over n elements. The copy moves the bits as they are; the sum is taken in fp32 and
// rounded as torch's CUDA add rounds it (vec.cuh's from_float: NaN bits included), so a graph
// that folds with it leaves `.grad` bit for bit what eager AccumulateGrad leaves. The flag is read
// from device memory: one captured backward graph copies on the first microbatch of a step (the
// flag set by the accumulator's reset graph instead of a -0.0 fill) and adds on the others
// (notes/PERF.md, "Gradient accumulation at Llama shapes").
//
// Grid: 256-thread blocks striding over 16-byte vectors (8 bf16 / fp16 or 4 fp32 elements) when
// both pointers are 16-byte aligned and n is a multiple of the vector; otherwise over elements.
#include "../dtype_switch.h"
#include "../grad_fold.h"
#include "fp8_util.cuh"
#include "vec.cuh"

namespace graphfp8 {
namespace {

constexpr int kThreads = 256;

template <typename T>
__device__ __forceinline__ uint4 add_vec(const uint4& b, const uint4& g) {
  constexpr int N = cuda::Vec<T>::N;
  float fb[N], fg[N];
  if constexpr (sizeof(T) == 4) {
    cuda::unpack(b, fb);
    cuda::unpack(g, fg);
  } else {
    cuda::unpack<T>(b, fb);
    cuda::unpack<T>(g, fg);
  }
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (sizeof(T) == 4) {
      w[i] = __float_as_uint(fb[i] + fg[i]);
    } else {
      const uint32_t lo = cuda::to_bits(fb[2 * i] + fg[2 * i], T{});
      const uint32_t hi = cuda::to_bits(fb[2 * i + 1] + fg[2 * i + 1], T{});
      w[i] = lo | (hi << 16);
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// The buffer is read with a plain load (it is written by this kernel: not __ldg's read-only
// path); each vector is read and written by one thread.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    grad_fold_vec_kernel(uint4* buffer, const uint4* __restrict__ grad, const int32_t* first,
                         int64_t vectors) {
  const bool copy = *first != 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; v < vectors;
       v += stride) {
    const uint4 g = __ldg(grad + v);
    buffer[v] = copy ? g : add_vec<T>(buffer[v], g);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    grad_fold_kernel(T* buffer, const T* __restrict__ grad, const int32_t* first, int64_t n) {
  const bool copy = *first != 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    buffer[i] = copy ? grad[i]
                     : cuda::from_float<T>(cuda::to_float(buffer[i]) + cuda::to_float(grad[i]));
  }
}

// One thread per vector (element), at most 16 blocks per SM (then grid-stride).
int blocks_for(int64_t work) { return cuda::grid_size(cuda::ceil_div(work, kThreads), 16); }

template <typename T>
Status launch(const GradFoldParams& p, cudaStream_t stream) {
  constexpr int N = cuda::Vec<T>::N;
  const bool aligned = cuda::aligned16(p.buffer) && cuda::aligned16(p.grad) && p.n % N == 0;
  if (aligned) {
    const int64_t vectors = p.n / N;
    grad_fold_vec_kernel<T><<<blocks_for(vectors), kThreads, 0, stream>>>(
        static_cast<uint4*>(p.buffer), static_cast<const uint4*>(p.grad), p.first, vectors);
  } else {
    grad_fold_kernel<T><<<blocks_for(p.n), kThreads, 0, stream>>>(
        static_cast<T*>(p.buffer), static_cast<const T*>(p.grad), p.first, p.n);
  }
  return cuda::check_launch("grad_fold_kernel");
}

}  // namespace

Status grad_fold_cuda(const GradFoldParams& p, void* stream) {
  if (p.n == 0) return Status{};
  GRAPHFP8_SWITCH_HP(p.dtype, "grad_fold", T,
                     return launch<T>(p, static_cast<cudaStream_t>(stream)););
  return Status{};
}

}  // namespace graphfp8
