// The SIMD CPU kernels (see vec.h), written once on at::vec::Vectorized<float>: included by vec_avx2.cpp and
// vec_avx512.cpp only, after their target pragma and CPU_CAPABILITY macros, inside namespace
// ckpt_ext::kernels::cpu::CKPT_EXT_VEC_NS. Every dtype is loaded as float vectors, 2 x Vectorized<float>
// elements per step (one Vectorized<BFloat16/Half>), computed in float and rounded once on store.
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <tuple>
#include <type_traits>

namespace ckpt_ext {
namespace kernels {
namespace cpu {
namespace CKPT_EXT_VEC_NS {
namespace {

// The helpers below are forced inline: left to GCC's heuristics, IO<BFloat16>::load stayed a call in
// layer_norm_forward, its vectors passed through memory and the row sums' accumulators spilled to the stack
// (bfloat16 add_layer_norm, one thread: half eager's speed).
#ifndef CKPT_EXT_VEC_INLINE
#define CKPT_EXT_VEC_INLINE inline __attribute__((always_inline))
#endif

using fVec = at::vec::Vectorized<float>;
using dVec = at::vec::Vectorized<double>;
constexpr int64_t kF = fVec::size();
constexpr int64_t kStep = 2 * kF;

// Loads / stores of kStep (or n < kStep, zero-filled) elements of T as two float vectors.
template <typename T>
struct IO {
  using V = at::vec::Vectorized<T>;
  static_assert(V::size() == kStep, "a 16-bit vector holds two float vectors");
  static CKPT_EXT_VEC_INLINE void load(const T* p, int64_t n, fVec& a, fVec& b) {
    std::tie(a, b) = at::vec::convert_to_float<T>(n == kStep ? V::loadu(p) : V::loadu(p, n));
  }
  static CKPT_EXT_VEC_INLINE void store(T* p, int64_t n, const fVec& a, const fVec& b) {
    const V v = at::vec::convert_from_float<T>(a, b);
    if (n == kStep)
      v.store(p);
    else
      v.store(p, n);
  }
  // a, b rounded to T and back (what a store and a reload would give).
  static CKPT_EXT_VEC_INLINE void round(fVec& a, fVec& b) { std::tie(a, b) = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(a, b)); }
  // store, then a, b set to what was stored (one conversion for both).
  static CKPT_EXT_VEC_INLINE void store_round(T* p, int64_t n, fVec& a, fVec& b) {
    const V v = at::vec::convert_from_float<T>(a, b);
    if (n == kStep)
      v.store(p);
    else
      v.store(p, n);
    std::tie(a, b) = at::vec::convert_to_float<T>(v);
  }
};

template <>
struct IO<float> {
  static CKPT_EXT_VEC_INLINE void load(const float* p, int64_t n, fVec& a, fVec& b) {
    if (n == kStep) {
      a = fVec::loadu(p);
      b = fVec::loadu(p + kF);
    } else if (n > kF) {
      a = fVec::loadu(p);
      b = fVec::loadu(p + kF, n - kF);
    } else {
      a = fVec::loadu(p, n);
      b = fVec(0.f);
    }
  }
  static CKPT_EXT_VEC_INLINE void store(float* p, int64_t n, const fVec& a, const fVec& b) {
    if (n == kStep) {
      a.store(p);
      b.store(p + kF);
    } else if (n > kF) {
      a.store(p);
      b.store(p + kF, n - kF);
    } else {
      a.store(p, n);
    }
  }
  static CKPT_EXT_VEC_INLINE void round(fVec&, fVec&) {}
  static CKPT_EXT_VEC_INLINE void store_round(float* p, int64_t n, fVec& a, fVec& b) { store(p, n, a, b); }
};

// A prefetch of the line kAhead bytes past p, in the loops that stream their inputs from memory: the
// compute-heavy ones (GELU, SiLU) run too few iterations in the out-of-order window to keep enough cache
// misses in flight on their own (bfloat16 GELU backward, 2048 x 4096, one thread: 13.5 -> 6 ms); the norms'
// first pass over a row likewise. A prefetch never faults, past the end of a buffer included.
constexpr int64_t kAhead = 1024;
template <typename T>
CKPT_EXT_VEC_INLINE void prefetch_ahead(const T* p) {
  __builtin_prefetch(reinterpret_cast<const char*>(p) + kAhead);
}

// x += y over n (<= kStep) elements, zeros where y is absent.
template <typename T>
CKPT_EXT_VEC_INLINE void add_opt(const T* y, int64_t n, fVec& a, fVec& b) {
  if (!y) return;
  fVec ya, yb;
  IO<T>::load(y, n, ya, yb);
  a = a + ya;
  b = b + yb;
}

// All-ones in the lanes of the kF words at w that dropout keeps ((w >> 8) >= threshold; both sides below
// 2^25, so a signed compare with threshold - 1 decides it).
CKPT_EXT_VEC_INLINE fVec keep_lanes(const uint32_t* w, uint32_t threshold) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i v = _mm512_srli_epi32(_mm512_loadu_si512(w), 8);
  const __mmask16 k = _mm512_cmpgt_epi32_mask(v, _mm512_set1_epi32(static_cast<int>(threshold) - 1));
  return fVec(_mm512_castsi512_ps(_mm512_maskz_mov_epi32(k, _mm512_set1_epi32(-1))));
#else
  const __m256i v = _mm256_srli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)), 8);
  return fVec(_mm256_castsi256_ps(_mm256_cmpgt_epi32(v, _mm256_set1_epi32(static_cast<int>(threshold) - 1))));
#endif
}

