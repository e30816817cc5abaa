// Registration of every graphfp8 op with the dispatcher (torch.ops.graphfp8.*), for CPU and
// CUDA: the same checked entry point serves both and picks its launcher by device.
#include <pybind11/pybind11.h>
#include <torch/library.h>

#include "ops.h"
#include "switches.h"

namespace graphfp8 {
namespace {

// Sets a kernel switch (switches.h); returns its previous state. Raises on an unknown name.
bool set_kernel_switch(const std::string& name, bool on) {
  KernelSwitch* s = kernel_switch(name.c_str());
  TORCH_CHECK(s != nullptr, "graphfp8: no kernel switch named ", name);
  return s->on.exchange(on);
}

bool get_kernel_switch(const std::string& name) {
  const KernelSwitch* s = kernel_switch(name.c_str());
  TORCH_CHECK(s != nullptr, "graphfp8: no kernel switch named ", name);
  return s->on.load();
}

bool built_with_cuda() {
#ifdef GRAPHFP8_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace
}  // namespace graphfp8

TORCH_LIBRARY(graphfp8, m) {
  // scaled_max given (current scaling, CurrentScale in common.h): the cast computes its scale
  // from amax, rewrites `scale` and resets `amax`, hence the (s!) on every cast's scale.
  m.def("cast_to_fp8(Tensor x, Tensor(s!) scale, Tensor(a!) out, Tensor(b!) scale_inv, "
        "Tensor(c!) amax, Tensor? noop=None, Tensor? scaled_max=None) -> ()");
  m.def("cast_transpose(Tensor x, Tensor(s!) scale, Tensor(a!) out, Tensor(b!) out_t, "
        "Tensor(c!) scale_inv, Tensor(d!) amax, Tensor? noop=None, "
        "Tensor? scaled_max=None) -> ()");
  m.def("amax(Tensor x, Tensor(a!) amax, Tensor? noop=None) -> ()");
  m.def("gelu_amax(Tensor x, Tensor(a!) amax) -> ()");
  m.def("dgelu_amax(Tensor dy, Tensor x, Tensor(a!) amax) -> ()");
  m.def("fp8_transpose(Tensor x, Tensor(a!) out_t, Tensor? noop=None) -> ()");
  m.def("scale_update(Tensor(a!) amax_history, Tensor(b!) scale, Tensor scaled_max, "
        "bool most_recent) -> ()");
  m.def("dequantize(Tensor x, Tensor scale_inv, Tensor(a!) out) -> ()");
  m.def("cast_transpose_dbias(Tensor x, Tensor(s!) scale, Tensor(a!) out, Tensor(b!) out_t, "
        "Tensor(c!) scale_inv, Tensor(d!) amax, Tensor(e!) dbias, "
        "Tensor? scaled_max=None) -> ()");
  m.def("gelu_cast_transpose(Tensor x, Tensor(s!) scale, Tensor(a!) out, Tensor(b!) out_t, "
        "Tensor(c!) scale_inv, Tensor(d!) amax, Tensor? scaled_max=None) -> ()");
  m.def("rope_qkv(Tensor qkv, Tensor cos, Tensor sin, int num_heads, bool inverse, "
        "Tensor(a!) out) -> ()");
  m.def("dgelu_cast_transpose_dbias(Tensor dy, Tensor x, Tensor(s!) scale, Tensor(a!) out, "
        "Tensor(b!) out_t, Tensor(c!) scale_inv, Tensor(d!) amax, Tensor(e!) dbias, "
        "Tensor? scaled_max=None) -> ()");
  m.def("rope_fp8(Tensor qkv, Tensor? cos, Tensor? sin, int num_heads, Tensor[] scale, "
        "Tensor(a!)[] out, Tensor(b!)[] scale_inv, Tensor(c!)[] amax) -> ()");
  m.def("rope_fp8_backward(Tensor[] grads, Tensor[] scale_inv, Tensor? cos, Tensor? sin, "
        "int num_heads, Tensor(a!) out) -> ()");
  m.def("layernorm_fp8(Tensor x, Tensor gamma, Tensor beta, float eps, bool zero_centered_gamma, "
        "Tensor(s!) scale, Tensor(a!) out, Tensor(b!)? out_t, Tensor(c!) scale_inv, "
        "Tensor(d!) amax, Tensor(e!) mu, Tensor(f!) rsigma, Tensor(g!)? out_hp=None, "
        "Tensor? residual=None, Tensor(h!)? residual_out=None, Tensor? scaled_max=None) -> ()");
  m.def("rmsnorm_fp8(Tensor x, Tensor gamma, float eps, bool zero_centered_gamma, "
        "Tensor(s!) scale, Tensor(a!) out, Tensor(b!)? out_t, Tensor(c!) scale_inv, "
        "Tensor(d!) amax, Tensor(e!) rsigma, Tensor(f!)? out_hp=None, Tensor? residual=None, "
        "Tensor(g!)? residual_out=None, Tensor? scaled_max=None) -> ()");
  m.def("layernorm_amax(Tensor x, Tensor gamma, Tensor beta, float eps, "
        "bool zero_centered_gamma, Tensor(a!) amax, Tensor? residual=None) -> ()");
  m.def("rmsnorm_amax(Tensor x, Tensor gamma, float eps, bool zero_centered_gamma, "
        "Tensor(a!) amax, Tensor? residual=None) -> ()");
  m.def("layernorm_bwd(Tensor dy, Tensor x, Tensor mu, Tensor rsigma, Tensor gamma, "
        "bool zero_centered_gamma, Tensor(a!) dx, Tensor(b!) dgamma, Tensor(c!) dbeta, "
        "Tensor? dresidual=None) -> ()");
  m.def("rmsnorm_bwd(Tensor dy, Tensor x, Tensor rsigma, Tensor gamma, bool zero_centered_gamma, "
        "Tensor(a!) dx, Tensor(b!) dgamma, Tensor? dresidual=None) -> ()");
  m.def("cast_stats(Tensor x, Tensor? act_in, Tensor? mu, Tensor? rsigma, Tensor? gamma, "
        "Tensor? beta, int mode, bool zero_centered_gamma, Tensor scale, Tensor recorded_amax, "
        "bool e4m3, Tensor? enabled, Tensor? skip, Tensor(a!) out) -> ()");
}

// The same checked entry points serve both backends: each picks its launcher by device.
#define GRAPHFP8_IMPL_ALL(m)                                                   \
  m.impl("cast_to_fp8", &graphfp8::cast_to_fp8);                               \
  m.impl("cast_transpose", &graphfp8::cast_transpose);                         \
  m.impl("amax", &graphfp8::amax);                                             \
  m.impl("gelu_amax", &graphfp8::gelu_amax);                                   \
  m.impl("dgelu_amax", &graphfp8::dgelu_amax);                                 \
  m.impl("fp8_transpose", &graphfp8::fp8_transpose);                           \
  m.impl("scale_update", &graphfp8::scale_update);                             \
  m.impl("dequantize", &graphfp8::dequantize);                                 \
  m.impl("cast_transpose_dbias", &graphfp8::cast_transpose_dbias);             \
  m.impl("gelu_cast_transpose", &graphfp8::gelu_cast_transpose);               \
  m.impl("dgelu_cast_transpose_dbias", &graphfp8::dgelu_cast_transpose_dbias); \
  m.impl("rope_qkv", &graphfp8::rope_qkv);                                     \
  m.impl("rope_fp8", &graphfp8::rope_fp8);                                     \
  m.impl("rope_fp8_backward", &graphfp8::rope_fp8_backward);                   \
  m.impl("layernorm_fp8", &graphfp8::layernorm_fp8);                           \
  m.impl("rmsnorm_fp8", &graphfp8::rmsnorm_fp8);                               \
  m.impl("layernorm_amax", &graphfp8::layernorm_amax);                         \
  m.impl("rmsnorm_amax", &graphfp8::rmsnorm_amax);                             \
  m.impl("layernorm_bwd", &graphfp8::layernorm_bwd);                           \
  m.impl("rmsnorm_bwd", &graphfp8::rmsnorm_bwd);                               \
  m.impl("cast_stats", &graphfp8::cast_stats)

TORCH_LIBRARY_IMPL(graphfp8, CPU, m) { GRAPHFP8_IMPL_ALL(m); }

#ifdef GRAPHFP8_WITH_CUDA
TORCH_LIBRARY_IMPL(graphfp8, CUDA, m) { GRAPHFP8_IMPL_ALL(m); }
#endif

namespace graphfp8 {
void bind_guard(pybind11::module_& m);  // guard_ops.cpp: the per-call guard of the graphs
}  // namespace graphfp8

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "graphfp8 kernels; the ops live in torch.ops.graphfp8";
  m.def("built_with_cuda", &graphfp8::built_with_cuda, "Whether the CUDA kernels were compiled");
  graphfp8::bind_guard(m);
  m.def("set_kernel_switch", &graphfp8::set_kernel_switch,
        "Sets a CUDA kernel switch (csrc/ops/switches.h); returns its previous state");
  m.def("get_kernel_switch", &graphfp8::get_kernel_switch, "The state of a CUDA kernel switch");
}
