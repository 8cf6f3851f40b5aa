// CheckpointFunction: a torch::autograd::Function that runs a Python callable without building a
// graph, keeps only its inputs (saved without copying) and its outputs (copied once into the
// BoundaryPool), and in backward replays the callable from C++ -- under the forward's RNG, autocast
// and device state -- to compute the gradients of the inputs and of the parameters used inside.
#pragma once

#include <torch/extension.h>

#include <string>
#include <vector>

namespace ckpt_ext {

struct CheckpointOptions {
  bool preserve_rng_state = true;
  bool determinism_check = true;
  bool debug = false;
  bool finish_hook = false;  // call runner.replay_done() after the replay's gradients are computed
};

// Runs `runner` under checkpointing.
//   runner.forward(list[Tensor]) -> list[Tensor]   in forward, grad disabled
//   runner.replay(list[Tensor])  -> list[Tensor]   in backward, on detached inputs, grad enabled
//   runner.replay_done()                          after the replay's backward (if finish_hook)
//   runner.describe()            -> str           detail for errors when debug is set
// `inputs` are the call's tensor arguments; `params` the tensors it uses without taking them as
// arguments (module parameters, captured tensors), so that their gradients flow through this node.
// Returns the forward outputs, each stored in the device's BoundaryPool.
std::vector<at::Tensor> checkpoint_apply(
    const pybind11::object& runner,
    const std::string& name,
    const std::vector<at::Tensor>& inputs,
    const std::vector<at::Tensor>& params,
    const CheckpointOptions& options);

}  // namespace ckpt_ext
