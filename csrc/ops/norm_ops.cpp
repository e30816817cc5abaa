// Checks and launches of the norms with an FP8 output (LayerNorm, RMSNorm; per tensor or in
// 1x128 tiles) and their backward.
#include <cmath>

#include "../blockwise_norm.h"
#include "blockwise_args.h"
#include "ops.h"
#include "switches.h"

namespace graphfp8 {
namespace {

// x and the tensors shaped like it (or like one of its rows): dtype, shape, device, contiguity.
void check_like(const char* op, const char* name, const at::Tensor& t, const at::Tensor& x,
                at::IntArrayRef shape) {
  check_common(op, name, t, x);
  TORCH_CHECK(t.scalar_type() == x.scalar_type(), op, ": argument '", name,
              "' must have the dtype of 'x' (", x.scalar_type(), "), got ", t.scalar_type());
  TORCH_CHECK(t.sizes() == shape, op, ": argument '", name, "' must have shape ", fmt(shape),
              ", got ", fmt(t.sizes()));
}

void check_row_stats(const char* op, const char* name, const at::Tensor& t, const at::Tensor& x) {
  check_common(op, name, t, x);
  TORCH_CHECK(t.scalar_type() == at::kFloat, op, ": argument '", name,
              "' must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == x.size(0), op, ": argument '", name,
              "' must have shape [", fmt(x.size(0)), "], got ", fmt(t.sizes()));
}

// The input every norm op starts from: x (rows, hidden) and gamma (hidden,).
void check_norm_input(const char* op, const at::Tensor& x, const at::Tensor& gamma) {
  TORCH_CHECK(is_hp(x.scalar_type()), op,
              ": argument 'x' must be float32, bfloat16 or float16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2, op, ": argument 'x' must be 2-D (rows, hidden), got ",
              fmt(x.dim()), "-D");
  TORCH_CHECK(x.is_contiguous(), op, ": argument 'x' must be contiguous");
  TORCH_CHECK(x.size(1) >= 1, op, ": the hidden size must be at least 1");
  TORCH_CHECK(x.is_cpu() || x.size(1) <= kNormMaxHiddenCuda, op, ": the CUDA kernels take a ",
              "hidden size of at most ", fmt(kNormMaxHiddenCuda), ", got ", fmt(x.size(1)));
  check_like(op, "gamma", gamma, x, {x.size(1)});
}

const at::Tensor* opt(const c10::optional<at::Tensor>& t) { return t.has_value() ? &*t : nullptr; }

struct NormFwdArgs {
  const at::Tensor& x;
  const at::Tensor& gamma;
  const at::Tensor* beta;  // LayerNorm
  double eps;
  bool zero_centered_gamma;
  const at::Tensor& scale;
  const at::Tensor& out;
  const at::Tensor* out_t;
  const at::Tensor& scale_inv;
  const at::Tensor& amax;
  const at::Tensor* mu;  // LayerNorm
  const at::Tensor& rsigma;
  const at::Tensor* out_hp;
  const at::Tensor* residual;
  const at::Tensor* residual_out;
  const at::Tensor* scaled_max;  // current scaling: the norm computes its scale (CurrentScale)
};

void check_fwd(const char* op, const NormFwdArgs& a) {
  const at::Tensor& x = a.x;
  check_norm_input(op, x, a.gamma);
  if (a.beta != nullptr) check_like(op, "beta", *a.beta, x, {x.size(1)});
  TORCH_CHECK(std::isfinite(a.eps) && a.eps >= 0.0, op, ": eps must be finite and >= 0");
  check_scalar_f32(op, "scale", a.scale, x);
  check_fp8_out(op, "out", a.out, x, x.sizes());
  if (a.out_t != nullptr) {
    check_fp8_out(op, "out_t", *a.out_t, x, {x.size(1), x.size(0)});
    TORCH_CHECK(a.out_t->scalar_type() == a.out.scalar_type(), op,
                ": arguments 'out' and 'out_t' must have the same dtype");
  }
  check_scalar_f32(op, "scale_inv", a.scale_inv, x);
  check_scalar_f32(op, "amax", a.amax, x);
  if (a.mu != nullptr) check_row_stats(op, "mu", *a.mu, x);
  check_row_stats(op, "rsigma", a.rsigma, x);
  if (a.out_hp != nullptr) check_like(op, "out_hp", *a.out_hp, x, x.sizes());
  TORCH_CHECK((a.residual == nullptr) == (a.residual_out == nullptr), op,
              ": arguments 'residual' and 'residual_out' go together");
  if (a.residual != nullptr) {
    check_like(op, "residual", *a.residual, x, x.sizes());
    check_like(op, "residual_out", *a.residual_out, x, x.sizes());
  }
}

void* ptr(const at::Tensor* t) { return t != nullptr ? t->data_ptr() : nullptr; }

void norm_fwd(const char* op, const NormFwdArgs& a) {
  check_fwd(op, a);
  NormParams p{};
  p.x = a.x.data_ptr();
  p.residual = ptr(a.residual);
  p.residual_out = ptr(a.residual_out);
  p.gamma = a.gamma.data_ptr();
  p.beta = ptr(a.beta);
  p.dtype = to_dtype(a.x.scalar_type());
  p.out = a.out.data_ptr();
  p.out_t = ptr(a.out_t);
  p.out_dtype = to_dtype(a.out.scalar_type());
  p.out_hp = ptr(a.out_hp);
  p.scale = a.scale.data_ptr<float>();
  p.scale_inv = a.scale_inv.data_ptr<float>();
  p.amax = a.amax.data_ptr<float>();
  if (a.scaled_max != nullptr) {
    check_scalar_f32(op, "scaled_max", *a.scaled_max, a.x);
    p.current = CurrentScale{a.scale.data_ptr<float>(), p.amax, a.scaled_max->data_ptr<float>()};
    p.amax = nullptr;
  }
  p.mu = a.mu != nullptr ? a.mu->data_ptr<float>() : nullptr;
  p.rsigma = a.rsigma.data_ptr<float>();
  p.eps = static_cast<float>(a.eps);
  p.rms = a.beta == nullptr;
  p.zero_centered_gamma = a.zero_centered_gamma;
  p.rows = a.x.size(0);
  p.hidden = a.x.size(1);
  p.transpose_in_kernel = switch_on("NORM_FWD_TRANSPOSE");
  if (p.rows == 0 && !p.current.on()) return;  // an empty input still updates its slot
  launch(op, a.x, p, norm_fwd_cpu, [](const NormParams& q, void* s) { return norm_fwd_cuda(q, s); });
}

// The norm's amax pass: y computed as norm_fwd computes it, only max |y| written.
void norm_amax(const char* op, const at::Tensor& x, const at::Tensor& gamma,
               const at::Tensor* beta, double eps, bool zero_centered_gamma,
               const at::Tensor& amax, const at::Tensor* residual) {
  check_norm_input(op, x, gamma);
  if (beta != nullptr) check_like(op, "beta", *beta, x, {x.size(1)});
  TORCH_CHECK(std::isfinite(eps) && eps >= 0.0, op, ": eps must be finite and >= 0");
  check_scalar_f32(op, "amax", amax, x);
  if (residual != nullptr) check_like(op, "residual", *residual, x, x.sizes());
  NormParams p{};
  p.x = x.data_ptr();
  p.residual = ptr(residual);
  p.gamma = gamma.data_ptr();
  p.beta = ptr(beta);
  p.dtype = to_dtype(x.scalar_type());
  p.out_dtype = DType::kE4M3;  // unused: nothing is quantized
  p.amax = amax.data_ptr<float>();
  p.eps = static_cast<float>(eps);
  p.rms = beta == nullptr;
  p.zero_centered_gamma = zero_centered_gamma;
  p.rows = x.size(0);
  p.hidden = x.size(1);
  p.amax_only = true;
  if (p.rows == 0) return;
  launch(op, x, p, norm_fwd_cpu, [](const NormParams& q, void* s) { return norm_fwd_cuda(q, s); });
}

void norm_bwd(const char* op, const at::Tensor& dy, const at::Tensor& x, const at::Tensor* mu,
              const at::Tensor& rsigma, const at::Tensor& gamma, bool zero_centered_gamma,
              const at::Tensor& dx, const at::Tensor& dgamma, const at::Tensor* dbeta,
              const at::Tensor* dresidual) {
  check_norm_input(op, x, gamma);
  check_like(op, "dy", dy, x, x.sizes());
  if (mu != nullptr) check_row_stats(op, "mu", *mu, x);
  check_row_stats(op, "rsigma", rsigma, x);
  check_like(op, "dx", dx, x, x.sizes());
  check_like(op, "dgamma", dgamma, x, {x.size(1)});
  if (dbeta != nullptr) check_like(op, "dbeta", *dbeta, x, {x.size(1)});
  if (dresidual != nullptr) check_like(op, "dresidual", *dresidual, x, x.sizes());
  NormBwdParams p{};
  p.dy = dy.data_ptr();
  p.x = x.data_ptr();
  p.mu = mu != nullptr ? mu->data_ptr<float>() : nullptr;
  p.rsigma = rsigma.data_ptr<float>();
  p.gamma = gamma.data_ptr();
  p.dresidual = ptr(dresidual);
  p.dx = dx.data_ptr();
  p.dgamma = dgamma.data_ptr();
  p.dbeta = ptr(dbeta);
  p.dtype = to_dtype(x.scalar_type());
  p.rms = mu == nullptr;
  p.zero_centered_gamma = zero_centered_gamma;
  p.rows = x.size(0);
  p.hidden = x.size(1);
  p.batched = switch_on("NORM_BWD_BATCHED");
  p.staged = switch_on("NORM_BWD_STAGED");
  p.param_grad_in_kernel = switch_on("NORM_BWD_PARAM_IN_KERNEL");
  p.v2 = switch_on("NORM_BWD_V2");
  if (p.rows == 0) {  // sums over no rows are zero, as torch's
    dgamma.zero_();
    if (dbeta != nullptr) dbeta->zero_();
    return;
  }
  at::Tensor workspace;
  if (x.is_cuda()) {
    // Column partial sums of dgamma and dbeta, one row per block, reduced in a fixed order by a
    // second kernel (deterministic); the caching allocator makes this capturable.
    workspace = at::empty({2, kNormBwdMaxBlocks, p.hidden}, x.options().dtype(at::kFloat));
    p.workspace = workspace.data_ptr<float>();
  }
  launch(op, x, p, norm_bwd_cpu,
         [](const NormBwdParams& q, void* s) { return norm_bwd_cuda(q, s); });
}

}  // namespace

void layernorm_fp8(const at::Tensor& x, const at::Tensor& gamma, const at::Tensor& beta,
                   double eps, bool zero_centered_gamma, const at::Tensor& scale,
                   const at::Tensor& out, const c10::optional<at::Tensor>& out_t,
                   const at::Tensor& scale_inv, const at::Tensor& amax, const at::Tensor& mu,
                   const at::Tensor& rsigma, const c10::optional<at::Tensor>& out_hp,
                   const c10::optional<at::Tensor>& residual,
                   const c10::optional<at::Tensor>& residual_out,
                   const c10::optional<at::Tensor>& scaled_max) {
  norm_fwd("graphfp8.layernorm_fp8",
           {x, gamma, &beta, eps, zero_centered_gamma, scale, out, opt(out_t), scale_inv, amax,
            &mu, rsigma, opt(out_hp), opt(residual), opt(residual_out), opt(scaled_max)});
}

TORCH_LIBRARY_FRAGMENT(graphfp8, m) {
  def_op(m,
         "layernorm_fp8(Tensor x, Tensor gamma, Tensor beta, float eps, bool zero_centered_gamma, "
         "Tensor(s!) scale, Tensor(a!) out, Tensor(b!)? out_t, Tensor(c!) scale_inv, "
         "Tensor(d!) amax, Tensor(e!) mu, Tensor(f!) rsigma, Tensor(g!)? out_hp=None, "
         "Tensor? residual=None, Tensor(h!)? residual_out=None, Tensor? scaled_max=None) -> ()",
         layernorm_fp8);
}

void rmsnorm_fp8(const at::Tensor& x, const at::Tensor& gamma, double eps,
                 bool zero_centered_gamma, const at::Tensor& scale, const at::Tensor& out,
                 const c10::optional<at::Tensor>& out_t, const at::Tensor& scale_inv,
                 const at::Tensor& amax, const at::Tensor& rsigma,
                 const c10::optional<at::Tensor>& out_hp,
                 const c10::optional<at::Tensor>& residual,
                 const c10::optional<at::Tensor>& residual_out,
                 const c10::optional<at::Tensor>& scaled_max) {
  norm_fwd("graphfp8.rmsnorm_fp8",
           {x, gamma, nullptr, eps, zero_centered_gamma, scale, out, opt(out_t), scale_inv, amax,
            nullptr, rsigma, opt(out_hp), opt(residual), opt(residual_out), opt(scaled_max)});
}

TORCH_LIBRARY_FRAGMENT(graphfp8, m) {
  def_op(m,
         "rmsnorm_fp8(Tensor x, Tensor gamma, float eps, bool zero_centered_gamma, "
         "Tensor(s!) scale, Tensor(a!) out, Tensor(b!)? out_t, Tensor(c!) scale_inv, "
         "Tensor(d!) amax, Tensor(e!) rsigma, Tensor(f!)? out_hp=None, Tensor? residual=None, "
         "Tensor(g!)? residual_out=None, Tensor? scaled_max=None) -> ()",
         rmsnorm_fp8);
}

void layernorm_amax(const at::Tensor& x, const at::Tensor& gamma, const at::Tensor& beta,
                    double eps, bool zero_centered_gamma, const at::Tensor& amax,
                    const c10::optional<at::Tensor>& residual) {
  norm_amax("graphfp8.layernorm_amax", x, gamma, &beta, eps, zero_centered_gamma, amax,
            opt(residual));
}

TORCH_LIBRARY_FRAGMENT(graphfp8, m) {
  def_op(m,
         "layernorm_amax(Tensor x, Tensor gamma, Tensor beta, float eps, "
         "bool zero_centered_gamma, Tensor(a!) amax, Tensor? residual=None) -> ()",
         layernorm_amax);
}

void rmsnorm_amax(const at::Tensor& x, const at::Tensor& gamma, double eps,
                  bool zero_centered_gamma, const at::Tensor& amax,
                  const c10::optional<at::Tensor>& residual) {
  norm_amax("graphfp8.rmsnorm_amax", x, gamma, nullptr, eps, zero_centered_gamma, amax,
            opt(residual));
}

TORCH_LIBRARY_FRAGMENT(graphfp8, m) {
  def_op(m,
         "rmsnorm_amax(Tensor x, Tensor gamma, float eps, bool zero_centered_gamma, "
         "Tensor(a!) amax, Tensor? residual=None) -> ()",
         rmsnorm_amax);
}

// LayerNorm (beta given) or RMSNorm with the output in 1x128 tiles (csrc/blockwise_norm.h).
void blockwise_norm(const at::Tensor& x, const at::Tensor& gamma,
                    const c10::optional<at::Tensor>& beta, double eps, bool zero_centered_gamma,
                    const at::Tensor& out, const at::Tensor& scale_inv,
                    const c10::optional<at::Tensor>& out_t,
                    const c10::optional<at::Tensor>& scale_inv_t,
                    const c10::optional<at::Tensor>& mu, const at::Tensor& rsigma,
                    const c10::optional<at::Tensor>& residual,
                    const c10::optional<at::Tensor>& residual_out, bool power_2_scale) {
  const char* op = "graphfp8.blockwise_norm";
  check_norm_input(op, x, gamma);
  const int64_t rows = x.size(0), hidden = x.size(1);
  if (beta.has_value()) check_like(op, "beta", *beta, x, {hidden});
  TORCH_CHECK(beta.has_value() == mu.has_value(), op,
              ": give 'mu' with 'beta' (LayerNorm), neither for RMSNorm");
  TORCH_CHECK(std::isfinite(eps) && eps >= 0.0, op, ": eps must be finite and >= 0");
  if (mu.has_value()) check_row_stats(op, "mu", *mu, x);
  check_row_stats(op, "rsigma", rsigma, x);
  TORCH_CHECK(residual.has_value() == residual_out.has_value(), op,
              ": arguments 'residual' and 'residual_out' go together");
  if (residual.has_value()) {
    check_like(op, "residual", *residual, x, x.sizes());
    check_like(op, "residual_out", *residual_out, x, x.sizes());
  }
  BlockNormParams p{};
  p.dst = check_block_out(op, x, rows, hidden, 1, out, scale_inv, out_t, scale_inv_t,
                          power_2_scale);
  p.x = x.data_ptr();
  p.residual = ptr(opt(residual));
  p.residual_out = ptr(opt(residual_out));
  p.gamma = gamma.data_ptr();
  p.beta = ptr(opt(beta));
  p.dtype = to_dtype(x.scalar_type());
  p.mu = mu.has_value() ? mu->data_ptr<float>() : nullptr;
  p.rsigma = rsigma.data_ptr<float>();
  p.eps = static_cast<float>(eps);
  p.zero_centered_gamma = zero_centered_gamma;
  p.rows = rows;
  p.hidden = hidden;
  if (x.numel() == 0) return;
  at::Tensor workspace;  // CUDA: the stats-only norm pass's scale slots (csrc/blockwise_norm.h)
  if (!x.is_cpu()) {
    workspace = at::empty({3}, x.options().dtype(at::kFloat));
    p.workspace = workspace.data_ptr<float>();
  }
  launch(op, x, p, block_norm_cpu,
         [](const BlockNormParams& q, void* s) { return block_norm_cuda(q, s); });
}

TORCH_LIBRARY_FRAGMENT(graphfp8, m) {
  def_op(m,
         "blockwise_norm(Tensor x, Tensor gamma, Tensor? beta, float eps, "
         "bool zero_centered_gamma, Tensor(a!) out, Tensor(b!) scale_inv, Tensor(c!)? out_t, "
         "Tensor(d!)? scale_inv_t, Tensor(e!)? mu, Tensor(f!) rsigma, Tensor? residual=None, "
         "Tensor(g!)? residual_out=None, bool power_2_scale=True) -> ()",
         blockwise_norm);
}

void layernorm_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mu,
                   const at::Tensor& rsigma, const at::Tensor& gamma, bool zero_centered_gamma,
                   const at::Tensor& dx, const at::Tensor& dgamma, const at::Tensor& dbeta,
                   const c10::optional<at::Tensor>& dresidual) {
  norm_bwd("graphfp8.layernorm_bwd", dy, x, &mu, rsigma, gamma, zero_centered_gamma, dx, dgamma,
           &dbeta, opt(dresidual));
}

TORCH_LIBRARY_FRAGMENT(graphfp8, m) {
  def_op(m,
         "layernorm_bwd(Tensor dy, Tensor x, Tensor mu, Tensor rsigma, Tensor gamma, "
         "bool zero_centered_gamma, Tensor(a!) dx, Tensor(b!) dgamma, Tensor(c!) dbeta, "
         "Tensor? dresidual=None) -> ()",
         layernorm_bwd);
}

void rmsnorm_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& rsigma,
                 const at::Tensor& gamma, bool zero_centered_gamma, const at::Tensor& dx,
                 const at::Tensor& dgamma, const c10::optional<at::Tensor>& dresidual) {
  norm_bwd("graphfp8.rmsnorm_bwd", dy, x, nullptr, rsigma, gamma, zero_centered_gamma, dx,
           dgamma, nullptr, opt(dresidual));
}

TORCH_LIBRARY_FRAGMENT(graphfp8, m) {
  def_op(m,
         "rmsnorm_bwd(Tensor dy, Tensor x, Tensor rsigma, Tensor gamma, bool zero_centered_gamma, "
         "Tensor(a!) dx, Tensor(b!) dgamma, Tensor? dresidual=None) -> ()",
         rmsnorm_bwd);
}

}  // namespace graphfp8
