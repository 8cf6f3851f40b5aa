// Kernel entry points of the fused-layer building blocks, one set per backend (kernels::cpu in
// kernels/cpu/*.cpp, kernels::cuda in kernels/cuda/*.cu).
//
// Contract (enforced by the op groups in csrc/ops/, the only callers, with ops/checks.h): every tensor
// is on the same device, has the dtype of the op's main input (mean/rstd: float32, or float64 for
// float64 inputs) and is contiguous, except rotary's x/out/grad, which need only a contiguous last dimension, and the
// two mixed-dtype cases of autocast's float32 residual stream: bias_dropout_add_forward's x and dropout's out may be
// bfloat16 / float16 beside float32 (the rest). Outputs are allocated by the caller. An optional tensor that is
// absent is passed as an undefined at::Tensor.
// Row-wise kernels see their input as [rows, hidden] with hidden = size(-1).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "philox.h"

namespace ckpt_ext {
namespace kernels {

// Dropout as passed to the kernels: p == 0 means no dropout (no Philox work at all).
struct DropoutArgs {
  double p = 0.0;
  int64_t seed = 0;
  int64_t offset = 0;

  bool enabled() const { return p > 0.0; }
  philox::Dropout philox() const {
    return philox::Dropout{static_cast<uint64_t>(seed), static_cast<uint64_t>(offset), static_cast<float>(p),
                           p < 1.0 ? static_cast<float>(1.0 / (1.0 - p)) : 0.0f};
  }
};

#define CKPT_EXT_FUSED_KERNEL_DECLS                                                                           \
  /* out = gelu(x + bias) */                                                                                  \
  void bias_gelu_forward(const at::Tensor& x, const at::Tensor& bias, bool tanh, const at::Tensor& out);      \
  /* grad_bias (undefined = not computed): grad_x's column sums, of the values stored, in float, fixed order */ \
  void bias_gelu_backward(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& bias, bool tanh,     \
                          const at::Tensor& grad_x, const at::Tensor& grad_bias);                             \
  /* out = residual + dropout(x + bias) */                                                                    \
  void bias_dropout_add_forward(const at::Tensor& x, const at::Tensor& bias, const at::Tensor& residual,      \
                                const DropoutArgs& dropout, const at::Tensor& out);                           \
  /* out = x * mask * scale (dropout; also the backward of every dropout of the same seed/offset) */        \
  void dropout(const at::Tensor& x, const DropoutArgs& dropout, const at::Tensor& out);                      \
  /* mask (bool) = keep flags of elements 0 .. numel-1 */                                                     \
  void dropout_mask(const DropoutArgs& dropout, const at::Tensor& mask);                                      \
  /* pre_norm = residual + dropout(x + bias); out = layer_norm(pre_norm) * weight + ln_bias; keep_bits     */ \
  /* (CPU only; undefined = not stored): uint8 [rows, ceil(hidden / 8)], bit j % 8 of byte j / 8 of row r  */ \
  /* = element (r, j) kept. x: pre_norm's dtype, or bfloat16/float16 beside a float32 stream, read as      */ \
  /* float; the same for rms_norm_forward's x beside sum                                                    */ \
  /* out: pre_norm's dtype or bfloat16/float16 beside a float32 one (issue 32: out_dtype); out2           */ \
  /* (undefined = none): out again, bfloat16/float16 beside a float32 out (the dual op)                     */ \
  void layer_norm_forward(const at::Tensor& x, const at::Tensor& bias, const at::Tensor& residual,            \
                          const DropoutArgs& dropout, const at::Tensor& weight, const at::Tensor& ln_bias,    \
                          double eps, const at::Tensor& out, const at::Tensor& pre_norm,                      \
                          const at::Tensor& mean, const at::Tensor& rstd, const at::Tensor& keep_bits,        \
                          const at::Tensor& out2);                                                            \
  /* grad_pre = d(out)/d(pre_norm)^T grad_out (+ grad_pre_norm); grad_x = grad_pre * mask * scale if       */ \
  /* grad_x is defined, the mask read from keep_bits where defined (CPU only), else regenerated;            */ \
  /* grad_weight/grad_ln_bias summed over rows in float; grad_bias (only with grad_x; undefined = not      */ \
  /* computed): grad_x's column sums, of the values stored, in float. grad_x may be bfloat16 /            */ \
  /* float16 beside a float32 pre_norm: rounded once from the float value, which grad_bias sums            */ \
  /* grad_out: pre_norm's dtype or a lower-precision out's; grad_out2 (undefined = none): a second        */ \
  /* gradient of out (of out2; or the fanout's, in pre_norm's dtype), added to grad_out as autograd       */ \
  /* adds them: in pre_norm's dtype                                                                       */ \
  void layer_norm_backward(const at::Tensor& grad_out, const at::Tensor& grad_pre_norm,                      \
                           const at::Tensor& pre_norm, const at::Tensor& weight, const at::Tensor& mean,      \
                           const at::Tensor& rstd, const DropoutArgs& dropout, const at::Tensor& keep_bits,   \
                           const at::Tensor& grad_pre, const at::Tensor& grad_x,                              \
                           const at::Tensor& grad_weight, const at::Tensor& grad_ln_bias,                     \
                           const at::Tensor& grad_bias, const at::Tensor& grad_out2);                         \
  /* sum = x + residual; out = weight * to_dtype(float(sum) * rstd) (Hugging Face LlamaRMSNorm) */           \
  void rms_norm_forward(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,           \
                        double eps, const at::Tensor& out, const at::Tensor& sum, const at::Tensor& rstd);    \
  /* grad_out, grad_out2 (undefined = none; either dtype): sum's dtype or, beside a float32 sum, bfloat16 / */ \
  /* float16, read as float; grad_out2 added to grad_out as autograd adds the two (in sum's dtype). The    */ \
  /* forwards' out may be bfloat16/float16 beside a float32 stream the same way                            */ \
  void rms_norm_backward(const at::Tensor& grad_out, const at::Tensor& grad_out2, const at::Tensor& grad_sum, \
                         const at::Tensor& sum, const at::Tensor& weight, const at::Tensor& rstd,             \
                         const at::Tensor& grad_input, const at::Tensor& grad_weight);                        \
  /* out = silu(gate) * up */                                                                                 \
  void swiglu_forward(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& out);                  \
  void swiglu_backward(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& up,                 \
                       const at::Tensor& grad_gate, const at::Tensor& grad_up);                               \
  /* out = gelu(gate) * up (GeGLU; tanh: the tanh-approximated GELU) */                                     \
  void geglu_forward(const at::Tensor& gate, const at::Tensor& up, bool tanh, const at::Tensor& out);       \
  void geglu_backward(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& up, bool tanh,      \
                      const at::Tensor& grad_gate, const at::Tensor& grad_up);                                \
  /* The backwards above that also write the forward's output `act` (issue 33: the replay of a segment's  */ \
  /* last layer), computed by the forward's element function (its bits); each output may be any of the    */ \
  /* inputs (an element's inputs are read before its outputs are written)                                 */ \
  void swiglu_backward_act(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& up,             \
                           const at::Tensor& grad_gate, const at::Tensor& grad_up, const at::Tensor& act);    \
  void geglu_backward_act(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& up, bool tanh,  \
                          const at::Tensor& grad_gate, const at::Tensor& grad_up, const at::Tensor& act);     \
  void bias_gelu_backward_act(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& bias, bool tanh, \
                              const at::Tensor& grad_x, const at::Tensor& grad_bias, const at::Tensor& act);  \
  /* x, out: [B, H, S, D] with any strides but a contiguous last dim; cos, sin: [B or 1, S, D] contiguous. */ \
  /* forward: out = x * cos + rotate_half(x) * sin; backward: its transpose applied to x (= grad).        */ \
  void rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool backward,              \
              const at::Tensor& out);

namespace cpu {
CKPT_EXT_FUSED_KERNEL_DECLS
}  // namespace cpu

namespace cuda {
CKPT_EXT_FUSED_KERNEL_DECLS
}  // namespace cuda

}  // namespace kernels
}  // namespace ckpt_ext
