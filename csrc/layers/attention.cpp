// Attention and its projections, shared by the families: q/k/v split and merge, Conv1D products, and
// attention(): SDPA's own kernel choice, the fused kernels (which return a log-sum-exp) called directly,
// their dropout drawn from a generator state derived from the layer's seed (rng.h), and keep-attention
// (layer.h's KeptAttention: the kernel's output and log-sum-exp kept from forward, its backward op called
// in the replay); on CPU with dropout, attention written out with ckpt_ext's Philox dropout.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/custom_function.h>

#include <limits>

#include "../ops/ops.h"
#include "family.h"
#include "rng.h"

namespace ckpt_ext {
namespace layers {

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

// y = x @ W + b for a Conv1D weight [in, out]: gemm_linear on W's transpose view (outside gemm.cpp's CPU
// layout policy at::linear's addmm(b, x, W), as Hugging Face computes it).
Tensor conv1d(const Tensor& x, const Tensor& w, const Tensor& b) {
  return gemm_linear(x, w.t(), b);
}

// x @ W (no bias: the bias is fused into the following op), keeping x's leading dims.
Tensor conv1d_nobias(const Tensor& x, const Tensor& w) {
  return gemm_linear(x, w.t());
}

namespace {

// [B, kv_heads, S, D] -> [B, kv_heads * n_rep, S, D], each kv head repeated n_rep times (Hugging Face's repeat_kv).
Tensor repeat_kv(const Tensor& t, int64_t n_rep) {
  if (n_rep == 1) return t;
  const auto B = t.size(0), H = t.size(1), S = t.size(2), D = t.size(3);
  return t.unsqueeze(2).expand({B, H, n_rep, S, D}).reshape({B, H * n_rep, S, D});
}

// Hugging Face's eager masks are additive with the dtype's lowest value; a query whose keys are all
// masked (left padding) then gets a uniform row in its eager softmax. CUDA's fused kernels scale
// score + mask by log2(e) in float32, which overflows float32's / bfloat16's lowest to -inf, and an
// all -inf row comes out as zeros: the CUDA-only eager+padding parity failures. -1e30 is as good as
// -inf for any row with one unmasked key (exp underflows to 0) and leaves fully masked rows uniform.
Tensor finite_additive_mask(const Tensor& mask) {
  const auto t = mask.scalar_type();
  if (t != at::kFloat && t != at::kBFloat16 && t != at::kDouble) return mask;  // float16's lowest is safe
  return mask.clamp_min(-1e30);
}

constexpr uint64_t kSdpaSalt = 0x5DBA7E11A5EEDULL;  // separates SDPA's generator seeds from our Philox keys

// CPU attention with dropout. SDPA takes its math path there (CPU's flash kernel has no dropout): a
// bernoulli mask drawn from the generator (set and restored around the call), mask and scale applied in
// separate passes, and _safe_softmax's guard for fully masked rows (isneginf, all, where) on every call
// and every replay. Here: scores = mask + scale * q k^T in one pass, softmax, and the dropout site's mask
// from ckpt_ext's Philox dropout op -- a function of (seed, site) like the residual sites, which its
// backward regenerates instead of storing. Taken only where no row can be fully masked: an additive mask
// (made finite by prepared()), none, or a square causal one (the diagonal is always kept).
bool dropout_written_out(const Tensor& q, const Tensor& k, const Tensor& mask, bool causal) {
  return q.is_cpu() && (!mask.defined() || mask.scalar_type() != at::kBool) && (!causal || q.size(2) == k.size(2));
}

Tensor attention_with_philox_dropout(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask,
                                     bool causal, double scale, double p, int64_t seed, int64_t offset) {
  const Tensor scores = gemm_matmul(q, k.transpose(-2, -1));
  Tensor bias = mask;
  if (causal)
    bias = at::full({q.size(2), k.size(2)}, -std::numeric_limits<double>::infinity(), scores.options()).triu_(1);
  const Tensor logits = bias.defined() ? at::add(bias, scores, scale) : scores * scale;
  return gemm_matmul(ops::dropout(at::softmax(logits, -1), p, seed, offset), v);
}


}  // namespace

LayerInputs prepared(const LayerInputs& in) {
  if (!in.mask.defined() || in.mask.scalar_type() == at::kBool) return in;
  return {finite_additive_mask(in.mask), in.cos, in.sin};
}

std::vector<Tensor> KeptAttention::tensors() const {
  return {out, lse, philox_seed, philox_offset, cum_seq_q, cum_seq_k};
}

void KeptAttention::from_tensors(const Tensor* t) {
  out = t[0];
  lse = t[1];
  philox_seed = t[2];
  philox_offset = t[3];
  cum_seq_q = t[4];
  cum_seq_k = t[5];
}

namespace {

// SDPA's kernels, numbered as at::_fused_sdp_choice returns them (sdp::SDPBackend).
enum Kernel : int64_t { kMath = 0, kFlash = 1, kEfficient = 2, kCudnn = 3 };

// The call of one attention, as SDPA makes it for the fused kernels: the mask additive (a bool mask
// becomes 0 / -inf in q's dtype, as SDPA's convert_boolean_attn_mask does) and, for CUDA's
// memory-efficient kernel, laid out as SDPA's preprocess_mask lays it out (last dim padded to an aligned
// stride, expanded to [B, heads, Sq, Sk]: the same values).
struct Call {
  Tensor q, k, v, bias;
  bool causal;
  double scale, p;
  int64_t kernel;
};

Tensor sdpa_bias(const Tensor& mask, const Tensor& q, const Tensor& k, int64_t kernel) {
  if (!mask.defined()) return mask;
  Tensor m = mask;
  if (m.scalar_type() == at::kBool)
    m = at::zeros_like(m, q.options()).masked_fill_(m.logical_not(), -std::numeric_limits<double>::infinity());
  if (kernel != kEfficient || !q.is_cuda()) return m;
  constexpr int64_t kAlign = 16;
  bool aligned = m.stride(-1) == 1;
  for (int64_t i = 0; i + 1 < m.dim(); ++i) aligned = aligned && m.stride(i) % kAlign == 0;
  if (!aligned) {
    const int64_t n = m.size(-1);
    m = at::pad(m, {0, kAlign - n % kAlign}).slice(-1, 0, n);
  }
  return m.expand({q.size(0), q.size(1), q.size(2), k.size(2)});
}

// Why no kernel with a log-sum-exp takes this call (keep-attention's error).
std::string no_lse_reason(int64_t kernel, const Tensor& q, double p) {
  if (kernel == kCudnn)
    return "SDPA chooses its cuDNN kernel here, whose outputs ckpt_ext does not keep; turn it off with "
           "torch.backends.cuda.enable_cudnn_sdp(False) so that SDPA takes the flash or memory-efficient kernel";
  if (q.is_cpu() && p > 0)
    return "attention dropout (p=" + std::to_string(p) + ") on CPU: SDPA's CPU flash kernel has no dropout, so "
           "attention runs SDPA's math path, which has no log-sum-exp (train with attention dropout 0, or "
           "checkpoint these layers without keep-attention)";
  if (kernel == kFlash)  // CUDA flash with a head dim SDPA pads
    return "the head dim (" + std::to_string(q.size(-1)) + ") is not a multiple of 8, which SDPA's CUDA flash "
           "path pads; ckpt_ext calls the kernel only where it needs no padding";
  return "no fused SDPA kernel takes this attention (dtype " + std::string(c10::toString(q.scalar_type())) +
         ", head dim " + std::to_string(q.size(-1)) + ", mask, or the torch.backends SDPA settings), so it runs "
         "SDPA's math path, which has no log-sum-exp";
}

// A fused kernel this file calls directly: one that returns a log-sum-exp and needs no padding.
bool direct(int64_t kernel, const Tensor& q) {
  if (kernel == kFlash) return q.is_cpu() || (q.is_cuda() && q.size(-1) % 8 == 0);
  return kernel == kEfficient && q.is_cuda();
}

// Runs the kernel of `c` (direct), filling `kept` when given: its output, log-sum-exp and dropout state.
Tensor run_kernel(const Call& c, KeptAttention* kept) {
  const OptTensor bias = opt(c.bias);
  if (c.q.is_cpu()) {
    auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(c.q, c.k, c.v, c.p, c.causal, bias, c.scale);
    if (kept != nullptr) {
      kept->out = out;
      kept->lse = lse;
    }
    return out;
  }
  if (c.kernel == kFlash) {
    auto r = at::_scaled_dot_product_flash_attention(c.q, c.k, c.v, c.p, c.causal, /*return_debug_mask=*/false,
                                                      c.scale);
    if (kept != nullptr) {
      kept->out = std::get<0>(r);
      kept->lse = std::get<1>(r);
      kept->cum_seq_q = std::get<2>(r);
      kept->cum_seq_k = std::get<3>(r);
      kept->max_q = std::get<4>(r).expect_int();
      kept->max_k = std::get<5>(r).expect_int();
      kept->philox_seed = std::get<6>(r);
      kept->philox_offset = std::get<7>(r);
    }
    return std::get<0>(r);
  }
  // The memory-efficient kernel computes its log-sum-exp when a backward will need it (SDPA's rule), and
  // always when it is kept.
  const bool lse = kept != nullptr || (at::GradMode::is_enabled() &&
                                       (c.q.requires_grad() || c.k.requires_grad() || c.v.requires_grad()));
  auto r = at::_scaled_dot_product_efficient_attention(c.q, c.k, c.v, bias, lse, c.p, c.causal, c.scale);
  if (kept != nullptr) {
    kept->out = std::get<0>(r);
    kept->lse = std::get<1>(r);
    kept->philox_seed = std::get<2>(r);
    kept->philox_offset = std::get<3>(r);
  }
  return std::get<0>(r);
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The replay's attention under keep-attention: returns the kept output, and in backward calls the
// kernel's backward op with it and the kept log-sum-exp (and dropout state) -- the call autograd makes
// for the kernel's node in a backward without checkpointing, so the gradients are the same bits.
struct KeptAttentionFunction : public torch::autograd::Function<KeptAttentionFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                               const Call& c, const KeptAttention& kept) {
    std::vector<Tensor> saved{q, k, v, c.bias};
    for (auto& t : kept.tensors()) saved.push_back(t);
    ctx->save_for_backward(saved);
    ctx->saved_data["kernel"] = c.kernel;
    ctx->saved_data["causal"] = c.causal;
    ctx->saved_data["scale"] = c.scale;
    ctx->saved_data["p"] = c.p;
    ctx->saved_data["max_q"] = kept.max_q;
    ctx->saved_data["max_k"] = kept.max_k;
    return {kept.out.detach()};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list s = ctx->get_saved_variables();
    const Tensor &q = s[0], &k = s[1], &v = s[2], &bias = s[3];
    KeptAttention kept;
    kept.from_tensors(&s[4]);
    const int64_t kernel = ctx->saved_data["kernel"].toInt();
    const bool causal = ctx->saved_data["causal"].toBool();
    const double scale = ctx->saved_data["scale"].toDouble(), p = ctx->saved_data["p"].toDouble();
    const Tensor& g = grads[0];
    variable_list r(5);  // q, k, v, and the two non-tensor arguments
    if (!g.defined()) return r;
    std::tuple<Tensor, Tensor, Tensor> gqkv;
    if (q.is_cpu()) {
      gqkv = at::_scaled_dot_product_flash_attention_for_cpu_backward(g, q, k, v, kept.out, kept.lse, p, causal,
                                                                      opt(bias), scale);
    } else if (kernel == kFlash) {
      gqkv = at::_scaled_dot_product_flash_attention_backward(
          g, q, k, v, kept.out, kept.lse, kept.cum_seq_q, kept.cum_seq_k, ctx->saved_data["max_q"].toInt(),
          ctx->saved_data["max_k"].toInt(), p, causal, kept.philox_seed, kept.philox_offset, scale);
    } else {
      auto e = at::_scaled_dot_product_efficient_attention_backward(
          g, q, k, v, bias, kept.out, kept.lse, kept.philox_seed, kept.philox_offset, p,
          {ctx->needs_input_grad(0), ctx->needs_input_grad(1), ctx->needs_input_grad(2), false}, causal, scale);
      gqkv = {std::get<0>(e), std::get<1>(e), std::get<2>(e)};
    }
    r[0] = std::get<0>(gqkv);
    r[1] = std::get<1>(gqkv);
    r[2] = std::get<2>(gqkv);
    return r;
  }
};

}  // namespace

Tensor attention(const Tensor& q_in, const Tensor& k, const Tensor& v, const Tensor& mask, bool causal, double scale,
                 double p, int64_t seed, int64_t offset, KeptAttention* kept) {
  const int64_t n_rep = q_in.size(1) / k.size(1);
  const bool use_causal = causal && !mask.defined() && q_in.size(2) > 1;
  // Grouped-query attention: SDPA's own GQA support when there is no mask (the fast kernels need
  // none), repeated heads otherwise -- Hugging Face's rule.
  const bool gqa = n_rep > 1 && !mask.defined();
  if (p > 0 && kept == nullptr && dropout_written_out(q_in, k, mask, use_causal))
    return attention_with_philox_dropout(q_in, repeat_kv(k, n_rep), repeat_kv(v, n_rep), mask, use_causal, scale, p,
                                         seed, offset);
  Tensor q = q_in, kk = gqa ? k : repeat_kv(k, n_rep), vv = gqa ? v : repeat_kv(v, n_rep);
  Tensor m = mask;  // additive masks made finite by prepared()
  // Autocast: SDPA is on autocast's lower-precision list; the fused kernels called below may not be, so the
  // inputs are cast here as autocast casts SDPA's (each op below then sees them already cast), and autocast
  // is off for the rest of the call, as inside an autocast wrapper.
  const auto dt = q.device().type();
  if (at::autocast::is_autocast_enabled(dt)) {
    const auto to = at::autocast::get_autocast_dtype(dt);
    q = at::autocast::cached_cast(to, q, dt);
    kk = at::autocast::cached_cast(to, kk, dt);
    vv = at::autocast::cached_cast(to, vv, dt);
    if (m.defined()) m = at::autocast::cached_cast(to, m, dt);
  }
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  if (kept != nullptr && kept->filled()) {  // keep-attention's replay: no attention forward
    Call c{q, kk, vv, sdpa_bias(m, q, kk, kept->kernel), use_causal, scale, p, kept->kernel};
    return KeptAttentionFunction::apply(q, kk, vv, c, *kept)[0];
  }
  const std::optional<Tensor> om = opt(m);
  const int64_t kernel = at::_fused_sdp_choice(q, kk, vv, om, p, use_causal, scale, gqa);
  const bool fused = direct(kernel, q);  // SDPA calls this kernel with these tensors too
  TORCH_CHECK(kept == nullptr || fused, "ckpt_ext keep-attention: ", kept->who,
              " cannot keep its attention: ", no_lse_reason(kernel, q, p), ".");
  // SDPA draws its dropout from the device's default generator (CUDA flash/efficient kernels: the
  // philox (seed, offset) they read from it and return for their backward; the math path, CPU: a
  // bernoulli mask from it). Set to a state that is a function of the layer call's seed and this
  // site, its mask is one more dropout site of the call: a replay with the same seed draws it again,
  // and the user's generator is left as it was.
  std::optional<SeededGeneratorScope> rng;
  if (p > 0) rng.emplace(q.device(), mix64(static_cast<uint64_t>(seed) ^ mix64(kSdpaSalt + offset)));
  if (!fused) return at::scaled_dot_product_attention(q, kk, vv, om, p, use_causal, scale, gqa);
  const Call c{q, kk, vv, sdpa_bias(m, q, kk, kernel), use_causal, scale, p, kernel};
  if (kept != nullptr) kept->kernel = kernel;
  return run_kernel(c, kept);
}

}  // namespace layers
}  // namespace ckpt_ext
