// CUDA: rotary embedding fused with the FP8 casts of q, k and v (the front of FP8 attention), and
// its backward: dequantize, rotate dq and dk back, write the fused dQKV (rope_fp8.h has the math);
// the backward also takes high-precision dq, dk, dv (the bf16 attention path: the cat of the
// three and rope_qkv's inverse in one pass).
//
// Forward grid: a grid-stride loop over chunks, a chunk being N = 16 / sizeof(T) consecutive
// (lo, hi) pairs of one input row (rope_layout.h: where a row lives, in the input and the output).
// A thread loads the chunk's lo and hi halves with one 16-byte load each, rotates in fp32, rounds
// to T, quantizes, and writes N FP8 bytes per half into its part's (batch, seq, heads, head_dim)
// output with one store each; consecutive threads take consecutive chunks. Each thread keeps one
// amax per part; a block reduces the three in shared memory and issues three atomics. Shapes that
// do not fit the vector path (half % N != 0, misaligned tensors) take a scalar loop, one pair
// per iteration.
//
// Backward grid: the same chunks, seen from the output: M = 16 / sizeof(OutT) pairs per chunk,
// M FP8 bytes loaded per half, one 16-byte store of OutT per half.
//
// Explicitly rounded fp32 arithmetic (no fused multiply-add), like the CPU kernel and the twin:
// rope_math.cuh's rotation, shared with rope.cu.
#include "../dtype_switch.h"
#include "../rope_fp8.h"
#include "fp8_util.cuh"
#include "rope_math.cuh"
#include "vec.cuh"

namespace graphfp8 {
namespace {

constexpr int kThreads = 256;

using Pair = RopePair;

// rope_math.cuh's rotation: the one rope.cu runs, so that the two paths agree bit for bit.
__device__ __forceinline__ Pair rotate(float lo, float hi, float c_lo, float c_hi, float n_lo,
                                       float n_hi, bool inverse) {
  return rope_rotate(lo, hi, c_lo, c_hi, n_lo, n_hi, inverse);
}

template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return cuda::to_float(cuda::from_float<T>(v));
}

template <>
__device__ __forceinline__ float round_to<float>(float v) {
  return v;
}

// Reduces the three per-part amaxes over the block and folds each into its slot with one atomic.
// v must be >= 0 (int ordering of the bits equals float ordering).
__device__ __forceinline__ void block_amax3(float (&v)[3], float* const (&amax)[3]) {
  __shared__ float warp_max[3][32];
#pragma unroll
  for (int p = 0; p < 3; ++p) {
    for (int off = cuda::kWarpSize / 2; off > 0; off /= 2) {
      v[p] = fmaxf(v[p], __shfl_xor_sync(0xffffffffu, v[p], off));
    }
  }
  const int lane = threadIdx.x % cuda::kWarpSize;
  const int warp = threadIdx.x / cuda::kWarpSize;
  if (lane == 0) {
#pragma unroll
    for (int p = 0; p < 3; ++p) warp_max[p][warp] = v[p];
  }
  __syncthreads();
  if (warp == 0) {
    const int num_warps = (blockDim.x + cuda::kWarpSize - 1) / cuda::kWarpSize;
#pragma unroll
    for (int p = 0; p < 3; ++p) {
      float m = lane < num_warps ? warp_max[p][lane] : 0.0f;
      for (int off = cuda::kWarpSize / 2; off > 0; off /= 2) {
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
      }
      if (lane == 0 && m > 0.0f) atomicMax(reinterpret_cast<int*>(amax[p]), __float_as_int(m));
    }
  }
}

struct Shape {
  int64_t seq, heads, kv_heads, head_dim;
};

// Folds |lo|, |hi| into the amax of `part` without indexing a register array dynamically.
__device__ __forceinline__ void fold(float (&amax)[3], int part, float a) {
  amax[0] = part == 0 ? fmaxf(amax[0], a) : amax[0];
  amax[1] = part == 1 ? fmaxf(amax[1], a) : amax[1];
  amax[2] = part == 2 ? fmaxf(amax[2], a) : amax[2];
}

// The lo and hi halves of a high-precision head vector chunk at src (half elements apart) as
// floats: one 16-byte load each (kVec), or one element each.
template <typename T, bool kVec, int M>
__device__ __forceinline__ void load_halves(const T* src, int64_t half, float (&lo)[M],
                                            float (&hi)[M]) {
  if constexpr (kVec) {
    cuda::load_vec(src, lo);
    cuda::load_vec(src + half, hi);
  } else {
    lo[0] = cuda::to_float(src[0]);
    hi[0] = cuda::to_float(src[half]);
  }
}

template <typename T, bool kE4M3, bool kVec>
__global__ void __launch_bounds__(kThreads)
    rope_fp8_kernel(const T* __restrict__ qkv, RopeFp8Params p, Shape sh, int64_t work) {
  constexpr int N = kVec ? cuda::Vec<T>::N : 1;
  const int64_t half = sh.head_dim / 2;
  const int64_t per_row = half / N;
  const float scale[3] = {*p.scale[0], *p.scale[1], *p.scale[2]};
  float amax[3] = {0.0f, 0.0f, 0.0f};
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < work;
       c += stride) {
    const int64_t r = c / per_row;
    const int64_t i0 = (c - r * per_row) * N;
    const RopeRow at = rope_row(r, sh.seq, sh.heads, sh.kv_heads, sh.head_dim);
    float lo[N], hi[N];
    load_halves<T, kVec>(qkv + r * sh.head_dim + i0, half, lo, hi);
    if (at.part < 2 && p.cos != nullptr) {
      const float* cs = p.cos + at.s * sh.head_dim + i0;
      const float* sn = p.sin + at.s * sh.head_dim + i0;
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const Pair o = rotate(lo[k], hi[k], __ldg(cs + k), __ldg(cs + half + k), __ldg(sn + k),
                              __ldg(sn + half + k), false);
        lo[k] = round_to<T>(o.lo);
        hi[k] = round_to<T>(o.hi);
      }
    }
    uint8_t q_lo[N], q_hi[N];
    const float sc = scale[at.part];
    float a = 0.0f;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      a = fmaxf(a, fmaxf(fabsf(lo[k]), fabsf(hi[k])));
      q_lo[k] = cuda::quantize<kE4M3>(lo[k] * sc);
      q_hi[k] = cuda::quantize<kE4M3>(hi[k] * sc);
    }
    fold(amax, at.part, a);
    uint8_t* dst = static_cast<uint8_t*>(p.out[at.part]) + at.part_offset + i0;
    if constexpr (kVec) {
      cuda::store_bytes<N>(dst, q_lo);
      cuda::store_bytes<N>(dst + half, q_hi);
    } else {
      dst[0] = q_lo[0];
      dst[half] = q_hi[0];
    }
  }
  block_amax3(amax, p.amax);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
