// The ckpt_ext op library: every schema (one place to read the ops' signatures), and the C++ entry
// points of ops.h, which call the ops through the dispatcher. Checks and backend kernels: the op groups
// (elementwise.cpp, norms.cpp); autograd: autograd.cpp; fake (meta) kernels: ckpt_ext/ops.py.
// The ops are pure functions of (inputs, weights, dropout seed/offset): no state, no global generator.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <tuple>

#include "ops.h"

TORCH_LIBRARY(ckpt_ext, m) {
  m.def("bias_gelu(Tensor x, Tensor? bias, str approximate) -> Tensor");
  m.def(
      "bias_gelu_backward(Tensor grad, Tensor x, Tensor? bias, str approximate, bool grad_bias=False) "
      "-> (Tensor grad_x, Tensor grad_bias)");
  m.def("bias_dropout_add(Tensor x, Tensor? bias, Tensor residual, float p, SymInt seed, SymInt offset) -> Tensor");
  m.def("dropout(Tensor x, float p, SymInt seed, SymInt offset, ScalarType? dtype=None) -> Tensor");
  m.def("dropout_mask(SymInt numel, float p, SymInt seed, SymInt offset, Device device) -> Tensor");
  m.def(
      "bias_dropout_add_layer_norm(Tensor x, Tensor? bias, Tensor residual, Tensor weight, Tensor? ln_bias, "
      "float p, float eps, SymInt seed, SymInt offset, ScalarType? out_dtype=None) "
      "-> (Tensor out, Tensor pre_norm, Tensor mean, Tensor rstd, Tensor keep_bits)");
  m.def(
      "bias_dropout_add_layer_norm_dual(Tensor x, Tensor? bias, Tensor residual, Tensor weight, Tensor? ln_bias, "
      "float p, float eps, SymInt seed, SymInt offset, ScalarType out2_dtype) "
      "-> (Tensor out, Tensor out2, Tensor pre_norm, Tensor mean, Tensor rstd, Tensor keep_bits)");
  m.def(
      "bias_dropout_add_layer_norm_backward(Tensor grad_out, Tensor? grad_pre_norm, Tensor pre_norm, Tensor weight, "
      "Tensor mean, Tensor rstd, float p, SymInt seed, SymInt offset, Tensor? keep_bits=None, bool grad_bias=False, "
      "ScalarType? x_dtype=None, Tensor? grad_out2=None) "
      "-> (Tensor grad_x, Tensor grad_residual, Tensor grad_weight, Tensor grad_ln_bias, Tensor grad_bias)");
  m.def(
      "add_layer_norm(Tensor x, Tensor? residual, Tensor weight, Tensor? bias, float eps) "
      "-> (Tensor out, Tensor sum, Tensor mean, Tensor rstd)");
  m.def(
      "add_layer_norm_backward(Tensor grad_out, Tensor? grad_sum, Tensor sum, Tensor weight, Tensor mean, "
      "Tensor rstd) -> (Tensor grad_input, Tensor grad_weight, Tensor grad_bias)");
  m.def(
      "add_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps, ScalarType? out_dtype=None) "
      "-> (Tensor out, Tensor sum, Tensor rstd)");
  m.def(
      "add_rms_norm_backward(Tensor grad_out, Tensor? grad_sum, Tensor sum, Tensor weight, Tensor rstd, "
      "Tensor? grad_out2=None) -> (Tensor grad_input, Tensor grad_weight)");
  m.def("swiglu(Tensor gate, Tensor up) -> Tensor");
  m.def("swiglu_backward(Tensor grad, Tensor gate, Tensor up) -> (Tensor grad_gate, Tensor grad_up)");
  m.def("geglu(Tensor gate, Tensor up, str approximate=\"tanh\") -> Tensor");
  m.def(
      "geglu_backward(Tensor grad, Tensor gate, Tensor up, str approximate=\"tanh\") "
      "-> (Tensor grad_gate, Tensor grad_up)");
  // The backwards that also write the forward's output, all in place (issue 33: the replay of a segment's last
  // layer takes the last linear's input from its activation's backward; its inputs are read nowhere else after).
  // GLUs: grad becomes the activation, gate and up their gradients; bias-GELU: grad becomes x's gradient, x the
  // activation.
  m.def("swiglu_backward_act_(Tensor(a!) grad, Tensor(b!) gate, Tensor(c!) up) -> ()");
  m.def("geglu_backward_act_(Tensor(a!) grad, Tensor(b!) gate, Tensor(c!) up, str approximate=\"tanh\") -> ()");
  m.def(
      "bias_gelu_backward_act_(Tensor(a!) grad, Tensor(b!) x, Tensor? bias, str approximate, bool grad_bias=False) "
      "-> Tensor grad_bias");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("rotary_backward(Tensor grad, Tensor cos, Tensor sin) -> Tensor");
}

