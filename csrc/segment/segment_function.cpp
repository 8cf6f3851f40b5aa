#include "segment_function.h"

#include <ATen/ATen.h>
#include <c10/util/strides.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <optional>
#include <unordered_map>
#include <utility>

#include "../replay/replay_context.h"
#include "../layers/rng.h"
#include "../pool/boundary_pool.h"

namespace ckpt_ext {
namespace {

using layers::LayerSpec;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Everything the replay needs besides the saved input. Lives in the node's context.
struct SegmentState : torch::CustomClassHolder {
  std::vector<LayerSpec> specs;
  // Distinct parameters, in first-use order: the node's tensor inputs after the hidden states. A
  // parameter shared by several layers (tied weights) is one input, so its gradient is one sum.
  // Held rather than saved (saved-tensor hooks would copy or detach them); versions are checked.
  std::vector<at::Tensor> params;
  std::vector<uint32_t> param_versions;
  // weight_index[l][i]: index into params of layer l's weight slot i, or -1 for an absent bias.
  std::vector<std::vector<int64_t>> weight_index;
  layers::LayerInputs inputs;  // mask, rotary tables: not differentiated (checked in segment_apply)
  std::vector<int64_t> seeds;  // per layer, drawn once in forward
  bool training = false;
  AutocastSnapshot autocast;   // forward's autocast state, applied again to the replay's layer forwards

  // Throws when a parameter was modified in place since forward (the replay would use new values).
  void check_versions() const {
    for (size_t j = 0; j < params.size(); ++j) {
      TORCH_CHECK(params[j]._version() == param_versions[j], "ckpt_ext fused segment: a parameter (shape ",
                  params[j].sizes(), ") was modified in place between forward and backward (for example by "
                  "optimizer.step()); the replay would use the new values. Run backward before updating parameters.");
    }
  }

  std::vector<at::Tensor> weights_of(size_t layer, const std::vector<at::Tensor>& values) const {
    std::vector<at::Tensor> w;
    w.reserve(weight_index[layer].size());
    for (int64_t i : weight_index[layer]) w.push_back(i >= 0 ? values[static_cast<size_t>(i)] : at::Tensor());
    return w;
  }
};

// Applies `snap` with autocast's weight-cast cache off for its lifetime, then restores what was there.
// The cache is off because the layers run under no_grad in forward (a cached cast made there would
// carry no gradient if the weight were used again with grad in the same autocast region) and on the
// backward thread in the replay (nothing would clear its entries); casts are deterministic, so the
// values are the same with or without it.
class SegmentAutocast {
 public:
  SegmentAutocast(AutocastSnapshot snap, c10::Device device)
      : saved_(AutocastSnapshot::capture({device})), active_(std::move(snap)) {
    active_.cache_enabled = false;
    active_.apply();
  }
  ~SegmentAutocast() { saved_.apply(); }
  SegmentAutocast(const SegmentAutocast&) = delete;
  SegmentAutocast& operator=(const SegmentAutocast&) = delete;