#pragma unroll
    for (int part = 0; part < 3; ++part) *p.scale_inv[part] = 1.0f / scale[part];
  }
}

// Loads M FP8 bytes (M = 4 or 8, aligned) as floats times scale_inv.
template <bool kE4M3, int M>
__device__ __forceinline__ void load_fp8(const uint8_t* src, float scale_inv, float (&f)[M]) {
  uint32_t words[M / 4];
  if constexpr (M == 8) {
    const uint2 w = *reinterpret_cast<const uint2*>(src);
    words[0] = w.x;
    words[1] = w.y;
  } else {
    static_assert(M == 4, "load_fp8: M must be 4 or 8");
    words[0] = *reinterpret_cast<const uint32_t*>(src);
  }
#pragma unroll
  for (int k = 0; k < M; ++k) {
    const uint8_t b = static_cast<uint8_t>(words[k / 4] >> (8 * (k % 4)));
    f[k] = cuda::fp8_to_float<kE4M3>(b) * scale_inv;
  }
}

// Where the backward's gradients come from: FP8 (E5M2, E4M3), dequantized, or high precision
// (out's dtype, read as they are: the bf16 attention path).
enum GradKind : int { kGradE5M2, kGradE4M3, kGradHp };

// The lo and hi halves (M elements each) of a gradient vector at element `at` of its part.
template <typename OutT, int kKind, bool kVec, int M>
__device__ __forceinline__ void load_grad(const void* grad, int64_t at, int64_t half,
                                          const float* scale_inv_ptr, float (&lo)[M],
                                          float (&hi)[M]) {
  if constexpr (kKind == kGradHp) {
    load_halves<OutT, kVec>(static_cast<const OutT*>(grad) + at, half, lo, hi);
  } else {
    constexpr bool kE4M3 = kKind == kGradE4M3;
    const auto* src = static_cast<const uint8_t*>(grad) + at;
    const float scale_inv = *scale_inv_ptr;
    if constexpr (kVec) {
      load_fp8<kE4M3, M>(src, scale_inv, lo);
      load_fp8<kE4M3, M>(src + half, scale_inv, hi);
    } else {
      lo[0] = cuda::fp8_to_float<kE4M3>(src[0]) * scale_inv;
      hi[0] = cuda::fp8_to_float<kE4M3>(src[half]) * scale_inv;
    }
  }
}

