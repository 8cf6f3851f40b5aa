// Building blocks shared by the fused layers: the dropout seed, the last linear with its residual
// (an autograd node of its own, so the segment replay can compute its gradients without running it),
// and attention.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/custom_function.h>

#include <limits>
#include <mutex>

#include "../ops/fused_ops.h"
#include "layer.h"

namespace ckpt_ext {
namespace layers {

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

}  // namespace

int64_t draw_dropout_seed(c10::Device device) {
  if (device.is_cpu()) {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    return static_cast<int64_t>(at::check_generator<at::CPUGeneratorImpl>(gen)->random64());
  }
  // Philox generators (CUDA) are fully described by (seed, offset): reserve offsets as torch's own
  // kernels do (multiples of 4) and hash the pair, so that our counters never coincide with the ones
  // torch's kernels use under the same seed, and nothing waits for the device.
  auto gen = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  const uint64_t seed = gen.current_seed();
  const uint64_t offset = gen.get_offset();
  gen.set_offset(offset + 4);
  return static_cast<int64_t>(splitmix64(seed ^ splitmix64(offset)));
}

// ---- residual linear ---------------------------------------------------------------------------------------------

namespace {

// x @ W^T (Linear) or x @ W (Conv1D) on the 2-D view of x, without bias (the bias is fused into the
// dropout-residual kernel).
Tensor matmul_2d(const Tensor& x, const LastLinear& lin) {
  const Tensor x2d = x.reshape({-1, x.size(-1)});
  return lin.conv1d ? x2d.mm(lin.weight) : x2d.mm(lin.weight.t());
}

std::optional<Tensor> bias_of(const LastLinear& lin) {
  return lin.bias.defined() ? std::optional<Tensor>(lin.bias) : std::nullopt;
}

struct ResidualLinearFunction : torch::autograd::Function<ResidualLinearFunction> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& x, const Tensor& weight,
                        const std::optional<Tensor>& bias, const Tensor& residual, bool conv1d, double p,
                        int64_t seed, int64_t offset) {
    LastLinear lin{weight, bias.has_value() ? *bias : Tensor(), conv1d, p, offset, -1, -1};
    const Tensor y = matmul_2d(x, lin).view(residual.sizes());
    ctx->save_for_backward({x, weight});
    ctx->saved_data["conv1d"] = conv1d;
    ctx->saved_data["has_bias"] = lin.bias.defined();
    ctx->saved_data["p"] = p;
    ctx->saved_data["seed"] = seed;
    ctx->saved_data["offset"] = offset;
    // Grad mode is off inside Function::forward, so this records nothing of its own.
    return ops::bias_dropout_add(y, bias_of(lin), residual, p, seed, offset);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const bool has_bias = ctx->saved_data.at("has_bias").toBool();
    LastLinear lin{saved[1], Tensor(), ctx->saved_data.at("conv1d").toBool(), ctx->saved_data.at("p").toDouble(),
                   ctx->saved_data.at("offset").toInt(), -1, -1};
    torch::autograd::variable_list out(8);
    const Tensor& grad = grads[0];
    if (!grad.defined()) return out;
    // Edges: x, weight, bias (if present), residual.
    const int64_t residual_edge = has_bias ? 3 : 2;
    auto g = residual_linear_backward(grad, saved[0], lin, ctx->saved_data.at("seed").toInt(),
                                      ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                                      has_bias && ctx->needs_input_grad(2));
    out[0] = g.x;
    out[1] = g.weight;
    out[2] = g.bias;
    if (ctx->needs_input_grad(residual_edge)) out[3] = grad;
    return out;
  }
};

}  // namespace

Tensor residual_linear(const Tensor& x, const LastLinear& lin, const Tensor& residual, int64_t seed) {
  return ResidualLinearFunction::apply(x, lin.weight, bias_of(lin), residual, lin.conv1d, lin.p, seed, lin.offset);
}

ResidualLinearGrads residual_linear_backward(const Tensor& grad, const Tensor& x, const LastLinear& lin, int64_t seed,
                                             bool need_x, bool need_weight, bool need_bias) {
  ResidualLinearGrads r;
  if (!(need_x || need_weight || need_bias)) return r;
  const Tensor g = lin.p > 0 ? ops::dropout_backward(grad, lin.p, seed, lin.offset) : grad;
  const Tensor g2d = g.reshape({-1, g.size(-1)});
  if (need_x) r.x = (lin.conv1d ? g2d.mm(lin.weight.t()) : g2d.mm(lin.weight)).view(x.sizes());
  if (need_weight) {
    const Tensor x2d = x.reshape({-1, x.size(-1)});
    r.weight = lin.conv1d ? x2d.t().mm(g2d) : g2d.t().mm(x2d);
  }
  if (need_bias) r.bias = g2d.sum(0);
  return r;
}

