// The determinism checks of a replay (count and metadata of the tensors it saved against the forward's)
// and the errors a checkpoint raises, in torch's words where code matches on them; debug=True's detail.
#include "checkpoint_internal.h"

#include <optional>
#include <sstream>

namespace ckpt_ext {

using namespace checkpoint_detail;

namespace {

std::string describe_meta(c10::IntArrayRef sizes, at::ScalarType dtype, c10::Device device) {
  std::ostringstream os;
  os << "shape=" << sizes << ", dtype=" << dtype << ", device=" << device;
  return os.str();
}

}  // namespace

namespace checkpoint_detail {

[[noreturn]] void raise_checkpoint_error(const std::string& msg) {
  PyErr_SetString(PyRefs::get().checkpoint_error.ptr(), msg.c_str());
  throw py::error_already_set();
}

}  // namespace checkpoint_detail

std::string Frame::name() const {
  try {
    return PyHelpers::get().function_name(call_.function).cast<std::string>();
  } catch (py::error_already_set&) {
    return "<function>";
  }
}

void Frame::check_replay(int64_t gid) {
  if (ignore_mismatch_) return;
  const size_t count = state(gid).counter;
  if (count != holders_.size()) {
    fail("A different number of tensors was saved during the original forward and recomputation.\n"
         "Number of tensors saved during forward: " + std::to_string(holders_.size()) +
         "\nNumber of tensors saved during recomputation: " + std::to_string(count) + ".");
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
  if (diff) fail("Recomputed values for the following tensors have different metadata than during the forward "
                 "pass." + diff->str());
}

void Frame::fail_more_saved() const {
  fail("trying to save more tensors during recomputation than during the original forward pass (" +
       std::to_string(holders_.size()) + ").");
}

// `what` starts with torch's own sentence (code and tests match on it), then says what to do.
void Frame::fail(const std::string& what) const {
  std::string detail;
  if (describe_ && !describe_.is_none()) {
    // torch's sentence (tests match on it), then the operators of the forward and the replay.
    detail = "\nYou are seeing this error because you passed `debug=True` to checkpoint (ckpt_ext.checkpoint or "
             "torch.utils.checkpoint.checkpoint, or set_checkpoint_debug_enabled(True)); the operators run in forward "
             "and in the replay:\n" + describe_().cast<std::string>();
  } else {
    detail = "\nPass debug=True to ckpt_ext.checkpoint to see the operators run in forward and in the replay.";
  }
  raise_checkpoint_error("ckpt_ext.checkpoint: the replay of `" + name() + "` differs from its forward. " + what +
                         "\nThe checkpointed function must compute the same tensors when called again with the same "
                         "inputs and RNG state (no dependence on global state that changes between forward and "
                         "backward). determinism_check=\"none\" disables the metadata check." + detail);
}

namespace checkpoint_detail {

void raise_unpacked_twice() {
  const std::string overlap = in_exec_group() ? "Performing two backward calls that overlap (i.e. require the same "
                                                "saved activation in order to compute gradients) is not allowed while "
                                                "under the torch.utils.checkpoint.GraphExecGroup context. "
                                              : "";
  raise_checkpoint_error("ckpt_ext.checkpoint (torch.utils.checkpoint semantics): Unpack is being triggered for a "
                         "tensor that was already unpacked once. " + overlap + "If you are calling ctx.saved_tensors "
                         "in backward, make sure to do so only once.");
}

}  // namespace checkpoint_detail

}  // namespace ckpt_ext
