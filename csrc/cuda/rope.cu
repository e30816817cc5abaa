// CUDA: rotary position embedding of the q and k parts of a fused QKV tensor, v copied (common.h
// has the math; the backward is the same kernel with inverse = true).
//
// Vector path (half = head_dim / 2 a multiple of N = 16 / sizeof(T), 16-byte-aligned tensors): a
// grid-stride loop over chunks, a chunk being N consecutive (lo, hi) pairs of one row (one
// (batch, seq, part, head) vector). A thread loads its chunk's lo and hi halves with one 16-byte
// load each, rotates them in fp32 and stores them with one 16-byte store each; consecutive
// threads take consecutive chunks, so a warp moves whole rows. The row's position and part
// (rope_layout.h) are worked out once per chunk. Other shapes take a scalar loop, one pair per
// iteration.
//
// The arithmetic uses explicitly rounded fp32 operations (no fused multiply-add), like the CPU
// kernel (built with -ffp-contract=off) and the PyTorch twin, so all three agree bit for bit; it
// is rope_math.cuh's, shared with rope_fp8.cu.
#include "../common.h"
#include "../dtype_switch.h"
#include "../rope_layout.h"
#include "fp8_util.cuh"
#include "rope_math.cuh"
#include "vec.cuh"

namespace graphfp8 {
namespace {

constexpr int kThreads = 256;
constexpr int kBlocksPerSm = 8;

// One pair: rope_math.cuh (the rotation rope_fp8.cu shares, bit for bit).
__device__ __forceinline__ RopePair rotate(float lo, float hi, float c_lo, float c_hi, float n_lo,
                                           float n_hi, bool inverse) {
  return rope_rotate(lo, hi, c_lo, c_hi, n_lo, n_hi, inverse);
}

struct RowInfo {
  int64_t seq, heads, kv_heads, head_dim;
};

template <typename T>
__global__ void __launch_bounds__(kThreads)
    rope_vec_kernel(const T* __restrict__ x, T* __restrict__ out, const float* __restrict__ cos_t,
                    const float* __restrict__ sin_t, RowInfo info, int64_t chunks, bool inverse) {
  constexpr int N = cuda::Vec<T>::N;
  const int64_t half = info.head_dim / 2;
  const int64_t per_row = half / N;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < chunks;
       c += stride) {
    const int64_t r = c / per_row;
    const int64_t i0 = (c - r * per_row) * N;
    const int64_t lo_at = r * info.head_dim + i0;
    float lo[N], hi[N];
    cuda::load_vec(x + lo_at, lo);
    cuda::load_vec(x + lo_at + half, hi);
    const RopeRow at = rope_row(r, info.seq, info.heads, info.kv_heads, info.head_dim);
    if (at.rotated) {
      const float* cs = cos_t + at.s * info.head_dim + i0;
      const float* sn = sin_t + at.s * info.head_dim + i0;
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const RopePair o = rotate(lo[k], hi[k], __ldg(cs + k), __ldg(cs + half + k),
                                  __ldg(sn + k), __ldg(sn + half + k), inverse);
        lo[k] = o.lo;
        hi[k] = o.hi;
      }
    }
    alignas(16) T lo_out[N];
    alignas(16) T hi_out[N];
#pragma unroll
    for (int k = 0; k < N; ++k) {
      lo_out[k] = cuda::from_float<T>(lo[k]);
      hi_out[k] = cuda::from_float<T>(hi[k]);
    }
    *reinterpret_cast<uint4*>(out + lo_at) = *reinterpret_cast<const uint4*>(lo_out);
    *reinterpret_cast<uint4*>(out + lo_at + half) = *reinterpret_cast<const uint4*>(hi_out);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    rope_scalar_kernel(const T* __restrict__ x, T* __restrict__ out, const float* __restrict__ cos_t,
                       const float* __restrict__ sin_t, RowInfo info, int64_t pairs, bool inverse) {
  const int64_t half = info.head_dim / 2;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < pairs;
       p += stride) {
    const int64_t r = p / half;
    const int64_t i = p - r * half;
    const int64_t lo_at = r * info.head_dim + i;
    float lo = cuda::to_float(x[lo_at]), hi = cuda::to_float(x[lo_at + half]);
    const RopeRow at = rope_row(r, info.seq, info.heads, info.kv_heads, info.head_dim);
    if (at.rotated) {
      const float* cs = cos_t + at.s * info.head_dim;
      const float* sn = sin_t + at.s * info.head_dim;
      const RopePair o = rotate(lo, hi, cs[i], cs[i + half], sn[i], sn[i + half], inverse);
      lo = o.lo;
      hi = o.hi;
    }
    out[lo_at] = cuda::from_float<T>(lo);
    out[lo_at + half] = cuda::from_float<T>(hi);
  }
}

int grid_for(int64_t work) { return cuda::grid_size(cuda::ceil_div(work, kThreads), kBlocksPerSm); }

template <typename T>
Status launch(const RopeParams& p, cudaStream_t stream) {
  constexpr int N = cuda::Vec<T>::N;
  const RowInfo info{p.seq, p.heads, p.kv_heads, p.head_dim};
  const int64_t rows = p.batch * p.seq * (p.heads + 2 * p.kv_heads);
  const int64_t half = p.head_dim / 2;
  const auto* x = static_cast<const T*>(p.x);
  auto* out = static_cast<T*>(p.out);
  if (half % N == 0 && cuda::aligned16(x) && cuda::aligned16(out)) {
    const int64_t chunks = rows * (half / N);
    rope_vec_kernel<T><<<grid_for(chunks), kThreads, 0, stream>>>(x, out, p.cos, p.sin, info,
                                                                   chunks, p.inverse);
    return cuda::check_launch("rope_vec_kernel");
  }
  const int64_t pairs = rows * half;
  rope_scalar_kernel<T><<<grid_for(pairs), kThreads, 0, stream>>>(x, out, p.cos, p.sin, info,
                                                                  pairs, p.inverse);
  return cuda::check_launch("rope_scalar_kernel");
}

}  // namespace

Status rope_cuda(const RopeParams& p, void* stream) {
  GRAPHFP8_SWITCH_HP(p.dtype, "rope", T, return launch<T>(p, static_cast<cudaStream_t>(stream));)
  return Status{};
}

}  // namespace graphfp8
