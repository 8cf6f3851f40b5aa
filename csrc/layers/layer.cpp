// The three fused layer families. Each forward mirrors the Hugging Face module it replaces operation
// by operation (same GEMM orientation, same residual order), with the elementwise and row-wise steps
// fused into ckpt_ext ops:
//
//   BERT   qkv = x Wqkv^T + b (one GEMM over the three weights); ctx = attention(q, k, v, mask)
//          h1  = LN(x + dropout(ctx Wo^T + bo))                  bias_dropout_add_layer_norm
//          out = LN(h1 + dropout(gelu(h1 Wi^T + bi) Wo2^T + bo2)) bias_gelu, bias_dropout_add_layer_norm
//   GPT-2  qkv = LN1(x) W + b; ctx = causal attention
//          (ln2, h1) = (LN2(h1), h1 = x + dropout(ctx Wp + bp))   bias_dropout_add_layer_norm
//          out = h1 + dropout(gelu_tanh(ln2 Wfc + bfc) Wp2 + bp2)  bias_gelu, residual_linear
//   Llama  (n1) = RMS(x); q, k rotated; ctx = causal (GQA) attention
//          (n2, h1) = (RMS(h1), h1 = x + ctx Wo^T)                add_rms_norm
//          out = h1 + swiglu(n2 Wg^T, n2 Wu^T) Wd^T                swiglu, residual_linear
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <array>
#include <sstream>

#include "../ops/fused_ops.h"
#include "layer.h"

