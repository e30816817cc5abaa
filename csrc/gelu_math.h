// The tanh-approximation GELU and its derivative in fp32, shared by the CPU and CUDA kernels.
//
// The operation order is torch's (aten GeluKernel / GeluTanhBackward with opmath = float), so
// that, rounded to bf16/fp16, the results match F.gelu(x, approximate="tanh") and
// gelu_backward: only a 1-ulp fp32 difference of the tanh implementations can change a result.
#pragma once

#include <cmath>

#include "host_device.h"

namespace graphfp8 {

constexpr float kGeluBeta = static_cast<float>(1.41421356237309504880 * 1.12837916709551257390 * 0.5);
constexpr float kGeluKappa = 0.044715f;

// 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))
GRAPHFP8_HOST_DEVICE float gelu_tanh(float x) {
  const float x_cube = x * x * x;
  const float inner = kGeluBeta * (x + kGeluKappa * x_cube);
  return 0.5f * x * (1.0f + tanhf(inner));
}

// dy * d gelu_tanh(x) / dx
GRAPHFP8_HOST_DEVICE float dgelu_tanh(float dy, float x) {
  const float x_sq = x * x;
  const float x_cube = x_sq * x;
  const float inner = kGeluBeta * (x + kGeluKappa * x_cube);
  const float tanh_inner = tanhf(inner);
  const float left = 0.5f * x;
  const float right = 1.0f + tanh_inner;
  const float left_derivative = 0.5f * right;
  const float tanh_derivative = 1.0f - tanh_inner * tanh_inner;
  const float inner_derivative = kGeluBeta * (1.0f + 3.0f * kGeluKappa * x_sq);
  const float right_derivative = left * tanh_derivative * inner_derivative;
  return dy * (left_derivative + right_derivative);
}

}  // namespace graphfp8
