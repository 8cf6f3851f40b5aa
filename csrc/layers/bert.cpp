// The BERT/RoBERTa encoder layer (post-LN, exact or tanh GELU, biases, padding mask, hidden and
// attention-probability dropout), mirroring Hugging Face's BertLayer operation by operation:
//
//   qkv = x Wqkv^T + b (one GEMM over the three weights); ctx = attention(q, k, v, mask)
//   h1  = LN(x + dropout(ctx Wo^T + bo))                      bias_dropout_add_layer_norm
//   out = LN(h1 + dropout(gelu(h1 Wi^T + bi) Wo2^T + bo2))    bias_gelu, bias_dropout_add_layer_norm
#include <ATen/ATen.h>

#include "../ops/ops.h"
#include "family.h"

namespace ckpt_ext {
namespace layers {
namespace {

// Weight slots and their names (exported to Python, which maps Hugging Face's parameters to them).
enum : int64_t { kQW, kQB, kKW, kKB, kVW, kVB, kAttnOutW, kAttnOutB, kLn1W, kLn1B, kInterW, kInterB, kOutW, kOutB,
                 kLn2W, kLn2B, kCount };
constexpr const char* kSlotNames[] = {
    "q_weight", "q_bias", "k_weight", "k_bias", "v_weight", "v_bias", "attn_out_weight", "attn_out_bias",
    "ln1_weight", "ln1_bias", "inter_weight", "inter_bias", "out_weight", "out_bias", "ln2_weight", "ln2_bias"};
static_assert(sizeof(kSlotNames) / sizeof(kSlotNames[0]) == kCount, "one name per weight slot");
// The projections that may carry a LoRA adapter (adapter j's A, B follow the slots above).
enum : int64_t { kLoraQ, kLoraK, kLoraV, kLoraAttnOut, kLoraInter, kLoraOut };
const std::vector<std::string> kLora{"q_weight", "k_weight", "v_weight", "attn_out_weight", "inter_weight",
                                     "out_weight"};

// The GEMM sites of the recompute levels (layer.h's KeptGemms; the q/k/v projection is KeptGemms::kQkv).
enum : int { kSiteAttnOut = 1, kSiteInter = 2, kSiteOut = 3 };

void check(const LayerSpec& s, const std::vector<Tensor>& w) {
  const int64_t H = s.hidden;
  for (int64_t i : {kQW, kKW, kVW, kAttnOutW}) {
    check_present(s, w, i, "every attention weight");
    check_matrix(s, "attention weight", w[i], H, H);
  }
  check_present(s, w, kLn1W, "LayerNorm weight");
  check_present(s, w, kLn2W, "LayerNorm weight");
  check_present(s, w, kInterW, "intermediate weight");
  check_present(s, w, kOutW, "output weight");
  check_matrix(s, "output.dense.weight", w[kOutW], H, w[kInterW].size(0));
}

LayerOutput forward(const LayerSpec& s, const Tensor& x, const LayerInputs& in, const std::vector<Tensor>& w,
                    const LayerRng& rng, const Tensor& out_slot, bool /*stop: no last_linear*/,
                    KeptAttention* kept) {
  const double hidden_p = effective(s.hidden_p, rng);
  const int64_t H = s.hidden;
  // Without adapters, the projection's own node (qkv.cpp: no gradient concatenation in backward).
  const auto [q, k, v] =
      any_adapter(s, w, {kLoraQ, kLoraK, kLoraV})
          ? split_qkv(plus_lora_qkv(s, w, {kLoraQ, kLoraK, kLoraV}, x,
                                    gemm_linear(x, at::cat({w[kQW], w[kKW], w[kVW]}, 0),
                                                cat_or_undefined({w[kQB], w[kKB], w[kVB]}), KeptGemms::kQkv),
                                    {H, H, H}, rng),
                      s.num_heads, s.num_heads, s.head_dim)
          : qkv_heads(x, {w[kQW], w[kKW], w[kVW]}, {w[kQB], w[kKB], w[kVB]}, s.num_heads, s.num_heads, s.head_dim);
  const Tensor ctx = merge_heads(attention(q, k, v, in.mask, /*causal=*/false, s.scaling, effective(s.attn_p, rng),
                                           rng.seed, kAttnProbs, kept));
  const Tensor h1 = std::get<0>(ops::bias_dropout_add_layer_norm(
      like(plus_lora(gemm_linear(ctx, w[kAttnOutW], Tensor(), kSiteAttnOut), lora_delta(s, w, kLoraAttnOut, ctx, rng)), x),
                                                                 opt(w[kAttnOutB]), x, w[kLn1W], opt(w[kLn1B]),
                                                                 hidden_p, s.eps, rng.seed, kAttnOut));
  const Tensor i = plus_lora(gemm_linear(h1, w[kInterW], Tensor(), kSiteInter), lora_delta(s, w, kLoraInter, h1, rng));
  const Tensor inter = ops::bias_gelu(i, opt_like(w[kInterB], i), s.gelu_tanh ? "tanh" : "none");
  const Tensor o = like(plus_lora(gemm_linear(inter, w[kOutW], Tensor(), kSiteOut), lora_delta(s, w, kLoraOut, inter, rng)), h1);
  LayerOutput r;
  if (out_slot.defined()) {
    ops::bias_dropout_add_layer_norm_into(o, opt(w[kOutB]), h1, w[kLn2W], opt(w[kLn2B]), hidden_p, s.eps, rng.seed,
                                          kMlpOut, out_slot);
    r.out = out_slot;
  } else {
    r.out = std::get<0>(ops::bias_dropout_add_layer_norm(o, opt(w[kOutB]), h1, w[kLn2W], opt(w[kLn2B]), hidden_p,
                                                         s.eps, rng.seed, kMlpOut));
  }
  return r;
}

}  // namespace

const LayerFamily kBertFamily{{Family::kBert, "bert", {kSlotNames, kSlotNames + kCount}, kLora}, &check, &forward,
                              nullptr};

}  // namespace layers
}  // namespace ckpt_ext
