// The Llama decoder layer and its relatives, one forward on one spec (RMSNorm, rotary q/k, gated MLP,
// grouped-query attention, causal, optional biases, attention dropout), mirroring Hugging Face's decoder
// layers operation by operation:
//
//   (n1) = RMS(x); q, k [RMS per head]; q, k rotated; ctx = causal (GQA) attention
//   (n2, h1) = (RMS(h1), h1 = x + ctx Wo^T)                add_rms_norm
//   out = h1 + act(n2 Wg^T) * (n2 Wu^T) Wd^T               swiglu / geglu, residual_linear (the last linear)
//
// What sets the relatives apart (Decoder below):
//   llama   LlamaDecoderLayer; also Qwen2 (biases on q, k, v: the optional bias slots) and Mistral (its
//           sliding window is the attention mask its model passes each layer, which attention() applies)
//   qwen3   an RMSNorm over each head of q and of k (q_norm, k_norm) before the rotary embedding
//   gemma   RMSNorm scaled by (1 + weight); GeGLU (GELU, tanh or exact, instead of SiLU). Its embedding
//           scaling and final norm are the model's, outside the layers.
//   gemma3  gemma's norms and GeGLU, qwen3's per-head q/k norms (scaled by 1 + weight), and the "sandwich"
//           norms: the attention's and the MLP's outputs are normalised before they join the residual,
//             h1 = x + RMS(ctx Wo^T);  n2 = RMS(h1);  out = h1 + RMS(act Wd^T)
//           (post_attention_layernorm on the attention output, pre_/post_feedforward_layernorm around the
//           MLP). The last linear then does not feed the residual sum directly: no last_linear (the segment
//           replay runs such a layer whole), the down projection a plain GEMM site and the sum autograd's add.
//   gemma2  gemma3's layer without the q/k norms, with attention logit softcapping (spec.attn_softcap: the
//           attention written out, attention.cpp) where Hugging Face's attention applies it (eager).
#include <ATen/ATen.h>

#include "../common/checks.h"
#include "../ops/ops.h"
#include "family.h"

