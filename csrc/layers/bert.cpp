// The BERT/RoBERTa encoder layer (post-LN, exact or tanh GELU, biases, padding mask, hidden and
// attention-probability dropout), mirroring Hugging Face's BertLayer operation by operation:
//
//   qkv = x Wqkv^T + b (one GEMM over the three weights); ctx = attention(q, k, v, mask)
//   h1  = LN(x + dropout(ctx Wo^T + bo))                      bias_dropout_add_layer_norm
//   out = LN(h1 + dropout(gelu(h1 Wi^T + bi) Wo2^T + bo2))    bias_gelu, bias_dropout_add_layer_norm
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <tuple>

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

bool has_out_adapter(const LayerSpec& s, const std::vector<Tensor>& w) {
  return any_adapter(s, w, {kLoraOut, kLoraOut, kLoraOut});
}

// `stop` (pre_norm_replay_forward only; BERT has no last_linear): return before the output linear, with its
// input and h1, when it has no adapter.
LayerOutput forward(const LayerSpec& s, const Tensor& x, const LayerInputs& in, const std::vector<Tensor>& w,
                    const LayerRng& rng, const Tensor& out_slot, bool stop, KeptAttention* kept) {
  const double hidden_p = effective(s.hidden_p, rng);
  const int64_t H = s.hidden;
  // Without adapters, the projection's own node (qkv.cpp: no gradient concatenation in backward), which also hands
  // out x's handle for LN1's residual (x_res: under autocast the node's alias, so that x's two gradients meet in its
  // backward, issue 32; else x).
  Tensor x_res = x;
  const auto [q, k, v] =
      any_adapter(s, w, {kLoraQ, kLoraK, kLoraV})
          ? split_qkv(plus_lora_qkv(s, w, {kLoraQ, kLoraK, kLoraV}, x,
                                    gemm_linear(x, at::cat({w[kQW], w[kKW], w[kVW]}, 0),
                                                cat_or_undefined({w[kQB], w[kKB], w[kVB]}), KeptGemms::kQkv),
                                    {H, H, H}, rng),
                      s.num_heads, s.num_heads, s.head_dim)
          : qkv_heads(x, {w[kQW], w[kKW], w[kVW]}, {w[kQB], w[kKB], w[kVB]}, s.num_heads, s.num_heads, s.head_dim,
                      &x_res);
  const Tensor ctx = merge_heads(attention(q, k, v, in.mask, /*causal=*/false, s.scaling, effective(s.attn_p, rng),
                                           rng.seed, kAttnProbs, kept));
  const Tensor attn_out = norm_input(
      plus_lora(gemm_linear(ctx, w[kAttnOutW], Tensor(), kSiteAttnOut), lora_delta(s, w, kLoraAttnOut, ctx, rng)), x);
  // h1 is LN2's float32 residual and the intermediate GEMM's input: under autocast the norm also writes it in the
  // GEMM's dtype (the dual op; gemm_input_dtype), which the GEMM reads without a cast; a LoRA adapter on it reads the
  // float32 h1 (its dropout rounds once from float32, as peft's; docs/lora-work.md).
  // Otherwise the norm hands h1 out twice (the fanout op), so that its backward adds the two gradients instead of
  // autograd's add (issue 32).
  const bool inter_adapter = any_adapter(s, w, {kLoraInter, kLoraInter, kLoraInter});
  const auto h1_dtype = gemm_input_dtype(x);
  Tensor h1, h1_gemm;
  if (h1_dtype) {
    std::tie(h1, h1_gemm, std::ignore, std::ignore, std::ignore, std::ignore) = ops::bias_dropout_add_layer_norm_dual(
        attn_out, opt(w[kAttnOutB]), x_res, w[kLn1W], opt(w[kLn1B]), hidden_p, s.eps, rng.seed, kAttnOut, *h1_dtype);
  } else if (!inter_adapter) {
    std::tie(h1, h1_gemm, std::ignore, std::ignore, std::ignore, std::ignore) = ops::bias_dropout_add_layer_norm_fanout(
        attn_out, opt(w[kAttnOutB]), x_res, w[kLn1W], opt(w[kLn1B]), hidden_p, s.eps, rng.seed, kAttnOut);
  } else {
    h1 = std::get<0>(ops::bias_dropout_add_layer_norm(attn_out, opt(w[kAttnOutB]), x_res, w[kLn1W], opt(w[kLn1B]),
                                                      hidden_p, s.eps, rng.seed, kAttnOut));
    h1_gemm = h1;
  }
  const Tensor i =
      plus_lora(gemm_linear(h1_gemm, w[kInterW], Tensor(), kSiteInter), lora_delta(s, w, kLoraInter, h1, rng));
  if (stops_before_activation(stop, has_out_adapter(s, w), kept_gemm(kSiteInter).defined())) {
    LayerOutput r;  // the boundary replay: the activation runs in its backward (issue 33)
    r.act = {StoppedActivation::kBiasGelu, s.gelu_tanh, i, like(w[kInterB], i)};
    r.residual = h1;
    return r;
  }
  const Tensor inter = ops::bias_gelu(i, opt_like(w[kInterB], i), s.gelu_tanh ? "tanh" : "none");
  if (stop && !has_out_adapter(s, w)) {
    LayerOutput r;
    r.last_input = inter;
    r.residual = h1;
    return r;
  }
  const Tensor o = norm_input(
      plus_lora(gemm_linear(inter, w[kOutW], Tensor(), kSiteOut), lora_delta(s, w, kLoraOut, inter, rng)), h1);
  LayerOutput r;
  if (out_slot.defined()) {
    // The pre-norm boundary (layer.h) comes with it; the segment keeps it or drops it.
    std::tie(r.pre_norm, r.mean, r.rstd) = ops::bias_dropout_add_layer_norm_into(
        o, opt(w[kOutB]), h1, w[kLn2W], opt(w[kLn2B]), hidden_p, s.eps, rng.seed, kMlpOut, out_slot);
    r.out = out_slot;
  } else {
    r.out = std::get<0>(ops::bias_dropout_add_layer_norm(o, opt(w[kOutB]), h1, w[kLn2W], opt(w[kLn2B]), hidden_p,
                                                         s.eps, rng.seed, kMlpOut));
  }
  return r;
}

}  // namespace

