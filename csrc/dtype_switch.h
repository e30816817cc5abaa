// The one dtype switch of the kernels: runtime DType -> compile-time element type or FP8 format,
// with an error default (in the manner of TransformerEngine's TYPE_SWITCH and flash-attention's
// static_switch.h).
//
//   GRAPHFP8_SWITCH_HP(p.x_dtype, "cast", T, return launch<T>(p, stream););
//   GRAPHFP8_SWITCH_FP8(p.out_dtype, "cast", kE4M3, return launch<T, kE4M3>(p, stream););
//   GRAPHFP8_SWITCH_BOOL(vec, kVec, return launch<kVec>(p, stream););
//
// The HP switch binds T to float, or to this backend's 16-bit types: CUDA's __nv_bfloat16 and
// __half in .cu files, c10's BFloat16 and Half in the CPU .cpp files. A DType that the switch does
// not cover makes the enclosing function return a failed Status; csrc/ops/ has already rejected
// such inputs with a clear error, so reaching the default is an internal invariant failure,
// reported (by csrc/ops/) rather than ignored. The enclosing function must therefore return Status.
#pragma once

#include "common.h"

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
namespace graphfp8::elem {
using BFloat16 = __nv_bfloat16;
using Half = __half;
}  // namespace graphfp8::elem
#else
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
namespace graphfp8::elem {
using BFloat16 = c10::BFloat16;
using Half = c10::Half;
}  // namespace graphfp8::elem
#endif

#define GRAPHFP8_SWITCH_CASE_(value, binding, ...) \
  case value: {                                    \
    binding;                                       \
    __VA_ARGS__                                    \
  } break;

#define GRAPHFP8_SWITCH_DEFAULT_(what) \
  default:                             \
    return ::graphfp8::Status{what, "unsupported dtype"};

// Runs the statements with T bound to the element type of a float32/bfloat16/float16 `dtype`.
#define GRAPHFP8_SWITCH_HP(dtype, what, T, ...)                                                \
  switch (dtype) {                                                                             \
    GRAPHFP8_SWITCH_CASE_(::graphfp8::DType::kFloat32, using T = float, __VA_ARGS__)           \
    GRAPHFP8_SWITCH_CASE_(::graphfp8::DType::kBFloat16, using T = ::graphfp8::elem::BFloat16, \
                          __VA_ARGS__)                                                         \
    GRAPHFP8_SWITCH_CASE_(::graphfp8::DType::kFloat16, using T = ::graphfp8::elem::Half,      \
                          __VA_ARGS__)                                                         \
    GRAPHFP8_SWITCH_DEFAULT_(what)                                                             \
  }

// Runs the statements with `constexpr bool kE4M3` telling an E4M3 `dtype` from an E5M2 one.
#define GRAPHFP8_SWITCH_FP8(dtype, what, kE4M3, ...)                                             \
  switch (dtype) {                                                                             \
    GRAPHFP8_SWITCH_CASE_(::graphfp8::DType::kE4M3, constexpr bool kE4M3 = true, __VA_ARGS__)  \
    GRAPHFP8_SWITCH_CASE_(::graphfp8::DType::kE5M2, constexpr bool kE4M3 = false, __VA_ARGS__) \
    GRAPHFP8_SWITCH_DEFAULT_(what)                                                             \
  }

// Runs the statements with `constexpr bool kName` equal to the runtime `cond`.
#define GRAPHFP8_SWITCH_BOOL(cond, kName, ...) \
  if (cond) {                                  \
    constexpr bool kName = true;               \
    __VA_ARGS__                                \
  } else {                                     \
    constexpr bool kName = false;              \
    __VA_ARGS__                                \
  }
