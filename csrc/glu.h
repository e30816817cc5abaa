// Params and launchers of the GLU activation fused with FP8 cast-transposes (glu_math.h has the
// math). No torch headers (see common.h).
//
// Forward, for h = [g | u] (rows, 2 F):
//   a = round(act(g) * u) to h's dtype;  out = saturate(a * scale) (rows, F), out_t = out^T,
//   amax = max(amax, max |a|) (NaN ignored), scale_inv = 1 / scale.
// Backward, for da (rows, F) and the saved h:
//   dh = [round(dg) | round(du)] (rows, 2 F) in da's dtype;  out = saturate(dh * scale), out_t,
//   amax, scale_inv as above, and dbias = sum over rows of dh (2 F,) when asked for: a float64
//   sequential sum per column on the CPU, fp32 tile partials summed in a fixed order on the GPU,
//   rounded to float32 and then to the dtype.
#pragma once

#include <cstdint>

#include "common.h"
#include "glu_math.h"

namespace graphfp8 {

struct GluParams {
  const void* x;       // (rows, 2 * cols), dtype: h, the fc1 output, contiguous
  const void* dy;      // backward: (rows, cols), dtype: da, contiguous; nullptr in the forward
  DType dtype;         // float32, bfloat16 or float16
  void* out;           // forward (rows, cols), backward (rows, 2 * cols); out_dtype (FP8)
  void* out_t;         // the transpose of out
  DType out_dtype;     // E4M3 or E5M2
  const float* scale;  // (1,)
  float* scale_inv;    // (1,): receives 1 / scale
  float* amax;         // (1,): receives max(amax, max |value|), NaN ignored
  void* dbias;         // backward: (2 * cols,), dtype, or nullptr
  float* workspace;    // CUDA with dbias: (ceil(rows / kDbiasPartialRows), 2 * cols) fp32
  bool dbias_in_kernel;  // CUDA: the kernel switch DBIAS_IN_KERNEL (the same sums, one launch)
  bool v2;               // CUDA: the kernel switch GLU_V2 (the same bytes, amax and dbias)
  bool v2_div;           // CUDA, with v2: the kernel switch GLU_V2_DIV (SwiGLU; the same bytes)
  GluAct act;
  int64_t rows;
  int64_t cols;        // F: the width of a, half the width of h
};

// Launchers assume csrc/ops/'s checks passed; a failed Status reports a launch error.
Status glu_fwd_cpu(const GluParams& p);
Status glu_bwd_cpu(const GluParams& p);
Status glu_fwd_cuda(const GluParams& p, void* stream);
Status glu_bwd_cuda(const GluParams& p, void* stream);

}  // namespace graphfp8
