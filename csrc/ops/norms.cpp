// The row-wise norm ops: bias_dropout_add_layer_norm, add_layer_norm, add_rms_norm (and their backward
// ops): argument checks, output allocation, CPU/CUDA registration. Schemas: schemas.cpp; autograd:
// autograd.cpp; kernels: kernels/{cpu,cuda}/norms. Row statistics (mean, rstd) are float32 (float64
// for float64 inputs).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "checks.h"
#include "ops.h"

namespace ckpt_ext {
namespace {

using namespace ops::detail;

// out_dtype (issue 32): the dtype of a norm's normalised output, the stream's (absent, or equal) or, beside a
// float32 stream, bfloat16/float16 (autocast: an output that only feeds GEMMs, written in their dtype: the float
// result rounded once, as .to(dtype)). Returns the dtype to allocate.
at::ScalarType check_out_dtype(const char* op, const std::optional<at::ScalarType>& out_dtype, at::ScalarType stream) {
  if (!out_dtype.has_value() || *out_dtype == stream) return stream;
  TORCH_CHECK(is_lowp_beside_float(*out_dtype, stream), "ckpt_ext::", op,
              ": out_dtype must be the stream's dtype (", stream, ") or, beside a float32 stream, bfloat16 or "
              "float16; got ", *out_dtype);
  return *out_dtype;
}

// A norm backward's grad_out against its stream tensor `ref` (the pre-norm sum): ref's dtype, or the lower-precision
// dtype of an output written in out_dtype (the kernels read it as float, exact). The same device and shape.
void check_grad_out(const char* op, const char* name, const Tensor& g, const char* ref_name, const Tensor& ref) {
  if (!is_lowp_beside_float(g.scalar_type(), ref.scalar_type())) {
    check_same_shape(op, name, g, ref_name, ref);
    return;
  }
  TORCH_CHECK(g.device() == ref.device(), "ckpt_ext::", op, ": ", name, " must be on the device of ", ref_name, " (",
              ref.device(), "), got ", g.device());
  TORCH_CHECK(g.sizes() == ref.sizes(), "ckpt_ext::", op, ": ", name, " must have the shape of ", ref_name, " ",
              ref.sizes(), ", got ", g.sizes());
}

// `out`: where to write the normalised output; undefined = allocate it (and, where the kernel stores them,
// the keep bits: the *_into calls run without autograd, so nothing would read them).
// x may be in a lower-precision dtype than the float32 stream (residual, weights: check_norm_x): out and
// pre_norm are in the stream's dtype, and the kernels read x as float (exact; CUDA rows wider than its register
// kernels convert it first).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> bias_dropout_add_layer_norm_impl(
    const Tensor& x, const OptTensor& bias, const Tensor& residual, const Tensor& weight, const OptTensor& ln_bias,
    double p, double eps, int64_t seed, int64_t offset, Tensor out,
    const std::optional<at::ScalarType>& out_dtype = std::nullopt, Tensor* out2 = nullptr,
    at::ScalarType out2_dtype = at::kFloat) {
  const char* op = "bias_dropout_add_layer_norm";
  check_floating(op, "x", x);
  check_hidden(op, "x", x);
  const bool mixed = check_norm_x(op, x, "residual", residual);
  // The stream's dtype: every other tensor is checked against it (x itself when not mixed, as the messages say).
  const Tensor& ref = mixed ? residual : x;
  const char* ref_name = mixed ? "residual" : "x";
  const int64_t hidden = x.size(-1);
  check_vector(op, "weight", weight, hidden, ref_name, ref);
  if (present(bias)) check_vector(op, "bias", *bias, hidden, ref_name, ref);
  if (present(ln_bias)) check_vector(op, "ln_bias", *ln_bias, hidden, ref_name, ref);
  check_p(op, p);
  TORCH_CHECK(eps >= 0, "ckpt_ext::", op, ": eps must be >= 0, got ", eps);
  const bool into = out.defined();
  if (into) check_out(op, out, ref);
  const auto out_type = check_out_dtype(op, out_dtype, ref.scalar_type());
  const Tensor xc = x.contiguous(), rc = residual.contiguous(), wc = weight.contiguous();
  if (!into) out = at::empty_like(rc, rc.options().dtype(out_type));
  // A lower-precision out is rounded once on the kernels' store (CPU: each row; CUDA: the register kernels, or the
  // launcher converts a float32 one for the rows they do not take). out2 (the dual op): out again in a
  // lower-precision dtype, written by the kernels beside out in the same pass (the same fallback on CUDA).
  if (out2) {
    TORCH_CHECK(is_lowp_beside_float(out2_dtype, ref.scalar_type()), "ckpt_ext::", op,
                "_dual: out2_dtype must be bfloat16 or float16 beside a float32 stream; got ", out2_dtype, " beside ",
                ref.scalar_type());
    *out2 = at::empty_like(rc, rc.options().dtype(out2_dtype));
  }
  Tensor pre_norm = at::empty_like(rc), mean = empty_row_stats(rc), rstd = empty_row_stats(rc);
  const bool store_bits = !into && stores_keep_bits(xc, p);
  Tensor keep_bits = empty_keep_bits(xc, store_bits);
  if (xc.numel() > 0) {
    CKPT_EXT_LAUNCH(x.device(), layer_norm_forward, xc, contiguous_or_undefined(bias), rc,
                    DropoutArgs{p, seed, offset}, wc, contiguous_or_undefined(ln_bias), eps, out, pre_norm, mean,
                    rstd, store_bits ? keep_bits : Tensor(), out2 ? *out2 : Tensor());
  }
  return {out, pre_norm, mean, rstd, keep_bits};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> bias_dropout_add_layer_norm(
    const Tensor& x, const OptTensor& bias, const Tensor& residual, const Tensor& weight, const OptTensor& ln_bias,
    double p, double eps, int64_t seed, int64_t offset, std::optional<at::ScalarType> out_dtype) {
  return bias_dropout_add_layer_norm_impl(x, bias, residual, weight, ln_bias, p, eps, seed, offset, Tensor(),
                                          out_dtype);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> bias_dropout_add_layer_norm_dual(
    const Tensor& x, const OptTensor& bias, const Tensor& residual, const Tensor& weight, const OptTensor& ln_bias,
    double p, double eps, int64_t seed, int64_t offset, at::ScalarType out2_dtype) {
  Tensor out2;
  auto [out, pre_norm, mean, rstd, keep_bits] = bias_dropout_add_layer_norm_impl(
      x, bias, residual, weight, ln_bias, p, eps, seed, offset, Tensor(), std::nullopt, &out2, out2_dtype);
  return {out, out2, pre_norm, mean, rstd, keep_bits};
}

// Shared by the two LayerNorm backward ops. grad_x is defined only for the dropout variant.
void layer_norm_backward_checked(const char* op, const char* pre_name, const Tensor& grad_out,
                                 const OptTensor& grad_pre_norm, const Tensor& pre_norm, const Tensor& weight,
                                 const Tensor& mean, const Tensor& rstd, const DropoutArgs& dropout,
                                 const OptTensor& keep_bits, Tensor& grad_pre, Tensor* grad_x, Tensor& grad_weight,
                                 Tensor& grad_ln_bias, Tensor* grad_bias = nullptr,
                                 const std::optional<at::ScalarType>& x_dtype = std::nullopt,
                                 const OptTensor& grad_out2 = std::nullopt) {
  check_floating(op, pre_name, pre_norm);
  check_hidden(op, pre_name, pre_norm);
  // grad_out may be in the lower-precision dtype of an out written in out_dtype (read as float)
  check_grad_out(op, "grad_out", grad_out, pre_name, pre_norm);
  if (present(grad_out2)) check_grad_out(op, "grad_out2", *grad_out2, pre_name, pre_norm);
  if (present(grad_pre_norm)) check_same_shape(op, "grad_pre_norm", *grad_pre_norm, pre_name, pre_norm);
  check_vector(op, "weight", weight, pre_norm.size(-1), pre_name, pre_norm);
  check_row_stats(op, "mean", mean, pre_norm);
  check_row_stats(op, "rstd", rstd, pre_norm);
  const bool read_bits = check_keep_bits(op, keep_bits, pre_norm, dropout.p);
  // grad_x in x's dtype: the kernels round it once from the float value, which the bias gradient sums.
  const auto gx_dtype = check_grad_x_dtype(op, x_dtype, pre_norm);
  const Tensor pc = pre_norm.contiguous();
  grad_pre = at::empty_like(pc);
  if (grad_x) *grad_x = at::empty_like(pc, pc.options().dtype(gx_dtype));
  grad_weight = at::empty_like(weight, at::MemoryFormat::Contiguous);
  grad_ln_bias = at::empty_like(weight, at::MemoryFormat::Contiguous);
  // The dense bias has the weight's length and, in the layers, the input's dtype.
  if (grad_bias) *grad_bias = at::empty({pc.size(-1)}, pc.options());
  if (pc.numel() == 0) {  // no rows: the sums over rows are zero
    grad_weight.zero_();
    grad_ln_bias.zero_();
    if (grad_bias) grad_bias->zero_();
    return;
  }
  // grad_out2 (a second gradient of out: the dual op's out2): added to grad_out in float by the kernels (CPU: row by
  // row; CUDA: the register kernels, or the launcher adds them first for the rows they do not take).
  const Tensor g2 = present(grad_out2) ? grad_out2->contiguous() : Tensor();
  CKPT_EXT_LAUNCH(pc.device(), layer_norm_backward, grad_out.contiguous(), contiguous_or_undefined(grad_pre_norm), pc,
                  weight.contiguous(), mean.contiguous(), rstd.contiguous(), dropout,
                  read_bits ? *keep_bits : Tensor(), grad_pre, grad_x ? *grad_x : Tensor(), grad_weight, grad_ln_bias,
                  grad_bias ? *grad_bias : Tensor(), g2);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> bias_dropout_add_layer_norm_backward(
    const Tensor& grad_out, const OptTensor& grad_pre_norm, const Tensor& pre_norm, const Tensor& weight,
    const Tensor& mean, const Tensor& rstd, double p, int64_t seed, int64_t offset, const OptTensor& keep_bits,
    bool want_grad_bias, std::optional<at::ScalarType> x_dtype, const OptTensor& grad_out2) {
  const char* op = "bias_dropout_add_layer_norm_backward";
  check_p(op, p);
  Tensor grad_residual, grad_x, grad_weight, grad_ln_bias, grad_bias;
  layer_norm_backward_checked(op, "pre_norm", grad_out, grad_pre_norm, pre_norm, weight, mean, rstd,
                              DropoutArgs{p, seed, offset}, keep_bits, grad_residual, &grad_x, grad_weight,
                              grad_ln_bias, want_grad_bias ? &grad_bias : nullptr, x_dtype, grad_out2);
  if (!want_grad_bias) grad_bias = at::empty({0}, pre_norm.options());
  return {grad_x, grad_residual, grad_weight, grad_ln_bias, grad_bias};
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
                    weight.contiguous(), contiguous_or_undefined(bias), eps, out, sum, mean, rstd, Tensor(), Tensor());
  return {out, sum, mean, rstd};
}

std::tuple<Tensor, Tensor, Tensor> add_layer_norm_backward(const Tensor& grad_out, const OptTensor& grad_sum,
                                                           const Tensor& sum, const Tensor& weight,
                                                           const Tensor& mean, const Tensor& rstd) {
  Tensor grad_input, grad_weight, grad_bias;
  layer_norm_backward_checked("add_layer_norm_backward", "sum", grad_out, grad_sum, sum, weight, mean, rstd,
                              DropoutArgs{}, std::nullopt, grad_input, nullptr, grad_weight, grad_bias);
  return {grad_input, grad_weight, grad_bias};
}

// x may be in a lower-precision dtype than the float32 stream (residual, or weight without one: autocast's GEMM
// output joining the stream, or Qwen3's per-head norm of a projection), read as float as in
// bias_dropout_add_layer_norm; out and sum are in the stream's dtype. The CPU kernel reads it row by row, the CUDA
// register kernels in their pass (rows they do not take: the launcher converts it first).
// out_dtype: out's dtype (check_out_dtype: bfloat16/float16 beside a float32 stream, rounded once on the store).
std::tuple<Tensor, Tensor, Tensor> add_rms_norm(const Tensor& x, const OptTensor& residual, const Tensor& weight,
                                                double eps, std::optional<at::ScalarType> out_dtype) {
  const char* op = "add_rms_norm";
  check_floating(op, "x", x);
  check_hidden(op, "x", x);
  const bool mixed = present(residual) ? check_norm_x(op, x, "residual", *residual)
                                       : is_lowp_beside_float(x.scalar_type(), weight.scalar_type());
  const Tensor& ref = !mixed ? x : present(residual) ? *residual : weight;
  const char* ref_name = !mixed ? "x" : present(residual) ? "residual" : "weight";
  if (mixed && !present(residual))
    TORCH_CHECK(weight.device() == x.device(), "ckpt_ext::", op, ": weight must be on the device of x (", x.device(),
                "), got ", weight.device());
  check_vector(op, "weight", weight, x.size(-1), ref_name, ref);
  TORCH_CHECK(eps >= 0, "ckpt_ext::", op, ": eps must be >= 0, got ", eps);
  const auto stream = ref.scalar_type();
  const auto out_type = check_out_dtype(op, out_dtype, stream);
  const Tensor xc = x.contiguous();
  const auto opts = xc.options().dtype(stream);
  // A lower-precision out: the kernels round each element once on its store (CUDA rows wider than the register
  // kernels: a float32 out converted after, in the launcher).
  Tensor out = at::empty_like(xc, opts.dtype(out_type)), sum = at::empty_like(xc, opts), rstd = empty_row_stats(sum);
  if (xc.numel() > 0)
    CKPT_EXT_LAUNCH(x.device(), rms_norm_forward, xc, contiguous_or_undefined(residual), weight.contiguous(), eps, out,
                    sum, rstd);
  return {out, sum, rstd};
}

// grad_out (and grad_out2) may be in the lower-precision dtype of an out written in out_dtype, read as float;
// grad_out2: a second gradient of out (an output that feeds two GEMMs, each handed its own handle: the layers'
// add_rms_norm_fanout), added to grad_out in float, as autograd adds the two float gradients of a float out.
std::tuple<Tensor, Tensor> add_rms_norm_backward(const Tensor& grad_out, const OptTensor& grad_sum, const Tensor& sum,
                                                 const Tensor& weight, const Tensor& rstd,
                                                 const OptTensor& grad_out2) {
  const char* op = "add_rms_norm_backward";
  check_floating(op, "sum", sum);
  check_hidden(op, "sum", sum);
  check_grad_out(op, "grad_out", grad_out, "sum", sum);
  if (present(grad_out2)) check_grad_out(op, "grad_out2", *grad_out2, "sum", sum);
  if (present(grad_sum)) check_same_shape(op, "grad_sum", *grad_sum, "sum", sum);
  check_vector(op, "weight", weight, sum.size(-1), "sum", sum);
  check_row_stats(op, "rstd", rstd, sum);
  const Tensor sc = sum.contiguous();
  Tensor grad_input = at::empty_like(sc), grad_weight = at::empty_like(weight, at::MemoryFormat::Contiguous);
  // The kernels read a lower-precision grad_out as float and add grad_out2 (either dtype) as autograd adds the two
  // gradients (CPU: row by row; CUDA: the register kernels, or the launcher adds them first for rows they do not take).
  const Tensor g2 = present(grad_out2) ? grad_out2->contiguous() : Tensor();
  if (sc.numel() > 0)
    CKPT_EXT_LAUNCH(sc.device(), rms_norm_backward, grad_out.contiguous(), g2,
                    contiguous_or_undefined(grad_sum), sc, weight.contiguous(), rstd.contiguous(), grad_input,
                    grad_weight);
  else
    grad_weight.zero_();
  return {grad_input, grad_weight};
}

}  // namespace
}  // namespace ckpt_ext

namespace ckpt_ext {
namespace ops {

std::tuple<Tensor, Tensor, Tensor> bias_dropout_add_layer_norm_into(const Tensor& x, const OptTensor& bias,
                                                                    const Tensor& residual, const Tensor& weight,
                                                                    const OptTensor& ln_bias, double p, double eps,
                                                                    int64_t seed, int64_t offset, const Tensor& out) {
  TORCH_CHECK(out.defined(), "ckpt_ext::bias_dropout_add_layer_norm_into: out must be a tensor");
  auto r = ckpt_ext::bias_dropout_add_layer_norm_impl(x, bias, residual, weight, ln_bias, p, eps, seed, offset, out,
                                                      std::nullopt);
  return {std::get<1>(r), std::get<2>(r), std::get<3>(r)};
}

}  // namespace ops
}  // namespace ckpt_ext

// The same checked functions serve both backends; CKPT_EXT_LAUNCH picks the kernel by device.
#define CKPT_EXT_IMPL(m)                                                                           \
  m.impl("bias_dropout_add_layer_norm", &ckpt_ext::bias_dropout_add_layer_norm);                   \
  m.impl("bias_dropout_add_layer_norm_dual", &ckpt_ext::bias_dropout_add_layer_norm_dual);         \
  m.impl("bias_dropout_add_layer_norm_backward", &ckpt_ext::bias_dropout_add_layer_norm_backward); \
  m.impl("add_layer_norm", &ckpt_ext::add_layer_norm);                                             \
  m.impl("add_layer_norm_backward", &ckpt_ext::add_layer_norm_backward);                           \
  m.impl("add_rms_norm", &ckpt_ext::add_rms_norm);                                                 \
  m.impl("add_rms_norm_backward", &ckpt_ext::add_rms_norm_backward)

TORCH_LIBRARY_IMPL(ckpt_ext, CPU, m) { CKPT_EXT_IMPL(m); }

// Only in CUDA builds (setup.py defines CKPT_EXT_WITH_CUDA and compiles kernels/cuda/*.cu).
#ifdef CKPT_EXT_WITH_CUDA
TORCH_LIBRARY_IMPL(ckpt_ext, CUDA, m) { CKPT_EXT_IMPL(m); }
#endif
#undef CKPT_EXT_IMPL
