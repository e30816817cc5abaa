// Plain parameter structs and launcher declarations shared by the CPU and CUDA kernels.
//
// No torch headers here: csrc/ops/ checks the tensors, fills these structs with raw pointers and
// sizes, and calls a launcher. Scale convention everywhere: x_fp8 = saturate(x * scale),
// x ~= x_fp8 * scale_inv, scale_inv = 1 / scale.
#pragma once

#include <cstdint>

namespace graphfp8 {

enum class DType : int { kFloat32, kBFloat16, kFloat16, kE4M3, kE5M2 };

// What a launcher returns: success, or which kernel (or dispatch) failed and why. The kernels'
// files never throw: csrc/ops/ validates every argument before it calls a launcher, and turns a
// failed Status (an internal invariant or a CUDA launch error) into a Python exception.
struct Status {
  const char* where = nullptr;   // the failing kernel or dispatch; nullptr on success
  const char* reason = nullptr;  // a static string (cudaGetErrorString's, or a literal)
  bool ok() const { return where == nullptr; }
};

// Largest finite value of each FP8 format.
constexpr float kE4M3Max = 448.0f;
constexpr float kE5M2Max = 57344.0f;

// Current scaling computed on the device by the cast itself (docs/fp8.md, "Current scaling"):
// with a = *amax (the slot's H[0], which an amax pass filled), the cast first runs the one-slot
// update of scale_math.h, writes the new scale to *scale, resets *amax to 0, and casts with the
// new scale; its own amax is folded nowhere. Off (all nullptr): the cast reads its scale as is.
struct CurrentScale {
  float* scale = nullptr;             // (1,) the slot's scale: read, then rewritten
  float* amax = nullptr;              // (1,) the slot's H[0]: read, then reset to 0
  const float* scaled_max = nullptr;  // (1,) fp8_max * 2^-margin
  bool on() const { return scaled_max != nullptr; }
};

// Cast of a (rows, cols) row-major tensor to FP8, optionally also writing its transpose.
struct CastParams {
  const void* x;         // (rows, cols), x_dtype
  DType x_dtype;
  void* out;             // (rows, cols), out_dtype (FP8)
  void* out_t;           // (cols, rows), out_dtype, or nullptr for a plain cast
  DType out_dtype;
  const float* scale;    // (1,)
  float* scale_inv;      // (1,): receives 1 / scale
  float* amax;           // (1,): receives max(amax, max |x|), NaN ignored
  const float* noop;     // (1,) or nullptr: when *noop == 1 nothing is written
  int64_t rows;
  int64_t cols;
  CurrentScale current;  // on: scale == current.scale, amax == nullptr (nothing folded)
  bool paired_quantize;  // CUDA tile kernels: the kernel switch PAIRED_QUANTIZE (same bytes)
};

// Transpose of an FP8 (rows, cols) row-major tensor into (cols, rows).
struct TransposeParams {
  const uint8_t* x;
  uint8_t* out_t;
  const float* noop;     // (1,) or nullptr
  int64_t rows;
  int64_t cols;
};

// Delayed-scaling update of many slots at once. amax_history is (history_len, num_slots) row-major:
// row 0 holds the amaxes that this step's casts wrote.
struct ScaleUpdateParams {
  float* amax_history;      // (history_len, num_slots)
  float* scale;             // (num_slots,)
  const float* scaled_max;  // (num_slots,): fp8_max * 2^-margin of each slot
  int64_t history_len;
  int64_t num_slots;
  bool most_recent;         // amax_compute_algo: "most_recent" if true, else "max"
};

// out = x_fp8 * scale_inv, rounded to out_dtype.
struct DequantizeParams {
  const uint8_t* x;
  DType x_dtype;
  void* out;
  DType out_dtype;
  const float* scale_inv;  // (1,)
  int64_t numel;
};

// The elementwise function f that a fused cast-transpose applies before casting.
//   kNone:  f = x                              (the grad-output cast with dbias)
//   kGelu:  f = gelu_tanh(x)                   (the activation's forward)
//   kDgelu: f = x * gelu_tanh'(act_in)         (x is dy, act_in the saved GELU input)
// f is computed in fp32 and rounded to x's dtype before it is scaled, folded into amax or summed,
// so the result equals torch's gelu / gelu_backward followed by the plain cast-transpose.
enum class FusedAct : int { kNone, kGelu, kDgelu };

// max |f(x)| of a tensor folded into *amax (NaN ignored), nothing written but the amax: the
// amax pass of current scaling (f: FusedAct above; kDgelu reads dy = x and act_in).
struct AmaxParams {
  const void* x;         // (numel,), dtype
  const void* act_in;    // (numel,), dtype: the GELU input (kDgelu only), else nullptr
  DType dtype;
  float* amax;           // (1,)
  const float* noop;     // (1,) or nullptr: when *noop == 1 nothing is read or written
  int64_t numel;
  FusedAct act;
};

// Rows of x covered by one row of the CUDA dbias workspace: every tile height (128 or 64) is a
// multiple of it, so ceil(rows / kDbiasPartialRows) workspace rows are always enough.
constexpr int64_t kDbiasPartialRows = 64;

// Cast-transpose of f(x) (both layouts, fused amax and scale_inv), optionally with
// dbias = sum over rows of f(x), accumulated in fp32 and rounded to x's dtype.
// The plain case (kNone, no dbias) is cast_transpose itself and may carry a noop flag.
struct FusedCastTransposeParams {
  CastParams cast;      // x, out, out_t (required), scale, scale_inv, amax, noop (plain case)
  FusedAct act;
  const void* act_in;   // (rows, cols), cast.x_dtype: the GELU input (kDgelu only), else nullptr
  void* dbias;          // (cols,), cast.x_dtype, or nullptr
  float* workspace;     // CUDA with dbias: (ceil(rows / kDbiasPartialRows), cols) fp32 scratch
  bool dbias_in_kernel;  // CUDA: the kernel switch DBIAS_IN_KERNEL (the same sums, one launch)
};

// Rotary position embedding of the q and k parts of a fused QKV tensor; the v part is copied. A
// token's row holds heads q heads, then kv_heads k heads and kv_heads v heads (grouped-query
// attention when kv_heads < heads; kv_heads == heads is the (3, heads, head_dim) layout).
// For head_dim index i < half = head_dim / 2, with c = cos[s], n = sin[s]:
//   forward   out[i] = x[i] c[i] - x[i+half] n[i],    out[i+half] = x[i+half] c[i+half] + x[i] n[i+half]
//   inverse   (the backward: the transposed rotation applied to a gradient)
//             out[i] = x[i] c[i] + x[i+half] n[i+half], out[i+half] = x[i+half] c[i+half] - x[i] n[i]
// in fp32, every product and sum rounded on its own (no fused multiply-add), then rounded to the
// dtype, so CPU, CUDA and the PyTorch twin agree bit for bit.
struct RopeParams {
  const void* x;       // (batch, seq, heads + 2 * kv_heads, head_dim), dtype, contiguous
  void* out;           // same shape and dtype
  DType dtype;         // float32, bfloat16 or float16
  const float* cos;    // (>= seq, head_dim) float32, row-major
  const float* sin;    // (>= seq, head_dim) float32, row-major
  int64_t batch;
  int64_t seq;
  int64_t heads;
  int64_t kv_heads;    // 1 <= kv_heads <= heads
  int64_t head_dim;    // even
  bool inverse;
};

// LayerNorm / RMSNorm of the rows of z with an FP8 output. z = x, or z = round(x + residual) to
// the dtype (written to residual_out) when a residual is given. With g = gamma (+ 1 when
// zero_centered_gamma), per row:
//   LayerNorm  mu = mean(z), rsigma = 1 / sqrt(mean((z - mu)^2) + eps), y = ((z - mu) rsigma) g + b
//   RMSNorm    rsigma = 1 / sqrt(mean(z^2) + eps),                       y = (z rsigma) g
// out = saturate(y * scale) (and out_t = out^T when given), amax = max(amax, max |y|) (NaN
// ignored), scale_inv = 1 / scale, out_hp = y rounded to the dtype when given. y is quantized in
// fp32, never rounded to the dtype first. The CPU kernel takes every mean as a sequential float64
// sum rounded to fp32 (graphfp8/reference.py's order); the CUDA kernel sums in fp32 trees, so
// its mu and rsigma may differ from the CPU's in the last bits.
struct NormParams {
  const void* x;             // (rows, hidden), dtype
  const void* residual;      // (rows, hidden), dtype, or nullptr
  void* residual_out;        // (rows, hidden), dtype: z, when residual is given
  const void* gamma;         // (hidden,), dtype
  const void* beta;          // (hidden,), dtype (LayerNorm), nullptr for RMSNorm
  DType dtype;               // float32, bfloat16 or float16
  void* out;                 // (rows, hidden), out_dtype (FP8)
  void* out_t;               // (hidden, rows), out_dtype, or nullptr
  DType out_dtype;
  void* out_hp;              // (rows, hidden), dtype, or nullptr
  const float* scale;        // (1,)
  float* scale_inv;          // (1,)
  float* amax;               // (1,)
  float* mu;                 // (rows,) fp32 (LayerNorm), nullptr for RMSNorm
  float* rsigma;             // (rows,) fp32
  float eps;
  bool rms;
  bool zero_centered_gamma;
  int64_t rows;
  int64_t hidden;
  CurrentScale current;      // on: scale == current.scale, amax == nullptr (nothing folded)
  // The norm's amax pass (current scaling): only amax = max(amax, max |y|) is written; out,
  // out_t, out_hp, residual_out, mu, rsigma, scale_inv are nullptr and untouched.
  bool amax_only;  // CUDA (switch NORM_FWD_TRANSPOSE): out_t written by the norm kernel from a band of rows
  // staged in shared memory instead of a second pass over out (the same bytes).
  bool transpose_in_kernel;
};

// The norm backward, given dy = dL/dy: with xhat = (x - mu) rsigma (RMSNorm: x rsigma) and
// dyg = dy g, per row
//   LayerNorm  dx = ((dyg - mean(dyg)) - xhat mean(dyg xhat)) rsigma
//   RMSNorm    dx = (dyg - xhat mean(dyg xhat)) rsigma
// plus dresidual when given (the gradient that reaches z by its other path, for a residual add
// folded into the norm), rounded to the dtype; dgamma = sum_rows dy xhat, dbeta = sum_rows dy,
// rounded to the dtype. No atomics: CUDA sums each block's rows into one workspace row per block
// (a grid independent of the GPU: kNormBwdMaxBlocks at most), then each column over those rows
// in order, so results are the same run to run.
struct NormBwdParams {
  const void* dy;            // (rows, hidden), dtype
  const void* x;             // (rows, hidden), dtype: the norm's input z
  const float* mu;           // (rows,) (LayerNorm), nullptr for RMSNorm
  const float* rsigma;       // (rows,)
  const void* gamma;         // (hidden,), dtype
  const void* dresidual;     // (rows, hidden), dtype, or nullptr
  void* dx;                  // (rows, hidden), dtype
  void* dgamma;              // (hidden,), dtype
  void* dbeta;               // (hidden,), dtype (LayerNorm), nullptr for RMSNorm
  float* workspace;          // CUDA: (2, kNormBwdMaxBlocks, hidden) fp32 scratch
  DType dtype;
  bool rms;
  bool zero_centered_gamma;
  int64_t rows;
  int64_t hidden;
  bool batched;              // CUDA: cuda/norm_bwd_batched.cu (kernel switch NORM_BWD_BATCHED)
  bool staged;               // CUDA, batched: rows staged by cp.async (NORM_BWD_STAGED)
  bool param_grad_in_kernel;  // CUDA, staged: dgamma, dbeta summed in it (NORM_BWD_PARAM_IN_KERNEL)
  bool v2;                   // CUDA: cuda/norm_bwd_v2.cu where it applies (NORM_BWD_V2)
};

constexpr int64_t kNormBwdMaxBlocks = 256;
// Largest hidden size of the CUDA norm kernels: a row is spread over at most 1024 threads that
// keep their part of it in registers (cuda/norm.cuh).
constexpr int64_t kNormMaxHiddenCuda = 8192;

// Launchers assume validated parameters (csrc/ops/ checks) and a non-empty input.
Status cast_cpu(const CastParams& p);
Status amax_cpu(const AmaxParams& p);
Status cast_transpose_fused_cpu(const FusedCastTransposeParams& p);
Status transpose_cpu(const TransposeParams& p);
Status scale_update_cpu(const ScaleUpdateParams& p);
Status dequantize_cpu(const DequantizeParams& p);
Status rope_cpu(const RopeParams& p);
Status norm_fwd_cpu(const NormParams& p);
Status norm_bwd_cpu(const NormBwdParams& p);

// CUDA launchers take the stream as an opaque cudaStream_t.
Status cast_cuda(const CastParams& p, void* stream);
Status amax_cuda(const AmaxParams& p, void* stream);
Status cast_transpose_cuda(const CastParams& p, void* stream);  // cast_cuda with p.out_t set
Status transpose_cuda(const TransposeParams& p, void* stream);
Status scale_update_cuda(const ScaleUpdateParams& p, void* stream);
Status dequantize_cuda(const DequantizeParams& p, void* stream);
Status rope_cuda(const RopeParams& p, void* stream);
Status cast_transpose_fused_cuda(const FusedCastTransposeParams& p, void* stream);
Status norm_fwd_cuda(const NormParams& p, void* stream);
Status norm_bwd_cuda(const NormBwdParams& p, void* stream);
Status norm_bwd_batched_cuda(const NormBwdParams& p, void* stream);  // the same sums, bit for bit

}  // namespace graphfp8
