// The per-call guard of graphed callables, microbatch and step graphs: one C++ loop over the
// tensors a capture read, fixed at capture (docs/after-capture.md says what it sees).
//
// A captured graph holds raw pointers to the parameters and buffers it read and runs no Python,
// so between replays the tensors must keep their storage (`.data =` swaps it in place: the
// TensorImpl stays, its storage pointer moves), their requires_grad and their lack of tensor
// hooks. TensorWatch reads those three per tensor straight from the THPVariable (~10-20 ns a
// tensor: no Python attribute lookup, no tuple per tensor), so the check costs the same at 1 and
// at 24 layers up to that loop. It only answers "which index changed first"; the Python side
// (graphs/replay_guard.py) words the error. GradWatch answers where the `.grad` of the
// parameters a backward graph folds into stands (graphs/grads.py).
#include <Python.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <vector>

namespace py = pybind11;

namespace graphfp8 {
namespace {

// A Python hook dict (OrderedDict) with at least one hook; None or emptied by handle.remove()
// counts as none, as torch's own dispatch does.
bool has_hooks(PyObject* hooks) {
  return hooks != nullptr && hooks != Py_None && PyDict_Check(hooks) && PyDict_Size(hooks) > 0;
}

const at::Tensor& unpack(PyObject* obj) { return THPVariable_Unpack(obj); }

PyObject* checked_tensor(py::handle item, const char* what) {
  if (!THPVariable_Check(item.ptr())) {
    throw py::type_error(std::string("graphfp8 guard: ") + what + " must hold tensors only");
  }
  return item.ptr();
}

class TensorWatch {
 public:
  // tensors: what the graphs read. grad_state[i]: also watch requires_grad and tensor hooks of
  // tensor i (parameters; buffers are watched for their storage only).
  TensorWatch(const py::sequence& tensors, const py::sequence& grad_state) {
    const auto n = static_cast<size_t>(py::len(tensors));
    if (static_cast<size_t>(py::len(grad_state)) != n) {
      throw py::value_error("graphfp8 guard: one grad_state flag per tensor");
    }
    items_.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      PyObject* obj = checked_tensor(tensors[i], "tensors");
      const at::Tensor& t = unpack(obj);
      items_.push_back(Item{py::reinterpret_borrow<py::object>(obj), t.const_data_ptr(),
                            t.requires_grad(), grad_state[i].cast<bool>()});
    }
  }

  // The index of the first tensor whose storage, requires_grad or hooks changed since capture,
  // or -1.
  int64_t first_changed() const {
    for (size_t i = 0; i < items_.size(); ++i) {
      const Item& item = items_[i];
      PyObject* obj = item.tensor.ptr();
      const at::Tensor& t = unpack(obj);
      if (t.const_data_ptr() != item.data_ptr) return static_cast<int64_t>(i);
      if (!item.grad_state) continue;
      const auto* var = reinterpret_cast<const THPVariable*>(obj);
      if (t.requires_grad() != item.requires_grad || has_hooks(var->backward_hooks) ||
          has_hooks(var->post_accumulate_grad_hooks)) {
        return static_cast<int64_t>(i);
      }
    }
    return -1;
  }

  size_t size() const { return items_.size(); }

 private:
  struct Item {
    py::object tensor;  // kept alive: the graphs read it
    const void* data_ptr;
    bool requires_grad;
    bool grad_state;
  };
  std::vector<Item> items_;
};

class GradWatch {
 public:
  GradWatch(const py::sequence& params, const py::sequence& buffers) {
    const auto n = static_cast<size_t>(py::len(params));
    if (static_cast<size_t>(py::len(buffers)) != n) {
      throw py::value_error("graphfp8 guard: one .grad buffer per parameter");
    }
    for (size_t i = 0; i < n; ++i) {
      params_.push_back(py::reinterpret_borrow<py::object>(checked_tensor(params[i], "params")));
      py::object buffer = py::reinterpret_borrow<py::object>(checked_tensor(buffers[i], "buffers"));
      buffer_impls_.push_back(unpack(buffer.ptr()).unsafeGetTensorImpl());
      buffers_.push_back(std::move(buffer));
    }
  }

  // 0: every parameter's .grad is its buffer; 1: every .grad is None; 2: anything else.
  int state() const {
    bool all_buffers = true, all_none = true;
    for (size_t i = 0; i < params_.size(); ++i) {
      // TensorImpl::grad(), not Tensor::grad(): the latter also asks whether the tensor is a leaf
      // (to warn about .grad of non-leaves), which parameters are.
      const at::Tensor& grad = unpack(params_[i].ptr()).unsafeGetTensorImpl()->grad();
      if (!grad.defined()) {
        all_buffers = false;
      } else {
        all_none = false;
        if (grad.unsafeGetTensorImpl() != buffer_impls_[i]) return 2;
      }
    }
    return all_buffers ? 0 : (all_none ? 1 : 2);
  }

 private:
  std::vector<py::object> params_, buffers_;  // buffers_ keeps buffer_impls_ alive
  std::vector<const c10::TensorImpl*> buffer_impls_;
};

}  // namespace

void bind_guard(py::module_& m) {
  py::class_<TensorWatch>(m, "TensorWatch")
      .def(py::init<const py::sequence&, const py::sequence&>(), py::arg("tensors"),
           py::arg("grad_state"))
      .def("first_changed", &TensorWatch::first_changed)
      .def("__len__", &TensorWatch::size);
  py::class_<GradWatch>(m, "GradWatch")
      .def(py::init<const py::sequence&, const py::sequence&>(), py::arg("params"),
           py::arg("buffers"))
      .def("state", &GradWatch::state);
}

}  // namespace graphfp8
