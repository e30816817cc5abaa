// CUDA: rotary position embedding of the q and k parts of a fused QKV tensor, v copied (common.h
// has the math; the backward is the same kernel with inverse = true).
//
// Grid: one warp per row, a row being one (batch, seq, part, head) vector of head_dim elements;
// warps stride over rows (8 per block), and the row's position and part are worked out once per
// row, not per element (64-bit divisions are slow). Lane l takes the pairs l, l + 32, ... of its
// row, so a warp's loads of x[i] and of x[i + half] are each contiguous. Math in double (the
// products of a 16/32-bit value and a float32 table entry are exact), rounded through float.
#include "../common.h"
#include "fp8_util.cuh"
#include "vec.cuh"

namespace graphfp8 {
namespace {

constexpr int kThreads = 256;

template <typename T>
__device__ __forceinline__ double load(const T* p) {
  if constexpr (sizeof(T) == 4) {
    return static_cast<double>(*p);
  } else if constexpr (std::is_same_v<T, __half>) {
    return static_cast<double>(__half2float(*p));
  } else {
    return static_cast<double>(__bfloat162float(*p));
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    rope_kernel(const T* __restrict__ x, T* __restrict__ out, const float* __restrict__ cos_t,
                const float* __restrict__ sin_t, int64_t seq, int64_t heads, int64_t head_dim,
                int64_t rows, bool inverse) {
  const int64_t half = head_dim / 2;
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kThreads / 32);
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32; r < rows;
       r += warps) {
    const int64_t head_row = r / heads;  // (batch, seq, part)
    const int64_t part = head_row % 3;
    const int64_t s = (head_row / 3) % seq;
    const T* xr = x + r * head_dim;
    T* outr = out + r * head_dim;
    const float* c = cos_t + s * head_dim;
    const float* n = sin_t + s * head_dim;
    for (int64_t i = lane; i < half; i += 32) {
      const double lo = load(xr + i);
      const double hi = load(xr + i + half);
      double out_lo = lo, out_hi = hi;
      if (part < 2 && !inverse) {
        out_lo = lo * c[i] - hi * n[i];
        out_hi = hi * c[i + half] + lo * n[i + half];
      } else if (part < 2) {
        out_lo = lo * c[i] + hi * n[i + half];
        out_hi = hi * c[i + half] - lo * n[i];
      }
      outr[i] = cuda::from_float<T>(static_cast<float>(out_lo));
      outr[i + half] = cuda::from_float<T>(static_cast<float>(out_hi));
    }
  }
}

template <typename T>
void launch(const RopeParams& p, cudaStream_t stream) {
  const int64_t rows = p.batch * p.seq * 3 * p.heads;
  const int64_t wanted = (rows + kThreads / 32 - 1) / (kThreads / 32);
  const int64_t cap = static_cast<int64_t>(cuda::sm_count()) * 16;
  const int blocks = static_cast<int>(wanted < cap ? wanted : cap);
  rope_kernel<T><<<blocks, kThreads, 0, stream>>>(
      static_cast<const T*>(p.x), static_cast<T*>(p.out), p.cos, p.sin, p.seq, p.heads,
      p.head_dim, rows, p.inverse);
}

}  // namespace

void rope_cuda(const RopeParams& p, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  switch (p.dtype) {
    case DType::kFloat32: launch<float>(p, s); break;
    case DType::kBFloat16: launch<__nv_bfloat16>(p, s); break;
    case DType::kFloat16: launch<__half>(p, s); break;
    default: break;  // ops.cpp rejects other dtypes
  }
}

}  // namespace graphfp8
