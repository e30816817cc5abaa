// The gated activations of the GLU MLP (SwiGLU, GeGLU) and their gradients in fp32, shared by the
// CPU and CUDA kernels (cpu/glu.cpp, cuda/glu_cast_transpose.cu).
//
// fc1 writes h = [g | u] (gate first: TransformerEngine's order, and Hugging Face's gate_proj /
// up_proj fused in that order), and the activation is a = act(g) * u:
//   swiglu  act(g) = silu(g) = g / (1 + exp(-g))
//   geglu   act(g) = gelu_tanh(g)                      (gelu_math.h)
// Backward, given da:  du = da * act(g),  dg = (da * u) * act'(g), with
//   silu'(g) = s * (1 + g * (1 - s)),  s = 1 / (1 + exp(-g)).
//
// Every product, sum and quotient of the SwiGLU math is rounded on its own (rn_* below: no fused
// multiply-add on the device; the host builds with -ffp-contract=off). The transcendentals are
// where the backends differ: on the host exp and tanh are computed in double and rounded once to
// float, which graphfp8/reference.py's twin computes too, so the CPU kernels equal it bit for
// bit; on the device they are CUDA's expf and tanhf (within 2 ulp of the true value).
#pragma once

#include <cmath>

#include "gelu_math.h"

namespace graphfp8 {

enum class GluAct : int { kSwiglu, kGeglu };

GRAPHFP8_HOST_DEVICE float rn_mul(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

GRAPHFP8_HOST_DEVICE float rn_add(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

GRAPHFP8_HOST_DEVICE float rn_sub(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

GRAPHFP8_HOST_DEVICE float rn_div(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// exp(-x): CUDA's expf on the device, the double exp rounded to float on the host.
GRAPHFP8_HOST_DEVICE float exp_neg(float x) {
#ifdef __CUDA_ARCH__
  return expf(-x);
#else
  return static_cast<float>(std::exp(-static_cast<double>(x)));
#endif
}

// tanh for GeGLU: CUDA's tanhf on the device, the double tanh rounded to float on the host.
struct GluTanh {
  GRAPHFP8_HOST_DEVICE float operator()(float v) const {
#ifdef __CUDA_ARCH__
    return tanhf(v);
#else
    return static_cast<float>(std::tanh(static_cast<double>(v)));
#endif
  }
};

GRAPHFP8_HOST_DEVICE float silu(float g) { return rn_div(g, rn_add(1.0f, exp_neg(g))); }

GRAPHFP8_HOST_DEVICE float dsilu(float g) {
  const float s = rn_div(1.0f, rn_add(1.0f, exp_neg(g)));
  return rn_mul(s, rn_add(1.0f, rn_mul(g, rn_sub(1.0f, s))));
}

// a = act(g) * u, in fp32 (the caller rounds it to the tensor dtype).
template <GluAct kAct>
GRAPHFP8_HOST_DEVICE float glu_forward(float g, float u) {
  if constexpr (kAct == GluAct::kSwiglu) {
    return rn_mul(silu(g), u);
  } else {
    return rn_mul(gelu_tanh(g, GluTanh{}), u);
  }
}

// (dg, du) for the gradient da of a, in fp32 (the caller rounds both to the tensor dtype).
struct GluGrad {
  float dg, du;
};

template <GluAct kAct>
GRAPHFP8_HOST_DEVICE GluGrad glu_backward(float da, float g, float u) {
  const float da_u = rn_mul(da, u);
  if constexpr (kAct == GluAct::kSwiglu) {
    return {rn_mul(da_u, dsilu(g)), rn_mul(da, silu(g))};
  } else {
    return {dgelu_tanh(da_u, g, GluTanh{}), rn_mul(da, gelu_tanh(g, GluTanh{}))};
  }
}

}  // namespace graphfp8
