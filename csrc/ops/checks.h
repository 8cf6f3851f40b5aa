// Argument checks and output allocation shared by the op groups (elementwise.cpp, norms.cpp); every
// message names the op and the argument. Kernels (kernels/kernels.h) assume what these checks establish.
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/string_view.h>

#include <optional>
#include <string>
#include <vector>

#include "../common/checks.h"
#include "../common/optional.h"
#include "../kernels/kernels.h"

// The kernel of `device`'s backend (CPU, or CUDA in CUDA builds).
#ifdef CKPT_EXT_WITH_CUDA
#define CKPT_EXT_LAUNCH(device, kernel, ...) \
  ((device).is_cuda() ? kernels::cuda::kernel(__VA_ARGS__) : kernels::cpu::kernel(__VA_ARGS__))
#else
#define CKPT_EXT_LAUNCH(device, kernel, ...) kernels::cpu::kernel(__VA_ARGS__)
#endif

namespace ckpt_ext {
namespace ops {
namespace detail {

using at::Tensor;
using kernels::DropoutArgs;

inline void check_floating(const char* op, const char* name, const Tensor& t) {
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
inline void check_like(const char* op, const char* name, const Tensor& t, const char* ref_name, const Tensor& ref) {
  TORCH_CHECK(t.device() == ref.device(), "ckpt_ext::", op, ": ", name, " must be on the device of ", ref_name, " (",
              ref.device(), "), got ", t.device());
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), "ckpt_ext::", op, ": ", name, " must have the dtype of ",
              ref_name, " (", ref.scalar_type(), "), got ", t.scalar_type(), "; cast it with .to(", ref_name,
              ".dtype)");
}

inline void check_same_shape(const char* op, const char* name, const Tensor& t, const char* ref_name,
                             const Tensor& ref) {
  check_like(op, name, t, ref_name, ref);
  TORCH_CHECK(t.sizes() == ref.sizes(), "ckpt_ext::", op, ": ", name, " must have the shape of ", ref_name, " ",
              ref.sizes(), ", got ", t.sizes());
}

// A norm op's x in a lower-precision dtype than the float32 stream it joins (autocast: a GEMM's bfloat16 /
// float16 output beside a float32 residual stream, issue 32): the kernels read it as the float it converts to
// exactly. Anything else must match the stream's dtype.
inline bool is_lowp_beside_float(at::ScalarType x, at::ScalarType stream) {
  return stream == at::kFloat && (x == at::kBFloat16 || x == at::kHalf);
}

// x (a norm's or bias_dropout_add's input) against the stream tensor `ref` (its residual): the same device and
// shape, and the same dtype or a lower-precision one (is_lowp_beside_float). Returns whether x's dtype differs.
inline bool check_norm_x(const char* op, const Tensor& x, const char* ref_name, const Tensor& ref) {
  if (!is_lowp_beside_float(x.scalar_type(), ref.scalar_type())) {
    check_same_shape(op, ref_name, ref, "x", x);
    return false;
  }
  TORCH_CHECK(ref.device() == x.device(), "ckpt_ext::", op, ": ", ref_name, " must be on the device of x (",
              x.device(), "), got ", ref.device());
  TORCH_CHECK(ref.sizes() == x.sizes(), "ckpt_ext::", op, ": ", ref_name, " must have the shape of x ", x.sizes(),
              ", got ", ref.sizes());
  return true;
}

// The dtype of grad_x a norm's backward writes: x_dtype when given (the pre-norm stream's dtype, or a
// lower-precision one beside float32: is_lowp_beside_float), else the stream's.
inline at::ScalarType check_grad_x_dtype(const char* op, const std::optional<at::ScalarType>& x_dtype,
                                         const Tensor& pre) {
  const auto stream = pre.scalar_type();
  if (!x_dtype.has_value() || *x_dtype == stream) return stream;
  TORCH_CHECK(is_lowp_beside_float(*x_dtype, stream), "ckpt_ext::", op,
              ": x_dtype must be the pre-norm tensor's dtype (", stream,
              ") or, beside a float32 stream, bfloat16 or float16; got ", *x_dtype);
  return *x_dtype;
}

// A per-feature vector (bias, weight) of length `hidden`, like `ref`.
inline void check_vector(const char* op, const char* name, const Tensor& t, int64_t hidden, const char* ref_name,
                         const Tensor& ref) {
  check_like(op, name, t, ref_name, ref);
  ckpt_ext::check_vector(t, hidden, name, ref_name, "ckpt_ext::", op);
}

inline void check_at_least_1d(const char* op, const char* name, const Tensor& t) {
  TORCH_CHECK(t.dim() >= 1, "ckpt_ext::", op, ": ", name, " must have at least one dimension (features last)");
}

inline void check_p(const char* op, double p) {
  TORCH_CHECK(p >= 0.0 && p <= 1.0, "ckpt_ext::", op, ": dropout probability p must be in [0, 1], got ", p);
}

inline bool parse_approximate(const char* op, c10::string_view approximate) {
  TORCH_CHECK(approximate == "none" || approximate == "tanh", "ckpt_ext::", op,
              ": approximate must be 'none' or 'tanh', got '", std::string(approximate), "'");
  return approximate == "tanh";
}

// Contiguous copy of an optional tensor, or an undefined tensor when it is absent.
inline Tensor contiguous_or_undefined(const OptTensor& t) { return present(t) ? t->contiguous() : Tensor(); }

// Per-row statistics (mean, rstd): shape = input shape without the last dim, dtype float32 (float64 for
// float64 inputs).
inline Tensor empty_row_stats(const Tensor& x) {
  const auto sizes = x.sizes();
  return at::empty(std::vector<int64_t>(sizes.begin(), sizes.end() - 1),
                   x.options().dtype(at::toOpMathType(x.scalar_type())));
}

inline void check_row_stats(const char* op, const char* name, const Tensor& t, const Tensor& pre) {
  const auto sizes = pre.sizes();
  const std::vector<int64_t> want(sizes.begin(), sizes.end() - 1);
  const auto dt = at::toOpMathType(pre.scalar_type());
  TORCH_CHECK(t.device() == pre.device() && t.scalar_type() == dt && t.sizes() == c10::IntArrayRef(want),
              "ckpt_ext::", op, ": ", name, " must be the ", dt, " tensor of shape ", c10::IntArrayRef(want),
              " returned by the forward op, got ", t.scalar_type(), " ", t.sizes(), " on ", t.device());
}

// The keep bits a LayerNorm with dropout stores on CPU (kernels.h): uint8 [*rows, ceil(hidden / 8)]; where
// not stored (CUDA, p == 0, an *_into call) an empty uint8 tensor of shape [0].
inline std::vector<int64_t> keep_bits_shape(const Tensor& x) {
  const auto sizes = x.sizes();
  std::vector<int64_t> shape(sizes.begin(), sizes.end() - 1);
  shape.push_back((x.size(-1) + 7) / 8);
  return shape;
}

inline bool stores_keep_bits(const Tensor& x, double p) { return x.device().is_cpu() && p > 0.0; }

// The keep bits a forward op returns: stored ones to be written, else the empty tensor.
inline Tensor empty_keep_bits(const Tensor& x, bool stored) {
  return at::empty(stored ? keep_bits_shape(x) : std::vector<int64_t>{0}, x.options().dtype(at::kByte));
}

// keep_bits handed to a backward op: absent or empty (the mask is regenerated), or exactly what the CPU
// forward returned for this pre-norm tensor and p. Returns whether they are to be read.
inline bool check_keep_bits(const char* op, const OptTensor& bits, const Tensor& pre, double p) {
  if (!bits.has_value() || !bits->defined() || (bits->dim() == 1 && bits->size(0) == 0)) return false;
  const auto want = keep_bits_shape(pre);
  TORCH_CHECK(stores_keep_bits(pre, p),
              "ckpt_ext::", op, ": keep_bits are stored only by the CPU forward with dropout (p > 0); got keep_bits ",
              bits->sizes(), " for ", pre.device(), " tensors and p = ", p,
              ". Pass None, or the forward's keep_bits as returned (empty where it stored none)");
  TORCH_CHECK(bits->device() == pre.device() && bits->scalar_type() == at::kByte &&
                  bits->sizes() == c10::IntArrayRef(want) && bits->is_contiguous(),
              "ckpt_ext::", op, ": keep_bits must be the contiguous uint8 tensor of shape ", c10::IntArrayRef(want),
              " returned by the forward op (one bit per element, rows padded to bytes), got ", bits->scalar_type(), " ",
              bits->sizes(), " on ", bits->device(), ". Pass None to regenerate the mask");
  return true;
}

inline void check_hidden(const char* op, const char* name, const Tensor& t) {
  check_at_least_1d(op, name, t);
  TORCH_CHECK(t.size(-1) > 0, "ckpt_ext::", op, ": the last (normalised) dimension of ", name, " must be non-empty");
}

// A caller-provided output (the *_into entry points) must be where the kernel would write its own.
inline void check_out(const char* op, const Tensor& out, const Tensor& x) {
  check_same_shape(op, "out", out, "x", x);
  TORCH_CHECK(out.is_contiguous(), "ckpt_ext::", op, ": out must be contiguous");
}

}  // namespace detail
}  // namespace ops
}  // namespace ckpt_ext
