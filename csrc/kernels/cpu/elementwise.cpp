// CPU kernels of the fused-layer building blocks (declared in kernels/fused_kernels.h).
//
// Every dtype (float32, float64, float16, bfloat16) computes in at::opmath_type (float, or double for
// float64) and rounds once when it stores. The per-row sums of the norms accumulate in double (RowSum): a
// serial float sum of `hidden` terms is off by up to hidden/2 ulps, which normalisation multiplies by rstd
// (a row with a large mean relative to its spread, a constant row) -- PyTorch's own kernels are exact there.
// Work is split with at::parallel_for; reductions over rows (grad_weight, grad_bias) use a fixed partition
// into chunks, so results do not depend on the number of threads.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/gelu_backward.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/silu_backward.h>

#include <algorithm>
#include <cmath>
#include <vector>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define CKPT_EXT_X86_AVX2 1
#endif

#include "../fused_kernels.h"

namespace ckpt_ext {
namespace kernels {
namespace cpu {
namespace {

constexpr int64_t kElementGrain = 32768;  // elements per parallel task for elementwise kernels
constexpr int64_t kMaxReduceChunks = 64;  // row chunks of a row reduction (fixed: thread-count independent)

int64_t row_grain(int64_t hidden) { return std::max<int64_t>(1, kElementGrain / std::max<int64_t>(hidden, 1)); }

template <typename T>
const T* ptr_or_null(const at::Tensor& t) {
  return t.defined() ? t.const_data_ptr<T>() : nullptr;
}

// The float scale of dropout in accumulation precision (1 / (1 - p), 0 when everything is dropped).
template <typename A>
A dropout_scale(const DropoutArgs& d) {
  return d.p < 1.0 ? static_cast<A>(1.0 / (1.0 - d.p)) : A(0);
}

// ---- GELU ---------------------------------------------------------------------------------------------

template <typename A>
A gelu(A x, bool tanh_approx) {
  if (tanh_approx) {
    const A kBeta = A(M_SQRT2 * M_2_SQRTPI * 0.5);  // sqrt(2 / pi)
    const A inner = kBeta * (x + A(0.044715) * x * x * x);
    return A(0.5) * x * (A(1) + std::tanh(inner));
  }
  return A(0.5) * x * (A(1) + std::erf(x * A(M_SQRT1_2)));
}

template <typename A>
A gelu_derivative(A x, bool tanh_approx) {
  if (tanh_approx) {
    const A kBeta = A(M_SQRT2 * M_2_SQRTPI * 0.5);
    const A kKappa = A(0.044715);
    const A t = std::tanh(kBeta * (x + kKappa * x * x * x));
    return A(0.5) * (A(1) + t) + A(0.5) * x * (A(1) - t * t) * kBeta * (A(1) + A(3) * kKappa * x * x);
  }
  const A cdf = A(0.5) * (A(1) + std::erf(x * A(M_SQRT1_2)));
  const A pdf = std::exp(A(-0.5) * x * x) * A(M_2_SQRTPI * M_SQRT1_2 * 0.5);
  return cdf + x * pdf;
}

template <typename A>
A sigmoid(A x) {
  return A(1) / (A(1) + std::exp(-x));
}

// ---- dropout masks in blocks -------------------------------------------------------------------------------
//
// The mask is philox.h's (the same bits as the CUDA kernels and the reference); only the way the CPU
// computes it differs from a per-element cursor: the Philox words of all the 4-element groups a range
// touches are computed first -- 32 groups at a time with AVX2 where the CPU has it -- and each
// element is then one integer compare. Regenerating masks (forward, backward, replay) is what dropout
// costs here, so this matters.

void philox_words_scalar(const philox::Dropout& d, uint64_t g0, int64_t n, uint32_t* out) {
  for (int64_t j = 0; j < n; ++j) {
    const philox::Uint4 w = philox::dropout_bits(d.seed, d.offset, g0 + static_cast<uint64_t>(j));
    out[4 * j] = w.x;
    out[4 * j + 1] = w.y;
    out[4 * j + 2] = w.z;
    out[4 * j + 3] = w.w;
  }
}

#ifdef CKPT_EXT_X86_AVX2
// The 32x32->64 products of the even and odd 32-bit lanes (vpmuludq), recombined into low and high halves.
__attribute__((target("avx2"), always_inline)) inline __m256i mulhilo_avx2(__m256i a, __m256i m, __m256i* hi) {
  const __m256i even = _mm256_mul_epu32(a, m);
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);
  *hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
  return _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
}

// Philox4x32-10 of 32 consecutive groups per step: four independent 8-lane streams, so the rounds'
// multiply latencies overlap; the four words of each group are then transposed into place.
__attribute__((target("avx2"))) void philox_words_avx2(const philox::Dropout& d, uint64_t g0, int64_t n,
                                                        uint32_t* out) {
  constexpr int U = 4;
  const __m256i m0 = _mm256_set1_epi32(static_cast<int>(philox::kMul0));
  const __m256i m1 = _mm256_set1_epi32(static_cast<int>(philox::kMul1));
  const __m256i off_lo = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(d.offset)));
  const __m256i off_hi = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(d.offset >> 32)));
  int64_t j = 0;
  for (; j + 8 * U <= n; j += 8 * U) {
    __m256i x[U], y[U], z[U], w[U];
    for (int u = 0; u < U; ++u) {
      alignas(32) uint32_t lo[8], hi[8];
      for (int l = 0; l < 8; ++l) {
        const uint64_t g = g0 + static_cast<uint64_t>(j + 8 * u + l);
        lo[l] = static_cast<uint32_t>(g);
        hi[l] = static_cast<uint32_t>(g >> 32);
      }
      x[u] = _mm256_load_si256(reinterpret_cast<const __m256i*>(lo));
      y[u] = _mm256_load_si256(reinterpret_cast<const __m256i*>(hi));
      z[u] = off_lo;
      w[u] = off_hi;
    }
    uint32_t k0 = static_cast<uint32_t>(d.seed), k1 = static_cast<uint32_t>(d.seed >> 32);
    for (int r = 0; r < 10; ++r) {
      const __m256i key0 = _mm256_set1_epi32(static_cast<int>(k0)), key1 = _mm256_set1_epi32(static_cast<int>(k1));
      for (int u = 0; u < U; ++u) {
        __m256i hi0, hi1;
        const __m256i lo0 = mulhilo_avx2(x[u], m0, &hi0);
        const __m256i lo1 = mulhilo_avx2(z[u], m1, &hi1);
        x[u] = _mm256_xor_si256(_mm256_xor_si256(hi1, y[u]), key0);
        z[u] = _mm256_xor_si256(_mm256_xor_si256(hi0, w[u]), key1);
        y[u] = lo1;
        w[u] = lo0;
      }
      k0 += philox::kWeyl0;
      k1 += philox::kWeyl1;
    }
    for (int u = 0; u < U; ++u) {
      // (x, y, z, w) of lanes 0..7 -> groups 0..7 of four consecutive words.
      const __m256i t0 = _mm256_unpacklo_epi32(x[u], y[u]), t1 = _mm256_unpackhi_epi32(x[u], y[u]);
      const __m256i t2 = _mm256_unpacklo_epi32(z[u], w[u]), t3 = _mm256_unpackhi_epi32(z[u], w[u]);
      const __m256i a0 = _mm256_unpacklo_epi64(t0, t2), a1 = _mm256_unpackhi_epi64(t0, t2);  // groups 0,1 | 4,5
      const __m256i a2 = _mm256_unpacklo_epi64(t1, t3), a3 = _mm256_unpackhi_epi64(t1, t3);  // groups 2,3 | 6,7
      uint32_t* o = out + 4 * (j + 8 * u);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm256_permute2x128_si256(a0, a1, 0x20));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 8), _mm256_permute2x128_si256(a2, a3, 0x20));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16), _mm256_permute2x128_si256(a0, a1, 0x31));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 24), _mm256_permute2x128_si256(a2, a3, 0x31));
    }
  }
  philox_words_scalar(d, g0 + static_cast<uint64_t>(j), n - j, out + 4 * j);
}

bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}
#endif

// out[4 * j + w] = Philox word w of group g0 + j, for j < n.
void philox_words(const philox::Dropout& d, uint64_t g0, int64_t n, uint32_t* out) {
#ifdef CKPT_EXT_X86_AVX2
  if (cpu_has_avx2()) return philox_words_avx2(d, g0, n, out);
#endif
  philox_words_scalar(d, g0, n, out);
}

// The Philox words of element ranges under one dropout (one object per parallel task): element k of
// the range is kept iff keep(words[k]).
class DropoutWords {
 public:
  static constexpr int64_t kBlock = 2048;  // elements per fill in the elementwise kernels

  explicit DropoutWords(const philox::Dropout& d)
      // bits_to_uniform(b) = (b >> 8) * 2^-24 >= p  <=>  (b >> 8) >= ceil(p * 2^24): exact, since both
      // sides are exact in double.
      : d_(d), threshold_(static_cast<uint32_t>(std::ceil(static_cast<double>(d.p) * 16777216.0))) {}

  // Words of elements [i0, i0 + n), valid until the next call.
  const uint32_t* fill(uint64_t i0, int64_t n) {
    const uint64_t g_first = i0 >> 2;
    const int64_t groups = static_cast<int64_t>(((i0 + static_cast<uint64_t>(n) - 1) >> 2) - g_first + 1);
    words_.resize(static_cast<size_t>(4 * groups));
    philox_words(d_, g_first, groups, words_.data());
    return words_.data() + (i0 & 3);
  }

