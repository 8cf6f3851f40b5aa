#include "segment_function.h"

#include <ATen/ATen.h>
#include <c10/util/strides.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/graph_task.h>

#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <atomic>
#include <deque>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <unordered_set>
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
  // Keep-attention: per layer, what its attention kernel returned in forward (layers::KeptAttention). Its
  // tensors (output and log-sum-exp in pool slots) are moved into the node's saved variables at the end of
  // forward, so that autograd frees them after backward; here remain the kernel and the layer's name.
  bool keep_attention = false;
  std::vector<layers::KeptAttention> kept;
  // Recompute levels (layers::KeptGemms): per layer, its GEMM outputs kept in forward (none when empty), moved into
  // the node's saved variables after the attention's, likewise.
  std::vector<layers::KeptGemms> kept_gemms;
  std::vector<int64_t> gemm_bytes;  // per layer, the bytes its forward kept (segment_apply reports them)
  // BERT's pre-norm boundary (layers::PreNormBoundary; issue 32), eager segments only (segment_apply).
  // `keeps_boundary`: this segment keeps its last layer's (boundary, from forward until its replay's norm
  // backward: dropped there unless the graph is retained) and its replay stops before that layer's output
  // linear. `input_from`: this segment's input is the output of such a segment, so the segment keeps not its
  // input but that segment's pre-norm sum, and its replay starts by recomputing the input from it.
  bool keeps_boundary = false;
  layers::PreNormBoundary boundary;
  struct InputBoundary {
    at::Tensor pre_norm;
    layers::LayerSpec spec;           // the producing layer's
    std::vector<at::Tensor> weights;  // the producing layer's (its last norm's weight and bias are read)
    std::vector<uint32_t> weight_versions;
    c10::VariableVersion version;     // the input's version counter, and its value in forward
    uint32_t version_at_forward;
  };
  std::optional<InputBoundary> input_from;
  bool boundaries_used = false;  // a backward without retain_graph used (and dropped) them

  // The last strong reference is gone (the graph freed, with or without a backward); a weak one may remain (the
  // thread's offered boundary, until the next segment call), which keeps the object, not its tensors.
  void release_resources() override {
    boundary = layers::PreNormBoundary();
    input_from.reset();
    params.clear();
    kept.clear();
  }

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
// `kept` (keep-attention): per layer, the attention forward's kept outputs; the layers then run no
// attention forward (a layer whose attention kept nothing runs it: full recompute of that layer).
// `gemms` (recompute levels): per layer, the GEMM outputs kept in forward, handed back instead of running the GEMMs.
// `boundary` (defined: the segment keeps its last layer's pre-norm boundary): the last layer stops before its
// output linear and goes back from the boundary (layers::pre_norm_replay_*), which is moved from.
layers::ReplayBackward replay(const SegmentState& st, const at::Tensor& x, const std::vector<at::Tensor>& values,
                              const at::Tensor& grad_out, const std::vector<bool>& need_param,
                              std::vector<layers::KeptAttention>* kept, std::vector<layers::KeptGemms>* gemms,
                              layers::PreNormBoundary* boundary) {
  const bool from_boundary = boundary != nullptr && boundary->defined();
  const size_t last = st.specs.size() - 1;
  const auto w = st.weights_of(last, values);
  const layers::LayerRng rng{st.training, st.seeds[last]};
  auto kept_of = [&](size_t l) { return kept != nullptr && (*kept)[l].filled() ? &(*kept)[l] : nullptr; };
  auto gemms_of = [&](size_t l) { return gemms != nullptr && (*gemms)[l].filled() ? &(*gemms)[l] : nullptr; };
  at::AutoGradMode grad_mode(true);
  RecomputingScope recomputing;
  layers::LayerOutput tail;
  {
    SegmentAutocast autocast(st.autocast, x.device());
    at::Tensor h = x;
    for (size_t l = 0; l < last; ++l)
      h = layers::layer_forward(st.specs[l], h, st.inputs, st.weights_of(l, values),
                                layers::LayerRng{st.training, st.seeds[l]}, at::Tensor(), kept_of(l), gemms_of(l))
              .out;
    tail = from_boundary
               ? layers::pre_norm_replay_forward(st.specs[last], h, st.inputs, w, rng, kept_of(last), gemms_of(last))
               : layers::replay_forward(st.specs[last], h, st.inputs, w, rng, kept_of(last), gemms_of(last));
  }
  std::vector<bool> need_slot;
  need_slot.reserve(st.weight_index[last].size());
  for (int64_t i : st.weight_index[last]) need_slot.push_back(i >= 0 && need_param[static_cast<size_t>(i)]);
  if (from_boundary) {
    return layers::pre_norm_replay_backward(st.specs[last], w, rng, tail, std::move(*boundary), grad_out,
                                            need_slot);
  }
  return layers::replay_backward(st.specs[last], w, rng, tail, grad_out, need_slot);
}

