// The saved-tensor hooks of a checkpoint: pushed and popped without a Python call, pack hooks marked
// checkpoint-internal, the forward's pack and unpack as C functions over a capsule owning the frame, and
// the backward (graph task or GraphExecGroup) an unpack belongs to.
#include "checkpoint_internal.h"

#include <ATen/SavedTensorHooks.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/PyInterpreter.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>

#include <atomic>
#include <optional>

namespace ckpt_ext::checkpoint_detail {

void set_python_error() {
  try {
    throw;
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const std::exception&) {
    torch::translate_exception_to_python(std::current_exception());
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "ckpt_ext.checkpoint: an unknown C++ exception");
  }
}

namespace {

// torch's GraphExecGroup (torch.autograd.graph: one replay for several backward calls run as one
// group), read from the autograd TLS where torch keeps it there (no Python call per unpack), else through
// torch._C._get_graph_exec_group, else none.
template <typename State>
auto exec_group_in_tls(const State& state, int) -> decltype(state.get_graph_exec_group(), std::optional<int64_t>()) {
  const auto& group = state.get_graph_exec_group();
  if (!group.has_value()) return std::optional<int64_t>(-1);
  return static_cast<int64_t>(reinterpret_cast<intptr_t>(group->ptr(&group->pyinterpreter())));
}
template <typename State>
std::optional<int64_t> exec_group_in_tls(const State&, long) {
  return std::nullopt;  // this torch keeps it elsewhere, if anywhere
}

// The group's id where one is active.
std::optional<int64_t> exec_group_id() {
  const std::optional<int64_t> tls_group = exec_group_in_tls(c10::AutogradState::get_tls_state(), 0);
  if (tls_group.has_value()) {
    if (*tls_group != -1) return *tls_group;
  } else if (const auto& get_group = PyRefs::get().get_exec_group; !get_group.is_none()) {
    py::object group = get_group();
    if (!group.is_none()) return static_cast<int64_t>(reinterpret_cast<intptr_t>(group.ptr()));
  }
  return std::nullopt;
}

}  // namespace

int64_t current_gid() {
  static std::atomic<int64_t> outside{-2};
  if (const auto group = exec_group_id()) return *group;
  int64_t gid = torch::autograd::get_current_graph_task_id();
  return gid == -1 ? outside.fetch_sub(1) : gid;
}

bool in_exec_group() { return exec_group_id().has_value(); }

// Pushes saved-tensor hooks as torch.autograd.graph.saved_tensors_hooks does (its binding,
// torch::autograd::PyDefaultSavedVariableHooks::push_hooks, is what this repeats: ATen's TLS stack, the
// objects owned as SafePyObjects), without a Python call: this runs on every checkpointed call and every
// replay. Throws c10::Error with torch's message where saved-tensor hooks are disabled.
void push_hooks(const py::object& pack, const py::object& unpack) {
  at::SavedTensorDefaultHooks::lazy_initialize();
  c10::impl::PyInterpreter* interpreter = getPyInterpreter();
  at::SavedTensorDefaultHooks::push_hooks(c10::SafePyObject(pack.inc_ref().ptr(), interpreter),
                                          c10::SafePyObject(unpack.inc_ref().ptr(), interpreter));
}

// The pack hooks a checkpoint pushes (forward and replay) are marked checkpoint-internal, as torch
// (>= 2.15) marks its own: torch's _current_user_saved_tensors_hooks looks past such a hook, through its
// `_user_hooks`, to the user's saved-tensor hooks (selective checkpointing routes the tensors it caches
// through them: respect_saved_tensors_hooks). A PyCFunction takes no attributes, so the hook is a small
// callable type: the C function and its `self` (a capsule), plus the user's hooks while it is pushed.
struct PackHookObject {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  PyObject* self;
  PyCFunction fn;
  PyObject* user_hooks;  // (pack, unpack) or null (None); held only while pushed (see PopHooks)
};

PyTypeObject pack_hook_type = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyObject* pack_hook_call(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  auto* h = reinterpret_cast<PackHookObject*>(self);
  if (PyVectorcall_NARGS(nargsf) != 1 || (kwnames != nullptr && PyTuple_GET_SIZE(kwnames) != 0)) {
    PyErr_SetString(PyExc_TypeError, "ckpt_ext.checkpoint: a pack hook takes one tensor");
    return nullptr;
  }
  return h->fn(h->self, args[0]);
}

void pack_hook_dealloc(PyObject* self) {
  auto* h = reinterpret_cast<PackHookObject*>(self);
  Py_XDECREF(h->self);
  Py_XDECREF(h->user_hooks);
  Py_TYPE(self)->tp_free(self);
}

PyObject* pack_hook_internal(PyObject*, void*) { Py_RETURN_TRUE; }

PyObject* pack_hook_user_hooks(PyObject* self, void*) {
  PyObject* u = reinterpret_cast<PackHookObject*>(self)->user_hooks;
  u = u != nullptr ? u : Py_None;
  Py_INCREF(u);
  return u;
}