template <typename OutT, int kKind, bool kVec>
__global__ void __launch_bounds__(kThreads)
    rope_fp8_bwd_kernel(OutT* __restrict__ out, RopeFp8BwdParams p, Shape sh, int64_t work) {
  constexpr int M = kVec ? cuda::Vec<OutT>::N : 1;
  const int64_t half = sh.head_dim / 2;
  const int64_t per_row = half / M;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < work;
       c += stride) {
    const int64_t r = c / per_row;
    const int64_t i0 = (c - r * per_row) * M;
    const RopeRow at = rope_row(r, sh.seq, sh.heads, sh.kv_heads, sh.head_dim);
    float lo[M], hi[M];
    load_grad<OutT, kKind, kVec, M>(p.grad[at.part], at.part_offset + i0, half,
                                    p.scale_inv[at.part], lo, hi);
    if (at.part < 2 && p.cos != nullptr) {
      const float* cs = p.cos + at.s * sh.head_dim + i0;
      const float* sn = p.sin + at.s * sh.head_dim + i0;
#pragma unroll
      for (int k = 0; k < M; ++k) {
        const Pair o = rotate(lo[k], hi[k], __ldg(cs + k), __ldg(cs + half + k), __ldg(sn + k),
                              __ldg(sn + half + k), true);
        lo[k] = o.lo;
        hi[k] = o.hi;
      }
    }
    OutT* dst = out + r * sh.head_dim + i0;
    if constexpr (kVec) {
      alignas(16) OutT lo_out[M];
      alignas(16) OutT hi_out[M];
#pragma unroll
      for (int k = 0; k < M; ++k) {
        lo_out[k] = cuda::from_float<OutT>(lo[k]);
        hi_out[k] = cuda::from_float<OutT>(hi[k]);
      }
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(lo_out);
      *reinterpret_cast<uint4*>(dst + half) = *reinterpret_cast<const uint4*>(hi_out);
    } else {
      dst[0] = cuda::from_float<OutT>(lo[0]);
      dst[half] = cuda::from_float<OutT>(hi[0]);
    }
  }
}

template <typename T, bool kE4M3>
Status launch_fwd(const RopeFp8Params& p, cudaStream_t stream) {
  constexpr int N = cuda::Vec<T>::N;
  const Shape sh{p.seq, p.heads, p.kv_heads, p.head_dim};
  const int64_t rows = p.batch * p.seq * (p.heads + 2 * p.kv_heads);
  const int64_t half = p.head_dim / 2;
  const auto* qkv = static_cast<const T*>(p.qkv);
  bool vec = half % N == 0 && cuda::aligned16(qkv);
  for (int part = 0; part < 3; ++part) vec = vec && cuda::aligned16(p.out[part]);
  const int64_t work = vec ? rows * (half / N) : rows * half;
  const int grid = cuda::grid_size(cuda::ceil_div(work, kThreads), 8);
  GRAPHFP8_SWITCH_BOOL(vec, kVec,
                       rope_fp8_kernel<T, kE4M3, kVec><<<grid, kThreads, 0, stream>>>(qkv, p, sh,
                                                                                      work);)
  return cuda::check_launch("rope_fp8_kernel");
}

template <typename OutT, int kKind>
Status launch_bwd(const RopeFp8BwdParams& p, cudaStream_t stream) {
  constexpr int M = cuda::Vec<OutT>::N;
  const Shape sh{p.seq, p.heads, p.kv_heads, p.head_dim};
  const int64_t rows = p.batch * p.seq * (p.heads + 2 * p.kv_heads);
  const int64_t half = p.head_dim / 2;
  auto* out = static_cast<OutT*>(p.out);
  bool vec = half % M == 0 && cuda::aligned16(out);
  for (int part = 0; part < 3; ++part) vec = vec && cuda::aligned16(p.grad[part]);
  const int64_t work = vec ? rows * (half / M) : rows * half;
  const int grid = cuda::grid_size(cuda::ceil_div(work, kThreads), 8);
  GRAPHFP8_SWITCH_BOOL(vec, kVec,
                       rope_fp8_bwd_kernel<OutT, kKind, kVec><<<grid, kThreads, 0, stream>>>(
                           out, p, sh, work);)
  return cuda::check_launch("rope_fp8_bwd_kernel");
}

}  // namespace

Status rope_fp8_cuda(const RopeFp8Params& p, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  GRAPHFP8_SWITCH_HP(p.qkv_dtype, "rope_fp8_cuda", T,
                     GRAPHFP8_SWITCH_FP8(p.out_dtype, "rope_fp8_cuda", kE4M3,
                                         return launch_fwd<T, kE4M3>(p, s);))
  return Status{};
}

Status rope_fp8_bwd_cuda(const RopeFp8BwdParams& p, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  const bool hp = p.grad_dtype == p.out_dtype;
  GRAPHFP8_SWITCH_HP(p.out_dtype, "rope_fp8_bwd_cuda", OutT,
    if (hp) return launch_bwd<OutT, kGradHp>(p, s);
    GRAPHFP8_SWITCH_FP8(p.grad_dtype, "rope_fp8_bwd_cuda", kE4M3,
                        return launch_bwd<OutT, kE4M3 ? kGradE4M3 : kGradE5M2>(p, s);))
  return Status{};
}

}  // namespace graphfp8
