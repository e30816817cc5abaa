// Checks and launches of the RoPE fused with the FP8 casts of q, k and v (rope_fp8.h), of its
// backward, and of the backward fused into the QKV gradient's cast-transpose (rope_cast.h).
#include <utility>
#include <vector>

#include "../rope_cast.h"
#include "../rope_fp8.h"
#include "ops.h"
#include "switches.h"

namespace graphfp8 {
namespace {

// The checks both directions share.
void check_rope_tables(const char* op, const c10::optional<at::Tensor>& cos,
                       const c10::optional<at::Tensor>& sin, const at::Tensor& ref, int64_t seq,
                       int64_t head_dim) {
  TORCH_CHECK(cos.has_value() == sin.has_value(), op,
              ": arguments 'cos' and 'sin' must be given together");
  if (!cos.has_value()) return;
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"cos", &*cos}, {"sin", &*sin}}) {
    check_common(op, name, *t, ref);
    TORCH_CHECK(t->scalar_type() == at::kFloat, op, ": argument '", name,
                "' must be float32, got ", t->scalar_type());
    TORCH_CHECK(t->dim() == 2 && t->size(0) >= seq && t->size(1) == head_dim, op, ": argument '",
                name, "' must be (>= ", fmt(seq), ", ", fmt(head_dim), "), got ", fmt(t->sizes()));
  }
}

void check_three(const char* op, const char* name, at::TensorList ts) {
  TORCH_CHECK(ts.size() == 3, op, ": argument '", name, "' must hold 3 tensors (q, k, v), got ",
              fmt(static_cast<int64_t>(ts.size())));
}

// head_dim of a fused QKV row of `width` = (heads + 2 * kv_heads) * head_dim (kv_heads 0: heads).
int64_t qkv_head_dim(const char* op, int64_t width, int64_t heads, int64_t& kv_heads) {
  if (kv_heads == 0) kv_heads = heads;
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0, op, ": num_heads (",
              fmt(heads), ") must be a positive multiple of num_kv_heads (", fmt(kv_heads), ")");
  TORCH_CHECK(width % (heads + 2 * kv_heads) == 0, op, ": last dim ", fmt(width),
              " is not (num_heads + 2 * num_kv_heads) * head_dim with num_heads ", fmt(heads),
              ", num_kv_heads ", fmt(kv_heads));
  const int64_t head_dim = width / (heads + 2 * kv_heads);
  TORCH_CHECK(head_dim % 2 == 0, op, ": head_dim must be even, got ", fmt(head_dim));
  return head_dim;
}

}  // namespace

void rope_fp8(const at::Tensor& qkv, const c10::optional<at::Tensor>& cos,
              const c10::optional<at::Tensor>& sin, int64_t num_heads, at::TensorList scale,
              at::TensorList out, at::TensorList scale_inv, at::TensorList amax,
              int64_t num_kv_heads) {
  const char* op = "graphfp8.rope_fp8";
  TORCH_CHECK(is_hp(qkv.scalar_type()), op,
              ": argument 'qkv' must be float32, bfloat16 or float16, got ", qkv.scalar_type());
  TORCH_CHECK(qkv.dim() == 3, op, ": argument 'qkv' must be (batch, seq, 3 * hidden), got ",
              fmt(qkv.dim()), "-D");
  TORCH_CHECK(qkv.is_contiguous(), op, ": argument 'qkv' must be contiguous");
  int64_t kv_heads = num_kv_heads;
  const int64_t head_dim = qkv_head_dim(op, qkv.size(2), num_heads, kv_heads);
  check_rope_tables(op, cos, sin, qkv, qkv.size(1), head_dim);
  for (auto [name, list] : {std::pair<const char*, at::TensorList>{"scale", scale},
                            {"out", out}, {"scale_inv", scale_inv}, {"amax", amax}}) {
    check_three(op, name, list);
  }
  RopeFp8Params p{};
  for (int i = 0; i < 3; ++i) {
    const std::vector<int64_t> part_shape{qkv.size(0), qkv.size(1), i == 0 ? num_heads : kv_heads,
                                          head_dim};
    check_scalar_f32(op, "scale", scale[i], qkv);
    check_fp8_out(op, "out", out[i], qkv, part_shape);
    TORCH_CHECK(out[i].scalar_type() == out[0].scalar_type(), op,
                ": the three 'out' tensors must have one FP8 dtype");
    check_scalar_f32(op, "scale_inv", scale_inv[i], qkv);
    check_scalar_f32(op, "amax", amax[i], qkv);
    p.out[i] = out[i].data_ptr();
    p.scale[i] = scale[i].data_ptr<float>();
    p.scale_inv[i] = scale_inv[i].data_ptr<float>();
    p.amax[i] = amax[i].data_ptr<float>();
  }
  p.qkv = qkv.data_ptr();
  p.qkv_dtype = to_dtype(qkv.scalar_type());
  p.cos = cos.has_value() ? cos->data_ptr<float>() : nullptr;
  p.sin = sin.has_value() ? sin->data_ptr<float>() : nullptr;
  p.out_dtype = to_dtype(out[0].scalar_type());
  p.batch = qkv.size(0);
  p.seq = qkv.size(1);
  p.heads = num_heads;
  p.kv_heads = kv_heads;
  p.head_dim = head_dim;
  if (qkv.numel() == 0) return;
  launch(op, qkv, p, rope_fp8_cpu,
         [](const RopeFp8Params& q, void* s) { return rope_fp8_cuda(q, s); });
}