// ---- the pre-norm boundary (layer.h) --------------------------------------------------------------------------

bool bert_has_pre_norm_boundary(const LayerSpec& s, const std::vector<Tensor>& w) { return !has_out_adapter(s, w); }

Tensor bert_output_from_pre_norm(const LayerSpec& s, const std::vector<Tensor>& w, const Tensor& pre_norm) {
  at::NoGradGuard no_grad;
  // The forward's norm kernel with no bias, dropout or residual: the sum it stores is pre_norm itself, and it
  // normalises what it stores.
  return std::get<0>(ops::add_layer_norm(pre_norm, std::nullopt, w[kLn2W], opt(w[kLn2B]), s.eps));
}

namespace {

// The end of a BERT layer replayed from its boundary, out = LN2(h1 + dropout(o + b)), o = norm_input(inter W^T, h1), as
// two autograd nodes that compute nothing in forward (their outputs are broadcast zeros, only roots and edges).
// Two, as the layer run whole has them, so that autograd frees the boundary after the norm's backward and
// before the output linear's GEMMs, and dX after bias_gelu's backward.
Tensor nothing_like(const Tensor& t) { return at::zeros({}, t.options()).expand(t.sizes()); }

// o = inter W^T in the dtype the layer run whole hands the norm (norm_input: the GEMM's under autocast with
// mixed_dtype_norms, else the residual stream's, of h1). Backward: the output linear's gradients as autograd
// computes them in the un-checkpointed layer (gemm_linear_grads; autocast: the gradient cast to the GEMM's dtype as
// like()'s cast does where the norm's gradient is float32, W as autocast cast it, W's gradient cast back).
struct OutLinearTailFunction : torch::autograd::Function<OutLinearTailFunction> {
  // h1: only its shape (a detached alias: no edge); o's dtype: inter's when `mixed`, else h1's.
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& inter, const Tensor& W,
                        const Tensor& h1, bool mixed) {
    ctx->save_for_backward({inter, W});
    return mixed ? at::zeros({}, inter.options()).expand(h1.sizes()) : nothing_like(h1);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    torch::autograd::variable_list out(4);
    const bool need_x = ctx->needs_input_grad(0), need_w = ctx->needs_input_grad(1);
    if (!grads[0].defined() || !(need_x || need_w)) return out;
    const auto saved = ctx->get_saved_variables();
    const Tensor &inter = saved[0], &W = saved[1];
    const auto cdt = inter.scalar_type();
    const Tensor g = grads[0].scalar_type() == cdt ? grads[0] : grads[0].to(cdt);
    auto [dx, dw] = gemm_linear_grads(g, inter, W.scalar_type() == cdt ? W : W.to(cdt), need_x, need_w);
    out[0] = dx;
    if (need_w) out[1] = dw.scalar_type() == W.scalar_type() ? dw : dw.to(W.scalar_type());
    return out;
  }
};

