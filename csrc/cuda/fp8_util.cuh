// Device helpers shared by the CUDA kernels: element conversion, saturating FP8 quantization,
// block-wide amax reduction, launch checks and grid sizing (the one grid-size helper).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../common.h"

namespace graphfp8::cuda {

constexpr int kWarpSize = 32;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

// Saturating quantization of an already-scaled value, bit-identical to the CPU kernel and to
// reference.quantize: every NaN becomes the canonical 0x7F, the rest is clamped and rounded to
// nearest even by the hardware conversion.
template <bool kE4M3>
__device__ __forceinline__ uint8_t quantize(float v) {
  if (isnan(v)) return 0x7F;
  constexpr float max_val = kE4M3 ? kE4M3Max : kE5M2Max;
  v = fminf(fmaxf(v, -max_val), max_val);
  return static_cast<uint8_t>(
      __nv_cvt_float_to_fp8(v, __NV_SATFINITE, kE4M3 ? __NV_E4M3 : __NV_E5M2));
}

// Four quantize() results packed into a word (a in the lowest byte), from two saturating
// pair converts instead of four clamped single ones (kernel switch PAIRED_QUANTIZE). The same
// bytes: the convert's .satfinite clamps +-inf and overflow to +-max as quantize()'s clamp did,
// rounds in-range values by the same instruction, and only NaN differs - the convert keeps the
// sign (E4M3 0xFF) or a payload (E5M2 0x7D/0x7E/0xFD..) - so every NaN code is then rewritten
// to 0x7F without a compare: t flags each byte whose low 7 bits reach the format's lowest NaN
// code (0x7F for E4M3, 0x7D for E5M2), m = 0x7F in those bytes, w = (w & ~(t | m)) | m.
template <bool kE4M3>
__device__ __forceinline__ uint32_t quantize4(float a, float b, float c, float d) {
  uint16_t lo, hi;
  if constexpr (kE4M3) {
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b), "f"(a));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d), "f"(c));
  } else {
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b), "f"(a));
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d), "f"(c));
  }
  const uint32_t w = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
  constexpr uint32_t kToNan = kE4M3 ? 0x01010101u : 0x03030303u;
  const uint32_t t = ((w & 0x7F7F7F7Fu) + kToNan) & 0x80808080u;
  const uint32_t m = t - (t >> 7);
  return (w & ~(t | m)) | m;
}

// Exact for every finite code and E5M2's infinities. A NaN code decodes to a NaN without its
// sign (torch's decoding keeps it), which no caller can see: each multiplies by scale_inv first,
// and the GPU's float multiply returns its one canonical NaN whatever NaN it is given (the
// float32-output rope_fp8_backward test, with E4M3 NaN codes, matches the twin bit for bit).
template <bool kE4M3>
__device__ __forceinline__ float fp8_to_float(uint8_t bits) {
  __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(bits),
                                         kE4M3 ? __NV_E4M3 : __NV_E5M2);
  return __half2float(__half(h));
}

// Reduces v over the block with fmaxf and folds the result into *amax with one atomic.
// Every thread of the block must call it. v must be >= 0, so that the int ordering of the bit
// patterns equals the float ordering.
__device__ __forceinline__ void block_amax_atomic(float v, float* amax) {
  __shared__ float warp_max[32];
  for (int off = kWarpSize / 2; off > 0; off /= 2) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  }
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  if (lane == 0) warp_max[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const int num_warps = (blockDim.x + kWarpSize - 1) / kWarpSize;
    v = lane < num_warps ? warp_max[lane] : 0.0f;
    for (int off = kWarpSize / 2; off > 0; off /= 2) {
      v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    }
    if (lane == 0 && v > 0.0f) atomicMax(reinterpret_cast<int*>(amax), __float_as_int(v));
  }
}

// The launch status of the kernel just enqueued (csrc/ops/ raises on a failure).
inline Status check_launch(const char* kernel) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return Status{kernel, cudaGetErrorString(err)};
  return Status{};
}

// Number of multiprocessors of the current device, cached per device.
inline int sm_count() {
  static int cached[64] = {0};
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev < 64 && cached[dev] > 0) return cached[dev];
  int n = 0;
  cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
  if (dev < 64) cached[dev] = n;
  return n;
}

// The grid of every launcher: one block per `work_blocks` unit of work, capped at
// `blocks_per_sm` blocks per multiprocessor (every kernel loops over what the grid does not
// cover), and at least one block.
inline int grid_size(int64_t work_blocks, int blocks_per_sm) {
  const int64_t cap = static_cast<int64_t>(sm_count()) * blocks_per_sm;
  const int64_t blocks = work_blocks < cap ? work_blocks : cap;
  return static_cast<int>(blocks < 1 ? 1 : blocks);
}

__host__ __device__ constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace graphfp8::cuda
