// The tile constants and element I/O of the blockwise CUDA kernels (blockwise.cu and
// blockwise_norm.cu): a 256-thread block per 128x128 region, each lane four consecutive columns.
#pragma once

#include <cstdint>

#include "../blockwise.h"
#include "fp8_util.cuh"

namespace graphfp8::cuda::blockwise {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / cuda::kWarpSize;
constexpr int kTile = static_cast<int>(kBlockTile);
constexpr int kStride = kTile + 4;  // shared row stride in floats: 16-byte rows, float4 stores
constexpr int kSmemBytes = kTile * kStride * static_cast<int>(sizeof(float));

// Four consecutive elements at p as floats; whole: all four exist and p is aligned for one load.
template <typename T>
__device__ __forceinline__ void load4(const T* p, int valid, bool whole, float (&f)[4]) {
  if (whole) {
    if constexpr (sizeof(T) == 4) {
      const float4 v = __ldg(reinterpret_cast<const float4*>(p));
      f[0] = v.x, f[1] = v.y, f[2] = v.z, f[3] = v.w;
    } else {
      const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
      const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
      for (int k = 0; k < 4; ++k) f[k] = cuda::to_float(e[k]);
    }
    return;
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) f[k] = k < valid ? cuda::to_float(p[k]) : 0.0f;
}

// Four FP8 bytes to dst (4-byte aligned when whole), the first `valid` of them otherwise.
__device__ __forceinline__ void store4(uint8_t* dst, const uint8_t (&q)[4], int valid, bool whole) {
  if (whole) {
    *reinterpret_cast<uint32_t*>(dst) = static_cast<uint32_t>(q[0]) | (uint32_t(q[1]) << 8) |
                                        (uint32_t(q[2]) << 16) | (uint32_t(q[3]) << 24);
    return;
  }
  for (int k = 0; k < valid; ++k) dst[k] = q[k];
}

__device__ __forceinline__ uint4 pack16(const uint8_t (&q)[16]) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    w[i] = uint32_t(q[4 * i]) | (uint32_t(q[4 * i + 1]) << 8) | (uint32_t(q[4 * i + 2]) << 16) |
           (uint32_t(q[4 * i + 3]) << 24);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ uint32_t warp_max(uint32_t v) {
  return __reduce_max_sync(0xffffffffu, v);
}

}  // namespace graphfp8::cuda::blockwise
