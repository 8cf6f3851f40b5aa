#include "checkpoint_frame.h"

#include <ATen/SavedTensorHooks.h>
#include <ATen/SequenceNumber.h>
#include <torch/csrc/PyInterpreter.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <pybind11/eval.h>

#include <algorithm>
#include <atomic>
#include <sstream>

namespace py = pybind11;

namespace ckpt_ext {
namespace {

// Raised by the replay's pack hook once every live Holder is filled (early stop); caught by the replay.
struct StopRecomputation : std::exception {
  const char* what() const noexcept override { return "ckpt_ext: recomputation stopped early"; }
};

std::atomic<int64_t> frames_created{0};  // tests count engine entries with it (e.g. under torch.compile)

PyObject* stop_type = nullptr;  // ckpt_ext._C._StopRecomputation, set by bind_checkpoint

// Python objects looked up once and kept for the life of the process (never destroyed: the
// interpreter may be gone when static destructors run).
struct PyRefs {
  py::object checkpoint_error;  // torch.utils.checkpoint.CheckpointError
  py::object get_exec_group;  // torch._C._get_graph_exec_group, None on torches without it
  // torch._C._autograd._top_saved_tensors_default_hooks, where torch looks past checkpoint-internal
  // hooks for the user's (torch >= 2.15: respect_saved_tensors_hooks); None where torch never does.
  py::object top_hooks;

  static PyRefs& get() {
    static PyRefs* refs = [] {
      auto* r = new PyRefs();
      r->checkpoint_error = py::module_::import("torch.utils.checkpoint").attr("CheckpointError");
      auto autograd = py::module_::import("torch._C._autograd");
      r->get_exec_group = py::getattr(py::module_::import("torch._C"), "_get_graph_exec_group", py::none());
      const bool torch_looks_past = py::hasattr(py::module_::import("torch.utils.checkpoint"),
                                                "_current_user_saved_tensors_hooks");
      r->top_hooks = torch_looks_past ? py::object(autograd.attr("_top_saved_tensors_default_hooks")) : py::none();
      return r;
    }();
    return *refs;
  }
};

// ckpt_ext/checkpoint.py's helpers for what is rare or must be Python (names for errors, nested
// containers, BatchNorm discovery in closures, contexts), and the types the replay checks.
struct PyHelpers {
  py::object module_type;     // torch.nn.Module
  py::object batchnorm_type;  // torch.nn.modules.batchnorm._BatchNorm
  py::object pytree_nodes;    // torch.utils._pytree.SUPPORTED_NODES: the types pytree flattens
  py::object module_call, module_call_impl;  // nn.Module.__call__ and _call_impl (plain functions)
  py::object partial_type;                   // functools.partial
  py::object function_name, devices, batchnorms_of, replay_guarded, replay_note, inputs_changed;

