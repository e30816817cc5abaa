// Element conversions for the CPU kernels, bit-identical to torch's own `.to()` rounding.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>

#include "../common.h"

namespace graphfp8::cpu {

inline float load_as_float(const void* base, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kFloat32:
      return static_cast<const float*>(base)[i];
    case DType::kBFloat16:
      return static_cast<float>(static_cast<const c10::BFloat16*>(base)[i]);
    case DType::kFloat16:
      return static_cast<float>(static_cast<const c10::Half*>(base)[i]);
    case DType::kE4M3:
      return static_cast<float>(static_cast<const c10::Float8_e4m3fn*>(base)[i]);
    case DType::kE5M2:
      return static_cast<float>(static_cast<const c10::Float8_e5m2*>(base)[i]);
  }
  return 0.0f;
}

inline void store_from_float(void* base, DType dtype, int64_t i, float v) {
  switch (dtype) {
    case DType::kFloat32:
      static_cast<float*>(base)[i] = v;
      break;
    case DType::kBFloat16:
      static_cast<c10::BFloat16*>(base)[i] = c10::BFloat16(v);
      break;
    case DType::kFloat16:
      static_cast<c10::Half*>(base)[i] = c10::Half(v);
      break;
    default:
      break;  // FP8 outputs go through quantize()
  }
}

// v rounded to a high-precision dtype and back to float (identity for float32).
inline float round_to(DType dtype, float v) {
  switch (dtype) {
    case DType::kBFloat16:
      return static_cast<float>(c10::BFloat16(v));
    case DType::kFloat16:
      return static_cast<float>(c10::Half(v));
    default:
      return v;
  }
}

inline float fp8_max(DType dtype) { return dtype == DType::kE4M3 ? kE4M3Max : kE5M2Max; }

// Saturating quantization of an already-scaled value. Every NaN becomes the canonical 0x7F (the
// sign of a NaN does not survive all of torch's conversions, so it is not kept); everything else
// is clamped to the format's finite range, then rounded to nearest even.
inline uint8_t quantize(float v, DType dtype, float max_val) {
  if (std::isnan(v)) return 0x7F;
  v = std::fmin(std::fmax(v, -max_val), max_val);
  return dtype == DType::kE4M3 ? c10::Float8_e4m3fn(v).x : c10::Float8_e5m2(v).x;
}

}  // namespace graphfp8::cpu
