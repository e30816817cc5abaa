// The only torch-aware C++ of graphfp8: tensor checks -> Params -> launcher, and op registration.
// Longer than 400 lines because every op's checks live in this one torch-aware file.
//
// Every op writes into tensors the caller passes in (graph-friendly: nothing is allocated here
// but the dbias workspace), and every value that changes between steps (scale, amax, noop flag)
// is read from a tensor. Every argument a user can get wrong is checked here, before the
// launcher runs; launchers return a Status instead of throwing, and launch() raises on a failure.
#include <torch/extension.h>

#include <string>

#include "common.h"
#include "rope_fp8.h"

#ifdef GRAPHFP8_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace graphfp8 {
namespace {

DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::kFloat32;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kHalf: return DType::kFloat16;
    case at::kFloat8_e4m3fn: return DType::kE4M3;
    case at::kFloat8_e5m2: return DType::kE5M2;
    default: TORCH_CHECK(false, "graphfp8: unsupported dtype ", t);
  }
}

// Message pieces as strings. Streaming a number into an ostream from this extension crashed on
// the GPU machine (a segfault instead of the error; strings and dtypes streamed fine; likely a
// libstdc++ mismatch, not proven), so numbers and shapes are formatted with std::to_string and
// devices by libc10 (Device::str).
std::string fmt(int64_t v) { return std::to_string(v); }

