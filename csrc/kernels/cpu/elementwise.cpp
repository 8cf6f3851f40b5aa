// CPU elementwise kernels: bias+GELU, bias+dropout+residual, dropout and its mask, SwiGLU, GeGLU, rotary
// (declared in kernels/kernels.h; the norms are in norms.cpp).
//
// Every dtype (float32, float64, float16, bfloat16) computes in at::opmath_type (float, or double for
// float64) and rounds once when it stores. Work is split with at::parallel_for. float32, bfloat16 and
// float16 run the SIMD kernels of vec.h where the CPU has AVX2 (with_vec); the loops below are the
// portable path (float64, other CPUs).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/gelu_backward.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/silu_backward.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "../math.h"
#include "common.h"

namespace ckpt_ext {
namespace kernels {
namespace cpu {
namespace {

using math::gelu;
using math::gelu_derivative;
using math::sigmoid;

// Portable path: float32 / float64 are their own accumulation type, so ATen's vectorized kernels (SIMD
// erf, tanh, exp) compute what the scalar loops below compute, in the same precision (up to the last bit
// of those functions), an order of magnitude faster than std::erf/std::exp per element. The scalar loops
// serve float16 / bfloat16 on CPUs without the SIMD kernels, computing in float and rounding once.
bool aten_vectorized(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble;
}

c10::string_view gelu_kind(bool tanh) { return tanh ? "tanh" : "none"; }

}  // namespace

// ---- elementwise ----------------------------------------------------------------------------------------

void bias_gelu_forward(const at::Tensor& x, const at::Tensor& bias, bool tanh, const at::Tensor& out) {
  if (with_vec(x.scalar_type(), [&](const auto& k) {
        using T = typename std::decay_t<decltype(k)>::Scalar;
        const T* xp = x.const_data_ptr<T>();
        const T* bp = ptr_or_null<T>(bias);
        T* op = out.mutable_data_ptr<T>();
        for_segments(x.numel(), x.size(-1), philox::Dropout{}, [&](int64_t i, int64_t n, int64_t col, DropoutWords&) {
          k.bias_gelu(xp + i, bp ? bp + col : nullptr, op + i, n, tanh);
        });
      }))
    return;
  if (aten_vectorized(x)) {
    at::Tensor o = out;
    if (bias.defined())
      at::add_out(o, x, bias);
    else
      o.copy_(x);
    at::gelu_(o, gelu_kind(tanh));
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "ckpt_ext::bias_gelu", [&] {
    using A = at::opmath_type<scalar_t>;
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* bp = ptr_or_null<scalar_t>(bias);
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    const int64_t hidden = x.size(-1);
    at::parallel_for(0, x.numel(), kElementGrain, [&](int64_t begin, int64_t end) {
      int64_t col = begin % hidden;
      for (int64_t i = begin; i < end; ++i) {
        const A v = static_cast<A>(xp[i]) + (bp ? static_cast<A>(bp[col]) : A(0));
        op[i] = static_cast<scalar_t>(gelu(v, tanh));
        if (++col == hidden) col = 0;
      }
    });
  });
}

namespace {

// grad_x row by row (row(base) computes the row starting at element base), and grad_bias = the column sums of
// grad_x as stored, accumulated per fixed chunk of rows (kMaxReduceChunks, in order: the same bits whatever the
// thread count) while the row is in cache.
template <typename T, typename RowFn>
void rows_with_column_sums(int64_t rows, int64_t hidden, const T* dp, const at::Tensor& grad_bias, const RowFn& row) {
  using A = at::opmath_type<T>;
  const int64_t chunks = std::max<int64_t>(1, std::min(rows, kMaxReduceChunks));
  const int64_t per = (rows + chunks - 1) / chunks;
  std::vector<A> partial(static_cast<size_t>(chunks * hidden), A(0));
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      A* p = partial.data() + c * hidden;
      for (int64_t r = c * per; r < std::min(rows, (c + 1) * per); ++r) {
        row(r * hidden);
        const T* d = dp + r * hidden;
        for (int64_t j = 0; j < hidden; ++j) p[j] += static_cast<A>(d[j]);
      }
    }
  });
  T* out = grad_bias.mutable_data_ptr<T>();
  at::parallel_for(0, hidden, kElementGrain / chunks + 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      A acc = 0;
      for (int64_t c = 0; c < chunks; ++c) acc += partial[c * hidden + j];
      out[j] = static_cast<T>(acc);
    }
  });
}