// The segment's K layer forwards without a graph (grad mode off), from `hidden` under the forward's
// autocast; the output is written by the last layer's last fused op straight into a BoundaryPool slot.
// Keep-attention: each layer's attention output and log-sum-exp go into pool slots too (st.kept).
at::Tensor run_forward(SegmentState& st, const at::Tensor& hidden) {
  const size_t K = st.specs.size();
  at::NoGradGuard no_grad;
  at::Tensor h = hidden;
  SegmentAutocast autocast(st.autocast, hidden.device());
  const auto pool = BoundaryPool::for_device(h.device());
  for (size_t l = 0; l < K; ++l) {
    layers::LayerRng rng{st.training, st.seeds[l]};
    at::Tensor slot;
    if (l + 1 == K) slot = pool->empty(h.sizes(), c10::contiguous_strides(h.sizes()), h.scalar_type());
    layers::KeptAttention* kept = st.keep_attention ? &st.kept[l] : nullptr;
    layers::KeptGemms* gemms = st.kept_gemms.empty() ? nullptr : &st.kept_gemms[l];
    if (gemms != nullptr) gemms->recording = true;
    layers::LayerOutput r =
        layers::layer_forward(st.specs[l], h, st.inputs, st.weights_of(l, st.params), rng, slot, kept, gemms);
    if (gemms != nullptr) gemms->recording = false;
    h = r.out;
    if (l + 1 == K && st.keeps_boundary) {
      TORCH_CHECK(r.pre_norm.defined(), "ckpt_ext fused segment: the last layer returned no pre-norm boundary");
      st.boundary = layers::PreNormBoundary{r.pre_norm, r.mean, r.rstd};
    }
    if (kept != nullptr && kept->filled()) {  // the kernel's output and log-sum-exp into the pool, strides kept
      kept->out = pool->store(kept->out);
      kept->lse = pool->store(kept->lse);
    }
  }
  return h;
}

// A root of the replay's autograd::grad whose values nobody reads: the engine needs its gradient edge and
// metadata only, and the op that made it saved its inputs, not it (BERT's last norm saves the pre-norm sum).
// Its memory goes back before the backward runs, as torch's engine lets a recomputed output go that nothing
// saved; otherwise the replayed layer output (a [tokens, hidden] tensor) would be held through the whole
// layer's backward. Only where this tensor is the storage's one user and nothing else holds the tensor (a
// saved output, a view, a tensor kept elsewhere keep theirs).
void release_unread_root(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage() || t.use_count() != 1 || t.storage().use_count() != 1) return;
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  s->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  s->set_nbytes(0);
}

// The backward of a segment: replays it from its input `saved` and returns {grad of hidden, grad of each
// of st.params} (undefined where not needed). The replay starts from a detached input and detached
// aliases of the parameters, so its graph ends here: neither the caller's inputs nor the parameters'
// hooks see the inner autograd::grad.
variable_list replay_grads(const SegmentState& st, const at::Tensor& saved, const at::Tensor& grad_out,
                           bool need_hidden, const std::vector<bool>& need_param,
                           std::vector<layers::KeptAttention>* kept = nullptr,
                           std::vector<layers::KeptGemms>* gemms = nullptr,
                           layers::PreNormBoundary* boundary = nullptr) {
  const size_t P = st.params.size();
  variable_list result(1 + P);
  at::Tensor x = saved.detach();
  if (need_hidden) x.requires_grad_(true);
  std::vector<at::Tensor> aliases(P);
  for (size_t j = 0; j < P; ++j) aliases[j] = st.params[j].detach().requires_grad_(need_param[j]);
  const layers::ReplayBackward rep = replay(st, x, aliases, grad_out, need_param, kept, gemms, boundary);
  variable_list targets;
  std::vector<size_t> target_slot;  // result index of each target
  if (need_hidden) {
    targets.push_back(x);
    target_slot.push_back(0);
  }
  for (size_t j = 0; j < P; ++j) {
    if (!need_param[j]) continue;
    targets.push_back(aliases[j]);
    target_slot.push_back(1 + j);
  }
  if (!rep.outputs.empty()) {
    for (const auto& root : rep.outputs) release_unread_root(root);
    variable_list grads = torch::autograd::grad(rep.outputs, targets, rep.grads, /*retain_graph=*/false,
                                                /*create_graph=*/false, /*allow_unused=*/true);
    for (size_t i = 0; i < grads.size(); ++i) result[target_slot[i]] = grads[i];
  }
  for (auto& [slot, g] : rep.slot_grads) {
    at::Tensor& r = result[1 + static_cast<size_t>(st.weight_index.back()[static_cast<size_t>(slot)])];
    r = r.defined() ? r + g : g;  // a last-linear weight also used elsewhere (tied)
  }
  return result;
}

