// Element conversions for the CPU kernels, bit-identical to torch's own `.to()` rounding. The
// kernels bind their element types once, with dtype_switch.h, and use these per element.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../common.h"

namespace graphfp8::cpu {

template <bool kE4M3>
using Fp8 = std::conditional_t<kE4M3, c10::Float8_e4m3fn, c10::Float8_e5m2>;

// v rounded to a high-precision type T and back to float (identity for float).
template <typename T>
inline float round_to(float v) {
  return static_cast<float>(T(v));
}

// Saturating quantization of an already-scaled value. Every NaN becomes the canonical 0x7F (the
// sign of a NaN does not survive all of torch's conversions, so it is not kept); everything else
// is clamped to the format's finite range, then rounded to nearest even.
template <bool kE4M3>
inline uint8_t quantize(float v) {
  if (std::isnan(v)) return 0x7F;
  constexpr float max_val = kE4M3 ? kE4M3Max : kE5M2Max;
  v = std::fmin(std::fmax(v, -max_val), max_val);
  return Fp8<kE4M3>(v).x;
}

// The value of FP8 bits.
template <bool kE4M3>
inline float fp8_to_float(uint8_t bits) {
  return static_cast<float>(Fp8<kE4M3>(bits, Fp8<kE4M3>::from_bits()));
}

}  // namespace graphfp8::cpu