void bias_gelu_backward_with_sums(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& bias, bool tanh,
                                  const at::Tensor& grad_x, const at::Tensor& grad_bias) {
  const int64_t hidden = x.size(-1), rows = x.numel() / hidden;
  if (with_vec(x.scalar_type(), [&](const auto& k) {
        using T = typename std::decay_t<decltype(k)>::Scalar;
        const T *gp = grad.const_data_ptr<T>(), *xp = x.const_data_ptr<T>(), *bp = ptr_or_null<T>(bias);
        T* dp = grad_x.mutable_data_ptr<T>();
        rows_with_column_sums<T>(rows, hidden, dp, grad_bias, [&](int64_t base) {
          k.bias_gelu_backward(gp + base, xp + base, bp, dp + base, hidden, tanh);
        });
      }))
    return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "ckpt_ext::bias_gelu_backward", [&] {
    using A = at::opmath_type<scalar_t>;
    const scalar_t *gp = grad.const_data_ptr<scalar_t>(), *xp = x.const_data_ptr<scalar_t>(),
                   *bp = ptr_or_null<scalar_t>(bias);
    scalar_t* dp = grad_x.mutable_data_ptr<scalar_t>();
    rows_with_column_sums<scalar_t>(rows, hidden, dp, grad_bias, [&](int64_t base) {
      for (int64_t j = 0; j < hidden; ++j) {
        const A v = static_cast<A>(xp[base + j]) + (bp ? static_cast<A>(bp[j]) : A(0));
        dp[base + j] = static_cast<scalar_t>(static_cast<A>(gp[base + j]) * gelu_derivative(v, tanh));
      }
    });
  });
}

}  // namespace

void bias_gelu_backward(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& bias, bool tanh,
                        const at::Tensor& grad_x, const at::Tensor& grad_bias) {
  if (grad_bias.defined()) return bias_gelu_backward_with_sums(grad, x, bias, tanh, grad_x, grad_bias);
  if (with_vec(x.scalar_type(), [&](const auto& k) {
        using T = typename std::decay_t<decltype(k)>::Scalar;
        const T* gp = grad.const_data_ptr<T>();
        const T* xp = x.const_data_ptr<T>();
        const T* bp = ptr_or_null<T>(bias);
        T* dp = grad_x.mutable_data_ptr<T>();
        for_segments(x.numel(), x.size(-1), philox::Dropout{}, [&](int64_t i, int64_t n, int64_t col, DropoutWords&) {
          k.bias_gelu_backward(gp + i, xp + i, bp ? bp + col : nullptr, dp + i, n, tanh);
        });
      }))
    return;
  if (aten_vectorized(x)) {
    at::Tensor gx = grad_x;
    at::gelu_backward_out(gx, grad, bias.defined() ? at::add(x, bias) : x, gelu_kind(tanh));
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "ckpt_ext::bias_gelu_backward", [&] {
    using A = at::opmath_type<scalar_t>;
    const scalar_t* gp = grad.const_data_ptr<scalar_t>();
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* bp = ptr_or_null<scalar_t>(bias);
    scalar_t* dp = grad_x.mutable_data_ptr<scalar_t>();
    const int64_t hidden = x.size(-1);
    at::parallel_for(0, x.numel(), kElementGrain, [&](int64_t begin, int64_t end) {
      int64_t col = begin % hidden;
      for (int64_t i = begin; i < end; ++i) {
        const A v = static_cast<A>(xp[i]) + (bp ? static_cast<A>(bp[col]) : A(0));
        dp[i] = static_cast<scalar_t>(static_cast<A>(gp[i]) * gelu_derivative(v, tanh));
        if (++col == hidden) col = 0;
      }
    });
  });
}

