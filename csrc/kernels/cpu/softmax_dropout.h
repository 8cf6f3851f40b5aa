// The CPU attention's row pass (layers/attention.cpp, attention with dropout written out): forward, the mask
// added to the scores, softmax and ckpt_ext's Philox dropout in one pass over each row; backward, the dropout's
// and the softmax's backward in one pass, the dropped probabilities regenerated from the saved ones for the
// value gradient. CPU only (CUDA runs SDPA's kernels). softmax_dropout.cpp holds the entry points (work split,
// dropout words, the portable loops), softmax_dropout_impl.h the SIMD rows (compiled per instruction set by
// vec_avx2.cpp / vec_avx512.cpp, as vec_impl.h).
//
// Types: G, the scores' (and the dropped probabilities', the gradients'): the products' dtype; L, the logits'
// (and the probabilities'): promote(G, the mask's dtype) -- float32 for bfloat16 scores beside a float32 mask
// under autocast, as at::add gives it; M, the mask's. Every value is computed in float and rounded where the
// written-out ops round: logits = L(s + m), probs = L(softmax(logits)), dropped = G(L(probs * keep / (1 - p))).
// Backward: dprobs = L(dropped_grad * keep / (1 - p)), grad_scores = G(L(probs * (dprobs - sum(probs *
// dprobs)))). The keep flag of element i (row-major over [B, heads, S, Sk]) is ckpt_ext's dropout mask of
// (seed, offset) at i: the bits ops::dropout draws for a contiguous tensor of that shape.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "../kernels.h"

namespace ckpt_ext {
namespace kernels {
namespace cpu {

enum class RowDtype : int { kFloat = 0, kBFloat16 = 1 };

// One call's rows for the SIMD kernels: rows = B * heads * seq of `cols` elements, contiguous.
struct SoftmaxDropoutRows {
  RowDtype g, m, l;
  const void* scores;       // forward: G [rows, cols]
  const void* mask;         // forward: M, nullptr when none; element (b, h, s, j) at b*sb + h*sh + s*ss + j
  int64_t mask_sb, mask_sh, mask_ss;
  int64_t heads, seq, cols;
  bool causal;              // forward: columns j > s masked (square attention)
  void* probs;              // forward: L, written (nullptr: not stored) / backward: read
  void* dropped;            // G, written: forward and backward (the value gradient's operand)
  const void* grad;         // backward: G, the gradient of dropped
  void* grad_scores;        // backward: G, written
  uint32_t threshold;       // keep iff (word >> 8) >= threshold (DropoutWords)
  float scale;              // 1 / (1 - p)
};

// Rows [r0, r1) of a call; words: the dropout words of its elements from row r0 on; scratch: at least
// cols rounded up to 64 floats.
#define CKPT_EXT_SOFTMAX_DROPOUT_ROWS \
  void softmax_dropout_rows(const SoftmaxDropoutRows& a, bool backward, int64_t r0, int64_t r1, \
                            const uint32_t* words, float* scratch);
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
namespace avx2 {
CKPT_EXT_SOFTMAX_DROPOUT_ROWS
}
namespace avx512 {
CKPT_EXT_SOFTMAX_DROPOUT_ROWS
}
#endif

// scores: [B, heads, S, Sk] contiguous, float32 / bfloat16 (G); mask: undefined or [B, heads, S, Sk] (an expanded
// view is fine) with a contiguous last dim, float32 / bfloat16; causal: S == Sk and no mask; probs: undefined
// (not stored) or contiguous L; dropped: contiguous G.
void softmax_dropout_forward(const at::Tensor& scores, const at::Tensor& mask, bool causal, const DropoutArgs& dropout,
                             const at::Tensor& probs, const at::Tensor& dropped);
// grad_dropped: contiguous G; probs: what forward stored (L); grad_scores, dropped: contiguous G, written.
void softmax_dropout_backward(const at::Tensor& grad_dropped, const at::Tensor& probs, const DropoutArgs& dropout,
                              const at::Tensor& grad_scores, const at::Tensor& dropped);

}  // namespace cpu
}  // namespace kernels
}  // namespace ckpt_ext
