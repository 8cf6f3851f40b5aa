// torch.library ops of the fused-layer building blocks: schemas, argument checks, output allocation.
//
// This file is the only caller of the kernels in kernels/fused_kernels.h. Each op checks its arguments
// once, for every backend, then launches the CPU or CUDA kernel of the input's device. Inputs that are
// not contiguous are made contiguous here (a copy only when needed); rotary only needs a contiguous last
// dimension, so the usual transposed [B, S, H, D] -> [B, H, S, D] views of q and k are read in place.
// Outputs are contiguous, except rotary's, which are laid out like their input (torch.empty_like).
// The ops are pure functions of (inputs, weights, dropout seed/offset): no state, no global generator.
//
// Autograd kernels: fused_autograd.cpp (C++, so that C++ code gets gradients without Python). Fake
// (meta) kernels: ckpt_ext/ops.py. C++ callers use the dispatcher entry points declared in fused_ops.h.
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "../kernels/fused_kernels.h"
#include "fused_ops.h"

namespace ckpt_ext {
namespace {

using at::Tensor;
using kernels::DropoutArgs;
using OptTensor = std::optional<Tensor>;

#ifdef CKPT_EXT_WITH_CUDA
#define CKPT_EXT_LAUNCH(device, kernel, ...) \
  ((device).is_cuda() ? kernels::cuda::kernel(__VA_ARGS__) : kernels::cpu::kernel(__VA_ARGS__))
#else
#define CKPT_EXT_LAUNCH(device, kernel, ...) kernels::cpu::kernel(__VA_ARGS__)
#endif

// ---- argument checks (messages name the op and the argument) --------------------------------------------

void check_floating(const char* op, const char* name, const Tensor& t) {
  const auto dt = t.scalar_type();
  const bool lowp_or_float = dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16;
  if (t.is_cuda()) {
    TORCH_CHECK(lowp_or_float, "ckpt_ext::", op, ": CUDA kernels support float32, float16 and bfloat16; ", name,
                " has dtype ", dt);
  } else {
    TORCH_CHECK(t.is_cpu(), "ckpt_ext::", op, ": ", name, " must be a CPU or CUDA tensor, got device ", t.device());
    TORCH_CHECK(lowp_or_float || dt == at::kDouble, "ckpt_ext::", op,
                ": CPU kernels support float32, float64, float16 and bfloat16; ", name, " has dtype ", dt);
  }
}

// `t` must match `ref` in device and dtype (weights included: cast them with .to(x.dtype)).
void check_like(const char* op, const char* name, const Tensor& t, const char* ref_name, const Tensor& ref) {
  TORCH_CHECK(t.device() == ref.device(), "ckpt_ext::", op, ": ", name, " must be on the device of ", ref_name, " (",
              ref.device(), "), got ", t.device());
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), "ckpt_ext::", op, ": ", name, " must have the dtype of ",
              ref_name, " (", ref.scalar_type(), "), got ", t.scalar_type(), "; cast it with .to(", ref_name,
              ".dtype)");
}

void check_same_shape(const char* op, const char* name, const Tensor& t, const char* ref_name, const Tensor& ref) {
  check_like(op, name, t, ref_name, ref);
  TORCH_CHECK(t.sizes() == ref.sizes(), "ckpt_ext::", op, ": ", name, " must have the shape of ", ref_name, " ",
              ref.sizes(), ", got ", t.sizes());
}

// A per-feature vector (bias, weight) of length `hidden`.
void check_vector(const char* op, const char* name, const Tensor& t, int64_t hidden, const char* ref_name,
                  const Tensor& ref) {
  check_like(op, name, t, ref_name, ref);
  TORCH_CHECK(t.dim() == 1 && t.size(0) == hidden, "ckpt_ext::", op, ": ", name,
              " must be 1-D of size ", hidden, " (the last dimension of ", ref_name, "), got shape ", t.sizes());
}

void check_at_least_1d(const char* op, const char* name, const Tensor& t) {
  TORCH_CHECK(t.dim() >= 1, "ckpt_ext::", op, ": ", name, " must have at least one dimension (features last)");
}

void check_p(const char* op, double p) {
  TORCH_CHECK(p >= 0.0 && p <= 1.0, "ckpt_ext::", op, ": dropout probability p must be in [0, 1], got ", p);
}

