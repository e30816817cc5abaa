// Shared pieces of the torch-aware layer (csrc/ops/): argument checks, message formatting, the
// device dispatch of a launcher, and def_op, which declares an op beside its entry point.
//
// csrc/ops/ is the only torch-aware C++ of graphfp8: tensor checks -> Params -> launcher. It is
// one folder of a few files rather than one ops.cpp because the checks of all ops together ran
// past ~400 lines: cast_ops.cpp (casts, transposes, dequantize, the fused cast-transposes),
// norm_ops.cpp (the norms), misc_ops.cpp (scale update, RoPE), rope_fp8_ops.cpp (RoPE fused with
// the FP8 casts of q, k, v), glu_ops.cpp (SwiGLU / GeGLU fused with the FP8 cast-transposes),
// stats_ops.cpp (the FP8 cast statistics); each declares its ops' schemas beside their entry
// points. module.cpp is the Python module (kernel switches, the graphs' guard of guard_ops.cpp).
//
// Every op writes into tensors the caller passes in (graph-friendly: nothing is allocated here
// but fp32 workspaces), and every value that changes between steps (scale, amax, noop flag) is
// read from a tensor. Every argument a user can get wrong is checked here, before the launcher
// runs; launchers return a Status instead of throwing, and launch() raises on a failure.
#pragma once

// ATen's tensor and c10's checks only, not <torch/extension.h>: that header pulls in all of
// torch's C++ frontend and made each of these files take minutes to compile.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <cstring>
#include <string>

#include "../common.h"

#ifdef GRAPHFP8_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace graphfp8 {

inline DType to_dtype(at::ScalarType t) {
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
inline std::string fmt(int64_t v) { return std::to_string(v); }

inline std::string fmt(at::IntArrayRef v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

inline bool is_fp8(at::ScalarType t) { return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2; }
inline bool is_hp(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

// Checks shared by every tensor argument: same device as the reference tensor, contiguous.
inline void check_common(const char* op, const char* name, const at::Tensor& t, const at::Tensor& ref) {
  TORCH_CHECK(t.device() == ref.device(), op, ": argument '", name, "' is on ", t.device().str(),
              " but the input is on ", ref.device().str());
  TORCH_CHECK(t.is_contiguous(), op, ": argument '", name, "' must be contiguous");
}

inline void check_scalar_f32(const char* op, const char* name, const at::Tensor& t, const at::Tensor& ref) {
  check_common(op, name, t, ref);
  TORCH_CHECK(t.scalar_type() == at::kFloat, op, ": argument '", name, "' must be float32, got ",
              t.scalar_type());
  TORCH_CHECK(t.numel() == 1, op, ": argument '", name, "' must hold one element, got ",
              fmt(t.numel()));
}

inline void check_fp8_out(const char* op, const char* name, const at::Tensor& t, const at::Tensor& ref,
                   at::IntArrayRef shape) {
  check_common(op, name, t, ref);
  TORCH_CHECK(is_fp8(t.scalar_type()), op, ": argument '", name,
              "' must be float8_e4m3fn or float8_e5m2, got ", t.scalar_type());
  TORCH_CHECK(t.sizes() == shape, op, ": argument '", name, "' must have shape ", fmt(shape),
              ", got ", fmt(t.sizes()));
}

inline const float* noop_ptr(const char* op, const c10::optional<at::Tensor>& noop, const at::Tensor& ref) {
  if (!noop.has_value()) return nullptr;
  check_scalar_f32(op, "noop", *noop, ref);
  return noop->data_ptr<float>();
}

#ifdef GRAPHFP8_WITH_CUDA
inline void* current_stream(const at::Tensor& t) {
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

// Declares the op `schema` in torch.ops.graphfp8 and registers `fn`, its checked entry point, as
// its CPU and (built with CUDA) CUDA kernel; the entry point picks its launcher by device (launch
// above). Each *_ops.cpp calls it in a TORCH_LIBRARY_FRAGMENT beside the entry point, so an op's
// C++ signature and schema are written side by side, and the dispatcher checks at load that the
// two agree in types.
template <typename Fn>
void def_op(torch::Library& m, const char* schema, Fn* fn) {
  m.def(schema);
  const std::string name(schema, std::strchr(schema, '('));
  m.impl(name.c_str(), torch::dispatch(c10::DispatchKey::CPU, fn));
#ifdef GRAPHFP8_WITH_CUDA
  m.impl(name.c_str(), torch::dispatch(c10::DispatchKey::CUDA, fn));
#endif
}

}  // namespace graphfp8