 private:
  AutocastSnapshot saved_, active_;
};

// Replays the segment for backward from `x` with the parameters `values` (grad on): the first K-1
// layers and the last one's replay_forward under forward's autocast, the last one's replay_backward
// (and the caller's autograd::grad) under the backward's own, as in the un-checkpointed backward.
layers::ReplayBackward replay(const SegmentState& st, const at::Tensor& x, const std::vector<at::Tensor>& values,
                              const at::Tensor& grad_out, const std::vector<bool>& need_param) {
  const size_t last = st.specs.size() - 1;
  const auto w = st.weights_of(last, values);
  const layers::LayerRng rng{st.training, st.seeds[last]};
  at::AutoGradMode grad_mode(true);
  RecomputingScope recomputing;
  layers::LayerOutput tail;
  {
    SegmentAutocast autocast(st.autocast, x.device());
    at::Tensor h = x;
    for (size_t l = 0; l < last; ++l)
      h = layers::layer_forward(st.specs[l], h, st.inputs, st.weights_of(l, values),
                                layers::LayerRng{st.training, st.seeds[l]})
              .out;
    tail = layers::replay_forward(st.specs[last], h, st.inputs, w, rng);
  }
  std::vector<bool> need_slot;
  need_slot.reserve(st.weight_index[last].size());
  for (int64_t i : st.weight_index[last]) need_slot.push_back(i >= 0 && need_param[static_cast<size_t>(i)]);
  return layers::replay_backward(st.specs[last], w, rng, tail, grad_out, need_slot);
}

struct SegmentFunction : public torch::autograd::Function<SegmentFunction> {
  // tensors = {hidden, params...}
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<SegmentState> st, at::TensorList tensors) {
    const at::Tensor& hidden = tensors[0];
    const size_t K = st->specs.size();
    at::Tensor h = hidden;
    SegmentAutocast autocast(st->autocast, hidden.device());
    for (size_t l = 0; l < K; ++l) {
      layers::LayerRng rng{st->training, st->seeds[l]};
      at::Tensor slot;
      if (l + 1 == K) {
        // The segment output is written by the layer's last fused op straight into a pool slot.
        slot = BoundaryPool::for_device(h.device())
                   ->empty(h.sizes(), c10::contiguous_strides(h.sizes()), h.scalar_type());
      }
      h = layers::layer_forward(st->specs[l], h, st->inputs, st->weights_of(l, st->params), rng, slot).out;
    }
    for (const auto& p : st->params) st->param_versions.push_back(p._version());
    ctx->save_for_backward({hidden});
    ctx->saved_data["state"] = at::IValue::make_capsule(st);
    return {h};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto st = c10::static_intrusive_pointer_cast<SegmentState>(ctx->saved_data.at("state").toCapsule());
    const variable_list saved = ctx->get_saved_variables();  // in-place modification / second-backward checks
    const size_t P = st->params.size();
    variable_list result(2 + P);  // slot 0: the state argument; 1: hidden; 2..: params
    st->check_versions();
    const at::Tensor& grad_out = grad_outputs[0];
    if (!grad_out.defined()) return result;
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "ckpt_ext fused segment: double backward (create_graph=True) is not supported; the fused ops' "
                "gradients are first order");
    const bool need_hidden = ctx->needs_input_grad(0);
    std::vector<bool> need_param(P);
    bool any = need_hidden;
    for (size_t j = 0; j < P; ++j) {
      need_param[j] = ctx->needs_input_grad(1 + j) && st->params[j].requires_grad();
      any = any || need_param[j];
    }
    if (!any) return result;
    // The replay starts from the saved input and detached aliases of the parameters, so its graph ends
    // here: neither the node's inputs nor the parameters' hooks see the inner autograd::grad.
    at::Tensor x = saved[0].detach();
    if (need_hidden) x.requires_grad_(true);
    std::vector<at::Tensor> aliases(P);
    for (size_t j = 0; j < P; ++j) aliases[j] = st->params[j].detach().requires_grad_(need_param[j]);
    const layers::ReplayBackward rep = replay(*st, x, aliases, grad_out, need_param);
    variable_list targets;
    std::vector<size_t> target_slot;  // result index of each target
    if (need_hidden) {
      targets.push_back(x);
      target_slot.push_back(1);
    }
    for (size_t j = 0; j < P; ++j) {
      if (!need_param[j]) continue;
      targets.push_back(aliases[j]);
      target_slot.push_back(2 + j);
    }
    if (!rep.outputs.empty()) {
      variable_list grads = torch::autograd::grad(rep.outputs, targets, rep.grads, /*retain_graph=*/false,
                                                  /*create_graph=*/false, /*allow_unused=*/true);
      for (size_t i = 0; i < grads.size(); ++i) result[target_slot[i]] = grads[i];
    }
    for (auto& [slot, g] : rep.slot_grads) {
      at::Tensor& r = result[2 + static_cast<size_t>(st->weight_index.back()[static_cast<size_t>(slot)])];
      r = r.defined() ? r + g : g;  // a last-linear weight also used elsewhere (tied)
    }
    return result;
  }
};

}  // namespace

at::Tensor segment_apply(const std::vector<layers::LayerSpec>& specs, const at::Tensor& hidden,
                         const layers::LayerInputs& inputs, const std::vector<std::vector<at::Tensor>>& weights,
                         bool training) {
  TORCH_CHECK(!specs.empty(), "ckpt_ext fused segment: needs at least one layer");
  TORCH_CHECK(specs.size() == weights.size(), "ckpt_ext fused segment: ", specs.size(), " layer specs but ",
              weights.size(), " weight lists");
  for (const at::Tensor* t : {&inputs.mask, &inputs.cos, &inputs.sin}) {
    TORCH_CHECK(!t->defined() || !t->requires_grad(),
                "ckpt_ext fused segment: the attention mask and rotary tables must not require grad (their "
                "gradients are not computed); use ckpt_ext.checkpoint for that case");
  }
  auto st = c10::make_intrusive<SegmentState>();
  st->specs = specs;
  st->inputs = layers::prepared(inputs);  // once for every layer, forward and replay
  st->training = training;
  st->autocast = AutocastSnapshot::capture({hidden.device()});
  std::unordered_map<const c10::TensorImpl*, int64_t> index_of;
  for (size_t l = 0; l < specs.size(); ++l) {
    layers::check_weights(specs[l], weights[l], hidden);
    std::vector<int64_t> idx;
    idx.reserve(weights[l].size());
    for (const auto& w : weights[l]) {
      if (!w.defined()) {
        idx.push_back(-1);
        continue;
      }
      auto [it, inserted] = index_of.emplace(w.unsafeGetTensorImpl(), static_cast<int64_t>(st->params.size()));
      if (inserted) st->params.push_back(w);
      idx.push_back(it->second);
    }
    st->weight_index.push_back(std::move(idx));
    // One seed per layer call, drawn in forward only: the replay reuses it.
    st->seeds.push_back(layers::uses_dropout(specs[l], training) ? layers::draw_dropout_seed(hidden.device()) : 0);
  }
  std::vector<at::Tensor> all;
  all.reserve(1 + st->params.size());
  all.push_back(hidden);
  all.insert(all.end(), st->params.begin(), st->params.end());
  return SegmentFunction::apply(st, at::TensorList(all))[0];
}

}  // namespace ckpt_ext