  bool keep(uint32_t word) const { return (word >> 8) >= threshold_; }

 private:
  philox::Dropout d_;
  uint32_t threshold_;
  std::vector<uint32_t> words_;
};

// float32 / float64 are their own accumulation type, so ATen's vectorized kernels (SIMD erf, tanh, exp)
// compute what the scalar loops below compute, in the same precision (up to the last bit of those
// functions), an order of magnitude faster: the scalar GELU/SiLU loops, calling std::erf/std::exp per
// element, dominated a CPU training step. The scalar loops serve float16 / bfloat16, which they compute
// in float and round once.
bool aten_vectorized(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble;
}

c10::string_view gelu_kind(bool tanh) { return tanh ? "tanh" : "none"; }

}  // namespace

// ---- elementwise ----------------------------------------------------------------------------------------

void bias_gelu_forward(const at::Tensor& x, const at::Tensor& bias, bool tanh, const at::Tensor& out) {
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

void bias_gelu_backward(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& bias, bool tanh,
                        const at::Tensor& grad_x) {
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

void bias_dropout_add_forward(const at::Tensor& x, const at::Tensor& bias, const at::Tensor& residual,
                              const DropoutArgs& dropout, const at::Tensor& out) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "ckpt_ext::bias_dropout_add", [&] {
    using A = at::opmath_type<scalar_t>;
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* bp = ptr_or_null<scalar_t>(bias);
    const scalar_t* rp = residual.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
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
          op[i] = static_cast<scalar_t>(static_cast<A>(rp[i]) + v);
          if (++col == hidden) col = 0;
        }
      }
    });
  });
}

void dropout_backward(const at::Tensor& grad, const DropoutArgs& dropout, const at::Tensor& grad_x) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "ckpt_ext::dropout_backward", [&] {
    using A = at::opmath_type<scalar_t>;
    const scalar_t* gp = grad.const_data_ptr<scalar_t>();
    scalar_t* dp = grad_x.mutable_data_ptr<scalar_t>();
    const bool drop = dropout.enabled();
    const A scale = dropout_scale<A>(dropout);
    const philox::Dropout ph = dropout.philox();
    at::parallel_for(0, grad.numel(), kElementGrain, [&](int64_t begin, int64_t end) {
      if (!drop) {
        std::copy(gp + begin, gp + end, dp + begin);
        return;
      }
      DropoutWords mask(ph);
      for (int64_t b0 = begin; b0 < end; b0 += DropoutWords::kBlock) {
        const int64_t b1 = std::min(end, b0 + DropoutWords::kBlock);
        const uint32_t* words = mask.fill(b0, b1 - b0);
        for (int64_t i = b0; i < b1; ++i)
          dp[i] = mask.keep(words[i - b0]) ? static_cast<scalar_t>(static_cast<A>(gp[i]) * scale) : scalar_t(0);
      }
    });
  });
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

void rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool backward,
            const at::Tensor& out) {
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

// ---- row-wise norms -------------------------------------------------------------------------------------

namespace {

// A fixed partition of rows into chunks for reductions over rows.
struct RowChunks {
  int64_t count;
  int64_t rows_per_chunk;
  explicit RowChunks(int64_t rows)
      : count(std::max<int64_t>(1, std::min(rows, kMaxReduceChunks))),
        rows_per_chunk((rows + count - 1) / count) {}
};

// Accumulator of the norms' per-row sums (see the top of this file).
using RowSum = double;

// Sums per-chunk partials [chunks, hidden] (in chunk order) into out[hidden].
template <typename T, typename A>
void reduce_chunks(const std::vector<A>& partial, int64_t chunks, int64_t hidden, T* out) {
  at::parallel_for(0, hidden, kElementGrain / std::max<int64_t>(chunks, 1) + 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      A acc = 0;
      for (int64_t c = 0; c < chunks; ++c) acc += partial[c * hidden + j];
      out[j] = static_cast<T>(acc);
    }
  });
}

}  // namespace

void layer_norm_forward(const at::Tensor& x, const at::Tensor& bias, const at::Tensor& residual,
                        const DropoutArgs& dropout, const at::Tensor& weight, const at::Tensor& ln_bias, double eps,
                        const at::Tensor& out, const at::Tensor& pre_norm, const at::Tensor& mean,
                        const at::Tensor& rstd) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "ckpt_ext::layer_norm_forward", [&] {
    using A = at::opmath_type<scalar_t>;
    const int64_t hidden = weight.numel();
    const int64_t rows = x.numel() / hidden;
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* bp = ptr_or_null<scalar_t>(bias);
    const scalar_t* rp = ptr_or_null<scalar_t>(residual);
    const scalar_t* wp = weight.const_data_ptr<scalar_t>();
    const scalar_t* lbp = ptr_or_null<scalar_t>(ln_bias);
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    scalar_t* pp = pre_norm.mutable_data_ptr<scalar_t>();
    A* mp = mean.mutable_data_ptr<A>();
    A* sp = rstd.mutable_data_ptr<A>();
    const bool drop = dropout.enabled();
    const A scale = dropout_scale<A>(dropout);
    const philox::Dropout ph = dropout.philox();
    at::parallel_for(0, rows, row_grain(hidden), [&](int64_t begin, int64_t end) {
      std::vector<A> v(hidden);
      DropoutWords mask(ph);
      for (int64_t r = begin; r < end; ++r) {
        const int64_t base = r * hidden;
        const uint32_t* words = drop ? mask.fill(base, hidden) : nullptr;
        RowSum sum = 0;
        for (int64_t j = 0; j < hidden; ++j) {
          A val = static_cast<A>(xp[base + j]) + (bp ? static_cast<A>(bp[j]) : A(0));
          if (drop) val = mask.keep(words[j]) ? val * scale : A(0);
          if (rp) val += static_cast<A>(rp[base + j]);
          const scalar_t stored = static_cast<scalar_t>(val);
          pp[base + j] = stored;
          v[j] = static_cast<A>(stored);  // normalise exactly what is stored (and what backward reads)
          sum += v[j];
        }
        const A mu = static_cast<A>(sum / hidden);
        RowSum var = 0;
        for (int64_t j = 0; j < hidden; ++j) var += static_cast<RowSum>((v[j] - mu) * (v[j] - mu));
        const A rs = static_cast<A>(1 / std::sqrt(var / hidden + eps));
        mp[r] = mu;
        sp[r] = rs;
        for (int64_t j = 0; j < hidden; ++j) {
          A y = (v[j] - mu) * rs * static_cast<A>(wp[j]);
          if (lbp) y += static_cast<A>(lbp[j]);
          op[base + j] = static_cast<scalar_t>(y);
        }
      }
    });
  });
}

