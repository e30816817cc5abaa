// Plain parameter structs and launcher declarations shared by the CPU and CUDA kernels.
//
// No torch headers here: ops.cpp checks the tensors, fills these structs with raw pointers and
// sizes, and calls a launcher. Scale convention everywhere: x_fp8 = saturate(x * scale),
// x ~= x_fp8 * scale_inv, scale_inv = 1 / scale.
#pragma once

#include <cstdint>

namespace graphfp8 {

enum class DType : int { kFloat32, kBFloat16, kFloat16, kE4M3, kE5M2 };

// What a launcher returns: success, or which kernel (or dispatch) failed and why. The kernels'
// files never throw: ops.cpp validates every argument before it calls a launcher, and turns a
// failed Status (an internal invariant or a CUDA launch error) into a Python exception.
struct Status {
  const char* where = nullptr;   // the failing kernel or dispatch; nullptr on success
  const char* reason = nullptr;  // a static string (cudaGetErrorString's, or a literal)
  bool ok() const { return where == nullptr; }
};

// Largest finite value of each FP8 format.
constexpr float kE4M3Max = 448.0f;
constexpr float kE5M2Max = 57344.0f;

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
};

// Rotary position embedding of the q and k parts of a fused QKV tensor; the v part is copied.
// For head_dim index i < half = head_dim / 2, with c = cos[s], n = sin[s]:
//   forward   out[i] = x[i] c[i] - x[i+half] n[i],    out[i+half] = x[i+half] c[i+half] + x[i] n[i+half]
//   inverse   (the backward: the transposed rotation applied to a gradient)
//             out[i] = x[i] c[i] + x[i+half] n[i+half], out[i+half] = x[i+half] c[i+half] - x[i] n[i]
// in fp32, every product and sum rounded on its own (no fused multiply-add), then rounded to the
// dtype, so CPU, CUDA and the PyTorch twin agree bit for bit.
struct RopeParams {
  const void* x;       // (batch, seq, 3, heads, head_dim), dtype, contiguous
  void* out;           // same shape and dtype
  DType dtype;         // float32, bfloat16 or float16
  const float* cos;    // (>= seq, head_dim) float32, row-major
  const float* sin;    // (>= seq, head_dim) float32, row-major
  int64_t batch;
  int64_t seq;
  int64_t heads;
  int64_t head_dim;    // even
  bool inverse;
};

// Launchers assume validated parameters (ops.cpp's checks) and a non-empty input.
Status cast_cpu(const CastParams& p);
Status cast_transpose_fused_cpu(const FusedCastTransposeParams& p);
Status transpose_cpu(const TransposeParams& p);
Status scale_update_cpu(const ScaleUpdateParams& p);
Status dequantize_cpu(const DequantizeParams& p);
Status rope_cpu(const RopeParams& p);

// CUDA launchers take the stream as an opaque cudaStream_t.
Status cast_cuda(const CastParams& p, void* stream);
Status cast_transpose_cuda(const CastParams& p, void* stream);  // cast_cuda with p.out_t set
Status transpose_cuda(const TransposeParams& p, void* stream);
Status scale_update_cuda(const ScaleUpdateParams& p, void* stream);
Status dequantize_cuda(const DequantizeParams& p, void* stream);
Status rope_cuda(const RopeParams& p, void* stream);
Status cast_transpose_fused_cuda(const FusedCastTransposeParams& p, void* stream);

}  // namespace graphfp8
