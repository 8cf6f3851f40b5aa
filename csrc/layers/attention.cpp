// Attention and its projections, shared by the families: q/k/v split and merge, Conv1D products, and
// attention(): SDPA's own kernel choice, the fused kernels (which return a log-sum-exp) called directly
// (cuDNN's through the dispatcher by name: see NamedOp), their dropout drawn from a generator state derived
// from the layer's seed (rng.h), and keep-attention (layer.h's KeptAttention: the kernel's output and
// log-sum-exp kept from forward, its backward op called in the replay; a path without a log-sum-exp keeps
// nothing and says why); on CPU with dropout, attention with ckpt_ext's Philox dropout: mask, softmax and dropout
// fused into one row pass between the two products (kernels/cpu/softmax_dropout.h), or written out as ATen ops
// (the reference, and what the fused pass does not cover).
#include <ATen/ATen.h>
#include <ATen/ScalarOps.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/custom_function.h>

#include <atomic>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <unordered_map>

#include "../kernels/cpu/softmax_dropout.h"
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
Tensor conv1d(const Tensor& x, const Tensor& w, const Tensor& b, int site) {
  return gemm_linear(x, w.t(), b, site);
}

// x @ W (no bias: the bias is fused into the following op), keeping x's leading dims.
Tensor conv1d_nobias(const Tensor& x, const Tensor& w, int site) {
  return gemm_linear(x, w.t(), Tensor(), site);
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
// and every replay. Here: scores = (scale * q) k^T + mask, softmax, and the dropout site's mask
// from ckpt_ext's Philox dropout op -- a function of (seed, site) like the residual sites, which its
// backward regenerates instead of storing. Taken only where no row can be fully masked: an additive mask
// (made finite by prepared()), none, or a square causal one (the diagonal is always kept).
bool dropout_written_out(const Tensor& q, const Tensor& k, const Tensor& mask, bool causal) {
  return q.is_cpu() && (!mask.defined() || mask.scalar_type() != at::kBool) && (!causal || q.size(2) == k.size(2));
}

// The products run as 3-D bmm on [batch * heads, ...] (no at::matmul: its batched path records an expand
// and a reshape per operand and copies q and k^T): q is scaled on its way to a contiguous copy (one pass
// over q, half the size of the scores for seq >= 2 * head_dim, where scaling the scores was a pass of its
// own and q's copy another), k and v are copied row by row (k^T is then a free transposed view); the
// context comes back as [B, heads, S, D].
Tensor attention_with_philox_dropout(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask,
                                     bool causal, double scale, double p, int64_t seed, int64_t offset) {
  const int64_t B = q.size(0), heads = q.size(1), S = q.size(2), D = q.size(3), Sk = k.size(2);
  const Tensor q3 = at::mul(q, scale).reshape({B * heads, S, D});
  const Tensor k3 = k.contiguous().view({B * heads, Sk, D});
  const Tensor v3 = v.contiguous().view({B * heads, Sk, v.size(3)});
  const Tensor scores = gemm_bmm(q3, k3.transpose(1, 2)).view({B, heads, S, Sk});
  Tensor bias = mask;
  if (causal)
    bias = at::full({S, Sk}, -std::numeric_limits<double>::infinity(), scores.options()).triu_(1);
  const Tensor logits = bias.defined() ? at::add(scores, bias) : scores;
  const Tensor dropped = ops::dropout(at::softmax(logits, -1), p, seed, offset);
  return gemm_bmm(dropped.view({B * heads, S, Sk}), v3).view({B, heads, S, v.size(3)});
}

// ---- the same attention fused (attention_philox_dropout_cpu, the layers' default) ----
// The two products stay GEMMs (gemm_bmm, the same calls as above, forward and backward); between them one row pass
// (kernels/cpu/softmax_dropout.h) adds the mask, takes the softmax and draws the dropout for (seed, offset) at the
// same flat indices as ops::dropout on the [B, heads, S, Sk] probabilities above, writing the dropped probabilities
// (the second product's operand) in the products' dtype and, when a backward will run, the probabilities. One
// autograd node for the whole attention rather than one for the part between the products: the second product's
// node would save the dropped probabilities beside the probabilities; here only the probabilities are saved (one
// [B, heads, S, Sk] tensor instead of two), the backward's row pass regenerates the dropped ones for dV while it
// computes the dropout's and the softmax's backward, and the ~10 nodes of the written-out ops (scale, copies,
// casts, two bmm, add, softmax, dropout, views) are one. Each product's gradient is the call the written-out
// path's autograd makes (gemm.cpp's MatmulFunction, or ATen's bmm backward where the layout policy does not
// apply), on equal operands: where the row pass's bits equal the ATen softmax's, so do the gradients.
// Roundings as the written-out ops under autocast: q scaled in q's dtype, then every product operand cast to the
// autocast dtype (G); the logits in promote(G, mask dtype) (L) as at::add gives them; gradients cast back to
// each input's dtype, q's then scaled.

std::atomic<bool>& fused_attention_flag() {
  static std::atomic<bool> f{[] {
    const char* env = std::getenv("CKPT_EXT_CPU_FUSED_ATTENTION");
    return !(env && std::string(env) == "0");
  }()};
  return f;
}

bool row_dtype_ok(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16; }

// The products' dtype: autocast's where it is on (it casts the bmm's operands), else q's.
at::ScalarType gemm_dtype(const Tensor& q) {
  return at::autocast::is_autocast_enabled(c10::DeviceType::CPU) ? at::autocast::get_autocast_dtype(c10::DeviceType::CPU)
                                                                  : q.scalar_type();
}

// Whether the fused path computes what the written-out one does for these inputs: float32 / bfloat16 throughout,
// a mask that takes no gradient, no mixed dtypes outside autocast (where at::bmm would refuse them).
bool fusable(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask) {
  const at::ScalarType g = gemm_dtype(q);
  if (!row_dtype_ok(g) || !row_dtype_ok(q.scalar_type()) || !row_dtype_ok(k.scalar_type()) ||
      !row_dtype_ok(v.scalar_type()))
    return false;
  if (!at::autocast::is_autocast_enabled(c10::DeviceType::CPU) &&
      (k.scalar_type() != g || v.scalar_type() != g))
    return false;
  if (!mask.defined()) return true;
  return row_dtype_ok(mask.scalar_type()) && !mask.requires_grad() && mask.dim() >= 1 && mask.dim() <= 4 &&
         at::promote_types(g, mask.scalar_type()) == (g == at::kBFloat16 && mask.scalar_type() == at::kBFloat16
                                                          ? at::kBFloat16
                                                          : at::kFloat);
}

// q * scale as a contiguous [B * heads, S, D], the bits of the written-out path's at::mul(q, scale): a contiguous copy
// multiplied in place by the scale as a wrapped number (what at::mul(Tensor, Scalar) passes; Tensor::mul_(Scalar)
// would cast the scale to bfloat16 first). Not at::mul_out into a contiguous result straight from the projection's
// transposed view: one pass, but ATen's bfloat16 loop over the mismatched layouts ran ~4x slower than a copy plus
// an in-place product.
Tensor scaled_copy(const Tensor& q, double scale) {
  const int64_t n = q.size(0) * q.size(1);
  if (q.is_contiguous()) return at::mul(q, scale).view({n, q.size(2), q.size(3)});
  Tensor w = c10::scalar_to_tensor(scale);
  w.unsafeGetTensorImpl()->set_wrapped_number(true);
  Tensor c = q.contiguous();
  c.mul_(w);
  return c.view({n, q.size(2), q.size(3)});
}

Tensor cast_to(const Tensor& t, at::ScalarType dt) { return t.scalar_type() == dt ? t : t.to(dt); }

struct FusedForward {
  Tensor q3, k3, v3, probs, ctx;
};

// No autograd (the node's forward, or a call without grad). keep_probs: store what backward reads.
FusedForward fused_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask, bool causal,
                           double scale, double p, int64_t seed, int64_t offset, at::ScalarType g, bool keep_probs) {
  const int64_t B = q.size(0), heads = q.size(1), S = q.size(2), D = q.size(3), Sk = k.size(2), Dv = v.size(3);
  FusedForward f;
  f.q3 = cast_to(scaled_copy(q, scale), g);
  f.k3 = cast_to(k.contiguous().view({B * heads, Sk, D}), g);
  f.v3 = cast_to(v.contiguous().view({B * heads, Sk, Dv}), g);
  const Tensor scores = gemm_bmm(f.q3, f.k3.transpose(1, 2)).contiguous().view({B, heads, S, Sk});
  Tensor m;
  at::ScalarType l = g;
  if (mask.defined()) {
    m = mask.stride(-1) == 1 ? mask : mask.contiguous();
    m = m.expand({B, heads, S, Sk});
    l = at::promote_types(g, mask.scalar_type());
  }
  if (keep_probs) f.probs = at::empty({B, heads, S, Sk}, scores.options().dtype(l));
  const Tensor dropped = at::empty({B, heads, S, Sk}, scores.options());
  kernels::cpu::softmax_dropout_forward(scores, m, causal, kernels::DropoutArgs{p, seed, offset}, f.probs, dropped);
  f.ctx = gemm_bmm(dropped.view({B * heads, S, Sk}), f.v3).view({B, heads, S, Dv});
  return f;
}

