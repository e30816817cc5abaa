// 16-byte vector packing helpers: unpack a uint4 of high-precision values to floats, pack floats
// back (torch's CUDA rounding and NaNs), and pack FP8 bytes into a uint4.
#pragma once

#include <type_traits>

#include "fp8_util.cuh"

namespace graphfp8::cuda {

// Elements of T in one 16-byte access.
template <typename T>
struct Vec {
  static constexpr int N = 16 / sizeof(T);
};

__device__ __forceinline__ void unpack(const uint4& r, float (&f)[4]) {
  f[0] = __uint_as_float(r.x);
  f[1] = __uint_as_float(r.y);
  f[2] = __uint_as_float(r.z);
  f[3] = __uint_as_float(r.w);
}

__device__ __forceinline__ void unpack_pair(uint32_t w, __nv_bfloat16, float* f) {
  f[0] = __uint_as_float(w << 16);  // bf16 -> fp32 is a shift: exact
  f[1] = __uint_as_float(w & 0xffff0000u);
}

__device__ __forceinline__ void unpack_pair(uint32_t w, __half, float* f) {
  f[0] = __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xffffu)));
  f[1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16)));
}

template <typename T>
__device__ __forceinline__ void unpack(const uint4& r, float (&f)[8]) {
  unpack_pair(r.x, T{}, f + 0);
  unpack_pair(r.y, T{}, f + 2);
  unpack_pair(r.z, T{}, f + 4);
  unpack_pair(r.w, T{}, f + 6);
}

// Loads Vec<T>::N elements of T from 16-byte-aligned memory as floats.
template <typename T>
__device__ __forceinline__ void load_vec(const T* p, float (&f)[Vec<T>::N]) {
  const uint4 r = __ldg(reinterpret_cast<const uint4*>(p));
  if constexpr (sizeof(T) == 4) {
    unpack(r, f);
  } else {
    unpack<T>(r, f);
  }
}

// float -> 16-bit exactly as torch's CUDA kernels convert (c10::BFloat16 and c10::Half call
// __float2bfloat16 and __float2half on the device): round to nearest even, and every NaN the
// hardware's canonical 0x7FFF, so a kernel matches its twin run on CUDA, NaN bits included.
// (The CPU kernels convert with c10's scalar conversions: 0x7FC0 for bf16, a signed 0x7E00 for
// fp16. torch's vectorised CPU `.to()` writes yet others on x86, 0xFFFF for bf16 and fp16 NaNs
// that keep their payload, so CPU NaN bits match the twin's only where no NaN is rounded.)
__device__ __forceinline__ uint16_t to_bits(float v, __nv_bfloat16) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(v));
}
__device__ __forceinline__ uint16_t to_bits(float v, __half) {
  return __half_as_ushort(__float2half_rn(v));
}

template <typename T>
__device__ __forceinline__ T from_float(float v) {
  if constexpr (sizeof(T) == 4) {
    return v;
  } else {
    const uint16_t b = to_bits(v, T{});
    if constexpr (std::is_same_v<T, __half>) {
      return __ushort_as_half(b);
    } else {
      return __ushort_as_bfloat16(b);
    }
  }
}

// Packs 4 bytes (b[0] lowest) into a word.
__device__ __forceinline__ uint32_t pack4(const uint8_t* b) {
  return static_cast<uint32_t>(b[0]) | (static_cast<uint32_t>(b[1]) << 8) |
         (static_cast<uint32_t>(b[2]) << 16) | (static_cast<uint32_t>(b[3]) << 24);
}

// Stores N FP8 bytes (N = 1, 4, 8 or 16) with one aligned store.
template <int N>
__device__ __forceinline__ void store_bytes(uint8_t* dst, const uint8_t (&b)[N]) {
  if constexpr (N == 16) {
    *reinterpret_cast<uint4*>(dst) = make_uint4(pack4(b), pack4(b + 4), pack4(b + 8), pack4(b + 12));
  } else if constexpr (N == 8) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(pack4(b), pack4(b + 4));
  } else if constexpr (N == 4) {
    *reinterpret_cast<uint32_t*>(dst) = pack4(b);
  } else {
    static_assert(N == 1, "store_bytes: N must be 1, 4, 8 or 16");
    *dst = b[0];
  }
}

}  // namespace graphfp8::cuda