TORCH_LIBRARY_FRAGMENT(graphfp8, m) {
  def_op(m,
         "rope_fp8(Tensor qkv, Tensor? cos, Tensor? sin, int num_heads, Tensor[] scale, "
         "Tensor(a!)[] out, Tensor(b!)[] scale_inv, Tensor(c!)[] amax, int num_kv_heads=0) -> ()",
         rope_fp8);
}

void rope_fp8_backward(at::TensorList grads, at::TensorList scale_inv,
                       const c10::optional<at::Tensor>& cos, const c10::optional<at::Tensor>& sin,
                       int64_t num_heads, const at::Tensor& out, int64_t num_kv_heads) {
  const char* op = "graphfp8.rope_fp8_backward";
  check_three(op, "grads", grads);
  TORCH_CHECK(is_hp(out.scalar_type()), op,
              ": argument 'out' must be float32, bfloat16 or float16, got ", out.scalar_type());
  // High-precision gradients (the bf16 attention path): out's dtype, no scale_inv.
  const bool hp = is_hp(grads[0].scalar_type());
  if (hp) {
    TORCH_CHECK(scale_inv.empty(), op, ": high-precision 'grads' take no 'scale_inv', got ",
                fmt(static_cast<int64_t>(scale_inv.size())), " tensors");
  } else {
    check_three(op, "scale_inv", scale_inv);
  }
  TORCH_CHECK(out.dim() == 3 && out.is_contiguous(), op,
              ": argument 'out' must be a contiguous (batch, seq, 3 * hidden) tensor");
  int64_t kv_heads = num_kv_heads;
  const int64_t head_dim = qkv_head_dim(op, out.size(2), num_heads, kv_heads);
  check_rope_tables(op, cos, sin, out, out.size(1), head_dim);
  RopeFp8BwdParams p{};
  for (int i = 0; i < 3; ++i) {
    const std::vector<int64_t> part_shape{out.size(0), out.size(1), i == 0 ? num_heads : kv_heads,
                                          head_dim};
    if (hp) {
      check_common(op, "grads", grads[i], out);
      TORCH_CHECK(grads[i].scalar_type() == out.scalar_type(), op,
                  ": high-precision 'grads' must have out's dtype ", out.scalar_type(), ", got ",
                  grads[i].scalar_type());
      TORCH_CHECK(grads[i].sizes() == at::IntArrayRef(part_shape), op,
                  ": argument 'grads' must have shape ", fmt(at::IntArrayRef(part_shape)),
                  ", got ", fmt(grads[i].sizes()));
    } else {
      check_fp8_out(op, "grads", grads[i], out, part_shape);
      TORCH_CHECK(grads[i].scalar_type() == grads[0].scalar_type(), op,
                  ": the three 'grads' tensors must have one FP8 dtype");
      check_scalar_f32(op, "scale_inv", scale_inv[i], out);
      p.scale_inv[i] = scale_inv[i].data_ptr<float>();
    }
    p.grad[i] = grads[i].data_ptr();
  }
  p.grad_dtype = to_dtype(grads[0].scalar_type());
  p.cos = cos.has_value() ? cos->data_ptr<float>() : nullptr;
  p.sin = sin.has_value() ? sin->data_ptr<float>() : nullptr;
  p.out = out.data_ptr();
  p.out_dtype = to_dtype(out.scalar_type());
  p.batch = out.size(0);
  p.seq = out.size(1);
  p.heads = num_heads;
  p.kv_heads = kv_heads;
  p.head_dim = head_dim;
  if (out.numel() == 0) return;
  launch(op, out, p, rope_fp8_bwd_cpu,
         [](const RopeFp8BwdParams& q, void* s) { return rope_fp8_bwd_cuda(q, s); });
}