// The mask as a plain argument (it takes no gradient: fusable() checks), not an input of the node.
struct MaskArg {
  Tensor t;
};

struct FusedPhiloxAttentionFunction : torch::autograd::Function<FusedPhiloxAttentionFunction> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                        const MaskArg& mask, bool causal, double scale, double p, int64_t seed, int64_t offset,
                        int64_t g) {
    FusedForward f =
        fused_forward(q, k, v, mask.t, causal, scale, p, seed, offset, static_cast<at::ScalarType>(g), true);
    ctx->save_for_backward({f.q3, f.k3, f.v3, f.probs});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["p"] = p;
    ctx->saved_data["seed"] = seed;
    ctx->saved_data["offset"] = offset;
    ctx->saved_data["dtypes"] = std::vector<int64_t>{static_cast<int64_t>(q.scalar_type()),
                                                     static_cast<int64_t>(k.scalar_type()),
                                                     static_cast<int64_t>(v.scalar_type())};
    ctx->saved_data["q_sizes"] = q.sizes().vec();
    ctx->saved_data["k_sizes"] = k.sizes().vec();
    ctx->saved_data["v_sizes"] = v.sizes().vec();
    return f.ctx;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const Tensor &q3 = s[0], &k3 = s[1], &v3 = s[2], &probs = s[3];
    torch::autograd::variable_list out(10);
    const Tensor& grad = grads[0];
    if (!grad.defined()) return out;
    const auto dtypes = ctx->saved_data.at("dtypes").toIntVector();
    const auto q_sizes = ctx->saved_data.at("q_sizes").toIntVector(), k_sizes = ctx->saved_data.at("k_sizes").toIntVector(),
               v_sizes = ctx->saved_data.at("v_sizes").toIntVector();
    const double scale = ctx->saved_data.at("scale").toDouble();
    const kernels::DropoutArgs dropout{ctx->saved_data.at("p").toDouble(), ctx->saved_data.at("seed").toInt(),
                                       ctx->saved_data.at("offset").toInt()};
    const int64_t n = q3.size(0), S = q3.size(1);
    // the written-out path's view backward (a reshape), then its second product's backward
    const Tensor g3 = cast_to(grad, v3.scalar_type()).reshape({n, S, v3.size(2)});
    const Tensor grad_dropped = gemm_bmm(g3, v3.transpose(1, 2)).contiguous();
    const Tensor grad_scores = at::empty_like(grad_dropped);
    const Tensor dropped = at::empty_like(grad_dropped);
    kernels::cpu::softmax_dropout_backward(grad_dropped.view(probs.sizes()), probs, dropout,
                                           grad_scores.view(probs.sizes()), dropped.view(probs.sizes()));
    if (ctx->needs_input_grad(0))
      out[0] = at::mul(cast_to(gemm_bmm(grad_scores, k3), static_cast<at::ScalarType>(dtypes[0])).view(q_sizes),
                       scale);
    if (ctx->needs_input_grad(1))
      out[1] = cast_to(gemm_bmm(q3.transpose(1, 2), grad_scores).transpose(1, 2),
                       static_cast<at::ScalarType>(dtypes[1]))
                   .view(k_sizes);
    if (ctx->needs_input_grad(2))
      out[2] = cast_to(gemm_bmm(dropped.transpose(1, 2), g3), static_cast<at::ScalarType>(dtypes[2])).view(v_sizes);
    return out;
  }
};

