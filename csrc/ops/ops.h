// C++ entry points of the ckpt_ext ops, for C++ code that runs them (the fused layers in csrc/layers/);
// defined in schemas.cpp, the *_into variants with their op group (elementwise.cpp, norms.cpp).
//
// The functions in ckpt_ext::ops call the registered ops through the dispatcher, exactly as
// torch.ops.ckpt_ext.* does from Python: the C++ autograd kernels (autograd.cpp) record
// gradients, and fake/meta tensors and tracing see the ops. The *_into variants are the exception:
// they check their arguments like the ops, then launch the kernel directly into a caller-provided
// output (for example a BoundaryPool slot), without autograd; use them only under no_grad.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>
#include <c10/util/string_view.h>

#include <cstdint>
#include <optional>
#include <tuple>

#include "../common/optional.h"

namespace ckpt_ext {
namespace ops {

// Dropout seeds and offsets are SymInts in the schemas, so that torch.compile can pass them as graph
// inputs instead of recompiling for each value; C++ callers pass plain int64_t (converted implicitly).
using at::Tensor;

Tensor bias_gelu(const Tensor& x, const OptTensor& bias, c10::string_view approximate);
// grad_bias: also the bias's gradient (grad_x summed over rows in the kernel's pass; else the second output is
// empty).
std::tuple<Tensor, Tensor> bias_gelu_backward(const Tensor& grad, const Tensor& x, const OptTensor& bias,
                                              c10::string_view approximate, bool grad_bias = false);
// x may be bfloat16/float16 beside a float32 residual (autocast's residual stream; the bias then float32 too):
// computed in float as for a float32 x, the result float32.
Tensor bias_dropout_add(const Tensor& x, const OptTensor& bias, const Tensor& residual, double p, c10::SymInt seed,
                        c10::SymInt offset);
// x * mask / (1 - p) with the mask of (seed, offset): forward dropout, and the backward of any dropout.
// dtype: the result's (default x's); a float32 x may give bfloat16/float16, rounded once from the float result.
Tensor dropout(const Tensor& x, double p, c10::SymInt seed, c10::SymInt offset,
               std::optional<at::ScalarType> dtype = std::nullopt);
// (out, pre_norm, mean, rstd, keep_bits): x in residual's dtype or, beside a float32 residual (autocast: a
// GEMM's output joining the stream), bfloat16/float16, read as float; out and pre_norm in residual's dtype, or out
// in out_dtype: bfloat16/float16 beside a float32 residual (issue 32: an out that only feeds GEMMs, written in
// their dtype, the float result rounded once; its gradient then comes in that dtype, read as float).
// keep_bits is the dropout mask, one bit per element, stored by the
// CPU kernel when p > 0 for the backward to read (uint8 [*rows, ceil(hidden / 8)]); elsewhere empty ([0]).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> bias_dropout_add_layer_norm(
    const Tensor& x, const OptTensor& bias, const Tensor& residual, const Tensor& weight, const OptTensor& ln_bias,
    double p, double eps, c10::SymInt seed, c10::SymInt offset,
    std::optional<at::ScalarType> out_dtype = std::nullopt);
// keep_bits: the forward's (read instead of regenerating the mask), or absent/empty (regenerated).
// grad_bias: also return the dense bias's gradient (grad_x summed over rows, in the kernel's pass; else the
// fifth output is empty). x_dtype: grad_x's dtype, x's in the forward (absent: pre_norm's; a lower-precision
// one beside a float32 pre_norm: rounded once from the float gradient, the bias gradient summed in float).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> bias_dropout_add_layer_norm_backward(
    const Tensor& grad_out, const OptTensor& grad_pre_norm, const Tensor& pre_norm, const Tensor& weight,
    const Tensor& mean, const Tensor& rstd, double p, c10::SymInt seed, c10::SymInt offset,
    const OptTensor& keep_bits = std::nullopt, bool grad_bias = false,
    std::optional<at::ScalarType> x_dtype = std::nullopt, const OptTensor& grad_out2 = std::nullopt);
// (out, out2, pre_norm, mean, rstd, keep_bits): bias_dropout_add_layer_norm (out in the stream's dtype) with its out
// also written in out2_dtype (bfloat16/float16 beside a float32 stream: the float value rounded once; issue 32: BERT's
// h1, the float32 residual of the next norm and the input of a GEMM). Backward: out2's gradient, read as float, added
// to out's (the backward op's grad_out2), as autograd adds the float gradient of a cast.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> bias_dropout_add_layer_norm_dual(
    const Tensor& x, const OptTensor& bias, const Tensor& residual, const Tensor& weight, const OptTensor& ln_bias,
    double p, double eps, c10::SymInt seed, c10::SymInt offset, at::ScalarType out2_dtype);