namespace ckpt_ext {
namespace layers {

namespace {

using OptTensor = std::optional<Tensor>;

OptTensor opt(const Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

// Splits the fused [B, S, (q_heads + 2 * kv_heads) * D] projection into q, k, v as [B, heads, S, D]
// views (the last dimension stays contiguous, which rotary and SDPA read in place). One split rather
// than three slices: its backward concatenates the three gradients in one copy, where slices would
// each zero-fill a full-size gradient and add them up.
std::array<Tensor, 3> split_qkv(const Tensor& qkv, int64_t q_heads, int64_t kv_heads, int64_t head_dim) {
  const auto B = qkv.size(0), S = qkv.size(1);
  auto parts = qkv.split_with_sizes({q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim}, -1);
  std::array<Tensor, 3> r;
  const int64_t heads[3] = {q_heads, kv_heads, kv_heads};
  for (int i = 0; i < 3; ++i) r[i] = parts[i].view({B, S, heads[i], head_dim}).transpose(1, 2);
  return r;
}

// [B, heads, S, D] -> [B, S, heads * D] (contiguous).
Tensor merge_heads(const Tensor& ctx) {
  return ctx.transpose(1, 2).reshape({ctx.size(0), ctx.size(2), ctx.size(1) * ctx.size(3)});
}

Tensor cat_or_undefined(std::initializer_list<Tensor> parts) {
  for (const auto& t : parts)
    if (!t.defined()) return Tensor();
  return at::cat(parts, 0);
}

// y = x @ W + b for a Conv1D weight [in, out], as Hugging Face computes it.
Tensor conv1d(const Tensor& x, const Tensor& w, const Tensor& b) {
  const Tensor y = at::addmm(b, x.reshape({-1, x.size(-1)}), w);
  auto sizes = x.sizes().vec();
  sizes.back() = w.size(1);
  return y.view(sizes);
}

// x @ W (no bias: the bias is fused into the following op), keeping x's leading dims.
Tensor conv1d_nobias(const Tensor& x, const Tensor& w) {
  auto sizes = x.sizes().vec();
  sizes.back() = w.size(1);
  return x.reshape({-1, x.size(-1)}).mm(w).view(sizes);
}

double effective(double p, const LayerRng& rng) { return rng.training ? p : 0.0; }

// Autocast (layer.h): `t` in `ref`'s dtype -- a GEMM output (autocast dtype) joining the residual
// stream, or a bias / rotary table joining a tensor in the GEMM's dtype. Outside autocast the dtypes
// already agree and nothing is copied.
Tensor like(const Tensor& t, const Tensor& ref) {
  return !t.defined() || t.scalar_type() == ref.scalar_type() ? t : t.to(ref.scalar_type());
}
OptTensor opt_like(const Tensor& t, const Tensor& ref) { return opt(like(t, ref)); }

// The end of a GPT-2/Llama layer: out = h1 + dropout(act @ W + b) through the family's last linear,
// written into out_slot when given; with `stop`, only what the segment replay needs to skip it.
LayerOutput last_linear_tail(const LayerSpec& s, const std::vector<Tensor>& w, const LayerRng& rng, const Tensor& act,
                             const Tensor& h1, const Tensor& out_slot, bool stop) {
  LayerOutput r;
  if (stop) {
    r.last_input = act;
    r.residual = h1;
    return r;
  }
  const LastLinear lin = last_linear(s, w, rng);
  if (out_slot.defined()) {
    const Tensor w = like(lin.weight, act);
    const Tensor y = like(lin.conv1d ? conv1d_nobias(act, w) : act.reshape({-1, act.size(-1)}).mm(w.t()).view(h1.sizes()),
                          h1);
    ops::bias_dropout_add_into(y, opt(lin.bias), h1, lin.p, rng.seed, lin.offset, out_slot);
    r.out = out_slot;
  } else {
    r.out = residual_linear(act, lin, h1, rng.seed);
  }
  return r;
}

// ---- BERT / RoBERTa -----------------------------------------------------------------------------------------------

LayerOutput bert_forward(const LayerSpec& s, const Tensor& x, const LayerInputs& in, const std::vector<Tensor>& w,
                         const LayerRng& rng, const Tensor& out_slot) {
  using namespace bert;
  const double hidden_p = effective(s.hidden_p, rng);
  const Tensor wqkv = at::cat({w[kQW], w[kKW], w[kVW]}, 0);
  const Tensor bqkv = cat_or_undefined({w[kQB], w[kKB], w[kVB]});
  const auto [q, k, v] = split_qkv(at::linear(x, wqkv, opt(bqkv)), s.num_heads, s.num_heads, s.head_dim);
  const Tensor ctx = merge_heads(attention(q, k, v, in.mask, /*causal=*/false, s.scaling, effective(s.attn_p, rng),
                                           rng.seed, kAttnProbs));
  const Tensor h1 = std::get<0>(ops::bias_dropout_add_layer_norm(like(at::linear(ctx, w[kAttnOutW]), x), opt(w[kAttnOutB]), x,
                                                                 w[kLn1W], opt(w[kLn1B]), hidden_p, s.eps, rng.seed,
                                                                 kAttnOut));
  const Tensor i = at::linear(h1, w[kInterW]);
  const Tensor inter = ops::bias_gelu(i, opt_like(w[kInterB], i), s.gelu_tanh ? "tanh" : "none");
  const Tensor o = like(at::linear(inter, w[kOutW]), h1);
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

// ---- GPT-2 ---------------------------------------------------------------------------------------------------------

LayerOutput gpt2_forward(const LayerSpec& s, const Tensor& x, const LayerInputs& in, const std::vector<Tensor>& w,
                         const LayerRng& rng, const Tensor& out_slot, bool stop) {
  using namespace gpt2;
  const Tensor ln1 = at::layer_norm(x, {s.hidden}, opt(w[kLn1W]), opt(w[kLn1B]), s.eps);
  const auto [q, k, v] = split_qkv(conv1d(ln1, w[kAttnW], w[kAttnB]), s.num_heads, s.num_heads, s.head_dim);
  const Tensor ctx = merge_heads(attention(q, k, v, in.mask, /*causal=*/true, s.scaling, effective(s.attn_p, rng),
                                           rng.seed, kAttnProbs));
  auto [ln2, h1, mean, rstd] =
      ops::bias_dropout_add_layer_norm(like(conv1d_nobias(ctx, w[kAttnProjW]), x), opt(w[kAttnProjB]), x, w[kLn2W],
                                       opt(w[kLn2B]), effective(s.hidden_p, rng), s.eps, rng.seed, kAttnOut);
  const Tensor fc = conv1d_nobias(ln2, w[kFcW]);
  const Tensor act = ops::bias_gelu(fc, opt_like(w[kFcB], fc), s.gelu_tanh ? "tanh" : "none");
  return last_linear_tail(s, w, rng, act, h1, out_slot, stop);
}

// ---- Llama ---------------------------------------------------------------------------------------------------------

LayerOutput llama_forward(const LayerSpec& s, const Tensor& x, const LayerInputs& in, const std::vector<Tensor>& w,
                          const LayerRng& rng, const Tensor& out_slot, bool stop) {
  using namespace llama;
  TORCH_CHECK(in.cos.defined() && in.sin.defined(),
              "ckpt_ext fused Llama layer: position_embeddings (cos, sin) are required; Hugging Face's LlamaModel "
              "passes them to every layer");
  const Tensor n1 = std::get<0>(ops::add_rms_norm(x, std::nullopt, w[kLn1W], s.eps));
  const Tensor wqkv = at::cat({w[kQW], w[kKW], w[kVW]}, 0);
  const Tensor bqkv = cat_or_undefined({w[kQB], w[kKB], w[kVB]});
  const auto [q_raw, k_raw, v] = split_qkv(at::linear(n1, wqkv, opt(bqkv)), s.num_heads, s.num_kv_heads, s.head_dim);
  const Tensor cos = like(in.cos, q_raw), sin = like(in.sin, q_raw);
  const Tensor q = ops::rotary(q_raw, cos, sin);
  const Tensor k = ops::rotary(k_raw, cos, sin);
  const Tensor ctx = merge_heads(attention(q, k, v, in.mask, /*causal=*/true, s.scaling, effective(s.attn_p, rng),
                                           rng.seed, kAttnProbs));
  auto [n2, h1, rstd] = ops::add_rms_norm(like(at::linear(ctx, w[kOW], opt(w[kOB])), x), x, w[kLn2W], s.eps);
  // Two GEMMs rather than one over [gate; up]: swiglu reads contiguous halves without a copy.
  const Tensor act = ops::swiglu(at::linear(n2, w[kGateW], opt(w[kGateB])), at::linear(n2, w[kUpW], opt(w[kUpB])));
  return last_linear_tail(s, w, rng, act, h1, out_slot, stop);
}

void check_vector(const char* what, const Tensor& t, int64_t n) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n, "ckpt_ext fused layer: ", what, " must have shape [", n, "], got ",
              t.sizes());
}

void check_matrix(const char* what, const Tensor& t, int64_t rows, int64_t cols) {
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols, "ckpt_ext fused layer: ", what,
              " must have shape [", rows, ", ", cols, "], got ", t.sizes());
}

}  // namespace

const char* family_name(Family f) {
  switch (f) {
    case Family::kBert:
      return "bert";
    case Family::kGPT2:
      return "gpt2";
    case Family::kLlama:
      return "llama";
  }
  return "?";
}

void LayerSpec::validate() const {
  const auto f = static_cast<int64_t>(family);
  TORCH_CHECK(f >= 0 && f <= 2, "ckpt_ext LayerSpec: unknown family ", f);
  TORCH_CHECK(hidden > 0 && num_heads > 0 && num_kv_heads > 0 && head_dim > 0,
              "ckpt_ext LayerSpec: hidden, num_heads, num_kv_heads and head_dim must be positive, got ", repr());
  TORCH_CHECK(num_heads % num_kv_heads == 0, "ckpt_ext LayerSpec: num_heads (", num_heads,
              ") must be a multiple of num_kv_heads (", num_kv_heads, ")");
  TORCH_CHECK(family == Family::kLlama || num_kv_heads == num_heads,
              "ckpt_ext LayerSpec: grouped-query attention (num_kv_heads != num_heads) is a Llama feature");
  TORCH_CHECK(family == Family::kLlama || num_heads * head_dim == hidden, "ckpt_ext LayerSpec: num_heads * head_dim (",
              num_heads * head_dim, ") must equal hidden (", hidden, ") for ", family_name(family));
  TORCH_CHECK(family != Family::kLlama || head_dim % 2 == 0, "ckpt_ext LayerSpec: rotary needs an even head_dim, got ",
              head_dim);
  TORCH_CHECK(attn_p >= 0 && attn_p < 1 && hidden_p >= 0 && hidden_p < 1,
              "ckpt_ext LayerSpec: dropout probabilities must be in [0, 1), got attn_p=", attn_p,
              ", hidden_p=", hidden_p);
  TORCH_CHECK(family != Family::kLlama || hidden_p == 0, "ckpt_ext LayerSpec: Llama layers have no hidden dropout");
  TORCH_CHECK(eps >= 0, "ckpt_ext LayerSpec: eps must be >= 0, got ", eps);
}

std::string LayerSpec::repr() const {
  std::ostringstream os;
  os << "LayerSpec(family=" << family_name(family) << ", hidden=" << hidden << ", num_heads=" << num_heads
     << ", num_kv_heads=" << num_kv_heads << ", head_dim=" << head_dim << ", scaling=" << scaling
     << ", attn_p=" << attn_p << ", hidden_p=" << hidden_p << ", eps=" << eps << ", gelu_tanh=" << gelu_tanh << ")";
  return os.str();
}

int64_t weight_count(Family f) {
  switch (f) {
    case Family::kBert:
      return bert::kCount;
    case Family::kGPT2:
      return gpt2::kCount;
    case Family::kLlama:
      return llama::kCount;
  }
  return 0;
}

void check_weights(const LayerSpec& s, const std::vector<Tensor>& w, const Tensor& hidden) {
  const int64_t n = weight_count(s.family);
  TORCH_CHECK(static_cast<int64_t>(w.size()) == n, "ckpt_ext fused ", family_name(s.family), " layer: expected ", n,
              " weights, got ", w.size());
  for (size_t i = 0; i < w.size(); ++i) {
    if (!w[i].defined()) continue;
    TORCH_CHECK(w[i].device() == hidden.device() && w[i].scalar_type() == hidden.scalar_type(), "ckpt_ext fused ",
                family_name(s.family), " layer: weight ", i, " is ", w[i].scalar_type(), " on ", w[i].device(),
                " but the hidden states are ", hidden.scalar_type(), " on ", hidden.device(),
                "; the fused layers keep the residual stream in the parameters' dtype (cast the whole model with "
                "model.to(dtype), or keep float32 weights and use torch.autocast)");
  }
  const int64_t H = s.hidden;
  auto need = [&](int64_t i, const char* what) {
    TORCH_CHECK(w[i].defined(), "ckpt_ext fused ", family_name(s.family), " layer: ", what, " is required");
  };
  switch (s.family) {
    case Family::kBert: {
      using namespace bert;
      for (int64_t i : {kQW, kKW, kVW, kAttnOutW}) {
        need(i, "every attention weight");
        check_matrix("attention weight", w[i], H, H);
      }
      need(kLn1W, "LayerNorm weight");
      need(kLn2W, "LayerNorm weight");
      need(kInterW, "intermediate weight");
      need(kOutW, "output weight");
      check_matrix("output.dense.weight", w[kOutW], H, w[kInterW].size(0));
      break;
    }
    case Family::kGPT2: {
      using namespace gpt2;
      for (int64_t i : {kLn1W, kLn1B, kAttnW, kAttnB, kAttnProjW, kAttnProjB, kLn2W, kLn2B, kFcW, kFcB, kMlpProjW,
                        kMlpProjB})
        need(i, "every GPT-2 weight and bias");
      check_matrix("attn.c_attn.weight", w[kAttnW], H, 3 * H);
      check_matrix("attn.c_proj.weight", w[kAttnProjW], H, H);
      check_matrix("mlp.c_proj.weight", w[kMlpProjW], w[kFcW].size(1), H);
      break;
    }
    case Family::kLlama: {
      using namespace llama;
      for (int64_t i : {kLn1W, kQW, kKW, kVW, kOW, kLn2W, kGateW, kUpW, kDownW}) need(i, "every Llama weight");
      check_matrix("self_attn.q_proj.weight", w[kQW], s.num_heads * s.head_dim, H);
      check_matrix("self_attn.k_proj.weight", w[kKW], s.num_kv_heads * s.head_dim, H);
      check_matrix("self_attn.v_proj.weight", w[kVW], s.num_kv_heads * s.head_dim, H);
      check_matrix("self_attn.o_proj.weight", w[kOW], H, s.num_heads * s.head_dim);
      check_vector("input_layernorm.weight", w[kLn1W], H);
      check_vector("post_attention_layernorm.weight", w[kLn2W], H);
      break;
    }
  }
}

bool uses_dropout(const LayerSpec& spec, bool training) {
  return training && (spec.attn_p > 0 || spec.hidden_p > 0);
}

bool can_stop_before_last_linear(Family f) { return f == Family::kGPT2 || f == Family::kLlama; }

LastLinear last_linear(const LayerSpec& s, const std::vector<Tensor>& w, const LayerRng& rng) {
  TORCH_CHECK(can_stop_before_last_linear(s.family), "ckpt_ext: last_linear is defined for GPT-2 and Llama layers");
  if (s.family == Family::kGPT2)
    return LastLinear{w[gpt2::kMlpProjW], w[gpt2::kMlpProjB], /*conv1d=*/true, effective(s.hidden_p, rng), kMlpOut,
                      gpt2::kMlpProjW, gpt2::kMlpProjB};
  return LastLinear{w[llama::kDownW], w[llama::kDownB], /*conv1d=*/false, 0.0, kMlpOut, llama::kDownW,
                    llama::kDownB};
}

LayerOutput layer_forward(const LayerSpec& spec, const Tensor& hidden, const LayerInputs& in,
                          const std::vector<Tensor>& weights, const LayerRng& rng, const Tensor& out_slot,
                          bool stop_before_last_linear) {
  TORCH_CHECK(hidden.dim() == 3 && hidden.size(2) == spec.hidden, "ckpt_ext fused ", family_name(spec.family),
              " layer: hidden_states must be [batch, seq, ", spec.hidden, "], got ", hidden.sizes());
  TORCH_CHECK(!stop_before_last_linear || can_stop_before_last_linear(spec.family),
              "ckpt_ext: stop_before_last_linear is only supported for GPT-2 and Llama layers");
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
  TORCH_CHECK(!out_slot.defined() || !c10::GradMode::is_enabled(),
              "ckpt_ext: a layer writes into a preallocated output only under no_grad");
  switch (spec.family) {
    case Family::kBert:
      return bert_forward(spec, hidden, in, weights, rng, out_slot);
    case Family::kGPT2:
      return gpt2_forward(spec, hidden, in, weights, rng, out_slot, stop_before_last_linear);
    case Family::kLlama:
      return llama_forward(spec, hidden, in, weights, rng, out_slot, stop_before_last_linear);
  }
  TORCH_CHECK(false, "ckpt_ext: unknown layer family");
}

Tensor fused_layer_forward(const LayerSpec& spec, const Tensor& hidden, const LayerInputs& in,
                          const std::vector<Tensor>& weights, bool training) {
  check_weights(spec, weights, hidden);
  LayerRng rng{training, uses_dropout(spec, training) ? draw_dropout_seed(hidden.device()) : 0};
  return layer_forward(spec, hidden, in, weights, rng).out;
}

}  // namespace layers
}  // namespace ckpt_ext
