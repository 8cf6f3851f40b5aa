#include "checkpoint_internal.h"

#include <ATen/SequenceNumber.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/autograd/variable.h>

#include <atomic>

namespace ckpt_ext {

using namespace checkpoint_detail;

namespace {

std::atomic<int64_t> frames_created{0};  // tests count engine entries with it (e.g. under torch.compile)

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

std::shared_ptr<Holder> Frame::pack(const at::Tensor& x) {
  auto h = std::make_shared<Holder>();
  holders_.push_back(h);
  if (options_.check_metadata) metas_.push_back({c10::SmallVector<int64_t, 5>(x.sizes().begin(), x.sizes().end()), x.scalar_type(), x.device()});
  // Autograd saves an op's inputs before the op runs and its outputs after: an output of the newest autograd
  // node (each takes a sequence number when created, before its saves) means the op has run.
  sequence_at_last_pack_ = at::sequence_number::peek();
  const torch::autograd::Node* fn = torch::autograd::impl::grad_fn_unsafe(x);  // a view's is not regenerated here
  last_pack_after_op_ = fn != nullptr && fn->sequence_nr() + 1 == sequence_at_last_pack_;
  return h;
}

void Frame::forward_done() {
  forward_completed_ = true;
  // Early stop raises through torch's C++ frames: worth it unless the replay would do nothing after the last
  // save -- saved by an op that had already run (an output; not an input, nor a tensor without grad_fn, which
  // may be either), with no autograd node created after it. Then the replay runs to its end instead, and a
  // replay that saves more than the forward did stops at the first extra save (recompute_pack).
  stop_at_last_pack_ = !last_pack_after_op_ || at::sequence_number::peek() != sequence_at_last_pack_;
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
    raise_unpacked_twice();
  }
  e->consumed = true;
  return std::move(e->tensor);
}

namespace {

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
  py::object pack = push_forward_hooks(std::move(frame));
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
  bind_replay(m);
  bind_hooks(m);
  m.def("checkpoint_frames_created", [] { return frames_created.load(); });
  PyObject* run = PyCFunction_New(&checkpoint_run_def, nullptr);
  if (run == nullptr) throw py::error_already_set();
  m.add_object("checkpoint_run", py::reinterpret_steal<py::object>(run));
}

}  // namespace ckpt_ext
