// Checks and launches of the RoPE fused with the FP8 casts of q, k and v (rope_fp8.h), and of
// its backward.
#include <utility>
#include <vector>

#include "../rope_fp8.h"
#include "ops.h"

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

}  // namespace graphfp8
