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

ResidualLinearGrads residual_linear_backward(const Tensor& grad, const Tensor& x, const LastLinear& lin, int64_t seed,
                                             bool need_x, bool need_weight, bool need_bias) {
  ResidualLinearGrads r;
  if (!(need_x || need_weight || need_bias)) return r;
  // The GEMMs run in x's dtype, as in forward (autocast: the weight cast down, its gradient cast back
  // to the parameter's dtype, as autograd does for Hugging Face's layer); the bias gradient is summed
  // from the incoming gradient in the stream's dtype. The dropout writes the GEMMs' dtype itself where
  // the float values are not needed for the bias (one pass instead of a dropout and a cast).
  const auto cdt = x.scalar_type();
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
  if (need_x) {
    const Tensor w = in_dtype(lin.weight, cdt);
    r.x = (lin.conv1d ? gemm_mm(gc, w.t()) : gemm_mm(gc, w)).view(x.sizes());
  }
  if (need_weight) {
    const Tensor x2d = x.reshape({-1, x.size(-1)});
    r.weight = in_dtype(lin.conv1d ? gemm_mm(x2d.t(), gc) : gemm_mm(gc.t(), x2d), lin.weight.scalar_type());
  }
  if (need_bias) r.bias = g2d.sum(0);
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
