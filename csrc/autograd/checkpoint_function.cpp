#include "checkpoint_function.h"

#include "../pool/boundary_pool.h"
#include "replay_context.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <mutex>
#include <sstream>
#include <unordered_set>

namespace py = pybind11;

namespace ckpt_ext {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::Node;
using torch::autograd::variable_list;

struct OutputMeta {
  std::vector<int64_t> sizes;
  at::ScalarType dtype;
  c10::Device device;
};

// Everything backward needs besides the saved tensors. Lives in the node's context.
struct ReplayState : torch::CustomClassHolder {
  py::object runner;
  std::string name;
  CheckpointOptions options;
  size_t num_inputs = 0;
  std::vector<bool> input_requires_grad;
  // Parameters are held here rather than saved for backward: saved-tensor hooks (save_on_cpu, an
  // enclosing torch.utils.checkpoint) would copy or detach them. Their versions are checked instead.
  std::vector<at::Tensor> params;
  std::vector<uint32_t> param_versions;
  ExecutionSnapshot snapshot;
  std::vector<OutputMeta> outputs;

  ~ReplayState() override {
    if (!runner) return;
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;  // the node may die on an autograd thread
      runner = py::object();
    } else {
      runner.release();  // interpreter gone: leak rather than touch it
    }
  }
};

std::vector<at::Tensor> call_runner(const py::object& runner, const char* method, const variable_list& tensors) {
  py::list args(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) args[i] = py::cast(tensors[i]);
  return runner.attr(method)(args).cast<std::vector<at::Tensor>>();
}

std::string describe_meta(const std::vector<int64_t>& sizes, at::ScalarType dtype, c10::Device device) {
  std::ostringstream os;
  os << "Tensor(shape=" << c10::IntArrayRef(sizes) << ", dtype=" << dtype << ", device=" << device << ")";
  return os.str();
}

// The replay must produce the tensors the forward produced; otherwise gradients would silently be
// computed for a different computation.
void check_replay(const ReplayState& st, const std::vector<at::Tensor>& outs) {
  std::ostringstream why;
  if (outs.size() != st.outputs.size()) {
    why << "it returned " << outs.size() << " tensor(s) in backward but " << st.outputs.size() << " in forward";
  } else {
    for (size_t i = 0; i < outs.size(); ++i) {
      const auto& m = st.outputs[i];
      const auto& o = outs[i];
      if (o.sizes() != c10::IntArrayRef(m.sizes) || o.scalar_type() != m.dtype || o.device() != m.device) {
        why << "tensor output " << i << " was " << describe_meta(m.sizes, m.dtype, m.device) << " in forward but "
            << describe_meta(o.sizes().vec(), o.scalar_type(), o.device()) << " when replayed in backward";
        break;
      }
    }
  }
  const std::string reason = why.str();
  if (reason.empty()) return;
  std::string detail;
  if (st.options.debug) {
    py::gil_scoped_acquire gil;
    detail = "\n" + st.runner.attr("describe")().cast<std::string>();
  } else {
    detail = "\nPass debug=True to ckpt_ext.checkpoint to see the operators run in forward and in the replay.";
  }
  TORCH_CHECK(false, "ckpt_ext.checkpoint: the replay of `", st.name, "` differs from its forward: ", reason,
              ". The checkpointed function must compute the same tensors when called again with the same "
              "inputs and RNG state (no dependence on global state that changes between forward and backward). "
              "determinism_check=\"none\" disables this check.", detail);
}

// Leaves that the replay reaches but that were not passed to the node (a parameter the wrapper could
// not discover). Walks the replay graph from its outputs, stopping at the node's own inputs. Inputs
// are recognised by their TensorImpl (leaves) or grad_fn (non-leaves); no grad accumulator is created.
variable_list undiscovered_leaves(const variable_list& outs, const variable_list& known) {
  std::unordered_set<const c10::TensorImpl*> known_leaves;
  std::unordered_set<const Node*> stop;
  for (const auto& t : known) {
    if (auto fn = t.grad_fn())
      stop.insert(fn.get());
    else
      known_leaves.insert(t.unsafeGetTensorImpl());
  }
  variable_list found;
  std::unordered_set<const c10::TensorImpl*> found_set;
  auto leaf = [&](const at::Tensor& v) {
    if (v.defined() && !known_leaves.count(v.unsafeGetTensorImpl()) && found_set.insert(v.unsafeGetTensorImpl()).second)
      found.push_back(v);
  };
  std::unordered_set<const Node*> seen;
  std::vector<Node*> stack;
  for (const auto& o : outs) {
    if (auto fn = o.grad_fn())
      stack.push_back(fn.get());
    else
      leaf(o);  // an output that is itself a leaf
  }
  while (!stack.empty()) {
    Node* node = stack.back();
    stack.pop_back();
    if (stop.count(node) || !seen.insert(node).second) continue;
    if (auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(node)) {
      leaf(acc->variable);
      continue;
    }
    for (const auto& e : node->next_edges())
      if (e.is_valid()) stack.push_back(e.function.get());
  }
  return found;
}