// Dropout of n (<= kStep) elements whose words start at w: kept * scale, dropped +0 (a select, as the
// portable loops store 0, not v * 0).
CKPT_EXT_VEC_INLINE void apply_dropout(const VecDropout& d, const uint32_t* w, int64_t n, fVec& a, fVec& b) {
  const fVec zero(0.f), scale(d.scale);
  if (n == kStep) {  // the words of a partial step may end before kStep: those take the scalar compare
    a = fVec::blendv(zero, a * scale, keep_lanes(w, d.threshold));
    b = fVec::blendv(zero, b * scale, keep_lanes(w + kF, d.threshold));
    return;
  }
  alignas(64) uint32_t m[kStep];
  for (int64_t k = 0; k < kStep; ++k) m[k] = k < n && (w[k] >> 8) >= d.threshold ? 0xFFFFFFFFu : 0u;
  a = fVec::blendv(zero, a * scale, fVec::loadu(m));
  b = fVec::blendv(zero, b * scale, fVec::loadu(m + kF));
}

// The two halves of a float vector in double.
CKPT_EXT_VEC_INLINE void to_double(const fVec& v, dVec& lo, dVec& hi) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 x = v;
  lo = dVec(_mm512_cvtps_pd(_mm512_castps512_ps256(x)));
  hi = dVec(_mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1))));
#else
  const __m256 x = v;
  lo = dVec(_mm256_cvtps_pd(_mm256_castps256_ps128(x)));
  hi = dVec(_mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)));
#endif
}

// Row sums in double (vec.h): acc += v (or v * v, squared in double).
struct DoubleSum {
  dVec s0{0.0}, s1{0.0};
  CKPT_EXT_VEC_INLINE void add(const fVec& v) {
    dVec lo, hi;
    to_double(v, lo, hi);
    s0 = s0 + lo;
    s1 = s1 + hi;
  }
  CKPT_EXT_VEC_INLINE void add_square(const fVec& v) {
    dVec lo, hi;
    to_double(v, lo, hi);
    s0 = at::vec::fmadd(lo, lo, s0);
    s1 = at::vec::fmadd(hi, hi, s1);
  }
  CKPT_EXT_VEC_INLINE double total() const {
    alignas(64) double t[2 * dVec::size()];
    s0.store(t);
    s1.store(t + dVec::size());
    double r = 0;
    for (double x : t) r += x;
    return r;
  }
};

// body(i, c) over H elements (a row, or a segment) in steps of kStep: the full steps in the loop -- body inlined there
// with c == kStep a constant, so its loads and stores take no branch -- then the partial last step.
#ifndef CKPT_EXT_VEC_LAMBDA
#define CKPT_EXT_VEC_LAMBDA __attribute__((always_inline))
#endif
template <typename F>
CKPT_EXT_VEC_INLINE void for_steps(int64_t H, const F& body) {
  int64_t i = 0;
  for (; i + kStep <= H; i += kStep) body(i, kStep);
  if (i < H) body(i, H - i);
}