// OutLinearTailFunction from before the activation (issue 33): o = gelu(i + bi) W^T with i the intermediate GEMM's
// output, bi its bias (as the layer cast it; may be absent). Backward: the output linear's input gradient as
// OutLinearTailFunction computes it, the bias-GELU backward that also writes the linear's input (the forward's bits;
// in place: the gradient becomes i's, i the input), then W's gradient from that input -- the ops of the layer run
// whole (OutLinear's GEMMs, BiasGeluFunction's backward), on the same values.
struct ActOutLinearTailFunction : torch::autograd::Function<ActOutLinearTailFunction> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& i, const std::optional<Tensor>& bi,
                        const Tensor& W, const Tensor& h1, bool mixed, bool tanh) {
    ctx->save_for_backward({i, bi.has_value() ? *bi : Tensor(), W});
    ctx->saved_data["tanh"] = tanh;
    // (a broadcast scalar nobody reads: no fill kernel)
    return at::empty({}, mixed ? i.options() : h1.options()).expand(h1.sizes());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    torch::autograd::variable_list out(6);
    const auto saved = ctx->get_saved_variables();
    const Tensor &i = saved[0], &bi = saved[1], &W = saved[2];
    // Edges (needs_input_grad's numbering): i, bi (if present), W; outputs: by argument.
    const bool need_i = ctx->needs_input_grad(0), need_bi = bi.defined() && ctx->needs_input_grad(1);
    const bool need_w = ctx->needs_input_grad(bi.defined() ? 2 : 1);
    if (!grads[0].defined() || !(need_i || need_bi || need_w)) return out;
    const char* approximate = ctx->saved_data.at("tanh").toBool() ? "tanh" : "none";
    const auto cdt = i.scalar_type();
    const Tensor g = grads[0].scalar_type() == cdt ? grads[0] : grads[0].to(cdt);
    const Tensor Wc = W.scalar_type() == cdt ? W : W.to(cdt);
    Tensor act;
    if (need_i || need_bi) {
      // In place (the replay's own tensors, which nothing reads after this node): d_act becomes i's gradient, i the
      // activation.
      Tensor d_act = gemm_linear_grads(g, i, Wc, true, false).first;
      if (!d_act.is_contiguous()) d_act = d_act.contiguous();
      act = i.is_contiguous() ? i : i.contiguous();
      Tensor dbi = ops::bias_gelu_backward_act_(d_act, act, opt(bi), approximate, need_bi);
      if (need_i) out[0] = d_act;
      if (need_bi) out[1] = dbi;
    } else {
      act = ops::bias_gelu(i, opt(bi), approximate);
    }
    if (need_w) {
      const Tensor dw = gemm_linear_grads(g, act, Wc, false, true).second;
      out[2] = dw.scalar_type() == W.scalar_type() ? dw : dw.to(W.scalar_type());
    }
    return out;
  }
};