// ---- the pre-norm boundary between segments (SegmentState::keeps_boundary / input_from) -----------------------

// The last segment of this thread that keeps a boundary, until the next segment call: weak references (nothing
// is held here), matched against the next segment's input.
struct OfferedBoundary {
  c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> out;  // that segment's output
  c10::weak_intrusive_ptr<SegmentState> state;
  uint32_t version;                               // the output's version when it was returned
};
thread_local std::optional<OfferedBoundary> offered;

std::atomic<bool> boundaries_enabled{true};

void offer_boundary(const c10::intrusive_ptr<SegmentState>& st, const at::Tensor& out) {
  offered.reset();
  if (st->keeps_boundary && st->boundary.defined())
    offered = OfferedBoundary{c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(out.getIntrusivePtr()),
                              c10::weak_intrusive_ptr<SegmentState>(st), out._version()};
}

// Takes the offered boundary as st's input when `hidden` is the offering segment's output, unchanged since.
void adopt_boundary(SegmentState& st, const at::Tensor& hidden) {
  std::optional<OfferedBoundary> o;
  std::swap(o, offered);
  if (!o) return;
  const auto out = o->out.lock();
  const auto from = o->state.lock();
  if (!out || !from || out.get() != hidden.unsafeGetTensorImpl() || hidden._version() != o->version ||
      !from->boundary.defined() || !from->boundary.pre_norm.sizes().equals(hidden.sizes()) ||
      from->boundary.pre_norm.scalar_type() != hidden.scalar_type())
    return;
  SegmentState::InputBoundary in{from->boundary.pre_norm, from->specs.back(),
                                 from->weights_of(from->specs.size() - 1, from->params), {},
                                 hidden.unsafeGetTensorImpl()->version_counter(), hidden._version()};
  for (const auto& w : in.weights) in.weight_versions.push_back(w.defined() ? w._version() : 0);
  st.input_from = std::move(in);
}

// The segment's input, recomputed (no grad) from the boundary it took: the producing layer's last norm on its
// pre-norm sum, bit-identical to that layer's output. Dropped from the state unless the graph is retained.
at::Tensor input_from_boundary(SegmentState& st, bool keep_graph) {
  const auto& in = *st.input_from;
  TORCH_CHECK(in.version.current_version() == in.version_at_forward,
              "ckpt_ext fused segment: its input (the previous fused segment's output) was modified in place "
              "between forward and backward; the replay recomputes the input as it was. Modify a copy instead.");
  for (size_t i = 0; i < in.weights.size(); ++i) {
    TORCH_CHECK(!in.weights[i].defined() || in.weights[i]._version() == in.weight_versions[i],
                "ckpt_ext fused segment: a parameter of the previous segment's last layer (shape ",
                in.weights[i].sizes(), ") was modified in place between forward and backward (for example by "
                "optimizer.step()); the replay would use the new values. Run backward before updating parameters.");
  }
  at::Tensor x;
  {
    RecomputingScope recomputing;
    x = layers::output_from_pre_norm(in.spec, in.weights, in.pre_norm);
  }
  if (!keep_graph) st.input_from.reset();
  return x;
}