// ---- activations ---------------------------------------------------------------------------------------
//
// exp is at::vec's inline exp_u20 (error <= 20 float ulps, 2.4e-6 relative) in every dtype: Sleef's
// out-of-line exp (1 ulp), which at::vec's erf and exp call, costs more than the rest of the GELU / SiLU
// together, and the 20 ulps are below the error of the erf formula below (1.5e-7 absolute, what ATen's
// float GELU has) and of the float32 tests' tolerance. Fast = true (float16 / bfloat16, whose 8 or 11
// bits of mantissa hide a few float ulps) also takes reciprocals from the hardware estimate and tanh from
// exp; float32 keeps a Newton step and at::vec's (Sleef) tanh.

template <bool Fast>
CKPT_EXT_VEC_INLINE fVec exp_(const fVec& x) {
  return x.exp_u20();
}

// 1 / d for d >= 1: the hardware estimate and one Newton step (relative error ~2^-23 or better).
CKPT_EXT_VEC_INLINE fVec recip_fast(const fVec& d) {
#if defined(CPU_CAPABILITY_AVX512)
  const fVec r(_mm512_rcp14_ps(d));
#else
  const fVec r(_mm256_rcp_ps(d));
#endif
  return r * (fVec(2.f) - d * r);
}

// 1 / d for d >= 1 from the hardware estimate alone: relative error <= 2^-14 with AVX-512 (rcp14), hidden
// by a float16/bfloat16 result; AVX2's estimate (1.5 * 2^-12) gets the Newton step.
CKPT_EXT_VEC_INLINE fVec recip_estimate(const fVec& d) {
#if defined(CPU_CAPABILITY_AVX512)
  return fVec(_mm512_rcp14_ps(d));
#else
  return recip_fast(d);
#endif
}

// erf(xs) by Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7), the formula of at::vec's erf, written for
// speed: erf(|xs|) = 1 - poly(t) * e with t = 1 / (1 + p |xs|) and e = exp(-xs^2), which the GELU
// derivative shares (returned in e: one exp per element), then the sign of xs put back by a bit
// operation. Fast: t from the reciprocal estimate; float32: with a Newton step. Horner in FMAs (this file is otherwise fp-contract=off: here the float32
// kernels need not match the portable loops bit for bit, which run ATen's GELU).
template <bool Fast>
CKPT_EXT_VEC_INLINE fVec erf_(const fVec& xs, fVec& e) {
  const fVec one(1.f), sign_bit(-0.f);
  const fVec ax = xs.abs();
  // |xs| capped (erf(9) rounds to 1; e is 0 there anyway) so that t stays finite; NaN passes through
  const fVec d = at::vec::fmadd(fVec(0.3275911f), at::vec::clamp_max(ax, fVec(9.f)), one);
  const fVec t = Fast ? recip_estimate(d) : recip_fast(d);
  fVec poly = at::vec::fmadd(fVec(1.061405429f), t, fVec(-1.453152027f));
  poly = at::vec::fmadd(poly, t, fVec(1.421413741f));
  poly = at::vec::fmadd(poly, t, fVec(-0.284496736f));
  poly = at::vec::fmadd(poly, t, fVec(0.254829592f));
  poly = poly * t;
  e = exp_<Fast>((ax * ax) ^ sign_bit);  // exp(-xs^2): 0 for huge |xs|, not an overflow
  const fVec erf_abs = at::vec::fmadd(poly ^ sign_bit, e, one);
  return erf_abs ^ (xs & sign_bit);
}

template <bool Fast>
CKPT_EXT_VEC_INLINE fVec tanh_(const fVec& x) {
  if (!Fast) return x.tanh();
  const fVec one(1.f);
  // tanh(9) rounds to 1 in float; the cap keeps exp finite for recip_fast
  const fVec xc = at::vec::minimum(at::vec::maximum(x, fVec(-9.f)), fVec(9.f));
  return one - fVec(2.f) * recip_fast(exp_<true>(xc + xc) + one);
}

template <bool Fast>
CKPT_EXT_VEC_INLINE fVec gelu(const fVec& x, bool tanh) {
  const fVec half(0.5f), one(1.f);
  if (tanh) {
    const fVec inner = fVec(static_cast<float>(math::kSqrt2OverPi)) *
                       (x + fVec(static_cast<float>(math::kGeluKappa)) * x * x * x);
    return half * x * (one + tanh_<Fast>(inner));
  }
  fVec e;
  return half * x * (one + erf_<Fast>(x * fVec(static_cast<float>(M_SQRT1_2)), e));
}