// ---- attention ---------------------------------------------------------------------------------------------------

namespace {

// [B, kv_heads, S, D] -> [B, kv_heads * n_rep, S, D], each kv head repeated n_rep times (Hugging Face's repeat_kv).
Tensor repeat_kv(const Tensor& t, int64_t n_rep) {
  if (n_rep == 1) return t;
  const auto B = t.size(0), H = t.size(1), S = t.size(2), D = t.size(3);
  return t.unsqueeze(2).expand({B, H, n_rep, S, D}).reshape({B, H * n_rep, S, D});
}

at::Scalar lowest_of(at::ScalarType t) {
  switch (t) {
    case at::kDouble:
      return std::numeric_limits<double>::lowest();
    case at::kHalf:
      return static_cast<double>(std::numeric_limits<c10::Half>::lowest());
    case at::kBFloat16:
      return static_cast<double>(std::numeric_limits<c10::BFloat16>::lowest());
    default:
      return static_cast<double>(std::numeric_limits<float>::lowest());
  }
}

}  // namespace

Tensor philox_dropout(const Tensor& x, double p, int64_t seed, int64_t offset) {
  // dropout_backward computes grad * mask / (1 - p): applied to x, it is dropout's forward, and its
  // autograd kernel (itself) is dropout's backward.
  return p > 0 ? ops::dropout_backward(x, p, seed, offset) : x;
}

Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask, bool causal, double scale,
                 double p, int64_t seed, int64_t offset) {
  const int64_t n_rep = q.size(1) / k.size(1);
  const int64_t S = q.size(2);
  const bool use_causal = causal && !mask.defined() && S > 1;
  if (p == 0.0) {
    // SDPA picks flash/efficient kernels on GPU (flash or math on CPU). Grouped-query attention: SDPA's
    // own GQA support when there is no mask (the fast kernels need none), repeated heads otherwise --
    // Hugging Face's rule.
    const bool gqa = n_rep > 1 && !mask.defined();
    const Tensor kk = gqa ? k : repeat_kv(k, n_rep), vv = gqa ? v : repeat_kv(v, n_rep);
    std::optional<Tensor> m = mask.defined() ? std::optional<Tensor>(mask) : std::nullopt;
    return at::scaled_dot_product_attention(q, kk, vv, m, 0.0, use_causal, scale, gqa);
  }
  // Attention dropout inside SDPA draws from torch's RNG, which a replay cannot reproduce from a seed;
  // so with dropout the attention is computed explicitly with our Philox mask. The scores are scaled
  // and masked in place: bmm's backward does not need its output, and each avoided [B, H, S, S]
  // temporary matters.
  const int64_t B = q.size(0), heads = q.size(1), Sk = k.size(2), D = q.size(3);
  const Tensor q3 = q.reshape({B * heads, S, D});
  const Tensor k3 = repeat_kv(k, n_rep).reshape({B * heads, Sk, D});
  const Tensor v3 = repeat_kv(v, n_rep).reshape({B * heads, Sk, v.size(3)});
  Tensor scores = at::bmm(q3, k3.transpose(1, 2));
  scores.mul_(scale);
  Tensor scores4 = scores.view({B, heads, S, Sk});
  // A row with every key masked (queries at left-padded positions) gets what SDPA gives it for a
  // boolean mask -- zeros (_safe_softmax) -- and what an additive mask implies otherwise (Hugging
  // Face's eager masks use the dtype's lowest value: a uniform row). Either way no NaN.
  bool safe = false;
  if (mask.defined()) {
    if (mask.scalar_type() == at::kBool) {
      scores4.masked_fill_(mask.logical_not(), -std::numeric_limits<double>::infinity());
      safe = true;
    } else {
      scores4.add_(mask);
    }
  } else if (use_causal) {
    scores4.masked_fill_(at::ones({S, Sk}, q.options().dtype(at::kBool)).triu(1), lowest_of(scores.scalar_type()));
  }
  // The softmax accumulates in float32, float64 for float64 models (as the ckpt_ext ops do).
  const auto acc = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const Tensor probs = (safe ? at::_safe_softmax(scores, -1, acc) : at::softmax(scores, -1, acc)).to(q.scalar_type());
  return at::bmm(philox_dropout(probs, p, seed, offset), v3).view({B, heads, S, v.size(3)});
}

}  // namespace layers
}  // namespace ckpt_ext
