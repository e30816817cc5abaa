// Checks and launches of the GLU activation fused with FP8 cast-transposes (glu.h), forward and
// backward.
#include <string>

#include "../glu.h"
#include "ops.h"
#include "switches.h"

namespace graphfp8 {
namespace {

GluAct parse_activation(const char* op, c10::string_view activation) {
  if (activation == "swiglu") return GluAct::kSwiglu;
  if (activation == "geglu") return GluAct::kGeglu;
  TORCH_CHECK(false, op, ": argument 'activation' must be 'swiglu' or 'geglu', got '",
              std::string(activation), "'");
}

// The checks both directions share: h (rows, 2 F) and the FP8 outputs of width `out_cols`.
GluParams check_common_args(const char* op, const at::Tensor& x, c10::string_view activation,
                            const at::Tensor& scale, const at::Tensor& out,
                            const at::Tensor& out_t, const at::Tensor& scale_inv,
                            const at::Tensor& amax, bool backward) {
  TORCH_CHECK(is_hp(x.scalar_type()), op,
              ": argument 'x' must be float32, bfloat16 or float16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2, op, ": argument 'x' must be 2-D (rows, 2 * F), got ", fmt(x.dim()),
              "-D");
  TORCH_CHECK(x.is_contiguous(), op, ": argument 'x' must be contiguous");
  TORCH_CHECK(x.size(1) % 2 == 0, op, ": argument 'x' must have an even width (gate | up), got ",
              fmt(x.size(1)));
  const int64_t rows = x.size(0), f = x.size(1) / 2;
  const int64_t out_cols = backward ? 2 * f : f;
  check_scalar_f32(op, "scale", scale, x);
  check_fp8_out(op, "out", out, x, {rows, out_cols});
  check_fp8_out(op, "out_t", out_t, x, {out_cols, rows});
  TORCH_CHECK(out_t.scalar_type() == out.scalar_type(), op,
              ": arguments 'out' and 'out_t' must have the same dtype");
  check_scalar_f32(op, "scale_inv", scale_inv, x);
  check_scalar_f32(op, "amax", amax, x);
  GluParams p{};
  p.x = x.data_ptr();
  p.dtype = to_dtype(x.scalar_type());
  p.out = out.data_ptr();
  p.out_t = out_t.data_ptr();
  p.out_dtype = to_dtype(out.scalar_type());
  p.scale = scale.data_ptr<float>();
  p.scale_inv = scale_inv.data_ptr<float>();
  p.amax = amax.data_ptr<float>();
  p.act = parse_activation(op, activation);
  p.rows = rows;
  p.cols = f;
  p.v2 = switch_on("GLU_V2");
  p.v2_div = switch_on("GLU_V2_DIV");
  return p;
}

}  // namespace

void glu_cast_transpose(const at::Tensor& x, c10::string_view activation, const at::Tensor& scale,
                        const at::Tensor& out, const at::Tensor& out_t,
                        const at::Tensor& scale_inv, const at::Tensor& amax) {
  const char* op = "graphfp8.glu_cast_transpose";
  const GluParams p =
      check_common_args(op, x, activation, scale, out, out_t, scale_inv, amax, false);
  if (x.numel() == 0) return;
  launch(op, x, p, glu_fwd_cpu, [](const GluParams& q, void* s) { return glu_fwd_cuda(q, s); });
}

TORCH_LIBRARY_FRAGMENT(graphfp8, m) {
  def_op(m,
         "glu_cast_transpose(Tensor x, str activation, Tensor scale, Tensor(a!) out, "
         "Tensor(b!) out_t, Tensor(c!) scale_inv, Tensor(d!) amax) -> ()",
         glu_cast_transpose);
}

void dglu_cast_transpose_dbias(const at::Tensor& dy, const at::Tensor& x,
                               c10::string_view activation, const at::Tensor& scale,
                               const at::Tensor& out, const at::Tensor& out_t,
                               const at::Tensor& scale_inv, const at::Tensor& amax,
                               const c10::optional<at::Tensor>& dbias) {
  const char* op = "graphfp8.dglu_cast_transpose_dbias";
  GluParams p = check_common_args(op, x, activation, scale, out, out_t, scale_inv, amax, true);
  check_common(op, "dy", dy, x);
  TORCH_CHECK(dy.scalar_type() == x.scalar_type() && dy.dim() == 2 && dy.size(0) == p.rows &&
                  dy.size(1) == p.cols,
              op, ": argument 'dy' must be (", fmt(p.rows), ", ", fmt(p.cols), ") of the dtype of 'x', got ",
              fmt(dy.sizes()), " ", dy.scalar_type());
  p.dy = dy.data_ptr();
  at::Tensor workspace;
  if (dbias.has_value()) {
    check_common(op, "dbias", *dbias, x);
    TORCH_CHECK(dbias->scalar_type() == x.scalar_type(), op,
                ": argument 'dbias' must have the dtype of 'x', got ", dbias->scalar_type());
    TORCH_CHECK(dbias->dim() == 1 && dbias->size(0) == 2 * p.cols, op,
                ": argument 'dbias' must have shape (", fmt(2 * p.cols), ",), got ",
                fmt(dbias->sizes()));
    p.dbias = dbias->data_ptr();
    if (x.is_cuda() && x.numel() > 0) {
      // Per-tile column partials, summed by a second kernel in a fixed order (deterministic);
      // the caching allocator makes this capturable.
      const int64_t partial_rows = (p.rows + kDbiasPartialRows - 1) / kDbiasPartialRows;
      workspace = at::empty({partial_rows, 2 * p.cols}, x.options().dtype(at::kFloat));
      p.workspace = workspace.data_ptr<float>();
      p.dbias_in_kernel = switch_on("DBIAS_IN_KERNEL");
    }
  }
  if (x.numel() == 0) {
    if (dbias.has_value()) dbias->zero_();  // an empty sum is zero
    return;
  }
  launch(op, x, p, glu_bwd_cpu, [](const GluParams& q, void* s) { return glu_bwd_cuda(q, s); });
}

TORCH_LIBRARY_FRAGMENT(graphfp8, m) {
  def_op(m,
         "dglu_cast_transpose_dbias(Tensor dy, Tensor x, str activation, Tensor scale, "
         "Tensor(a!) out, Tensor(b!) out_t, Tensor(c!) scale_inv, Tensor(d!) amax, "
         "Tensor(e!)? dbias=None) -> ()",
         dglu_cast_transpose_dbias);
}

}  // namespace graphfp8