TORCH_LIBRARY_FRAGMENT(graphfp8, m) {
  def_op(m,
         "rope_fp8_backward(Tensor[] grads, Tensor[] scale_inv, Tensor? cos, Tensor? sin, "
         "int num_heads, Tensor(a!) out, int num_kv_heads=0) -> ()",
         rope_fp8_backward);
}

namespace {

// The checks of rope_cast_transpose and rope_amax_: the high-precision gradients dq, dk, dv of one
// dtype and contiguous, the tables; fills p's geometry and gradients, returns the fused width.
int64_t rope_cast_geometry(const char* op, at::TensorList grads,
                           const c10::optional<at::Tensor>& cos,
                           const c10::optional<at::Tensor>& sin, int64_t num_heads,
                           int64_t num_kv_heads, RopeCastParams& p) {
  check_three(op, "grads", grads);
  const at::Tensor& g = grads[0];
  TORCH_CHECK(is_hp(g.scalar_type()), op,
              ": argument 'grads' must be float32, bfloat16 or float16, got ", g.scalar_type());
  TORCH_CHECK(g.dim() == 4 && g.size(2) == num_heads, op,
              ": argument 'grads' must start with dq (batch, seq, num_heads, head_dim), got ",
              fmt(g.sizes()));
  const int64_t kv_heads = num_kv_heads == 0 ? num_heads : num_kv_heads;
  const int64_t head_dim = g.size(3);
  int64_t kv = kv_heads;
  qkv_head_dim(op, (num_heads + 2 * kv_heads) * head_dim, num_heads, kv);
  check_rope_tables(op, cos, sin, g, g.size(1), head_dim);
  for (int i = 0; i < 3; ++i) {
    const std::vector<int64_t> part_shape{g.size(0), g.size(1), i == 0 ? num_heads : kv_heads,
                                          head_dim};
    check_common(op, "grads", grads[i], g);
    TORCH_CHECK(grads[i].scalar_type() == g.scalar_type() && grads[i].is_contiguous() &&
                    grads[i].sizes() == at::IntArrayRef(part_shape),
                op, ": argument 'grads' must be contiguous dq, dk, dv of one dtype, grads[", i,
                "] of shape ", fmt(at::IntArrayRef(part_shape)), ", got ", fmt(grads[i].sizes()),
                " ", grads[i].scalar_type());
    p.grad[i] = grads[i].data_ptr();
  }
  TORCH_CHECK(g.numel() > 0, op, ": the gradients must not be empty");
  p.cos = cos.has_value() ? cos->data_ptr<float>() : nullptr;
  p.sin = sin.has_value() ? sin->data_ptr<float>() : nullptr;
  p.batch = g.size(0);
  p.seq = g.size(1);
  p.heads = num_heads;
  p.kv_heads = kv_heads;
  p.head_dim = head_dim;
  p.fused.cast.x_dtype = to_dtype(g.scalar_type());
  p.fused.cast.rows = p.batch * p.seq;
  p.fused.cast.cols = (num_heads + 2 * kv_heads) * head_dim;
  p.fused.act = FusedAct::kNone;
  return p.fused.cast.cols;
}

void launch_rope_cast(const char* op, const at::Tensor& ref, const RopeCastParams& p) {
  launch(op, ref, p, rope_cast_cpu,
         [](const RopeCastParams& q, void* s) { return rope_cast_cuda(q, s); });
}

}  // namespace