template <bool Fast>
CKPT_EXT_VEC_INLINE fVec gelu_derivative(const fVec& x, bool tanh) {
  const fVec half(0.5f), one(1.f);
  if (tanh) {
    const fVec beta(static_cast<float>(math::kSqrt2OverPi)), kappa(static_cast<float>(math::kGeluKappa));
    const fVec t = tanh_<Fast>(beta * (x + kappa * x * x * x));
    return half * (one + t) + half * x * (one - t * t) * beta * (one + fVec(3.f) * kappa * x * x);
  }
  fVec e;  // exp(-x^2 / 2): erf's exponential and the normal density
  const fVec cdf = half * (one + erf_<Fast>(x * fVec(static_cast<float>(M_SQRT1_2)), e));
  return at::vec::fmadd(x * e, fVec(static_cast<float>(math::kInvSqrt2Pi)), cdf);
}

template <bool Fast>
CKPT_EXT_VEC_INLINE fVec sigmoid(const fVec& x) {
  return fVec(1.f) / (fVec(1.f) + exp_<Fast>(x.neg()));
}

template <typename T>
constexpr bool kFast = !std::is_same<T, float>::value;

// The loops below take the GELU kind as a template argument, so that no branch sits in the loop and the
// compiler keeps the formula's constants in registers.
template <typename T, bool Tanh>
void bias_gelu_loop(const T* x, const T* bias, T* out, int64_t n) {
  constexpr bool tanh = Tanh;
  for_steps(n, [&](int64_t i, int64_t c) CKPT_EXT_VEC_LAMBDA {
    fVec a, b;
    prefetch_ahead(x + i);
    IO<T>::load(x + i, c, a, b);
    add_opt(bias ? bias + i : nullptr, c, a, b);
    IO<T>::store(out + i, c, gelu<kFast<T>>(a, tanh), gelu<kFast<T>>(b, tanh));
  });
}

template <typename T, bool Tanh>
void bias_gelu_backward_loop(const T* grad, const T* x, const T* bias, T* grad_x, int64_t n) {
  constexpr bool tanh = Tanh;
  for_steps(n, [&](int64_t i, int64_t c) CKPT_EXT_VEC_LAMBDA {
    fVec a, b, ga, gb;
    prefetch_ahead(x + i);
    prefetch_ahead(grad + i);
    IO<T>::load(x + i, c, a, b);
    add_opt(bias ? bias + i : nullptr, c, a, b);
    IO<T>::load(grad + i, c, ga, gb);
    IO<T>::store(grad_x + i, c, ga * gelu_derivative<kFast<T>>(a, tanh), gb * gelu_derivative<kFast<T>>(b, tanh));
  });
}

template <typename T>
void bias_gelu(const T* x, const T* bias, T* out, int64_t n, bool tanh) {
  (tanh ? bias_gelu_loop<T, true> : bias_gelu_loop<T, false>)(x, bias, out, n);
}

template <typename T>
void bias_gelu_backward(const T* grad, const T* x, const T* bias, T* grad_x, int64_t n, bool tanh) {
  (tanh ? bias_gelu_backward_loop<T, true> : bias_gelu_backward_loop<T, false>)(grad, x, bias, grad_x, n);
}

// X: x's type, T: the others' (a bfloat16 / float16 x beside a float32 stream under autocast; X = T otherwise).
template <typename X, typename T>
void bias_dropout_add(const X* x, const T* bias, const T* residual, T* out, int64_t n, VecDropout d) {
  for_steps(n, [&](int64_t i, int64_t c) CKPT_EXT_VEC_LAMBDA {
    fVec a, b;
    IO<X>::load(x + i, c, a, b);
    add_opt(bias ? bias + i : nullptr, c, a, b);
    if (d.words) apply_dropout(d, d.words + i, c, a, b);
    add_opt(residual + i, c, a, b);
    IO<T>::store(out + i, c, a, b);
  });
}