std::string fmt(at::IntArrayRef v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

bool is_fp8(at::ScalarType t) { return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2; }
bool is_hp(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

// Checks shared by every tensor argument: same device as the reference tensor, contiguous.
void check_common(const char* op, const char* name, const at::Tensor& t, const at::Tensor& ref) {
  TORCH_CHECK(t.device() == ref.device(), op, ": argument '", name, "' is on ", t.device().str(),
              " but the input is on ", ref.device().str());
  TORCH_CHECK(t.is_contiguous(), op, ": argument '", name, "' must be contiguous");
}

void check_scalar_f32(const char* op, const char* name, const at::Tensor& t, const at::Tensor& ref) {
  check_common(op, name, t, ref);
  TORCH_CHECK(t.scalar_type() == at::kFloat, op, ": argument '", name, "' must be float32, got ",
              t.scalar_type());
  TORCH_CHECK(t.numel() == 1, op, ": argument '", name, "' must hold one element, got ",
              fmt(t.numel()));
}

void check_fp8_out(const char* op, const char* name, const at::Tensor& t, const at::Tensor& ref,
                   at::IntArrayRef shape) {
  check_common(op, name, t, ref);
  TORCH_CHECK(is_fp8(t.scalar_type()), op, ": argument '", name,
              "' must be float8_e4m3fn or float8_e5m2, got ", t.scalar_type());
  TORCH_CHECK(t.sizes() == shape, op, ": argument '", name, "' must have shape ", fmt(shape),
              ", got ", fmt(t.sizes()));
}

const float* noop_ptr(const char* op, const c10::optional<at::Tensor>& noop, const at::Tensor& ref) {
  if (!noop.has_value()) return nullptr;
  check_scalar_f32(op, "noop", *noop, ref);
  return noop->data_ptr<float>();
}

#ifdef GRAPHFP8_WITH_CUDA
void* current_stream(const at::Tensor& t) {
  return static_cast<void*>(c10::cuda::getCurrentCUDAStream(t.device().index()).stream());
}
#endif

// Runs the CPU or CUDA launcher for ref's device. Launchers assume the checks above have passed;
// a failed Status (an internal invariant, or a CUDA launch error) becomes an exception here.
template <typename Params, typename CpuFn, typename CudaFn>
void launch(const char* op, const at::Tensor& ref, const Params& p, CpuFn cpu_fn, CudaFn cuda_fn) {
  Status status;
  if (ref.is_cpu()) {
    status = cpu_fn(p);
  } else {
#ifdef GRAPHFP8_WITH_CUDA
    TORCH_CHECK(ref.is_cuda(), op, ": unsupported device ", ref.device().str());
    const c10::cuda::CUDAGuard guard(ref.device());
    status = cuda_fn(p, current_stream(ref));
#else
    (void)cuda_fn;
    TORCH_CHECK(false, op, ": graphfp8 was built without CUDA; cannot run on ",
                ref.device().str());
#endif
  }
  TORCH_CHECK(status.ok(), op, ": ", status.where, " failed: ", status.reason);
}

void cast_impl(const char* op, const at::Tensor& x, const at::Tensor& scale, const at::Tensor& out,
               const at::Tensor* out_t, const at::Tensor& scale_inv, const at::Tensor& amax,
               const c10::optional<at::Tensor>& noop) {
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
  p.scale = scale.data_ptr<float>();
  p.scale_inv = scale_inv.data_ptr<float>();
  p.amax = amax.data_ptr<float>();
  p.noop = noop_ptr(op, noop, x);
  p.rows = x.dim() == 2 ? x.size(0) : 1;
  p.cols = x.dim() == 2 ? x.size(1) : x.numel();
  if (x.numel() == 0) return;
  launch(op, x, p, cast_cpu, [](const CastParams& q, void* s) { return cast_cuda(q, s); });
}

void cast_to_fp8(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& out,
                 const at::Tensor& scale_inv, const at::Tensor& amax,
                 const c10::optional<at::Tensor>& noop) {
  cast_impl("graphfp8.cast_to_fp8", x, scale, out, nullptr, scale_inv, amax, noop);
}

void cast_transpose(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& out,
                    const at::Tensor& out_t, const at::Tensor& scale_inv, const at::Tensor& amax,
                    const c10::optional<at::Tensor>& noop) {
  cast_impl("graphfp8.cast_transpose", x, scale, out, &out_t, scale_inv, amax, noop);
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

// Checks and launches a fused cast-transpose: f(x) -> out, out_t, scale_inv, amax (and dbias).
void fused_impl(const char* op, FusedAct act, const at::Tensor& x, const at::Tensor* act_in,
                const at::Tensor& scale, const at::Tensor& out, const at::Tensor& out_t,
                const at::Tensor& scale_inv, const at::Tensor& amax, const at::Tensor* dbias) {
  TORCH_CHECK(is_hp(x.scalar_type()), op, ": argument 'x' must be float32, bfloat16 or float16, got ",
              x.scalar_type());
  TORCH_CHECK(x.dim() == 2, op, ": argument 'x' must be 2-D, got ", fmt(x.dim()), "-D");
  TORCH_CHECK(x.is_contiguous(), op, ": argument 'x' must be contiguous");
  if (act_in != nullptr) {
    check_common(op, "act_in", *act_in, x);
    TORCH_CHECK(act_in->scalar_type() == x.scalar_type() && act_in->sizes() == x.sizes(), op,
                ": argument 'act_in' must have the shape and dtype of the gradient, got ",
                fmt(act_in->sizes()), " ", act_in->scalar_type());
  }
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
  p.cast.scale = scale.data_ptr<float>();
  p.cast.scale_inv = scale_inv.data_ptr<float>();
  p.cast.amax = amax.data_ptr<float>();
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
    }
  }
  if (x.numel() == 0) {
    if (dbias != nullptr) dbias->zero_();  // an empty sum is zero, as torch's
    return;
  }
  launch(op, x, p, cast_transpose_fused_cpu,
         [](const FusedCastTransposeParams& q, void* s) { return cast_transpose_fused_cuda(q, s); });
}

void cast_transpose_dbias(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& out,
                          const at::Tensor& out_t, const at::Tensor& scale_inv,
                          const at::Tensor& amax, const at::Tensor& dbias) {
  fused_impl("graphfp8.cast_transpose_dbias", FusedAct::kNone, x, nullptr, scale, out, out_t,
             scale_inv, amax, &dbias);
}

void gelu_cast_transpose(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& out,
                         const at::Tensor& out_t, const at::Tensor& scale_inv,
                         const at::Tensor& amax) {
  fused_impl("graphfp8.gelu_cast_transpose", FusedAct::kGelu, x, nullptr, scale, out, out_t,
             scale_inv, amax, nullptr);
}

void dgelu_cast_transpose_dbias(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& scale,
                                const at::Tensor& out, const at::Tensor& out_t,
                                const at::Tensor& scale_inv, const at::Tensor& amax,
                                const at::Tensor& dbias) {
  fused_impl("graphfp8.dgelu_cast_transpose_dbias", FusedAct::kDgelu, dy, &x, scale, out, out_t,
             scale_inv, amax, &dbias);
}

bool built_with_cuda() {
#ifdef GRAPHFP8_WITH_CUDA
  return true;
#else
  return false;
#endif
}

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

void rope_qkv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
              int64_t num_heads, bool inverse, const at::Tensor& out) {
  const char* op = "graphfp8.rope_qkv";
  TORCH_CHECK_TYPE(is_hp(qkv.scalar_type()), op,
                   ": argument 'qkv' must be float32, bfloat16 or float16, got ",
                   qkv.scalar_type());
  TORCH_CHECK_VALUE(qkv.dim() == 3, op,
                    ": argument 'qkv' must be (batch, seq, 3 * hidden), got ", fmt(qkv.sizes()));
  TORCH_CHECK_VALUE(qkv.is_contiguous(), op, ": argument 'qkv' must be contiguous");
  const int64_t width = qkv.size(2);
  TORCH_CHECK_VALUE(num_heads > 0 && width % (3 * num_heads) == 0, op, ": last dim ",
                    fmt(width), " is not 3 * num_heads (", fmt(num_heads), ") * head_dim");
  const int64_t head_dim = width / (3 * num_heads);
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
  p.head_dim = head_dim;
  p.inverse = inverse;
  if (qkv.numel() == 0) return;
  launch(op, qkv, p, rope_cpu, [](const RopeParams& q, void* s) { return rope_cuda(q, s); });
}

