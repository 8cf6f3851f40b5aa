// The SIMD CPU kernels (at::vec::Vectorized): one implementation (vec_impl.h) compiled once per x86
// instruction set -- vec_avx2.cpp, vec_avx512.cpp, as ATen compiles its own kernels -- and picked at run
// time by vec_kernels<T>() from ATen's CPU capability (ATEN_CPU_CAPABILITY overrides it, as for ATen).
// They work on raw pointers over one contiguous segment or one row; elementwise.cpp and norms.cpp split
// the work (at::parallel_for), draw the dropout words, and fall back to their portable loops where
// vec_kernels<T>() is nullptr (float64, a CPU or build without AVX2).
//
// Same arithmetic as the portable loops: float math, one rounding on store, the norms' row sums in
// double, dropped elements stored as +0, dropout masks from the same Philox words.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace ckpt_ext {
namespace kernels {
namespace cpu {

// A dropout applied to a segment: element k is kept iff (words[k] >> 8) >= threshold; kept elements are
// multiplied by scale. words == nullptr: no dropout.
struct VecDropout {
  const uint32_t* words;
  uint32_t threshold;
  float scale;
};

// One row of the LayerNorm / RMSNorm kernels (pointers at the row; nullptr where absent).
template <typename T>
struct NormRow {
  const T* x;          // forward input / backward: the stored pre-norm (sum) row
  const T* bias;       // forward: bias added to x before dropout
  const T* residual;   // forward: added after dropout
  const T* grad;       // backward: grad_out
  const T* grad_pre;   // backward: gradient flowing into the pre-norm tensor directly
  const float* weight;  // the norm's weight and bias in float (norms.cpp converts them once per call)
  const float* ln_bias;
  T* out;              // forward: normalised output / backward: grad of the pre-norm tensor
  T* pre;              // forward: stored pre-norm tensor / backward: grad_x (dropout applied), may be null
  float* partial_w;    // backward: per-chunk grad_weight accumulators (float)
  float* partial_b;    // backward: per-chunk grad_ln_bias accumulators (float), LayerNorm only
  float* partial_x;    // backward: per-chunk column sums of grad_x as stored (float), LayerNorm only, may be null
  float* scratch;      // forward: hidden floats (the rounded pre-norm row in float)
  int64_t hidden;
  double eps;
  float mean;          // forward: written / backward: read
  float rstd;
  VecDropout drop;
};

template <typename T>
struct VecKernels {
  using Scalar = T;
  void (*bias_gelu)(const T* x, const T* bias, T* out, int64_t n, bool tanh);
  void (*bias_gelu_backward)(const T* grad, const T* x, const T* bias, T* grad_x, int64_t n, bool tanh);
  void (*bias_dropout_add)(const T* x, const T* bias, const T* residual, T* out, int64_t n, VecDropout d);
  void (*dropout)(const T* x, T* out, int64_t n, VecDropout d);
  void (*swiglu)(const T* gate, const T* up, T* out, int64_t n);
  void (*swiglu_backward)(const T* grad, const T* gate, const T* up, T* grad_gate, T* grad_up, int64_t n);
  void (*geglu)(const T* gate, const T* up, T* out, int64_t n, bool tanh);
  void (*geglu_backward)(const T* grad, const T* gate, const T* up, T* grad_gate, T* grad_up, int64_t n, bool tanh);
  // one row of `2 * half` elements: y = x * cos + rotate_half(x) * sin, or its transpose (backward)
  void (*rotary)(const T* x, const T* cos, const T* sin, T* y, int64_t half, bool backward);
  void (*layer_norm_forward)(NormRow<T>& row);
  void (*layer_norm_backward)(NormRow<T>& row);
  void (*rms_norm_forward)(NormRow<T>& row);
  void (*rms_norm_backward)(NormRow<T>& row);
  // Autocast's float32 residual stream (T = float only; nullptr for the other T): bias_dropout_add with x in
  // bfloat16 / float16, and dropout writing bfloat16 / float16.
  void (*bias_dropout_add_x_bf16)(const c10::BFloat16* x, const T* bias, const T* residual, T* out, int64_t n,
                                  VecDropout d);
  void (*bias_dropout_add_x_half)(const c10::Half* x, const T* bias, const T* residual, T* out, int64_t n,
                                  VecDropout d);
  void (*dropout_to_bf16)(const T* x, c10::BFloat16* out, int64_t n, VecDropout d);
  void (*dropout_to_half)(const T* x, c10::Half* out, int64_t n, VecDropout d);
};

// The kernels for this CPU, or nullptr (then the portable loops run).
template <typename T>
const VecKernels<T>* vec_kernels();

#define CKPT_EXT_VEC_TABLES(ns)                  \
  namespace ns {                                 \
  template <typename T>                          \
  const VecKernels<T>* table();                  \
  extern template const VecKernels<float>* table<float>();             \
  extern template const VecKernels<c10::BFloat16>* table<c10::BFloat16>(); \
  extern template const VecKernels<c10::Half>* table<c10::Half>();     \
  }

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define CKPT_EXT_VEC_X86 1
CKPT_EXT_VEC_TABLES(avx2)
CKPT_EXT_VEC_TABLES(avx512)
#endif

}  // namespace cpu
}  // namespace kernels
}  // namespace ckpt_ext
