// Activation math shared by the CPU and CUDA kernels (one header for host and device, as philox.h):
// GELU (exact and tanh-approximated), its derivative, and the sigmoid of SiLU/SwiGLU. `A` is the
// accumulation type: float, or double for the CPU's float64 kernels.
#pragma once

#include <math.h>

#include "host_device.h"

namespace ckpt_ext {
namespace kernels {
namespace math {

// The C functions by precision: ::tanhf and friends exist on the host and, under nvcc, on the device.
CKPT_HOST_DEVICE float tanh_(float x) { return ::tanhf(x); }
CKPT_HOST_DEVICE double tanh_(double x) { return ::tanh(x); }
CKPT_HOST_DEVICE float erf_(float x) { return ::erff(x); }
CKPT_HOST_DEVICE double erf_(double x) { return ::erf(x); }
CKPT_HOST_DEVICE float exp_(float x) { return ::expf(x); }
CKPT_HOST_DEVICE double exp_(double x) { return ::exp(x); }

constexpr double kSqrt2OverPi = M_SQRT2 * M_2_SQRTPI * 0.5;        // sqrt(2 / pi)
constexpr double kInvSqrt2Pi = M_2_SQRTPI * M_SQRT1_2 * 0.5;       // 1 / sqrt(2 pi)
constexpr double kGeluKappa = 0.044715;

template <typename A>
CKPT_HOST_DEVICE A gelu(A x, bool tanh_approx) {
  if (tanh_approx) {
    const A inner = A(kSqrt2OverPi) * (x + A(kGeluKappa) * x * x * x);
    return A(0.5) * x * (A(1) + tanh_(inner));
  }
  return A(0.5) * x * (A(1) + erf_(x * A(M_SQRT1_2)));
}

template <typename A>
CKPT_HOST_DEVICE A gelu_derivative(A x, bool tanh_approx) {
  if (tanh_approx) {
    const A beta = A(kSqrt2OverPi), kappa = A(kGeluKappa);
    const A t = tanh_(beta * (x + kappa * x * x * x));
    return A(0.5) * (A(1) + t) + A(0.5) * x * (A(1) - t * t) * beta * (A(1) + A(3) * kappa * x * x);
  }
  const A cdf = A(0.5) * (A(1) + erf_(x * A(M_SQRT1_2)));
  const A pdf = exp_(A(-0.5) * x * x) * A(kInvSqrt2Pi);
  return cdf + x * pdf;
}

template <typename A>
CKPT_HOST_DEVICE A sigmoid(A x) {
  return A(1) / (A(1) + exp_(-x));
}

}  // namespace math
}  // namespace kernels
}  // namespace ckpt_ext