struct SegmentFunction : public torch::autograd::Function<SegmentFunction> {
  // tensors = {hidden, params...}
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<SegmentState> st, at::TensorList tensors) {
    const at::Tensor& hidden = tensors[0];
    at::Tensor h = run_forward(*st, hidden);
    for (const auto& p : st->params) st->param_versions.push_back(p._version());
    // The input recomputed from the previous segment's boundary is not kept (see SegmentState::input_from).
    std::vector<at::Tensor> saved{st->input_from ? at::Tensor() : hidden};
    for (auto& k : st->kept) {  // keep-attention: held by autograd (freed after backward), not by the state
      for (auto& t : k.tensors()) saved.push_back(t);
      k.from_tensors(std::vector<at::Tensor>(layers::KeptAttention::kTensors).data());
    }
    for (auto& g : st->kept_gemms) {  // the recompute levels' GEMM outputs, likewise
      st->gemm_bytes.push_back(g.nbytes());
      for (auto& t : g.tensors()) saved.push_back(t);
      g.from_tensors(std::vector<at::Tensor>(layers::KeptGemms::kTensors).data());
    }
    ctx->save_for_backward(saved);
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
    std::vector<layers::KeptAttention> kept = st->kept;
    for (size_t l = 0; l < kept.size(); ++l) kept[l].from_tensors(&saved[1 + l * layers::KeptAttention::kTensors]);
    std::vector<layers::KeptGemms> gemms = st->kept_gemms;
    const size_t gemms_at = 1 + kept.size() * layers::KeptAttention::kTensors;
    for (size_t l = 0; l < gemms.size(); ++l) gemms[l].from_tensors(&saved[gemms_at + l * layers::KeptGemms::kTensors]);
    // The boundaries are used once and dropped, unless the graph is retained for another backward.
    const bool keep_graph = torch::autograd::get_current_graph_task_keep_graph();
    TORCH_CHECK(!st->boundaries_used, "ckpt_ext fused segment: trying to backward through the segment a second "
                "time, after its kept boundaries were freed; specify retain_graph=True in the first backward");
    st->boundaries_used = !keep_graph && (st->input_from || st->keeps_boundary);
    const at::Tensor input = st->input_from ? input_from_boundary(*st, keep_graph) : saved[0];
    layers::PreNormBoundary boundary;
    if (st->keeps_boundary) {
      boundary = st->boundary;
      if (!keep_graph) st->boundary = layers::PreNormBoundary();
    }
    const variable_list grads = replay_grads(*st, input, grad_out, need_hidden, need_param,
                                             st->keep_attention ? &kept : nullptr, gemms.empty() ? nullptr : &gemms,
                                             st->keeps_boundary ? &boundary : nullptr);
    std::copy(grads.begin(), grads.end(), result.begin() + 1);
    return result;
  }
};

}  // namespace

namespace {

// The state of a segment call: checks the specs and weights, dedupes the parameters and takes one seed
// per layer, `seeds[l]` when given (the operator's), else drawn now (training with dropout).
c10::intrusive_ptr<SegmentState> make_state(const std::vector<layers::LayerSpec>& specs, const at::Tensor& hidden,
                                            const layers::LayerInputs& inputs,
                                            const std::vector<std::vector<at::Tensor>>& weights, bool training,
                                            const std::vector<int64_t>* seeds) {
  TORCH_CHECK(!specs.empty(), "ckpt_ext fused segment: needs at least one layer");
  TORCH_CHECK(specs.size() == weights.size(), "ckpt_ext fused segment: ", specs.size(), " layer specs but ",
              weights.size(), " weight lists");
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
    const bool dropout = layers::uses_dropout(specs[l], training);
    st->seeds.push_back(!dropout ? 0 : seeds != nullptr ? (*seeds)[l] : layers::draw_dropout_seed(hidden.device()));
  }
  return st;
}

}  // namespace

at::Tensor segment_apply(const std::vector<layers::LayerSpec>& specs, const at::Tensor& hidden,
                         const layers::LayerInputs& inputs, const std::vector<std::vector<at::Tensor>>& weights,
                         bool training, bool keep_attention, std::vector<std::string>* not_kept, int gemm_level,
                         std::vector<int64_t>* gemm_bytes, std::vector<std::string>* gemm_not_kept,
                         bool pre_norm_boundary) {
  TORCH_CHECK(gemm_level >= 0 && gemm_level <= 2, "ckpt_ext fused segment: gemm_level must be 0 (none), 1 (the q/k/v "
              "projections) or 2 (every GEMM), got ", gemm_level);
  for (const at::Tensor* t : {&inputs.mask, &inputs.cos, &inputs.sin}) {
    TORCH_CHECK(!t->defined() || !t->requires_grad(),
                "ckpt_ext fused segment: the attention mask and rotary tables must not require grad (their "
                "gradients are not computed); use ckpt_ext.checkpoint for that case");
  }
  auto st = make_state(specs, hidden, inputs, weights, training, nullptr);
  // The boundaries serve a node autograd records (grad mode on, something requiring grad).
  bool recorded = at::GradMode::is_enabled() && hidden.requires_grad();
  for (const auto& p : st->params) recorded = recorded || (at::GradMode::is_enabled() && p.requires_grad());
  if (recorded && pre_norm_boundary && boundaries_enabled.load()) {
    st->keeps_boundary = layers::has_pre_norm_boundary(specs.back(), weights.back());
    adopt_boundary(*st, hidden);
  } else {
    offered.reset();
  }
  if (keep_attention) {
    st->keep_attention = true;
    st->kept.resize(specs.size());
    for (size_t l = 0; l < specs.size(); ++l) {
      st->kept[l].who = "layer " + std::to_string(l) + " (" + layers::family_name(specs[l].family) +
                        ") of a checkpointed segment of " + std::to_string(specs.size());
    }
  }
  if (gemm_level > 0) {
    st->kept_gemms.resize(specs.size());
    for (auto& g : st->kept_gemms) g.all = gemm_level == 2;
  }
  std::vector<at::Tensor> all;
  all.reserve(1 + st->params.size());
  all.push_back(hidden);
  all.insert(all.end(), st->params.begin(), st->params.end());
  at::Tensor out = SegmentFunction::apply(st, at::TensorList(all))[0];
  if (recorded) offer_boundary(st, out);
  if (not_kept != nullptr) {
    not_kept->clear();
    for (const auto& k : st->kept) not_kept->push_back(k.not_kept);
  }
  if (gemm_bytes != nullptr) *gemm_bytes = st->gemm_bytes;
  if (gemm_not_kept != nullptr) {
    gemm_not_kept->clear();
    for (const auto& g : st->kept_gemms) gemm_not_kept->push_back(g.not_kept);
  }
  return out;
}

