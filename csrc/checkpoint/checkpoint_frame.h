// CheckpointFrame: the C++ state of one ckpt_ext.checkpoint call, in torch's non-reentrant design.
//
// The function runs in forward with grad enabled, building the real autograd graph, under saved-tensor
// hooks whose pack (Frame::pack) drops each tensor autograd would save and returns a small Holder in
// its place. The first unpack of any Holder in a backward (one per graph task) replays the function
// under the forward's RNG/autocast/device state with recompute hooks that fill the Holders in order;
// the replay stops early once every live Holder is filled, and the count and metadata of what it saved
// are checked against the forward (torch.utils.checkpoint.CheckpointError otherwise). Gradients then
// flow through the real graph: parameter hooks fire once, grad_fn is the real op, outputs are separate.
#pragma once

#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/utils/pybind.h>  // py::object and the Tensor caster; not torch/extension.h (the whole C++ frontend: ~20 s more per source to compile)

#include "../replay/replay_context.h"

#include <c10/util/SmallVector.h>

#include <memory>
#include <string>
#include <vector>

namespace ckpt_ext {

// What the forward's pack hook returns in place of a tensor: per graph task, the recomputed tensor
// (filled by the replay, handed out once).
struct Holder {
  struct Entry {
    int64_t gid;
    at::Tensor tensor;
    bool consumed = false;
  };
  std::vector<Entry> entries;  // usually one (one backward)
  Entry* find(int64_t gid);
};

struct FrameOptions {
  bool preserve_rng_state = true;
  bool check_metadata = true;  // determinism_check="default"
  bool early_stop = true;
};

// What the replay calls: function(*args, **kwargs) under the recompute context, with the training
// BatchNorm modules' running statistics put back afterwards. The tensor arguments are kept as autograd
// keeps a saved tensor (SavedVariable): outer saved-tensor hooks apply, and one modified in place since
// the forward makes the replay raise autograd's error.
struct ReplayCall {
  pybind11::object function;
  std::vector<pybind11::object> objects;  // the positional arguments; null where a tensor is saved
  std::vector<torch::autograd::SavedVariable> tensors;  // the tensor arguments, in order
  pybind11::object kwargs;      // dict or None
  pybind11::object context;     // context_fn's recompute context, or None
  pybind11::object modules;     // the modules it runs (their BatchNorms are searched at replay), or None
};

class Frame : public std::enable_shared_from_this<Frame> {
 public:
  // describe(): debug detail appended to determinism errors, or None.
  Frame(ReplayCall call, pybind11::object describe, const std::vector<c10::Device>& devices,
        const FrameOptions& options);
  ~Frame();

  std::shared_ptr<Holder> pack(const at::Tensor& x);  // forward hook
  at::Tensor unpack(const std::shared_ptr<Holder>& h);  // forward hook
  void forward_done();

  // The replay's pack hook (see recompute_hooks in the .cpp).
  pybind11::object recompute_pack(int64_t gid, const at::Tensor& x);

 private:
  struct GraphTaskState {
    int64_t gid;
    size_t counter = 0;
    bool recomputed = false;
  };
  GraphTaskState& state(int64_t gid);
  void replay(int64_t gid);
  PyObject* call_replay();  // the function on its saved arguments; new reference, or null with an error set
  void check_replay(int64_t gid);
  [[noreturn]] void fail_more_saved() const;
  [[noreturn]] void fail(const std::string& what) const;
  std::string name() const;  // the function's name, for errors (Python's _function_name)

  ReplayCall call_;
  pybind11::object describe_;
  FrameOptions options_;
  ExecutionSnapshot snapshot_;
  std::vector<std::weak_ptr<Holder>> holders_;
  struct Meta {
    c10::SmallVector<int64_t, 5> sizes;  // no allocation for up to 5 dimensions
    at::ScalarType dtype;
    c10::Device device;
  };
  std::vector<Meta> metas_;
  std::vector<GraphTaskState> tasks_;
  bool forward_completed_ = false;
  // Early stop raises through torch's C++ frames; a replay that would do nothing after the last save runs
  // to its end instead (see forward_done).
  uint64_t sequence_at_last_pack_ = 0;  // at::sequence_number after the forward's last pack
  bool last_pack_after_op_ = false;     // the last pack saved an output of the op that had just run
  bool stop_at_last_pack_ = true;       // decided by forward_done()
  bool ignore_mismatch_ = false;  // the replay of a backward run inside the forward went past it
};

// Registers checkpoint_run, the Holder type and the stop exception on the module.
void bind_checkpoint(pybind11::module_& m);

}  // namespace ckpt_ext
