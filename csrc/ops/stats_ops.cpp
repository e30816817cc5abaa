// Checks and launch of the FP8 cast statistics (csrc/cast_stats.h; graphfp8.numerics).
#include "../cast_stats.h"
#include "ops.h"

namespace graphfp8 {
namespace {

// An optional input of the mode: present exactly when the mode needs it, on x's device,
// contiguous, `numel` elements of dtype `dtype`.
const void* aux(const char* op, const char* name, const c10::optional<at::Tensor>& t,
                const at::Tensor& x, at::ScalarType dtype, int64_t numel, bool needed) {
  TORCH_CHECK(t.has_value() == needed, op, ": argument '", name,
              needed ? "' is required by this mode" : "' is not used by this mode");
  if (!needed) return nullptr;
  check_common(op, name, *t, x);
  TORCH_CHECK(t->scalar_type() == dtype, op, ": argument '", name, "' must be ", dtype);
  TORCH_CHECK(t->numel() == numel, op, ": argument '", name, "' must hold ", fmt(numel),
              " elements, got ", fmt(t->numel()));
  return t->data_ptr();
}

}  // namespace

void cast_stats(const at::Tensor& x, const c10::optional<at::Tensor>& act_in,
                const c10::optional<at::Tensor>& mu, const c10::optional<at::Tensor>& rsigma,
                const c10::optional<at::Tensor>& gamma, const c10::optional<at::Tensor>& beta,
                int64_t mode, bool zero_centered_gamma, const at::Tensor& scale,
                const at::Tensor& recorded_amax, bool e4m3,
                const c10::optional<at::Tensor>& enabled, const c10::optional<at::Tensor>& skip,
                const at::Tensor& out) {
  const char* op = "graphfp8.cast_stats";
  TORCH_CHECK(is_hp(x.scalar_type()), op, ": argument 'x' must be float32, bfloat16 or float16, got ",
              x.scalar_type());
  TORCH_CHECK(x.is_contiguous(), op, ": argument 'x' must be contiguous");
  TORCH_CHECK(mode >= kStatsIdentity && mode <= kStatsRmsNorm, op, ": unknown mode ", fmt(mode));
  const bool norm = mode == kStatsLayerNorm || mode == kStatsRmsNorm;
  TORCH_CHECK(!norm || x.dim() == 2, op, ": the norm modes need a 2-D 'x' (rows, hidden)");
  const int64_t cols = x.dim() == 0 ? 1 : x.size(-1);
  const int64_t rows = cols == 0 ? 0 : x.numel() / cols;
  CastStatsParams p{};
  p.x = x.data_ptr();
  p.x_dtype = to_dtype(x.scalar_type());
  const at::ScalarType hp = x.scalar_type();
  p.act_in = aux(op, "act_in", act_in, x, hp, x.numel(), mode == kStatsDgelu);
  p.mu = static_cast<const float*>(aux(op, "mu", mu, x, at::kFloat, rows, mode == kStatsLayerNorm));
  p.rsigma = static_cast<const float*>(aux(op, "rsigma", rsigma, x, at::kFloat, rows, norm));
  p.gamma = aux(op, "gamma", gamma, x, hp, cols, norm);
  p.beta = aux(op, "beta", beta, x, hp, cols, mode == kStatsLayerNorm);
  p.zero_centered_gamma = zero_centered_gamma;
  p.mode = static_cast<int>(mode);
  p.rows = rows;
  p.cols = cols;
  check_scalar_f32(op, "scale", scale, x);
  check_scalar_f32(op, "recorded_amax", recorded_amax, x);
  p.scale = scale.data_ptr<float>();
  p.recorded_amax = recorded_amax.data_ptr<float>();
  if (enabled.has_value()) check_scalar_f32(op, "enabled", *enabled, x);
  p.enabled = enabled.has_value() ? enabled->data_ptr<float>() : nullptr;
  p.skip = noop_ptr(op, skip, x);
  p.e4m3 = e4m3;
  check_common(op, "out", out, x);
  TORCH_CHECK(out.scalar_type() == at::kDouble && out.dim() == 2 && out.size(1) == kStatsColumns &&
                  out.size(0) >= 1,
              op, ": argument 'out' must be (partials, ", fmt(kStatsColumns), ") float64, got ",
              fmt(out.sizes()), " ", out.scalar_type());
  p.out = out.data_ptr<double>();
  p.partials = out.size(0);
  launch(op, x, p, cast_stats_cpu,
         [](const CastStatsParams& q, void* s) { return cast_stats_cuda(q, s); });
}

TORCH_LIBRARY_FRAGMENT(graphfp8, m) {
  def_op(m,
         "cast_stats(Tensor x, Tensor? act_in, Tensor? mu, Tensor? rsigma, Tensor? gamma, "
         "Tensor? beta, int mode, bool zero_centered_gamma, Tensor scale, Tensor recorded_amax, "
         "bool e4m3, Tensor? enabled, Tensor? skip, Tensor(a!) out) -> ()",
         cast_stats);
}

}  // namespace graphfp8