void warn_undiscovered_once(const std::string& name, const variable_list& leaves) {
  static std::mutex m;
  static std::unordered_set<std::string> warned;
  {
    std::lock_guard<std::mutex> lock(m);
    if (!warned.insert(name).second) return;
  }
  std::ostringstream shapes;
  for (size_t i = 0; i < leaves.size() && i < 4; ++i) shapes << (i ? ", " : "") << leaves[i].sizes();
  if (leaves.size() > 4) shapes << ", ...";
  TORCH_WARN("ckpt_ext.checkpoint: `", name, "` uses ", leaves.size(),
             " tensor(s) requiring grad that were neither arguments nor discoverable from the function "
             "(shapes ", shapes.str(), "). Their gradients are accumulated into .grad directly, as "
             "reentrant torch.utils.checkpoint does, which bypasses gradient hooks (DDP, FSDP) and "
             "torch.autograd.grad. Pass a module, bound method, functools.partial or closure that holds "
             "them, or pass them as arguments.");
}

struct CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
  // tensors = the call's tensor inputs followed by the parameters it uses.
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<ReplayState> st, at::TensorList tensors) {
    const size_t n_in = st->num_inputs;
    std::vector<c10::Device> devices;
    for (size_t i = 0; i < tensors.size(); ++i) {
      const auto& t = tensors[i];
      TORCH_CHECK(t.is_cpu() || t.is_cuda(), "ckpt_ext.checkpoint: `", st->name, "` got ",
                  i < n_in ? "tensor argument " : "parameter ", i < n_in ? i : i - n_in, " on device ", t.device(),
                  "; ckpt_ext checkpoints CPU and CUDA tensors only. Run the function without checkpointing, or "
                  "use torch.utils.checkpoint.checkpoint for other devices.");
      devices.push_back(t.device());
    }
    st->snapshot = ExecutionSnapshot::capture(devices, st->options.preserve_rng_state);

    variable_list inputs(tensors.begin(), tensors.begin() + static_cast<std::ptrdiff_t>(n_in));
    std::vector<uint32_t> versions;
    versions.reserve(n_in);
    for (const auto& t : inputs) versions.push_back(t._version());

    std::vector<at::Tensor> outs = call_runner(st->runner, "forward", inputs);

    for (size_t i = 0; i < n_in; ++i) {
      TORCH_CHECK(inputs[i]._version() == versions[i], "ckpt_ext.checkpoint: `", st->name,
                  "` modified its tensor argument ", i, " in place. A checkpointed function is run again in "
                  "backward on its saved inputs, so it must not modify them; clone the argument first.");
    }

    variable_list result;
    variable_list non_differentiable;
    result.reserve(outs.size());
    st->outputs.reserve(outs.size());
    for (size_t i = 0; i < outs.size(); ++i) {
      const auto& o = outs[i];
      TORCH_CHECK(o.layout() == c10::kStrided && (o.is_cpu() || o.is_cuda()), "ckpt_ext.checkpoint: `", st->name,
                  "` returned tensor output ", i, " with layout ", o.layout(), " on ", o.device(),
                  "; the boundary pool holds dense (strided) CPU and CUDA tensors only. Return a dense tensor "
                  "(.to_dense()), or use torch.utils.checkpoint.checkpoint for this function.");
      TORCH_CHECK(!o.key_set().has(c10::DispatchKey::Python), "ckpt_ext.checkpoint: `", st->name,
                  "` returned tensor output ", i, " that is a tensor subclass with __torch_dispatch__ (e.g. DTensor); "
                  "ckpt_ext would store it as a plain tensor. Return a plain tensor (e.g. .to_local() / "
                  ".full_tensor()), or use torch.utils.checkpoint.checkpoint for this function.");
    }
    for (auto& o : outs) {
      st->outputs.push_back({o.sizes().vec(), o.scalar_type(), o.device()});
      // The boundary goes into the pool once; the function's own output is released right away.
      at::Tensor pooled = BoundaryPool::for_device(o.device())->store(o);
      o.reset();
      if (!c10::isFloatingType(pooled.scalar_type()) && !c10::isComplexType(pooled.scalar_type()))
        non_differentiable.push_back(pooled);
      result.push_back(std::move(pooled));
    }
    st->input_requires_grad.reserve(n_in);
    for (const auto& t : inputs) st->input_requires_grad.push_back(t.requires_grad());
    st->params.assign(tensors.begin() + static_cast<std::ptrdiff_t>(n_in), tensors.end());
    for (const auto& p : st->params) st->param_versions.push_back(p._version());
    ctx->save_for_backward(inputs);
    if (!non_differentiable.empty()) ctx->mark_non_differentiable(non_differentiable);
    ctx->set_materialize_grads(false);
    ctx->saved_data["state"] = at::IValue::make_capsule(st);
    return result;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto st = c10::static_intrusive_pointer_cast<ReplayState>(ctx->saved_data.at("state").toCapsule());
    variable_list saved = ctx->get_saved_variables();  // version checks, second-backward check
    const size_t n_in = st->num_inputs;
    const size_t n_all = n_in + st->params.size();
    variable_list result(1 + n_all);  // slot 0: the state argument
    for (size_t j = 0; j < st->params.size(); ++j) {
      TORCH_CHECK(st->params[j]._version() == st->param_versions[j], "ckpt_ext.checkpoint: a parameter of `",
                  st->name, "` (shape ", st->params[j].sizes(), ") was modified in place between forward and "
                  "backward (for example by optimizer.step()); the replay would use the new values. Run "
                  "backward before updating parameters.");
    }

    std::vector<size_t> wanted;  // which of the node's tensor inputs need a gradient now
    for (size_t i = 0; i < n_all; ++i)
      if (ctx->needs_input_grad(i)) wanted.push_back(i);
    bool any_grad_output = false;
    for (const auto& g : grad_outputs) any_grad_output = any_grad_output || g.defined();
    if (wanted.empty() || !any_grad_output) return result;

    // Double backward (create_graph): the replay must hang off the real inputs so that the gradients
    // it produces are differentiable with respect to them. Otherwise it runs on detached inputs, so
    // that the replay's backward stops at this node.
    const bool create_graph = at::GradMode::is_enabled();
    variable_list detached(n_in);
    for (size_t i = 0; i < n_in; ++i) {
      if (create_graph && saved[i].requires_grad()) {
        detached[i] = saved[i];
        continue;
      }
      detached[i] = saved[i].detach();
      if (st->input_requires_grad[i]) detached[i].requires_grad_(true);
    }

    // Restores side effects of the replay (BatchNorm statistics) however backward ends.
    struct FinishHook {
      ReplayState* st;
      ~FinishHook() {
        if (!st->options.finish_hook) return;
        py::gil_scoped_acquire gil;
        try {
          st->runner.attr("replay_done")();
        } catch (py::error_already_set& e) {
          e.discard_as_unraisable(__func__);
        }
      }
    } finish{st.get()};

    std::vector<at::Tensor> outputs;
    {
      ReplayGuard guard(st->snapshot);
      at::AutoGradMode grad_mode(true);
      py::gil_scoped_acquire gil;
      outputs = call_runner(st->runner, "replay", detached);
    }

    if (st->options.determinism_check) check_replay(*st, outputs);

    variable_list outs, gouts;
    for (size_t k = 0; k < outputs.size() && k < grad_outputs.size(); ++k) {
      if (grad_outputs[k].defined() && outputs[k].requires_grad()) {
        outs.push_back(outputs[k]);
        gouts.push_back(grad_outputs[k]);
      }
    }
    if (outs.empty()) return result;

    variable_list targets;
    targets.reserve(wanted.size());
    for (size_t i : wanted) targets.push_back(i < n_in ? detached[i] : st->params[i - n_in]);
    // Every tensor input of the node is known, wanted now or not (torch.autograd.grad may ask for a
    // subset); only leaves outside that set were missed by the wrapper.
    variable_list known;
    known.reserve(n_all);
    for (size_t i = 0; i < n_all; ++i) {
      const at::Tensor& t = i < n_in ? detached[i] : st->params[i - n_in];
      if (t.requires_grad()) known.push_back(t);
    }
    variable_list extra = undiscovered_leaves(outs, known);
    if (!extra.empty()) {
      warn_undiscovered_once(st->name, extra);
      targets.insert(targets.end(), extra.begin(), extra.end());
    }

    variable_list grads = torch::autograd::grad(outs, targets, gouts, /*retain_graph=*/create_graph,
                                                create_graph, /*allow_unused=*/true);
    for (size_t j = 0; j < wanted.size(); ++j) result[1 + wanted[j]] = grads[j];
    for (size_t j = 0; j < extra.size(); ++j) {
      const at::Tensor& g = grads[wanted.size() + j];
      if (!g.defined()) continue;
      at::AutoGradMode accumulate_mode(create_graph);
      at::Tensor& slot = extra[j].mutable_grad();
      slot = slot.defined() ? slot + g : g.clone(at::MemoryFormat::Contiguous);
    }
    return result;
  }
};

}  // namespace

std::vector<at::Tensor> checkpoint_apply(const py::object& runner, const std::string& name,
                                         const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& params,
                                         const CheckpointOptions& options) {
  auto st = c10::make_intrusive<ReplayState>();
  st->runner = runner;
  st->name = name;
  st->options = options;
  st->num_inputs = inputs.size();
  std::vector<at::Tensor> all;
  all.reserve(inputs.size() + params.size());
  all.insert(all.end(), inputs.begin(), inputs.end());
  all.insert(all.end(), params.begin(), params.end());
  return CheckpointFunction::apply(st, at::TensorList(all));
}

}  // namespace ckpt_ext
