// The extension's Python module: a direct entry into flashopm::outer_product_mean for the modules'
// forward.
//
// `torch.ops.flashopm.outer_product_mean(...)` converts each of its 15 Python arguments against the
// schema into a boxed stack before the dispatcher unboxes them again: at the specification's size
// that costs more host time than the kernels take on the GPU.  `outer_product_mean` below reads
// the arguments itself and calls the op's typed handle, so the dispatcher still runs every layer
// (autograd, autocast, inference mode, the profiler, dispatch modes) and only the schema parsing
// goes.  It takes the common case alone (plain tensors or parameters, no __torch_function__
// override or mode, arguments of the schema's types) and answers NotImplemented otherwise, so
// that the caller takes torch.ops, whose behaviour (and error messages) it then shares.
#include <Python.h>

#include <ATen/ATen.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include "opm_op_handles.h"

#include <optional>

namespace flashopm {
namespace {

// A plain tensor or parameter; subclasses (which may override __torch_function__) are not.
bool plain_tensor(PyObject* obj) { return THPVariable_CheckExact(obj); }

bool read_tensor(PyObject* obj, const at::Tensor** out) {
  if (!plain_tensor(obj)) return false;
  *out = &THPVariable_Unpack(obj);
  return true;
}

bool read_optional_tensor(PyObject* obj, OptTensor* out) {
  if (obj == Py_None) return true;
  if (!plain_tensor(obj)) return false;
  *out = THPVariable_Unpack(obj);
  return true;
}

// Python floats and ints only (what the schema's float accepts without a conversion of its own).
bool read_double(PyObject* obj, double* out) {
  if (PyFloat_CheckExact(obj)) {
    *out = PyFloat_AS_DOUBLE(obj);
    return true;
  }
  if (PyLong_CheckExact(obj)) {
    *out = PyLong_AsDouble(obj);
    if (*out == -1.0 && PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
    return true;
  }
  return false;
}

bool read_int(PyObject* obj, int64_t* out) {
  if (!PyLong_CheckExact(obj)) return false;
  int overflow = 0;
  *out = PyLong_AsLongLongAndOverflow(obj, &overflow);
  if (overflow != 0 || (*out == -1 && PyErr_Occurred())) {
    PyErr_Clear();
    return false;
  }
  return true;
}

PyObject* not_implemented() { Py_RETURN_NOTIMPLEMENTED; }

// outer_product_mean(msa_repr, msa_mask, ln_weight, ln_bias, ln_eps, w_a, b_a, w_b, b_b, w_out, b_out
//                    [, algorithm, normalization, norm_eps, precision]) -> Tensor, or NotImplemented
// Positional arguments as in the schema; the trailing four default as there.
PyObject* outer_product_mean_entry(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs < 11 || nargs > 15) return not_implemented();
  if (at::impl::torch_function_mode_enabled()) return not_implemented();
  const at::Tensor *msa, *mask, *ln_w, *ln_b, *w_a, *w_b, *w_out;
  OptTensor b_a, b_b, b_out;
  double ln_eps = 0.0, norm_eps = 1e-3;
  int64_t algorithm = 0, normalization = 0, precision = -1;
  const bool ok = read_tensor(args[0], &msa) && read_tensor(args[1], &mask) && read_tensor(args[2], &ln_w) &&
                  read_tensor(args[3], &ln_b) && read_double(args[4], &ln_eps) && read_tensor(args[5], &w_a) &&
                  read_optional_tensor(args[6], &b_a) && read_tensor(args[7], &w_b) &&
                  read_optional_tensor(args[8], &b_b) && read_tensor(args[9], &w_out) &&
                  read_optional_tensor(args[10], &b_out) && (nargs < 12 || read_int(args[11], &algorithm)) &&
                  (nargs < 13 || read_int(args[12], &normalization)) &&
                  (nargs < 14 || read_double(args[13], &norm_eps)) && (nargs < 15 || read_int(args[14], &precision));
  if (!ok) return not_implemented();
  at::Tensor out;
  {
    // As torch.ops does: other Python threads run while the op does.
    pybind11::gil_scoped_release no_gil;
    out = forward_op().call(*msa, *mask, *ln_w, *ln_b, ln_eps, *w_a, b_a, *w_b, b_b, *w_out, b_out, algorithm,
                            normalization, norm_eps, precision);
  }
  return THPVariable_Wrap(std::move(out));
  END_HANDLE_TH_ERRORS
}

PyMethodDef module_methods[] = {
    {"outer_product_mean", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(&outer_product_mean_entry)),
     METH_FASTCALL,
     "outer_product_mean(msa_repr, msa_mask, ln_weight, ln_bias, ln_eps, w_a, b_a, w_b, b_b, w_out, b_out"
     "[, algorithm, normalization, norm_eps, precision]): torch.ops.flashopm.outer_product_mean without the "
     "schema's argument parsing, or NotImplemented where the call needs it"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "flashopm_extension",
                          "flashopm's CUDA kernels (registered with torch.ops.flashopm) and a direct entry into them",
                          -1, module_methods};

}  // namespace
}  // namespace flashopm

#define FLASHOPM_CONCAT_(a, b) a##b
#define FLASHOPM_CONCAT(a, b) FLASHOPM_CONCAT_(a, b)

PyMODINIT_FUNC FLASHOPM_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  return PyModule_Create(&flashopm::module_def);
}
