// CPU kernel of the norm with a blockwise FP8 output (csrc/blockwise_norm.h): the CPU norm
// kernel (norm.cpp) writes y rounded to the input dtype into a host scratch, which the CPU
// blockwise quantizer (blockwise.cpp) reads: norm-then-quantize by construction, the reference
// the CUDA kernel is held to. (The CPU kernels are reference-speed loops for CI.)
#include <vector>

#include "../blockwise_norm.h"

namespace graphfp8 {
namespace {

int64_t elem_bytes(DType t) { return t == DType::kFloat32 ? 4 : 2; }

}  // namespace

NormParams norm_stats_params(const BlockNormParams& p) {
  NormParams n{};
  n.x = p.x;
  n.residual = p.residual;
  n.residual_out = p.residual_out;
  n.gamma = p.gamma;
  n.beta = p.beta;
  n.dtype = p.dtype;
  n.out_dtype = p.out_dtype;
  n.mu = p.mu;
  n.rsigma = p.rsigma;
  n.eps = p.eps;
  n.rms = p.beta == nullptr;
  n.zero_centered_gamma = p.zero_centered_gamma;
  n.rows = p.rows;
  n.hidden = p.hidden;
  return n;
}

Status block_norm_cpu(const BlockNormParams& p) {
  const int64_t n = p.rows * p.hidden;
  std::vector<uint8_t> y(static_cast<size_t>(n * elem_bytes(p.dtype)));
  std::vector<uint8_t> unused(static_cast<size_t>(n));  // the per-tensor FP8 bytes (scale 1)
  float scale = 1.0f, amax = 0.0f, scale_inv = 1.0f;
  NormParams norm = norm_stats_params(p);
  norm.out = unused.data();
  norm.out_hp = y.data();
  norm.scale = &scale;
  norm.amax = &amax;
  norm.scale_inv = &scale_inv;
  Status st = norm_fwd_cpu(norm);
  if (!st.ok()) return st;
  BlockQuantizeParams q{};
  q.x = y.data();
  q.x_dtype = p.dtype;
  q.out = p.out;
  q.scale_inv = p.scale_inv;
  q.out_t = p.out_t;
  q.scale_inv_t = p.scale_inv_t;
  q.out_dtype = p.out_dtype;
  q.rows = p.rows;
  q.cols = p.hidden;
  q.block_rows = 1;
  q.power_2_scale = p.power_2_scale;
  return block_quantize_cpu(q);
}

}  // namespace graphfp8
