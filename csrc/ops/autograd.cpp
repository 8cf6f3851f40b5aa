// Autograd kernels of the ckpt_ext forward ops, in C++.
//
// Registered on the Autograd dispatch key, so the ops are differentiable wherever they are called from:
// Python (torch.ops.ckpt_ext.*), and C++ code such as the fused layers, which run without Python. Each
// forward op is a torch::autograd::Function whose forward redispatches below autograd to the CPU/CUDA
// kernel and whose backward calls the matching *_backward op (so fake tensors and tracing see the
// backward as ops too). The formulas are first order: the *_backward ops have no gradient of their own,
// except dropout, which is linear in its input and therefore its own derivative.
//
// Index conventions: ctx->needs_input_grad(i) counts only the tensor arguments that were present in
// forward (an absent optional is no edge); backward returns one entry per forward argument, tensors
// or not, with undefined tensors for the non-differentiable ones.
//
// Copies and casts (reviewed for issue 10.4): the backward kernels here cast nothing and copy nothing
// of their own. What they allocate is what they return: the *_backward ops' outputs, and a bias
// gradient as one row sum (sum_rows: a view of the contiguous kernel output, then one reduction), except
// bias_dropout_add_layer_norm's and bias_gelu's, which their backward kernels sum in the same pass (issue 32). Three
// allocations remain, each needed: (1) the norms' `zeros_like` when only the second output (pre_norm /
// sum) carries a gradient -- the kernels take a dense grad_out, and the layers use both outputs, so
// this path is the rare one of a caller that drops `out`; (2) rotary's `grad * x` and `rotate_half`
// products, only when the cos/sin tables require grad (x is saved only then); (3) the ops' own
// `.contiguous()` on their inputs (ops/checks.h), a no-op for the contiguous gradients autograd hands
// them and a copy only for a strided one, which the kernels could not read.
#include <ATen/core/Tensor.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/neg.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros_like.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <string>
#include <tuple>
#include <utility>

#include "../common/optional.h"
#include "ops.h"

namespace ckpt_ext {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Gradient of a bias broadcast over the last dimension. Sizes are read as SymInts throughout this file:
// under torch.compile, plain sizes() would specialise the traced graph to the example's shape.
Tensor sum_rows(const Tensor& t) { return t.reshape_symint({-1, t.sym_size(-1)}).sum(0); }

// Maps forward argument positions to autograd edge indices (only present tensors are edges).
struct Edges {
  int64_t index[8];
  static Edges of(std::initializer_list<bool> tensor_present) {
    Edges e{};
    int64_t next = 0;
    int64_t i = 0;
    for (bool p : tensor_present) e.index[i++] = p ? next++ : -1;
    return e;
  }
};

bool needs(AutogradContext* ctx, int64_t edge) { return edge >= 0 && ctx->needs_input_grad(edge); }

void store_edges(AutogradContext* ctx, const Edges& e, int64_t n) {
  std::vector<int64_t> v(e.index, e.index + n);
  ctx->saved_data["edges"] = v;
}

std::vector<int64_t> load_edges(AutogradContext* ctx) { return ctx->saved_data.at("edges").toIntVector(); }

// Dropout seeds and offsets are SymInts (symbolic under torch.compile, so that a new seed is no recompilation).
c10::SymInt saved_symint(AutogradContext* ctx, const char* key) { return ctx->saved_data.at(key).toSymInt(); }

// ---- bias_gelu(x, bias?, approximate) ------------------------------------------------------------------------

struct BiasGeluFunction : torch::autograd::Function<BiasGeluFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const OptTensor& bias, c10::string_view approximate) {
    at::AutoDispatchBelowADInplaceOrView below;
    ctx->save_for_backward({x, undefined_if_absent(bias)});
    ctx->saved_data["approximate"] = std::string(approximate);
    store_edges(ctx, Edges::of({true, present(bias)}), 2);
    return ops::bias_gelu(x, bias, approximate);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto e = load_edges(ctx);
    variable_list out(3);
    if (!grads[0].defined() || !(needs(ctx, e[0]) || needs(ctx, e[1]))) return out;
    const OptTensor bias = saved[1].defined() ? OptTensor(saved[1]) : std::nullopt;
    // The bias's gradient from the kernel's own pass over grad_x (column partials), not a second reduction.
    auto [grad_x, grad_bias] = ops::bias_gelu_backward(grads[0], saved[0], bias,
                                                       ctx->saved_data.at("approximate").toStringRef(),
                                                       needs(ctx, e[1]));
    if (needs(ctx, e[1])) out[1] = grad_bias;
    if (needs(ctx, e[0])) out[0] = grad_x;
    return out;
  }
};