bool parse_approximate(const char* op, c10::string_view approximate) {
  TORCH_CHECK(approximate == "none" || approximate == "tanh", "ckpt_ext::", op,
              ": approximate must be 'none' or 'tanh', got '", std::string(approximate), "'");
  return approximate == "tanh";
}

// Contiguous copy of an optional tensor, or an undefined tensor when it is absent.
Tensor contiguous_or_undefined(const OptTensor& t) {
  return t.has_value() && t->defined() ? t->contiguous() : Tensor();
}

bool present(const OptTensor& t) { return t.has_value() && t->defined(); }

// Per-row statistics (mean, rstd): shape = input shape without the last dim, dtype float32 (float64 for
// float64 inputs).
Tensor empty_row_stats(const Tensor& x) {
  const auto sizes = x.sizes();
  return at::empty(std::vector<int64_t>(sizes.begin(), sizes.end() - 1),
                   x.options().dtype(at::toOpMathType(x.scalar_type())));
}

void check_row_stats(const char* op, const char* name, const Tensor& t, const Tensor& pre) {
  const auto sizes = pre.sizes();
  const std::vector<int64_t> want(sizes.begin(), sizes.end() - 1);
  const auto dt = at::toOpMathType(pre.scalar_type());
  TORCH_CHECK(t.device() == pre.device() && t.scalar_type() == dt && t.sizes() == c10::IntArrayRef(want),
              "ckpt_ext::", op, ": ", name, " must be the ", dt, " tensor of shape ", c10::IntArrayRef(want),
              " returned by the forward op, got ", t.scalar_type(), " ", t.sizes(), " on ", t.device());
}

void check_hidden(const char* op, const char* name, const Tensor& t) {
  check_at_least_1d(op, name, t);
  TORCH_CHECK(t.size(-1) > 0, "ckpt_ext::", op, ": the last (normalised) dimension of ", name, " must be non-empty");
}

// ---- elementwise ops ----------------------------------------------------------------------------------------

Tensor bias_gelu(const Tensor& x, const OptTensor& bias, c10::string_view approximate) {
  const char* op = "bias_gelu";
  check_floating(op, "x", x);
  check_at_least_1d(op, "x", x);
  const bool tanh = parse_approximate(op, approximate);
  if (present(bias)) check_vector(op, "bias", *bias, x.size(-1), "x", x);
  const Tensor xc = x.contiguous(), bc = contiguous_or_undefined(bias);
  Tensor out = at::empty_like(xc);
  if (xc.numel() > 0) CKPT_EXT_LAUNCH(x.device(), bias_gelu_forward, xc, bc, tanh, out);
  return out;
}

Tensor bias_gelu_backward(const Tensor& grad, const Tensor& x, const OptTensor& bias, c10::string_view approximate) {
  const char* op = "bias_gelu_backward";
  check_floating(op, "x", x);
  check_at_least_1d(op, "x", x);
  check_same_shape(op, "grad", grad, "x", x);
  const bool tanh = parse_approximate(op, approximate);
  if (present(bias)) check_vector(op, "bias", *bias, x.size(-1), "x", x);
  const Tensor gc = grad.contiguous(), xc = x.contiguous(), bc = contiguous_or_undefined(bias);
  Tensor grad_x = at::empty_like(xc);
  if (xc.numel() > 0) CKPT_EXT_LAUNCH(x.device(), bias_gelu_backward, gc, xc, bc, tanh, grad_x);
  return grad_x;
}

// A caller-provided output (the *_into entry points) must be where the kernel would write its own.
void check_out(const char* op, const Tensor& out, const Tensor& x) {
  check_same_shape(op, "out", out, "x", x);
  TORCH_CHECK(out.is_contiguous(), "ckpt_ext::", op, ": out must be contiguous");
}

// `out`: where to write the result; undefined = allocate it.
Tensor bias_dropout_add_impl(const Tensor& x, const OptTensor& bias, const Tensor& residual, double p, int64_t seed,
                             int64_t offset, Tensor out) {
  const char* op = "bias_dropout_add";
  check_floating(op, "x", x);
  check_at_least_1d(op, "x", x);
  check_same_shape(op, "residual", residual, "x", x);
  check_p(op, p);
  if (present(bias)) check_vector(op, "bias", *bias, x.size(-1), "x", x);
  if (out.defined()) check_out(op, out, x);
  const Tensor xc = x.contiguous(), rc = residual.contiguous(), bc = contiguous_or_undefined(bias);
  if (!out.defined()) out = at::empty_like(xc);
  if (xc.numel() > 0)
    CKPT_EXT_LAUNCH(x.device(), bias_dropout_add_forward, xc, bc, rc, DropoutArgs{p, seed, offset}, out);
  return out;
}