namespace {

// The portable loops of bias_dropout_add (X: x's type, S: the stream's -- bias, residual, out; X = S, or a
// bfloat16 / float16 x beside a float32 stream under autocast) and of dropout (O: the result's type).
template <typename X, typename S>
void bias_dropout_add_loop(const at::Tensor& x, const at::Tensor& bias, const at::Tensor& residual,
                           const DropoutArgs& dropout, const at::Tensor& out) {
  using A = at::opmath_type<S>;
  const X* xp = x.const_data_ptr<X>();
  const S* bp = ptr_or_null<S>(bias);
  const S* rp = residual.const_data_ptr<S>();
  S* op = out.mutable_data_ptr<S>();
  const int64_t hidden = x.size(-1);
  const bool drop = dropout.enabled();
  const A scale = dropout_scale<A>(dropout);
  const philox::Dropout ph = dropout.philox();
  at::parallel_for(0, x.numel(), kElementGrain, [&](int64_t begin, int64_t end) {
    DropoutWords mask(ph);
    int64_t col = begin % hidden;
    for (int64_t b0 = begin; b0 < end; b0 += DropoutWords::kBlock) {
      const int64_t b1 = std::min(end, b0 + DropoutWords::kBlock);
      const uint32_t* words = drop ? mask.fill(b0, b1 - b0) : nullptr;
      for (int64_t i = b0; i < b1; ++i) {
        A v = static_cast<A>(xp[i]) + (bp ? static_cast<A>(bp[col]) : A(0));
        if (drop) v = mask.keep(words[i - b0]) ? v * scale : A(0);
        op[i] = static_cast<S>(static_cast<A>(rp[i]) + v);
        if (++col == hidden) col = 0;
      }
    }
  });
}

template <typename T, typename O>
void dropout_loop(const at::Tensor& x, const DropoutArgs& dropout, const at::Tensor& out) {
  using A = at::opmath_type<T>;
  const T* gp = x.const_data_ptr<T>();
  O* dp = out.mutable_data_ptr<O>();
  const A scale = dropout_scale<A>(dropout);
  const philox::Dropout ph = dropout.philox();
  at::parallel_for(0, x.numel(), kElementGrain, [&](int64_t begin, int64_t end) {
    DropoutWords mask(ph);
    for (int64_t b0 = begin; b0 < end; b0 += DropoutWords::kBlock) {
      const int64_t b1 = std::min(end, b0 + DropoutWords::kBlock);
      const uint32_t* words = mask.fill(b0, b1 - b0);
      for (int64_t i = b0; i < b1; ++i)
        dp[i] = mask.keep(words[i - b0]) ? static_cast<O>(static_cast<A>(gp[i]) * scale) : O(0);
    }
  });
}

// body(tag) with tag a value of c10::BFloat16 or c10::Half: the lower-precision side of a mixed call.
template <typename F>
void with_lowp(at::ScalarType t, const char* name, const F& body) {
  if (t == at::kBFloat16) return body(c10::BFloat16());
  TORCH_CHECK(t == at::kHalf, name, ": unexpected dtype ", t, " (ops/elementwise.cpp checks it)");
  body(c10::Half());
}

// The SIMD kernels of the mixed calls, by the lower-precision type.
auto mixed_x_kernel(const VecKernels<float>& k, c10::BFloat16) { return k.bias_dropout_add_x_bf16; }
auto mixed_x_kernel(const VecKernels<float>& k, c10::Half) { return k.bias_dropout_add_x_half; }
auto mixed_out_kernel(const VecKernels<float>& k, c10::BFloat16) { return k.dropout_to_bf16; }
auto mixed_out_kernel(const VecKernels<float>& k, c10::Half) { return k.dropout_to_half; }

}  // namespace