void layer_norm_backward(const at::Tensor& grad_out, const at::Tensor& grad_pre_norm, const at::Tensor& pre_norm,
                         const at::Tensor& weight, const at::Tensor& mean, const at::Tensor& rstd,
                         const DropoutArgs& dropout, const at::Tensor& grad_pre, const at::Tensor& grad_x,
                         const at::Tensor& grad_weight, const at::Tensor& grad_ln_bias) {
  const auto dtype = pre_norm.scalar_type();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "ckpt_ext::layer_norm_backward", [&] {
    using A = at::opmath_type<scalar_t>;
    const int64_t hidden = weight.numel();
    const int64_t rows = pre_norm.numel() / hidden;
    const scalar_t* gp = grad_out.const_data_ptr<scalar_t>();
    const scalar_t* gsp = ptr_or_null<scalar_t>(grad_pre_norm);
    const scalar_t* vp = pre_norm.const_data_ptr<scalar_t>();
    const scalar_t* wp = weight.const_data_ptr<scalar_t>();
    const A* mp = mean.const_data_ptr<A>();
    const A* sp = rstd.const_data_ptr<A>();
    scalar_t* dpre = grad_pre.mutable_data_ptr<scalar_t>();
    scalar_t* dx = grad_x.defined() ? grad_x.mutable_data_ptr<scalar_t>() : nullptr;
    const bool drop = dropout.enabled();
    const A scale = dropout_scale<A>(dropout);
    const philox::Dropout ph = dropout.philox();
    const RowChunks chunks(rows);
    std::vector<A> partial_w(chunks.count * hidden, A(0)), partial_b(chunks.count * hidden, A(0));
    at::parallel_for(0, chunks.count, 1, [&](int64_t c0, int64_t c1) {
      DropoutWords mask(ph);
      for (int64_t c = c0; c < c1; ++c) {
        A* pw = partial_w.data() + c * hidden;
        A* pb = partial_b.data() + c * hidden;
        const int64_t r_end = std::min(rows, (c + 1) * chunks.rows_per_chunk);
        for (int64_t r = c * chunks.rows_per_chunk; r < r_end; ++r) {
          const int64_t base = r * hidden;
          const A mu = mp[r], rs = sp[r];
          RowSum sum_dy = 0, sum_dy_xhat = 0;  // dy = grad_out * weight
          for (int64_t j = 0; j < hidden; ++j) {
            const A g = static_cast<A>(gp[base + j]);
            const A xhat = (static_cast<A>(vp[base + j]) - mu) * rs;
            const A dy = g * static_cast<A>(wp[j]);
            sum_dy += dy;
            sum_dy_xhat += dy * xhat;
            pw[j] += g * xhat;
            pb[j] += g;
          }
          const A c_mean = static_cast<A>(sum_dy / hidden), c_xhat = static_cast<A>(sum_dy_xhat / hidden);
          const uint32_t* words = drop && dx ? mask.fill(base, hidden) : nullptr;
          for (int64_t j = 0; j < hidden; ++j) {
            const A xhat = (static_cast<A>(vp[base + j]) - mu) * rs;
            A d = rs * (static_cast<A>(gp[base + j]) * static_cast<A>(wp[j]) - c_mean - xhat * c_xhat);
            if (gsp) d += static_cast<A>(gsp[base + j]);
            dpre[base + j] = static_cast<scalar_t>(d);
            if (dx) dx[base + j] = static_cast<scalar_t>(!drop ? d : mask.keep(words[j]) ? d * scale : A(0));
          }
        }
      }
    });
    reduce_chunks(partial_w, chunks.count, hidden, grad_weight.mutable_data_ptr<scalar_t>());
    reduce_chunks(partial_b, chunks.count, hidden, grad_ln_bias.mutable_data_ptr<scalar_t>());
  });
}

