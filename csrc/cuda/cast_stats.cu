// CUDA: the FP8 cast statistics (csrc/cast_stats.h).
//
// Grid: exactly `partials` blocks of 256 threads in a grid-stride loop over the rows * cols
// elements (scalar loads: the op runs only on the steps that record); block u reduces its
// threads' partial sums in double (warp shuffles, then shared memory) and writes out row u. The
// high-precision value of the fused modes is recomputed with the fused kernels' arithmetic
// (gelu_math.h; the norms' __f*_rn operations of norm_fwd.cu), so its max equals the amax those
// kernels recorded. Every block returns at once when *enabled == 0 or *skip == 1.
#include "../cast_stats.h"
#include "../dtype_switch.h"
#include "../gelu_math.h"
#include "fp8_util.cuh"

namespace graphfp8 {
namespace {

constexpr int kThreads = 256;

template <typename T>
__device__ __forceinline__ T from_f(float v);
template <>
__device__ __forceinline__ float from_f<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }

template <typename T>
__device__ __forceinline__ float hp_value(const CastStatsParams& p, int64_t i) {
  const float x = cuda::to_float(static_cast<const T*>(p.x)[i]);
  if (p.mode == kStatsGelu) return cuda::to_float(from_f<T>(gelu_tanh(x)));
  if (p.mode == kStatsDgelu) {
    const float h = cuda::to_float(static_cast<const T*>(p.act_in)[i]);
    return cuda::to_float(from_f<T>(dgelu_tanh(x, h)));
  }
  if (p.mode == kStatsLayerNorm || p.mode == kStatsRmsNorm) {
    const int64_t r = i / p.cols;
    const int64_t c = i - r * p.cols;
    float g = cuda::to_float(static_cast<const T*>(p.gamma)[c]);
    if (p.zero_centered_gamma) g = __fadd_rn(g, 1.0f);
    const float mu = p.mode == kStatsLayerNorm ? p.mu[r] : 0.0f;
    float y = __fmul_rn(__fmul_rn(__fsub_rn(x, mu), p.rsigma[r]), g);
    if (p.mode == kStatsLayerNorm) {
      y = __fadd_rn(y, cuda::to_float(static_cast<const T*>(p.beta)[c]));
    }
    return y;
  }
  return x;
}

__device__ __forceinline__ double warp_reduce(double v, bool is_max) {
  for (int off = cuda::kWarpSize / 2; off > 0; off /= 2) {
    const double o = __shfl_xor_sync(0xffffffffu, v, off);
    v = is_max ? fmax(v, o) : v + o;
  }
  return v;
}

template <typename T, bool kE4M3>
__global__ void __launch_bounds__(kThreads) cast_stats_kernel(CastStatsParams p) {
  if (p.enabled != nullptr && *p.enabled == 0.0f) return;
  if (p.skip != nullptr && *p.skip == 1.0f) return;
  const float scale = *p.scale;
  const float scale_inv = __fdiv_rn(1.0f, scale);
  constexpr float max_val = kE4M3 ? kE4M3Max : kE5M2Max;
  double acc[6] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0};  // amax, sat, under, nonzero, signal, noise
  const int64_t n = p.rows * p.cols;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const float v = hp_value<T>(p, i);
    if (isnan(v)) continue;
    const float y = __fmul_rn(v, scale);
    const float q = cuda::fp8_to_float<kE4M3>(cuda::quantize<kE4M3>(y));
    acc[0] = fmax(acc[0], static_cast<double>(fabsf(v)));
    acc[1] += fabsf(y) > max_val ? 1.0 : 0.0;
    acc[2] += (q == 0.0f && v != 0.0f) ? 1.0 : 0.0;
    acc[3] += v != 0.0f ? 1.0 : 0.0;
    const double e = static_cast<double>(v) - static_cast<double>(__fmul_rn(q, scale_inv));
    acc[4] += static_cast<double>(v) * static_cast<double>(v);
    acc[5] += e * e;
  }
  __shared__ double shared[kThreads / cuda::kWarpSize][6];
  const int lane = threadIdx.x % cuda::kWarpSize;
  const int warp = threadIdx.x / cuda::kWarpSize;
#pragma unroll
  for (int k = 0; k < 6; ++k) acc[k] = warp_reduce(acc[k], k == 0);
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < 6; ++k) shared[warp][k] = acc[k];
  }
  __syncthreads();
  if (warp != 0) return;
  constexpr int kWarps = kThreads / cuda::kWarpSize;
#pragma unroll
  for (int k = 0; k < 6; ++k) {
    double v = lane < kWarps ? shared[lane][k] : 0.0;
    acc[k] = warp_reduce(v, k == 0);
  }
  if (lane == 0) {
    double* row = p.out + static_cast<int64_t>(blockIdx.x) * kStatsColumns;
#pragma unroll
    for (int k = 0; k < 6; ++k) row[k] = acc[k];
    row[6] = scale;
    row[7] = *p.recorded_amax;
  }
}

}  // namespace

Status cast_stats_cuda(const CastStatsParams& p, void* stream_ptr) {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  const DType fp8 = p.e4m3 ? DType::kE4M3 : DType::kE5M2;
  const int grid = static_cast<int>(p.partials);
  GRAPHFP8_SWITCH_HP(p.x_dtype, "cast_stats", T,
    GRAPHFP8_SWITCH_FP8(fp8, "cast_stats", kE4M3,
      cast_stats_kernel<T, kE4M3><<<grid, kThreads, 0, stream>>>(p);
      return cuda::check_launch("cast_stats_kernel");))
  return Status{};
}

}  // namespace graphfp8