void bias_dropout_add_forward(const at::Tensor& x, const at::Tensor& bias, const at::Tensor& residual,
                              const DropoutArgs& dropout, const at::Tensor& out) {
  if (x.scalar_type() != residual.scalar_type()) {  // autocast: a bfloat16 / float16 x, a float32 stream
    with_lowp(x.scalar_type(), "ckpt_ext::bias_dropout_add", [&](auto tag) {
      using X = decltype(tag);
      const VecKernels<float>* k = vec_kernels<float>();
      if (!k) return bias_dropout_add_loop<X, float>(x, bias, residual, dropout, out);
      const auto fn = mixed_x_kernel(*k, tag);
      const X* xp = x.const_data_ptr<X>();
      const float* bp = ptr_or_null<float>(bias);
      const float* rp = residual.const_data_ptr<float>();
      float* op = out.mutable_data_ptr<float>();
      const float scale = dropout_scale<float>(dropout);
      for_segments(x.numel(), x.size(-1), dropout.philox(), [&](int64_t i, int64_t n, int64_t col, DropoutWords& mask) {
        fn(xp + i, bp ? bp + col : nullptr, rp + i, op + i, n, vec_dropout(mask, dropout.enabled(), scale, i, n));
      });
    });
    return;
  }
  if (with_vec(x.scalar_type(), [&](const auto& k) {
        using T = typename std::decay_t<decltype(k)>::Scalar;
        const T* xp = x.const_data_ptr<T>();
        const T* bp = ptr_or_null<T>(bias);
        const T* rp = residual.const_data_ptr<T>();
        T* op = out.mutable_data_ptr<T>();
        const float scale = dropout_scale<float>(dropout);
        for_segments(x.numel(), x.size(-1), dropout.philox(),
                     [&](int64_t i, int64_t n, int64_t col, DropoutWords& mask) {
                       k.bias_dropout_add(xp + i, bp ? bp + col : nullptr, rp + i, op + i, n,
                                          vec_dropout(mask, dropout.enabled(), scale, i, n));
                     });
      }))
    return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "ckpt_ext::bias_dropout_add", [&] {
    bias_dropout_add_loop<scalar_t, scalar_t>(x, bias, residual, dropout, out);
  });
}

void dropout(const at::Tensor& x, const DropoutArgs& dropout, const at::Tensor& out) {
  if (!dropout.enabled()) {  // a copy, or the one cast to the result's dtype
    at::Tensor o = out;
    o.copy_(x);
    return;
  }
  if (out.scalar_type() != x.scalar_type()) {  // autocast: a float32 x dropped into bfloat16 / float16
    with_lowp(out.scalar_type(), "ckpt_ext::dropout", [&](auto tag) {
      using O = decltype(tag);
      const VecKernels<float>* k = vec_kernels<float>();
      if (!k) return dropout_loop<float, O>(x, dropout, out);
      const auto fn = mixed_out_kernel(*k, tag);
      const float* xp = x.const_data_ptr<float>();
      O* op = out.mutable_data_ptr<O>();
      const float scale = dropout_scale<float>(dropout);
      for_segments(x.numel(), x.numel(), dropout.philox(), [&](int64_t i, int64_t n, int64_t, DropoutWords& mask) {
        fn(xp + i, op + i, n, vec_dropout(mask, true, scale, i, n));
      });
    });
    return;
  }
  if (with_vec(x.scalar_type(), [&](const auto& k) {
        using T = typename std::decay_t<decltype(k)>::Scalar;
        const T* xp = x.const_data_ptr<T>();
        T* op = out.mutable_data_ptr<T>();
        const float scale = dropout_scale<float>(dropout);
        for_segments(x.numel(), x.numel(), dropout.philox(), [&](int64_t i, int64_t n, int64_t, DropoutWords& mask) {
          k.dropout(xp + i, op + i, n, vec_dropout(mask, true, scale, i, n));
        });
      }))
    return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "ckpt_ext::dropout",
                                  [&] { dropout_loop<scalar_t, scalar_t>(x, dropout, out); });
}