// ---- the operators ckpt_ext::fused_segment / fused_segment_backward (torch.compile's path) ---------------

namespace {

std::mutex registry_mutex;
std::deque<layers::LayerSpec> registry;  // a deque: references stay valid as it grows

// The state of an operator call: the specs by id, the weights split by layer (`layout`: per weight slot of
// each layer in turn, the index into `weights`, or -1 for an absent bias), the given seeds and the given
// autocast dtype for the hidden states' device type (none: autocast off).
c10::intrusive_ptr<SegmentState> op_state(at::IntArrayRef spec_ids, const at::Tensor& hidden,
                                          const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& cos,
                                          const std::optional<at::Tensor>& sin, at::TensorList weights,
                                          at::IntArrayRef layout, bool training, const at::Tensor& seeds,
                                          std::optional<at::ScalarType> autocast_dtype) {
  std::vector<layers::LayerSpec> specs;
  for (int64_t id : spec_ids) specs.push_back(registered_spec(id));
  std::vector<std::vector<at::Tensor>> split;
  size_t pos = 0;
  for (const auto& spec : specs) {
    const auto& info = layers::family_info(spec.family);
    const size_t n = spec.lora_scaling.empty() ? info.slots.size() : info.num_weights();
    TORCH_CHECK(pos + n <= layout.size(), "ckpt_ext::fused_segment: the layout names ", layout.size(),
                " weight slots, fewer than the layers' specs take");
    std::vector<at::Tensor> w;
    for (size_t i = 0; i < n; ++i, ++pos) {
      const int64_t k = layout[pos];
      TORCH_CHECK(k >= -1 && k < static_cast<int64_t>(weights.size()), "ckpt_ext::fused_segment: layout entry ",
                  k, " names no weight (", weights.size(), " given)");
      w.push_back(k >= 0 ? weights[static_cast<size_t>(k)] : at::Tensor());
    }
    split.push_back(std::move(w));
  }
  TORCH_CHECK(pos == layout.size(), "ckpt_ext::fused_segment: the layout names ", layout.size(),
              " weight slots, but the layers' specs take ", pos);
  TORCH_CHECK(seeds.dim() == 1 && seeds.size(0) == static_cast<int64_t>(specs.size()) &&
                  seeds.scalar_type() == at::kLong,
              "ckpt_ext::fused_segment: seeds must be an int64 tensor with one seed per layer (", specs.size(), ")");
  const at::Tensor host = seeds.to(at::kCPU).contiguous();
  std::vector<int64_t> seed_values(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + host.numel());
  layers::LayerInputs inputs{mask.value_or(at::Tensor()), cos.value_or(at::Tensor()), sin.value_or(at::Tensor())};
  auto st = make_state(specs, hidden, inputs, split, training, &seed_values);
  for (auto& e : st->autocast.entries) {
    if (e.type != hidden.device().type()) continue;
    e.enabled = autocast_dtype.has_value();
    if (autocast_dtype.has_value()) e.dtype = *autocast_dtype;
  }
  return st;
}

at::Tensor fused_segment_op(at::IntArrayRef specs, const at::Tensor& hidden, const std::optional<at::Tensor>& mask,
                            const std::optional<at::Tensor>& cos, const std::optional<at::Tensor>& sin,
                            at::TensorList weights, at::IntArrayRef layout, bool training, const at::Tensor& seeds,
                            std::optional<at::ScalarType> autocast_dtype) {
  auto st = op_state(specs, hidden, mask, cos, sin, weights, layout, training, seeds, autocast_dtype);
  return run_forward(*st, hidden);
}

// Gradients of the inputs flagged in `needs` ([hidden, weights...]), in that order, by replaying the segment of
// `st` from `x` (its input, saved or recomputed). A weight passed twice (tied) gets its whole gradient in its first
// needed entry, zeros in the others (autograd sums them). `boundary` (defined: the segment kept its last layer's
// pre-norm boundary): the replay goes back from it (layers::pre_norm_replay_*), as SegmentFunction's does.
// `inputs`: the operator's tensor inputs that the returned gradients must not alias.
std::vector<at::Tensor> segment_op_grads(const SegmentState& st, const at::Tensor& x, const at::Tensor& grad_out,
                                         at::TensorList weights, at::IntArrayRef layout, at::IntArrayRef needs,
                                         layers::PreNormBoundary* boundary, std::vector<const at::Tensor*> inputs) {
  TORCH_CHECK(needs.size() == 1 + weights.size(), "ckpt_ext::fused_segment_backward: needs has ", needs.size(),
              " entries, expected ", 1 + weights.size());
  // The dispatcher runs this kernel below autograd (Autograd keys excluded); the replay needs autograd.
  c10::impl::LocalDispatchKeySet tls = c10::impl::tls_local_dispatch_key_set();
  tls.excluded_ = tls.excluded_ - c10::autograd_dispatch_keyset_with_ADInplaceOrView;
  c10::impl::ForceDispatchKeyGuard with_autograd(tls);
  std::vector<int64_t> param_of(weights.size(), -1);  // weight k -> index into st.params
  size_t f = 0;
  for (const auto& idx : st.weight_index) {
    for (int64_t j : idx) {
      if (layout[f] >= 0) param_of[static_cast<size_t>(layout[f])] = j;
      ++f;
    }
  }
  std::vector<bool> need_param(st.params.size(), false);
  for (size_t k = 0; k < weights.size(); ++k) {
    TORCH_CHECK(param_of[k] >= 0, "ckpt_ext::fused_segment_backward: weight ", k, " is in no slot of the layout");
    if (needs[1 + k]) need_param[static_cast<size_t>(param_of[k])] = true;
  }
  const variable_list grads =
      replay_grads(st, x, grad_out.contiguous(), needs[0] != 0, need_param, nullptr, nullptr, boundary);
  std::vector<at::Tensor> out;
  std::vector<bool> given(st.params.size(), false);
  if (needs[0]) out.push_back(grads[0].defined() ? grads[0] : at::zeros_like(x, at::MemoryFormat::Contiguous));
  for (size_t k = 0; k < weights.size(); ++k) {
    if (!needs[1 + k]) continue;
    const size_t j = static_cast<size_t>(param_of[k]);
    const at::Tensor& g = grads[1 + j];
    const bool first = !given[j];
    given[j] = true;
    out.push_back(first && g.defined() ? g : at::zeros_like(weights[k]));
  }
  // An operator's outputs alias neither each other nor its inputs (the replay's gradients may be views of
  // one buffer, e.g. of a fused projection's): such an output is copied. All are contiguous, at offset 0
  // (as the fake kernel's).
  std::unordered_set<const c10::StorageImpl*> seen{grad_out.storage().unsafeGetStorageImpl()};
  for (const at::Tensor* t : inputs) {
    if (t->defined() && t->has_storage()) seen.insert(t->storage().unsafeGetStorageImpl());
  }
  for (const auto& w : weights) seen.insert(w.storage().unsafeGetStorageImpl());
  for (auto& t : out) {
    if (!seen.insert(t.storage().unsafeGetStorageImpl()).second || t.storage_offset() != 0) {
      t = t.clone(at::MemoryFormat::Contiguous);
    } else {
      t = t.contiguous();
    }
  }
  return out;
}

std::vector<at::Tensor> fused_segment_backward_op(at::IntArrayRef specs, const at::Tensor& grad_out,
                                                  const at::Tensor& hidden, const std::optional<at::Tensor>& mask,
                                                  const std::optional<at::Tensor>& cos,
                                                  const std::optional<at::Tensor>& sin, at::TensorList weights,
                                                  at::IntArrayRef layout, bool training, const at::Tensor& seeds,
                                                  std::optional<at::ScalarType> autocast_dtype, at::IntArrayRef needs) {
  auto st = op_state(specs, hidden, mask, cos, sin, weights, layout, training, seeds, autocast_dtype);
  return segment_op_grads(*st, hidden, grad_out, weights, layout, needs, nullptr, {&hidden});
}

// ---- BERT's pre-norm boundary under torch.compile (ckpt_ext::fused_segment_boundary; docs/compile.md) ----------
//
// The operator pair of a segment that keeps its last layer's pre-norm boundary (`keep_boundary`: returned as the
// outputs 1-3, non-differentiable, for its own backward), or whose input is the output of such a segment
// (`in_pre_norm` given: its backward gets that pre-norm sum instead of the input, and recomputes the input with the
// producing layer's last norm: spec `in_spec`, norm weight and bias `in_ln_weight`, `in_ln_bias`), or both. The
// forward is fused_segment's; without keep_boundary the outputs 1-3 are empty ([0], hidden's dtype).

// The producing layer's weight slots as layers::output_from_pre_norm reads them: only its last norm's weight and
// bias (found by name in the family's slots) are given.
std::vector<at::Tensor> last_norm_weights(const layers::LayerSpec& spec, const std::optional<at::Tensor>& w,
                                          const std::optional<at::Tensor>& b) {
  const auto& info = layers::family_info(spec.family);
  std::vector<at::Tensor> slots(info.num_weights());
  bool found = false;
  for (size_t i = 0; i < info.slots.size(); ++i) {
    if (info.slots[i] == "ln2_weight") {
      slots[i] = w.value_or(at::Tensor());
      found = true;
    }
    if (info.slots[i] == "ln2_bias") slots[i] = b.value_or(at::Tensor());
  }
  TORCH_CHECK(found && w.has_value(), "ckpt_ext::fused_segment_boundary: the producing layer (", spec.repr(),
              ") has no last norm weight to recompute the input from its pre-norm sum");
  return slots;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_segment_boundary_op(
    at::IntArrayRef specs, const at::Tensor& hidden, const std::optional<at::Tensor>& mask,
    const std::optional<at::Tensor>& cos, const std::optional<at::Tensor>& sin, at::TensorList weights,
    at::IntArrayRef layout, bool training, const at::Tensor& seeds, std::optional<at::ScalarType> autocast_dtype,
    bool keep_boundary, const std::optional<at::Tensor>& in_pre_norm, int64_t in_spec,
    const std::optional<at::Tensor>& in_ln_weight, const std::optional<at::Tensor>& in_ln_bias) {
  (void)in_spec;
  (void)in_ln_weight;
  (void)in_ln_bias;
  TORCH_CHECK(!in_pre_norm.has_value() ||
                  (in_pre_norm->sizes().equals(hidden.sizes()) && in_pre_norm->scalar_type() == hidden.scalar_type()),
              "ckpt_ext::fused_segment_boundary: in_pre_norm must have the shape and dtype of hidden");
  auto st = op_state(specs, hidden, mask, cos, sin, weights, layout, training, seeds, autocast_dtype);
  if (keep_boundary) {
    const size_t last = st->specs.size() - 1;
    TORCH_CHECK(layers::has_pre_norm_boundary(st->specs[last], st->weights_of(last, st->params)),
                "ckpt_ext::fused_segment_boundary: keep_boundary, but the segment's last layer (",
                st->specs[last].repr(), ") has no pre-norm boundary (not BERT, or a LoRA adapter on its output "
                "linear)");
    st->keeps_boundary = true;
  }
  at::Tensor out = run_forward(*st, hidden);
  if (!keep_boundary) {
    auto none = [&] { return at::empty({0}, hidden.options()); };
    return {out, none(), none(), none()};
  }
  layers::PreNormBoundary b = std::move(st->boundary);
  // As the fake kernel says: the pre-norm sum contiguous in hidden's shape and dtype, the row statistics [..., ]
  // without the last dim, float32 (float64 for float64 hidden states).
  const auto stats_dtype = hidden.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor pre_norm = b.pre_norm.view(hidden.sizes());
  auto stats_sizes = hidden.sizes().vec();
  stats_sizes.pop_back();
  TORCH_CHECK(pre_norm.scalar_type() == hidden.scalar_type() && pre_norm.is_contiguous() &&
                  b.mean.numel() == pre_norm.numel() / hidden.size(-1) && b.mean.scalar_type() == stats_dtype &&
                  b.rstd.scalar_type() == stats_dtype && b.mean.is_contiguous() && b.rstd.is_contiguous(),
              "ckpt_ext::fused_segment_boundary: the kept boundary is not laid out as the fake kernel says");
  return {out, pre_norm, b.mean.view(stats_sizes), b.rstd.view(stats_sizes)};
}

std::vector<at::Tensor> fused_segment_boundary_backward_op(
    at::IntArrayRef specs, const at::Tensor& grad_out, const std::optional<at::Tensor>& hidden,
    const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& cos, const std::optional<at::Tensor>& sin,
    at::TensorList weights, at::IntArrayRef layout, bool training, const at::Tensor& seeds,
    std::optional<at::ScalarType> autocast_dtype, at::IntArrayRef needs, const std::optional<at::Tensor>& pre_norm,
    const std::optional<at::Tensor>& mean, const std::optional<at::Tensor>& rstd,
    const std::optional<at::Tensor>& in_pre_norm, int64_t in_spec, const std::optional<at::Tensor>& in_ln_weight,
    const std::optional<at::Tensor>& in_ln_bias) {
  TORCH_CHECK(hidden.has_value() != in_pre_norm.has_value(), "ckpt_ext::fused_segment_boundary_backward: give "
              "either the segment's input (hidden) or the pre-norm sum it is recomputed from (in_pre_norm)");
  at::Tensor x;
  if (hidden.has_value()) {
    x = *hidden;
  } else {
    // The input as SegmentFunction's backward recomputes it (input_from_boundary): the producing layer's last
    // norm on the kept pre-norm sum, no grad, bit-identical to that layer's output in forward.
    const layers::LayerSpec& spec = registered_spec(in_spec);
    RecomputingScope recomputing;
    x = layers::output_from_pre_norm(spec, last_norm_weights(spec, in_ln_weight, in_ln_bias), *in_pre_norm);
  }
  auto st = op_state(specs, x, mask, cos, sin, weights, layout, training, seeds, autocast_dtype);
  layers::PreNormBoundary boundary;
  if (pre_norm.has_value()) {
    TORCH_CHECK(mean.has_value() && rstd.has_value(), "ckpt_ext::fused_segment_boundary_backward: pre_norm given "
                "without mean and rstd");
    boundary = layers::PreNormBoundary{*pre_norm, *mean, *rstd};
    st->keeps_boundary = true;
  }
  const at::Tensor none;
  return segment_op_grads(*st, x, grad_out, weights, layout, needs, pre_norm.has_value() ? &boundary : nullptr,
                          {hidden.has_value() ? &*hidden : &none, pre_norm.has_value() ? &*pre_norm : &none,
                           mean.has_value() ? &*mean : &none, rstd.has_value() ? &*rstd : &none,
                           in_pre_norm.has_value() ? &*in_pre_norm : &none});
}

}  // namespace

bool pre_norm_boundaries(std::optional<bool> enable) {
  return enable.has_value() ? boundaries_enabled.exchange(*enable) : boundaries_enabled.load();
}

int64_t register_spec(const layers::LayerSpec& spec) {
  spec.validate();
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry.push_back(spec);
  return static_cast<int64_t>(registry.size()) - 1;
}

const layers::LayerSpec& registered_spec(int64_t id) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  TORCH_CHECK(id >= 0 && id < static_cast<int64_t>(registry.size()), "ckpt_ext::fused_segment: unknown layer spec id ",
              id, " (ids come from ckpt_ext._C.register_spec in this process)");
  return registry[static_cast<size_t>(id)];
}

}  // namespace ckpt_ext

