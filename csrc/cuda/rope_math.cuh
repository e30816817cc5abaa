// The rotation of one (lo, hi) pair of rotary position embedding, shared by the two CUDA paths
// that rotate: rope.cu (RoPE of a fused QKV tensor, forward and backward) and rope_fp8.cu (RoPE
// fused with the FP8 casts of q, k, v, and its backward). Their outputs must agree bit for bit
// (rope_fp8 equals rope_qkv followed by a cast), so the arithmetic is written once, here.
//
//   forward:  lo' = lo * c_lo - hi * n_lo,   hi' = hi * c_hi + lo * n_hi
//   inverse:  lo' = lo * c_lo + hi * n_hi,   hi' = hi * c_hi - lo * n_lo
//
// with c_lo = cos[i], c_hi = cos[i + half], n_lo = sin[i], n_hi = sin[i + half]. Every product
// and sum is rounded on its own (__fmul_rn, __fadd_rn, __fsub_rn: no fused multiply-add), as the
// CPU kernels (built with -ffp-contract=off) and the PyTorch twin compute it.
#pragma once

namespace graphfp8 {

struct RopePair {
  float lo, hi;
};

__device__ __forceinline__ RopePair rope_rotate(float lo, float hi, float c_lo, float c_hi,
                                                float n_lo, float n_hi, bool inverse) {
  if (!inverse) {
    return {__fsub_rn(__fmul_rn(lo, c_lo), __fmul_rn(hi, n_lo)),
            __fadd_rn(__fmul_rn(hi, c_hi), __fmul_rn(lo, n_hi))};
  }
  return {__fadd_rn(__fmul_rn(lo, c_lo), __fmul_rn(hi, n_hi)),
          __fsub_rn(__fmul_rn(hi, c_hi), __fmul_rn(lo, n_lo))};
}

}  // namespace graphfp8