void dropout_mask(const DropoutArgs& dropout, const at::Tensor& mask) {
  bool* mp = mask.mutable_data_ptr<bool>();
  const philox::Dropout ph = dropout.philox();
  const bool drop = dropout.enabled();
  at::parallel_for(0, mask.numel(), kElementGrain, [&](int64_t begin, int64_t end) {
    if (!drop) {
      std::fill(mp + begin, mp + end, true);
      return;
    }
    DropoutWords mask(ph);
    for (int64_t b0 = begin; b0 < end; b0 += DropoutWords::kBlock) {
      const int64_t b1 = std::min(end, b0 + DropoutWords::kBlock);
      const uint32_t* words = mask.fill(b0, b1 - b0);
      for (int64_t i = b0; i < b1; ++i) mp[i] = mask.keep(words[i - b0]);
    }
  });
}

void swiglu_forward(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& out) {
  if (with_vec(gate.scalar_type(), [&](const auto& k) {
        using T = typename std::decay_t<decltype(k)>::Scalar;
        const T* gp = gate.const_data_ptr<T>();
        const T* up_ = up.const_data_ptr<T>();
        T* op = out.mutable_data_ptr<T>();
        at::parallel_for(0, gate.numel(), kElementGrain,
                         [&](int64_t begin, int64_t end) { k.swiglu(gp + begin, up_ + begin, op + begin, end - begin); });
      }))
    return;
  if (aten_vectorized(gate)) {
    at::Tensor o = out;
    at::silu_out(o, gate);
    o.mul_(up);
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, gate.scalar_type(), "ckpt_ext::swiglu", [&] {
    using A = at::opmath_type<scalar_t>;
    const scalar_t* gp = gate.const_data_ptr<scalar_t>();
    const scalar_t* up_ = up.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, gate.numel(), kElementGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const A g = static_cast<A>(gp[i]);
        op[i] = static_cast<scalar_t>(g * sigmoid(g) * static_cast<A>(up_[i]));
      }
    });
  });
}

void swiglu_backward(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& up,
                     const at::Tensor& grad_gate, const at::Tensor& grad_up) {
  if (with_vec(gate.scalar_type(), [&](const auto& k) {
        using T = typename std::decay_t<decltype(k)>::Scalar;
        const T* dy = grad.const_data_ptr<T>();
        const T* gp = gate.const_data_ptr<T>();
        const T* up_ = up.const_data_ptr<T>();
        T* dg = grad_gate.mutable_data_ptr<T>();
        T* du = grad_up.mutable_data_ptr<T>();
        at::parallel_for(0, gate.numel(), kElementGrain, [&](int64_t begin, int64_t end) {
          k.swiglu_backward(dy + begin, gp + begin, up_ + begin, dg + begin, du + begin, end - begin);
        });
      }))
    return;
  if (aten_vectorized(gate)) {
    // d/dgate = silu'(gate) * (grad * up); d/dup = silu(gate) * grad.
    at::Tensor gg = grad_gate, gu = grad_up;
    at::silu_backward_out(gg, at::mul(grad, up), gate);
    at::silu_out(gu, gate);
    gu.mul_(grad);
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, gate.scalar_type(), "ckpt_ext::swiglu_backward", [&] {
    using A = at::opmath_type<scalar_t>;
    const scalar_t* dy = grad.const_data_ptr<scalar_t>();
    const scalar_t* gp = gate.const_data_ptr<scalar_t>();
    const scalar_t* up_ = up.const_data_ptr<scalar_t>();
    scalar_t* dg = grad_gate.mutable_data_ptr<scalar_t>();
    scalar_t* du = grad_up.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, gate.numel(), kElementGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const A g = static_cast<A>(gp[i]);
        const A u = static_cast<A>(up_[i]);
        const A d = static_cast<A>(dy[i]);
        const A s = sigmoid(g);
        du[i] = static_cast<scalar_t>(d * g * s);
        dg[i] = static_cast<scalar_t>(d * u * s * (A(1) + g * (A(1) - s)));
      }
    });
  });
}

