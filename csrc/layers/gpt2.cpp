// The GPT-2 block (pre-LN, causal, Conv1D weights [in, out], resid/attn dropout), mirroring Hugging
// Face's GPT2Block operation by operation:
//
//   qkv = LN1(x) W + b; ctx = causal attention
//   (ln2, h1) = (LN2(h1), h1 = x + dropout(ctx Wp + bp))    bias_dropout_add_layer_norm
//   out = h1 + dropout(gelu_tanh(ln2 Wfc + bfc) Wp2 + bp2)   bias_gelu, residual_linear (the last linear)
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/custom_function.h>

#include "../ops/ops.h"
#include "family.h"

namespace ckpt_ext {
namespace layers {
namespace {

// ln_1 of x, where x is also ln_2's residual (issue 32): ATen's layer_norm forward (its bits, as before), returning
// (ln1, an alias of x) -- the alias is ln_2's residual -- and as backward the ops' LayerNorm backward kernel
// (add_layer_norm_backward) with the alias's gradient as its grad_sum: x's two gradients added in the kernel,
// where autograd added ATen's layer_norm gradient and ln_2's residual gradient in a separate pass. Saves what
// ATen's node saved (x, mean, rstd).
struct Ln1Function : torch::autograd::Function<Ln1Function> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const Tensor& x,
                                                const Tensor& weight, const Tensor& bias, double eps) {
    auto [out, mean, rstd] = at::native_layer_norm(x, {x.size(-1)}, weight, bias, eps);
    // The ops' row statistics: [rows...] in the op-math dtype (ATen's: [rows..., 1], x's dtype on CPU for a
    // bfloat16 x with bfloat16 weights; converted exactly).
    const auto sizes = x.sizes();
    const std::vector<int64_t> rows(sizes.begin(), sizes.end() - 1);
    const auto st = at::toOpMathType(x.scalar_type());
    ctx->save_for_backward({x, weight, mean.reshape(rows).to(st), rstd.reshape(rows).to(st)});
    ctx->set_materialize_grads(false);
    return {out, x.alias()};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    torch::autograd::variable_list out(4);
    if (!grads[0].defined() && !grads[1].defined()) return out;
    const auto saved = ctx->get_saved_variables();
    const Tensor& x = saved[0];
    const Tensor g = grads[0].defined() ? grads[0] : at::zeros_like(x);
    auto [dx, dw, db] = ops::add_layer_norm_backward(g, grads[1].defined() ? OptTensor(grads[1]) : std::nullopt, x,
                                                     saved[1], saved[2], saved[3]);
    if (ctx->needs_input_grad(0)) out[0] = dx;
    if (ctx->needs_input_grad(1)) out[1] = dw;
    if (ctx->needs_input_grad(2)) out[2] = db;
    return out;
  }
};

// (ln_1(x), x's handle for ln_2's residual): Ln1Function where ATen's layer_norm would run in x's dtype (outside
// autocast, or a float32 x under it: autocast runs layer_norm in float32); else at::layer_norm and x.
std::pair<Tensor, Tensor> ln1_and_residual(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  const c10::DeviceType dt = x.device().type();
  const bool autocast =
      (dt == c10::DeviceType::CPU || dt == c10::DeviceType::CUDA) && at::autocast::is_autocast_enabled(dt);
  if ((autocast && x.scalar_type() != at::kFloat) || x.numel() == 0 || weight.scalar_type() != x.scalar_type() ||
      !bias.defined() || bias.scalar_type() != x.scalar_type())
    return {at::layer_norm(x, {x.size(-1)}, opt(weight), opt(bias), eps), x};
  const auto r = Ln1Function::apply(x, weight, bias, eps);
  return {r[0], r[1]};
}

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
  const auto [ln1, x_res] = ln1_and_residual(x, w[kLn1W], w[kLn1B], s.eps);
  const Tensor qkv = plus_lora(conv1d(ln1, w[kAttnW], w[kAttnB], KeptGemms::kQkv), lora_delta(s, w, kLoraAttn, ln1, rng));
  const auto [q, k, v] = split_qkv(qkv, s.num_heads, s.num_heads, s.head_dim);
  const Tensor ctx = merge_heads(attention(q, k, v, in.mask, /*causal=*/true, s.scaling, effective(s.attn_p, rng),
                                           rng.seed, kAttnProbs, kept));
  // Under autocast ln_2 feeds only c_fc: written in its dtype (gemm_input_dtype), unless a LoRA adapter reads it.
  // (ln_1 is ATen's layer_norm forward, whose bits the ops' kernels need not match: it keeps its float32 output and
  // cast.) x_res: x as ln_2's residual, through ln_1's node (ln1_and_residual).
  const auto ln2_dtype = any_adapter(s, w, {kLoraFc, kLoraFc, kLoraFc}) ? std::nullopt : gemm_input_dtype(x);
  auto [ln2, h1, mean, rstd, keep_bits] =
      ops::bias_dropout_add_layer_norm(norm_input(plus_lora(conv1d_nobias(ctx, w[kAttnProjW], kSiteAttnProj),
                                                 lora_delta(s, w, kLoraAttnProj, ctx, rng)),
                                       x), opt(w[kAttnProjB]), x_res, w[kLn2W],
                                       opt(w[kLn2B]), effective(s.hidden_p, rng), s.eps, rng.seed, kAttnOut,
                                       ln2_dtype);
  const Tensor fc = plus_lora(conv1d_nobias(ln2, w[kFcW], kSiteFc), lora_delta(s, w, kLoraFc, ln2, rng));
  if (stops_before_activation(stop, any_adapter(s, w, {kLoraMlpProj, kLoraMlpProj, kLoraMlpProj}),
                              kept_gemm(kSiteFc).defined())) {
    LayerOutput r;  // the replay: the activation runs in replay_backward (issue 33)
    r.act = {StoppedActivation::kBiasGelu, s.gelu_tanh, fc, like(w[kFcB], fc)};
    r.residual = h1;
    return r;
  }
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