// O: the result's type (bfloat16 / float16 for a float32 x under autocast; O = T otherwise).
template <typename T, typename O>
void dropout(const T* x, O* out, int64_t n, VecDropout d) {
  for_steps(n, [&](int64_t i, int64_t c) CKPT_EXT_VEC_LAMBDA {
    fVec a, b;
    IO<T>::load(x + i, c, a, b);
    apply_dropout(d, d.words + i, c, a, b);
    IO<O>::store(out + i, c, a, b);
  });
}

// The mixed-dtype entries of table<T>(): instantiated for T = float only, nullptr for the other T.
template <typename X, typename T>
constexpr auto mixed_bias_dropout_add() {
  using Fn = void (*)(const X*, const T*, const T*, T*, int64_t, VecDropout);
  if constexpr (std::is_same<T, float>::value) return static_cast<Fn>(&bias_dropout_add<X, T>);
  else return static_cast<Fn>(nullptr);
}
template <typename T, typename O>
constexpr auto mixed_dropout() {
  using Fn = void (*)(const T*, O*, int64_t, VecDropout);
  if constexpr (std::is_same<T, float>::value) return static_cast<Fn>(&dropout<T, O>);
  else return static_cast<Fn>(nullptr);
}

template <typename T>
void swiglu(const T* gate, const T* up, T* out, int64_t n) {
  for_steps(n, [&](int64_t i, int64_t c) CKPT_EXT_VEC_LAMBDA {
    fVec ga, gb, ua, ub;
    prefetch_ahead(gate + i);
    prefetch_ahead(up + i);
    IO<T>::load(gate + i, c, ga, gb);
    IO<T>::load(up + i, c, ua, ub);
    IO<T>::store(out + i, c, ga * sigmoid<kFast<T>>(ga) * ua, gb * sigmoid<kFast<T>>(gb) * ub);
  });
}

// GeGLU: gelu(gate) * up, the GELU kind a template argument as in bias_gelu_loop.
template <typename T, bool Tanh>
void geglu_loop(const T* gate, const T* up, T* out, int64_t n) {
  constexpr bool tanh = Tanh;
  for_steps(n, [&](int64_t i, int64_t c) CKPT_EXT_VEC_LAMBDA {
    fVec ga, gb, ua, ub;
    prefetch_ahead(gate + i);
    prefetch_ahead(up + i);
    IO<T>::load(gate + i, c, ga, gb);
    IO<T>::load(up + i, c, ua, ub);
    IO<T>::store(out + i, c, gelu<kFast<T>>(ga, tanh) * ua, gelu<kFast<T>>(gb, tanh) * ub);
  });
}

template <typename T, bool Tanh>
void geglu_backward_loop(const T* grad, const T* gate, const T* up, T* grad_gate, T* grad_up, int64_t n) {
  constexpr bool tanh = Tanh;
  for_steps(n, [&](int64_t i, int64_t c) CKPT_EXT_VEC_LAMBDA {
    fVec g[2], u[2], dy[2], dg[2], du[2];
    prefetch_ahead(gate + i);
    prefetch_ahead(up + i);
    prefetch_ahead(grad + i);
    IO<T>::load(gate + i, c, g[0], g[1]);
    IO<T>::load(up + i, c, u[0], u[1]);
    IO<T>::load(grad + i, c, dy[0], dy[1]);
    for (int h = 0; h < 2; ++h) {
      du[h] = dy[h] * gelu<kFast<T>>(g[h], tanh);
      dg[h] = dy[h] * u[h] * gelu_derivative<kFast<T>>(g[h], tanh);
    }
    IO<T>::store(grad_up + i, c, du[0], du[1]);
    IO<T>::store(grad_gate + i, c, dg[0], dg[1]);
  });
}

template <typename T>
void geglu(const T* gate, const T* up, T* out, int64_t n, bool tanh) {
  (tanh ? geglu_loop<T, true> : geglu_loop<T, false>)(gate, up, out, n);
}

template <typename T>
void geglu_backward(const T* grad, const T* gate, const T* up, T* grad_gate, T* grad_up, int64_t n, bool tanh) {
  (tanh ? geglu_backward_loop<T, true> : geglu_backward_loop<T, false>)(grad, gate, up, grad_gate, grad_up, n);
}

