// Checks and launches of the MLP activations and their gradients in the input dtype
// (csrc/mlp_act.h): the blockwise LayerNormMLP's activation forward and backward.
#include <string>
#include <vector>

#include "../mlp_act.h"
#include "ops.h"

namespace graphfp8 {
namespace {

MlpAct parse_mlp_act(const char* op, c10::string_view activation) {
  if (activation == "gelu") return MlpAct::kGelu;
  if (activation == "swiglu") return MlpAct::kSwiglu;
  if (activation == "geglu") return MlpAct::kGeglu;
  TORCH_CHECK(false, op, ": argument 'activation' must be 'gelu', 'swiglu' or 'geglu', got '",
              std::string(activation), "'");
}

// x (rows, F) or (rows, 2 F) and an output `out` of `out_cols` columns, both of x's dtype.
MlpActParams check_args(const char* op, const at::Tensor& x, c10::string_view activation,
                        const at::Tensor& out, bool backward) {
  TORCH_CHECK(is_hp(x.scalar_type()), op,
              ": argument 'x' must be float32, bfloat16 or float16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2, op, ": argument 'x' must be 2-D, got ", fmt(x.dim()), "-D");
  TORCH_CHECK(x.is_contiguous(), op, ": argument 'x' must be contiguous");
  MlpActParams p{};
  p.act = parse_mlp_act(op, activation);
  const bool gated = p.act != MlpAct::kGelu;
  TORCH_CHECK(!gated || x.size(1) % 2 == 0, op,
              ": argument 'x' must have an even width (gate | up), got ", fmt(x.size(1)));
  p.rows = x.size(0);
  p.cols = gated ? x.size(1) / 2 : x.size(1);
  const std::vector<int64_t> shape = {p.rows, backward ? x.size(1) : p.cols};
  check_common(op, "out", out, x);
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), op,
              ": argument 'out' must have the dtype of 'x', got ", out.scalar_type());
  TORCH_CHECK(out.sizes() == at::IntArrayRef(shape), op, ": argument 'out' must have shape ",
              fmt(shape), ", got ", fmt(out.sizes()));
  p.x = x.data_ptr();
  p.out = out.data_ptr();
  p.dtype = to_dtype(x.scalar_type());
  return p;
}

}  // namespace

// a = act(x) in x's dtype.
void mlp_act(const at::Tensor& x, c10::string_view activation, const at::Tensor& out) {
  const char* op = "graphfp8.mlp_act";
  const MlpActParams p = check_args(op, x, activation, out, false);
  if (p.rows * p.cols == 0) return;
  launch(op, x, p, mlp_act_cpu, [](const MlpActParams& q, void* s) { return mlp_act_cuda(q, s); });
}

// dx (x's shape) from dy (rows, F), the gradient of a.
void mlp_dact(const at::Tensor& dy, const at::Tensor& x, c10::string_view activation,
              const at::Tensor& out) {
  const char* op = "graphfp8.mlp_dact";
  MlpActParams p = check_args(op, x, activation, out, true);
  check_common(op, "dy", dy, x);
  TORCH_CHECK(dy.scalar_type() == x.scalar_type() && dy.dim() == 2 && dy.size(0) == p.rows &&
                  dy.size(1) == p.cols,
              op, ": argument 'dy' must be (", fmt(p.rows), ", ", fmt(p.cols),
              ") of the dtype of 'x', got ", fmt(dy.sizes()), " ", dy.scalar_type());
  p.dy = dy.data_ptr();
  if (p.rows * p.cols == 0) return;
  launch(op, x, p, mlp_act_cpu, [](const MlpActParams& q, void* s) { return mlp_act_cuda(q, s); });
}

TORCH_LIBRARY_FRAGMENT(graphfp8, m) {
  def_op(m, "mlp_act(Tensor x, str activation, Tensor(a!) out) -> ()", mlp_act);
  def_op(m, "mlp_dact(Tensor dy, Tensor x, str activation, Tensor(a!) out) -> ()", mlp_dact);
}

}  // namespace graphfp8
