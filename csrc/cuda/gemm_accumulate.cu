// CUDA: out (m, n) = alpha * (a * a_scale_inv) @ (b * b_scale_inv) + beta * out as one cuBLASLt
// FP8 GEMM with C = D = out (gemm_accumulate.h): the weight-gradient GEMM accumulates into the
// fp32 main gradient or the parameter's bf16 .grad with no separate add pass (docs/fp8.md,
// "Weight-gradient accumulation").
//
// cuBLASLt is column-major: the row-major out (m, n) is the column-major D (n, m) = b^T a^T.
// b_t (n, k) row-major is the column-major (k, n) matrix A, transposed (op T); a (m, k)
// row-major is the column-major (k, m) matrix B (op N): the TN layout that FP8 GEMMs need.
// The scales are device pointers (A's is b_scale_inv, B's a_scale_inv), read by the GEMM, so a
// graph replays it with the scales of each step; with alpha_beta so are alpha and beta
// (CUBLASLT_POINTER_MODE_DEVICE): a graph's device flag picks beta = 0 (the first microbatch
// writes the product, C unread) or beta = 1 at each replay. No fast accumulation (the
// backward's GEMMs accumulate exactly, as graphfp8.ops.fp8_gemm's wgrad does).
#include "../gemm_accumulate.h"

#ifdef GRAPHFP8_NO_CUBLASLT
namespace graphfp8 {
// Built without cuBLASLt (setup.py found neither the toolkit's nor the pip wheel's).
Status fp8_gemm_accumulate_cuda(const GemmAccumulateParams&, void*) {
  return Status{"fp8_gemm_accumulate",
                "graphfp8 was built without cuBLASLt: install the CUDA toolkit's cuBLAS or "
                "nvidia-cublas and rebuild, or leave fuse_wgrad_accumulation off"};
}
}  // namespace graphfp8
#else
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>

namespace graphfp8 {
namespace {

constexpr int kMaxDevices = 64;

// One cuBLASLt handle per device, made on first use (outside a capture: graphs warm up first).
cublasLtHandle_t handle_for(int device, cublasStatus_t* status) {
  static cublasLtHandle_t handles[kMaxDevices] = {};
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  *status = CUBLAS_STATUS_SUCCESS;
  if (handles[device] == nullptr) *status = cublasLtCreate(&handles[device]);
  return handles[device];
}

cudaDataType_t fp8_type(DType t) { return t == DType::kE4M3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2; }

// C's and D's type (csrc/ops/ admits these three only).
cudaDataType_t out_type(DType t) {
  return t == DType::kBFloat16 ? CUDA_R_16BF : t == DType::kFloat16 ? CUDA_R_16F : CUDA_R_32F;
}

// The descriptors of one call, destroyed with it.
struct Descs {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~Descs() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

// The largest power of two up to 256 that divides the address: the heuristic's default
// assumption is 256-byte aligned matrices, a .grad view or a main_grad slice may be less.
uint32_t alignment_of(const void* p) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  uint32_t align = 256;
  while (address % align != 0) align /= 2;
  return align;
}

Status failed(const char* where, cublasStatus_t s) { return Status{where, cublasLtGetStatusString(s)}; }

}  // namespace

Status fp8_gemm_accumulate_cuda(const GemmAccumulateParams& p, void* stream) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return Status{"fp8_gemm_accumulate (cudaGetDevice)", cudaGetErrorString(err)};
  if (device >= kMaxDevices) return Status{"fp8_gemm_accumulate", "device index past 64"};
  cublasStatus_t s;
  cublasLtHandle_t handle = handle_for(device, &s);
  if (s != CUBLAS_STATUS_SUCCESS) return failed("cublasLtCreate", s);