Tensor bias_dropout_add(const Tensor& x, const OptTensor& bias, const Tensor& residual, double p, int64_t seed,
                        int64_t offset) {
  return bias_dropout_add_impl(x, bias, residual, p, seed, offset, Tensor());
}

Tensor dropout_backward(const Tensor& grad, double p, int64_t seed, int64_t offset) {
  const char* op = "dropout_backward";
  check_floating(op, "grad", grad);
  check_p(op, p);
  const Tensor gc = grad.contiguous();
  Tensor grad_x = at::empty_like(gc);
  if (gc.numel() > 0) CKPT_EXT_LAUNCH(grad.device(), dropout_backward, gc, DropoutArgs{p, seed, offset}, grad_x);
  return grad_x;
}

// No tensor argument to dispatch on: registered as CompositeExplicitAutograd and launched by `device`.
Tensor dropout_mask(int64_t numel, double p, int64_t seed, int64_t offset, c10::Device device) {
  const char* op = "dropout_mask";
  TORCH_CHECK(numel >= 0, "ckpt_ext::", op, ": numel must be >= 0, got ", numel);
  check_p(op, p);
  Tensor mask = at::empty({numel}, at::TensorOptions().dtype(at::kBool).device(device));
  if (numel == 0) return mask;
  const DropoutArgs dropout{p, seed, offset};
  if (device.is_cpu()) {
    kernels::cpu::dropout_mask(dropout, mask);
  } else {
#ifdef CKPT_EXT_WITH_CUDA
    TORCH_CHECK(device.is_cuda(), "ckpt_ext::", op, ": device must be cpu or cuda, got ", device);
    kernels::cuda::dropout_mask(dropout, mask);
#else
    TORCH_CHECK(false, "ckpt_ext::", op, ": ckpt_ext was built without CUDA; device must be cpu, got ", device);
#endif
  }
  return mask;
}

Tensor swiglu(const Tensor& gate, const Tensor& up) {
  const char* op = "swiglu";
  check_floating(op, "gate", gate);
  check_same_shape(op, "up", up, "gate", gate);
  const Tensor gc = gate.contiguous(), uc = up.contiguous();
  Tensor out = at::empty_like(gc);
  if (gc.numel() > 0) CKPT_EXT_LAUNCH(gate.device(), swiglu_forward, gc, uc, out);
  return out;
}

std::tuple<Tensor, Tensor> swiglu_backward(const Tensor& grad, const Tensor& gate, const Tensor& up) {
  const char* op = "swiglu_backward";
  check_floating(op, "gate", gate);
  check_same_shape(op, "up", up, "gate", gate);
  check_same_shape(op, "grad", grad, "gate", gate);
  const Tensor dc = grad.contiguous(), gc = gate.contiguous(), uc = up.contiguous();
  Tensor grad_gate = at::empty_like(gc), grad_up = at::empty_like(gc);
  if (gc.numel() > 0) CKPT_EXT_LAUNCH(gate.device(), swiglu_backward, dc, gc, uc, grad_gate, grad_up);
  return {grad_gate, grad_up};
}