PyGetSetDef pack_hook_getset[] = {
    {"_checkpoint_internal", pack_hook_internal, nullptr, nullptr, nullptr},
    {"_user_hooks", pack_hook_user_hooks, nullptr, nullptr, nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

void ready_pack_hook_type() {
  PyTypeObject& t = pack_hook_type;
  t.tp_name = "ckpt_ext._C._CheckpointPackHook";
  t.tp_basicsize = sizeof(PackHookObject);
  t.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL;
  t.tp_vectorcall_offset = offsetof(PackHookObject, vectorcall);
  t.tp_call = PyVectorcall_Call;
  t.tp_dealloc = pack_hook_dealloc;
  t.tp_getset = pack_hook_getset;
  if (PyType_Ready(&t) < 0) throw py::error_already_set();
}

// The (pack, unpack) pair a tensor saved now would use, past checkpoint-internal hooks, as torch's
// _current_user_saved_tensors_hooks finds it; None where torch never asks.
py::object user_hooks_now() {
  const auto& top = PyRefs::get().top_hooks;
  if (top.is_none()) return py::none();
  py::object hooks = top(false);
  while (!hooks.is_none()) {
    py::object pack = hooks[py::int_(0)];
    if (Py_TYPE(pack.ptr()) == &pack_hook_type) return pack.attr("_user_hooks");  // resolved when pushed
    if (!py::bool_(py::getattr(pack, "_checkpoint_internal", py::bool_(false)))) break;
    hooks = pack.attr("_user_hooks");
  }
  return hooks;
}

// A checkpoint's pack hook: fn(self, tensor), marked checkpoint-internal.
py::object make_pack_hook(py::handle self, PyCFunction fn) {
  py::object user_hooks = user_hooks_now();
  auto* h = PyObject_New(PackHookObject, &pack_hook_type);
  if (h == nullptr) throw py::error_already_set();
  h->vectorcall = pack_hook_call;
  h->self = self.inc_ref().ptr();
  h->fn = fn;
  h->user_hooks = user_hooks.is_none() ? nullptr : user_hooks.release().ptr();
  return py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(h));
}

PopHooks::~PopHooks() {
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);  // an error on its way out stays set, untouched
  try {
    at::SavedTensorDefaultHooks::pop_hooks();  // the pair is released here (the GIL is held)
  } catch (const std::exception& e) {
    PyErr_WarnFormat(PyExc_RuntimeWarning, 1, "ckpt_ext.checkpoint: popping its saved-tensor hooks failed: %s",
                     e.what());
    if (PyErr_Occurred()) PyErr_WriteUnraisable(nullptr);
  }
  PyErr_Restore(type, value, traceback);
  Py_CLEAR(reinterpret_cast<PackHookObject*>(pack)->user_hooks);
}

namespace {

// The forward's hooks are C functions whose `self` is a capsule owning the frame (no pybind11 dispatch
// per saved tensor), and the Holder handed to autograd is a minimal Python object (no pybind11 instance).
struct HolderObject {
  PyObject_HEAD
  std::shared_ptr<Holder> holder;
};

PyTypeObject* holder_type = nullptr;

void holder_dealloc(PyObject* self) {
  reinterpret_cast<HolderObject*>(self)->holder.~shared_ptr<Holder>();
  PyTypeObject* tp = Py_TYPE(self);
  tp->tp_free(self);
  Py_DECREF(tp);  // heap type
}

PyType_Slot holder_slots[] = {{Py_tp_dealloc, reinterpret_cast<void*>(holder_dealloc)}, {0, nullptr}};
PyType_Spec holder_spec = {"ckpt_ext._C._CheckpointHolder", sizeof(HolderObject), 0, Py_TPFLAGS_DEFAULT,
                           holder_slots};

const char* kFrameCapsule = "ckpt_ext.CheckpointFrame";

void free_frame(PyObject* capsule) {
  delete static_cast<std::shared_ptr<Frame>*>(PyCapsule_GetPointer(capsule, kFrameCapsule));
}

Frame* frame_of(PyObject* capsule) {
  auto* f = static_cast<std::shared_ptr<Frame>*>(PyCapsule_GetPointer(capsule, kFrameCapsule));
  return f == nullptr ? nullptr : f->get();
}

PyObject* forward_pack_c(PyObject* capsule, PyObject* tensor) {
  Frame* frame = frame_of(capsule);
  if (frame == nullptr) return nullptr;
  try {
    auto* obj = PyObject_New(HolderObject, holder_type);
    if (obj == nullptr) return nullptr;
    new (&obj->holder) std::shared_ptr<Holder>(frame->pack(THPVariable_Unpack(tensor)));
    return reinterpret_cast<PyObject*>(obj);
  } catch (...) {
    set_python_error();
  }
  return nullptr;
}

PyObject* forward_unpack_c(PyObject* capsule, PyObject* holder) {
  Frame* frame = frame_of(capsule);
  if (frame == nullptr) return nullptr;
  if (Py_TYPE(holder) != holder_type) {
    PyErr_SetString(PyExc_TypeError, "ckpt_ext.checkpoint: unpack hook got an object its pack hook did not make");
    return nullptr;
  }
  try {
    return THPVariable_Wrap(frame->unpack(reinterpret_cast<HolderObject*>(holder)->holder));
  } catch (...) {
    set_python_error();
  }
  return nullptr;
}

PyMethodDef forward_unpack_def = {"ckpt_ext_unpack", forward_unpack_c, METH_O, nullptr};

}  // namespace

py::object push_forward_hooks(std::shared_ptr<Frame> frame) {
  auto* owner = new std::shared_ptr<Frame>(std::move(frame));
  py::object capsule = py::reinterpret_steal<py::object>(PyCapsule_New(owner, kFrameCapsule, free_frame));
  if (!capsule) {
    delete owner;
    throw py::error_already_set();
  }
  py::object pack = make_pack_hook(capsule, forward_pack_c);
  py::object unpack = py::reinterpret_steal<py::object>(PyCFunction_New(&forward_unpack_def, capsule.ptr()));
  if (!unpack) throw py::error_already_set();
  push_hooks(pack, unpack);
  return pack;
}

void bind_hooks(py::module_& m) {
  ready_pack_hook_type();
  holder_type = reinterpret_cast<PyTypeObject*>(PyType_FromSpec(&holder_spec));
  if (holder_type == nullptr) throw py::error_already_set();
  m.attr("_CheckpointHolder") = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(holder_type));
}

}  // namespace ckpt_ext::checkpoint_detail