void geglu_forward(const at::Tensor& gate, const at::Tensor& up, bool tanh, const at::Tensor& out) {
  if (with_vec(gate.scalar_type(), [&](const auto& k) {
        using T = typename std::decay_t<decltype(k)>::Scalar;
        const T* gp = gate.const_data_ptr<T>();
        const T* up_ = up.const_data_ptr<T>();
        T* op = out.mutable_data_ptr<T>();
        at::parallel_for(0, gate.numel(), kElementGrain, [&](int64_t begin, int64_t end) {
          k.geglu(gp + begin, up_ + begin, op + begin, end - begin, tanh);
        });
      }))
    return;
  if (aten_vectorized(gate)) {
    at::Tensor o = out;
    at::gelu_out(o, gate, gelu_kind(tanh));
    o.mul_(up);
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, gate.scalar_type(), "ckpt_ext::geglu", [&] {
    using A = at::opmath_type<scalar_t>;
    const scalar_t* gp = gate.const_data_ptr<scalar_t>();
    const scalar_t* up_ = up.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, gate.numel(), kElementGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        op[i] = static_cast<scalar_t>(gelu(static_cast<A>(gp[i]), tanh) * static_cast<A>(up_[i]));
    });
  });
}

void geglu_backward(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& up, bool tanh,
                    const at::Tensor& grad_gate, const at::Tensor& grad_up) {
  if (with_vec(gate.scalar_type(), [&](const auto& k) {
        using T = typename std::decay_t<decltype(k)>::Scalar;
        const T* dy = grad.const_data_ptr<T>();
        const T* gp = gate.const_data_ptr<T>();
        const T* up_ = up.const_data_ptr<T>();
        T* dg = grad_gate.mutable_data_ptr<T>();
        T* du = grad_up.mutable_data_ptr<T>();
        at::parallel_for(0, gate.numel(), kElementGrain, [&](int64_t begin, int64_t end) {
          k.geglu_backward(dy + begin, gp + begin, up_ + begin, dg + begin, du + begin, end - begin, tanh);
        });
      }))
    return;
  if (aten_vectorized(gate)) {
    // d/dgate = gelu'(gate) * (grad * up); d/dup = gelu(gate) * grad.
    at::Tensor gg = grad_gate, gu = grad_up;
    at::gelu_backward_out(gg, at::mul(grad, up), gate, gelu_kind(tanh));
    at::gelu_out(gu, gate, gelu_kind(tanh));
    gu.mul_(grad);
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, gate.scalar_type(), "ckpt_ext::geglu_backward", [&] {
    using A = at::opmath_type<scalar_t>;
    const scalar_t* dy = grad.const_data_ptr<scalar_t>();
    const scalar_t* gp = gate.const_data_ptr<scalar_t>();
    const scalar_t* up_ = up.const_data_ptr<scalar_t>();
    scalar_t* dg = grad_gate.mutable_data_ptr<scalar_t>();
    scalar_t* du = grad_up.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, gate.numel(), kElementGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const A g = static_cast<A>(gp[i]);
        const A d = static_cast<A>(dy[i]);
        du[i] = static_cast<scalar_t>(d * gelu(g, tanh));
        dg[i] = static_cast<scalar_t>(d * static_cast<A>(up_[i]) * gelu_derivative(g, tanh));
      }
    });
  });
}

// ---- the backwards that also write the forward's output (issue 33) ----------------------------------------
//
// The outputs may be any of the inputs (the replay overwrites them: nothing else reads them afterwards). With the
// SIMD kernels: block by block (DropoutWords::kBlock elements, in cache), the forward kernel into a buffer on the
// stack, then the backward kernel (each vector step loads before it stores, so an output over an input of the same
// elements is safe), then the buffer into `act` -- the forward's own element function, whose lanes compute each
// element alone (the same bits wherever a block starts). Elsewhere (float64, CPUs without the SIMD kernels): the
// forward and the backward, whole, into new tensors, copied to the outputs.

