// CPU kernels: rotary embedding fused with the FP8 casts of q, k and v, and its backward
// (rope_fp8.h has the math). Reference-speed loops in fp32, each product and sum rounded on its
// own (setup.py builds with -ffp-contract=off), bit-identical to graphfp8/reference.py's twins.
#include <cmath>

#include "../dtype_switch.h"
#include "../rope_fp8.h"
#include "fp8_convert.h"
#include "rope_rotate.h"

namespace graphfp8 {
namespace {

using cpu::rotate;

template <typename T, bool kE4M3>
void rope_fp8_loop(const RopeFp8Params& p) {
  const auto* qkv = static_cast<const T*>(p.qkv);
  const int64_t half = p.head_dim / 2;
  float scale[3], amax[3] = {0.0f, 0.0f, 0.0f};
  for (int part = 0; part < 3; ++part) scale[part] = *p.scale[part];
  const int64_t rows = p.batch * p.seq * (p.heads + 2 * p.kv_heads);  // rope_layout.h's rows
  for (int64_t r = 0; r < rows; ++r) {
    const RopeRow at = rope_row(r, p.seq, p.heads, p.kv_heads, p.head_dim);
    const int part = at.part;
    const int64_t s = at.s;
    const int64_t in_base = r * p.head_dim;
    const int64_t out_base = at.part_offset;
    auto* out = static_cast<uint8_t*>(p.out[part]);
    for (int64_t i = 0; i < half; ++i) {
      float lo = static_cast<float>(qkv[in_base + i]);
      float hi = static_cast<float>(qkv[in_base + i + half]);
      if (part < 2 && p.cos != nullptr) {
        rotate(lo, hi, p.cos + s * p.head_dim, p.sin + s * p.head_dim, i, half, false);
        lo = cpu::round_to<T>(lo);
        hi = cpu::round_to<T>(hi);
      }
      amax[part] = std::fmax(amax[part], std::fmax(std::fabs(lo), std::fabs(hi)));
      out[out_base + i] = cpu::quantize<kE4M3>(lo * scale[part]);
      out[out_base + i + half] = cpu::quantize<kE4M3>(hi * scale[part]);
    }
  }
  for (int part = 0; part < 3; ++part) {
    if (*p.amax[part] < amax[part]) *p.amax[part] = amax[part];
    *p.scale_inv[part] = 1.0f / scale[part];
  }
}

// Where a backward's gradient comes from: FP8 (E5M2, E4M3), dequantized, or high precision.
enum GradKind : int { kGradE5M2, kGradE4M3, kGradHp };

// One gradient element in fp32: an FP8 code dequantized, or a high-precision value as it is.
template <typename OutT, int kKind>
float grad_value(const void* grad, int64_t at, float scale_inv) {
  if constexpr (kKind == kGradHp) {
    return static_cast<float>(static_cast<const OutT*>(grad)[at]);
  } else {
    return cpu::fp8_to_float<kKind == kGradE4M3>(static_cast<const uint8_t*>(grad)[at]) *
           scale_inv;
  }
}

template <typename OutT, int kKind>
void rope_fp8_bwd_loop(const RopeFp8BwdParams& p) {
  auto* out = static_cast<OutT*>(p.out);
  const int64_t half = p.head_dim / 2;
  float scale_inv[3] = {1.0f, 1.0f, 1.0f};
  if constexpr (kKind != kGradHp) {
    for (int part = 0; part < 3; ++part) scale_inv[part] = *p.scale_inv[part];
  }
  const int64_t rows = p.batch * p.seq * (p.heads + 2 * p.kv_heads);  // rope_layout.h's rows
  for (int64_t r = 0; r < rows; ++r) {
    const RopeRow at = rope_row(r, p.seq, p.heads, p.kv_heads, p.head_dim);
    const int part = at.part;
    const int64_t s = at.s;
    const int64_t in_base = at.part_offset;
    const int64_t out_base = r * p.head_dim;
    for (int64_t i = 0; i < half; ++i) {
      float lo = grad_value<OutT, kKind>(p.grad[part], in_base + i, scale_inv[part]);
      float hi = grad_value<OutT, kKind>(p.grad[part], in_base + i + half, scale_inv[part]);
      if (part < 2 && p.cos != nullptr) {
        rotate(lo, hi, p.cos + s * p.head_dim, p.sin + s * p.head_dim, i, half, true);
      }
      out[out_base + i] = OutT(lo);
      out[out_base + i + half] = OutT(hi);
    }
  }
}

}  // namespace

Status rope_fp8_cpu(const RopeFp8Params& p) {
  GRAPHFP8_SWITCH_HP(p.qkv_dtype, "rope_fp8_cpu", T,
                     GRAPHFP8_SWITCH_FP8(p.out_dtype, "rope_fp8_cpu", kE4M3,
                                         rope_fp8_loop<T, kE4M3>(p);))
  return Status{};
}

Status rope_fp8_bwd_cpu(const RopeFp8BwdParams& p) {
  const bool hp = p.grad_dtype == p.out_dtype;
  GRAPHFP8_SWITCH_HP(p.out_dtype, "rope_fp8_bwd_cpu", OutT,
    if (hp) {
      rope_fp8_bwd_loop<OutT, kGradHp>(p);
    } else {
      GRAPHFP8_SWITCH_FP8(p.grad_dtype, "rope_fp8_bwd_cpu", kE4M3,
                          rope_fp8_bwd_loop<OutT, kE4M3 ? kGradE4M3 : kGradE5M2>(p);)
    })
  return Status{};
}

}  // namespace graphfp8
