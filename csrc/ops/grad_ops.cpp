// Checks and dispatch of the gradient fold of graphed callables (grad_fold.h; graphs/grads.py,
// switch GRAD_FOLD_COPY_FIRST): buffer = first ? grad : buffer + grad. On the CPU it is ATen's
// copy_ / add_ on the flag's value (torch's own arithmetic: what eager AccumulateGrad does), on
// CUDA one kernel that reads the flag from device memory, so a captured graph can do either.
#include "../grad_fold.h"
#include "ops.h"

namespace graphfp8 {

void grad_fold(const at::Tensor& buffer, const at::Tensor& grad, const at::Tensor& first) {
  const char* op = "graphfp8.grad_fold_";
  TORCH_CHECK_TYPE(is_hp(buffer.scalar_type()), op,
                   ": argument 'buffer' must be float32, bfloat16 or float16, got ",
                   buffer.scalar_type());
  TORCH_CHECK_VALUE(buffer.is_contiguous(), op, ": argument 'buffer' must be contiguous");
  TORCH_CHECK_TYPE(grad.scalar_type() == buffer.scalar_type(), op, ": argument 'grad' must be ",
                   buffer.scalar_type(), " like the buffer, got ", grad.scalar_type());
  TORCH_CHECK_VALUE(grad.sizes() == buffer.sizes(), op, ": argument 'grad' must have shape ",
                    fmt(buffer.sizes()), " like the buffer, got ", fmt(grad.sizes()));
  check_common(op, "grad", grad, buffer);
  check_common(op, "first", first, buffer);
  TORCH_CHECK_TYPE(first.scalar_type() == at::kInt, op,
                   ": argument 'first' must be int32, got ", first.scalar_type());
  TORCH_CHECK_VALUE(first.numel() == 1, op, ": argument 'first' must hold one element, got ",
                    fmt(first.numel()));
  if (buffer.is_cpu()) {
    if (*first.data_ptr<int32_t>() != 0) {
      buffer.copy_(grad);
    } else {
      buffer.add_(grad);
    }
    return;
  }
  GradFoldParams p{};
  p.buffer = buffer.data_ptr();
  p.grad = grad.data_ptr();
  p.first = first.data_ptr<int32_t>();
  p.n = buffer.numel();
  p.dtype = to_dtype(buffer.scalar_type());
  launch(op, buffer, p, [](const GradFoldParams&) { return Status{"grad_fold", "CPU is ATen's"}; },
         [](const GradFoldParams& q, void* s) { return grad_fold_cuda(q, s); });
}

TORCH_LIBRARY_FRAGMENT(graphfp8, m) {
  def_op(m, "grad_fold_(Tensor(a!) buffer, Tensor grad, Tensor first) -> ()", grad_fold);
}

}  // namespace graphfp8
