// The GPT-2 block (pre-LN, causal, Conv1D weights [in, out], resid/attn dropout), mirroring Hugging
// Face's GPT2Block operation by operation:
//
//   qkv = LN1(x) W + b; ctx = causal attention
//   (ln2, h1) = (LN2(h1), h1 = x + dropout(ctx Wp + bp))    bias_dropout_add_layer_norm
//   out = h1 + dropout(gelu_tanh(ln2 Wfc + bfc) Wp2 + bp2)   bias_gelu, residual_linear (the last linear)
#include <ATen/ATen.h>

#include "../ops/ops.h"
#include "family.h"

namespace ckpt_ext {
namespace layers {
namespace {

// Weight slots and their names (exported to Python, which maps Hugging Face's parameters to them).
enum : int64_t { kLn1W, kLn1B, kAttnW, kAttnB, kAttnProjW, kAttnProjB, kLn2W, kLn2B, kFcW, kFcB, kMlpProjW, kMlpProjB,
                 kCount };
constexpr const char* kSlotNames[] = {
    "ln1_weight", "ln1_bias", "attn_weight", "attn_bias", "attn_proj_weight", "attn_proj_bias", "ln2_weight",
    "ln2_bias", "fc_weight", "fc_bias", "mlp_proj_weight", "mlp_proj_bias"};
static_assert(sizeof(kSlotNames) / sizeof(kSlotNames[0]) == kCount, "one name per weight slot");
// The projections that may carry a LoRA adapter (adapter j's A, B follow the slots above).
enum : int64_t { kLoraAttn, kLoraAttnProj, kLoraFc, kLoraMlpProj };
const std::vector<std::string> kLora{"attn_weight", "attn_proj_weight", "fc_weight", "mlp_proj_weight"};

// The GEMM sites of the recompute levels (layer.h's KeptGemms; mlp.c_proj is the last linear's).
enum : int { kSiteAttnProj = 1, kSiteFc = 2 };

void check(const LayerSpec& s, const std::vector<Tensor>& w) {
  const int64_t H = s.hidden;
  for (int64_t i = 0; i < kCount; ++i) check_present(s, w, i, "every GPT-2 weight and bias");
  check_matrix(s, "attn.c_attn.weight", w[kAttnW], H, 3 * H);
  check_matrix(s, "attn.c_proj.weight", w[kAttnProjW], H, H);
  check_matrix(s, "mlp.c_proj.weight", w[kMlpProjW], w[kFcW].size(1), H);
}

LastLinear last_linear(const LayerSpec& s, const std::vector<Tensor>& w, const LayerRng& rng) {
  return LastLinear{w[kMlpProjW], w[kMlpProjB], /*conv1d=*/true, effective(s.hidden_p, rng), kMlpOut, kMlpProjW,
                    kMlpProjB};
}

LayerOutput forward(const LayerSpec& s, const Tensor& x, const LayerInputs& in, const std::vector<Tensor>& w,
                    const LayerRng& rng, const Tensor& out_slot, bool stop, KeptAttention* kept) {
  const Tensor ln1 = at::layer_norm(x, {s.hidden}, opt(w[kLn1W]), opt(w[kLn1B]), s.eps);
  const Tensor qkv = plus_lora(conv1d(ln1, w[kAttnW], w[kAttnB], KeptGemms::kQkv), lora_delta(s, w, kLoraAttn, ln1, rng));
  const auto [q, k, v] = split_qkv(qkv, s.num_heads, s.num_heads, s.head_dim);
  const Tensor ctx = merge_heads(attention(q, k, v, in.mask, /*causal=*/true, s.scaling, effective(s.attn_p, rng),
                                           rng.seed, kAttnProbs, kept));
  // Under autocast ln_2 feeds only c_fc: written in its dtype (gemm_input_dtype), unless a LoRA adapter reads it.
  // (ln_1 is ATen's layer_norm, whose bits the ops' kernels need not match: it keeps its float32 output and cast.)
  const auto ln2_dtype = any_adapter(s, w, {kLoraFc, kLoraFc, kLoraFc}) ? std::nullopt : gemm_input_dtype(x);
  auto [ln2, h1, mean, rstd, keep_bits] =
      ops::bias_dropout_add_layer_norm(norm_input(plus_lora(conv1d_nobias(ctx, w[kAttnProjW], kSiteAttnProj),
                                                 lora_delta(s, w, kLoraAttnProj, ctx, rng)),
                                       x), opt(w[kAttnProjB]), x, w[kLn2W],
                                       opt(w[kLn2B]), effective(s.hidden_p, rng), s.eps, rng.seed, kAttnOut,
                                       ln2_dtype);
  const Tensor fc = plus_lora(conv1d_nobias(ln2, w[kFcW], kSiteFc), lora_delta(s, w, kLoraFc, ln2, rng));
  const Tensor act = ops::bias_gelu(fc, opt_like(w[kFcB], fc), s.gelu_tanh ? "tanh" : "none");
  return last_linear_tail(s, w, rng, last_linear(s, w, rng), act, h1, out_slot, stop,
                          lora_delta(s, w, kLoraMlpProj, act, rng));
}

}  // namespace

const LayerFamily kGpt2Family{
    {Family::kGPT2, "gpt2", {kSlotNames, kSlotNames + kCount}, kLora, /*conv1d=*/true}, &check, &forward,
    &last_linear};

}  // namespace layers
}  // namespace ckpt_ext