template <typename T>
void swiglu_backward(const T* grad, const T* gate, const T* up, T* grad_gate, T* grad_up, int64_t n) {
  const fVec one(1.f);
  for_steps(n, [&](int64_t i, int64_t c) CKPT_EXT_VEC_LAMBDA {
    fVec g[2], u[2], dy[2], dg[2], du[2];
    prefetch_ahead(gate + i);
    prefetch_ahead(up + i);
    prefetch_ahead(grad + i);
    IO<T>::load(gate + i, c, g[0], g[1]);
    IO<T>::load(up + i, c, u[0], u[1]);
    IO<T>::load(grad + i, c, dy[0], dy[1]);
    for (int h = 0; h < 2; ++h) {
      const fVec s = sigmoid<kFast<T>>(g[h]);
      du[h] = dy[h] * g[h] * s;
      dg[h] = dy[h] * u[h] * s * (one + g[h] * (one - s));
    }
    IO<T>::store(grad_up + i, c, du[0], du[1]);
    IO<T>::store(grad_gate + i, c, dg[0], dg[1]);
  });
}

template <typename T>
void rotary(const T* x, const T* cos, const T* sin, T* y, int64_t half, bool backward) {
  for_steps(half, [&](int64_t j, int64_t c) CKPT_EXT_VEC_LAMBDA {
    fVec x1[2], x2[2], c1[2], c2[2], s1[2], s2[2], y1[2], y2[2];
    IO<T>::load(x + j, c, x1[0], x1[1]);
    IO<T>::load(x + half + j, c, x2[0], x2[1]);
    IO<T>::load(cos + j, c, c1[0], c1[1]);
    IO<T>::load(cos + half + j, c, c2[0], c2[1]);
    IO<T>::load(sin + j, c, s1[0], s1[1]);
    IO<T>::load(sin + half + j, c, s2[0], s2[1]);
    for (int h = 0; h < 2; ++h) {
      if (!backward) {  // rotate_half(x) = [-x2, x1]
        y1[h] = x1[h] * c1[h] - x2[h] * s1[h];
        y2[h] = x2[h] * c2[h] + x1[h] * s2[h];
      } else {  // transpose of the above: rotate_half^T(g * sin) = [g2 * s2, -g1 * s1]
        y1[h] = x1[h] * c1[h] + x2[h] * s2[h];
        y2[h] = x2[h] * c2[h] - x1[h] * s1[h];
      }
    }
    IO<T>::store(y + j, c, y1[0], y1[1]);
    IO<T>::store(y + half + j, c, y2[0], y2[1]);
  });
}

// ---- norms (one row) -----------------------------------------------------------------------------------

// a, b with the lanes from n on set to 0.
CKPT_EXT_VEC_INLINE void zero_tail(int64_t n, fVec& a, fVec& b) {
  if (n == kStep) return;
  const fVec zero(0.f);
  a = fVec::set(zero, a, std::min(n, kF));
  b = fVec::set(zero, b, std::max<int64_t>(n - kF, 0));
}

template <typename T>
void layer_norm_forward(NormRow<T>& row) {
  const NormRow<T> r = row;  // a local copy: the stores through T* below cannot alias it, so no reloads
  const int64_t H = r.hidden;
  float* v = r.scratch;  // the stored pre-norm row in float
  DoubleSum sum;
  for_steps(H, [&](int64_t i, int64_t c) CKPT_EXT_VEC_LAMBDA {
    fVec a, b;
    prefetch_ahead(r.x + i);
    if (r.residual) prefetch_ahead(r.residual + i);
    IO<T>::load(r.x + i, c, a, b);
    add_opt(r.bias ? r.bias + i : nullptr, c, a, b);
    if (r.drop.words) apply_dropout(r.drop, r.drop.words + i, c, a, b);
    add_opt(r.residual ? r.residual + i : nullptr, c, a, b);
    IO<T>::store_round(r.pre + i, c, a, b);  // normalise exactly what is stored (and what backward reads)
    IO<float>::store(v + i, c, a, b);
    sum.add(a + b);  // zero-filled past the row's end; the pair in float, the row's sum in double
  });
  const float mu = static_cast<float>(sum.total() / H);
  const fVec vmu(mu);
  DoubleSum var;
  for_steps(H, [&](int64_t i, int64_t c) CKPT_EXT_VEC_LAMBDA {
    fVec a, b;
    IO<float>::load(v + i, c, a, b);
    a = a - vmu;
    b = b - vmu;
    zero_tail(c, a, b);
    var.add(a * a + b * b);
  });
  const float rs = static_cast<float>(1 / std::sqrt(var.total() / H + r.eps));
  row.mean = mu;
  row.rstd = rs;
  const fVec vrs(rs);
  for_steps(H, [&](int64_t i, int64_t c) CKPT_EXT_VEC_LAMBDA {
    fVec a, b, wa, wb;
    IO<float>::load(v + i, c, a, b);
    IO<float>::load(r.weight + i, c, wa, wb);
    a = (a - vmu) * vrs * wa;
    b = (b - vmu) * vrs * wb;
    add_opt<float>(r.ln_bias ? r.ln_bias + i : nullptr, c, a, b);
    IO<T>::store(r.out + i, c, a, b);
  });
}

