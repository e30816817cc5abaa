// CPU kernel of the norm with a blockwise FP8 output (csrc/blockwise_norm.h): the CPU norm
// kernel (norm.cpp) writes y rounded to the input dtype into a host scratch, which the CPU
// blockwise quantizer (blockwise.cpp) reads: norm-then-quantize by construction, the reference
// the CUDA kernel is held to. (The CPU kernels are reference-speed loops for CI.)
#include <vector>

#include "../blockwise_norm.h"

namespace graphfp8 {
NormParams norm_stats_params(const BlockNormParams& p, float* slots) {
  NormParams n{};
  n.x = p.x;
  n.residual = p.residual;
  n.residual_out = p.residual_out;
  n.gamma = p.gamma;
  n.beta = p.beta;
  n.dtype = p.dtype;
  n.out_dtype = p.dst.out_dtype;
  n.mu = p.mu;
  n.rsigma = p.rsigma;
  n.eps = p.eps;
  n.rms = p.beta == nullptr;
  n.zero_centered_gamma = p.zero_centered_gamma;
  n.rows = p.rows;
  n.hidden = p.hidden;
  n.scale = slots;
  n.amax = slots + 1;
  n.scale_inv = slots + 2;
  return n;
}

Status block_norm_cpu(const BlockNormParams& p) {
  const int64_t n = p.rows * p.hidden;
  std::vector<uint8_t> y(static_cast<size_t>(n * hp_bytes(p.dtype)));
  std::vector<uint8_t> unused(static_cast<size_t>(n));  // the per-tensor FP8 bytes (scale 1)
  float slots[3] = {1.0f, 0.0f, 1.0f};                  // scale, amax, scale_inv
  NormParams norm = norm_stats_params(p, slots);
  norm.out = unused.data();
  norm.out_hp = y.data();
  Status st = norm_fwd_cpu(norm);
  if (!st.ok()) return st;
  return block_quantize_cpu(tile_quantize_params(y.data(), p.dtype, p.dst, p.rows, p.hidden));
}

}  // namespace graphfp8