// RoPE fused with the FP8 casts of q, k, v (rope_fp8.h): the checks both directions share.
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

void rope_fp8(const at::Tensor& qkv, const c10::optional<at::Tensor>& cos,
              const c10::optional<at::Tensor>& sin, int64_t num_heads, at::TensorList scale,
              at::TensorList out, at::TensorList scale_inv, at::TensorList amax) {
  const char* op = "graphfp8.rope_fp8";
  TORCH_CHECK(is_hp(qkv.scalar_type()), op,
              ": argument 'qkv' must be float32, bfloat16 or float16, got ", qkv.scalar_type());
  TORCH_CHECK(qkv.dim() == 3, op, ": argument 'qkv' must be (batch, seq, 3 * hidden), got ",
              fmt(qkv.dim()), "-D");
  TORCH_CHECK(qkv.is_contiguous(), op, ": argument 'qkv' must be contiguous");
  const int64_t width = qkv.size(2);
  TORCH_CHECK(num_heads > 0 && width % (3 * num_heads) == 0, op, ": last dim ", fmt(width),
              " is not 3 * num_heads (", fmt(num_heads), ") * head_dim");
  const int64_t head_dim = width / (3 * num_heads);
  TORCH_CHECK(head_dim % 2 == 0, op, ": head_dim must be even, got ", fmt(head_dim));
  check_rope_tables(op, cos, sin, qkv, qkv.size(1), head_dim);
  for (auto [name, list] : {std::pair<const char*, at::TensorList>{"scale", scale},
                            {"out", out}, {"scale_inv", scale_inv}, {"amax", amax}}) {
    check_three(op, name, list);
  }
  RopeFp8Params p{};
  const std::vector<int64_t> part_shape{qkv.size(0), qkv.size(1), num_heads, head_dim};
  for (int i = 0; i < 3; ++i) {
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
  p.head_dim = head_dim;
  if (qkv.numel() == 0) return;
  launch(op, qkv, p, rope_fp8_cpu,
         [](const RopeFp8Params& q, void* s) { return rope_fp8_cuda(q, s); });
}

void rope_fp8_backward(at::TensorList grads, at::TensorList scale_inv,
                       const c10::optional<at::Tensor>& cos, const c10::optional<at::Tensor>& sin,
                       int64_t num_heads, const at::Tensor& out) {
  const char* op = "graphfp8.rope_fp8_backward";
  check_three(op, "grads", grads);
  check_three(op, "scale_inv", scale_inv);
  TORCH_CHECK(is_hp(out.scalar_type()), op,
              ": argument 'out' must be float32, bfloat16 or float16, got ", out.scalar_type());
  TORCH_CHECK(out.dim() == 3 && out.is_contiguous(), op,
              ": argument 'out' must be a contiguous (batch, seq, 3 * hidden) tensor");
  TORCH_CHECK(num_heads > 0 && out.size(2) % (3 * num_heads) == 0, op, ": last dim ",
              fmt(out.size(2)), " is not 3 * num_heads (", fmt(num_heads), ") * head_dim");
  const int64_t head_dim = out.size(2) / (3 * num_heads);
  TORCH_CHECK(head_dim % 2 == 0, op, ": head_dim must be even, got ", fmt(head_dim));
  check_rope_tables(op, cos, sin, out, out.size(1), head_dim);
  RopeFp8BwdParams p{};
  const std::vector<int64_t> part_shape{out.size(0), out.size(1), num_heads, head_dim};
  for (int i = 0; i < 3; ++i) {
    check_fp8_out(op, "grads", grads[i], out, part_shape);
    TORCH_CHECK(grads[i].scalar_type() == grads[0].scalar_type(), op,
                ": the three 'grads' tensors must have one FP8 dtype");
    check_scalar_f32(op, "scale_inv", scale_inv[i], out);
    p.grad[i] = grads[i].data_ptr();
    p.scale_inv[i] = scale_inv[i].data_ptr<float>();
  }
  p.grad_dtype = to_dtype(grads[0].scalar_type());
  p.cos = cos.has_value() ? cos->data_ptr<float>() : nullptr;
  p.sin = sin.has_value() ? sin->data_ptr<float>() : nullptr;
  p.out = out.data_ptr();
  p.out_dtype = to_dtype(out.scalar_type());
  p.batch = out.size(0);
  p.seq = out.size(1);
  p.heads = num_heads;
  p.head_dim = head_dim;
  if (out.numel() == 0) return;
  launch(op, out, p, rope_fp8_bwd_cpu,
         [](const RopeFp8BwdParams& q, void* s) { return rope_fp8_bwd_cuda(q, s); });
}

}  // namespace
}  // namespace graphfp8

