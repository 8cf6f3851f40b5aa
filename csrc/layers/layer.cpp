// The layer's spec and dispatch by family, the checks every layer call shares, and the segment's replay
// interface (layer.h). Each family lives in its own file (bert.cpp, gpt2.cpp, llama.cpp: Llama and its
// relatives).
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <atomic>
#include <sstream>
#include <utility>

#include "family.h"
#include "rng.h"

namespace ckpt_ext {
namespace layers {

namespace {

const LayerFamily& family(Family f) {
  switch (f) {
    case Family::kBert:
      return kBertFamily;
    case Family::kGPT2:
      return kGpt2Family;
    case Family::kLlama:
      return kLlamaFamily;
    case Family::kQwen3:
      return kQwen3Family;
    case Family::kGemma:
      return kGemmaFamily;
    case Family::kGemma3:
      return kGemma3Family;
    case Family::kGemma2:
      return kGemma2Family;
  }
  TORCH_CHECK(false, "ckpt_ext: unknown layer family ", static_cast<int64_t>(f));
}

// The hidden states, and the mask and rotary tables against them.
void check_inputs(const LayerSpec& spec, const Tensor& hidden, const LayerInputs& in) {
  TORCH_CHECK(hidden.dim() == 3 && hidden.size(2) == spec.hidden, "ckpt_ext fused ", family_name(spec.family),
              " layer: hidden_states must be [batch, seq, ", spec.hidden, "], got ", hidden.sizes());
  TORCH_CHECK(hidden.is_cpu() || hidden.is_cuda(), "ckpt_ext fused ", family_name(spec.family),
              " layer: hidden_states must be a CPU or CUDA tensor, got device ", hidden.device());
  if (in.mask.defined()) {
    TORCH_CHECK(in.mask.device() == hidden.device(), "ckpt_ext fused ", family_name(spec.family),
                " layer: attention_mask is on ", in.mask.device(), " but the hidden states are on ", hidden.device(),
                "; move the mask to the hidden states' device");
    TORCH_CHECK(in.mask.dim() == 4, "ckpt_ext fused ", family_name(spec.family),
                " layer: attention_mask must be the 4-D mask Hugging Face's models pass to their layers ([batch or "
                "1, 1 or heads, seq, seq], bool with True = attend, or additive float), got shape ",
                in.mask.sizes());
    TORCH_CHECK(in.mask.scalar_type() == at::kBool || in.mask.scalar_type() == hidden.scalar_type(),
                "ckpt_ext fused ", family_name(spec.family), " layer: attention_mask must be bool or have the dtype "
                "of the hidden states (", hidden.scalar_type(), "), got ", in.mask.scalar_type());
    const int64_t b = hidden.size(0), seq = hidden.size(1);
    TORCH_CHECK((in.mask.size(0) == 1 || in.mask.size(0) == b) &&
                    (in.mask.size(1) == 1 || in.mask.size(1) == spec.num_heads) &&
                    (in.mask.size(2) == 1 || in.mask.size(2) == seq) && in.mask.size(3) == seq,
                "ckpt_ext fused ", family_name(spec.family), " layer: attention_mask of shape ", in.mask.sizes(),
                " does not fit hidden states of shape ", hidden.sizes(), " with ", spec.num_heads,
                " heads; it must broadcast to [batch=", b, ", heads=", spec.num_heads, ", seq=", seq, ", seq=", seq,
                "] (dims of size 1 broadcast, the last must be ", seq, ")");
  }
  for (const Tensor* t : {&in.cos, &in.sin}) {
    if (!t->defined()) continue;
    TORCH_CHECK(t->device() == hidden.device() && t->scalar_type() == hidden.scalar_type(), "ckpt_ext fused ",
                family_name(spec.family), " layer: position_embeddings (cos, sin) are ", t->scalar_type(), " on ",
                t->device(), " but the hidden states are ", hidden.scalar_type(), " on ", hidden.device(),
                "; pass the tables the model computed for these hidden states");
  }
}

// The KeptGemms a layer call uses: `gemms`, unless the call has LoRA adapters (then none, and not_kept says why:
// the kept nodes know the base GEMMs only, and an adapter's input gradient would join theirs).
KeptGemms* gemms_for(const LayerSpec& spec, const std::vector<Tensor>& weights, KeptGemms* gemms) {
  if (gemms == nullptr) return nullptr;
  const size_t n = family(spec.family).info.slots.size();
  for (size_t i = n; i < weights.size(); ++i) {
    if (weights[i].defined()) {
      gemms->not_kept = "it has LoRA adapters, whose layers keep no GEMM outputs (only what the level keeps besides)";
      return nullptr;
    }
  }
  return gemms;
}

}  // namespace

static std::atomic<bool> mixed_norms{true};  // mixed_dtype_norms (layer.h)
static std::atomic<bool> lowp_norm_outputs{true};  // mixed_dtype_norm_outputs (layer.h)

bool mixed_dtype_norm_outputs() { return lowp_norm_outputs.load(std::memory_order_relaxed); }

bool set_mixed_dtype_norm_outputs(std::optional<bool> set) {
  return set.has_value() ? lowp_norm_outputs.exchange(*set) : lowp_norm_outputs.load();
}

std::optional<at::ScalarType> gemm_input_dtype(const Tensor& stream) {
  const c10::DeviceType dt = stream.device().type();
  if (!mixed_dtype_norm_outputs() || stream.scalar_type() != at::kFloat ||
      (dt != c10::DeviceType::CPU && dt != c10::DeviceType::CUDA) || !at::autocast::is_autocast_enabled(dt))
    return std::nullopt;
  const at::ScalarType a = at::autocast::get_autocast_dtype(dt);
  if (a != at::kBFloat16 && a != at::kHalf) return std::nullopt;
  return a;
}

bool mixed_dtype_norms() { return mixed_norms.load(std::memory_order_relaxed); }

bool set_mixed_dtype_norms(std::optional<bool> set) {
  return set.has_value() ? mixed_norms.exchange(*set) : mixed_norms.load();
}

const FamilyInfo& family_info(Family f) { return family(f).info; }

const std::vector<Family>& all_families() {
  static const std::vector<Family> all{Family::kBert, Family::kGPT2, Family::kLlama, Family::kQwen3,
                                       Family::kGemma, Family::kGemma3, Family::kGemma2};
  return all;
}

const char* family_name(Family f) { return family(f).info.name; }

void LayerSpec::validate() const {
  const auto f = static_cast<int64_t>(family);
  TORCH_CHECK(f >= 0 && f <= static_cast<int64_t>(Family::kGemma2), "ckpt_ext LayerSpec: unknown family ", f);
  const bool decoder = is_rotary_decoder(family);
  TORCH_CHECK(hidden > 0 && num_heads > 0 && num_kv_heads > 0 && head_dim > 0,
              "ckpt_ext LayerSpec: hidden, num_heads, num_kv_heads and head_dim must be positive, got ", repr());
  TORCH_CHECK(num_heads % num_kv_heads == 0, "ckpt_ext LayerSpec: num_heads (", num_heads,
              ") must be a multiple of num_kv_heads (", num_kv_heads, ")");
  TORCH_CHECK(decoder || num_kv_heads == num_heads,
              "ckpt_ext LayerSpec: grouped-query attention (num_kv_heads != num_heads) is a feature of the rotary "
              "decoders (llama, qwen3, gemma)");
  TORCH_CHECK(decoder || num_heads * head_dim == hidden, "ckpt_ext LayerSpec: num_heads * head_dim (",
              num_heads * head_dim, ") must equal hidden (", hidden, ") for ", family_name(family));
  TORCH_CHECK(!decoder || head_dim % 2 == 0, "ckpt_ext LayerSpec: rotary needs an even head_dim, got ",
              head_dim);
  TORCH_CHECK(attn_p >= 0 && attn_p < 1 && hidden_p >= 0 && hidden_p < 1,
              "ckpt_ext LayerSpec: dropout probabilities must be in [0, 1), got attn_p=", attn_p,
              ", hidden_p=", hidden_p);
  TORCH_CHECK(!decoder || hidden_p == 0, "ckpt_ext LayerSpec: ", family_name(family),
              " layers have no hidden dropout");
  TORCH_CHECK(eps >= 0, "ckpt_ext LayerSpec: eps must be >= 0, got ", eps);
  TORCH_CHECK(attn_softcap >= 0 && (attn_softcap == 0 || decoder), "ckpt_ext LayerSpec: attn_softcap must be >= 0 "
              "(0: none), and only the rotary decoders take one, got ", attn_softcap, " for ", family_name(family));
  const size_t n_lora = family_info(family).lora.size();
  TORCH_CHECK(lora_scaling.size() == lora_p.size() && (lora_p.empty() || lora_p.size() == n_lora),
              "ckpt_ext LayerSpec: lora_scaling and lora_p need one value per adapter projection (", n_lora,
              " for ", family_name(family), ") or none, got ", lora_scaling.size(), " and ", lora_p.size());
  for (double p : lora_p)
    TORCH_CHECK(p >= 0 && p < 1, "ckpt_ext LayerSpec: LoRA dropout probabilities must be in [0, 1), got ", p);
}

std::string LayerSpec::repr() const {
  std::ostringstream os;
  os << "LayerSpec(family=" << family_name(family) << ", hidden=" << hidden << ", num_heads=" << num_heads
     << ", num_kv_heads=" << num_kv_heads << ", head_dim=" << head_dim << ", scaling=" << scaling
     << ", attn_p=" << attn_p << ", hidden_p=" << hidden_p << ", eps=" << eps << ", gelu_tanh=" << gelu_tanh;
  if (attn_softcap > 0) os << ", attn_softcap=" << attn_softcap;
  if (!lora_p.empty()) {
    os << ", lora_scaling=[";
    for (size_t j = 0; j < lora_scaling.size(); ++j) os << (j ? ", " : "") << lora_scaling[j];
    os << "], lora_p=[";
    for (size_t j = 0; j < lora_p.size(); ++j) os << (j ? ", " : "") << lora_p[j];
    os << "]";
  }
  os << ")";
  return os.str();
}

void check_matrix(const LayerSpec& s, const char* name, const Tensor& t, int64_t rows, int64_t cols) {
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols, "ckpt_ext fused ", family_name(s.family),
              " layer: ", name, " must have shape [", rows, ", ", cols, "], got ", t.sizes());
}

void check_present(const LayerSpec& s, const std::vector<Tensor>& w, int64_t i, const char* what) {
  TORCH_CHECK(w[i].defined(), "ckpt_ext fused ", family_name(s.family), " layer: ", what, " is required");
}

void check_weights(const LayerSpec& s, const std::vector<Tensor>& w, const Tensor& hidden) {
  const LayerFamily& fam = family(s.family);
  // Without adapters the adapter slots may be left out altogether.
  const size_t n = fam.info.slots.size(), n_all = fam.info.num_weights();
  TORCH_CHECK(w.size() == n || w.size() == n_all, "ckpt_ext fused ", fam.info.name, " layer: expected ", n,
              " weights (or ", n_all, " with the LoRA adapter slots), got ", w.size());
  for (size_t i = 0; i < w.size(); ++i) {
    if (!w[i].defined()) continue;
    // Adapter weights may be wider than the layer's (peft keeps float32 adapters on a bfloat16 model and
    // computes their term in float32): check_lora checks them.
    const bool dtype_ok = i >= n ? at::isFloatingType(w[i].scalar_type()) : w[i].scalar_type() == hidden.scalar_type();
    TORCH_CHECK(w[i].device() == hidden.device() && dtype_ok, "ckpt_ext fused ",
                fam.info.name, " layer: weight ", i, " is ", w[i].scalar_type(), " on ", w[i].device(),
                " but the hidden states are ", hidden.scalar_type(), " on ", hidden.device(), " (weight slot ",
                fam.info.slot_name(i), "); the fused layers keep the residual stream in the parameters' dtype (cast the whole model with "
                "model.to(dtype), or keep float32 weights and use torch.autocast)");
  }
  fam.check_weights(s, w);
  if (w.size() == n_all) check_lora(s, w);
}

bool uses_dropout(const LayerSpec& spec, bool training) {
  return training && (spec.attn_p > 0 || spec.hidden_p > 0 ||
                      std::any_of(spec.lora_p.begin(), spec.lora_p.end(), [](double p) { return p > 0; }));
}

LayerOutput layer_forward(const LayerSpec& spec, const Tensor& hidden, const LayerInputs& in,
                          const std::vector<Tensor>& weights, const LayerRng& rng, const Tensor& out_slot,
                          KeptAttention* kept, KeptGemms* gemms) {
  check_inputs(spec, hidden, in);
  TORCH_CHECK(!out_slot.defined() || !c10::GradMode::is_enabled(),
              "ckpt_ext: a layer writes into a preallocated output only under no_grad");
  KeptGemmsScope scope(gemms_for(spec, weights, gemms));
  return family(spec.family).forward(spec, hidden, in, weights, rng, out_slot, /*stop=*/false, kept);
}

Tensor fused_layer_forward(const LayerSpec& spec, const Tensor& hidden, const LayerInputs& in,
                           const std::vector<Tensor>& weights, bool training) {
  check_weights(spec, weights, hidden);
  LayerRng rng{training, uses_dropout(spec, training) ? draw_dropout_seed(hidden.device()) : 0};
  return layer_forward(spec, hidden, prepared(in), weights, rng).out;
}

// ---- the segment's replay --------------------------------------------------------------------------------------

LayerOutput replay_forward(const LayerSpec& spec, const Tensor& hidden, const LayerInputs& in,
                           const std::vector<Tensor>& weights, const LayerRng& rng, KeptAttention* kept,
                           KeptGemms* gemms) {
  check_inputs(spec, hidden, in);
  const LayerFamily& fam = family(spec.family);
  KeptGemmsScope scope(gemms_for(spec, weights, gemms));
  return fam.forward(spec, hidden, in, weights, rng, Tensor(), /*stop=*/fam.last_linear != nullptr, kept);
}

ReplayBackward replay_backward(const LayerSpec& spec, const std::vector<Tensor>& weights, const LayerRng& rng,
                               const LayerOutput& replayed, const Tensor& grad_out,
                               const std::vector<bool>& need_slot) {
  ReplayBackward r;
  if (replayed.out.defined()) {  // ran whole: autograd takes it from the output
    if (replayed.out.requires_grad()) {
      r.outputs.push_back(replayed.out);
      r.grads.push_back(grad_out);
    }
    return r;
  }
  if (replayed.act.defined())  // stopped before the activation (issue 33)
    return last_linear_act_backward(family(spec.family).last_linear(spec, weights, rng), replayed.act,
                                    replayed.residual, grad_out, rng.seed);
  // Stopped before the last linear: its gradients from the incoming gradient, the rest through autograd
  // from its input (gradient g.x) and the residual (gradient grad_out itself).
  const LastLinear lin = family(spec.family).last_linear(spec, weights, rng);
  const bool need_w = need_slot[static_cast<size_t>(lin.weight_slot)];
  const bool need_b = lin.bias.defined() && need_slot[static_cast<size_t>(lin.bias_slot)];
  const Tensor& x = replayed.last_input;
  auto g = residual_linear_backward(grad_out, x, lin, rng.seed, x.requires_grad(), need_w, need_b);
  if (need_w) r.slot_grads.emplace_back(lin.weight_slot, g.weight);
  if (need_b) r.slot_grads.emplace_back(lin.bias_slot, g.bias);
  if (g.x.defined()) {
    r.outputs.push_back(x);
    r.grads.push_back(g.x);
  }
  if (replayed.residual.requires_grad()) {
    r.outputs.push_back(replayed.residual);
    r.grads.push_back(grad_out);
  }
  return r;
}

// ---- the pre-norm boundary (BERT/RoBERTa) ----------------------------------------------------------------------

bool has_pre_norm_boundary(const LayerSpec& spec, const std::vector<Tensor>& weights) {
  return spec.family == Family::kBert && bert_has_pre_norm_boundary(spec, weights);
}

Tensor output_from_pre_norm(const LayerSpec& spec, const std::vector<Tensor>& weights, const Tensor& pre_norm) {
  TORCH_CHECK(spec.family == Family::kBert, "ckpt_ext: ", family_name(spec.family), " layers have no pre-norm boundary");
  return bert_output_from_pre_norm(spec, weights, pre_norm);
}

LayerOutput pre_norm_replay_forward(const LayerSpec& spec, const Tensor& hidden, const LayerInputs& in,
                                    const std::vector<Tensor>& weights, const LayerRng& rng, KeptAttention* kept,
                                    KeptGemms* gemms) {
  TORCH_CHECK(has_pre_norm_boundary(spec, weights), "ckpt_ext: this ", family_name(spec.family),
              " layer has no pre-norm boundary");
  check_inputs(spec, hidden, in);
  KeptGemmsScope scope(gemms_for(spec, weights, gemms));
  return family(spec.family).forward(spec, hidden, in, weights, rng, Tensor(), /*stop=*/true, kept);
}

ReplayBackward pre_norm_replay_backward(const LayerSpec& spec, const std::vector<Tensor>& weights,
                                        const LayerRng& rng, const LayerOutput& replayed, PreNormBoundary boundary,
                                        const Tensor& grad_out, const std::vector<bool>& need_slot) {
  TORCH_CHECK(spec.family == Family::kBert, "ckpt_ext: ", family_name(spec.family), " layers have no pre-norm boundary");
  return bert_pre_norm_backward(spec, weights, rng, replayed, std::move(boundary), grad_out, need_slot);
}

}  // namespace layers
}  // namespace ckpt_ext
