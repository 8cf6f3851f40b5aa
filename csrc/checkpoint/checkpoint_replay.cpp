// The replay: the function called again on its saved arguments under the forward's RNG/autocast/device
// state, with recompute hooks that fill the Holders in order, and its early stop.
#include "checkpoint_internal.h"

#include <ATen/core/grad_mode.h>
#include <ATen/SequenceNumber.h>
#include <torch/csrc/autograd/python_variable.h>
#include <pybind11/eval.h>

#include <algorithm>

namespace ckpt_ext {

using namespace checkpoint_detail;

namespace {

// Raised by the replay's pack hook once every live Holder is filled (early stop); caught by the replay.
struct StopRecomputation : std::exception {
  const char* what() const noexcept override { return "ckpt_ext: recomputation stopped early"; }
};

PyObject* stop_type = nullptr;  // ckpt_ext._C._StopRecomputation, set by bind_replay

bool attr_true(PyObject* obj, const char* name) {
  PyObject* v = PyObject_GetAttrString(obj, name);
  if (v == nullptr) throw py::error_already_set();
  const int t = PyObject_IsTrue(v);
  Py_DECREF(v);
  if (t < 0) throw py::error_already_set();
  return t == 1;
}

// The training BatchNorm modules with running statistics in `roots` and their submodules (modules() order),
// walked in C++: this runs on every replay (Python's modules() costs ~5 µs for a module of two).
py::list batchnorms_in(const std::vector<PyObject*>& roots) {
  const auto& h = PyHelpers::get();
  py::list found;
  std::vector<PyObject*> stack(roots.rbegin(), roots.rend());  // borrowed: held by the frame or a parent
  std::vector<PyObject*> seen;
  while (!stack.empty()) {
    PyObject* m = stack.back();
    stack.pop_back();
    if (std::find(seen.begin(), seen.end(), m) != seen.end()) continue;
    seen.push_back(m);
    const int is_bn = PyObject_IsInstance(m, h.batchnorm_type.ptr());
    if (is_bn < 0) throw py::error_already_set();
    if (is_bn && attr_true(m, "training") && attr_true(m, "track_running_stats")) found.append(m);
    py::object children = py::reinterpret_steal<py::object>(PyObject_GetAttrString(m, "_modules"));
    if (!children) throw py::error_already_set();
    if (!PyDict_Check(children.ptr())) continue;
    const size_t first = stack.size();
    PyObject *key, *child;
    Py_ssize_t pos = 0;
    while (PyDict_Next(children.ptr(), &pos, &key, &child))
      if (child != Py_None) stack.push_back(child);
    std::reverse(stack.begin() + static_cast<std::ptrdiff_t>(first), stack.end());  // pre-order, as modules()
  }
  return found;
}

// Arguments that discovery (ckpt_ext/_discovery.py) would find no module in: tensors and plain values,
// in tuples and lists.
bool inert(PyObject* obj, int depth) {
  if (obj == Py_None || THPVariable_Check(obj) || PyBool_Check(obj) || PyLong_CheckExact(obj) ||
      PyFloat_CheckExact(obj) || PyUnicode_CheckExact(obj))
    return true;
  if (depth < 3 && (PyTuple_CheckExact(obj) || PyList_CheckExact(obj))) {
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(obj); ++i)
      if (!inert(PySequence_Fast_GET_ITEM(obj, i), depth + 1)) return false;
    return true;
  }
  return false;
}

// The module a checkpointed callable calls, where that is all it does: the module itself, its own
// __call__ (nn.Module's, bound), or either in functools.partial with inert arguments -- Hugging Face's
// layers call the checkpoint function with partial(super().__call__, **kwargs). Borrowed; null for any
// other callable (Python's discovery walks its closure and globals then).
PyObject* called_module(PyObject* fn) {
  const auto& h = PyHelpers::get();
  for (int depth = 0; depth < 4; ++depth) {
    const int is_module = PyObject_IsInstance(fn, h.module_type.ptr());
    if (is_module < 0) throw py::error_already_set();
    if (is_module) return fn;
    if (PyMethod_Check(fn)) {
      PyObject* self = PyMethod_GET_SELF(fn);
      PyObject* func = PyMethod_GET_FUNCTION(fn);
      if (func != h.module_call.ptr() && func != h.module_call_impl.ptr()) return nullptr;
      fn = self;
      continue;
    }
    if (Py_TYPE(fn) != reinterpret_cast<PyTypeObject*>(h.partial_type.ptr())) return nullptr;
    py::handle partial(fn);
    py::object args = partial.attr("args"), keywords = partial.attr("keywords");
    if (!inert(args.ptr(), 0)) return nullptr;
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(keywords.ptr(), &pos, &key, &value))
      if (!inert(value, 0)) return nullptr;
    fn = partial.attr("func").ptr();  // held by the partial
  }
  return nullptr;
}

// The replay's pack hook: a C function (not pybind11) so that early stop raises without a C++ throw.
struct RecomputeHook {
  std::shared_ptr<Frame> frame;
  int64_t gid;
};

void free_hook(PyObject* capsule) {
  delete static_cast<RecomputeHook*>(PyCapsule_GetPointer(capsule, "ckpt_ext.RecomputeHook"));
}

PyObject* make_capsule(RecomputeHook* hook) {
  PyObject* c = PyCapsule_New(hook, "ckpt_ext.RecomputeHook", free_hook);
  if (c == nullptr) delete hook;
  return c;
}