  static PyHelpers& get() {
    static PyHelpers* helpers = [] {
      auto* h = new PyHelpers();
      h->module_type = py::module_::import("torch.nn").attr("Module");
      h->batchnorm_type = py::module_::import("torch.nn.modules.batchnorm").attr("_BatchNorm");
      h->pytree_nodes = py::module_::import("torch.utils._pytree").attr("SUPPORTED_NODES");
      h->module_call = h->module_type.attr("__call__");
      h->module_call_impl = h->module_type.attr("_call_impl");
      h->partial_type = py::module_::import("functools").attr("partial");
      auto m = py::module_::import("ckpt_ext.checkpoint");
      h->function_name = m.attr("_function_name");
      h->devices = m.attr("_devices");
      h->batchnorms_of = m.attr("_batchnorms_of");
      h->replay_guarded = m.attr("_replay_guarded");
      h->replay_note = m.attr("_replay_note");
      h->inputs_changed = m.attr("_check_inputs_unchanged");
      return h;
    }();
    return *helpers;
  }
};

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

// The C++ exception being handled, as the Python error of a C function returning null, translated as
// torch translates its own (a Python error raised by code torch called, e.g. an outer saved-tensor hook,
// as it was; c10::IndexError as IndexError, ...).
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

[[noreturn]] void raise_checkpoint_error(const std::string& msg) {
  PyErr_SetString(PyRefs::get().checkpoint_error.ptr(), msg.c_str());
  throw py::error_already_set();
}

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

// The backward a replay belongs to: torch's GraphExecGroup if one is active, else the graph task;
// outside any backward (grad_fn._saved_* inspection) every unpack is its own task, as in torch.
int64_t current_gid() {
  static std::atomic<int64_t> outside{-2};
  const std::optional<int64_t> tls_group = exec_group_in_tls(c10::AutogradState::get_tls_state(), 0);
  if (tls_group.has_value()) {
    if (*tls_group != -1) return *tls_group;
  } else if (const auto& get_group = PyRefs::get().get_exec_group; !get_group.is_none()) {
    py::object group = get_group();
    if (!group.is_none()) return static_cast<int64_t>(reinterpret_cast<intptr_t>(group.ptr()));
  }
  int64_t gid = torch::autograd::get_current_graph_task_id();
  return gid == -1 ? outside.fetch_sub(1) : gid;
}

std::string describe_meta(c10::IntArrayRef sizes, at::ScalarType dtype, c10::Device device) {
  std::ostringstream os;
  os << "shape=" << sizes << ", dtype=" << dtype << ", device=" << device;
  return os.str();
}

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

// Pops a checkpoint's saved-tensor hooks however the forward or the replay ends, and drops the pack
// hook's reference to the user's hooks (the graph keeps the pack hook where gc cannot see it).
struct PopHooks {
  PyObject* pack;
  ~PopHooks() {
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
};

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

Holder::Entry* Holder::find(int64_t gid) {
  for (auto& e : entries)
    if (e.gid == gid) return &e;
  return nullptr;
}

Frame::Frame(ReplayCall call, py::object describe, const std::vector<c10::Device>& devices,
             const FrameOptions& options)
    : call_(std::move(call)),
      describe_(std::move(describe)),
      options_(options),
      snapshot_(ExecutionSnapshot::capture(devices, options.preserve_rng_state)) {
  frames_created.fetch_add(1, std::memory_order_relaxed);
}

Frame::~Frame() {
  if (Py_IsInitialized()) {
    py::gil_scoped_acquire gil;  // the last reference may go on an autograd thread
    call_ = ReplayCall();
    describe_ = py::object();
  } else {  // interpreter gone: leak rather than touch it
    call_.function.release();
    for (auto& o : call_.objects) o.release();
    call_.kwargs.release();
    call_.context.release();
    call_.modules.release();
    new std::vector<torch::autograd::SavedVariable>(std::move(call_.tensors));  // may hold Python hooks
    describe_.release();
  }
}

std::string Frame::name() const {
  try {
    return PyHelpers::get().function_name(call_.function).cast<std::string>();
  } catch (py::error_already_set&) {
    return "<function>";
  }
}

std::shared_ptr<Holder> Frame::pack(const at::Tensor& x) {
  auto h = std::make_shared<Holder>();
  holders_.push_back(h);
  if (options_.check_metadata) metas_.push_back({c10::SmallVector<int64_t, 5>(x.sizes().begin(), x.sizes().end()), x.scalar_type(), x.device()});
  sequence_at_last_pack_ = at::sequence_number::peek();
  return h;
}

void Frame::forward_done() {
  forward_completed_ = true;
  // Every autograd node takes a sequence number when it is created: none taken since the last pack means
  // no differentiable op followed it, and stopping the replay there would skip nothing worth a throw.
  stop_at_last_pack_ = at::sequence_number::peek() != sequence_at_last_pack_;
}

Frame::GraphTaskState& Frame::state(int64_t gid) {
  for (auto& t : tasks_)
    if (t.gid == gid) return t;
  tasks_.push_back({gid});
  return tasks_.back();
}

at::Tensor Frame::unpack(const std::shared_ptr<Holder>& h) {
  const int64_t gid = current_gid();
  if (!state(gid).recomputed) {
    replay(gid);
    state(gid).recomputed = true;  // tasks_ may have grown during the replay: look it up again
    check_replay(gid);
  }
  Holder::Entry* e = h->find(gid);
  TORCH_INTERNAL_ASSERT(e != nullptr, "ckpt_ext.checkpoint: a saved tensor of `", name(), "` was not recomputed");
  if (e->consumed) {
    raise_checkpoint_error(
        "ckpt_ext.checkpoint (torch.utils.checkpoint semantics): Unpack is being triggered for a tensor that was "
        "already unpacked once. If you are calling ctx.saved_tensors in backward, make sure to do so only once.");
  }
  e->consumed = true;
  return std::move(e->tensor);
}

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
  const size_t index = st.counter++;
  if (index >= holders_.size()) {
    TORCH_INTERNAL_ASSERT(!options_.early_stop || !forward_completed_);
    if (!forward_completed_) {
      // A backward inside the forward replays a forward that had not finished saving yet.
      ignore_mismatch_ = true;
      return py::cast(keep);
    }
    fail("the replay saved more tensors for backward than the forward did (" + std::to_string(holders_.size()) + ")");
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

void Frame::check_replay(int64_t gid) {
  if (ignore_mismatch_) return;
  const size_t count = state(gid).counter;
  if (count != holders_.size()) {
    fail("a different number of tensors was saved for backward during the original forward and the "
         "recomputation.\nNumber of tensors saved during forward: " + std::to_string(holders_.size()) +
         "\nNumber of tensors saved during recomputation: " + std::to_string(count));
  }
  if (!options_.check_metadata) return;
  std::optional<std::ostringstream> diff;  // made only on a mismatch: constructing a stream costs ~1 µs
  for (size_t i = 0; i < holders_.size(); ++i) {
    auto h = holders_[i].lock();
    if (!h) continue;
    Holder::Entry* e = h->find(gid);
    TORCH_INTERNAL_ASSERT(e != nullptr && !e->consumed);
    const Meta& m = metas_[i];
    const at::Tensor& t = e->tensor;
    const c10::IntArrayRef sizes(m.sizes.data(), m.sizes.size());
    if (t.sizes() != sizes || t.scalar_type() != m.dtype || t.device() != m.device) {
      if (!diff) diff.emplace();
      *diff << "\ntensor at position " << i << ":\n  saved metadata: " << describe_meta(sizes, m.dtype, m.device)
            << "\n  recomputed metadata: " << describe_meta(t.sizes(), t.scalar_type(), t.device());
    }
  }
  if (diff) fail("recomputed values for the following tensors have different metadata than during the forward "
                 "pass:" + diff->str());
}

void Frame::fail(const std::string& what) const {
  std::string detail;
  if (describe_ && !describe_.is_none()) {
    detail = "\n" + describe_().cast<std::string>();
  } else {
    detail = "\nPass debug=True to ckpt_ext.checkpoint to see the operators run in forward and in the replay.";
  }
  raise_checkpoint_error("ckpt_ext.checkpoint: the replay of `" + name() + "` differs from its forward: " + what +
                         ".\nThe checkpointed function must compute the same tensors when called again with the same "
                         "inputs and RNG state (no dependence on global state that changes between forward and "
                         "backward). determinism_check=\"none\" disables the metadata check." + detail);
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

// A checkpoint's positional arguments as the replay gets them, and the _version of each tensor among them
// when it was saved (checked after the forward).
struct SavedInputs {
  ReplayCall call;
  std::vector<uint32_t> versions;
};

SavedInputs save_inputs(PyObject* function, PyObject* args, PyObject* kwargs, PyObject* context, PyObject* modules) {
  SavedInputs s;
  s.call.function = py::reinterpret_borrow<py::object>(function);
  s.call.kwargs = py::reinterpret_borrow<py::object>(kwargs);
  s.call.context = py::reinterpret_borrow<py::object>(context);
  if (modules != Py_None && !PyList_Check(modules) && !PyTuple_Check(modules)) {
    PyErr_SetString(PyExc_TypeError, "checkpoint_run: modules must be a list, a tuple or None");
    throw py::error_already_set();
  }
  s.call.modules = py::reinterpret_borrow<py::object>(modules);
  const Py_ssize_t n = PyTuple_GET_SIZE(args);
  s.call.objects.resize(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* a = PyTuple_GET_ITEM(args, i);
    if (THPVariable_Check(a)) {
      const at::Tensor& t = THPVariable_Unpack(a);
      s.versions.push_back(t._version());
      // As autograd saves a tensor: outer saved-tensor hooks (save_on_cpu) apply here, before the
      // checkpoint's own are pushed.
      s.call.tensors.emplace_back(t, /*is_output=*/false);
    } else {
      s.call.objects[static_cast<size_t>(i)] = py::reinterpret_borrow<py::object>(a);
    }
  }
  return s;
}

// Adds the non-CPU devices of the tensors in `obj`, walking plain lists, tuples and dicts as torch's pytree
// does; false (nothing decided) where another pytree node may hide tensors (a namedtuple, an OrderedDict, a
// registered type such as a Hugging Face ModelOutput): the caller asks pytree then.
bool add_devices(PyObject* obj, PyObject* pytree_nodes, std::vector<c10::Device>& devices, int depth) {
  if (THPVariable_Check(obj)) {
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (!t.is_cpu() && !t.is_meta()) devices.push_back(t.device());  // as torch: meta has no generator
    return true;
  }
  if (depth > 32) return false;
  if (PyTuple_CheckExact(obj) || PyList_CheckExact(obj)) {
    PyObject* seq = obj;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < n; ++i)
      if (!add_devices(PySequence_Fast_GET_ITEM(seq, i), pytree_nodes, devices, depth + 1)) return false;
    return true;
  }
  if (PyDict_CheckExact(obj)) {
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(obj, &pos, &key, &value))
      if (!add_devices(value, pytree_nodes, devices, depth + 1)) return false;
    return true;
  }
  if (PyTuple_Check(obj) || PyList_Check(obj) || PyDict_Check(obj)) return false;  // subclasses: pytree decides
  const int node = PyDict_Contains(pytree_nodes, reinterpret_cast<PyObject*>(Py_TYPE(obj)));
  if (node < 0) throw py::error_already_set();
  return node == 0;  // a leaf unless its type is a registered pytree node
}

// The devices of the call's tensors, positional and keyword, anywhere in their pytrees, whose generators
// are snapshotted: all but CPU (its generator is always) and meta (none), as torch's get_device_states.
std::vector<c10::Device> devices_of(PyObject* args, PyObject* kwargs) {
  std::vector<c10::Device> devices;
  PyObject* nodes = PyHelpers::get().pytree_nodes.ptr();
  if (add_devices(args, nodes, devices, 0) && (kwargs == Py_None || add_devices(kwargs, nodes, devices, 0)))
    return devices;
  py::object found = PyHelpers::get().devices(py::handle(args), py::handle(kwargs));
  return found.cast<std::vector<c10::Device>>();
}

bool truth(PyObject* o) {
  const int t = PyObject_IsTrue(o);
  if (t < 0) throw py::error_already_set();
  return t == 1;
}

// checkpoint_run(function, call, args, kwargs, recompute_context, modules, describe, preserve_rng_state,
// check_metadata, early_stop): one checkpointed forward -- inputs saved, frame (RNG/autocast snapshot),
// hooks pushed, call(*args, **kwargs), hooks popped, inputs checked unchanged -- in one call from Python.
// `call` is `function`, or `function` inside the forward context; the replay calls `function` on the saved
// arguments under `recompute_context` (None: none). modules: the modules the function runs (a list or
// tuple), whose training BatchNorms' statistics the replay puts back, searched at replay; None: the function
// itself if it is a module, else what discovery finds in it.
// A METH_FASTCALL function: it runs once per checkpointed call.
PyObject* checkpoint_run_impl(PyObject* const* argv) {
  PyObject *function = argv[0], *call = argv[1], *args = argv[2], *kwargs = argv[3];
  if (!PyTuple_Check(args) || (kwargs != Py_None && !PyDict_Check(kwargs))) {
    PyErr_SetString(PyExc_TypeError, "checkpoint_run: args must be a tuple and kwargs a dict or None");
    return nullptr;
  }
  FrameOptions o;
  o.preserve_rng_state = truth(argv[7]);
  o.check_metadata = truth(argv[8]);
  o.early_stop = truth(argv[9]);
  SavedInputs inputs = save_inputs(function, args, kwargs, argv[4], argv[5]);
  const std::vector<c10::Device> devices = devices_of(args, kwargs);
  auto frame = std::make_shared<Frame>(std::move(inputs.call), py::reinterpret_borrow<py::object>(argv[6]), devices, o);
  Frame* raw = frame.get();
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
  PyObject* out = PyObject_Call(call, args, kwargs == Py_None ? nullptr : kwargs);
  if (out == nullptr) {
    py::error_already_set error;  // taken out of the indicator: popping the hooks calls Python
    { PopHooks pop{pack.ptr()}; }
    throw error;
  }
  py::object result = py::reinterpret_steal<py::object>(out);
  { PopHooks pop{pack.ptr()}; }
  raw->forward_done();
  if (!inputs.versions.empty()) {
    size_t k = 0;
    bool changed = false;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args); ++i) {
      PyObject* a = PyTuple_GET_ITEM(args, i);
      if (THPVariable_Check(a)) changed = changed || THPVariable_Unpack(a)._version() != inputs.versions[k++];
    }
    if (changed) {  // Python names the argument, and raises
      py::list versions;
      for (uint32_t v : inputs.versions) versions.append(v);
      PyHelpers::get().inputs_changed(py::handle(function), py::handle(args), versions);
    }
  }
  return result.release().ptr();
}

PyObject* checkpoint_run(PyObject*, PyObject* const* argv, Py_ssize_t nargs) {
  if (nargs != 10) {
    PyErr_Format(PyExc_TypeError, "checkpoint_run takes 10 positional arguments (%zd given)", nargs);
    return nullptr;
  }
  try {
    return checkpoint_run_impl(argv);
  } catch (...) {
    set_python_error();
  }
  return nullptr;
}

PyMethodDef checkpoint_run_def = {
    "checkpoint_run", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(checkpoint_run)), METH_FASTCALL,
    "checkpoint_run(function, call, args, kwargs, recompute_context, modules, describe, preserve_rng_state, "
    "check_metadata, early_stop): one checkpointed forward"};

}  // namespace

void bind_checkpoint(py::module_& m) {
  stop_type = py::register_exception<StopRecomputation>(m, "_StopRecomputation").ptr();
  ready_pack_hook_type();
  holder_type = reinterpret_cast<PyTypeObject*>(PyType_FromSpec(&holder_spec));
  if (holder_type == nullptr) throw py::error_already_set();
  m.attr("_CheckpointHolder") = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(holder_type));
  m.def("checkpoint_frames_created", [] { return frames_created.load(); });
  PyObject* run = PyCFunction_New(&checkpoint_run_def, nullptr);
  if (run == nullptr) throw py::error_already_set();
  m.add_object("checkpoint_run", py::reinterpret_steal<py::object>(run));
}

}  // namespace ckpt_ext