TORCH_LIBRARY(graphfp8, m) {
  m.def("cast_to_fp8(Tensor x, Tensor scale, Tensor(a!) out, Tensor(b!) scale_inv, "
        "Tensor(c!) amax, Tensor? noop=None) -> ()");
  m.def("cast_transpose(Tensor x, Tensor scale, Tensor(a!) out, Tensor(b!) out_t, "
        "Tensor(c!) scale_inv, Tensor(d!) amax, Tensor? noop=None) -> ()");
  m.def("fp8_transpose(Tensor x, Tensor(a!) out_t, Tensor? noop=None) -> ()");
  m.def("scale_update(Tensor(a!) amax_history, Tensor(b!) scale, Tensor scaled_max, "
        "bool most_recent) -> ()");
  m.def("dequantize(Tensor x, Tensor scale_inv, Tensor(a!) out) -> ()");
  m.def("cast_transpose_dbias(Tensor x, Tensor scale, Tensor(a!) out, Tensor(b!) out_t, "
        "Tensor(c!) scale_inv, Tensor(d!) amax, Tensor(e!) dbias) -> ()");
  m.def("gelu_cast_transpose(Tensor x, Tensor scale, Tensor(a!) out, Tensor(b!) out_t, "
        "Tensor(c!) scale_inv, Tensor(d!) amax) -> ()");
  m.def("rope_qkv(Tensor qkv, Tensor cos, Tensor sin, int num_heads, bool inverse, "
        "Tensor(a!) out) -> ()");
  m.def("dgelu_cast_transpose_dbias(Tensor dy, Tensor x, Tensor scale, Tensor(a!) out, "
        "Tensor(b!) out_t, Tensor(c!) scale_inv, Tensor(d!) amax, Tensor(e!) dbias) -> ()");
  m.def("rope_fp8(Tensor qkv, Tensor? cos, Tensor? sin, int num_heads, Tensor[] scale, "
        "Tensor(a!)[] out, Tensor(b!)[] scale_inv, Tensor(c!)[] amax) -> ()");
  m.def("rope_fp8_backward(Tensor[] grads, Tensor[] scale_inv, Tensor? cos, Tensor? sin, "
        "int num_heads, Tensor(a!) out) -> ()");
}

// The same checked entry points serve both backends: each picks its launcher by device.
#define GRAPHFP8_IMPL_ALL(m)                                  \
  m.impl("cast_to_fp8", &graphfp8::cast_to_fp8);              \
  m.impl("cast_transpose", &graphfp8::cast_transpose);        \
  m.impl("fp8_transpose", &graphfp8::fp8_transpose);          \
  m.impl("scale_update", &graphfp8::scale_update);            \
  m.impl("dequantize", &graphfp8::dequantize);                \
  m.impl("cast_transpose_dbias", &graphfp8::cast_transpose_dbias); \
  m.impl("gelu_cast_transpose", &graphfp8::gelu_cast_transpose);   \
  m.impl("dgelu_cast_transpose_dbias", &graphfp8::dgelu_cast_transpose_dbias); \
  m.impl("rope_qkv", &graphfp8::rope_qkv);                    \
  m.impl("rope_fp8", &graphfp8::rope_fp8);                    \
  m.impl("rope_fp8_backward", &graphfp8::rope_fp8_backward)

TORCH_LIBRARY_IMPL(graphfp8, CPU, m) { GRAPHFP8_IMPL_ALL(m); }

#ifdef GRAPHFP8_WITH_CUDA
TORCH_LIBRARY_IMPL(graphfp8, CUDA, m) { GRAPHFP8_IMPL_ALL(m); }
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "graphfp8 kernels; the ops live in torch.ops.graphfp8";
  m.def("built_with_cuda", &graphfp8::built_with_cuda, "Whether the CUDA kernels were compiled");
}