TORCH_LIBRARY_FRAGMENT(ckpt_ext, m) {
  m.def(
      "fused_segment(int[] specs, Tensor hidden, Tensor? mask, Tensor? cos, Tensor? sin, Tensor[] weights, "
      "int[] layout, bool training, Tensor seeds, ScalarType? autocast_dtype) -> Tensor");
  m.def(
      "fused_segment_backward(int[] specs, Tensor grad_out, Tensor hidden, Tensor? mask, Tensor? cos, Tensor? sin, "
      "Tensor[] weights, int[] layout, bool training, Tensor seeds, ScalarType? autocast_dtype, int[] needs) "
      "-> Tensor[]");
  m.def(
      "fused_segment_boundary(int[] specs, Tensor hidden, Tensor? mask, Tensor? cos, Tensor? sin, Tensor[] weights, "
      "int[] layout, bool training, Tensor seeds, ScalarType? autocast_dtype, bool keep_boundary, "
      "Tensor? in_pre_norm, int in_spec, Tensor? in_ln_weight, Tensor? in_ln_bias) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "fused_segment_boundary_backward(int[] specs, Tensor grad_out, Tensor? hidden, Tensor? mask, Tensor? cos, "
      "Tensor? sin, Tensor[] weights, int[] layout, bool training, Tensor seeds, ScalarType? autocast_dtype, "
      "int[] needs, Tensor? pre_norm, Tensor? mean, Tensor? rstd, Tensor? in_pre_norm, int in_spec, "
      "Tensor? in_ln_weight, Tensor? in_ln_bias) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(ckpt_ext, CompositeExplicitAutograd, m) {
  m.impl("fused_segment", &ckpt_ext::fused_segment_op);
  m.impl("fused_segment_backward", &ckpt_ext::fused_segment_backward_op);
  m.impl("fused_segment_boundary", &ckpt_ext::fused_segment_boundary_op);
  m.impl("fused_segment_boundary_backward", &ckpt_ext::fused_segment_boundary_backward_op);
}