// forward: x * cos + rotate_half(x) * sin; backward: the transpose, applied to grad.
Tensor rotary_impl(const char* op, const char* name, const Tensor& x, const Tensor& cos, const Tensor& sin,
                   bool backward) {
  check_floating(op, name, x);
  TORCH_CHECK(x.dim() == 4, "ckpt_ext::", op, ": ", name, " must be [batch, heads, seq, head_dim], got shape ",
              x.sizes());
  const int64_t B = x.size(0), S = x.size(2), D = x.size(3);
  TORCH_CHECK(D % 2 == 0, "ckpt_ext::", op, ": head_dim must be even, got ", D);
  const Tensor* tables[2] = {&cos, &sin};
  const char* names[2] = {"cos", "sin"};
  Tensor tc[2];
  for (int k = 0; k < 2; ++k) {
    const Tensor& t = *tables[k];
    check_like(op, names[k], t, name, x);
    // [S, D] is accepted as [1, S, D].
    tc[k] = (t.dim() == 2 ? t.unsqueeze(0) : t).contiguous();
    TORCH_CHECK(tc[k].dim() == 3 && (tc[k].size(0) == 1 || tc[k].size(0) == B) && tc[k].size(1) == S &&
                    tc[k].size(2) == D,
                "ckpt_ext::", op, ": ", names[k], " must be [1 or batch=", B, ", seq=", S, ", head_dim=", D,
                "] (or [seq, head_dim]), got shape ", t.sizes());
  }
  // Any strides for batch/heads/seq; the last dim must be contiguous (else one copy is made here).
  const Tensor xc = x.stride(3) == 1 ? x : x.contiguous();
  // empty_like keeps x's layout when x is dense (a transposed view stays transposed); ops.py's fake does the same.
  Tensor out = x.stride(3) == 1 ? at::empty_like(x) : at::empty_like(xc);
  if (x.numel() > 0) CKPT_EXT_LAUNCH(x.device(), rotary, xc, tc[0], tc[1], backward, out);
  return out;
}

Tensor rotary(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  return rotary_impl("rotary", "x", x, cos, sin, /*backward=*/false);
}

Tensor rotary_backward(const Tensor& grad, const Tensor& cos, const Tensor& sin) {
  return rotary_impl("rotary_backward", "grad", grad, cos, sin, /*backward=*/true);
}

// ---- row-wise norms ----------------------------------------------------------------------------------------