namespace ckpt_ext {
namespace layers {
namespace {

// Weight slots and their names (exported to Python, which maps Hugging Face's parameters to them). The
// families share the first kCount; qwen3 adds its per-head norms after them.
enum : int64_t { kLn1W, kQW, kQB, kKW, kKB, kVW, kVB, kOW, kOB, kLn2W, kGateW, kGateB, kUpW, kUpB, kDownW, kDownB,
                 kCount, kQNormW = kCount, kKNormW, kQwen3Count, kPreFfW = kQwen3Count, kPostFfW, kGemma3Count };
constexpr const char* kSlotNames[] = {
    "ln1_weight", "q_weight", "q_bias", "k_weight", "k_bias", "v_weight", "v_bias", "o_weight", "o_bias",
    "ln2_weight", "gate_weight", "gate_bias", "up_weight", "up_bias", "down_weight", "down_bias",
    "q_norm_weight", "k_norm_weight", "pre_ff_norm_weight", "post_ff_norm_weight"};
static_assert(sizeof(kSlotNames) / sizeof(kSlotNames[0]) == kGemma3Count, "one name per weight slot");
// Gemma 2: the shared slots, then its two MLP norms (no q/k norms).
enum : int64_t { kGemma2PreFfW = kCount, kGemma2PostFfW, kGemma2Count };
std::vector<std::string> gemma2_slots() {
  std::vector<std::string> names(kSlotNames, kSlotNames + kCount);
  names.insert(names.end(), kSlotNames + kPreFfW, kSlotNames + kGemma3Count);
  return names;
}
// The projections that may carry a LoRA adapter (adapter j's A, B follow the slots above).
enum : int64_t { kLoraQ, kLoraK, kLoraV, kLoraO, kLoraGate, kLoraUp, kLoraDown };
const std::vector<std::string> kLora{"q_weight", "k_weight", "v_weight", "o_weight", "gate_weight", "up_weight",
                                     "down_weight"};

// The GEMM sites of the recompute levels (layer.h's KeptGemms; the down projection is the last linear's).
enum : int { kSiteO = 1, kSiteGate = 2, kSiteUp = 3 };

struct Decoder {
  const char* label;  // in messages
  bool qk_norm;       // qwen3: RMSNorm over each head of q and k (slots kQNormW, kKNormW), before rotary
  bool unit_offset;   // gemma: RMSNorm scaled by (1 + weight)
  bool gelu;          // gemma: GeGLU (spec.gelu_tanh: tanh or exact GELU) instead of SwiGLU
  bool sandwich;      // gemma2/3: RMSNorm of the attention output (kLn2W) and of the MLP output (post_ff) before
                      // each joins the residual; the MLP's input norm is pre_ff
  int64_t pre_ff = -1, post_ff = -1;  // sandwich: the slots of the MLP's input and output norm weights
};
constexpr Decoder kLlama{"Llama", false, false, false, false};
constexpr Decoder kQwen3{"Qwen3", true, false, false, false};
constexpr Decoder kGemma{"Gemma", false, true, true, false};
constexpr Decoder kGemma3{"Gemma3", true, true, true, true, kPreFfW, kPostFfW};
constexpr Decoder kGemma2{"Gemma2", false, true, true, true, kGemma2PreFfW, kGemma2PostFfW};

void check(const Decoder& d, const LayerSpec& s, const std::vector<Tensor>& w) {
  const int64_t H = s.hidden;
  for (int64_t i : {kLn1W, kQW, kKW, kVW, kOW, kLn2W, kGateW, kUpW, kDownW}) check_present(s, w, i, "every weight");
  check_matrix(s, "self_attn.q_proj.weight", w[kQW], s.num_heads * s.head_dim, H);
  check_matrix(s, "self_attn.k_proj.weight", w[kKW], s.num_kv_heads * s.head_dim, H);
  check_matrix(s, "self_attn.v_proj.weight", w[kVW], s.num_kv_heads * s.head_dim, H);
  check_matrix(s, "self_attn.o_proj.weight", w[kOW], H, s.num_heads * s.head_dim);
  check_vector(w[kLn1W], H, "input_layernorm.weight", nullptr, "ckpt_ext fused ", d.label, " layer");
  check_vector(w[kLn2W], H, "post_attention_layernorm.weight", nullptr, "ckpt_ext fused ", d.label, " layer");
  if (d.qk_norm) {
    check_present(s, w, kQNormW, "self_attn.q_norm.weight");
    check_present(s, w, kKNormW, "self_attn.k_norm.weight");
    check_vector(w[kQNormW], s.head_dim, "self_attn.q_norm.weight", nullptr, "ckpt_ext fused ", d.label, " layer");
    check_vector(w[kKNormW], s.head_dim, "self_attn.k_norm.weight", nullptr, "ckpt_ext fused ", d.label, " layer");
  }
  if (d.sandwich) {
    check_present(s, w, d.pre_ff, "pre_feedforward_layernorm.weight");
    check_present(s, w, d.post_ff, "post_feedforward_layernorm.weight");
    check_vector(w[d.pre_ff], H, "pre_feedforward_layernorm.weight", nullptr, "ckpt_ext fused ", d.label, " layer");
    check_vector(w[d.post_ff], H, "post_feedforward_layernorm.weight", nullptr, "ckpt_ext fused ", d.label, " layer");
  }
}

LastLinear last_linear(const LayerSpec&, const std::vector<Tensor>& w, const LayerRng&) {
  return LastLinear{w[kDownW], w[kDownB], /*conv1d=*/false, 0.0, kMlpOut, kDownW, kDownB};
}

// The RMSNorm weight as the kernel multiplies it: Gemma's scale is 1 + weight (a differentiable add; in
// float32 the same product as GemmaRMSNorm's, in a reduced-precision model 1 + weight is rounded once more).
Tensor norm_weight(const Decoder& d, const Tensor& w) { return d.unit_offset ? w + 1 : w; }

// Qwen3's q_norm/k_norm: RMSNorm over the last dim (head_dim) of each head, computed by the rms norm op
// on the [B, heads, S, D] tensor. Under autocast the projection is in the autocast dtype and the norm's
// weight in the parameters' (float32): Hugging Face's Qwen3RMSNorm then returns weight * normalised in
// float32, which the rotary embedding (float32 tables) and SDPA (autocast) take; the op runs in the
// weight's dtype for the same dtypes downstream.
Tensor head_rms_norm(const LayerSpec& s, const Tensor& t, const Tensor& weight) {
  return std::get<0>(ops::add_rms_norm(norm_input(t, weight), std::nullopt, weight, s.eps));
}

// Gemma 3's q_norm/k_norm: Gemma3RMSNorm returns the projection's dtype (`type_as`), which the rotary embedding
// then multiplies by its float32 tables under autocast: the norm's output rounded to the projection's dtype and
// read back in the weight's (float32 under autocast; no copies outside it).
Tensor head_rms_norm_typed(const LayerSpec& s, const Tensor& t, const Tensor& weight) {
  const Tensor n = std::get<0>(ops::add_rms_norm(norm_input(t, weight), std::nullopt, weight, s.eps, t.scalar_type()));
  return like(n, weight);
}

// Gemma 2/3's sandwich norms of a GEMM output `y` (the attention's o projection, the MLP's down projection) beside the
// residual `stream`: Gemma2/3RMSNorm computes in float32 and returns y's dtype (`type_as`), which then joins the
// stream (under autocast a bfloat16 output beside the float32 stream, added in float32 as Hugging Face's add promotes).
Tensor output_norm(const LayerSpec& s, const Tensor& y, const Tensor& stream, const Tensor& weight) {
  return std::get<0>(ops::add_rms_norm(norm_input(y, stream), std::nullopt, weight, s.eps, y.scalar_type()));
}

LayerOutput forward(const Decoder& d, const LayerSpec& s, const Tensor& x, const LayerInputs& in,
                    const std::vector<Tensor>& w, const LayerRng& rng, const Tensor& out_slot, bool stop,
                    KeptAttention* kept) {
  TORCH_CHECK(in.cos.defined() && in.sin.defined(), "ckpt_ext fused ", d.label,
              " layer: position_embeddings (cos, sin) are required; Hugging Face's decoder models pass them to "
              "every layer");
  // Under autocast n1 and n2 feed only GEMMs: written in their dtype (gemm_input_dtype), unless a LoRA adapter
  // reads them (its dropout would round differently; it keeps the float32 output and the casts).
  const auto n1_dtype = any_adapter(s, w, {kLoraQ, kLoraK, kLoraV}) ? std::nullopt : gemm_input_dtype(x);
  // x is also the post-attention norm's residual: that norm takes the copy of x this one writes anyway (its `sum`,
  // the same bits), so that x's two gradients meet in this norm's backward kernel (its grad_sum) instead of
  // autograd's add (issue 32).
  const auto [n1, x_res, n1_rstd] = ops::add_rms_norm(x, std::nullopt, norm_weight(d, w[kLn1W]), s.eps, n1_dtype);
  (void)n1_rstd;
  const Tensor wqkv = at::cat({w[kQW], w[kKW], w[kVW]}, 0);
  const Tensor bqkv = cat_or_undefined({w[kQB], w[kKB], w[kVB]});
  const int64_t qw = s.num_heads * s.head_dim, kvw = s.num_kv_heads * s.head_dim;
  const Tensor qkv = plus_lora_qkv(s, w, {kLoraQ, kLoraK, kLoraV}, n1,
                                  gemm_linear(n1, wqkv, bqkv, KeptGemms::kQkv), {qw, kvw, kvw}, rng);
  auto [q_raw, k_raw, v] = split_qkv(qkv, s.num_heads, s.num_kv_heads, s.head_dim);
  if (d.qk_norm) {
    const auto norm = d.unit_offset ? &head_rms_norm_typed : &head_rms_norm;
    q_raw = norm(s, q_raw, norm_weight(d, w[kQNormW]));
    k_raw = norm(s, k_raw, norm_weight(d, w[kKNormW]));
  }
  const Tensor cos = like(in.cos, q_raw), sin = like(in.sin, q_raw);
  const Tensor q = ops::rotary(q_raw, cos, sin);
  const Tensor k = ops::rotary(k_raw, cos, sin);
  const Tensor ctx = merge_heads(attention(q, k, v, in.mask, /*causal=*/true, s.scaling, effective(s.attn_p, rng),
                                           rng.seed, kAttnProbs, kept, s.attn_softcap));
  const Tensor o_proj = plus_lora(gemm_linear(ctx, w[kOW], w[kOB], kSiteO), lora_delta(s, w, kLoraO, ctx, rng));
  // Sandwich: the attention output normalised (kLn2W) joins the residual, and the MLP's input norm is pre_ff.
  const Tensor o =
      norm_input(d.sandwich ? output_norm(s, o_proj, x, norm_weight(d, w[kLn2W])) : o_proj, x);
  const Tensor& mlp_norm_w = w[d.sandwich ? d.pre_ff : kLn2W];
  const bool mlp_adapter = any_adapter(s, w, {kLoraGate, kLoraUp, kLoraUp});
  const auto n2_dtype = mlp_adapter ? std::nullopt : gemm_input_dtype(x);
  Tensor n2, n2_up, h1;
  if (!mlp_adapter) {
    // n2 feeds two GEMMs: one handle each (add_rms_norm_fanout), so that the backward adds their two gradients
    // (in float32 for a lower-precision n2, as autograd added the casts' float32 gradients -- summed in bfloat16 they
    // would round; in the stream's dtype otherwise, autograd's add in the kernel, issue 32).
    std::tie(n2, n2_up, h1, std::ignore) = ops::add_rms_norm_fanout(o, x_res, norm_weight(d, mlp_norm_w), s.eps,
                                                                    n2_dtype.value_or(x_res.scalar_type()));
  } else {
    std::tie(n2, h1, std::ignore) = ops::add_rms_norm(o, x_res, norm_weight(d, mlp_norm_w), s.eps);
    n2_up = n2;
  }
  // Two GEMMs rather than one over [gate; up]: the gated activation reads contiguous halves without a copy.
  const Tensor gate = plus_lora(gemm_linear(n2, w[kGateW], w[kGateB], kSiteGate), lora_delta(s, w, kLoraGate, n2, rng));
  const Tensor up = plus_lora(gemm_linear(n2_up, w[kUpW], w[kUpB], kSiteUp), lora_delta(s, w, kLoraUp, n2_up, rng));
  if (!d.sandwich && stops_before_activation(stop, any_adapter(s, w, {kLoraDown, kLoraDown, kLoraDown}),
                                             kept_gemm(kSiteGate).defined() || kept_gemm(kSiteUp).defined())) {
    LayerOutput r;  // the replay: the activation runs in replay_backward (issue 33)
    r.act = {d.gelu ? StoppedActivation::kGeglu : StoppedActivation::kSwiglu, s.gelu_tanh, gate, up};
    r.residual = h1;
    return r;
  }
  const Tensor act = d.gelu ? ops::geglu(gate, up, s.gelu_tanh ? "tanh" : "none") : ops::swiglu(gate, up);
  if (d.sandwich) {
    // out = h1 + RMS(act Wd^T): the down projection is a GEMM site of the recompute levels (kLastLinear's number:
    // the layer's fifth GEMM; no replay stops before it), its normalised output joins h1 through autograd's add.
    const Tensor down = plus_lora(gemm_linear(act, w[kDownW], w[kDownB], KeptGemms::kLastLinear),
                                  lora_delta(s, w, kLoraDown, act, rng));
    const Tensor m = output_norm(s, down, h1, norm_weight(d, w[d.post_ff]));
    LayerOutput r;
    if (out_slot.defined()) {
      Tensor slot = out_slot;  // (a handle of the same tensor: add_out takes a non-const reference)
      r.out = at::add_out(slot, h1, m);
    } else {
      r.out = h1 + m;
    }
    return r;
  }
  return last_linear_tail(s, w, rng, last_linear(s, w, rng), act, h1, out_slot, stop,
                          lora_delta(s, w, kLoraDown, act, rng));
}

// One family per Decoder: the LayerFamily entry points bound to it.
template <const Decoder& D>
void check_of(const LayerSpec& s, const std::vector<Tensor>& w) {
  check(D, s, w);
}
template <const Decoder& D>
LayerOutput forward_of(const LayerSpec& s, const Tensor& x, const LayerInputs& in, const std::vector<Tensor>& w,
                       const LayerRng& rng, const Tensor& out_slot, bool stop, KeptAttention* kept) {
  return forward(D, s, x, in, w, rng, out_slot, stop, kept);
}

}  // namespace

const LayerFamily kLlamaFamily{{Family::kLlama, "llama", {kSlotNames, kSlotNames + kCount}, kLora},
                               &check_of<kLlama>, &forward_of<kLlama>, &last_linear};
const LayerFamily kQwen3Family{{Family::kQwen3, "qwen3", {kSlotNames, kSlotNames + kQwen3Count}, kLora},
                               &check_of<kQwen3>, &forward_of<kQwen3>, &last_linear};
const LayerFamily kGemmaFamily{{Family::kGemma, "gemma", {kSlotNames, kSlotNames + kCount}, kLora},
                               &check_of<kGemma>, &forward_of<kGemma>, &last_linear};
// No last_linear: its down projection's output is normalised before the residual sum (Decoder::sandwich).
const LayerFamily kGemma3Family{{Family::kGemma3, "gemma3", {kSlotNames, kSlotNames + kGemma3Count}, kLora},
                                &check_of<kGemma3>, &forward_of<kGemma3>, nullptr};
const LayerFamily kGemma2Family{{Family::kGemma2, "gemma2", gemma2_slots(), kLora}, &check_of<kGemma2>,
                                &forward_of<kGemma2>, nullptr};

}  // namespace layers
}  // namespace ckpt_ext
