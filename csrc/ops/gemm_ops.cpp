// Checks and launch of the FP8 GEMM that accumulates into its output in place
// (csrc/gemm_accumulate.h): the weight-gradient GEMM of fuse_wgrad_accumulation (fp32 out,
// beta = 1) and of WGRAD_INTO_GRAD (out of any high-precision dtype, alpha and beta read from
// device memory).
#include "../gemm_accumulate.h"
#include "ops.h"

namespace graphfp8 {
namespace {

void check_fp8_operand(const char* op, const char* name, const at::Tensor& t, const at::Tensor& ref) {
  check_common(op, name, t, ref);
  TORCH_CHECK_TYPE(is_fp8(t.scalar_type()), op, ": argument '", name,
                   "' must be float8_e4m3fn or float8_e5m2, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 2, op, ": argument '", name, "' must be 2-D, got ", fmt(t.dim()),
                    "-D");
}

// cuBLASLt's FP8 GEMMs need every matrix and scale pointer 16-byte aligned.
void check_aligned(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, op, ": argument '", name,
                    "' must start at a 16-byte aligned address (cuBLASLt FP8 GEMMs need it)");
}

// Checks every argument (before anything is written), then runs the GEMM; alpha_beta nullptr:
// out float32 and alpha = beta = 1.
void gemm_into(const char* op, const at::Tensor& a, const at::Tensor& a_scale_inv,
               const at::Tensor& b_t, const at::Tensor& b_scale_inv, const at::Tensor& out,
               const at::Tensor* alpha_beta) {
  check_fp8_operand(op, "a", a, a);
  check_fp8_operand(op, "b_t", b_t, a);
  TORCH_CHECK_TYPE(!(a.scalar_type() == at::kFloat8_e5m2 && b_t.scalar_type() == at::kFloat8_e5m2),
                   op, ": E5M2 x E5M2 is not supported by cuBLASLt");
  const int64_t m = a.size(0), k = a.size(1), n = b_t.size(0);
  TORCH_CHECK_VALUE(b_t.size(1) == k, op, ": 'a' ", fmt(a.sizes()), " and 'b_t' ", fmt(b_t.sizes()),
                    " must have the same inner dim k");
  TORCH_CHECK_VALUE(k % 16 == 0 && n % 16 == 0, op,
                    ": FP8 GEMMs need the inner dim k and the output dim n to be multiples of 16, "
                    "got k=", fmt(k), ", n=", fmt(n));
  check_scalar_f32(op, "a_scale_inv", a_scale_inv, a);
  check_scalar_f32(op, "b_scale_inv", b_scale_inv, a);
  check_common(op, "out", out, a);
  if (alpha_beta == nullptr) {
    TORCH_CHECK_TYPE(out.scalar_type() == at::kFloat, op, ": argument 'out' must be float32, got ",
                     out.scalar_type());
  } else {
    TORCH_CHECK_TYPE(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16 ||
                         out.scalar_type() == at::kHalf,
                     op, ": argument 'out' must be float32, bfloat16 or float16, got ",
                     out.scalar_type());
    check_common(op, "alpha_beta", *alpha_beta, a);
    TORCH_CHECK_TYPE(alpha_beta->scalar_type() == at::kFloat, op,
                     ": argument 'alpha_beta' must be float32, got ", alpha_beta->scalar_type());
    TORCH_CHECK_VALUE(alpha_beta->numel() == 2, op,
                      ": argument 'alpha_beta' must hold two elements (alpha, beta), got ",
                      fmt(alpha_beta->numel()));
  }
  TORCH_CHECK_VALUE(out.sizes() == at::IntArrayRef({m, n}), op, ": argument 'out' must have shape ",
                    fmt({m, n}), ", got ", fmt(out.sizes()));
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"a", &a}, {"b_t", &b_t},
                         {"a_scale_inv", &a_scale_inv}, {"b_scale_inv", &b_scale_inv},
                         {"out", &out}}) {
    check_aligned(op, name, *t);
  }
  GemmAccumulateParams p{};
  p.a = static_cast<const uint8_t*>(a.data_ptr());
  p.a_dtype = to_dtype(a.scalar_type());
  p.b_t = static_cast<const uint8_t*>(b_t.data_ptr());
  p.b_dtype = to_dtype(b_t.scalar_type());
  p.a_scale_inv = a_scale_inv.data_ptr<float>();
  p.b_scale_inv = b_scale_inv.data_ptr<float>();
  p.out = out.data_ptr();
  p.out_dtype = to_dtype(out.scalar_type());
  p.alpha_beta = alpha_beta ? alpha_beta->data_ptr<float>() : nullptr;
  p.m = m;
  p.n = n;
  p.k = k;
  if (m == 0 || n == 0) return;
  if (k == 0) {  // alpha * 0 + beta * out, as cuBLASLt would give
    TORCH_CHECK_VALUE(alpha_beta == nullptr, op, ": k = 0 is not supported with 'alpha_beta'");
    return;  // out += 0
  }
  at::Tensor workspace;
  if (!a.is_cpu()) {
    // From torch's caching allocator on the call's stream (a graph's pool inside a capture).
    workspace = at::empty({kGemmWorkspaceBytes}, a.options().dtype(at::kByte));
    p.workspace = workspace.data_ptr();
    p.workspace_bytes = kGemmWorkspaceBytes;
  }
  launch(op, a, p, fp8_gemm_accumulate_cpu,
         [](const GemmAccumulateParams& q, void* s) { return fp8_gemm_accumulate_cuda(q, s); });
}

}  // namespace

void fp8_gemm_accumulate(const at::Tensor& a, const at::Tensor& a_scale_inv, const at::Tensor& b_t,
                         const at::Tensor& b_scale_inv, const at::Tensor& out) {
  gemm_into("graphfp8.fp8_gemm_accumulate", a, a_scale_inv, b_t, b_scale_inv, out, nullptr);
}

void fp8_gemm_into(const at::Tensor& a, const at::Tensor& a_scale_inv, const at::Tensor& b_t,
                   const at::Tensor& b_scale_inv, const at::Tensor& out,
                   const at::Tensor& alpha_beta) {
  gemm_into("graphfp8.fp8_gemm_into", a, a_scale_inv, b_t, b_scale_inv, out, &alpha_beta);
}

TORCH_LIBRARY_FRAGMENT(graphfp8, m) {
  def_op(m,
         "fp8_gemm_accumulate(Tensor a, Tensor a_scale_inv, Tensor b_t, Tensor b_scale_inv, "
         "Tensor(a!) out) -> ()",
         fp8_gemm_accumulate);
  def_op(m,
         "fp8_gemm_into(Tensor a, Tensor a_scale_inv, Tensor b_t, Tensor b_scale_inv, "
         "Tensor(a!) out, Tensor alpha_beta) -> ()",
         fp8_gemm_into);
}

}  // namespace graphfp8