// ---- bias_dropout_add(x, bias?, residual, p, seed, offset) ------------------------------------------------------

struct BiasDropoutAddFunction : torch::autograd::Function<BiasDropoutAddFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const OptTensor& bias, const Tensor& residual,
                        double p, c10::SymInt seed, c10::SymInt offset) {
    at::AutoDispatchBelowADInplaceOrView below;
    ctx->saved_data["p"] = p;
    ctx->saved_data["seed"] = seed;
    ctx->saved_data["offset"] = offset;
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
    store_edges(ctx, Edges::of({true, present(bias), true}), 3);
    return ops::bias_dropout_add(x, bias, residual, p, seed, offset);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto e = load_edges(ctx);
    variable_list out(6);
    const Tensor& grad = grads[0];
    if (!grad.defined()) return out;
    if (needs(ctx, e[0]) || needs(ctx, e[1])) {
      // x in a lower precision than the (float32) stream: its gradient is the float one rounded once to x's dtype
      // (what the cast of a float path's x would give), written by the dropout itself unless the bias's gradient
      // needs the float values too.
      const auto x_dtype = static_cast<at::ScalarType>(ctx->saved_data.at("x_dtype").toInt());
      const bool mixed = x_dtype != grad.scalar_type();
      if (ctx->saved_data.at("p").toDouble() == 0 && !mixed && !needs(ctx, e[1])) {
        // No dropout, x in the stream's dtype, no bias gradient (Llama's last linear with a LoRA adapter,
        // last_linear_tail): x's gradient is the incoming one itself, not dropout(p = 0)'s copy of it.
        if (needs(ctx, e[0])) out[0] = grad;
        if (needs(ctx, e[2])) out[2] = grad;
        return out;
      }
      Tensor grad_x = ops::dropout(grad, ctx->saved_data.at("p").toDouble(), saved_symint(ctx, "seed"),
                                   saved_symint(ctx, "offset"),
                                   mixed && !needs(ctx, e[1]) ? std::optional<at::ScalarType>(x_dtype) : std::nullopt);
      if (needs(ctx, e[1])) out[1] = sum_rows(grad_x);
      if (needs(ctx, e[0])) out[0] = grad_x.scalar_type() == x_dtype ? grad_x : grad_x.to(x_dtype);
    }
    if (needs(ctx, e[2])) out[2] = grad;
    return out;
  }
};

// ---- dropout(x, p, seed, offset): linear in x, so its gradient is itself ---------------------------------------

// With dtype (a float32 x, a lower-precision result): out = round(dropout(x)), whose gradient is the dropout of
// the incoming gradient in float32.
struct DropoutFunction : torch::autograd::Function<DropoutFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, double p, c10::SymInt seed, c10::SymInt offset,
                        std::optional<at::ScalarType> dtype) {
    at::AutoDispatchBelowADInplaceOrView below;
    ctx->saved_data["p"] = p;
    ctx->saved_data["seed"] = seed;
    ctx->saved_data["offset"] = offset;
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
    return ops::dropout(x, p, seed, offset, dtype);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list out(5);
    if (grads[0].defined() && ctx->needs_input_grad(0)) {
      const auto x_dtype = static_cast<at::ScalarType>(ctx->saved_data.at("x_dtype").toInt());
      const Tensor g = grads[0].scalar_type() == x_dtype ? grads[0] : grads[0].to(x_dtype);
      out[0] = ops::dropout(g, ctx->saved_data.at("p").toDouble(), saved_symint(ctx, "seed"),
                            saved_symint(ctx, "offset"));
    }
    return out;
  }
};

