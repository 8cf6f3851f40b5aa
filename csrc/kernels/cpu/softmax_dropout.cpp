// The CPU attention's softmax + dropout row pass (softmax_dropout.h): the rows split over threads
// (at::parallel_for), the dropout words of a block of rows drawn at once (DropoutWords), and each row run by the
// SIMD kernels (softmax_dropout_impl.h) where vec.h has them for this CPU, else by the portable loops below (the
// same roundings; std::exp and plain sums instead of exp_u20 and the lane sums).
#include "softmax_dropout.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common.h"

namespace ckpt_ext {
namespace kernels {
namespace cpu {
namespace {

RowDtype row_dtype(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16,
              "ckpt_ext softmax_dropout: ", what, " must be float32 or bfloat16, got ", t.scalar_type());
  return t.scalar_type() == at::kFloat ? RowDtype::kFloat : RowDtype::kBFloat16;
}

template <typename T>
float rnd(float v) {
  return static_cast<float>(static_cast<T>(v));
}

template <typename G, typename M, typename L>
void forward_rows_portable(const SoftmaxDropoutRows& a, int64_t r0, int64_t r1, const uint32_t* words, float* x) {
  const int64_t n = a.cols;
  const G* sp = static_cast<const G*>(a.scores);
  const M* mp = static_cast<const M*>(a.mask);
  L* pp = static_cast<L*>(a.probs);
  G* dp = static_cast<G*>(a.dropped);
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t s = r % a.seq, h = (r / a.seq) % a.heads, b = r / (a.seq * a.heads);
    const int64_t valid = a.causal ? std::min(s + 1, n) : n;
    const G* sr = sp + r * n;
    const M* mr = mp ? mp + b * a.mask_sb + h * a.mask_sh + s * a.mask_ss : nullptr;
    const uint32_t* w = words + (r - r0) * n;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < valid; ++j) {
      x[j] = rnd<L>(static_cast<float>(sr[j]) + (mr ? static_cast<float>(mr[j]) : 0.f));
      mx = (x[j] > mx || x[j] != x[j]) ? x[j] : mx;
    }
    float sum = 0.f;
    for (int64_t j = 0; j < valid; ++j) sum += (x[j] = std::exp(x[j] - mx));
    const float inv = 1.f / sum;
    for (int64_t j = 0; j < n; ++j) {
      const float p = j < valid ? rnd<L>(x[j] * inv) : 0.f;
      if (pp) pp[r * n + j] = static_cast<L>(p);
      dp[r * n + j] = static_cast<G>((w[j] >> 8) >= a.threshold ? rnd<L>(p * a.scale) : 0.f);
    }
  }
}

template <typename G, typename L>
void backward_rows_portable(const SoftmaxDropoutRows& a, int64_t r0, int64_t r1, const uint32_t* words, float* x) {
  const int64_t n = a.cols;
  const G* gp = static_cast<const G*>(a.grad);
  const L* pp = static_cast<const L*>(a.probs);
  G* sp = static_cast<G*>(a.grad_scores);
  G* dp = static_cast<G*>(a.dropped);
  for (int64_t r = r0; r < r1; ++r) {
    const uint32_t* w = words + (r - r0) * n;
    const G* gr = gp + r * n;
    const L* pr = pp + r * n;
    float dot = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      const bool keep = (w[j] >> 8) >= a.threshold;
      const float p = static_cast<float>(pr[j]);
      x[j] = keep ? rnd<L>(static_cast<float>(gr[j]) * a.scale) : 0.f;
      dot += x[j] * p;
      dp[r * n + j] = static_cast<G>(keep ? rnd<L>(p * a.scale) : 0.f);
    }
    for (int64_t j = 0; j < n; ++j) sp[r * n + j] = static_cast<G>(rnd<L>(static_cast<float>(pr[j]) * (x[j] - dot)));
  }
}

void rows_portable(const SoftmaxDropoutRows& a, bool backward, int64_t r0, int64_t r1, const uint32_t* words,
                   float* x) {
  using BF = c10::BFloat16;
  const bool gb = a.g == RowDtype::kBFloat16, mb = a.m == RowDtype::kBFloat16, lb = a.l == RowDtype::kBFloat16;
  if (backward) {
    if (!gb) return backward_rows_portable<float, float>(a, r0, r1, words, x);
    if (!lb) return backward_rows_portable<BF, float>(a, r0, r1, words, x);
    return backward_rows_portable<BF, BF>(a, r0, r1, words, x);
  }
  if (!gb && !mb) return forward_rows_portable<float, float, float>(a, r0, r1, words, x);
  if (!gb) return forward_rows_portable<float, BF, float>(a, r0, r1, words, x);
  if (!lb) return mb ? forward_rows_portable<BF, BF, float>(a, r0, r1, words, x)
                     : forward_rows_portable<BF, float, float>(a, r0, r1, words, x);
  return forward_rows_portable<BF, BF, BF>(a, r0, r1, words, x);
}

using RowsFn = void (*)(const SoftmaxDropoutRows&, bool, int64_t, int64_t, const uint32_t*, float*);

// The SIMD rows of the instruction set vec.h picked for this CPU (the same choice as every other kernel's).
RowsFn rows_fn() {
#ifdef CKPT_EXT_VEC_X86
  const VecKernels<float>* k = vec_kernels<float>();
  if (k == avx512::table<float>()) return &avx512::softmax_dropout_rows;
  if (k == avx2::table<float>()) return &avx2::softmax_dropout_rows;
#endif
  return &rows_portable;
}

