// The extension's Python module: direct entries into flashopm::outer_product_mean for the modules'
// forward.
//
// `torch.ops.flashopm.outer_product_mean(...)` converts each of its 15 Python arguments against the
// schema into a boxed stack before the dispatcher unboxes them again: at the specification's size
// that costs more host time than the kernels take on the GPU.  `outer_product_mean` below reads
// the arguments itself and calls the op's typed handle, so the dispatcher still runs every layer
// (autograd, autocast, inference mode, the profiler, dispatch modes) and only the schema parsing
// goes; where none of those layers has anything to do (no gradient to record, no mode, no
// observer, plain CUDA tensors), it calls the op's CUDA kernel itself, which is where the
// dispatcher would have taken the call.  `outer_product_mean_modules` does the same with the
// parameters read from a module's submodules.  Both take the common case alone (plain tensors or
// parameters, no __torch_function__ override or mode, arguments of the schema's types) and answer
// NotImplemented otherwise, so that the caller takes torch.ops, whose behaviour (and error
// messages) it then shares.
#include <Python.h>

#include <ATen/ATen.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/grad_mode.h>
#include <ATen/record_function.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include "opm_op_handles.h"
#include "opm_params.h"

#include <optional>

namespace flashopm {
namespace {

// A plain tensor or parameter; subclasses (which may override __torch_function__) are not.
bool plain_tensor(PyObject* obj) { return THPVariable_CheckExact(obj); }

// Tensors are taken by value (a reference on each), so that they outlive the call even where they
// were read from a module's dictionaries, which other Python threads may change while the op runs
// without the GIL.
bool read_tensor(PyObject* obj, at::Tensor* out) {
  if (!plain_tensor(obj)) return false;
  *out = THPVariable_Unpack(obj);
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

// The op's arguments, as the typed call takes them.
struct ForwardArgs {
  at::Tensor msa, mask, ln_w, ln_b, w_a, w_b, w_out;
  OptTensor b_a, b_b, b_out;
  double ln_eps = 0.0, norm_eps = 1e-3;
  int64_t algorithm = 0, normalization = 0, precision = -1;
};

// The trailing optional arguments (algorithm, normalization, norm_eps, precision), the first
// `n` of them given.
bool read_trailing(PyObject* const* args, Py_ssize_t n, ForwardArgs& f) {
  return (n < 1 || read_int(args[0], &f.algorithm)) && (n < 2 || read_int(args[1], &f.normalization)) &&
         (n < 3 || read_double(args[2], &f.norm_eps)) && (n < 4 || read_int(args[3], &f.precision));
}

// Whether the dispatcher would take this call straight to the op's CUDA kernel: every tensor a
// plain dense CUDA tensor, no dispatch key added or removed by thread-local state (autocast,
// dispatch modes, functorch's transforms, functionalization), no gradient to record, and no
// RecordFunction observer (the profiler) to tell.  Then the call skips the two trips through the
// dispatcher (its autograd kernel and the kernel below), which on a cold host cost more than the
// kernels take at small sizes; in every other case it takes them as before.
bool straight_to_cuda_kernel(const ForwardArgs& f) {
  const at::Tensor* tensors[] = {&f.msa, &f.mask, &f.ln_w, &f.ln_b, &f.w_a, &f.w_b, &f.w_out};
  const OptTensor* optional[] = {&f.b_a, &f.b_b, &f.b_out};
  const bool grad_mode = at::GradMode::is_enabled();
  bool records_grad = false;
  c10::DispatchKeySet keys;
  const auto add = [&](const at::Tensor& t) {
    records_grad = records_grad || (grad_mode && t.requires_grad());
    keys = keys | t.key_set();
  };
  for (const at::Tensor* t : tensors) add(*t);
  for (const OptTensor* t : optional)
    if (t->has_value()) add(**t);
  if (records_grad) return false;
  const c10::impl::LocalDispatchKeySet local = c10::impl::tls_local_dispatch_key_set();
  // With no gradient to record, the autograd kernel and ADInplaceOrView only pass the call on;
  // BackendSelect is in the default local set and has no kernel for this op.
  keys = (keys | local.included_) - local.excluded_ - c10::autograd_dispatch_keyset_with_ADInplaceOrView -
         c10::DispatchKeySet(c10::DispatchKey::BackendSelect);
  if (keys != c10::DispatchKeySet(c10::DispatchKey::CUDA)) return false;
  return !at::getStepCallbacksUnlessEmpty(at::RecordScope::FUNCTION).has_value();
}

PyObject* run_forward(const ForwardArgs& f) {
  at::Tensor out;
  {
    // As torch.ops does: other Python threads run while the op does.
    pybind11::gil_scoped_release no_gil;
    if (straight_to_cuda_kernel(f)) {
      out = outer_product_mean_cuda(f.msa, f.mask, f.ln_w, f.ln_b, f.ln_eps, f.w_a, f.b_a, f.w_b, f.b_b, f.w_out,
                                    f.b_out, f.algorithm, f.normalization, f.norm_eps, f.precision);
    } else {
      out = forward_op().call(f.msa, f.mask, f.ln_w, f.ln_b, f.ln_eps, f.w_a, f.b_a, f.w_b, f.b_b, f.w_out, f.b_out,
                              f.algorithm, f.normalization, f.norm_eps, f.precision);
    }
  }
  return THPVariable_Wrap(std::move(out));
}

// outer_product_mean(msa_repr, msa_mask, ln_weight, ln_bias, ln_eps, w_a, b_a, w_b, b_b, w_out, b_out
//                    [, algorithm, normalization, norm_eps, precision]) -> Tensor, or NotImplemented
// Positional arguments as in the schema; the trailing four default as there.
PyObject* outer_product_mean_entry(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs < 11 || nargs > 15) return not_implemented();
  if (at::impl::torch_function_mode_enabled()) return not_implemented();
  ForwardArgs f;
  const bool ok = read_tensor(args[0], &f.msa) && read_tensor(args[1], &f.mask) &&
                  read_tensor(args[2], &f.ln_w) && read_tensor(args[3], &f.ln_b) &&
                  read_double(args[4], &f.ln_eps) && read_tensor(args[5], &f.w_a) &&
                  read_optional_tensor(args[6], &f.b_a) && read_tensor(args[7], &f.w_b) &&
                  read_optional_tensor(args[8], &f.b_b) && read_tensor(args[9], &f.w_out) &&
                  read_optional_tensor(args[10], &f.b_out) && read_trailing(args + 11, nargs - 11, f);
  if (!ok) return not_implemented();
  return run_forward(f);
  END_HANDLE_TH_ERRORS
}

// Interned attribute and key names (created once, with the GIL held).
PyObject* interned(const char* s) {
  PyObject* u = PyUnicode_InternFromString(s);
  if (u == nullptr) throw python_error();
  return u;
}

// An nn.Module's parameter `name` from its `_parameters` dictionary (a plain tensor, or None),
// without nn.Module's attribute machinery.  False where the module keeps it any other way (a
// parametrization, a property, a replaced attribute), for the caller to decline.
bool read_parameter(PyObject* parameters, PyObject* name, OptTensor* out) {
  PyObject* value = PyDict_GetItemWithError(parameters, name);  // borrowed
  if (value == nullptr) {
    PyErr_Clear();
    return false;
  }
  return read_optional_tensor(value, out);
}

// The weight and bias of submodule `name` of `modules` (an nn.Module's `_modules`), and its eps if
// asked; false where any of them is not where a plain nn.LayerNorm or nn.Linear keeps it.
bool read_submodule(PyObject* modules, PyObject* name, OptTensor* weight, OptTensor* bias, double* eps) {
  static PyObject* const k_parameters = interned("_parameters");
  static PyObject* const k_weight = interned("weight");
  static PyObject* const k_bias = interned("bias");
  static PyObject* const k_eps = interned("eps");
  if (!PyDict_CheckExact(modules) || !PyUnicode_CheckExact(name)) return false;
  PyObject* module = PyDict_GetItemWithError(modules, name);  // borrowed
  if (module == nullptr) {
    PyErr_Clear();
    return false;
  }
  PyObject* parameters = PyObject_GetAttr(module, k_parameters);
  if (parameters == nullptr) {
    PyErr_Clear();
    return false;
  }
  bool ok = PyDict_CheckExact(parameters) && read_parameter(parameters, k_weight, weight) &&
            read_parameter(parameters, k_bias, bias);
  Py_DECREF(parameters);
  if (ok && eps != nullptr) {
    PyObject* value = PyObject_GetAttr(module, k_eps);
    if (value == nullptr) {
      PyErr_Clear();
      return false;
    }
    ok = read_double(value, eps);
    Py_DECREF(value);
  }
  return ok;
}

// outer_product_mean_modules(modules, names, msa_repr, msa_mask[, algorithm, normalization, norm_eps,
//                            precision]) -> Tensor, or NotImplemented
// The same call with the parameters read from a module's submodules: `modules` is its `_modules`,
// `names` the names of its LayerNorm and its three linear layers (in the op's order).  A module's
// forward saves the Python frames and the dictionary lookups that collecting its nine parameters
// would take.
PyObject* outer_product_mean_modules_entry(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs < 4 || nargs > 8) return not_implemented();
  if (at::impl::torch_function_mode_enabled()) return not_implemented();
  PyObject* const modules = args[0];
  PyObject* const names = args[1];
  if (!PyTuple_CheckExact(names) || PyTuple_GET_SIZE(names) != 4) return not_implemented();
  ForwardArgs f;
  OptTensor ln_w, ln_b, w_a, w_b, w_out;  // required: None declines
  const bool ok = read_tensor(args[2], &f.msa) && read_tensor(args[3], &f.mask) &&
                  read_submodule(modules, PyTuple_GET_ITEM(names, 0), &ln_w, &ln_b, &f.ln_eps) &&
                  read_submodule(modules, PyTuple_GET_ITEM(names, 1), &w_a, &f.b_a, nullptr) &&
                  read_submodule(modules, PyTuple_GET_ITEM(names, 2), &w_b, &f.b_b, nullptr) &&
                  read_submodule(modules, PyTuple_GET_ITEM(names, 3), &w_out, &f.b_out, nullptr) &&
                  read_trailing(args + 4, nargs - 4, f);
  if (!ok || !ln_w || !ln_b || !w_a || !w_b || !w_out) return not_implemented();
  f.ln_w = *std::move(ln_w), f.ln_b = *std::move(ln_b), f.w_a = *std::move(w_a), f.w_b = *std::move(w_b);
  f.w_out = *std::move(w_out);
  return run_forward(f);
  END_HANDLE_TH_ERRORS
}

// name([enabled]) -> bool: a process-wide launch switch; with `enabled`, sets it and returns the
// previous setting.
PyObject* launch_switch(const char* name, bool (*get)(), bool (*set)(bool), PyObject* const* args, Py_ssize_t nargs) {
  if (nargs > 1) {
    PyErr_Format(PyExc_TypeError, "%s: expected at most one argument (enabled), got %zd", name, nargs);
    return nullptr;
  }
  if (nargs == 1 && !PyBool_Check(args[0])) {
    PyErr_Format(PyExc_TypeError, "%s: expected enabled to be a bool, got %s", name, Py_TYPE(args[0])->tp_name);
    return nullptr;
  }
  return PyBool_FromLong(nargs == 1 ? set(args[0] == Py_True) : get());
}

// driver_launch([enabled]): the launch route (True: the driver's cuLaunchKernelEx, False: the
// runtime's cudaLaunchKernelEx).
PyObject* driver_launch_entry(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  return launch_switch("driver_launch", &driver_launch, &set_driver_launch, args, nargs);
}

// graph_launch([enabled]): whether a call's launches may go out as one launch of a CUDA graph.
PyObject* graph_launch_entry(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  return launch_switch("graph_launch", &graph_launch, &set_graph_launch, args, nargs);
}

// graph_launch_counts() -> (graphs built, graph launches, failed builds, last failure) in this process.
PyObject* graph_launch_counts_entry(PyObject* /*self*/, PyObject* /*unused*/) {
  const GraphLaunchCounts c = graph_launch_counts();
  return Py_BuildValue("(KKKs)", static_cast<unsigned long long>(c.built), static_cast<unsigned long long>(c.launched),
                       static_cast<unsigned long long>(c.failed), c.last_failure.c_str());
}

PyMethodDef module_methods[] = {
    {"outer_product_mean", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(&outer_product_mean_entry)),
     METH_FASTCALL,
     "outer_product_mean(msa_repr, msa_mask, ln_weight, ln_bias, ln_eps, w_a, b_a, w_b, b_b, w_out, b_out"
     "[, algorithm, normalization, norm_eps, precision]): torch.ops.flashopm.outer_product_mean without the "
     "schema's argument parsing, or NotImplemented where the call needs it"},
    {"outer_product_mean_modules",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(&outer_product_mean_modules_entry)), METH_FASTCALL,
     "outer_product_mean_modules(modules, names, msa_repr, msa_mask[, algorithm, normalization, norm_eps, "
     "precision]): outer_product_mean with the parameters of the submodules `names` (LayerNorm, then the three "
     "linear layers) of `modules` (an nn.Module's _modules), or NotImplemented where a parameter is not a plain "
     "entry of its module's _parameters"},
    {"driver_launch", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(&driver_launch_entry)), METH_FASTCALL,
     "driver_launch([enabled]) -> bool: whether kernels are launched through the driver's cuLaunchKernelEx "
     "(True, the default) or the runtime's cudaLaunchKernelEx; with `enabled`, sets it and returns the "
     "previous setting"},
    {"graph_launch", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(&graph_launch_entry)), METH_FASTCALL,
     "graph_launch([enabled]) -> bool: whether a call's launches go out as one launch of a CUDA graph of them "
     "where they can (True, the default; never under stream capture); with `enabled`, sets it and returns the "
     "previous setting"},
    {"graph_launch_counts", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(&graph_launch_counts_entry)),
     METH_NOARGS,
     "graph_launch_counts() -> (graphs built, graph launches, sequences of launches no graph could be built for, "
     "the last such failure's step and error) in this process"},
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