void rope_cast_transpose(at::TensorList grads, const c10::optional<at::Tensor>& cos,
                         const c10::optional<at::Tensor>& sin, int64_t num_heads,
                         const at::Tensor& scale, const at::Tensor& out, const at::Tensor& out_t,
                         const at::Tensor& scale_inv, const at::Tensor& amax,
                         const c10::optional<at::Tensor>& dbias,
                         const c10::optional<at::Tensor>& scaled_max, int64_t num_kv_heads) {
  const char* op = "graphfp8.rope_cast_transpose";
  RopeCastParams p{};
  const int64_t cols = rope_cast_geometry(op, grads, cos, sin, num_heads, num_kv_heads, p);
  const at::Tensor& g = grads[0];
  const int64_t rows = p.fused.cast.rows;
  check_scalar_f32(op, "scale", scale, g);
  check_fp8_out(op, "out", out, g, {rows, cols});
  check_fp8_out(op, "out_t", out_t, g, {cols, rows});
  TORCH_CHECK(out_t.scalar_type() == out.scalar_type(), op,
              ": arguments 'out' and 'out_t' must have the same dtype");
  check_scalar_f32(op, "scale_inv", scale_inv, g);
  check_scalar_f32(op, "amax", amax, g);
  CastParams& c = p.fused.cast;
  c.out = out.data_ptr();
  c.out_t = out_t.data_ptr();
  c.out_dtype = to_dtype(out.scalar_type());
  c.scale = scale.data_ptr<float>();
  c.scale_inv = scale_inv.data_ptr<float>();
  c.amax = amax.data_ptr<float>();
  c.paired_quantize = switch_on("PAIRED_QUANTIZE");
  if (scaled_max.has_value()) {  // current scaling, as the casts take it (cast_ops.cpp's set_scale)
    check_scalar_f32(op, "scaled_max", *scaled_max, g);
    c.current = CurrentScale{scale.data_ptr<float>(), amax.data_ptr<float>(),
                             scaled_max->data_ptr<float>()};
    c.amax = nullptr;
  }
  at::Tensor workspace;
  if (dbias.has_value()) {
    check_common(op, "dbias", *dbias, g);
    TORCH_CHECK(dbias->scalar_type() == g.scalar_type() && dbias->dim() == 1 &&
                    dbias->size(0) == cols,
                op, ": argument 'dbias' must be (", fmt(cols), ",) of the gradients' dtype, got ",
                fmt(dbias->sizes()), " ", dbias->scalar_type());
    p.fused.dbias = dbias->data_ptr();
    if (g.is_cuda()) {  // per-tile column partials, as cast_transpose_dbias (cast_ops.cpp)
      workspace = at::empty({(rows + kDbiasPartialRows - 1) / kDbiasPartialRows, cols},
                            g.options().dtype(at::kFloat));
      p.fused.workspace = workspace.data_ptr<float>();
      p.fused.dbias_in_kernel = switch_on("DBIAS_IN_KERNEL");
    }
  }
  launch_rope_cast(op, g, p);
}

TORCH_LIBRARY_FRAGMENT(graphfp8, m) {
  def_op(m,
         "rope_cast_transpose(Tensor[] grads, Tensor? cos, Tensor? sin, int num_heads, "
         "Tensor(s!) scale, Tensor(a!) out, Tensor(b!) out_t, Tensor(c!) scale_inv, "
         "Tensor(d!) amax, Tensor(e!)? dbias=None, Tensor? scaled_max=None, "
         "int num_kv_heads=0) -> ()",
         rope_cast_transpose);
}

void rope_amax(at::TensorList grads, const c10::optional<at::Tensor>& cos,
                const c10::optional<at::Tensor>& sin, int64_t num_heads, const at::Tensor& amax,
                int64_t num_kv_heads) {
  const char* op = "graphfp8.rope_amax";
  RopeCastParams p{};
  rope_cast_geometry(op, grads, cos, sin, num_heads, num_kv_heads, p);
  check_scalar_f32(op, "amax", amax, grads[0]);
  p.fused.cast.out_dtype = DType::kE4M3;  // no cast: out == nullptr, only the amax is folded
  p.fused.cast.amax = amax.data_ptr<float>();
  launch_rope_cast(op, grads[0], p);
}

TORCH_LIBRARY_FRAGMENT(graphfp8, m) {
  def_op(m,
         "rope_amax(Tensor[] grads, Tensor? cos, Tensor? sin, int num_heads, Tensor(a!) amax, "
         "int num_kv_heads=0) -> ()",
         rope_amax);
}

}  // namespace graphfp8