// ---- bias_dropout_add_layer_norm(x, bias?, residual, weight, ln_bias?, p, eps, seed, offset) ---------------------

struct BiasDropoutAddLayerNormFunction : torch::autograd::Function<BiasDropoutAddLayerNormFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const OptTensor& bias, const Tensor& residual,
                               const Tensor& weight, const OptTensor& ln_bias, double p, double eps,
                               c10::SymInt seed, c10::SymInt offset, std::optional<at::ScalarType> out_dtype,
                               std::optional<at::ScalarType> out2_dtype, bool fanout) {
    at::AutoDispatchBelowADInplaceOrView below;
    // out in out_dtype (ops.h): its gradient comes in that dtype, which the backward op reads as float. out2_dtype
    // (the dual op): out also written in it, a sixth output, whose gradient the backward op adds in float. fanout
    // (bias_dropout_add_layer_norm_fanout, ops.h): out handed out a second time, as an alias (the sixth output).
    Tensor out, out2, pre_norm, mean, rstd, keep_bits;
    if (out2_dtype.has_value())
      std::tie(out, out2, pre_norm, mean, rstd, keep_bits) =
          ops::bias_dropout_add_layer_norm_dual(x, bias, residual, weight, ln_bias, p, eps, seed, offset, *out2_dtype);
    else
      std::tie(out, pre_norm, mean, rstd, keep_bits) =
          ops::bias_dropout_add_layer_norm(x, bias, residual, weight, ln_bias, p, eps, seed, offset, out_dtype);
    ctx->saved_data["p"] = p;
    ctx->saved_data["seed"] = seed;
    ctx->saved_data["offset"] = offset;
    // x may be in a lower-precision dtype than the stream (ops.h): its gradient is written in x's dtype.
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
    store_edges(ctx, Edges::of({true, present(bias), true, true, present(ln_bias)}), 5);
    // keep_bits: the CPU kernel's mask, 1 bit per element (empty elsewhere): the backward reads it instead
    // of running Philox again.
    ctx->save_for_backward({pre_norm, weight, mean, rstd, keep_bits});
    ctx->mark_non_differentiable({mean, rstd, keep_bits});
    ctx->set_materialize_grads(false);
    if (out2.defined()) return {out, pre_norm, mean, rstd, keep_bits, out2};
    if (fanout) return {out, pre_norm, mean, rstd, keep_bits, out.alias()};
    return {out, pre_norm, mean, rstd, keep_bits};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto e = load_edges(ctx);
    variable_list out(12);
    // out2's gradient (the dual op; fanout: the alias's), added to out's by the backward op.
    Tensor g0 = grads[0], g5 = grads.size() > 5 ? grads[5] : Tensor();
    if (!g0.defined()) std::swap(g0, g5);
    if (!g0.defined() && !grads[1].defined()) return out;
    const Tensor& pre_norm = saved[0];
    const Tensor grad_out = g0.defined() ? g0 : at::zeros_like(pre_norm);
    const OptTensor grad_pre = grads[1].defined() ? OptTensor(grads[1]) : std::nullopt;
    // The dense bias's gradient comes from the kernel's own pass over grad_x (column partials).
    auto [grad_x, grad_residual, grad_weight, grad_ln_bias, grad_bias] = ops::bias_dropout_add_layer_norm_backward(
        grad_out, grad_pre, pre_norm, saved[1], saved[2], saved[3], ctx->saved_data.at("p").toDouble(),
        saved_symint(ctx, "seed"), saved_symint(ctx, "offset"), saved[4], needs(ctx, e[1]),
        static_cast<at::ScalarType>(ctx->saved_data.at("x_dtype").toInt()),
        g5.defined() ? OptTensor(g5) : std::nullopt);
    if (needs(ctx, e[1])) out[1] = grad_bias;
    if (needs(ctx, e[0])) out[0] = grad_x;
    if (needs(ctx, e[2])) out[2] = grad_residual;
    if (needs(ctx, e[3])) out[3] = grad_weight;
    if (needs(ctx, e[4])) out[4] = grad_ln_bias;
    return out;
  }
};