  Descs desc;
  s = cublasLtMatmulDescCreate(&desc.op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  if (s != CUBLAS_STATUS_SUCCESS) return failed("cublasLtMatmulDescCreate", s);
  const cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
  const int8_t fast_accum = 0;
  // Device alpha and beta (graphs), or the host constants 1 and 1.
  const int32_t pointer_mode = p.alpha_beta ? CUBLASLT_POINTER_MODE_DEVICE : CUBLASLT_POINTER_MODE_HOST;
  const void* a_scale = p.b_scale_inv;  // cuBLASLt's A is b_t
  const void* b_scale = p.a_scale_inv;  // cuBLASLt's B is a
  const struct {
    cublasLtMatmulDescAttributes_t attr;
    const void* value;
    size_t size;
  } attrs[] = {
      {CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof(op_t)},
      {CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof(op_n)},
      {CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast_accum, sizeof(fast_accum)},
      {CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scale, sizeof(a_scale)},
      {CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scale, sizeof(b_scale)},
      {CUBLASLT_MATMUL_DESC_POINTER_MODE, &pointer_mode, sizeof(pointer_mode)},
  };
  for (const auto& a : attrs) {
    s = cublasLtMatmulDescSetAttribute(desc.op, a.attr, a.value, a.size);
    if (s != CUBLAS_STATUS_SUCCESS) return failed("cublasLtMatmulDescSetAttribute", s);
  }
  const uint64_t m = p.m, n = p.n, k = p.k;
  s = cublasLtMatrixLayoutCreate(&desc.a, fp8_type(p.b_dtype), k, n, k);
  if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatrixLayoutCreate(&desc.b, fp8_type(p.a_dtype), k, m, k);
  if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatrixLayoutCreate(&desc.d, out_type(p.out_dtype), n, m, n);
  if (s != CUBLAS_STATUS_SUCCESS) return failed("cublasLtMatrixLayoutCreate", s);

  s = cublasLtMatmulPreferenceCreate(&desc.pref);
  if (s != CUBLAS_STATUS_SUCCESS) return failed("cublasLtMatmulPreferenceCreate", s);
  const uint64_t ws = static_cast<uint64_t>(p.workspace_bytes);
  s = cublasLtMatmulPreferenceSetAttribute(desc.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                           &ws, sizeof(ws));
  if (s != CUBLAS_STATUS_SUCCESS) return failed("cublasLtMatmulPreferenceSetAttribute", s);
  const uint32_t align_a = alignment_of(p.b_t), align_b = alignment_of(p.a),
                 align_out = alignment_of(p.out);
  const struct {
    cublasLtMatmulPreferenceAttributes_t attr;
    const uint32_t* value;
  } aligns[] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_out},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_out},
  };
  for (const auto& a : aligns) {
    s = cublasLtMatmulPreferenceSetAttribute(desc.pref, a.attr, a.value, sizeof(uint32_t));
    if (s != CUBLAS_STATUS_SUCCESS) return failed("cublasLtMatmulPreferenceSetAttribute", s);
  }
  cublasLtMatmulHeuristicResult_t heuristic = {};
  int found = 0;
  // C = D: one layout for both (beta = 1 reads out, the GEMM writes it).
  s = cublasLtMatmulAlgoGetHeuristic(handle, desc.op, desc.a, desc.b, desc.d, desc.d, desc.pref, 1,
                                     &heuristic, &found);
  if (s != CUBLAS_STATUS_SUCCESS) return failed("cublasLtMatmulAlgoGetHeuristic", s);
  if (found == 0) {
    return Status{"cublasLtMatmulAlgoGetHeuristic",
                  p.alpha_beta ? "no algorithm for this FP8 GEMM with device alpha and beta "
                                 "(unset GRAPHFP8_WGRAD_INTO_GRAD)"
                               : "no algorithm for this FP8 GEMM"};
  }

  const float one = 1.0f;
  const void* alpha = p.alpha_beta ? static_cast<const void*>(p.alpha_beta) : &one;
  const void* beta = p.alpha_beta ? static_cast<const void*>(p.alpha_beta + 1) : &one;
  s = cublasLtMatmul(handle, desc.op, alpha, p.b_t, desc.a, p.a, desc.b, beta, p.out, desc.d,
                     p.out, desc.d, &heuristic.algo, p.workspace, p.workspace_bytes,
                     static_cast<cudaStream_t>(stream));
  if (s != CUBLAS_STATUS_SUCCESS) return failed("cublasLtMatmul", s);
  return Status{};
}

}  // namespace graphfp8
#endif  // GRAPHFP8_NO_CUBLASLT
