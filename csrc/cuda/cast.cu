// CUDA: elementwise FP8 cast with fused amax and scale_inv write, and FP8 dequantize.
//
// cast: out = saturate(x * scale) in E4M3 or E5M2, amax = max(amax, max |x|), scale_inv = 1/scale,
// in one pass over x. Grid: a grid-stride loop of 256-thread blocks (at most 4 per SM); each
// iteration of a thread handles 16 consecutive elements with 16-byte loads and one 16-byte FP8
// store; the tail (or a misaligned tensor) goes element by element. Each block reduces its amax in
// registers and shared memory and issues one atomic max. The kCurrent variant computes its
// scale from the slot's amax first (current_scale.cuh) and folds no amax.
//
// dequantize: out = x_fp8 * scale_inv rounded to bf16/fp16/fp32, 16 elements per iteration.
#include "../common.h"
#include "../dtype_switch.h"
#include "current_scale.cuh"
#include "fp8_util.cuh"
#include "tile.cuh"
#include "vec.cuh"

namespace graphfp8 {
namespace {

constexpr int kThreads = 256;
constexpr int kElems = 16;  // elements per vector iteration: one 16-byte FP8 store
constexpr int kBlocksPerSm = 4;

template <typename InT, bool kE4M3, bool kCurrent>
__global__ void __launch_bounds__(kThreads)
    cast_kernel(const InT* __restrict__ x, uint8_t* __restrict__ out, const float* scale_p,
                float* scale_inv, float* amax_p, const float* noop, int64_t n, bool vectorized,
                CurrentScale current) {
  // A current-scaling cast updates its slot even when the noop flag skips the cast, as the
  // separate scale update did.
  const float scale = cuda::cast_scale<kCurrent>(scale_p, current);
  if (noop != nullptr && *noop == 1.0f) return;
  float amax = 0.0f;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t n_vec = vectorized ? n / kElems : 0;
  constexpr int kPerLoad = cuda::Vec<InT>::N;
  for (int64_t i = first; i < n_vec; i += stride) {
    uint8_t q[kElems];
#pragma unroll
    for (int l = 0; l < kElems / kPerLoad; ++l) {
      float f[kPerLoad];
      cuda::load_vec(x + i * kElems + l * kPerLoad, f);
#pragma unroll
      for (int k = 0; k < kPerLoad; ++k) {
        amax = fmaxf(amax, fabsf(f[k]));
        q[l * kPerLoad + k] = cuda::quantize<kE4M3>(f[k] * scale);
      }
    }
    cuda::store_bytes<kElems>(out + i * kElems, q);
  }
  for (int64_t i = n_vec * kElems + first; i < n; i += stride) {
    const float v = cuda::to_float(x[i]);
    amax = fmaxf(amax, fabsf(v));
    out[i] = cuda::quantize<kE4M3>(v * scale);
  }
  cuda::cast_epilogue<kCurrent>(amax, amax_p, scale_inv, scale);
}

template <bool kE4M3, typename OutT>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const uint8_t* __restrict__ x, OutT* __restrict__ out,
                      const float* scale_inv_p, int64_t n, bool vectorized) {
  const float scale_inv = *scale_inv_p;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t n_vec = vectorized ? n / kElems : 0;
  for (int64_t i = first; i < n_vec; i += stride) {
    const uint4 r = __ldg(reinterpret_cast<const uint4*>(x + i * kElems));
    const uint32_t words[4] = {r.x, r.y, r.z, r.w};
    constexpr int kPerStore = cuda::Vec<OutT>::N;
    OutT vals[kElems];
#pragma unroll
    for (int k = 0; k < kElems; ++k) {
      const uint8_t b = static_cast<uint8_t>(words[k / 4] >> (8 * (k % 4)));
      vals[k] = cuda::from_float<OutT>(cuda::fp8_to_float<kE4M3>(b) * scale_inv);
    }
#pragma unroll
    for (int s = 0; s < kElems / kPerStore; ++s) {
      reinterpret_cast<uint4*>(out + i * kElems)[s] = *reinterpret_cast<const uint4*>(vals + s * kPerStore);
    }
  }
  for (int64_t i = n_vec * kElems + first; i < n; i += stride) {
    out[i] = cuda::from_float<OutT>(cuda::fp8_to_float<kE4M3>(x[i]) * scale_inv);
  }
}

int grid_for(int64_t work_items) {
  return cuda::grid_size(cuda::ceil_div(work_items, kThreads), kBlocksPerSm);
}

template <typename InT, bool kE4M3, bool kCurrent>
Status launch_cast(const CastParams& p, cudaStream_t stream) {
  const int64_t n = p.rows * p.cols;
  const bool vec = cuda::aligned16(p.x) && cuda::aligned16(p.out);
  cast_kernel<InT, kE4M3, kCurrent><<<grid_for(vec ? n / kElems : n), kThreads, 0, stream>>>(
      static_cast<const InT*>(p.x), static_cast<uint8_t*>(p.out), p.scale, p.scale_inv, p.amax,
      p.noop, n, vec, p.current);
  return cuda::check_launch("cast_kernel");
}

template <typename OutT, bool kE4M3>
Status launch_dequantize(const DequantizeParams& p, cudaStream_t stream) {
  const bool vec = cuda::aligned16(p.x) && cuda::aligned16(p.out);
  dequantize_kernel<kE4M3, OutT><<<grid_for(vec ? p.numel / kElems : p.numel), kThreads, 0,
                                   stream>>>(p.x, static_cast<OutT*>(p.out), p.scale_inv,
                                             p.numel, vec);
  return cuda::check_launch("dequantize_kernel");
}

}  // namespace

Status cast_cuda(const CastParams& p, void* stream_ptr) {
  if (p.out_t != nullptr) return cast_transpose_cuda(p, stream_ptr);
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  GRAPHFP8_SWITCH_HP(p.x_dtype, "cast", InT,
    GRAPHFP8_SWITCH_FP8(p.out_dtype, "cast", kE4M3,
      GRAPHFP8_SWITCH_BOOL(p.current.on(), kCurrent,
        return launch_cast<InT, kE4M3, kCurrent>(p, stream);)))
  return Status{};
}

Status dequantize_cuda(const DequantizeParams& p, void* stream_ptr) {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  GRAPHFP8_SWITCH_HP(p.out_dtype, "dequantize", OutT,
    GRAPHFP8_SWITCH_FP8(p.x_dtype, "dequantize", kE4M3,
      return launch_dequantize<OutT, kE4M3>(p, stream);))
  return Status{};
}

}  // namespace graphfp8
