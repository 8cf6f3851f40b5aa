// Shared pieces of the CPU kernels: parallel grains, optional pointers, the dropout scale, and the
// Philox words of element ranges (DropoutWords), computed in blocks (dropout_words.cpp).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "../kernels.h"
#include "vec.h"

namespace ckpt_ext {
namespace kernels {
namespace cpu {

constexpr int64_t kElementGrain = 32768;  // elements per parallel task for elementwise kernels
constexpr int64_t kMaxReduceChunks = 64;  // row chunks of a row reduction (fixed: thread-count independent)

inline int64_t row_grain(int64_t hidden) { return std::max<int64_t>(1, kElementGrain / std::max<int64_t>(hidden, 1)); }

template <typename T>
const T* ptr_or_null(const at::Tensor& t) {
  return t.defined() ? t.const_data_ptr<T>() : nullptr;
}

// The float scale of dropout in accumulation precision (1 / (1 - p), 0 when everything is dropped).
template <typename A>
A dropout_scale(const DropoutArgs& d) {
  return d.p < 1.0 ? static_cast<A>(1.0 / (1.0 - d.p)) : A(0);
}

// ---- dropout masks in blocks -------------------------------------------------------------------------------
//
// The mask is philox.h's (the same bits as the CUDA kernels and the reference); only the way the CPU
// computes it differs from a per-element cursor: the Philox words of all the 4-element groups a range
// touches are computed first -- 32 groups at a time with AVX2 where the CPU has it -- and each
// element is then one integer compare. Regenerating masks (forward, backward, replay) is what dropout
// costs here, so this matters.

// out[4 * j + w] = Philox word w of group g0 + j, for j < n.
void philox_words(const philox::Dropout& d, uint64_t g0, int64_t n, uint32_t* out);

// Keep bits: bit j % 8 of out[j / 8] = (words[j] >> 8) >= threshold (DropoutWords::keep), for j < n; the
// last byte's bits past n are 0. The LayerNorm forward stores them (a row's bits start at a byte) and its
// backward expands them back into words -- all ones where kept, 0 where dropped, which keep() reads the
// same way for every threshold of a dropout in (0, 1] -- instead of running Philox again.
void pack_keep_bits(const uint32_t* words, int64_t n, uint32_t threshold, uint8_t* out);
void expand_keep_bits(const uint8_t* bits, int64_t n, uint32_t* words);

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

  // Words of a range from its stored keep bits (pack_keep_bits of the words fill() gave), valid until the
  // next call.
  const uint32_t* expand(const uint8_t* bits, int64_t n) {
    words_.resize(static_cast<size_t>(n));
    expand_keep_bits(bits, n, words_.data());
    return words_.data();
  }

  bool keep(uint32_t word) const { return (word >> 8) >= threshold_; }
  uint32_t threshold() const { return threshold_; }

 private:
  philox::Dropout d_;
  uint32_t threshold_;
  std::vector<uint32_t> words_;
};

// ---- the SIMD kernels (vec.h) -------------------------------------------------------------------------------

// body(kernels) with the SIMD kernels of dtype t, returning true; false where there are none (float64, a
// CPU without AVX2): the caller then runs its portable loop.
template <typename T, typename F>
bool call_vec(const VecKernels<T>* k, const F& body) {
  if (!k) return false;
  body(*k);
  return true;
}

template <typename F>
bool with_vec(at::ScalarType t, const F& body) {
  switch (t) {
    case at::kFloat:
      return call_vec(vec_kernels<float>(), body);
    case at::kBFloat16:
      return call_vec(vec_kernels<c10::BFloat16>(), body);
    case at::kHalf:
      return call_vec(vec_kernels<c10::Half>(), body);
    default:
      return false;
  }
}

// The dropout of a segment for the SIMD kernels: its words drawn by `mask` (none when disabled).
inline VecDropout vec_dropout(DropoutWords& mask, bool enabled, float scale, int64_t i0, int64_t n) {
  return {enabled ? mask.fill(static_cast<uint64_t>(i0), n) : nullptr, mask.threshold(), scale};
}

// fn(i0, n, col, mask) over elements [0, numel) in parallel, in segments that end at row ends (col: the
// column of i0 in rows of `hidden`) and are at most DropoutWords::kBlock long; one DropoutWords per task.
template <typename F>
void for_segments(int64_t numel, int64_t hidden, const philox::Dropout& ph, const F& fn) {
  at::parallel_for(0, numel, kElementGrain, [&](int64_t begin, int64_t end) {
    DropoutWords mask(ph);
    for (int64_t i = begin; i < end;) {
      const int64_t col = i % hidden;
      const int64_t n = std::min(std::min(end - i, hidden - col), DropoutWords::kBlock);
      fn(i, n, col, mask);
      i += n;
    }
  });
}

}  // namespace cpu
}  // namespace kernels
}  // namespace ckpt_ext
