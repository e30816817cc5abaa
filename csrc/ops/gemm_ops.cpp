// Checks and launch of the FP8 GEMM that accumulates into an fp32 output in place
// (csrc/gemm_accumulate.h): the weight-gradient GEMM of fuse_wgrad_accumulation.
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

}  // namespace

void fp8_gemm_accumulate(const at::Tensor& a, const at::Tensor& a_scale_inv, const at::Tensor& b_t,
                         const at::Tensor& b_scale_inv, const at::Tensor& out) {
  const char* op = "graphfp8.fp8_gemm_accumulate";
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
  TORCH_CHECK_TYPE(out.scalar_type() == at::kFloat, op, ": argument 'out' must be float32, got ",
                   out.scalar_type());
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
  p.out = out.data_ptr<float>();
  p.m = m;
  p.n = n;
  p.k = k;
  if (m == 0 || n == 0 || k == 0) return;  // out += 0
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

TORCH_LIBRARY_FRAGMENT(graphfp8, m) {
  def_op(m,
         "fp8_gemm_accumulate(Tensor a, Tensor a_scale_inv, Tensor b_t, Tensor b_scale_inv, "
         "Tensor(a!) out) -> ()",
         fp8_gemm_accumulate);
}

}  // namespace graphfp8
