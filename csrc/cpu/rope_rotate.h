// The CPU rotation of one (lo, hi) pair of rotary position embedding, shared by the CPU kernels
// that rotate (rope_fp8.cpp, rope_cast.cpp): every product and sum rounded on its own (built with
// -ffp-contract=off), as cuda/rope_math.cuh and the PyTorch twin compute it.
#pragma once

#include <cstdint>

namespace graphfp8::cpu {

// Rotates the pair (lo, hi) at index i < half of position row (c, n) in place.
inline void rotate(float& lo, float& hi, const float* c, const float* n, int64_t i, int64_t half,
                   bool inverse) {
  const float l = lo, h = hi;
  if (!inverse) {
    lo = l * c[i] - h * n[i];
    hi = h * c[i + half] + l * n[i + half];
  } else {
    lo = l * c[i] + h * n[i + half];
    hi = h * c[i + half] - l * n[i];
  }
}

}  // namespace graphfp8::cpu