// ---- add_layer_norm(x, residual?, weight, bias?, eps) -------------------------------------------------------------

struct AddLayerNormFunction : torch::autograd::Function<AddLayerNormFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const OptTensor& residual, const Tensor& weight,
                               const OptTensor& bias, double eps) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [out, sum, mean, rstd] = ops::add_layer_norm(x, residual, weight, bias, eps);
    store_edges(ctx, Edges::of({true, present(residual), true, present(bias)}), 4);
    ctx->save_for_backward({sum, weight, mean, rstd});
    ctx->mark_non_differentiable({mean, rstd});
    ctx->set_materialize_grads(false);
    return {out, sum, mean, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto e = load_edges(ctx);
    variable_list out(5);
    if (!grads[0].defined() && !grads[1].defined()) return out;
    const Tensor& sum = saved[0];
    const Tensor grad_out = grads[0].defined() ? grads[0] : at::zeros_like(sum);
    const OptTensor grad_sum = grads[1].defined() ? OptTensor(grads[1]) : std::nullopt;
    auto [grad_input, grad_weight, grad_bias] =
        ops::add_layer_norm_backward(grad_out, grad_sum, sum, saved[1], saved[2], saved[3]);
    if (needs(ctx, e[0])) out[0] = grad_input;
    if (needs(ctx, e[1])) out[1] = grad_input;
    if (needs(ctx, e[2])) out[2] = grad_weight;
    if (needs(ctx, e[3])) out[3] = grad_bias;
    return out;
  }
};

// ---- add_rms_norm(x, residual?, weight, eps) ------------------------------------------------------------------------

struct AddRmsNormFunction : torch::autograd::Function<AddRmsNormFunction> {
  // fanout (add_rms_norm_fanout, ops.h): out handed out a second time, as an alias (a fourth output).
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const OptTensor& residual, const Tensor& weight,
                               double eps, std::optional<at::ScalarType> out_dtype, bool fanout) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [out, sum, rstd] = ops::add_rms_norm(x, residual, weight, eps, out_dtype);
    // x may be in a lower-precision dtype than the stream (ops.h): its gradient is returned in x's dtype.
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
    store_edges(ctx, Edges::of({true, present(residual), true}), 3);
    ctx->save_for_backward({sum, weight, rstd});
    ctx->mark_non_differentiable({rstd});
    ctx->set_materialize_grads(false);
    if (fanout) return {out, sum, rstd, out.alias()};
    return {out, sum, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto e = load_edges(ctx);
    variable_list out(6);
    // The second handle's gradient (fanout), added to out's in float by the backward op.
    Tensor g0 = grads[0], g3 = grads.size() > 3 ? grads[3] : Tensor();
    if (!g0.defined()) std::swap(g0, g3);
    if (!g0.defined() && !grads[1].defined()) return out;
    const Tensor& sum = saved[0];
    const Tensor grad_out = g0.defined() ? g0 : at::zeros_like(sum);
    const OptTensor grad_sum = grads[1].defined() ? OptTensor(grads[1]) : std::nullopt;
    auto [grad_input, grad_weight] = ops::add_rms_norm_backward(grad_out, grad_sum, sum, saved[1], saved[2],
                                                                g3.defined() ? OptTensor(g3) : std::nullopt);
    const auto x_dtype = static_cast<at::ScalarType>(ctx->saved_data.at("x_dtype").toInt());
    // A mixed x: its gradient rounded once from the float one (a cast pass, as autograd's ToCopyBackward).
    if (needs(ctx, e[0])) out[0] = x_dtype == grad_input.scalar_type() ? grad_input : grad_input.to(x_dtype);
    if (needs(ctx, e[1])) out[1] = grad_input;
    if (needs(ctx, e[2])) out[2] = grad_weight;
    return out;
  }
};

// ---- swiglu(gate, up) ------------------------------------------------------------------------------------------------

