// The Python module graphfp8._C: whether the CUDA kernels were built, the kernel switches and the
// graphs' per-call guard (guard_ops.cpp). The ops are not here: each *_ops.cpp declares its own
// in torch.ops.graphfp8 (ops.h, def_op), loaded with this module.
#include <pybind11/pybind11.h>
#include <c10/util/Exception.h>

#include <string>

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