void run_rows(const SoftmaxDropoutRows& a, int64_t rows, bool backward, const DropoutArgs& dropout) {
  const int64_t n = a.cols;
  if (rows == 0 || n == 0) return;
  const RowsFn fn = rows_fn();
  const int64_t per_fill = std::max<int64_t>(1, DropoutWords::kBlock / n);  // rows whose words are drawn at once
  const int64_t padded = (n + 63) / 64 * 64;
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    DropoutWords mask(dropout.philox());
    std::vector<float> scratch(static_cast<size_t>(padded));
    for (int64_t r = begin; r < end; r += per_fill) {
      const int64_t r1 = std::min(end, r + per_fill);
      const uint32_t* words = mask.fill(static_cast<uint64_t>(r * n), (r1 - r) * n);
      fn(a, backward, r, r1, words, scratch.data());
    }
  });
}

SoftmaxDropoutRows rows_of(const at::Tensor& like, const DropoutArgs& dropout) {
  SoftmaxDropoutRows a{};
  a.heads = like.size(1);
  a.seq = like.size(2);
  a.cols = like.size(3);
  a.scale = dropout_scale<float>(dropout);
  a.threshold = DropoutWords(dropout.philox()).threshold();
  return a;
}

}  // namespace

void softmax_dropout_forward(const at::Tensor& scores, const at::Tensor& mask, bool causal, const DropoutArgs& dropout,
                             const at::Tensor& probs, const at::Tensor& dropped) {
  TORCH_CHECK(scores.dim() == 4 && scores.is_contiguous() && dropped.is_contiguous() &&
                  dropped.sizes() == scores.sizes() && dropped.scalar_type() == scores.scalar_type(),
              "ckpt_ext softmax_dropout: scores and dropped must be contiguous [B, heads, S, Sk] of one dtype");
  TORCH_CHECK(dropout.p > 0 && dropout.p < 1, "ckpt_ext softmax_dropout: p must be in (0, 1), got ", dropout.p);
  SoftmaxDropoutRows a = rows_of(scores, dropout);
  a.g = row_dtype(scores, "scores");
  a.l = a.g;
  a.m = a.g;
  if (mask.defined()) {
    TORCH_CHECK(!causal, "ckpt_ext softmax_dropout: causal takes no mask");
    TORCH_CHECK(mask.dim() == 4 && mask.sizes() == scores.sizes() && mask.stride(3) == 1,
                "ckpt_ext softmax_dropout: mask must be [B, heads, S, Sk] with a contiguous last dim");
    a.m = row_dtype(mask, "mask");
    a.l = (a.g == RowDtype::kBFloat16 && a.m == RowDtype::kBFloat16) ? RowDtype::kBFloat16 : RowDtype::kFloat;
    a.mask = mask.const_data_ptr();
    a.mask_sb = mask.stride(0);
    a.mask_sh = mask.stride(1);
    a.mask_ss = mask.stride(2);
  }
  TORCH_CHECK(!causal || scores.size(2) == scores.size(3), "ckpt_ext softmax_dropout: causal needs S == Sk");
  a.causal = causal;
  if (probs.defined()) {
    TORCH_CHECK(probs.is_contiguous() && probs.sizes() == scores.sizes() &&
                    row_dtype(probs, "probs") == a.l,
                "ckpt_ext softmax_dropout: probs must be contiguous, of the scores' shape and the logits' dtype");
    a.probs = probs.mutable_data_ptr();
  }
  a.scores = scores.const_data_ptr();
  a.dropped = dropped.mutable_data_ptr();
  run_rows(a, scores.numel() / std::max<int64_t>(1, scores.size(3)), false, dropout);
}

void softmax_dropout_backward(const at::Tensor& grad_dropped, const at::Tensor& probs, const DropoutArgs& dropout,
                              const at::Tensor& grad_scores, const at::Tensor& dropped) {
  TORCH_CHECK(grad_dropped.dim() == 4 && grad_dropped.is_contiguous() && probs.is_contiguous() &&
                  grad_scores.is_contiguous() && dropped.is_contiguous() && probs.sizes() == grad_dropped.sizes() &&
                  grad_scores.sizes() == grad_dropped.sizes() && dropped.sizes() == grad_dropped.sizes() &&
                  grad_scores.scalar_type() == grad_dropped.scalar_type() &&
                  dropped.scalar_type() == grad_dropped.scalar_type(),
              "ckpt_ext softmax_dropout_backward: contiguous [B, heads, S, Sk] tensors, the gradients in one dtype");
  TORCH_CHECK(dropout.p > 0 && dropout.p < 1, "ckpt_ext softmax_dropout: p must be in (0, 1), got ", dropout.p);
  SoftmaxDropoutRows a = rows_of(grad_dropped, dropout);
  a.g = row_dtype(grad_dropped, "grad");
  a.l = row_dtype(probs, "probs");
  a.m = a.g;
  TORCH_CHECK(a.g == RowDtype::kBFloat16 || a.l == RowDtype::kFloat,
              "ckpt_ext softmax_dropout_backward: bfloat16 probabilities need bfloat16 gradients");
  a.grad = grad_dropped.const_data_ptr();
  a.probs = const_cast<void*>(probs.const_data_ptr());
  a.grad_scores = grad_scores.mutable_data_ptr();
  a.dropped = dropped.mutable_data_ptr();
  run_rows(a, grad_dropped.numel() / std::max<int64_t>(1, grad_dropped.size(3)), true, dropout);
}

}  // namespace cpu
}  // namespace kernels
}  // namespace ckpt_ext