struct SwigluFunction : torch::autograd::Function<SwigluFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& gate, const Tensor& up) {
    at::AutoDispatchBelowADInplaceOrView below;
    ctx->save_for_backward({gate, up});
    return ops::swiglu(gate, up);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list out(2);
    if (!grads[0].defined() || !(ctx->needs_input_grad(0) || ctx->needs_input_grad(1))) return out;
    const auto saved = ctx->get_saved_variables();
    auto [grad_gate, grad_up] = ops::swiglu_backward(grads[0], saved[0], saved[1]);
    if (ctx->needs_input_grad(0)) out[0] = grad_gate;
    if (ctx->needs_input_grad(1)) out[1] = grad_up;
    return out;
  }
};

// ---- geglu(gate, up, approximate) ----------------------------------------------------------------------------------

struct GegluFunction : torch::autograd::Function<GegluFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& gate, const Tensor& up, c10::string_view approximate) {
    at::AutoDispatchBelowADInplaceOrView below;
    ctx->save_for_backward({gate, up});
    ctx->saved_data["approximate"] = std::string(approximate);
    return ops::geglu(gate, up, approximate);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list out(3);
    if (!grads[0].defined() || !(ctx->needs_input_grad(0) || ctx->needs_input_grad(1))) return out;
    const auto saved = ctx->get_saved_variables();
    const std::string approximate = ctx->saved_data["approximate"].toStringRef();
    auto [grad_gate, grad_up] = ops::geglu_backward(grads[0], saved[0], saved[1], approximate);
    if (ctx->needs_input_grad(0)) out[0] = grad_gate;
    if (ctx->needs_input_grad(1)) out[1] = grad_up;
    return out;
  }
};

// ---- rotary(x, cos, sin) -------------------------------------------------------------------------------------------

Tensor rotate_half(const Tensor& x) {
  const auto halves = x.chunk(2, -1);
  return at::cat({halves[1].neg(), halves[0]}, -1);
}

// Sums a [B, H, S, D] product over the dims that `like` ([B or 1, S, D] or [S, D]) broadcasts, in one
// reduction: one rounding in low precision, as autograd's sum_to_size (two sums in a row round twice).
Tensor reduce_to(const Tensor& t, const Tensor& like) {
  if (like.dim() == 2) return t.sum(at::IntArrayRef{0, 1});
  return like.sym_size(0) == 1 ? t.sum(at::IntArrayRef{0, 1}).unsqueeze(0) : t.sum(1);
}

struct RotaryFunction : torch::autograd::Function<RotaryFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& cos, const Tensor& sin) {
    at::AutoDispatchBelowADInplaceOrView below;
    // x is needed only for the (rare) gradients of the cos/sin tables.
    const bool tables_need_grad = cos.requires_grad() || sin.requires_grad();
    ctx->save_for_backward({tables_need_grad ? x : Tensor(), cos, sin});
    return ops::rotary(x, cos, sin);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list out(3);
    const Tensor& grad = grads[0];
    if (!grad.defined()) return out;
    const auto saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &cos = saved[1], &sin = saved[2];
    if (ctx->needs_input_grad(0)) out[0] = ops::rotary_backward(grad, cos, sin);
    if (ctx->needs_input_grad(1)) out[1] = reduce_to(grad * x, cos);
    if (ctx->needs_input_grad(2)) out[2] = reduce_to(grad * rotate_half(x), sin);
    return out;
  }
};

// ---- Autograd kernels ----------------------------------------------------------------------------------------------

Tensor bias_gelu_autograd(const Tensor& x, const OptTensor& bias, c10::string_view approximate) {
  return BiasGeluFunction::apply(x, bias, approximate);
}

Tensor bias_dropout_add_autograd(const Tensor& x, const OptTensor& bias, const Tensor& residual, double p,
                                 c10::SymInt seed, c10::SymInt offset) {
  return BiasDropoutAddFunction::apply(x, bias, residual, p, seed, offset);
}

