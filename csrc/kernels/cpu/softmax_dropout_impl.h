// The SIMD rows of the CPU attention's softmax + dropout (softmax_dropout.h): included by vec_avx2.cpp and
// vec_avx512.cpp right after vec_impl.h, whose helpers (IO, for_steps, apply_dropout) it uses, inside the same
// target pragma. exp is at::vec's inline exp_u20 (<= 20 float ulps; vec_impl.h says why), the row max and sum
// are reduced across the vector lanes in a fixed order: the same bits for the same row whatever the thread
// count, not ATen's softmax's bits (its summation order and exp differ: within a few float ulps).
#include <limits>

namespace ckpt_ext {
namespace kernels {
namespace cpu {
namespace CKPT_EXT_VEC_NS {
namespace {

CKPT_EXT_VEC_INLINE float lanes_max(const fVec& v) {
  alignas(64) float t[kF];
  v.store(t);
  float m = t[0];
  for (int64_t k = 1; k < kF; ++k) m = (t[k] > m || t[k] != t[k]) ? t[k] : m;  // NaN propagates
  return m;
}

CKPT_EXT_VEC_INLINE float lanes_sum(const fVec& v) {
  alignas(64) float t[kF];
  v.store(t);
  float s = 0.f;
  for (int64_t k = 0; k < kF; ++k) s += t[k];
  return s;
}

// One forward row of n columns, of which the first `valid` are unmasked (causal: s + 1, else n). x: scratch of
// n rounded up to kStep floats.
template <typename G, typename M, typename L>
void forward_row(const G* s, const M* m, int64_t n, int64_t valid, float* x, L* probs, G* dropped,
                 const VecDropout& d) {
  const float ninf = -std::numeric_limits<float>::infinity();
  fVec vmax(ninf);
  // logits = L(s + m), kept in x; the partial step's tail filled with -inf (exp gives 0 there)
  for_steps(valid, [&](int64_t i, int64_t c) CKPT_EXT_VEC_LAMBDA {
    fVec a, b;
    IO<G>::load(s + i, c, a, b);
    add_opt(m ? m + i : nullptr, c, a, b);
    IO<L>::round(a, b);
    IO<float>::store(x + i, c, a, b);
    if (c != kStep) {
      for (int64_t k = c; k < kStep; ++k) x[i + k] = ninf;
      IO<float>::load(x + i, kStep, a, b);
    }
    vmax = at::vec::maximum(vmax, at::vec::maximum(a, b));
  });
  const int64_t padded = (valid + kStep - 1) / kStep * kStep;
  const fVec mx(lanes_max(vmax));
  fVec vsum(0.f);
  for (int64_t i = 0; i < padded; i += kStep) {
    const fVec a = (fVec::loadu(x + i) - mx).exp_u20(), b = (fVec::loadu(x + i + kF) - mx).exp_u20();
    a.store(x + i);
    b.store(x + i + kF);
    vsum = vsum + (a + b);
  }
  const fVec inv(1.f / lanes_sum(vsum));
  for_steps(n, [&](int64_t i, int64_t c) CKPT_EXT_VEC_LAMBDA {
    fVec a(0.f), b(0.f);
    if (i < padded) {
      a = fVec::loadu(x + i) * inv;
      b = fVec::loadu(x + i + kF) * inv;
    }
    if (probs)
      IO<L>::store_round(probs + i, c, a, b);
    else
      IO<L>::round(a, b);
    apply_dropout(d, d.words + i, c, a, b);
    IO<L>::round(a, b);
    IO<G>::store(dropped + i, c, a, b);
  });
}

// One backward row: x, scratch of n rounded up to kStep floats (the probabilities' gradient).
template <typename G, typename L>
void backward_row(const G* g, const L* p, int64_t n, float* x, G* grad_scores, G* dropped, const VecDropout& d) {
  fVec vdot(0.f);
  for_steps(n, [&](int64_t i, int64_t c) CKPT_EXT_VEC_LAMBDA {
    fVec ga, gb, pa, pb;
    IO<G>::load(g + i, c, ga, gb);  // G is never wider than L: no rounding to L here
    apply_dropout(d, d.words + i, c, ga, gb);
    IO<L>::round(ga, gb);
    IO<float>::store(x + i, c, ga, gb);
    IO<L>::load(p + i, c, pa, pb);  // zero-filled past n, as ga, gb
    vdot = vdot + (ga * pa + gb * pb);
    apply_dropout(d, d.words + i, c, pa, pb);
    IO<L>::round(pa, pb);
    IO<G>::store(dropped + i, c, pa, pb);
  });
  const fVec dot(lanes_sum(vdot));
  for_steps(n, [&](int64_t i, int64_t c) CKPT_EXT_VEC_LAMBDA {
    fVec ga, gb, pa, pb;
    IO<float>::load(x + i, c, ga, gb);
    IO<L>::load(p + i, c, pa, pb);
    fVec ra = pa * (ga - dot), rb = pb * (gb - dot);
    IO<L>::round(ra, rb);
    IO<G>::store(grad_scores + i, c, ra, rb);
  });
}

template <typename T>
const T* cptr(const void* p, int64_t i) {
  return p ? static_cast<const T*>(p) + i : nullptr;
}
template <typename T>
T* mptr(void* p, int64_t i) {
  return p ? static_cast<T*>(p) + i : nullptr;
}

template <typename G, typename M, typename L>
void forward_rows(const SoftmaxDropoutRows& a, int64_t r0, int64_t r1, const uint32_t* words, float* x) {
  const int64_t n = a.cols;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t s = r % a.seq, h = (r / a.seq) % a.heads, b = r / (a.seq * a.heads);
    const VecDropout d{words + (r - r0) * n, a.threshold, a.scale};
    forward_row<G, M, L>(cptr<G>(a.scores, r * n), cptr<M>(a.mask, b * a.mask_sb + h * a.mask_sh + s * a.mask_ss), n,
                         a.causal ? std::min(s + 1, n) : n, x, mptr<L>(a.probs, r * n), mptr<G>(a.dropped, r * n), d);
  }
}

template <typename G, typename L>
void backward_rows(const SoftmaxDropoutRows& a, int64_t r0, int64_t r1, const uint32_t* words, float* x) {
  const int64_t n = a.cols;
  for (int64_t r = r0; r < r1; ++r) {
    const VecDropout d{words + (r - r0) * n, a.threshold, a.scale};
    backward_row<G, L>(cptr<G>(a.grad, r * n), cptr<L>(a.probs, r * n), n, x, mptr<G>(a.grad_scores, r * n),
                       mptr<G>(a.dropped, r * n), d);
  }
}

}  // namespace

// The (G, M, L) combinations softmax_dropout.cpp passes: L = promote(G, M), both float or bfloat16.
void softmax_dropout_rows(const SoftmaxDropoutRows& a, bool backward, int64_t r0, int64_t r1, const uint32_t* words,
                          float* scratch) {
  using BF = c10::BFloat16;
  const bool gb = a.g == RowDtype::kBFloat16, mb = a.m == RowDtype::kBFloat16, lb = a.l == RowDtype::kBFloat16;
  if (backward) {
    if (!gb) return backward_rows<float, float>(a, r0, r1, words, scratch);
    if (!lb) return backward_rows<BF, float>(a, r0, r1, words, scratch);
    return backward_rows<BF, BF>(a, r0, r1, words, scratch);
  }
  if (!gb && !mb) return forward_rows<float, float, float>(a, r0, r1, words, scratch);
  if (!gb) return forward_rows<float, BF, float>(a, r0, r1, words, scratch);
  if (!lb) return mb ? forward_rows<BF, BF, float>(a, r0, r1, words, scratch)
                     : forward_rows<BF, float, float>(a, r0, r1, words, scratch);
  return forward_rows<BF, BF, BF>(a, r0, r1, words, scratch);
}

}  // namespace CKPT_EXT_VEC_NS
}  // namespace cpu
}  // namespace kernels
}  // namespace ckpt_ext
