// CPU kernel: out (m, n) = alpha * (a * a_scale_inv) @ (b * b_scale_inv) + beta * out
// (gemm_accumulate.h): the operands decoded and scaled once, each dot product summed in k order
// in fp32, the epilogue in fp32 and rounded once to out's dtype; beta = 0 never reads out.
#include <vector>

#include "../dtype_switch.h"
#include "../gemm_accumulate.h"
#include "fp8_convert.h"

namespace graphfp8 {
namespace {

// The (rows, k) FP8 matrix decoded and multiplied by its scale_inv, in fp32.
std::vector<float> decoded(const uint8_t* x, DType dtype, float scale_inv, int64_t rows,
                           int64_t k) {
  float table[256];
  for (int bits = 0; bits < 256; ++bits) {
    const auto b = static_cast<uint8_t>(bits);
    const float v = dtype == DType::kE4M3 ? cpu::fp8_to_float<true>(b) : cpu::fp8_to_float<false>(b);
    table[bits] = v * scale_inv;
  }
  std::vector<float> out(static_cast<size_t>(rows * k));
  for (int64_t i = 0; i < rows * k; ++i) out[i] = table[x[i]];
  return out;
}

template <typename T>
void gemm(const GemmAccumulateParams& p, const std::vector<float>& a, const std::vector<float>& b,
          float alpha, float beta) {
  T* out = static_cast<T*>(p.out);
  for (int64_t i = 0; i < p.m; ++i) {
    const float* ai = a.data() + i * p.k;
    for (int64_t j = 0; j < p.n; ++j) {
      const float* bj = b.data() + j * p.k;
      float acc = 0.0f;
      for (int64_t l = 0; l < p.k; ++l) acc += ai[l] * bj[l];
      float v = alpha * acc;
      if (beta != 0.0f) v += beta * static_cast<float>(out[i * p.n + j]);
      out[i * p.n + j] = T(v);
    }
  }
}

}  // namespace

Status fp8_gemm_accumulate_cpu(const GemmAccumulateParams& p) {
  const std::vector<float> a = decoded(p.a, p.a_dtype, *p.a_scale_inv, p.m, p.k);
  const std::vector<float> b = decoded(p.b_t, p.b_dtype, *p.b_scale_inv, p.n, p.k);
  const float alpha = p.alpha_beta ? p.alpha_beta[0] : 1.0f;
  const float beta = p.alpha_beta ? p.alpha_beta[1] : 1.0f;
  GRAPHFP8_SWITCH_HP(p.out_dtype, "fp8_gemm_accumulate", T, gemm<T>(p, a, b, alpha, beta););
  return Status{};
}

}  // namespace graphfp8