// No schema of its own (C++ callers, the layers): bias_dropout_add_layer_norm with out handed out twice, (out, out2,
// pre_norm, mean, rstd, keep_bits), out2 an alias of out, for an out with two uses (issue 32: BERT's h1, the input of a
// GEMM and the next norm's residual): autograd then hands the op's backward the two gradients, which it adds (the
// backward op's grad_out2: CPU kernels row by row in out's dtype, the bits of autograd's add; CUDA one add before
// the kernel) instead of a separate add of autograd's.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> bias_dropout_add_layer_norm_fanout(
    const Tensor& x, const OptTensor& bias, const Tensor& residual, const Tensor& weight, const OptTensor& ln_bias,
    double p, double eps, int64_t seed, int64_t offset);
std::tuple<Tensor, Tensor, Tensor, Tensor> add_layer_norm(const Tensor& x, const OptTensor& residual,
                                                          const Tensor& weight, const OptTensor& bias, double eps);
std::tuple<Tensor, Tensor, Tensor> add_layer_norm_backward(const Tensor& grad_out, const OptTensor& grad_sum,
                                                           const Tensor& sum, const Tensor& weight,
                                                           const Tensor& mean, const Tensor& rstd);
// x in the stream's dtype (residual's, else weight's) or, beside a float32 stream, bfloat16/float16, read as
// float; out and sum in the stream's dtype, x's gradient (autograd) in x's. out_dtype: out's dtype, as
// bias_dropout_add_layer_norm's.
std::tuple<Tensor, Tensor, Tensor> add_rms_norm(const Tensor& x, const OptTensor& residual, const Tensor& weight,
                                                double eps, std::optional<at::ScalarType> out_dtype = std::nullopt);
// grad_out, grad_out2 (optional, a second gradient of out, added in float): sum's dtype or out_dtype's.
std::tuple<Tensor, Tensor> add_rms_norm_backward(const Tensor& grad_out, const OptTensor& grad_sum, const Tensor& sum,
                                                 const Tensor& weight, const Tensor& rstd,
                                                 const OptTensor& grad_out2 = std::nullopt);
// No schema of its own (C++ callers, the layers): add_rms_norm with out in out_dtype handed out twice, (out, out2,
// sum, rstd), out2 an alias of out, for an out that feeds two GEMMs: autograd then hands the op's backward the two
// gradients, which it adds in float (add_rms_norm_backward's grad_out2), as it added the float gradients of a float
// out cast twice -- where summing them in out_dtype (one handle) would round.
std::tuple<Tensor, Tensor, Tensor, Tensor> add_rms_norm_fanout(const Tensor& x, const OptTensor& residual,
                                                               const Tensor& weight, double eps,
                                                               at::ScalarType out_dtype);
Tensor swiglu(const Tensor& gate, const Tensor& up);
std::tuple<Tensor, Tensor> swiglu_backward(const Tensor& grad, const Tensor& gate, const Tensor& up);
// approximate: "tanh" (GELUTanh, Gemma's gelu_pytorch_tanh) or "none" (exact GELU).
Tensor geglu(const Tensor& gate, const Tensor& up, c10::string_view approximate);
std::tuple<Tensor, Tensor> geglu_backward(const Tensor& grad, const Tensor& gate, const Tensor& up,
                                          c10::string_view approximate);
// The backwards above that also write the forward's output (the same bits), in place (issue 33): swiglu / geglu:
// grad becomes the activation of (gate, up), gate and up their gradients; bias_gelu: grad becomes x's gradient, x
// the activation (returns the bias's gradient, empty without grad_bias). Every tensor written must be contiguous.
void swiglu_backward_act_(Tensor& grad, Tensor& gate, Tensor& up);
void geglu_backward_act_(Tensor& grad, Tensor& gate, Tensor& up, c10::string_view approximate);
Tensor bias_gelu_backward_act_(Tensor& grad, Tensor& x, const OptTensor& bias, c10::string_view approximate,
                               bool grad_bias = false);
Tensor rotary(const Tensor& x, const Tensor& cos, const Tensor& sin);
Tensor rotary_backward(const Tensor& grad, const Tensor& cos, const Tensor& sin);

// No autograd: bias_dropout_add with its result written into `out` (contiguous, x's shape and device, the
// residual's dtype).
void bias_dropout_add_into(const Tensor& x, const OptTensor& bias, const Tensor& residual, double p, int64_t seed,
                           int64_t offset, const Tensor& out);
// No autograd: bias_dropout_add_layer_norm with `out` written into the given tensor (contiguous, x's
// shape, dtype and device); returns (pre_norm, mean, rstd).
std::tuple<Tensor, Tensor, Tensor> bias_dropout_add_layer_norm_into(const Tensor& x, const OptTensor& bias,
                                                                    const Tensor& residual, const Tensor& weight,
                                                                    const OptTensor& ln_bias, double p, double eps,
                                                                    int64_t seed, int64_t offset, const Tensor& out);

}  // namespace ops
}  // namespace ckpt_ext