PyObject* recompute_pack_c(PyObject* capsule, PyObject* tensor) {
  auto* hook = static_cast<RecomputeHook*>(PyCapsule_GetPointer(capsule, "ckpt_ext.RecomputeHook"));
  if (hook == nullptr) return nullptr;
  try {
    return hook->frame->recompute_pack(hook->gid, THPVariable_Unpack(tensor)).release().ptr();
  } catch (...) {
    set_python_error();
  }
  return nullptr;
}

// The replay's unpack hook: what the pack hook returned (the replay's own graph is never backwarded
// through, but it may be: torch's Rule 6).
const py::object& identity() {
  static py::object* fn = new py::object(py::eval("lambda x: x"));
  return *fn;
}

}  // namespace

void Frame::replay(int64_t gid) {
  auto keep_alive = shared_from_this();
  ReplayGuard guard(snapshot_);  // RNG, autocast, current device; is_recomputing()
  at::AutoGradMode grad_mode(true);
  py::object capsule = py::reinterpret_steal<py::object>(make_capsule(new RecomputeHook{keep_alive, gid}));
  if (!capsule) throw py::error_already_set();
  py::object pack = make_pack_hook(capsule, recompute_pack_c);
  push_hooks(pack, identity());
  PopHooks pop{pack.ptr()};
  // Called through the C API: early stop is a Python exception that must not cost C++ throws here.
  PyObject* result = call_replay();
  if (result != nullptr) {
    Py_DECREF(result);
  } else if (PyErr_ExceptionMatches(stop_type)) {
    PyErr_Clear();
  } else {
    // Any other error: a note says where it was raised (Python), then it propagates.
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    if (traceback != nullptr) PyException_SetTraceback(value, traceback);
    PyObject* noted = PyObject_CallFunctionObjArgs(PyHelpers::get().replay_note.ptr(), call_.function.ptr(), value,
                                                   nullptr);
    if (noted == nullptr) PyErr_WriteUnraisable(call_.function.ptr());
    Py_XDECREF(noted);
    PyErr_Restore(type, value, traceback);
    throw py::error_already_set();
  }
}

PyObject* Frame::call_replay() {
  // The arguments, tensors unpacked as autograd unpacks a saved tensor (its error if one was modified).
  const Py_ssize_t n = static_cast<Py_ssize_t>(call_.objects.size());
  py::object args = py::reinterpret_steal<py::object>(PyTuple_New(n));
  if (!args) return nullptr;
  size_t k = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* a = call_.objects[static_cast<size_t>(i)].ptr();
    if (a != nullptr) {
      Py_INCREF(a);
    } else {
      try {
        a = THPVariable_Wrap(call_.tensors[k++].unpack());
      } catch (...) {
        set_python_error();  // autograd's in-place error, or an outer unpack hook's
        return nullptr;
      }
      if (a == nullptr) return nullptr;
    }
    PyTuple_SET_ITEM(args.ptr(), i, a);
  }
  PyObject* fn = call_.function.ptr();
  PyObject* kwargs = call_.kwargs.is_none() ? nullptr : call_.kwargs.ptr();
  const auto& h = PyHelpers::get();
  py::object bns;
  try {
    if (!call_.modules.is_none()) {  // the caller named the modules the function runs
      std::vector<PyObject*> roots;
      for (py::handle m : call_.modules) roots.push_back(m.ptr());
      bns = batchnorms_in(roots);
    } else {
      PyObject* module = called_module(fn);
      bns = module != nullptr ? py::object(batchnorms_in({module})) : h.batchnorms_of(call_.function, args);
    }
  } catch (py::error_already_set& e) {
    e.restore();
    return nullptr;
  }
  if (call_.context.is_none() && PyList_Check(bns.ptr()) && PyList_GET_SIZE(bns.ptr()) == 0)
    return PyObject_Call(fn, args.ptr(), kwargs);
  return PyObject_CallFunctionObjArgs(h.replay_guarded.ptr(), fn, args.ptr(), kwargs ? kwargs : Py_None,
                                      call_.context.ptr(), bns.ptr(), nullptr);
}

py::object Frame::recompute_pack(int64_t gid, const at::Tensor& x) {
  // A tensor that requires grad is kept detached (the replay's graph is not used); others are kept as
  // they are, so that a custom Function gets back the very object it saved.
  at::Tensor keep = x.requires_grad() ? x.detach() : x;
  auto& st = state(gid);
  if (st.counter == holders_.size() && options_.early_stop && forward_completed_) {
    // The replay went on past the forward's last save (whose op had already run: see forward_done); torch
    // would have stopped there, and every Holder is filled: stop now.
    PyErr_SetNone(stop_type);
    return py::object();
  }
  const size_t index = st.counter++;
  if (index >= holders_.size()) {
    if (!forward_completed_) {
      // A backward inside the forward replays a forward that had not finished saving yet.
      ignore_mismatch_ = true;
      return py::cast(keep);
    }
    fail_more_saved();
  }
  if (auto h = holders_[index].lock()) {  // a Holder already freed (partial backward) needs nothing
    TORCH_INTERNAL_ASSERT(h->find(gid) == nullptr);
    h->entries.push_back({gid, keep});
  }
  if (options_.early_stop && stop_at_last_pack_ && st.counter == holders_.size()) {
    PyErr_SetNone(stop_type);
    return py::object();  // null: the C hook returns it with the error set
  }
  return py::cast(keep);
}

namespace checkpoint_detail {

void bind_replay(py::module_& m) {
  stop_type = py::register_exception<StopRecomputation>(m, "_StopRecomputation").ptr();
}

}  // namespace checkpoint_detail
}  // namespace ckpt_ext