// ---- C++ entry points (ops.h): through the dispatcher, so autograd and fake tensors apply ----------------

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

using T6 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;
using T5 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;
using T4 = std::tuple<Tensor, Tensor, Tensor, Tensor>;
using T3 = std::tuple<Tensor, Tensor, Tensor>;
using T2 = std::tuple<Tensor, Tensor>;

Tensor bias_gelu(const Tensor& x, const OptTensor& bias, c10::string_view approximate) {
  CKPT_EXT_CALL("bias_gelu", Tensor(const Tensor&, const OptTensor&, c10::string_view), x, bias, approximate);
}
T2 bias_gelu_backward(const Tensor& grad, const Tensor& x, const OptTensor& bias, c10::string_view approximate,
                      bool grad_bias) {
  CKPT_EXT_CALL("bias_gelu_backward", T2(const Tensor&, const Tensor&, const OptTensor&, c10::string_view, bool), grad,
                x, bias, approximate, grad_bias);
}
Tensor bias_dropout_add(const Tensor& x, const OptTensor& bias, const Tensor& residual, double p, c10::SymInt seed,
                        c10::SymInt offset) {
  CKPT_EXT_CALL("bias_dropout_add",
                Tensor(const Tensor&, const OptTensor&, const Tensor&, double, c10::SymInt, c10::SymInt), x, bias,
                residual, p, seed, offset);
}
Tensor dropout(const Tensor& x, double p, c10::SymInt seed, c10::SymInt offset, std::optional<at::ScalarType> dtype) {
  CKPT_EXT_CALL("dropout", Tensor(const Tensor&, double, c10::SymInt, c10::SymInt, std::optional<at::ScalarType>), x,
                p, seed, offset, dtype);
}
T5 bias_dropout_add_layer_norm(const Tensor& x, const OptTensor& bias, const Tensor& residual, const Tensor& weight,
                               const OptTensor& ln_bias, double p, double eps, c10::SymInt seed, c10::SymInt offset,
                               std::optional<at::ScalarType> out_dtype) {
  CKPT_EXT_CALL("bias_dropout_add_layer_norm",
                T5(const Tensor&, const OptTensor&, const Tensor&, const Tensor&, const OptTensor&, double, double,
                   c10::SymInt, c10::SymInt, std::optional<at::ScalarType>),
                x, bias, residual, weight, ln_bias, p, eps, seed, offset, out_dtype);
}
T6 bias_dropout_add_layer_norm_dual(const Tensor& x, const OptTensor& bias, const Tensor& residual,
                                    const Tensor& weight, const OptTensor& ln_bias, double p, double eps,
                                    c10::SymInt seed, c10::SymInt offset, at::ScalarType out2_dtype) {
  CKPT_EXT_CALL("bias_dropout_add_layer_norm_dual",
                T6(const Tensor&, const OptTensor&, const Tensor&, const Tensor&, const OptTensor&, double, double,
                   c10::SymInt, c10::SymInt, at::ScalarType),
                x, bias, residual, weight, ln_bias, p, eps, seed, offset, out2_dtype);
}
T5 bias_dropout_add_layer_norm_backward(const Tensor& grad_out, const OptTensor& grad_pre_norm, const Tensor& pre_norm,
                                        const Tensor& weight, const Tensor& mean, const Tensor& rstd, double p,
                                        c10::SymInt seed, c10::SymInt offset, const OptTensor& keep_bits,
                                        bool grad_bias, std::optional<at::ScalarType> x_dtype,
                                        const OptTensor& grad_out2) {
  CKPT_EXT_CALL("bias_dropout_add_layer_norm_backward",
                T5(const Tensor&, const OptTensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, double,
                   c10::SymInt, c10::SymInt, const OptTensor&, bool, std::optional<at::ScalarType>, const OptTensor&),
                grad_out, grad_pre_norm, pre_norm, weight, mean, rstd, p, seed, offset, keep_bits, grad_bias, x_dtype,
                grad_out2);
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
T3 add_rms_norm(const Tensor& x, const OptTensor& residual, const Tensor& weight, double eps,
                std::optional<at::ScalarType> out_dtype) {
  CKPT_EXT_CALL("add_rms_norm",
                T3(const Tensor&, const OptTensor&, const Tensor&, double, std::optional<at::ScalarType>), x,
                residual, weight, eps, out_dtype);
}
T2 add_rms_norm_backward(const Tensor& grad_out, const OptTensor& grad_sum, const Tensor& sum, const Tensor& weight,
                         const Tensor& rstd, const OptTensor& grad_out2) {
  CKPT_EXT_CALL("add_rms_norm_backward",
                T2(const Tensor&, const OptTensor&, const Tensor&, const Tensor&, const Tensor&, const OptTensor&),
                grad_out, grad_sum, sum, weight, rstd, grad_out2);
}
Tensor swiglu(const Tensor& gate, const Tensor& up) {
  CKPT_EXT_CALL("swiglu", Tensor(const Tensor&, const Tensor&), gate, up);
}
T2 swiglu_backward(const Tensor& grad, const Tensor& gate, const Tensor& up) {
  CKPT_EXT_CALL("swiglu_backward", T2(const Tensor&, const Tensor&, const Tensor&), grad, gate, up);
}
void swiglu_backward_act_(Tensor& grad, Tensor& gate, Tensor& up) {
  CKPT_EXT_CALL("swiglu_backward_act_", void(Tensor&, Tensor&, Tensor&), grad, gate, up);
}
void geglu_backward_act_(Tensor& grad, Tensor& gate, Tensor& up, c10::string_view approximate) {
  CKPT_EXT_CALL("geglu_backward_act_", void(Tensor&, Tensor&, Tensor&, c10::string_view), grad, gate, up, approximate);
}
Tensor bias_gelu_backward_act_(Tensor& grad, Tensor& x, const OptTensor& bias, c10::string_view approximate,
                               bool grad_bias) {
  CKPT_EXT_CALL("bias_gelu_backward_act_", Tensor(Tensor&, Tensor&, const OptTensor&, c10::string_view, bool), grad,
                x, bias, approximate, grad_bias);
}
Tensor geglu(const Tensor& gate, const Tensor& up, c10::string_view approximate) {
  CKPT_EXT_CALL("geglu", Tensor(const Tensor&, const Tensor&, c10::string_view), gate, up, approximate);
}
T2 geglu_backward(const Tensor& grad, const Tensor& gate, const Tensor& up, c10::string_view approximate) {
  CKPT_EXT_CALL("geglu_backward", T2(const Tensor&, const Tensor&, const Tensor&, c10::string_view), grad, gate, up,
                approximate);
}
Tensor rotary(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  CKPT_EXT_CALL("rotary", Tensor(const Tensor&, const Tensor&, const Tensor&), x, cos, sin);
}
Tensor rotary_backward(const Tensor& grad, const Tensor& cos, const Tensor& sin) {
  CKPT_EXT_CALL("rotary_backward", Tensor(const Tensor&, const Tensor&, const Tensor&), grad, cos, sin);
}

#undef CKPT_EXT_CALL

}  // namespace ops
}  // namespace ckpt_ext
