// Python bindings of ckpt_ext._C. Each room of csrc/ exposes its C++ API; this file only binds it.
#include <torch/extension.h>

#include "autograd/checkpoint_function.h"
#include "autograd/replay_context.h"
#include "pool/boundary_pool.h"

namespace py = pybind11;
using ckpt_ext::BoundaryPool;

namespace {

py::dict stats_dict(const ckpt_ext::PoolStats& s) {
  py::dict d;
  d["reserved_bytes"] = s.reserved_bytes;
  d["in_use_bytes"] = s.in_use_bytes;
  d["peak_in_use_bytes"] = s.peak_in_use_bytes;
  d["live_slots"] = s.live_slots;
  d["grows"] = s.grows;
  d["chunks"] = s.chunks;
  d["allocations"] = s.allocations;
  d["stream_fences"] = s.stream_fences;
  return d;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ckpt_ext C++ core: BoundaryPool and CheckpointFunction";

  m.def(
      "checkpoint_apply",
      [](const py::object& runner, const std::string& name, const std::vector<at::Tensor>& inputs,
         const std::vector<at::Tensor>& params, bool preserve_rng_state, bool determinism_check, bool debug,
         bool finish_hook) {
        ckpt_ext::CheckpointOptions o;
        o.preserve_rng_state = preserve_rng_state;
        o.determinism_check = determinism_check;
        o.debug = debug;
        o.finish_hook = finish_hook;
        return ckpt_ext::checkpoint_apply(runner, name, inputs, params, o);
      },
      py::arg("runner"), py::arg("name"), py::arg("inputs"), py::arg("params"), py::arg("preserve_rng_state"),
      py::arg("determinism_check"), py::arg("debug"), py::arg("finish_hook"));

  m.def("is_recomputing", &ckpt_ext::is_recomputing);

  m.def("pool_stats", [](c10::Device d) { return stats_dict(BoundaryPool::for_device(d)->stats()); });
  m.def("reset_peak_stats", [](c10::Device d) { BoundaryPool::for_device(d)->reset_peak(); });
  m.def("empty_pool", [](c10::Device d) { return BoundaryPool::for_device(d)->release_unused(); });
  m.def("set_pool_chunk_bytes", [](c10::Device d, int64_t bytes) { BoundaryPool::for_device(d)->set_chunk_bytes(bytes); });
  m.def("pool_chunk_bytes", [](c10::Device d) { return BoundaryPool::for_device(d)->chunk_bytes(); });
  m.def("pool_store", [](const at::Tensor& t) { return BoundaryPool::for_device(t.device())->store(t); });
  m.def("is_pooled", &BoundaryPool::owns);
  m.def("record_stream", [](const at::Tensor& t, int64_t stream_id, int64_t device_index, int64_t device_type) {
    BoundaryPool::record_stream(
        t, c10::Stream::unpack3(stream_id, static_cast<c10::DeviceIndex>(device_index),
                                static_cast<c10::DeviceType>(device_type)));
  });

#ifdef CKPT_EXT_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}
