// Checks and launches of the casts, their amax passes, the FP8 transpose, dequantize and the
// fused cast-transposes.
#include "ops.h"
#include "switches.h"

namespace graphfp8 {
namespace {

// The input x (float, contiguous) and, for dGELU, the GELU input act_in of x's shape and dtype.
void check_act_input(const char* op, const at::Tensor& x, const at::Tensor* act_in,
                     const char* act_in_name) {
  TORCH_CHECK(is_hp(x.scalar_type()), op, ": argument 'x' must be float32, bfloat16 or float16, got ",
              x.scalar_type());
  TORCH_CHECK(x.is_contiguous(), op, ": argument 'x' must be contiguous");
  if (act_in == nullptr) return;
  check_common(op, act_in_name, *act_in, x);
  TORCH_CHECK(act_in->scalar_type() == x.scalar_type() && act_in->sizes() == x.sizes(), op,
              ": argument '", act_in_name, "' must have the shape and dtype of the gradient, got ",
              fmt(act_in->sizes()), " ", act_in->scalar_type());
}

// A cast's scale: as given, or (scaled_max given: current scaling) computed by the cast from the
// slot's amax, which is then read and reset instead of receiving the cast's own amax.
void set_scale(const char* op, const at::Tensor& x, const at::Tensor& scale, const at::Tensor& amax,
               const c10::optional<at::Tensor>& scaled_max, CastParams& p) {
  p.scale = scale.data_ptr<float>();
  p.amax = amax.data_ptr<float>();
  p.paired_quantize = switch_on("PAIRED_QUANTIZE");
  if (!scaled_max.has_value()) return;
  check_scalar_f32(op, "scaled_max", *scaled_max, x);
  p.current = CurrentScale{scale.data_ptr<float>(), amax.data_ptr<float>(),
                           scaled_max->data_ptr<float>()};
  p.amax = nullptr;
}

void cast_impl(const char* op, const at::Tensor& x, const at::Tensor& scale, const at::Tensor& out,
               const at::Tensor* out_t, const at::Tensor& scale_inv, const at::Tensor& amax,
               const c10::optional<at::Tensor>& noop,
               const c10::optional<at::Tensor>& scaled_max) {
  TORCH_CHECK(is_hp(x.scalar_type()), op, ": argument 'x' must be float32, bfloat16 or float16, got ",
              x.scalar_type());
  TORCH_CHECK(x.is_contiguous(), op, ": argument 'x' must be contiguous");
  check_scalar_f32(op, "scale", scale, x);
  check_fp8_out(op, "out", out, x, x.sizes());
  check_scalar_f32(op, "scale_inv", scale_inv, x);
  check_scalar_f32(op, "amax", amax, x);
  CastParams p{};
  p.x = x.data_ptr();
  p.x_dtype = to_dtype(x.scalar_type());
  p.out = out.data_ptr();
  p.out_dtype = to_dtype(out.scalar_type());
  p.out_t = nullptr;
  if (out_t != nullptr) {
    TORCH_CHECK(x.dim() == 2, op, ": argument 'x' must be 2-D, got ", fmt(x.dim()), "-D");
    check_fp8_out(op, "out_t", *out_t, x, {x.size(1), x.size(0)});
    TORCH_CHECK(out_t->scalar_type() == out.scalar_type(), op,
                ": arguments 'out' and 'out_t' must have the same dtype");
    p.out_t = out_t->data_ptr();
  }
  set_scale(op, x, scale, amax, scaled_max, p);
  p.scale_inv = scale_inv.data_ptr<float>();
  p.noop = noop_ptr(op, noop, x);
  p.rows = x.dim() == 2 ? x.size(0) : 1;
  p.cols = x.dim() == 2 ? x.size(1) : x.numel();
  if (x.numel() == 0 && !p.current.on()) return;  // an empty tensor still updates its slot
  launch(op, x, p, cast_cpu, [](const CastParams& q, void* s) { return cast_cuda(q, s); });
}

}  // namespace

void cast_to_fp8(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& out,
                 const at::Tensor& scale_inv, const at::Tensor& amax,
                 const c10::optional<at::Tensor>& noop,
                 const c10::optional<at::Tensor>& scaled_max) {
  cast_impl("graphfp8.cast_to_fp8", x, scale, out, nullptr, scale_inv, amax, noop, scaled_max);
}

// scaled_max given (current scaling, CurrentScale in common.h): the cast computes its scale from
// amax, rewrites `scale` and resets `amax`, hence the (s!) on every cast's scale.
TORCH_LIBRARY_FRAGMENT(graphfp8, m) {
  def_op(m,
         "cast_to_fp8(Tensor x, Tensor(s!) scale, Tensor(a!) out, Tensor(b!) scale_inv, "
         "Tensor(c!) amax, Tensor? noop=None, Tensor? scaled_max=None) -> ()",
         cast_to_fp8);
}

void cast_transpose(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& out,
                    const at::Tensor& out_t, const at::Tensor& scale_inv, const at::Tensor& amax,
                    const c10::optional<at::Tensor>& noop,
                    const c10::optional<at::Tensor>& scaled_max) {
  cast_impl("graphfp8.cast_transpose", x, scale, out, &out_t, scale_inv, amax, noop, scaled_max);
}

TORCH_LIBRARY_FRAGMENT(graphfp8, m) {
  def_op(m,
         "cast_transpose(Tensor x, Tensor(s!) scale, Tensor(a!) out, Tensor(b!) out_t, "
         "Tensor(c!) scale_inv, Tensor(d!) amax, Tensor? noop=None, Tensor? scaled_max=None) -> ()",
         cast_transpose);
}

namespace {

void amax_impl(const char* op, FusedAct act, const at::Tensor& x, const at::Tensor* act_in,
               const at::Tensor& amax, const c10::optional<at::Tensor>& noop) {
  check_act_input(op, x, act_in, "x");
  check_scalar_f32(op, "amax", amax, x);
  AmaxParams p{};
  p.x = x.data_ptr();
  p.act_in = act_in != nullptr ? act_in->data_ptr() : nullptr;
  p.dtype = to_dtype(x.scalar_type());
  p.amax = amax.data_ptr<float>();
  p.noop = noop_ptr(op, noop, x);
  p.numel = x.numel();
  p.act = act;
  if (x.numel() == 0) return;
  launch(op, x, p, amax_cpu, [](const AmaxParams& q, void* s) { return amax_cuda(q, s); });
}

}  // namespace

void amax(const at::Tensor& x, const at::Tensor& amax, const c10::optional<at::Tensor>& noop) {
  amax_impl("graphfp8.amax", FusedAct::kNone, x, nullptr, amax, noop);
}

TORCH_LIBRARY_FRAGMENT(graphfp8, m) {
  def_op(m, "amax(Tensor x, Tensor(a!) amax, Tensor? noop=None) -> ()", amax);
}

void gelu_amax(const at::Tensor& x, const at::Tensor& amax) {
  amax_impl("graphfp8.gelu_amax", FusedAct::kGelu, x, nullptr, amax, c10::nullopt);
}

TORCH_LIBRARY_FRAGMENT(graphfp8, m) {
  def_op(m, "gelu_amax(Tensor x, Tensor(a!) amax) -> ()", gelu_amax);
}

void dgelu_amax(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& amax) {
  amax_impl("graphfp8.dgelu_amax", FusedAct::kDgelu, dy, &x, amax, c10::nullopt);
}

TORCH_LIBRARY_FRAGMENT(graphfp8, m) {
  def_op(m, "dgelu_amax(Tensor dy, Tensor x, Tensor(a!) amax) -> ()", dgelu_amax);
}

void fp8_transpose(const at::Tensor& x, const at::Tensor& out_t,
                   const c10::optional<at::Tensor>& noop) {
  const char* op = "graphfp8.fp8_transpose";
  TORCH_CHECK(is_fp8(x.scalar_type()), op, ": argument 'x' must be float8_e4m3fn or float8_e5m2, got ",
              x.scalar_type());
  TORCH_CHECK(x.dim() == 2, op, ": argument 'x' must be 2-D, got ", fmt(x.dim()), "-D");
  TORCH_CHECK(x.is_contiguous(), op, ": argument 'x' must be contiguous");
  check_fp8_out(op, "out_t", out_t, x, {x.size(1), x.size(0)});
  TORCH_CHECK(out_t.scalar_type() == x.scalar_type(), op,
              ": argument 'out_t' must have the dtype of 'x'");
  TransposeParams p{};
  p.x = static_cast<const uint8_t*>(x.data_ptr());
  p.out_t = static_cast<uint8_t*>(out_t.data_ptr());
  p.noop = noop_ptr(op, noop, x);
  p.rows = x.size(0);
  p.cols = x.size(1);
  if (x.numel() == 0) return;
  launch(op, x, p, transpose_cpu,
         [](const TransposeParams& q, void* s) { return transpose_cuda(q, s); });
}

TORCH_LIBRARY_FRAGMENT(graphfp8, m) {
  def_op(m, "fp8_transpose(Tensor x, Tensor(a!) out_t, Tensor? noop=None) -> ()", fp8_transpose);
}

void dequantize(const at::Tensor& x, const at::Tensor& scale_inv, const at::Tensor& out) {
  const char* op = "graphfp8.dequantize";
  TORCH_CHECK(is_fp8(x.scalar_type()), op, ": argument 'x' must be float8_e4m3fn or float8_e5m2, got ",
              x.scalar_type());
  TORCH_CHECK(x.is_contiguous(), op, ": argument 'x' must be contiguous");
  check_scalar_f32(op, "scale_inv", scale_inv, x);
  check_common(op, "out", out, x);
  TORCH_CHECK(is_hp(out.scalar_type()), op,
              ": argument 'out' must be float32, bfloat16 or float16, got ", out.scalar_type());
  TORCH_CHECK(out.sizes() == x.sizes(), op, ": argument 'out' must have shape ", fmt(x.sizes()),
              ", got ", fmt(out.sizes()));
  DequantizeParams p{};
  p.x = static_cast<const uint8_t*>(x.data_ptr());
  p.x_dtype = to_dtype(x.scalar_type());
  p.out = out.data_ptr();
  p.out_dtype = to_dtype(out.scalar_type());
  p.scale_inv = scale_inv.data_ptr<float>();
  p.numel = x.numel();
  if (x.numel() == 0) return;
  launch(op, x, p, dequantize_cpu,
         [](const DequantizeParams& q, void* s) { return dequantize_cuda(q, s); });
}

TORCH_LIBRARY_FRAGMENT(graphfp8, m) {
  def_op(m, "dequantize(Tensor x, Tensor scale_inv, Tensor(a!) out) -> ()", dequantize);
}

namespace {

// Checks and launches a fused cast-transpose: f(x) -> out, out_t, scale_inv, amax (and dbias).
void fused_impl(const char* op, FusedAct act, const at::Tensor& x, const at::Tensor* act_in,
                const at::Tensor& scale, const at::Tensor& out, const at::Tensor& out_t,
                const at::Tensor& scale_inv, const at::Tensor& amax, const at::Tensor* dbias,
                const c10::optional<at::Tensor>& scaled_max) {
  check_act_input(op, x, act_in, "act_in");
  TORCH_CHECK(x.dim() == 2, op, ": argument 'x' must be 2-D, got ", fmt(x.dim()), "-D");
  check_scalar_f32(op, "scale", scale, x);
  check_fp8_out(op, "out", out, x, x.sizes());
  check_fp8_out(op, "out_t", out_t, x, {x.size(1), x.size(0)});
  TORCH_CHECK(out_t.scalar_type() == out.scalar_type(), op,
              ": arguments 'out' and 'out_t' must have the same dtype");
  check_scalar_f32(op, "scale_inv", scale_inv, x);
  check_scalar_f32(op, "amax", amax, x);
  FusedCastTransposeParams p{};
  p.cast.x = x.data_ptr();
  p.cast.x_dtype = to_dtype(x.scalar_type());
  p.cast.out = out.data_ptr();
  p.cast.out_t = out_t.data_ptr();
  p.cast.out_dtype = to_dtype(out.scalar_type());
  set_scale(op, x, scale, amax, scaled_max, p.cast);
  p.cast.scale_inv = scale_inv.data_ptr<float>();
  p.cast.noop = nullptr;
  p.cast.rows = x.size(0);
  p.cast.cols = x.size(1);
  p.act = act;
  p.act_in = act_in != nullptr ? act_in->data_ptr() : nullptr;
  at::Tensor workspace;
  if (dbias != nullptr) {
    check_common(op, "dbias", *dbias, x);
    TORCH_CHECK(dbias->scalar_type() == x.scalar_type(), op,
                ": argument 'dbias' must have the dtype of the gradient, got ",
                dbias->scalar_type());
    TORCH_CHECK(dbias->dim() == 1 && dbias->size(0) == x.size(1), op,
                ": argument 'dbias' must have shape (", fmt(x.size(1)), ",), got ",
                fmt(dbias->sizes()));
    p.dbias = dbias->data_ptr();
    if (x.is_cuda() && x.numel() > 0) {
      // Per-tile column sums, reduced by a second kernel in a fixed order (deterministic, so
      // graphed and eager runs agree bit for bit). The caching allocator makes this capturable.
      const int64_t partial_rows = (x.size(0) + kDbiasPartialRows - 1) / kDbiasPartialRows;
      workspace = at::empty({partial_rows, x.size(1)}, x.options().dtype(at::kFloat));
      p.workspace = workspace.data_ptr<float>();
      p.dbias_in_kernel = switch_on("DBIAS_IN_KERNEL");
    }
  }
  if (x.numel() == 0) {
    if (dbias != nullptr) dbias->zero_();  // an empty sum is zero, as torch's
    if (p.cast.current.on()) {  // an empty tensor still updates its slot
      const CastParams none{x.data_ptr(), p.cast.x_dtype, out.data_ptr(), nullptr,
                            p.cast.out_dtype, p.cast.scale, p.cast.scale_inv, nullptr, nullptr,
                            0, 0, p.cast.current, false};
      launch(op, x, none, cast_cpu, [](const CastParams& q, void* s) { return cast_cuda(q, s); });
    }
    return;
  }
  launch(op, x, p, cast_transpose_fused_cpu,
         [](const FusedCastTransposeParams& q, void* s) { return cast_transpose_fused_cuda(q, s); });
}

}  // namespace

void cast_transpose_dbias(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& out,
                          const at::Tensor& out_t, const at::Tensor& scale_inv,
                          const at::Tensor& amax, const at::Tensor& dbias,
                          const c10::optional<at::Tensor>& scaled_max) {
  fused_impl("graphfp8.cast_transpose_dbias", FusedAct::kNone, x, nullptr, scale, out, out_t,
             scale_inv, amax, &dbias, scaled_max);
}

TORCH_LIBRARY_FRAGMENT(graphfp8, m) {
  def_op(m,
         "cast_transpose_dbias(Tensor x, Tensor(s!) scale, Tensor(a!) out, Tensor(b!) out_t, "
         "Tensor(c!) scale_inv, Tensor(d!) amax, Tensor(e!) dbias, Tensor? scaled_max=None) -> ()",
         cast_transpose_dbias);
}

void gelu_cast_transpose(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& out,
                         const at::Tensor& out_t, const at::Tensor& scale_inv,
                         const at::Tensor& amax, const c10::optional<at::Tensor>& scaled_max) {
  fused_impl("graphfp8.gelu_cast_transpose", FusedAct::kGelu, x, nullptr, scale, out, out_t,
             scale_inv, amax, nullptr, scaled_max);
}

TORCH_LIBRARY_FRAGMENT(graphfp8, m) {
  def_op(m,
         "gelu_cast_transpose(Tensor x, Tensor(s!) scale, Tensor(a!) out, Tensor(b!) out_t, "
         "Tensor(c!) scale_inv, Tensor(d!) amax, Tensor? scaled_max=None) -> ()",
         gelu_cast_transpose);
}

void dgelu_cast_transpose_dbias(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& scale,
                                const at::Tensor& out, const at::Tensor& out_t,
                                const at::Tensor& scale_inv, const at::Tensor& amax,
                                const at::Tensor& dbias,
                                const c10::optional<at::Tensor>& scaled_max) {
  fused_impl("graphfp8.dgelu_cast_transpose_dbias", FusedAct::kDgelu, dy, &x, scale, out, out_t,
             scale_inv, amax, &dbias, scaled_max);
}

TORCH_LIBRARY_FRAGMENT(graphfp8, m) {
  def_op(m,
         "dgelu_cast_transpose_dbias(Tensor dy, Tensor x, Tensor(s!) scale, Tensor(a!) out, "
         "Tensor(b!) out_t, Tensor(c!) scale_inv, Tensor(d!) amax, Tensor(e!) dbias, "
         "Tensor? scaled_max=None) -> ()",
         dgelu_cast_transpose_dbias);
}

}  // namespace graphfp8
