// Python bindings of ckpt_ext._C. Each room of csrc/ exposes its C++ API; this file only binds it.
#include <torch/csrc/utils/pybind.h>  // not torch/extension.h: the C++ frontend it adds is unused and costs ~15 s per compile

#include <ATen/Parallel.h>

#include <mutex>
#include <set>
#include <thread>

#include "checkpoint/checkpoint_frame.h"
#include "replay/replay_context.h"
#include "common/optional.h"
#include "layers/layer.h"
#include "pool/boundary_pool.h"
#include "segment/segment_function.h"

namespace py = pybind11;
using ckpt_ext::BoundaryPool;

namespace {

py::dict stats_dict(const ckpt_ext::PoolStats& s) {
  py::dict d;
  d["reserved_bytes"] = s.reserved_bytes;
  d["peak_reserved_bytes"] = s.peak_reserved_bytes;
  d["in_use_bytes"] = s.in_use_bytes;
  d["peak_in_use_bytes"] = s.peak_in_use_bytes;
  d["live_slots"] = s.live_slots;
  d["grows"] = s.grows;
  d["releases"] = s.releases;
  d["chunks"] = s.chunks;
  d["allocations"] = s.allocations;
  d["stream_fences"] = s.stream_fences;
  return d;
}

using ckpt_ext::OptTensor;
using ckpt_ext::undefined_if_absent;

ckpt_ext::layers::LayerInputs layer_inputs(const OptTensor& mask, const OptTensor& cos, const OptTensor& sin) {
  return {undefined_if_absent(mask), undefined_if_absent(cos), undefined_if_absent(sin)};
}

}  // namespace

