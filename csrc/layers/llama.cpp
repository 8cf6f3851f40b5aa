// The Llama decoder layer (RMSNorm, rotary q/k, SwiGLU, grouped-query attention, causal, optional
// biases, attention dropout), mirroring Hugging Face's LlamaDecoderLayer operation by operation:
//
//   (n1) = RMS(x); q, k rotated; ctx = causal (GQA) attention
//   (n2, h1) = (RMS(h1), h1 = x + ctx Wo^T)                add_rms_norm
//   out = h1 + swiglu(n2 Wg^T, n2 Wu^T) Wd^T                swiglu, residual_linear (the last linear)
#include <ATen/ATen.h>

#include "../common/checks.h"
#include "../ops/ops.h"
#include "family.h"

namespace ckpt_ext {
namespace layers {
namespace {

// Weight slots and their names (exported to Python, which maps Hugging Face's parameters to them).
enum : int64_t { kLn1W, kQW, kQB, kKW, kKB, kVW, kVB, kOW, kOB, kLn2W, kGateW, kGateB, kUpW, kUpB, kDownW, kDownB,
                 kCount };
constexpr const char* kSlotNames[] = {
    "ln1_weight", "q_weight", "q_bias", "k_weight", "k_bias", "v_weight", "v_bias", "o_weight", "o_bias",
    "ln2_weight", "gate_weight", "gate_bias", "up_weight", "up_bias", "down_weight", "down_bias"};
static_assert(sizeof(kSlotNames) / sizeof(kSlotNames[0]) == kCount, "one name per weight slot");
// The projections that may carry a LoRA adapter (adapter j's A, B follow the slots above).
enum : int64_t { kLoraQ, kLoraK, kLoraV, kLoraO, kLoraGate, kLoraUp, kLoraDown };
const std::vector<std::string> kLora{"q_weight", "k_weight", "v_weight", "o_weight", "gate_weight", "up_weight",
                                     "down_weight"};

void check(const LayerSpec& s, const std::vector<Tensor>& w) {
  const int64_t H = s.hidden;
  for (int64_t i : {kLn1W, kQW, kKW, kVW, kOW, kLn2W, kGateW, kUpW, kDownW})
    check_present(s, w, i, "every Llama weight");
  check_matrix(s, "self_attn.q_proj.weight", w[kQW], s.num_heads * s.head_dim, H);
  check_matrix(s, "self_attn.k_proj.weight", w[kKW], s.num_kv_heads * s.head_dim, H);
  check_matrix(s, "self_attn.v_proj.weight", w[kVW], s.num_kv_heads * s.head_dim, H);
  check_matrix(s, "self_attn.o_proj.weight", w[kOW], H, s.num_heads * s.head_dim);
  check_vector(w[kLn1W], H, "input_layernorm.weight", nullptr, "ckpt_ext fused llama layer");
  check_vector(w[kLn2W], H, "post_attention_layernorm.weight", nullptr, "ckpt_ext fused llama layer");
}

LastLinear last_linear(const LayerSpec&, const std::vector<Tensor>& w, const LayerRng&) {
  return LastLinear{w[kDownW], w[kDownB], /*conv1d=*/false, 0.0, kMlpOut, kDownW, kDownB};
}

LayerOutput forward(const LayerSpec& s, const Tensor& x, const LayerInputs& in, const std::vector<Tensor>& w,
                    const LayerRng& rng, const Tensor& out_slot, bool stop, KeptAttention* kept) {
  TORCH_CHECK(in.cos.defined() && in.sin.defined(),
              "ckpt_ext fused Llama layer: position_embeddings (cos, sin) are required; Hugging Face's LlamaModel "
              "passes them to every layer");
  const Tensor n1 = std::get<0>(ops::add_rms_norm(x, std::nullopt, w[kLn1W], s.eps));
  const Tensor wqkv = at::cat({w[kQW], w[kKW], w[kVW]}, 0);
  const Tensor bqkv = cat_or_undefined({w[kQB], w[kKB], w[kVB]});
  const int64_t qw = s.num_heads * s.head_dim, kvw = s.num_kv_heads * s.head_dim;
  const Tensor qkv = plus_lora_qkv(s, w, {kLoraQ, kLoraK, kLoraV}, n1,
                                  gemm_linear(n1, wqkv, bqkv), {qw, kvw, kvw}, rng);
  const auto [q_raw, k_raw, v] = split_qkv(qkv, s.num_heads, s.num_kv_heads, s.head_dim);
  const Tensor cos = like(in.cos, q_raw), sin = like(in.sin, q_raw);
  const Tensor q = ops::rotary(q_raw, cos, sin);
  const Tensor k = ops::rotary(k_raw, cos, sin);
  const Tensor ctx = merge_heads(attention(q, k, v, in.mask, /*causal=*/true, s.scaling, effective(s.attn_p, rng),
                                           rng.seed, kAttnProbs, kept));
  auto [n2, h1, rstd] = ops::add_rms_norm(
      like(plus_lora(gemm_linear(ctx, w[kOW], w[kOB]), lora_delta(s, w, kLoraO, ctx, rng)), x), x, w[kLn2W],
      s.eps);
  // Two GEMMs rather than one over [gate; up]: swiglu reads contiguous halves without a copy.
  const Tensor act =
      ops::swiglu(plus_lora(gemm_linear(n2, w[kGateW], w[kGateB]), lora_delta(s, w, kLoraGate, n2, rng)),
                  plus_lora(gemm_linear(n2, w[kUpW], w[kUpB]), lora_delta(s, w, kLoraUp, n2, rng)));
  return last_linear_tail(s, w, rng, last_linear(s, w, rng), act, h1, out_slot, stop,
                          lora_delta(s, w, kLoraDown, act, rng));
}

}  // namespace

const LayerFamily kLlamaFamily{{Family::kLlama, "llama", {kSlotNames, kSlotNames + kCount}, kLora}, &check, &forward,
                               &last_linear};

}  // namespace layers
}  // namespace ckpt_ext
