// Checks and launches of the fused scale update and the fused-QKV RoPE.
#include "ops.h"

namespace graphfp8 {

void scale_update(const at::Tensor& amax_history, const at::Tensor& scale,
                  const at::Tensor& scaled_max, bool most_recent) {
  const char* op = "graphfp8.scale_update";
  const at::Tensor& h = amax_history;
  TORCH_CHECK(h.scalar_type() == at::kFloat, op, ": argument 'amax_history' must be float32, got ",
              h.scalar_type());
  TORCH_CHECK(h.dim() == 2, op,
              ": argument 'amax_history' must be 2-D (history_len, num_slots), got ",
              fmt(h.dim()), "-D");
  TORCH_CHECK(h.is_contiguous(), op, ": argument 'amax_history' must be contiguous");
  TORCH_CHECK(h.size(0) >= 1, op, ": argument 'amax_history' needs a history length >= 1");
  const int64_t num_slots = h.size(1);
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"scale", &scale},
                         {"scaled_max", &scaled_max}}) {
    check_common(op, name, *t, h);
    TORCH_CHECK(t->scalar_type() == at::kFloat, op, ": argument '", name,
                "' must be float32, got ", t->scalar_type());
    TORCH_CHECK(t->dim() == 1 && t->size(0) == num_slots, op, ": argument '", name,
                "' must have shape (", fmt(num_slots), ",), got ", fmt(t->sizes()));
  }
  ScaleUpdateParams p{};
  p.amax_history = h.data_ptr<float>();
  p.scale = scale.data_ptr<float>();
  p.scaled_max = scaled_max.data_ptr<float>();
  p.history_len = h.size(0);
  p.num_slots = num_slots;
  p.most_recent = most_recent;
  if (num_slots == 0) return;
  launch(op, h, p, scale_update_cpu,
         [](const ScaleUpdateParams& q, void* s) { return scale_update_cuda(q, s); });
}

TORCH_LIBRARY_FRAGMENT(graphfp8, m) {
  def_op(m,
         "scale_update(Tensor(a!) amax_history, Tensor(b!) scale, Tensor scaled_max, "
         "bool most_recent) -> ()",
         scale_update);
}

namespace {

// rope_qkv's checks raise TypeError (dtypes) and ValueError (shapes, layout, devices): the
// classes that its Python wrapper raised when it checked the arguments itself.
void check_rope_table(const char* op, const char* name, const at::Tensor& t, const at::Tensor& qkv,
                      int64_t head_dim) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, op, ": argument '", name,
                   "' must be float32, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 2 && t.size(0) >= qkv.size(1) && t.size(1) == head_dim, op,
                    ": argument '", name, "' must be (>= ", fmt(qkv.size(1)), ", ",
                    fmt(head_dim), "), got ", fmt(t.sizes()));
  TORCH_CHECK_VALUE(t.device() == qkv.device(), op, ": argument '", name, "' is on ",
                    t.device().str(), " but the input is on ", qkv.device().str());
  TORCH_CHECK_VALUE(t.is_contiguous(), op, ": argument '", name, "' must be contiguous");
}

}  // namespace

void rope_qkv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
              int64_t num_heads, bool inverse, const at::Tensor& out, int64_t num_kv_heads) {
  const char* op = "graphfp8.rope_qkv";
  TORCH_CHECK_TYPE(is_hp(qkv.scalar_type()), op,
                   ": argument 'qkv' must be float32, bfloat16 or float16, got ",
                   qkv.scalar_type());
  TORCH_CHECK_VALUE(qkv.dim() == 3, op,
                    ": argument 'qkv' must be (batch, seq, 3 * hidden), got ", fmt(qkv.sizes()));
  TORCH_CHECK_VALUE(qkv.is_contiguous(), op, ": argument 'qkv' must be contiguous");
  const int64_t width = qkv.size(2);
  const int64_t kv_heads = num_kv_heads == 0 ? num_heads : num_kv_heads;
  TORCH_CHECK_VALUE(num_heads > 0 && kv_heads > 0 && num_heads % kv_heads == 0, op,
                    ": num_heads (", fmt(num_heads), ") must be a positive multiple of ",
                    "num_kv_heads (", fmt(kv_heads), ")");
  TORCH_CHECK_VALUE(width % (num_heads + 2 * kv_heads) == 0, op, ": last dim ", fmt(width),
                    " is not (num_heads + 2 * num_kv_heads) * head_dim with num_heads ",
                    fmt(num_heads), ", num_kv_heads ", fmt(kv_heads));
  const int64_t head_dim = width / (num_heads + 2 * kv_heads);
  TORCH_CHECK_VALUE(head_dim % 2 == 0, op, ": head_dim must be even, got ", fmt(head_dim));
  check_rope_table(op, "cos", cos, qkv, head_dim);
  check_rope_table(op, "sin", sin, qkv, head_dim);
  TORCH_CHECK_TYPE(out.scalar_type() == qkv.scalar_type(), op,
                   ": argument 'out' must have the dtype of 'qkv', got ", out.scalar_type());
  TORCH_CHECK_VALUE(out.sizes() == qkv.sizes(), op, ": argument 'out' must have shape ",
                    fmt(qkv.sizes()), ", got ", fmt(out.sizes()));
  TORCH_CHECK_VALUE(out.device() == qkv.device(), op, ": argument 'out' is on ",
                    out.device().str(), " but the input is on ", qkv.device().str());
  TORCH_CHECK_VALUE(out.is_contiguous(), op, ": argument 'out' must be contiguous");
  RopeParams p{};
  p.x = qkv.data_ptr();
  p.out = out.data_ptr();
  p.dtype = to_dtype(qkv.scalar_type());
  p.cos = cos.data_ptr<float>();
  p.sin = sin.data_ptr<float>();
  p.batch = qkv.size(0);
  p.seq = qkv.size(1);
  p.heads = num_heads;
  p.kv_heads = kv_heads;
  p.head_dim = head_dim;
  p.inverse = inverse;
  if (qkv.numel() == 0) return;
  launch(op, qkv, p, rope_cpu, [](const RopeParams& q, void* s) { return rope_cuda(q, s); });
}

TORCH_LIBRARY_FRAGMENT(graphfp8, m) {
  def_op(m,
         "rope_qkv(Tensor qkv, Tensor cos, Tensor sin, int num_heads, bool inverse, "
         "Tensor(a!) out, int num_kv_heads=0) -> ()",
         rope_qkv);
}

}  // namespace graphfp8