namespace {

// fn(i, n) over [0, numel) in blocks of at most kBlock elements, in parallel.
template <typename F>
void for_blocks(int64_t numel, const F& fn) {
  at::parallel_for(0, numel, kElementGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i += DropoutWords::kBlock) fn(i, std::min(end - i, DropoutWords::kBlock));
  });
}

void copy_into(const at::Tensor& dst, const at::Tensor& src) {
  at::Tensor d = dst;
  d.copy_(src);
}

}  // namespace

void swiglu_backward_act(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& up,
                         const at::Tensor& grad_gate, const at::Tensor& grad_up, const at::Tensor& act) {
  if (with_vec(gate.scalar_type(), [&](const auto& k) {
        using T = typename std::decay_t<decltype(k)>::Scalar;
        const T *dy = grad.const_data_ptr<T>(), *gp = gate.const_data_ptr<T>(), *up_ = up.const_data_ptr<T>();
        T *dg = grad_gate.data_ptr<T>(), *du = grad_up.data_ptr<T>(), *ap = act.data_ptr<T>();
        for_blocks(gate.numel(), [&](int64_t i, int64_t n) {
          T buf[DropoutWords::kBlock];
          k.swiglu(gp + i, up_ + i, buf, n);
          k.swiglu_backward(dy + i, gp + i, up_ + i, dg + i, du + i, n);
          std::copy(buf, buf + n, ap + i);
        });
      }))
    return;
  const at::Tensor a = at::empty_like(gate), g = at::empty_like(gate), u = at::empty_like(gate);
  swiglu_forward(gate, up, a);
  swiglu_backward(grad, gate, up, g, u);
  copy_into(act, a);
  copy_into(grad_gate, g);
  copy_into(grad_up, u);
}

void geglu_backward_act(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& up, bool tanh,
                        const at::Tensor& grad_gate, const at::Tensor& grad_up, const at::Tensor& act) {
  if (with_vec(gate.scalar_type(), [&](const auto& k) {
        using T = typename std::decay_t<decltype(k)>::Scalar;
        const T *dy = grad.const_data_ptr<T>(), *gp = gate.const_data_ptr<T>(), *up_ = up.const_data_ptr<T>();
        T *dg = grad_gate.data_ptr<T>(), *du = grad_up.data_ptr<T>(), *ap = act.data_ptr<T>();
        for_blocks(gate.numel(), [&](int64_t i, int64_t n) {
          T buf[DropoutWords::kBlock];
          k.geglu(gp + i, up_ + i, buf, n, tanh);
          k.geglu_backward(dy + i, gp + i, up_ + i, dg + i, du + i, n, tanh);
          std::copy(buf, buf + n, ap + i);
        });
      }))
    return;
  const at::Tensor a = at::empty_like(gate), g = at::empty_like(gate), u = at::empty_like(gate);
  geglu_forward(gate, up, tanh, a);
  geglu_backward(grad, gate, up, tanh, g, u);
  copy_into(act, a);
  copy_into(grad_gate, g);
  copy_into(grad_up, u);
}

void bias_gelu_backward_act(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& bias, bool tanh,
                            const at::Tensor& grad_x, const at::Tensor& grad_bias, const at::Tensor& act) {
  const int64_t hidden = x.size(-1), rows = x.numel() / hidden;
  if (with_vec(x.scalar_type(), [&](const auto& k) {
        using T = typename std::decay_t<decltype(k)>::Scalar;
        const T *gp = grad.const_data_ptr<T>(), *xp = x.const_data_ptr<T>(), *bp = ptr_or_null<T>(bias);
        T *dp = grad_x.data_ptr<T>(), *ap = act.data_ptr<T>();
        // n elements from i, the bias from column col.
        auto block = [&](int64_t i, int64_t n, int64_t col) {
          T buf[DropoutWords::kBlock];
          k.bias_gelu(xp + i, bp ? bp + col : nullptr, buf, n, tanh);
          k.bias_gelu_backward(gp + i, xp + i, bp ? bp + col : nullptr, dp + i, n, tanh);
          std::copy(buf, buf + n, ap + i);
        };
        if (grad_bias.defined()) {  // row by row, the column sums of grad_x's row after it
          rows_with_column_sums<T>(rows, hidden, dp, grad_bias, [&](int64_t base) {
            for (int64_t j = 0; j < hidden; j += DropoutWords::kBlock)
              block(base + j, std::min(hidden - j, DropoutWords::kBlock), j);
          });
          return;
        }
        for_segments(x.numel(), hidden, philox::Dropout{},
                     [&](int64_t i, int64_t n, int64_t col, DropoutWords&) { block(i, n, col); });
      }))
    return;
  const at::Tensor a = at::empty_like(x), d = at::empty_like(x);
  bias_gelu_forward(x, bias, tanh, a);
  bias_gelu_backward(grad, x, bias, tanh, d, grad_bias);
  copy_into(act, a);
  copy_into(grad_x, d);
}

void rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool backward,
            const at::Tensor& out) {
  if (with_vec(x.scalar_type(), [&](const auto& k) {
        using T = typename std::decay_t<decltype(k)>::Scalar;
        const int64_t H = x.size(1), S = x.size(2), D = x.size(3);
        const int64_t cos_batch_stride = cos.size(0) == 1 ? 0 : S * D;
        const T* xp = x.const_data_ptr<T>();
        const T* cp = cos.const_data_ptr<T>();
        const T* sp = sin.const_data_ptr<T>();
        T* op = out.mutable_data_ptr<T>();
        at::parallel_for(0, x.size(0) * H * S, row_grain(D), [&](int64_t begin, int64_t end) {
          for (int64_t r = begin; r < end; ++r) {
            const int64_t b = r / (H * S), h = (r / S) % H, s = r % S;
            k.rotary(xp + b * x.stride(0) + h * x.stride(1) + s * x.stride(2), cp + b * cos_batch_stride + s * D,
                     sp + b * cos_batch_stride + s * D, op + b * out.stride(0) + h * out.stride(1) + s * out.stride(2),
                     D / 2, backward);
          }
        });
      }))
    return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "ckpt_ext::rotary", [&] {
    using A = at::opmath_type<scalar_t>;
    const int64_t B = x.size(0), H = x.size(1), S = x.size(2), D = x.size(3), half = D / 2;
    const int64_t cos_batch_stride = cos.size(0) == 1 ? 0 : S * D;
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* cp = cos.const_data_ptr<scalar_t>();
    const scalar_t* sp = sin.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, B * H * S, row_grain(D), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t b = r / (H * S), h = (r / S) % H, s = r % S;
        const scalar_t* xr = xp + b * x.stride(0) + h * x.stride(1) + s * x.stride(2);
        scalar_t* yr = op + b * out.stride(0) + h * out.stride(1) + s * out.stride(2);
        const scalar_t* cr = cp + b * cos_batch_stride + s * D;
        const scalar_t* sr = sp + b * cos_batch_stride + s * D;
        for (int64_t j = 0; j < half; ++j) {
          const A x1 = static_cast<A>(xr[j]), x2 = static_cast<A>(xr[j + half]);
          const A c1 = static_cast<A>(cr[j]), c2 = static_cast<A>(cr[j + half]);
          const A s1 = static_cast<A>(sr[j]), s2 = static_cast<A>(sr[j + half]);
          if (!backward) {  // rotate_half(x) = [-x2, x1]
            yr[j] = static_cast<scalar_t>(x1 * c1 - x2 * s1);
            yr[j + half] = static_cast<scalar_t>(x2 * c2 + x1 * s2);
          } else {  // transpose of the above: rotate_half^T(g * sin) = [g2 * s2, -g1 * s1]
            yr[j] = static_cast<scalar_t>(x1 * c1 + x2 * s2);
            yr[j + half] = static_cast<scalar_t>(x2 * c2 - x1 * s1);
          }
        }
      }
    });
  });
}

}  // namespace cpu
}  // namespace kernels
}  // namespace ckpt_ext
