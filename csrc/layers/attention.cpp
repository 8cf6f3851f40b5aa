// Attention and its projections, shared by the families: q/k/v split and merge, Conv1D products, and
// attention() through at::scaled_dot_product_attention (its dropout drawn from a generator state
// derived from the layer's seed, rng.h), or on CPU with dropout written out with ckpt_ext's Philox dropout.
#include <ATen/ATen.h>

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
  const Tensor scores = at::matmul(q, k.transpose(-2, -1));
  Tensor bias = mask;
  if (causal)
    bias = at::full({q.size(2), k.size(2)}, -std::numeric_limits<double>::infinity(), scores.options()).triu_(1);
  const Tensor logits = bias.defined() ? at::add(bias, scores, scale) : scores * scale;
  return at::matmul(ops::dropout(at::softmax(logits, -1), p, seed, offset), v);
}

}  // namespace

LayerInputs prepared(const LayerInputs& in) {
  if (!in.mask.defined() || in.mask.scalar_type() == at::kBool) return in;
  return {finite_additive_mask(in.mask), in.cos, in.sin};
}

Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask, bool causal, double scale,
                 double p, int64_t seed, int64_t offset) {
  const int64_t n_rep = q.size(1) / k.size(1);
  const bool use_causal = causal && !mask.defined() && q.size(2) > 1;
  // Grouped-query attention: SDPA's own GQA support when there is no mask (the fast kernels need
  // none), repeated heads otherwise -- Hugging Face's rule.
  const bool gqa = n_rep > 1 && !mask.defined();
  const Tensor kk = gqa ? k : repeat_kv(k, n_rep), vv = gqa ? v : repeat_kv(v, n_rep);
  std::optional<Tensor> m;
  if (mask.defined()) m = mask;  // additive masks made finite by prepared()
  if (p == 0.0) return at::scaled_dot_product_attention(q, kk, vv, m, 0.0, use_causal, scale, gqa);
  if (dropout_written_out(q, k, mask, use_causal))
    return attention_with_philox_dropout(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), mask, use_causal, scale, p,
                                         seed, offset);
  // SDPA draws its dropout from the device's default generator (CUDA flash/efficient kernels: the
  // philox (seed, offset) they read from it and return for their backward; the math path, CPU: a
  // bernoulli mask from it). Set to a state that is a function of the layer call's seed and this
  // site, its mask is one more dropout site of the call: a replay with the same seed draws it again,
  // and the user's generator is left as it was.
  SeededGeneratorScope rng(q.device(), mix64(static_cast<uint64_t>(seed) ^ mix64(kSdpaSalt + offset)));
  return at::scaled_dot_product_attention(q, kk, vv, m, p, use_causal, scale, gqa);
}

}  // namespace layers
}  // namespace ckpt_ext