void rms_norm_forward(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
                      const at::Tensor& out, const at::Tensor& sum, const at::Tensor& rstd) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "ckpt_ext::rms_norm_forward", [&] {
    using A = at::opmath_type<scalar_t>;
    const int64_t hidden = weight.numel();
    const int64_t rows = x.numel() / hidden;
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* rp = ptr_or_null<scalar_t>(residual);
    const scalar_t* wp = weight.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    scalar_t* sump = sum.mutable_data_ptr<scalar_t>();
    A* sp = rstd.mutable_data_ptr<A>();
    at::parallel_for(0, rows, row_grain(hidden), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t base = r * hidden;
        RowSum sum_sq = 0;
        for (int64_t j = 0; j < hidden; ++j) {
          A val = static_cast<A>(xp[base + j]);
          if (rp) val += static_cast<A>(rp[base + j]);
          const scalar_t stored = static_cast<scalar_t>(val);
          sump[base + j] = stored;
          sum_sq += static_cast<RowSum>(stored) * static_cast<RowSum>(stored);
        }
        const A rs = static_cast<A>(1 / std::sqrt(sum_sq / hidden + eps));
        sp[r] = rs;
        for (int64_t j = 0; j < hidden; ++j) {
          // LlamaRMSNorm: normalise in float, cast back to the input dtype, then multiply by the weight.
          const scalar_t normed = static_cast<scalar_t>(static_cast<A>(sump[base + j]) * rs);
          op[base + j] = static_cast<scalar_t>(static_cast<A>(wp[j]) * static_cast<A>(normed));
        }
      }
    });
  });
}

void rms_norm_backward(const at::Tensor& grad_out, const at::Tensor& grad_sum, const at::Tensor& sum,
                       const at::Tensor& weight, const at::Tensor& rstd, const at::Tensor& grad_input,
                       const at::Tensor& grad_weight) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, sum.scalar_type(), "ckpt_ext::rms_norm_backward", [&] {
    using A = at::opmath_type<scalar_t>;
    const int64_t hidden = weight.numel();
    const int64_t rows = sum.numel() / hidden;
    const scalar_t* gp = grad_out.const_data_ptr<scalar_t>();
    const scalar_t* gsp = ptr_or_null<scalar_t>(grad_sum);
    const scalar_t* vp = sum.const_data_ptr<scalar_t>();
    const scalar_t* wp = weight.const_data_ptr<scalar_t>();
    const A* sp = rstd.const_data_ptr<A>();
    scalar_t* dinp = grad_input.mutable_data_ptr<scalar_t>();
    const RowChunks chunks(rows);
    std::vector<A> partial_w(chunks.count * hidden, A(0));
    at::parallel_for(0, chunks.count, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        A* pw = partial_w.data() + c * hidden;
        const int64_t r_end = std::min(rows, (c + 1) * chunks.rows_per_chunk);
        for (int64_t r = c * chunks.rows_per_chunk; r < r_end; ++r) {
          const int64_t base = r * hidden;
          const A rs = sp[r];
          RowSum sum_dn_n = 0;  // dn = grad_out * weight, n = sum * rstd
          for (int64_t j = 0; j < hidden; ++j) {
            const A g = static_cast<A>(gp[base + j]);
            const A n = static_cast<A>(vp[base + j]) * rs;
            sum_dn_n += g * static_cast<A>(wp[j]) * n;
            pw[j] += g * static_cast<A>(static_cast<scalar_t>(n));  // out = weight * to_dtype(n)
          }
          const A c_n = static_cast<A>(sum_dn_n / hidden);
          for (int64_t j = 0; j < hidden; ++j) {
            const A n = static_cast<A>(vp[base + j]) * rs;
            A d = rs * (static_cast<A>(gp[base + j]) * static_cast<A>(wp[j]) - n * c_n);
            if (gsp) d += static_cast<A>(gsp[base + j]);
            dinp[base + j] = static_cast<scalar_t>(d);
          }
        }
      }
    });
    reduce_chunks(partial_w, chunks.count, hidden, grad_weight.mutable_data_ptr<scalar_t>());
  });
}

}  // namespace cpu
}  // namespace kernels
}  // namespace ckpt_ext
