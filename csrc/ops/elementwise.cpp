// The elementwise ops: bias_gelu, bias_dropout_add, dropout, dropout_mask, swiglu, rotary (and their
// backward ops): argument checks, output allocation, CPU/CUDA registration. Schemas: schemas.cpp;
// autograd: autograd.cpp; kernels: kernels/{cpu,cuda}/elementwise.
//
// Inputs that are not contiguous are made contiguous here (a copy only when needed); rotary only needs a
// contiguous last dimension, so the usual transposed [B, S, H, D] -> [B, H, S, D] views of q and k are
// read in place. Outputs are contiguous, except rotary's, which are laid out like their input.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <initializer_list>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "checks.h"
#include "ops.h"

namespace ckpt_ext {
namespace {

using namespace ops::detail;

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

std::tuple<Tensor, Tensor> bias_gelu_backward(const Tensor& grad, const Tensor& x, const OptTensor& bias,
                                              c10::string_view approximate, bool want_grad_bias) {
  const char* op = "bias_gelu_backward";
  check_floating(op, "x", x);
  check_at_least_1d(op, "x", x);
  check_same_shape(op, "grad", grad, "x", x);
  const bool tanh = parse_approximate(op, approximate);
  if (present(bias)) check_vector(op, "bias", *bias, x.size(-1), "x", x);
  const Tensor gc = grad.contiguous(), xc = x.contiguous(), bc = contiguous_or_undefined(bias);
  Tensor grad_x = at::empty_like(xc);
  // The bias's gradient has the last dimension's length (and x's dtype, as the bias); zero without rows.
  Tensor grad_bias = at::empty({want_grad_bias ? x.size(-1) : 0}, xc.options());
  if (want_grad_bias && xc.numel() == 0) grad_bias.zero_();
  if (xc.numel() > 0)
    CKPT_EXT_LAUNCH(x.device(), bias_gelu_backward, gc, xc, bc, tanh, grad_x, want_grad_bias ? grad_bias : Tensor());
  return {grad_x, grad_bias};
}

// `out`: where to write the result; undefined = allocate it.
//
// Autocast's residual stream: x may be bfloat16/float16 beside a float32 residual (the GEMM's output joining
// the stream). The kernels read x and compute in float, as after a cast of x to float32 (exact), so the
// result is the float path's without the cast's pass; bias and out then have the residual's dtype.
Tensor bias_dropout_add_impl(const Tensor& x, const OptTensor& bias, const Tensor& residual, double p, int64_t seed,
                             int64_t offset, Tensor out) {
  const char* op = "bias_dropout_add";
  check_floating(op, "x", x);
  check_at_least_1d(op, "x", x);
  TORCH_CHECK(residual.scalar_type() == x.scalar_type() ||
                  is_lowp_beside_float(x.scalar_type(), residual.scalar_type()),
              "ckpt_ext::", op, ": residual must have the dtype of x (", x.scalar_type(), "), or be float32 with x in "
              "bfloat16 or float16 (autocast's float32 residual stream), got ", residual.scalar_type(),
              "; cast it with .to(x.dtype)");
  const bool mixed = check_norm_x(op, x, "residual", residual);  // device and shape (and dtype unless mixed)
  // The stream's tensor: what the bias and the output are like.
  const Tensor& stream = mixed ? residual : x;
  const char* stream_name = mixed ? "residual" : "x";
  check_p(op, p);
  if (present(bias)) check_vector(op, "bias", *bias, x.size(-1), stream_name, stream);
  if (out.defined()) {
    check_same_shape(op, "out", out, stream_name, stream);
    TORCH_CHECK(out.is_contiguous(), "ckpt_ext::", op, ": out must be contiguous");
  }
  const Tensor xc = x.contiguous(), rc = residual.contiguous(), bc = contiguous_or_undefined(bias);
  if (!out.defined()) out = at::empty_like(rc);
  if (xc.numel() > 0)
    CKPT_EXT_LAUNCH(x.device(), bias_dropout_add_forward, xc, bc, rc, DropoutArgs{p, seed, offset}, out);
  return out;
}

Tensor bias_dropout_add(const Tensor& x, const OptTensor& bias, const Tensor& residual, double p, int64_t seed,
                        int64_t offset) {
  return bias_dropout_add_impl(x, bias, residual, p, seed, offset, Tensor());
}

// x * mask / (1 - p): the forward of a dropout without bias or residual, and the backward of every
// dropout of (seed, offset) (the mask is the same, and the map is linear).
//
// dtype: the result's; a float32 x may give bfloat16/float16 (autocast: a float32 gradient of the residual
// stream dropped into the GEMMs' dtype), each element rounded once from the float result -- the bits of
// dropout then .to(dtype), in one pass.
Tensor dropout(const Tensor& x, double p, int64_t seed, int64_t offset, std::optional<at::ScalarType> dtype) {
  const char* op = "dropout";
  check_floating(op, "x", x);
  check_p(op, p);
  const at::ScalarType out_dtype = dtype.value_or(x.scalar_type());
  TORCH_CHECK(out_dtype == x.scalar_type() || is_lowp_beside_float(out_dtype, x.scalar_type()), "ckpt_ext::", op,
              ": dtype must be x's (", x.scalar_type(), "), or bfloat16 / float16 for a float32 x, got ", out_dtype);
  const Tensor xc = x.contiguous();
  Tensor out = at::empty(xc.sizes(), xc.options().dtype(out_dtype));
  if (xc.numel() > 0) CKPT_EXT_LAUNCH(x.device(), dropout, xc, DropoutArgs{p, seed, offset}, out);
  return out;
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

Tensor geglu(const Tensor& gate, const Tensor& up, c10::string_view approximate) {
  const char* op = "geglu";
  const bool tanh = parse_approximate(op, approximate);
  check_floating(op, "gate", gate);
  check_same_shape(op, "up", up, "gate", gate);
  const Tensor gc = gate.contiguous(), uc = up.contiguous();
  Tensor out = at::empty_like(gc);
  if (gc.numel() > 0) CKPT_EXT_LAUNCH(gate.device(), geglu_forward, gc, uc, tanh, out);
  return out;
}

std::tuple<Tensor, Tensor> geglu_backward(const Tensor& grad, const Tensor& gate, const Tensor& up,
                                          c10::string_view approximate) {
  const char* op = "geglu_backward";
  const bool tanh = parse_approximate(op, approximate);
  check_floating(op, "gate", gate);
  check_same_shape(op, "up", up, "gate", gate);
  check_same_shape(op, "grad", grad, "gate", gate);
  const Tensor dc = grad.contiguous(), gc = gate.contiguous(), uc = up.contiguous();
  Tensor grad_gate = at::empty_like(gc), grad_up = at::empty_like(gc);
  if (gc.numel() > 0) CKPT_EXT_LAUNCH(gate.device(), geglu_backward, dc, gc, uc, tanh, grad_gate, grad_up);
  return {grad_gate, grad_up};
}

// The backwards that also write the forward's output, in place (issue 33). Every tensor written must be contiguous
// and no two of them the same memory; the kernels read an element's inputs before they write its outputs.
void check_written(const char* op, std::initializer_list<std::pair<const char*, const Tensor*>> ts) {
  for (const auto& [name, t] : ts)
    TORCH_CHECK(t->is_contiguous(), "ckpt_ext::", op, ": ", name,
                " is overwritten and must be contiguous, got strides ", t->strides());
  for (auto i = ts.begin(); i != ts.end(); ++i)
    for (auto j = i + 1; j != ts.end(); ++j)
      TORCH_CHECK(i->second->numel() == 0 || !i->second->is_alias_of(*j->second), "ckpt_ext::", op, ": ", i->first,
                  " and ", j->first, " are both overwritten and must not share memory");
}

void glu_backward_act_checks(const char* op, const Tensor& grad, const Tensor& gate, const Tensor& up) {
  check_floating(op, "gate", gate);
  check_same_shape(op, "up", up, "gate", gate);
  check_same_shape(op, "grad", grad, "gate", gate);
  check_written(op, {{"grad", &grad}, {"gate", &gate}, {"up", &up}});
}

void swiglu_backward_act_(Tensor& grad, Tensor& gate, Tensor& up) {
  glu_backward_act_checks("swiglu_backward_act_", grad, gate, up);
  // grad's old values -> gate's and up's gradients; gate, up -> the activation.
  if (gate.numel() > 0) CKPT_EXT_LAUNCH(gate.device(), swiglu_backward_act, grad, gate, up, gate, up, grad);
}

void geglu_backward_act_(Tensor& grad, Tensor& gate, Tensor& up, c10::string_view approximate) {
  const char* op = "geglu_backward_act_";
  const bool tanh = parse_approximate(op, approximate);
  glu_backward_act_checks(op, grad, gate, up);
  if (gate.numel() > 0) CKPT_EXT_LAUNCH(gate.device(), geglu_backward_act, grad, gate, up, tanh, gate, up, grad);
}

Tensor bias_gelu_backward_act_(Tensor& grad, Tensor& x, const OptTensor& bias, c10::string_view approximate,
                               bool want_grad_bias) {
  const char* op = "bias_gelu_backward_act_";
  check_floating(op, "x", x);
  check_at_least_1d(op, "x", x);
  check_same_shape(op, "grad", grad, "x", x);
  check_written(op, {{"grad", &grad}, {"x", &x}});
  const bool tanh = parse_approximate(op, approximate);
  if (present(bias)) check_vector(op, "bias", *bias, x.size(-1), "x", x);
  const Tensor bc = contiguous_or_undefined(bias);
  Tensor grad_bias = at::empty({want_grad_bias ? x.size(-1) : 0}, x.options());
  if (want_grad_bias && x.numel() == 0) grad_bias.zero_();
  // grad -> x's gradient; x -> the activation.
  if (x.numel() > 0)
    CKPT_EXT_LAUNCH(x.device(), bias_gelu_backward_act, grad, x, bc, tanh, grad, want_grad_bias ? grad_bias : Tensor(),
                    x);
  return grad_bias;
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

}  // namespace
}  // namespace ckpt_ext

namespace ckpt_ext {
namespace ops {

void bias_dropout_add_into(const Tensor& x, const OptTensor& bias, const Tensor& residual, double p, int64_t seed,
                           int64_t offset, const Tensor& out) {
  TORCH_CHECK(out.defined(), "ckpt_ext::bias_dropout_add_into: out must be a tensor");
  ckpt_ext::bias_dropout_add_impl(x, bias, residual, p, seed, offset, out);
}

}  // namespace ops
}  // namespace ckpt_ext

// The same checked functions serve both backends; CKPT_EXT_LAUNCH picks the kernel by device.
#define CKPT_EXT_IMPL(m)                                       \
  m.impl("bias_gelu", &ckpt_ext::bias_gelu);                   \
  m.impl("bias_gelu_backward", &ckpt_ext::bias_gelu_backward); \
  m.impl("bias_dropout_add", &ckpt_ext::bias_dropout_add);     \
  m.impl("dropout", &ckpt_ext::dropout);                       \
  m.impl("swiglu", &ckpt_ext::swiglu);                         \
  m.impl("swiglu_backward", &ckpt_ext::swiglu_backward);       \
  m.impl("geglu", &ckpt_ext::geglu);                           \
  m.impl("geglu_backward", &ckpt_ext::geglu_backward);         \
  m.impl("swiglu_backward_act_", &ckpt_ext::swiglu_backward_act_); \
  m.impl("geglu_backward_act_", &ckpt_ext::geglu_backward_act_);   \
  m.impl("bias_gelu_backward_act_", &ckpt_ext::bias_gelu_backward_act_); \
  m.impl("rotary", &ckpt_ext::rotary);                         \
  m.impl("rotary_backward", &ckpt_ext::rotary_backward)

TORCH_LIBRARY_IMPL(ckpt_ext, CPU, m) { CKPT_EXT_IMPL(m); }

// Only in CUDA builds (setup.py defines CKPT_EXT_WITH_CUDA and compiles kernels/cuda/*.cu).
#ifdef CKPT_EXT_WITH_CUDA
TORCH_LIBRARY_IMPL(ckpt_ext, CUDA, m) { CKPT_EXT_IMPL(m); }
#endif
#undef CKPT_EXT_IMPL

// No tensor argument to dispatch on: launched by its `device` argument.
TORCH_LIBRARY_IMPL(ckpt_ext, CompositeExplicitAutograd, m) { m.impl("dropout_mask", &ckpt_ext::dropout_mask); }