Tensor attention_philox_dropout_fused(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask,
                                      bool causal, double scale, double p, int64_t seed, int64_t offset) {
  const at::ScalarType g = gemm_dtype(q);
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const bool grad = at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad());
  if (!grad) return fused_forward(q, k, v, mask, causal, scale, p, seed, offset, g, false).ctx;
  return FusedPhiloxAttentionFunction::apply(q, k, v, MaskArg{mask}, causal, scale, p, seed, offset, static_cast<int64_t>(g));
}


// Gemma 2's attention with logit softcapping, as Hugging Face's eager_attention_forward computes it (the same ops
// in the same order, autocast casting the matmuls as there): scores = (q k^T) * scale, capped to
// tanh(scores / cap) * cap, plus the mask (or the causal -inf triangle), softmax in float32 cast back to q's dtype,
// ckpt_ext's dropout drawn for (seed, offset) as attention_with_philox_dropout draws it, times v. Deterministic
// but for that dropout, so a replay with the same seed gives the same bits. k, v: already repeated to q's heads.
Tensor attention_softcapped(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask, bool causal,
                            double scale, double softcap, double p, int64_t seed, int64_t offset) {
  const int64_t S = q.size(2), Sk = k.size(2);
  Tensor scores = at::mul(at::matmul(q, k.transpose(2, 3)), scale);
  scores = at::mul(at::tanh(at::div(scores, softcap)), softcap);
  if (mask.defined()) {
    const Tensor bias = mask.scalar_type() == at::kBool
                            ? at::zeros(mask.sizes(), scores.options()).masked_fill_(
                                  mask.logical_not(), -std::numeric_limits<double>::infinity())
                            : mask;
    scores = at::add(scores, bias);
  } else if (causal) {
    scores = at::add(scores, at::full({S, Sk}, -std::numeric_limits<double>::infinity(), scores.options()).triu_(1));
  }
  Tensor probs = at::softmax(scores, -1, at::kFloat).to(q.scalar_type());
  if (p > 0) probs = ops::dropout(probs, p, seed, offset);
  return at::matmul(probs, v);
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
  // SDPA gives cuDNN -65504 for masked-out positions instead of -inf (convert_boolean_attn_mask_cudnn).
  const double masked = kernel == kCudnn && q.is_cuda() ? -65504.0 : -std::numeric_limits<double>::infinity();
  if (m.scalar_type() == at::kBool) m = at::zeros_like(m, q.options()).masked_fill_(m.logical_not(), masked);
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

// ---- cuDNN attention, called by name ----
// torch's _scaled_dot_product_cudnn_attention and its _backward are private ops whose C++ signatures have
// changed between releases (arguments added with defaults). They are called through the dispatcher, their
// arguments matched to the schema by name (an argument not named here must have a default) and their
// results checked by name, once per process; a torch whose schemas differ from what is matched here gets
// no direct cuDNN path: SDPA runs it (at::scaled_dot_product_attention) and keep-attention replays those
// layers in full, saying why.
struct NamedOp {
  std::optional<c10::OperatorHandle> op;
  std::string problem;  // empty: usable

  // `args`: what this file passes, by name; `results`: the names the first results must have (those
  // without names in the schema are taken by position).
  NamedOp(const char* name, std::initializer_list<const char*> args, std::initializer_list<const char*> results) {
    op = c10::Dispatcher::singleton().findOp({name, ""});
    if (!op) {
      problem = std::string("this torch has no ") + name + " op";
      return;
    }
    const auto& schema = op->schema();
    std::unordered_map<std::string, bool> given;
    for (const char* a : args) given[a] = false;
    for (const auto& a : schema.arguments()) {
      auto it = given.find(a.name());
      if (it != given.end()) {
        it->second = true;
      } else if (!a.default_value()) {
        problem = std::string("this torch's ") + name + " takes an argument ckpt_ext does not know (" + a.name() + ")";
        return;
      }
    }
    for (const auto& [a, found] : given) {
      if (!found) {
        problem = std::string("this torch's ") + name + " takes no argument " + a + ", which ckpt_ext passes";
        return;
      }
    }
    const auto& returns = schema.returns();
    if (returns.size() < results.size()) {
      problem = std::string("this torch's ") + name + " returns fewer results than ckpt_ext reads";
      return;
    }
    size_t i = 0;
    for (const char* r : results) {
      if (!returns[i].name().empty() && returns[i].name() != r) {
        problem = std::string("this torch's ") + name + " returns " + returns[i].name() + " where ckpt_ext reads " + r;
        return;
      }
      ++i;
    }
  }

  // Calls the op with `args` matched by name (defaults for the rest); returns its results. An undefined
  // tensor goes to an optional argument as None.
  torch::jit::Stack operator()(const std::unordered_map<std::string, c10::IValue>& args) const {
    torch::jit::Stack stack;
    for (const auto& a : op->schema().arguments()) {
      auto it = args.find(a.name());
      if (it == args.end()) {
        stack.push_back(*a.default_value());
        continue;
      }
      const c10::IValue& v = it->second;
      const bool none = v.isTensor() && !v.toTensor().defined() && a.type()->kind() == c10::TypeKind::OptionalType;
      stack.push_back(none ? c10::IValue() : v);
    }
    op->callBoxed(&stack);
    return stack;
  }
};

const NamedOp& cudnn_forward() {
  static const NamedOp op("aten::_scaled_dot_product_cudnn_attention",
                          {"query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal",
                           "return_debug_mask", "scale"},
                          {"output", "logsumexp", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "philox_seed",
                           "philox_offset"});
  return op;
}

const NamedOp& cudnn_backward() {
  static const NamedOp op("aten::_scaled_dot_product_cudnn_attention_backward",
                          {"grad_out", "query", "key", "value", "out", "logsumexp", "philox_seed", "philox_offset",
                           "attn_bias", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal",
                           "scale"},
                          {});
  return op;
}

int64_t as_int(const c10::IValue& v) {
  return v.isInt() ? v.toInt() : v.toSymInt().expect_int();
}

// Why no kernel with a log-sum-exp takes this call (what keep-attention says of a layer it replays in full).
std::string no_lse_reason(int64_t kernel, const Tensor& q, double p) {
  if (q.is_cpu() && p > 0)
    return "of attention dropout (p=" + c10::str(p) + ") on CPU: SDPA's CPU flash kernel has no dropout, so "
           "the attention is written out (softmax and ckpt_ext's dropout), with no log-sum-exp to keep (train "
           "with attention dropout 0 to keep it)";
  if (kernel == kCudnn) {
    const std::string& why = cudnn_forward().problem.empty() ? cudnn_backward().problem : cudnn_forward().problem;
    return "SDPA chooses its cuDNN kernel, but " + why + " (ckpt_ext calls it by name); SDPA runs it instead";
  }
  if (kernel == kFlash)  // CUDA flash with a head dim SDPA pads
    return "the head dim (" + std::to_string(q.size(-1)) + ") is not a multiple of 8, which SDPA's CUDA flash "
           "path pads; ckpt_ext calls the kernel only where it needs no padding";
  return "no fused SDPA kernel takes this attention (dtype " + std::string(c10::toString(q.scalar_type())) +
         ", head dim " + std::to_string(q.size(-1)) + ", mask, or the torch.backends / sdpa_kernel SDPA settings), "
         "so it runs SDPA's math path, which has no log-sum-exp";
}

// A fused kernel this file calls directly: one that returns a log-sum-exp and needs no padding.
bool direct(int64_t kernel, const Tensor& q) {
  if (kernel == kFlash) return q.is_cpu() || (q.is_cuda() && q.size(-1) % 8 == 0);
  if (kernel == kCudnn) return q.is_cuda() && cudnn_forward().problem.empty() && cudnn_backward().problem.empty();
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
  if (c.kernel == kCudnn) {
    // Its log-sum-exp always: cuDNN's inference graph (no statistics) is another kernel, whose output need
    // not be the same bits as the training graph's, and forward, replay and keep-attention must agree.
    const auto r = cudnn_forward()({{"query", c.q},
                                    {"key", c.k},
                                    {"value", c.v},
                                    {"attn_bias", c.bias},
                                    {"compute_log_sumexp", true},
                                    {"dropout_p", c.p},
                                    {"is_causal", c.causal},
                                    {"return_debug_mask", false},
                                    {"scale", c.scale}});
    if (kept != nullptr) {
      kept->out = r[0].toTensor();
      kept->lse = r[1].toTensor();
      kept->cum_seq_q = r[2].toTensor();
      kept->cum_seq_k = r[3].toTensor();
      kept->max_q = as_int(r[4]);
      kept->max_k = as_int(r[5]);
      kept->philox_seed = r[6].toTensor();
      kept->philox_offset = r[7].toTensor();
    }
    return r[0].toTensor();
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
    } else if (kernel == kCudnn) {
      const auto b = cudnn_backward()({{"grad_out", g},
                                       {"query", q},
                                       {"key", k},
                                       {"value", v},
                                       {"out", kept.out},
                                       {"logsumexp", kept.lse},
                                       {"philox_seed", kept.philox_seed},
                                       {"philox_offset", kept.philox_offset},
                                       {"attn_bias", bias},
                                       {"cum_seq_q", kept.cum_seq_q},
                                       {"cum_seq_k", kept.cum_seq_k},
                                       {"max_q", ctx->saved_data["max_q"].toInt()},
                                       {"max_k", ctx->saved_data["max_k"].toInt()},
                                       {"dropout_p", p},
                                       {"is_causal", causal},
                                       {"scale", scale}});
      gqkv = {b[0].toTensor(), b[1].toTensor(), b[2].toTensor()};
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

Tensor attention_philox_dropout_cpu(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask,
                                    bool causal, double scale, double p, int64_t seed, int64_t offset, bool fused) {
  TORCH_CHECK(q.is_cpu() && p > 0 && p < 1 && q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && k.size(1) == q.size(1) &&
                  v.size(1) == q.size(1),
              "ckpt_ext attention_philox_dropout_cpu: CPU q, k, v [B, heads, S, D] with equal heads and 0 < p < 1");
  TORCH_CHECK(!causal || (!mask.defined() && q.size(2) == k.size(2)),
              "ckpt_ext attention_philox_dropout_cpu: causal is for square attention without a mask");
  TORCH_CHECK(!mask.defined() || mask.scalar_type() != at::kBool,
              "ckpt_ext attention_philox_dropout_cpu: the mask must be additive (a bool mask can mask whole rows)");
  if (fused && fusable(q, k, v, mask))
    return attention_philox_dropout_fused(q, k, v, mask, causal, scale, p, seed, offset);
  return attention_with_philox_dropout(q, k, v, mask, causal, scale, p, seed, offset);
}

bool cpu_fused_attention(std::optional<bool> set) {
  return set.has_value() ? fused_attention_flag().exchange(*set) : fused_attention_flag().load();
}

std::string cudnn_attention_problem() {
  return cudnn_forward().problem.empty() ? cudnn_backward().problem : cudnn_forward().problem;
}

Tensor attention(const Tensor& q_in, const Tensor& k, const Tensor& v, const Tensor& mask, bool causal, double scale,
                 double p, int64_t seed, int64_t offset, KeptAttention* kept, double softcap) {
  const int64_t n_rep = q_in.size(1) / k.size(1);
  const bool use_causal = causal && !mask.defined() && q_in.size(2) > 1;
  if (softcap > 0) {
    if (kept != nullptr)
      kept->not_kept = "of attention logit softcapping (Gemma 2, attn_logit_softcapping=" + c10::str(softcap) +
                       "): no SDPA kernel computes it, so the attention is written out (matmul, tanh cap, mask, "
                       "softmax, dropout, matmul) with no log-sum-exp to keep; such layers replay their attention "
                       "in full";
    return attention_softcapped(q_in, repeat_kv(k, n_rep), repeat_kv(v, n_rep), mask, use_causal, scale, softcap, p,
                                seed, offset);
  }
  // Grouped-query attention: SDPA's own GQA support when there is no mask (the fast kernels need
  // none), repeated heads otherwise -- Hugging Face's rule.
  const bool gqa = n_rep > 1 && !mask.defined();
  const bool replaying_kept = kept != nullptr && kept->filled();
  if (p > 0 && !replaying_kept && dropout_written_out(q_in, k, mask, use_causal)) {
    if (kept != nullptr) kept->not_kept = no_lse_reason(kMath, q_in, p);
    return attention_philox_dropout_cpu(q_in, repeat_kv(k, n_rep), repeat_kv(v, n_rep), mask, use_causal, scale, p,
                                        seed, offset, fused_attention_flag().load(std::memory_order_relaxed));
  }
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
  if (replaying_kept) {  // keep-attention's replay: no attention forward
    Call c{q, kk, vv, sdpa_bias(m, q, kk, kept->kernel), use_causal, scale, p, kept->kernel};
    return KeptAttentionFunction::apply(q, kk, vv, c, *kept)[0];
  }
  const std::optional<Tensor> om = opt(m);
  const int64_t kernel = at::_fused_sdp_choice(q, kk, vv, om, p, use_causal, scale, gqa);
  const bool fused = direct(kernel, q);  // SDPA calls this kernel with these tensors too
  if (kept != nullptr && !fused) {  // nothing to keep: this layer's replay runs its attention forward
    kept->not_kept = no_lse_reason(kernel, q, p);
    kept = nullptr;
  }
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