// out = LN2(h1 + dropout(o + out_b)) with the stored pre_norm, mean, rstd. Backward: the norm's node backward as
// BiasDropoutAddLayerNormFunction runs it (no gradient reaches its pre_norm output; the dropout mask regenerated
// from the seed: the CPU forward's keep bits hold the same mask), the dense bias's gradient from the kernel.
// Tensor arguments (biases may be undefined): o, h1, out_b, ln_w, ln_b, pre_norm, mean, rstd.
struct NormTailFunction : torch::autograd::Function<NormTailFunction> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& o, const Tensor& h1, const Tensor& out_b,
                        const Tensor& ln_w, const Tensor& ln_b, const Tensor& pre_norm, const Tensor& mean,
                        const Tensor& rstd, double p, int64_t seed) {
    ctx->save_for_backward({ln_w, pre_norm, mean, rstd});
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(o.scalar_type());  // o's gradient in o's dtype
    ctx->saved_data["p"] = p;
    ctx->saved_data["seed"] = seed;
    ctx->saved_data["has_out_b"] = out_b.defined();
    return nothing_like(h1);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    torch::autograd::variable_list out(10);
    if (!grads[0].defined()) return out;
    const auto saved = ctx->get_saved_variables();
    const bool need_b = ctx->saved_data.at("has_out_b").toBool() && ctx->needs_input_grad(2);
    auto [grad_o, grad_h1, grad_ln_w, grad_ln_b, grad_bias] = ops::bias_dropout_add_layer_norm_backward(
        grads[0], std::nullopt, saved[1], saved[0], saved[2], saved[3], ctx->saved_data.at("p").toDouble(),
        ctx->saved_data.at("seed").toInt(), kMlpOut, std::nullopt, need_b,
        static_cast<at::ScalarType>(ctx->saved_data.at("x_dtype").toInt()));
    if (ctx->needs_input_grad(0)) out[0] = grad_o;
    if (ctx->needs_input_grad(1)) out[1] = grad_h1;
    if (need_b) out[2] = grad_bias;
    if (ctx->needs_input_grad(3)) out[3] = grad_ln_w;
    if (ctx->needs_input_grad(4)) out[4] = grad_ln_b;
    return out;
  }
};

}  // namespace

ReplayBackward bert_pre_norm_backward(const LayerSpec& s, const std::vector<Tensor>& w, const LayerRng& rng,
                                      const LayerOutput& replayed, PreNormBoundary b, const Tensor& grad_out,
                                      const std::vector<bool>& /*need_slot: autograd asks the node*/) {
  TORCH_CHECK(b.defined() && (replayed.last_input.defined() || replayed.act.defined()) && replayed.residual.defined(),
              "ckpt_ext: the BERT boundary replay needs the kept pre-norm sum and a replay stopped before the "
              "output linear");
  ReplayBackward r;
  const Tensor& inter = replayed.act.defined() ? replayed.act.a : replayed.last_input;
  const bool mixed = mixed_norm_input(inter, replayed.residual);
  const Tensor o = replayed.act.defined()
                       ? ActOutLinearTailFunction::apply(inter, opt(replayed.act.b), w[kOutW],
                                                         replayed.residual.detach(), mixed, replayed.act.tanh)
                       : OutLinearTailFunction::apply(inter, w[kOutW], replayed.residual.detach(), mixed);
  r.outputs.push_back(NormTailFunction::apply(o, replayed.residual, w[kOutB], w[kLn2W], w[kLn2B], b.pre_norm, b.mean,
                                              b.rstd, effective(s.hidden_p, rng), rng.seed));
  r.grads.push_back(grad_out);
  return r;
}

const LayerFamily kBertFamily{{Family::kBert, "bert", {kSlotNames, kSlotNames + kCount}, kLora}, &check, &forward,
                              nullptr};

}  // namespace layers
}  // namespace ckpt_ext
