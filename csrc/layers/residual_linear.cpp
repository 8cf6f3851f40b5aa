// The last linear of a GPT-2/Llama layer with its residual: out = residual + dropout(x W + b), an
// autograd node of its own (ResidualLinearFunction), so that the segment replay can compute its
// gradients without running it (replay_backward calls residual_linear_backward directly).
//
// Under autocast (float32 parameters, bfloat16/float16 GEMMs) the GEMM's output joins the float32 stream
// without a cast of its own: ops::bias_dropout_add reads the lower-precision x beside the float32 residual and
// computes in float (the bits of casting first), and the backward's dropout writes its result in the GEMMs'
// dtype (the bits of dropping, then casting). _C.mixed_dtype_residual(false) restores the casts (A/B tests).
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <atomic>
#include <tuple>

#include "../ops/ops.h"
#include "family.h"

namespace ckpt_ext {
namespace layers {

namespace {

std::atomic<bool>& mixed_residual() {
  static std::atomic<bool> on{true};
  return on;
}

// `t` in `dtype`: a no-op outside autocast. Under autocast the last linear's input is in the autocast
// dtype (it comes from GEMMs) while its weight and the residual stream keep the parameters' dtype.
Tensor in_dtype(const Tensor& t, at::ScalarType dtype) { return t.scalar_type() == dtype ? t : t.to(dtype); }

bool lowp(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

// Whether a GEMM output of dtype `y` joins a stream of dtype `stream` as it is (the ops read it beside the
// float32 stream), rather than cast to the stream's dtype first.
bool joins_as_is(at::ScalarType y, at::ScalarType stream) {
  return y == stream || (lowp(y) && stream == at::kFloat && mixed_residual().load());
}

// The GEMM's output `y` as bias_dropout_add's x beside `stream`.
Tensor join_stream(const Tensor& y, const Tensor& stream) {
  return joins_as_is(y.scalar_type(), stream.scalar_type()) ? y : y.to(stream.scalar_type());
}

// x @ W^T (Linear) or x @ W (Conv1D) on the 2-D view of x, without bias (the bias is fused into the
// dropout-residual kernel). Computed in x's dtype -- the autocast dtype under autocast, as autocast's
// mm would -- explicitly, so that the node's backward (which runs outside autocast) and the segment
// replay compute the same thing.
Tensor matmul_2d(const Tensor& x, const LastLinear& lin) {
  const Tensor x2d = x.reshape({-1, x.size(-1)});
  const Tensor w = in_dtype(lin.weight, x.scalar_type());
  return lin.conv1d ? gemm_mm(x2d, w) : gemm_mm(x2d, w.t());
}


struct ResidualLinearFunction : torch::autograd::Function<ResidualLinearFunction> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& x, const Tensor& weight,
                        const std::optional<Tensor>& bias, const Tensor& residual, bool conv1d, double p,
                        int64_t seed, int64_t offset, const KeptTensor& kept) {
    LastLinear lin{weight, bias.has_value() ? *bias : Tensor(), conv1d, p, offset, -1, -1};
    // A recompute level's replay: the GEMM's output kept in forward (KeptGemms), no GEMM.
    Tensor y2d = kept.t;
    if (!y2d.defined()) {
      y2d = matmul_2d(x, lin);
      record_gemm(KeptGemms::kLastLinear, y2d);  // a recompute level's forward keeps it
    }
    // The GEMM's output joins the residual stream in the stream's dtype (Hugging Face's residual add
    // promotes the same way under autocast), read as it is by the op (join_stream).
    const Tensor y = join_stream(y2d.view(residual.sizes()), residual);
    ctx->save_for_backward({x, weight});
    ctx->saved_data["conv1d"] = conv1d;
    ctx->saved_data["has_bias"] = lin.bias.defined();
    ctx->saved_data["p"] = p;
    ctx->saved_data["seed"] = seed;
    ctx->saved_data["offset"] = offset;
    // Grad mode is off inside Function::forward, so this records nothing of its own.
    return ops::bias_dropout_add(y, opt(lin.bias), residual, p, seed, offset);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const bool has_bias = ctx->saved_data.at("has_bias").toBool();
    LastLinear lin{saved[1], Tensor(), ctx->saved_data.at("conv1d").toBool(), ctx->saved_data.at("p").toDouble(),
                   ctx->saved_data.at("offset").toInt(), -1, -1};
    torch::autograd::variable_list out(9);
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
  const Tensor kept = kept_gemm(KeptGemms::kLastLinear);
  if (kept.defined()) {
    TORCH_CHECK(kept.dim() == 2 && kept.size(0) * kept.size(1) == residual.numel() && kept.scalar_type() == x.scalar_type(),
                "ckpt_ext fused segment: the last linear's output kept in forward (", kept.sizes(), ") does not match "
                "the replay's; the replay must run the layers as forward did");
  }
  return ResidualLinearFunction::apply(x, lin.weight, opt(lin.bias), residual, lin.conv1d, lin.p, seed, lin.offset,
                                       KeptTensor{kept});
}

namespace {

// The incoming gradient through the last linear's dropout: {g2d (the stream's dtype, 2-D; undefined when only gc is
// needed), gc (the GEMMs' dtype `cdt`, 2-D)}. The GEMMs run in x's dtype, as in forward (autocast: the weight cast
// down, its gradient cast back to the parameter's dtype, as autograd does for Hugging Face's layer); the bias
// gradient is summed from the incoming gradient in the stream's dtype. The dropout writes the GEMMs' dtype itself
// where the float values are not needed for the bias (one pass instead of a dropout and a cast).
std::pair<Tensor, Tensor> dropped_grad(const Tensor& grad, at::ScalarType cdt, const LastLinear& lin, int64_t seed,
                                       bool need_bias) {
  const bool drop_into_cdt = lin.p > 0 && !need_bias && cdt != grad.scalar_type() &&
                             joins_as_is(cdt, grad.scalar_type());
  Tensor g2d, gc;
  if (drop_into_cdt) {
    gc = ops::dropout(grad, lin.p, seed, lin.offset, cdt);
    gc = gc.reshape({-1, gc.size(-1)});
  } else {
    const Tensor g = lin.p > 0 ? ops::dropout(grad, lin.p, seed, lin.offset) : grad;
    g2d = g.reshape({-1, g.size(-1)});
    gc = in_dtype(g2d, cdt);
  }
  return {g2d, gc};
}

// The last linear's weight gradient from its input x and the gradient gc (dropped_grad).
Tensor weight_grad(const Tensor& gc, const Tensor& x, const LastLinear& lin) {
  const Tensor x2d = x.reshape({-1, x.size(-1)});
  return in_dtype(lin.conv1d ? gemm_mm(x2d.t(), gc) : gemm_mm(gc.t(), x2d), lin.weight.scalar_type());
}

}  // namespace

ResidualLinearGrads residual_linear_backward(const Tensor& grad, const Tensor& x, const LastLinear& lin, int64_t seed,
                                             bool need_x, bool need_weight, bool need_bias) {
  ResidualLinearGrads r;
  if (!(need_x || need_weight || need_bias)) return r;
  const auto cdt = x.scalar_type();
  const auto [g2d, gc] = dropped_grad(grad, cdt, lin, seed, need_bias);
  if (need_x) {
    const Tensor w = in_dtype(lin.weight, cdt);
    r.x = (lin.conv1d ? gemm_mm(gc, w.t()) : gemm_mm(gc, w)).view(x.sizes());
  }
  if (need_weight) r.weight = weight_grad(gc, x, lin);
  if (need_bias) r.bias = g2d.sum(0);
  return r;
}

// ---- the replay's tail from before the activation (issue 33) -------------------------------------------------------

namespace {

const char* gelu_kind(bool tanh) { return tanh ? "tanh" : "none"; }

// The activation of `a`, `b` run forward (no grad), as the layer ran it.
Tensor activation_forward(StoppedActivation::Kind kind, bool tanh, const Tensor& a, const Tensor& b) {
  switch (kind) {
    case StoppedActivation::kSwiglu: return ops::swiglu(a, b);
    case StoppedActivation::kGeglu: return ops::geglu(a, b, gelu_kind(tanh));
    default: return ops::bias_gelu(a, opt(b), gelu_kind(tanh));
  }
}

// The activation's backward from d_act = the gradient of its output, in place (the _act_ ops, one pass): d_act
// becomes that output (the forward's bits); returns the gradients of a and b (undefined b: none), which are a and b
// themselves for the GLUs (overwritten: the replay's own tensors, which nothing reads after this node) and d_act's
// old memory for bias-GELU (a then holds the activation). `act` is set to the activation.
std::tuple<Tensor, Tensor> activation_backward_writing_act(StoppedActivation::Kind kind, bool tanh, Tensor d_act,
                                                           Tensor a, Tensor b, bool need_b, Tensor* act) {
  if (!d_act.is_contiguous()) d_act = d_act.contiguous();
  if (!a.is_contiguous()) a = a.contiguous();
  if (kind == StoppedActivation::kBiasGelu) {
    Tensor db = ops::bias_gelu_backward_act_(d_act, a, opt(b), gelu_kind(tanh), need_b);
    *act = a;
    return {d_act, need_b ? db : Tensor()};
  }
  if (!b.is_contiguous()) b = b.contiguous();
  if (kind == StoppedActivation::kSwiglu)
    ops::swiglu_backward_act_(d_act, a, b);
  else
    ops::geglu_backward_act_(d_act, a, b, gelu_kind(tanh));
  *act = d_act;
  return {a, b};
}

// A broadcast scalar of t's shape and dtype, never read (no kernel: not even a fill).
Tensor nothing_like(const Tensor& t) { return at::empty({}, t.options()).expand(t.sizes()); }

// out = residual + dropout(act(a, b) @ W + bias) from the replay stopped before the activation: an autograd node
// that computes nothing in forward (its output is a broadcast scalar of the residual's shape, never read, a root of
// the replay's autograd::grad; the residual's own gradient is the root's gradient, given apart) and whose backward
// computes what ResidualLinearFunction's and the activation's nodes compute in the layer run whole, the same ops on
// the same values: the last linear's input gradient d_act = g W, the activation's backward also writing act (in
// place: activation_backward_writing_act), then W's gradient from act and the bias's from g. Tensor arguments (b,
// bias may be absent): a, b, weight, bias, and the residual (detached: its shape and dtype only).
struct ActTailFunction : torch::autograd::Function<ActTailFunction> {
  // (b, bias: optional, as undefined tensors cannot be a node's inputs)
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& a, const std::optional<Tensor>& b,
                        const Tensor& weight, const std::optional<Tensor>& bias, const Tensor& residual, int64_t kind,
                        bool tanh, bool conv1d, double p, int64_t seed, int64_t offset) {
    ctx->save_for_backward({a, b.has_value() ? *b : Tensor(), weight});
    ctx->saved_data["kind"] = kind;
    ctx->saved_data["tanh"] = tanh;
    ctx->saved_data["conv1d"] = conv1d;
    ctx->saved_data["has_b"] = b.has_value();
    ctx->saved_data["has_bias"] = bias.has_value();
    ctx->saved_data["p"] = p;
    ctx->saved_data["seed"] = seed;
    ctx->saved_data["offset"] = offset;
    return nothing_like(residual);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    torch::autograd::variable_list out(11);
    const Tensor& grad = grads[0];
    if (!grad.defined()) return out;
    const auto saved = ctx->get_saved_variables();
    const Tensor &a = saved[0], &b = saved[1], &weight = saved[2];
    const auto kind = static_cast<StoppedActivation::Kind>(ctx->saved_data.at("kind").toInt());
    const bool tanh = ctx->saved_data.at("tanh").toBool();
    // Edges (needs_input_grad's numbering): a, b (if present), weight, bias (if present); outputs: by argument.
    const bool has_b = ctx->saved_data.at("has_b").toBool();
    const bool need_a = ctx->needs_input_grad(0), need_b = has_b && ctx->needs_input_grad(1);
    const bool need_w = ctx->needs_input_grad(has_b ? 2 : 1);
    const bool need_bias = ctx->saved_data.at("has_bias").toBool() && ctx->needs_input_grad(has_b ? 3 : 2);
    if (!(need_a || need_b || need_w || need_bias)) return out;
    const LastLinear lin{weight, Tensor(), ctx->saved_data.at("conv1d").toBool(), ctx->saved_data.at("p").toDouble(),
                         ctx->saved_data.at("offset").toInt(), -1, -1};
    const auto cdt = a.scalar_type();
    const auto [g2d, gc] = dropped_grad(grad, cdt, lin, ctx->saved_data.at("seed").toInt(), need_bias);
    Tensor act;
    if (need_a || need_b) {
      const Tensor w = in_dtype(weight, cdt);
      Tensor d_act = (lin.conv1d ? gemm_mm(gc, w.t()) : gemm_mm(gc, w)).view(a.sizes());
      std::tie(out[0], out[1]) = activation_backward_writing_act(kind, tanh, std::move(d_act), a, b, need_b, &act);
      if (!need_a) out[0] = Tensor();
      if (!need_b) out[1] = Tensor();
    } else if (need_w) {
      act = activation_forward(kind, tanh, a, b);
    }
    if (need_w) out[2] = weight_grad(gc, act, lin);
    act = Tensor();
    if (need_bias) out[3] = g2d.sum(0);
    return out;
  }
};

}  // namespace

bool tail_activation_in_backward(std::optional<bool> set) {
  static std::atomic<bool> on{true};
  return set.has_value() ? on.exchange(*set) : on.load(std::memory_order_relaxed);
}

ReplayBackward last_linear_act_backward(const LastLinear& lin, const StoppedActivation& act, const Tensor& residual,
                                        const Tensor& grad_out, int64_t seed) {
  ReplayBackward r;
  r.outputs.push_back(ActTailFunction::apply(act.a, opt(act.b), lin.weight, opt(lin.bias), residual.detach(),
                                             static_cast<int64_t>(act.kind), act.tanh, lin.conv1d, lin.p, seed,
                                             lin.offset));
  r.grads.push_back(grad_out);
  if (!r.outputs.back().requires_grad()) {  // nothing to differentiate through it
    r.outputs.clear();
    r.grads.clear();
  }
  if (residual.requires_grad()) {
    r.outputs.push_back(residual);
    r.grads.push_back(grad_out);
  }
  return r;
}

LayerOutput last_linear_tail(const LayerSpec& s, const std::vector<Tensor>& w, const LayerRng& rng,
                             const LastLinear& lin, const Tensor& act, const Tensor& h1, const Tensor& out_slot,
                             bool stop, const Tensor& lora) {
  LayerOutput r;
  if (stop && !lora.defined()) {
    r.last_input = act;
    r.residual = h1;
    return r;
  }
  if (!out_slot.defined() && !lora.defined()) {
    r.out = residual_linear(act, lin, h1, rng.seed);
    return r;
  }
  // Under no_grad into out_slot, or with an adapter: the GEMM (and adapter term) then the fused
  // bias-dropout-residual op, differentiated by autograd when grad mode is on.
  const Tensor y = join_stream(plus_lora(matmul_2d(act, lin).view(h1.sizes()), lora), h1);
  if (out_slot.defined()) {
    ops::bias_dropout_add_into(y, opt(lin.bias), h1, lin.p, rng.seed, lin.offset, out_slot);
    r.out = out_slot;
  } else {
    r.out = ops::bias_dropout_add(y, opt(lin.bias), h1, lin.p, rng.seed, lin.offset);
  }
  return r;
}

bool mixed_dtype_residual(std::optional<bool> set) {
  return set.has_value() ? mixed_residual().exchange(*set) : mixed_residual().load();
}

}  // namespace layers
}  // namespace ckpt_ext
