// Private to csrc/checkpoint/: what its sources share. checkpoint_frame.cpp holds the frame's state and
// checkpoint_run; checkpoint_hooks.cpp the saved-tensor hooks (pushing and popping them, the forward's pack
// and unpack as C functions, the backward a replay belongs to); checkpoint_replay.cpp the replay and its
// early stop; checkpoint_checks.cpp the determinism checks and their messages (debug output included).
#pragma once

#include "checkpoint_frame.h"

#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

namespace ckpt_ext::checkpoint_detail {

namespace py = pybind11;

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

// The C++ exception being handled, as the Python error of a C function returning null, translated as
// torch translates its own (a Python error raised by code torch called, e.g. an outer saved-tensor hook,
// as it was; c10::IndexError as IndexError, ...).
void set_python_error();

// --- checkpoint_hooks.cpp
// The backward a replay belongs to: torch's GraphExecGroup if one is active, else the graph task;
// outside any backward (grad_fn._saved_* inspection) every unpack is its own task, as in torch.
int64_t current_gid();
bool in_exec_group();  // a torch.utils.checkpoint.GraphExecGroup is active
void push_hooks(const py::object& pack, const py::object& unpack);
py::object make_pack_hook(py::handle self, PyCFunction fn);  // fn(self, tensor), marked checkpoint-internal
// Pushes the forward's hooks (pack: Frame::pack, unpack: Frame::unpack) for `frame`; returns the pack hook.
py::object push_forward_hooks(std::shared_ptr<Frame> frame);
// Pops a checkpoint's saved-tensor hooks however the forward or the replay ends, and drops the pack
// hook's reference to the user's hooks (the graph keeps the pack hook where gc cannot see it).
struct PopHooks {
  PyObject* pack;
  ~PopHooks();
};
void bind_hooks(py::module_& m);  // the hook and Holder types

// --- checkpoint_replay.cpp
void bind_replay(py::module_& m);  // the stop exception

// --- checkpoint_checks.cpp
[[noreturn]] void raise_checkpoint_error(const std::string& msg);
[[noreturn]] void raise_unpacked_twice();  // torch's message, with its GraphExecGroup hint

}  // namespace ckpt_ext::checkpoint_detail
