// The FP8 cast statistics of graphfp8.numerics: what one cast into FP8 did to its tensor.
//
// For the high-precision tensor hp that a cast quantized with `scale` (recomputed here for the
// fused kernels that never write it: GELU, dGELU, the norms, in their kernels' exact arithmetic),
// each of `partials` work units (CUDA blocks; one on the CPU) writes one row of `out`:
//
//   out[u] = (max |hp| (NaNs ignored), #saturated (|hp * scale| > fp8 max), #underflow
//             (hp != 0, FP8 value 0), #nonzero, sum hp^2, sum (hp - fp8 value * (1 / scale))^2,
//             scale, recorded_amax)                                       float64, NaNs skipped
//
// over its share of the elements; the caller sums (maxes) the rows in a fixed order, so the
// result does not depend on the order of work. Nothing is written when *enabled == 0 or when a
// `skip` flag holds 1 (a weight cast that its noop flag skipped), so the op can sit in a captured
// graph and cost one empty launch on the steps that do not record.
#pragma once

#include <cstdint>

#include "common.h"

namespace graphfp8 {

enum StatsMode : int {
  kStatsIdentity = 0,   // hp = x
  kStatsGelu = 1,       // hp = round_to_x_dtype(gelu_tanh(x)), as gelu_cast_transpose
  kStatsDgelu = 2,      // hp = round_to_x_dtype(dgelu_tanh(x, act_in)), x = dy
  kStatsLayerNorm = 3,  // hp = ((x - mu[r]) * rsigma[r]) * g[c] + beta[c], x = z, float32
  kStatsRmsNorm = 4,    // hp = (x * rsigma[r]) * g[c]
};

constexpr int kStatsColumns = 8;

struct CastStatsParams {
  const void* x = nullptr;       // (rows, cols), x_dtype
  DType x_dtype = DType::kFloat32;
  const void* act_in = nullptr;  // dGELU: the GELU input, x's dtype
  const float* mu = nullptr;     // LayerNorm: (rows,)
  const float* rsigma = nullptr; // norms: (rows,)
  const void* gamma = nullptr;   // norms: (cols,), x's dtype; g = gamma (+ 1)
  const void* beta = nullptr;    // LayerNorm: (cols,), x's dtype
  bool zero_centered_gamma = false;
  int mode = kStatsIdentity;
  int64_t rows = 0;
  int64_t cols = 0;
  const float* scale = nullptr;
  const float* recorded_amax = nullptr;
  const float* enabled = nullptr;  // nullptr: always
  const float* skip = nullptr;     // nullptr: never
  bool e4m3 = true;
  double* out = nullptr;  // (partials, kStatsColumns)
  int64_t partials = 1;
};

Status cast_stats_cpu(const CastStatsParams& p);
Status cast_stats_cuda(const CastStatsParams& p, void* stream);

}  // namespace graphfp8