template <typename T>
void layer_norm_backward(NormRow<T>& row) {
  const NormRow<T> r = row;  // a local copy: the stores through T* below cannot alias it, so no reloads
  const int64_t H = r.hidden;
  const fVec mu(r.mean), rs(r.rstd);
  DoubleSum sum_dy, sum_dy_xhat;  // dy = grad_out * weight
  for_steps(H, [&](int64_t i, int64_t c) CKPT_EXT_VEC_LAMBDA {
    fVec g[2], v[2], w[2], pw[2], pb[2];
    prefetch_ahead(r.grad + i);
    prefetch_ahead(r.x + i);
    IO<T>::load(r.grad + i, c, g[0], g[1]);  // zero-filled past the row's end: those lanes add 0
    IO<T>::load(r.x + i, c, v[0], v[1]);
    IO<float>::load(r.weight + i, c, w[0], w[1]);
    IO<float>::load(r.partial_w + i, c, pw[0], pw[1]);
    IO<float>::load(r.partial_b + i, c, pb[0], pb[1]);
    fVec dy[2], dy_xhat[2];
    for (int h = 0; h < 2; ++h) {
      const fVec xhat = (v[h] - mu) * rs;
      dy[h] = g[h] * w[h];
      dy_xhat[h] = dy[h] * xhat;
      pw[h] = pw[h] + g[h] * xhat;
      pb[h] = pb[h] + g[h];
    }
    sum_dy.add(dy[0] + dy[1]);  // the pair in float, the row's sum in double
    sum_dy_xhat.add(dy_xhat[0] + dy_xhat[1]);
    IO<float>::store(r.partial_w + i, c, pw[0], pw[1]);
    IO<float>::store(r.partial_b + i, c, pb[0], pb[1]);
  });
  const fVec c_mean(static_cast<float>(sum_dy.total() / H)), c_xhat(static_cast<float>(sum_dy_xhat.total() / H));
  for_steps(H, [&](int64_t i, int64_t c) CKPT_EXT_VEC_LAMBDA {
    fVec g[2], v[2], w[2], d[2];
    IO<T>::load(r.grad + i, c, g[0], g[1]);
    IO<T>::load(r.x + i, c, v[0], v[1]);
    IO<float>::load(r.weight + i, c, w[0], w[1]);
    for (int h = 0; h < 2; ++h) {
      const fVec xhat = (v[h] - mu) * rs;
      d[h] = rs * (g[h] * w[h] - c_mean - xhat * c_xhat);
    }
    add_opt(r.grad_pre ? r.grad_pre + i : nullptr, c, d[0], d[1]);
    IO<T>::store(r.out + i, c, d[0], d[1]);
    if (r.pre) {
      if (r.drop.words) apply_dropout(r.drop, r.drop.words + i, c, d[0], d[1]);
      if (r.partial_x) {  // the bias gradient: grad_x's column sums, of the values stored
        IO<T>::store_round(r.pre + i, c, d[0], d[1]);
        fVec px[2];
        IO<float>::load(r.partial_x + i, c, px[0], px[1]);
        IO<float>::store(r.partial_x + i, c, px[0] + d[0], px[1] + d[1]);
      } else {
        IO<T>::store(r.pre + i, c, d[0], d[1]);
      }
    }
  });
}