// One flat table of what Python sees, longer than a function should be on purpose: split up, the
// module's contents would have to be read from several places.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ckpt_ext C++ core: BoundaryPool, checkpoint_run (saved-tensor-hook checkpoint), fused layers";

  ckpt_ext::bind_checkpoint(m);
  m.def("is_recomputing", &ckpt_ext::is_recomputing);
  // The threads at::parallel_for runs n one-item tasks on, compiled as the kernels are (tests/test_build.py:
  // built with OpenMP, the kernels follow torch.get_num_threads()).
  m.def("parallel_threads", [](int64_t n) {
    std::mutex mu;
    std::set<std::thread::id> ids;
    at::parallel_for(0, n, 1, [&](int64_t, int64_t) {
      std::lock_guard<std::mutex> lock(mu);
      ids.insert(std::this_thread::get_id());
    });
    return static_cast<int64_t>(ids.size());
  });

  namespace L = ckpt_ext::layers;
  // The fused layers' CPU GEMM layout policy (csrc/layers/gemm.cpp): "auto", "nt" or "off"; sets it when
  // given, returns the one before.
  m.def("cpu_gemm_layout", &L::cpu_gemm_layout, py::arg("set") = py::none());
  // Autocast: the last linear's GEMM output read beside the float32 stream without casts (residual_linear.cpp);
  // sets it when given, returns the one before.
  m.def("mixed_dtype_residual", &L::mixed_dtype_residual, py::arg("set") = py::none());
  m.def("tail_activation_in_backward", &L::tail_activation_in_backward, py::arg("set") = py::none(),
        "The replay of a checkpointed segment's last layer stops before its activation (SwiGLU / GeGLU / "
        "bias-GELU), whose backward also writes the last linear's input (issue 33; default on); off: it runs the "
        "activation forward as before (the same bits). On/off (None: unchanged); returns the setting before");
  m.def("mixed_dtype_norms", &L::set_mixed_dtype_norms, py::arg("enable") = py::none(),
        "Autocast: the fused layers' norm ops read a GEMM's bfloat16/float16 output beside the float32 stream "
        "(issue 32); off: it is cast to float32 first. On/off (None: unchanged); returns the setting before");
  m.def("mixed_dtype_norm_outputs", &L::set_mixed_dtype_norm_outputs, py::arg("enable") = py::none(),
        "Autocast: a fused layer's norm whose output feeds only GEMMs writes it in their dtype, and reads its "
        "gradient in it (issue 32; the same bits as the casts); off: float32, cast by autocast. On/off (None: "
        "unchanged); returns the setting before");
  // The layers' GEMMs (family.h), bound for tests/test_gemm_layout.py.
  m.def("_gemm_linear", [](const at::Tensor& x, const at::Tensor& w, const OptTensor& b) {
    return L::gemm_linear(x, w, b.has_value() ? *b : at::Tensor());
  }, py::arg("x"), py::arg("w"), py::arg("bias") = py::none());
  m.def("_gemm_matmul", &L::gemm_matmul);
  m.def("_attention_philox_dropout_cpu", [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                             const OptTensor& mask, bool causal, double scale, double p, int64_t seed,
                                             int64_t offset, bool fused) {
    return L::attention_philox_dropout_cpu(q, k, v, mask.has_value() ? *mask : at::Tensor(), causal, scale, p, seed,
                                           offset, fused);
  }, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("mask"), py::arg("causal"), py::arg("scale"), py::arg("p"), py::arg("seed"), py::arg("offset"),
        py::arg("fused") = true);
  m.def("cpu_fused_attention", &L::cpu_fused_attention, py::arg("set") = py::none(),
        "CPU attention with dropout fused (mask + softmax + dropout in one row pass, one autograd node) or written "
        "out as ATen ops; on by default. Sets it when given (None: unchanged); returns the setting before");
  auto make_spec = [](int64_t family, int64_t hidden, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                      double scaling, double attn_p, double hidden_p, double eps, bool gelu_tanh,
                      const std::vector<double>& lora_scaling, const std::vector<double>& lora_p,
                      double attn_softcap) {
    L::LayerSpec s;
    s.family = static_cast<L::Family>(family);
    s.hidden = hidden;
    s.num_heads = num_heads;
    s.num_kv_heads = num_kv_heads;
    s.head_dim = head_dim;
    s.scaling = scaling;
    s.attn_p = attn_p;
    s.hidden_p = hidden_p;
    s.eps = eps;
    s.gelu_tanh = gelu_tanh;
    s.lora_scaling = lora_scaling;
    s.lora_p = lora_p;
    s.attn_softcap = attn_softcap;
    s.validate();
    return s;
  };
  py::class_<L::LayerSpec>(m, "LayerSpec")
      .def(py::init(make_spec), py::arg("family"), py::arg("hidden"), py::arg("num_heads"), py::arg("num_kv_heads"),
           py::arg("head_dim"), py::arg("scaling"), py::arg("attn_p"), py::arg("hidden_p"), py::arg("eps"),
           py::arg("gelu_tanh"), py::arg("lora_scaling") = std::vector<double>{},
           py::arg("lora_p") = std::vector<double>{}, py::arg("attn_softcap") = 0.0)
      .def_property_readonly("family", [](const L::LayerSpec& s) { return static_cast<int64_t>(s.family); })
      .def_readonly("attn_p", &L::LayerSpec::attn_p)
      .def_readonly("hidden_p", &L::LayerSpec::hidden_p)
      .def_readonly("lora_scaling", &L::LayerSpec::lora_scaling)
      .def_readonly("lora_p", &L::LayerSpec::lora_p)
      .def_readonly("attn_softcap", &L::LayerSpec::attn_softcap)
      // A copy with the LoRA adapters' scalings and input dropouts (one per adapter projection, or none).
      .def(
          "with_lora",
          [](const L::LayerSpec& s, const std::vector<double>& lora_scaling, const std::vector<double>& lora_p) {
            L::LayerSpec r = s;  // (attn_softcap and the rest kept)
            r.lora_scaling = lora_scaling;
            r.lora_p = lora_p;
            r.validate();
            return r;
          },
          py::arg("lora_scaling"), py::arg("lora_p"))
      .def("__repr__", &L::LayerSpec::repr)
      // Pickling (copy.deepcopy of fused models, torch.save of whole modules).
      .def(py::pickle(
          [](const L::LayerSpec& s) {
            return py::make_tuple(static_cast<int64_t>(s.family), s.hidden, s.num_heads, s.num_kv_heads, s.head_dim,
                                  s.scaling, s.attn_p, s.hidden_p, s.eps, s.gelu_tanh, s.lora_scaling, s.lora_p,
                                  s.attn_softcap);
          },
          [make_spec](const py::tuple& t) {
            TORCH_CHECK(t.size() == 10 || t.size() == 12 || t.size() == 13, "ckpt_ext LayerSpec: bad pickled state");
            const bool lora = t.size() >= 12;  // states pickled before LoRA have 10 fields, before attn_softcap 12
            return make_spec(t[0].cast<int64_t>(), t[1].cast<int64_t>(), t[2].cast<int64_t>(), t[3].cast<int64_t>(),
                             t[4].cast<int64_t>(), t[5].cast<double>(), t[6].cast<double>(), t[7].cast<double>(),
                             t[8].cast<double>(), t[9].cast<bool>(),
                             lora ? t[10].cast<std::vector<double>>() : std::vector<double>{},
                             lora ? t[11].cast<std::vector<double>>() : std::vector<double>{},
                             t.size() == 13 ? t[12].cast<double>() : 0.0);
          }));
  // The layer layout's one home: {name: (family id, [weight slot names in call order])}; ckpt_ext/fused.py
  // maps Hugging Face's parameters to these slots.
  m.def("layer_families", [] {
    py::dict d;
    for (L::Family f : L::all_families()) {
      const auto& info = L::family_info(f);
      d[info.name] = py::make_tuple(static_cast<int64_t>(info.id), info.slots);
    }
    return d;
  });
  // {name: [the weight slots whose projections may carry a LoRA adapter]}: adapter j's A and B are passed
  // after the family's weight slots, at positions len(slots) + 2j and len(slots) + 2j + 1.
  m.def("layer_adapters", [] {
    py::dict d;
    for (L::Family f : L::all_families()) d[L::family_info(f).name] = L::family_info(f).lora;
    return d;
  });
  m.def("uses_dropout", &L::uses_dropout, py::arg("spec"), py::arg("training"));

  m.def(
      "fused_layer_forward",
      [](const L::LayerSpec& spec, const at::Tensor& hidden, const OptTensor& mask, const OptTensor& cos,
         const OptTensor& sin, const std::vector<OptTensor>& weights, bool training) {
        return L::fused_layer_forward(spec, hidden, layer_inputs(mask, cos, sin), undefined_if_absent(weights),
                                      training);
      },
      py::arg("spec"), py::arg("hidden"), py::arg("mask"), py::arg("cos"), py::arg("sin"), py::arg("weights"),
      py::arg("training"));
  m.def("pre_norm_boundaries", &ckpt_ext::pre_norm_boundaries, py::arg("enable") = py::none(),
        "BERT's pre-norm boundary between fused segments: on/off (None: unchanged); returns the setting before");
  m.def("register_spec", &ckpt_ext::register_spec, py::arg("spec"),
        "An id naming `spec` in the ckpt_ext::fused_segment operators (torch.compile's path)");
  m.def(
      "segment_apply",
      [](const std::vector<L::LayerSpec>& specs, const at::Tensor& hidden, const OptTensor& mask,
         const OptTensor& cos, const OptTensor& sin, const std::vector<std::vector<OptTensor>>& weights,
         bool training, bool keep_attention, bool pre_norm_boundary) {
        std::vector<std::vector<at::Tensor>> w;
        w.reserve(weights.size());
        for (const auto& l : weights) w.push_back(undefined_if_absent(l));
        return ckpt_ext::segment_apply(specs, hidden, layer_inputs(mask, cos, sin), w, training, keep_attention,
                                       nullptr, 0, nullptr, nullptr, pre_norm_boundary);
      },
      py::arg("specs"), py::arg("hidden"), py::arg("mask"), py::arg("cos"), py::arg("sin"), py::arg("weights"),
      py::arg("training"), py::arg("keep_attention") = false, py::arg("pre_norm_boundary") = true,
      "pre_norm_boundary: this call may keep / take BERT's pre-norm boundary (and pre_norm_boundaries() is on)");
  m.def(
      "segment_apply_keeping_attention",
      [](const std::vector<L::LayerSpec>& specs, const at::Tensor& hidden, const OptTensor& mask,
         const OptTensor& cos, const OptTensor& sin, const std::vector<std::vector<OptTensor>>& weights,
         bool training, bool pre_norm_boundary) {
        std::vector<std::vector<at::Tensor>> w;
        w.reserve(weights.size());
        for (const auto& l : weights) w.push_back(undefined_if_absent(l));
        std::vector<std::string> not_kept;
        at::Tensor out = ckpt_ext::segment_apply(specs, hidden, layer_inputs(mask, cos, sin), w, training,
                                                 /*keep_attention=*/true, &not_kept, 0, nullptr, nullptr,
                                                 pre_norm_boundary);
        return std::make_pair(out, not_kept);
      },
      py::arg("specs"), py::arg("hidden"), py::arg("mask"), py::arg("cos"), py::arg("sin"), py::arg("weights"),
      py::arg("training"), py::arg("pre_norm_boundary") = true,
      "segment_apply keeping attention; returns (output, per layer why its attention kept nothing, '' if kept)");
  m.def(
      "segment_apply_levels",
      [](const std::vector<L::LayerSpec>& specs, const at::Tensor& hidden, const OptTensor& mask,
         const OptTensor& cos, const OptTensor& sin, const std::vector<std::vector<OptTensor>>& weights,
         bool training, bool keep_attention, int64_t gemm_level, bool pre_norm_boundary) {
        std::vector<std::vector<at::Tensor>> w;
        w.reserve(weights.size());
        for (const auto& l : weights) w.push_back(undefined_if_absent(l));
        std::vector<std::string> not_kept, gemm_not_kept;
        std::vector<int64_t> gemm_bytes;
        at::Tensor out = ckpt_ext::segment_apply(specs, hidden, layer_inputs(mask, cos, sin), w, training,
                                                 keep_attention, &not_kept, static_cast<int>(gemm_level),
                                                 &gemm_bytes, &gemm_not_kept, pre_norm_boundary);
        return py::make_tuple(out, not_kept, gemm_bytes, gemm_not_kept);
      },
      py::arg("specs"), py::arg("hidden"), py::arg("mask"), py::arg("cos"), py::arg("sin"), py::arg("weights"),
      py::arg("training"), py::arg("keep_attention"), py::arg("gemm_level"), py::arg("pre_norm_boundary") = true,
      "segment_apply at a recompute level (gemm_level 0: no GEMM output kept, 1: the q/k/v projections, 2: every "
      "GEMM); returns (output, per layer why its attention kept nothing, per layer the GEMM bytes kept, per layer why "
      "it kept no GEMM output)");
  m.def("cudnn_attention_problem", &ckpt_ext::layers::cudnn_attention_problem,
        "Why torch's cuDNN attention ops cannot be called by name here ('' when they can)");

  m.def("pool_stats", [](c10::Device d) { return stats_dict(BoundaryPool::for_device(d)->stats()); });
  m.def("reset_peak_stats", [](c10::Device d) { BoundaryPool::for_device(d)->reset_peak(); });
  m.def("empty_pool", [](c10::Device d) { return BoundaryPool::for_device(d)->release_unused(); });
  m.def("set_pool_chunk_bytes", [](c10::Device d, int64_t bytes) { BoundaryPool::for_device(d)->set_chunk_bytes(bytes); });
  m.def("pool_chunk_bytes", [](c10::Device d) { return BoundaryPool::for_device(d)->chunk_bytes(); });
  m.attr("pool_min_chunk_bytes") = BoundaryPool::kMinChunkBytes;
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