// `out`: where to write the normalised output; undefined = allocate it.
std::tuple<Tensor, Tensor, Tensor, Tensor> bias_dropout_add_layer_norm_impl(const Tensor& x, const OptTensor& bias,
                                                                            const Tensor& residual,
                                                                            const Tensor& weight,
                                                                            const OptTensor& ln_bias, double p,
                                                                            double eps, int64_t seed, int64_t offset,
                                                                            Tensor out) {
  const char* op = "bias_dropout_add_layer_norm";
  check_floating(op, "x", x);
  check_hidden(op, "x", x);
  check_same_shape(op, "residual", residual, "x", x);
  const int64_t hidden = x.size(-1);
  check_vector(op, "weight", weight, hidden, "x", x);
  if (present(bias)) check_vector(op, "bias", *bias, hidden, "x", x);
  if (present(ln_bias)) check_vector(op, "ln_bias", *ln_bias, hidden, "x", x);
  check_p(op, p);
  TORCH_CHECK(eps >= 0, "ckpt_ext::", op, ": eps must be >= 0, got ", eps);
  if (out.defined()) check_out(op, out, x);
  const Tensor xc = x.contiguous(), rc = residual.contiguous(), wc = weight.contiguous();
  if (!out.defined()) out = at::empty_like(xc);
  Tensor pre_norm = at::empty_like(xc), mean = empty_row_stats(xc), rstd = empty_row_stats(xc);
  if (xc.numel() > 0)
    CKPT_EXT_LAUNCH(x.device(), layer_norm_forward, xc, contiguous_or_undefined(bias), rc,
                    DropoutArgs{p, seed, offset}, wc, contiguous_or_undefined(ln_bias), eps, out, pre_norm, mean, rstd);
  return {out, pre_norm, mean, rstd};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> bias_dropout_add_layer_norm(const Tensor& x, const OptTensor& bias,
                                                                       const Tensor& residual, const Tensor& weight,
                                                                       const OptTensor& ln_bias, double p, double eps,
                                                                       int64_t seed, int64_t offset) {
  return bias_dropout_add_layer_norm_impl(x, bias, residual, weight, ln_bias, p, eps, seed, offset, Tensor());
}

// Shared by the two LayerNorm backward ops. grad_x is defined only for the dropout variant.
void layer_norm_backward_checked(const char* op, const char* pre_name, const Tensor& grad_out,
                                 const OptTensor& grad_pre_norm, const Tensor& pre_norm, const Tensor& weight,
                                 const Tensor& mean, const Tensor& rstd, const DropoutArgs& dropout, Tensor& grad_pre,
                                 Tensor* grad_x, Tensor& grad_weight, Tensor& grad_ln_bias) {
  check_floating(op, pre_name, pre_norm);
  check_hidden(op, pre_name, pre_norm);
  check_same_shape(op, "grad_out", grad_out, pre_name, pre_norm);
  if (present(grad_pre_norm)) check_same_shape(op, "grad_pre_norm", *grad_pre_norm, pre_name, pre_norm);
  check_vector(op, "weight", weight, pre_norm.size(-1), pre_name, pre_norm);
  check_row_stats(op, "mean", mean, pre_norm);
  check_row_stats(op, "rstd", rstd, pre_norm);
  const Tensor pc = pre_norm.contiguous();
  grad_pre = at::empty_like(pc);
  if (grad_x) *grad_x = at::empty_like(pc);
  grad_weight = at::empty_like(weight, at::MemoryFormat::Contiguous);
  grad_ln_bias = at::empty_like(weight, at::MemoryFormat::Contiguous);
  if (pc.numel() == 0) {  // no rows: the sums over rows are zero
    grad_weight.zero_();
    grad_ln_bias.zero_();
    return;
  }
  CKPT_EXT_LAUNCH(pc.device(), layer_norm_backward, grad_out.contiguous(), contiguous_or_undefined(grad_pre_norm), pc,
                  weight.contiguous(), mean.contiguous(), rstd.contiguous(), dropout, grad_pre,
                  grad_x ? *grad_x : Tensor(), grad_weight, grad_ln_bias);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> bias_dropout_add_layer_norm_backward(
    const Tensor& grad_out, const OptTensor& grad_pre_norm, const Tensor& pre_norm, const Tensor& weight,
    const Tensor& mean, const Tensor& rstd, double p, int64_t seed, int64_t offset) {
  const char* op = "bias_dropout_add_layer_norm_backward";
  check_p(op, p);
  Tensor grad_residual, grad_x, grad_weight, grad_ln_bias;
  layer_norm_backward_checked(op, "pre_norm", grad_out, grad_pre_norm, pre_norm, weight, mean, rstd,
                              DropoutArgs{p, seed, offset}, grad_residual, &grad_x, grad_weight, grad_ln_bias);
  return {grad_x, grad_residual, grad_weight, grad_ln_bias};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> add_layer_norm(const Tensor& x, const OptTensor& residual,
                                                          const Tensor& weight, const OptTensor& bias, double eps) {
  const char* op = "add_layer_norm";
  check_floating(op, "x", x);
  check_hidden(op, "x", x);
  if (present(residual)) check_same_shape(op, "residual", *residual, "x", x);
  const int64_t hidden = x.size(-1);
  check_vector(op, "weight", weight, hidden, "x", x);
  if (present(bias)) check_vector(op, "bias", *bias, hidden, "x", x);
  TORCH_CHECK(eps >= 0, "ckpt_ext::", op, ": eps must be >= 0, got ", eps);
  const Tensor xc = x.contiguous();
  Tensor out = at::empty_like(xc), sum = at::empty_like(xc), mean = empty_row_stats(xc), rstd = empty_row_stats(xc);
  if (xc.numel() > 0)
    CKPT_EXT_LAUNCH(x.device(), layer_norm_forward, xc, Tensor(), contiguous_or_undefined(residual), DropoutArgs{},
                    weight.contiguous(), contiguous_or_undefined(bias), eps, out, sum, mean, rstd);
  return {out, sum, mean, rstd};
}

std::tuple<Tensor, Tensor, Tensor> add_layer_norm_backward(const Tensor& grad_out, const OptTensor& grad_sum,
                                                           const Tensor& sum, const Tensor& weight,
                                                           const Tensor& mean, const Tensor& rstd) {
  Tensor grad_input, grad_weight, grad_bias;
  layer_norm_backward_checked("add_layer_norm_backward", "sum", grad_out, grad_sum, sum, weight, mean, rstd,
                              DropoutArgs{}, grad_input, nullptr, grad_weight, grad_bias);
  return {grad_input, grad_weight, grad_bias};
}

std::tuple<Tensor, Tensor, Tensor> add_rms_norm(const Tensor& x, const OptTensor& residual, const Tensor& weight,
                                                double eps) {
  const char* op = "add_rms_norm";
  check_floating(op, "x", x);
  check_hidden(op, "x", x);
  if (present(residual)) check_same_shape(op, "residual", *residual, "x", x);
  check_vector(op, "weight", weight, x.size(-1), "x", x);
  TORCH_CHECK(eps >= 0, "ckpt_ext::", op, ": eps must be >= 0, got ", eps);
  const Tensor xc = x.contiguous();
  Tensor out = at::empty_like(xc), sum = at::empty_like(xc), rstd = empty_row_stats(xc);
  if (xc.numel() > 0)
    CKPT_EXT_LAUNCH(x.device(), rms_norm_forward, xc, contiguous_or_undefined(residual), weight.contiguous(), eps, out,
                    sum, rstd);
  return {out, sum, rstd};
}

std::tuple<Tensor, Tensor> add_rms_norm_backward(const Tensor& grad_out, const OptTensor& grad_sum, const Tensor& sum,
                                                 const Tensor& weight, const Tensor& rstd) {
  const char* op = "add_rms_norm_backward";
  check_floating(op, "sum", sum);
  check_hidden(op, "sum", sum);
  check_same_shape(op, "grad_out", grad_out, "sum", sum);
  if (present(grad_sum)) check_same_shape(op, "grad_sum", *grad_sum, "sum", sum);
  check_vector(op, "weight", weight, sum.size(-1), "sum", sum);
  check_row_stats(op, "rstd", rstd, sum);
  const Tensor sc = sum.contiguous();
  Tensor grad_input = at::empty_like(sc), grad_weight = at::empty_like(weight, at::MemoryFormat::Contiguous);
  if (sc.numel() > 0)
    CKPT_EXT_LAUNCH(sc.device(), rms_norm_backward, grad_out.contiguous(), contiguous_or_undefined(grad_sum), sc,
                    weight.contiguous(), rstd.contiguous(), grad_input, grad_weight);
  else
    grad_weight.zero_();
  return {grad_input, grad_weight};
}

}  // namespace
}  // namespace ckpt_ext

TORCH_LIBRARY(ckpt_ext, m) {
  m.def("bias_gelu(Tensor x, Tensor? bias, str approximate) -> Tensor");
  m.def("bias_gelu_backward(Tensor grad, Tensor x, Tensor? bias, str approximate) -> Tensor");
  m.def("bias_dropout_add(Tensor x, Tensor? bias, Tensor residual, float p, SymInt seed, SymInt offset) -> Tensor");
  m.def("dropout_backward(Tensor grad, float p, SymInt seed, SymInt offset) -> Tensor");
  m.def("dropout_mask(SymInt numel, float p, SymInt seed, SymInt offset, Device device) -> Tensor");
  m.def(
      "bias_dropout_add_layer_norm(Tensor x, Tensor? bias, Tensor residual, Tensor weight, Tensor? ln_bias, "
      "float p, float eps, SymInt seed, SymInt offset) -> (Tensor out, Tensor pre_norm, Tensor mean, Tensor rstd)");
  m.def(
      "bias_dropout_add_layer_norm_backward(Tensor grad_out, Tensor? grad_pre_norm, Tensor pre_norm, Tensor weight, "
      "Tensor mean, Tensor rstd, float p, SymInt seed, SymInt offset) "
      "-> (Tensor grad_x, Tensor grad_residual, Tensor grad_weight, Tensor grad_ln_bias)");
  m.def(
      "add_layer_norm(Tensor x, Tensor? residual, Tensor weight, Tensor? bias, float eps) "
      "-> (Tensor out, Tensor sum, Tensor mean, Tensor rstd)");
  m.def(
      "add_layer_norm_backward(Tensor grad_out, Tensor? grad_sum, Tensor sum, Tensor weight, Tensor mean, "
      "Tensor rstd) -> (Tensor grad_input, Tensor grad_weight, Tensor grad_bias)");
  m.def("add_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor out, Tensor sum, Tensor rstd)");
  m.def(
      "add_rms_norm_backward(Tensor grad_out, Tensor? grad_sum, Tensor sum, Tensor weight, Tensor rstd) "
      "-> (Tensor grad_input, Tensor grad_weight)");
  m.def("swiglu(Tensor gate, Tensor up) -> Tensor");
  m.def("swiglu_backward(Tensor grad, Tensor gate, Tensor up) -> (Tensor grad_gate, Tensor grad_up)");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("rotary_backward(Tensor grad, Tensor cos, Tensor sin) -> Tensor");
}

// The same checked entry points serve both backends; CKPT_EXT_LAUNCH picks the kernel by device.
#define CKPT_EXT_IMPL_ALL(m)                                                                       \
  m.impl("bias_gelu", &ckpt_ext::bias_gelu);                                                       \
  m.impl("bias_gelu_backward", &ckpt_ext::bias_gelu_backward);                                     \
  m.impl("bias_dropout_add", &ckpt_ext::bias_dropout_add);                                         \
  m.impl("dropout_backward", &ckpt_ext::dropout_backward);                                         \
  m.impl("bias_dropout_add_layer_norm", &ckpt_ext::bias_dropout_add_layer_norm);                   \
  m.impl("bias_dropout_add_layer_norm_backward", &ckpt_ext::bias_dropout_add_layer_norm_backward); \
  m.impl("add_layer_norm", &ckpt_ext::add_layer_norm);                                             \
  m.impl("add_layer_norm_backward", &ckpt_ext::add_layer_norm_backward);                           \
  m.impl("add_rms_norm", &ckpt_ext::add_rms_norm);                                                 \
  m.impl("add_rms_norm_backward", &ckpt_ext::add_rms_norm_backward);                               \
  m.impl("swiglu", &ckpt_ext::swiglu);                                                             \
  m.impl("swiglu_backward", &ckpt_ext::swiglu_backward);                                           \
  m.impl("rotary", &ckpt_ext::rotary);                                                             \
  m.impl("rotary_backward", &ckpt_ext::rotary_backward)

TORCH_LIBRARY_IMPL(ckpt_ext, CPU, m) { CKPT_EXT_IMPL_ALL(m); }

// Only in CUDA builds (setup.py defines CKPT_EXT_WITH_CUDA and compiles kernels/cuda/*.cu).
#ifdef CKPT_EXT_WITH_CUDA
TORCH_LIBRARY_IMPL(ckpt_ext, CUDA, m) { CKPT_EXT_IMPL_ALL(m); }
#endif

TORCH_LIBRARY_IMPL(ckpt_ext, CompositeExplicitAutograd, m) { m.impl("dropout_mask", &ckpt_ext::dropout_mask); }

// ---- C++ entry points (fused_ops.h): through the dispatcher, so autograd and fake tensors apply ----------------

namespace ckpt_ext {
namespace ops {
namespace {

// The typed handle of ckpt_ext::<name>, looked up once.
template <typename Signature>
c10::TypedOperatorHandle<Signature> handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

}  // namespace

#define CKPT_EXT_CALL(name, Signature, ...)                                      \
  static const auto op = handle<Signature>("ckpt_ext::" name); \
  return op.call(__VA_ARGS__)

using T4 = std::tuple<Tensor, Tensor, Tensor, Tensor>;
using T3 = std::tuple<Tensor, Tensor, Tensor>;
using T2 = std::tuple<Tensor, Tensor>;

Tensor bias_gelu(const Tensor& x, const OptTensor& bias, c10::string_view approximate) {
  CKPT_EXT_CALL("bias_gelu", Tensor(const Tensor&, const OptTensor&, c10::string_view), x, bias, approximate);
}
Tensor bias_gelu_backward(const Tensor& grad, const Tensor& x, const OptTensor& bias, c10::string_view approximate) {
  CKPT_EXT_CALL("bias_gelu_backward", Tensor(const Tensor&, const Tensor&, const OptTensor&, c10::string_view), grad,
                x, bias, approximate);
}
Tensor bias_dropout_add(const Tensor& x, const OptTensor& bias, const Tensor& residual, double p, c10::SymInt seed,
                        c10::SymInt offset) {
  CKPT_EXT_CALL("bias_dropout_add",
                Tensor(const Tensor&, const OptTensor&, const Tensor&, double, c10::SymInt, c10::SymInt), x, bias,
                residual, p, seed, offset);
}
Tensor dropout_backward(const Tensor& grad, double p, c10::SymInt seed, c10::SymInt offset) {
  CKPT_EXT_CALL("dropout_backward", Tensor(const Tensor&, double, c10::SymInt, c10::SymInt), grad, p, seed, offset);
}
T4 bias_dropout_add_layer_norm(const Tensor& x, const OptTensor& bias, const Tensor& residual, const Tensor& weight,
                               const OptTensor& ln_bias, double p, double eps, c10::SymInt seed, c10::SymInt offset) {
  CKPT_EXT_CALL("bias_dropout_add_layer_norm",
                T4(const Tensor&, const OptTensor&, const Tensor&, const Tensor&, const OptTensor&, double, double,
                   c10::SymInt, c10::SymInt),
                x, bias, residual, weight, ln_bias, p, eps, seed, offset);
}
T4 bias_dropout_add_layer_norm_backward(const Tensor& grad_out, const OptTensor& grad_pre_norm, const Tensor& pre_norm,
                                        const Tensor& weight, const Tensor& mean, const Tensor& rstd, double p,
                                        c10::SymInt seed, c10::SymInt offset) {
  CKPT_EXT_CALL("bias_dropout_add_layer_norm_backward",
                T4(const Tensor&, const OptTensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, double,
                   c10::SymInt, c10::SymInt),
                grad_out, grad_pre_norm, pre_norm, weight, mean, rstd, p, seed, offset);
}
T4 add_layer_norm(const Tensor& x, const OptTensor& residual, const Tensor& weight, const OptTensor& bias,
                  double eps) {
  CKPT_EXT_CALL("add_layer_norm", T4(const Tensor&, const OptTensor&, const Tensor&, const OptTensor&, double), x,
                residual, weight, bias, eps);
}
T3 add_layer_norm_backward(const Tensor& grad_out, const OptTensor& grad_sum, const Tensor& sum, const Tensor& weight,
                           const Tensor& mean, const Tensor& rstd) {
  CKPT_EXT_CALL("add_layer_norm_backward",
                T3(const Tensor&, const OptTensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&),
                grad_out, grad_sum, sum, weight, mean, rstd);
}
T3 add_rms_norm(const Tensor& x, const OptTensor& residual, const Tensor& weight, double eps) {
  CKPT_EXT_CALL("add_rms_norm", T3(const Tensor&, const OptTensor&, const Tensor&, double), x, residual, weight, eps);
}
T2 add_rms_norm_backward(const Tensor& grad_out, const OptTensor& grad_sum, const Tensor& sum, const Tensor& weight,
                         const Tensor& rstd) {
  CKPT_EXT_CALL("add_rms_norm_backward",
                T2(const Tensor&, const OptTensor&, const Tensor&, const Tensor&, const Tensor&), grad_out, grad_sum,
                sum, weight, rstd);
}
Tensor swiglu(const Tensor& gate, const Tensor& up) {
  CKPT_EXT_CALL("swiglu", Tensor(const Tensor&, const Tensor&), gate, up);
}
T2 swiglu_backward(const Tensor& grad, const Tensor& gate, const Tensor& up) {
  CKPT_EXT_CALL("swiglu_backward", T2(const Tensor&, const Tensor&, const Tensor&), grad, gate, up);
}
Tensor rotary(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  CKPT_EXT_CALL("rotary", Tensor(const Tensor&, const Tensor&, const Tensor&), x, cos, sin);
}
Tensor rotary_backward(const Tensor& grad, const Tensor& cos, const Tensor& sin) {
  CKPT_EXT_CALL("rotary_backward", Tensor(const Tensor&, const Tensor&, const Tensor&), grad, cos, sin);
}

#undef CKPT_EXT_CALL

void bias_dropout_add_into(const Tensor& x, const OptTensor& bias, const Tensor& residual, double p, int64_t seed,
                           int64_t offset, const Tensor& out) {
  TORCH_CHECK(out.defined(), "ckpt_ext::bias_dropout_add_into: out must be a tensor");
  ckpt_ext::bias_dropout_add_impl(x, bias, residual, p, seed, offset, out);
}

T3 bias_dropout_add_layer_norm_into(const Tensor& x, const OptTensor& bias, const Tensor& residual,
                                    const Tensor& weight, const OptTensor& ln_bias, double p, double eps, int64_t seed,
                                    int64_t offset, const Tensor& out) {
  TORCH_CHECK(out.defined(), "ckpt_ext::bias_dropout_add_layer_norm_into: out must be a tensor");
  auto r = ckpt_ext::bias_dropout_add_layer_norm_impl(x, bias, residual, weight, ln_bias, p, eps, seed, offset, out);
  return {std::get<1>(r), std::get<2>(r), std::get<3>(r)};
}

}  // namespace ops
}  // namespace ckpt_ext