template <typename T>
void rms_norm_forward(NormRow<T>& row) {
  const NormRow<T> r = row;  // a local copy: the stores through T* below cannot alias it, so no reloads
  const int64_t H = r.hidden;
  DoubleSum sum_sq;
  for_steps(H, [&](int64_t i, int64_t c) CKPT_EXT_VEC_LAMBDA {
    fVec a, b;
    prefetch_ahead(r.x + i);
    if (r.residual) prefetch_ahead(r.residual + i);
    IO<T>::load(r.x + i, c, a, b);
    add_opt(r.residual ? r.residual + i : nullptr, c, a, b);
    IO<T>::store_round(r.pre + i, c, a, b);
    sum_sq.add_square(a);
    sum_sq.add_square(b);
  });
  const float rs_f = static_cast<float>(1 / std::sqrt(sum_sq.total() / H + r.eps));
  row.rstd = rs_f;
  const fVec rs(rs_f);
  for_steps(H, [&](int64_t i, int64_t c) CKPT_EXT_VEC_LAMBDA {
    fVec a, b, wa, wb;
    IO<T>::load(r.pre + i, c, a, b);
    a = a * rs;
    b = b * rs;
    IO<T>::round(a, b);  // LlamaRMSNorm: normalise in float, cast to the input dtype, then times the weight
    IO<float>::load(r.weight + i, c, wa, wb);
    IO<T>::store(r.out + i, c, wa * a, wb * b);
  });
}

template <typename T>
void rms_norm_backward(NormRow<T>& row) {
  const NormRow<T> r = row;  // a local copy: the stores through T* below cannot alias it, so no reloads
  const int64_t H = r.hidden;
  const fVec rs(r.rstd);
  DoubleSum sum_dn_n;  // dn = grad_out * weight, n = sum * rstd
  for_steps(H, [&](int64_t i, int64_t c) CKPT_EXT_VEC_LAMBDA {
    fVec g[2], n[2], w[2], pw[2];
    prefetch_ahead(r.grad + i);
    prefetch_ahead(r.x + i);
    IO<T>::load(r.grad + i, c, g[0], g[1]);
    IO<T>::load(r.x + i, c, n[0], n[1]);
    IO<float>::load(r.weight + i, c, w[0], w[1]);
    IO<float>::load(r.partial_w + i, c, pw[0], pw[1]);
    n[0] = n[0] * rs;
    n[1] = n[1] * rs;
    sum_dn_n.add(g[0] * w[0] * n[0] + g[1] * w[1] * n[1]);
    IO<T>::round(n[0], n[1]);  // out = weight * to_dtype(n)
    IO<float>::store(r.partial_w + i, c, pw[0] + g[0] * n[0], pw[1] + g[1] * n[1]);
  });
  const fVec c_n(static_cast<float>(sum_dn_n.total() / H));
  for_steps(H, [&](int64_t i, int64_t c) CKPT_EXT_VEC_LAMBDA {
    fVec g[2], n[2], w[2], d[2];
    IO<T>::load(r.grad + i, c, g[0], g[1]);
    IO<T>::load(r.x + i, c, n[0], n[1]);
    IO<float>::load(r.weight + i, c, w[0], w[1]);
    for (int h = 0; h < 2; ++h) d[h] = rs * (g[h] * w[h] - n[h] * rs * c_n);
    add_opt(r.grad_pre ? r.grad_pre + i : nullptr, c, d[0], d[1]);
    IO<T>::store(r.out + i, c, d[0], d[1]);
  });
}

}  // namespace

template <typename T>
const VecKernels<T>* table() {
  static const VecKernels<T> k{&bias_gelu<T>,         &bias_gelu_backward<T>, &bias_dropout_add<T, T>,
                               &dropout<T, T>,        &swiglu<T>,             &swiglu_backward<T>,     &geglu<T>,
                               &geglu_backward<T>,    &rotary<T>,
                               &layer_norm_forward<T>, &layer_norm_backward<T>, &rms_norm_forward<T>,
                               &rms_norm_backward<T>,
                               mixed_bias_dropout_add<c10::BFloat16, T>(), mixed_bias_dropout_add<c10::Half, T>(),
                               mixed_dropout<T, c10::BFloat16>(), mixed_dropout<T, c10::Half>()};
  return &k;
}

template const VecKernels<float>* table<float>();
template const VecKernels<c10::BFloat16>* table<c10::BFloat16>();
template const VecKernels<c10::Half>* table<c10::Half>();

}  // namespace CKPT_EXT_VEC_NS
}  // namespace cpu
}  // namespace kernels
}  // namespace ckpt_ext
