// Params and launcher of the gradient fold of graphed callables (graphs/grads.py, switch
// GRAD_FOLD_COPY_FIRST): buffer = *first ? grad : buffer + grad, element by element. The CPU
// entry point runs ATen's copy_ / add_ (csrc/ops/grad_ops.cpp), so it is torch's own arithmetic;
// this launcher is CUDA's. No torch headers (see common.h).
#pragma once

#include <cstdint>

#include "common.h"

namespace graphfp8 {

struct GradFoldParams {
  void* buffer;          // (n,) of dtype: read (unless *first) and written
  const void* grad;      // (n,) of dtype
  const int32_t* first;  // (1,) device flag: nonzero copies grad, zero adds it
  int64_t n;
  DType dtype;  // float32, bfloat16 or float16
};

Status grad_fold_cuda(const GradFoldParams& p, void* stream);

}  // namespace graphfp8