Tensor dropout_autograd(const Tensor& x, double p, c10::SymInt seed, c10::SymInt offset,
                        std::optional<at::ScalarType> dtype) {
  return DropoutFunction::apply(x, p, seed, offset, dtype);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> bias_dropout_add_layer_norm_autograd(
    const Tensor& x, const OptTensor& bias, const Tensor& residual, const Tensor& weight, const OptTensor& ln_bias,
    double p, double eps, c10::SymInt seed, c10::SymInt offset, std::optional<at::ScalarType> out_dtype) {
  auto r = BiasDropoutAddLayerNormFunction::apply(x, bias, residual, weight, ln_bias, p, eps, seed, offset, out_dtype,
                                                  std::nullopt, false);
  return {r[0], r[1], r[2], r[3], r[4]};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> bias_dropout_add_layer_norm_dual_autograd(
    const Tensor& x, const OptTensor& bias, const Tensor& residual, const Tensor& weight, const OptTensor& ln_bias,
    double p, double eps, c10::SymInt seed, c10::SymInt offset, at::ScalarType out2_dtype) {
  auto r = BiasDropoutAddLayerNormFunction::apply(x, bias, residual, weight, ln_bias, p, eps, seed, offset,
                                                  std::nullopt, std::optional<at::ScalarType>(out2_dtype), false);
  return {r[0], r[5], r[1], r[2], r[3], r[4]};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> add_layer_norm_autograd(const Tensor& x, const OptTensor& residual,
                                                                   const Tensor& weight, const OptTensor& bias,
                                                                   double eps) {
  auto r = AddLayerNormFunction::apply(x, residual, weight, bias, eps);
  return {r[0], r[1], r[2], r[3]};
}

std::tuple<Tensor, Tensor, Tensor> add_rms_norm_autograd(const Tensor& x, const OptTensor& residual,
                                                         const Tensor& weight, double eps,
                                                         std::optional<at::ScalarType> out_dtype) {
  auto r = AddRmsNormFunction::apply(x, residual, weight, eps, out_dtype, false);
  return {r[0], r[1], r[2]};
}

Tensor swiglu_autograd(const Tensor& gate, const Tensor& up) { return SwigluFunction::apply(gate, up); }

Tensor geglu_autograd(const Tensor& gate, const Tensor& up, c10::string_view approximate) {
  return GegluFunction::apply(gate, up, approximate);
}

Tensor rotary_autograd(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  return RotaryFunction::apply(x, cos, sin);
}

}  // namespace

namespace ops {

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> bias_dropout_add_layer_norm_fanout(
    const Tensor& x, const OptTensor& bias, const Tensor& residual, const Tensor& weight, const OptTensor& ln_bias,
    double p, double eps, int64_t seed, int64_t offset) {
  auto r = BiasDropoutAddLayerNormFunction::apply(x, bias, residual, weight, ln_bias, p, eps, c10::SymInt(seed),
                                                  c10::SymInt(offset), std::nullopt, std::nullopt, true);
  return {r[0], r[5], r[1], r[2], r[3], r[4]};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> add_rms_norm_fanout(const Tensor& x, const OptTensor& residual,
                                                               const Tensor& weight, double eps,
                                                               at::ScalarType out_dtype) {
  auto r = AddRmsNormFunction::apply(x, residual, weight, eps, std::optional<at::ScalarType>(out_dtype), true);
  return {r[0], r[3], r[1], r[2]};
}

}  // namespace ops
}  // namespace ckpt_ext

TORCH_LIBRARY_IMPL(ckpt_ext, Autograd, m) {
  m.impl("bias_gelu", &ckpt_ext::bias_gelu_autograd);
  m.impl("bias_dropout_add", &ckpt_ext::bias_dropout_add_autograd);
  m.impl("dropout", &ckpt_ext::dropout_autograd);
  m.impl("bias_dropout_add_layer_norm", &ckpt_ext::bias_dropout_add_layer_norm_autograd);
  m.impl("bias_dropout_add_layer_norm_dual", &ckpt_ext::bias_dropout_add_layer_norm_dual_autograd);
  m.impl("add_layer_norm", &ckpt_ext::add_layer_norm_autograd);
  m.impl("add_rms_norm", &ckpt_ext::add_rms_norm_autograd);
  m.impl("swiglu", &ckpt_ext::swiglu_autograd);
  m.impl("geglu", &ckpt_ext::geglu_autograd);
  m.impl("rotary", &ckpt_ext::rotary_autograd);
}
