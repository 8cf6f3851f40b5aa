// CPU kernels of the row-wise norms (declared in kernels/kernels.h).
//
// Every dtype (float32, float64, float16, bfloat16) computes in at::opmath_type (float, or double for
// float64) and rounds once when it stores. The per-row sums of the norms accumulate in double (RowSum): a
// serial float sum of `hidden` terms is off by up to hidden/2 ulps, which normalisation multiplies by rstd
// (a row with a large mean relative to its spread, a constant row) -- PyTorch's own kernels are exact there.
// float32, bfloat16 and float16 run the SIMD row kernels of vec.h where the CPU has AVX2 (with_vec: same
// arithmetic, sums in double); the loops below are the portable path. Work is split with
// at::parallel_for; reductions over rows (grad_weight, grad_bias) use a fixed partition into chunks, so
// results do not depend on the number of threads.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "common.h"

namespace ckpt_ext {
namespace kernels {
namespace cpu {

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

// A norm's weight and bias in float for the SIMD row kernels (NormRow), converted once per call rather
// than once per row.
struct FloatParams {
  std::vector<float> wbuf, bbuf;
  const float* weight;
  const float* bias;
  FloatParams(const at::Tensor& w, const at::Tensor& b)
      : weight(as_float(w, wbuf)), bias(b.defined() ? as_float(b, bbuf) : nullptr) {}

  static const float* as_float(const at::Tensor& t, std::vector<float>& buf) {
    if (t.scalar_type() == at::kFloat) return t.const_data_ptr<float>();
    buf.resize(static_cast<size_t>(t.numel()));
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, t.scalar_type(), "ckpt_ext::norm_params", [&] {
      const scalar_t* p = t.const_data_ptr<scalar_t>();
      for (int64_t j = 0; j < t.numel(); ++j) buf[j] = static_cast<float>(p[j]);
    });
    return buf.data();
  }
};

// The keep bits of a LayerNorm with dropout (kernels.h): rows of ceil(hidden / 8) bytes, written by the
// forward from the words it drew, read by the backward in their place. Inert when undefined.
class KeepBits {
 public:
  KeepBits(const at::Tensor& bits, const DropoutArgs& dropout, int64_t hidden)
      : bits_(bits.defined() ? bits.data_ptr<uint8_t>() : nullptr), row_bytes_((hidden + 7) / 8), hidden_(hidden) {
    TORCH_INTERNAL_ASSERT(!bits_ || dropout.enabled(), "ckpt_ext: keep bits of a LayerNorm without dropout");
  }

  bool stored() const { return bits_ != nullptr; }

  // forward: row r's bits from its words (nullptr: no dropout drawn)
  void store(int64_t r, const uint32_t* words, uint32_t threshold) const {
    if (bits_ && words) pack_keep_bits(words, hidden_, threshold, bits_ + r * row_bytes_);
  }

  // backward: row r's words, expanded from its bits into `mask`'s buffer
  const uint32_t* words(DropoutWords& mask, int64_t r) const { return mask.expand(bits_ + r * row_bytes_, hidden_); }

 private:
  uint8_t* bits_;
  int64_t row_bytes_;
  int64_t hidden_;
};

// x (forward) or grad_x (backward) of a LayerNorm in a lower-precision dtype (bfloat16 / float16) than
// the stream's T = float (ops/checks.h: is_lowp_beside_float; issue 32): rows are converted into a T row
// (exact) before the kernel of T reads them, and the kernel's T row of grad_x is rounded once (to nearest
// even, as Tensor.to) into it. Inert (mixed() false) when the tensor has the stream's dtype.
template <typename T>
class LowpRows {
 public:
  LowpRows(const at::Tensor& t, at::ScalarType stream)
      : data_(t.defined() && t.scalar_type() != stream ? t.data_ptr() : nullptr), dtype_(t.scalar_type()) {
    TORCH_INTERNAL_ASSERT(!data_ || dtype_ == at::kBFloat16 || dtype_ == at::kHalf,
                          "ckpt_ext: a mixed-dtype norm row must be bfloat16 or float16");
  }

  bool mixed() const { return data_ != nullptr; }

  // the row at element `base` in T, written to dst[0, n)
  const T* load(int64_t base, int64_t n, T* dst) const {
    if (dtype_ == at::kBFloat16)
      convert(static_cast<const c10::BFloat16*>(data_) + base, dst, n);
    else
      convert(static_cast<const c10::Half*>(data_) + base, dst, n);
    return dst;
  }

  // src[0, n) rounded into the row at element `base`
  void store(int64_t base, int64_t n, const T* src) const {
    if (dtype_ == at::kBFloat16)
      convert(src, static_cast<c10::BFloat16*>(data_) + base, n);
    else
      convert(src, static_cast<c10::Half*>(data_) + base, n);
  }

 private:
  template <typename A, typename B>
  static void convert(const A* src, B* dst, int64_t n) {
    for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<B>(static_cast<float>(src[j]));
  }

  void* data_;
  at::ScalarType dtype_;
};

// A norm backward's grad_out rows in T: grad_out itself, or (issue 32) grad_out in a lower-precision dtype than the
// stream (an out written in out_dtype), converted into a T row (LowpRows), plus an optional second gradient of out
// (grad_out2, either dtype) added in T -- autograd's sum of the two gradients of a T out.
template <typename T>
class GradRows {
 public:
  GradRows(const at::Tensor& g, const at::Tensor& g2, at::ScalarType stream)
      : lowp_(g, stream), lowp2_(g2, stream), g_(lowp_.mixed() ? nullptr : g.const_data_ptr<T>()),
        g2_(g2.defined() && !lowp2_.mixed() ? g2.const_data_ptr<T>() : nullptr), two_(g2.defined()) {}

  // whether rows go through the caller's buffers (hidden T each)
  bool copies() const { return lowp_.mixed() || two_; }

  // the row at element `base`; buf, buf2: hidden T each when copies()
  const T* row(int64_t base, int64_t n, T* buf, T* buf2) const {
    if (!copies()) return g_ + base;
    const T* a = lowp_.mixed() ? lowp_.load(base, n, buf) : g_ + base;
    if (!two_) return a;
    const T* b = lowp2_.mixed() ? lowp2_.load(base, n, buf2) : g2_ + base;
    for (int64_t j = 0; j < n; ++j) buf[j] = a[j] + b[j];
    return buf;
  }

 private:
  LowpRows<T> lowp_, lowp2_;
  const T* g_;
  const T* g2_;
  bool two_;
};

}  // namespace

void layer_norm_forward(const at::Tensor& x, const at::Tensor& bias, const at::Tensor& residual,
                        const DropoutArgs& dropout, const at::Tensor& weight, const at::Tensor& ln_bias, double eps,
                        const at::Tensor& out, const at::Tensor& pre_norm, const at::Tensor& mean,
                        const at::Tensor& rstd, const at::Tensor& keep_bits, const at::Tensor& out2) {
  const KeepBits kb(keep_bits, dropout, weight.numel());
  // The stream's dtype (pre_norm's); x may be a lower-precision one (LowpRows).
  const auto stream = pre_norm.scalar_type();
  if (with_vec(stream, [&](const auto& k) {
        using T = typename std::decay_t<decltype(k)>::Scalar;
        const int64_t hidden = weight.numel();
        const LowpRows<T> lowp_x(x, stream);
        const T* xp = lowp_x.mixed() ? nullptr : x.const_data_ptr<T>();
        const T* bp = ptr_or_null<T>(bias);
        const T* rp = ptr_or_null<T>(residual);
        const LowpRows<T> lowp_out(out, stream);  // out in out_dtype: the T row rounded into it
        const LowpRows<T> lowp_out2(out2, stream);  // a second, lower-precision out (the same row rounded)
        T* op = lowp_out.mixed() ? nullptr : out.mutable_data_ptr<T>();
        T* pp = pre_norm.mutable_data_ptr<T>();
        float* mp = mean.mutable_data_ptr<float>();
        float* sp = rstd.mutable_data_ptr<float>();
        const float scale = dropout_scale<float>(dropout);
        const FloatParams params(weight, ln_bias);
        at::parallel_for(0, x.numel() / hidden, row_grain(hidden), [&](int64_t begin, int64_t end) {
          std::vector<float> scratch(hidden);
          std::vector<T> x_row(lowp_x.mixed() ? hidden : 0), out_row(lowp_out.mixed() ? hidden : 0);
          DropoutWords mask(dropout.philox());
          NormRow<T> row{};
          row.bias = bp;
          row.weight = params.weight;
          row.ln_bias = params.bias;
          row.scratch = scratch.data();
          row.hidden = hidden;
          row.eps = eps;
          for (int64_t r = begin; r < end; ++r) {
            const int64_t base = r * hidden;
            row.x = lowp_x.mixed() ? lowp_x.load(base, hidden, x_row.data()) : xp + base;
            row.residual = rp ? rp + base : nullptr;
            row.out = lowp_out.mixed() ? out_row.data() : op + base;
            row.pre = pp + base;
            row.drop = vec_dropout(mask, dropout.enabled(), scale, base, hidden);
            kb.store(r, row.drop.words, mask.threshold());
            k.layer_norm_forward(row);
            if (lowp_out.mixed()) lowp_out.store(base, hidden, out_row.data());
            if (lowp_out2.mixed()) lowp_out2.store(base, hidden, row.out);
            mp[r] = row.mean;
            sp[r] = row.rstd;
          }
        });
      }))
    return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, stream, "ckpt_ext::layer_norm_forward", [&] {
    using A = at::opmath_type<scalar_t>;
    const int64_t hidden = weight.numel();
    const int64_t rows = x.numel() / hidden;
    const LowpRows<scalar_t> lowp_x(x, stream);
    const scalar_t* xp = lowp_x.mixed() ? nullptr : x.const_data_ptr<scalar_t>();
    const scalar_t* bp = ptr_or_null<scalar_t>(bias);
    const scalar_t* rp = ptr_or_null<scalar_t>(residual);
    const scalar_t* wp = weight.const_data_ptr<scalar_t>();
    const scalar_t* lbp = ptr_or_null<scalar_t>(ln_bias);
    const LowpRows<scalar_t> lowp_out(out, stream), lowp_out2(out2, stream);
    scalar_t* op = lowp_out.mixed() ? nullptr : out.mutable_data_ptr<scalar_t>();
    scalar_t* pp = pre_norm.mutable_data_ptr<scalar_t>();
    A* mp = mean.mutable_data_ptr<A>();
    A* sp = rstd.mutable_data_ptr<A>();
    const bool drop = dropout.enabled();
    const A scale = dropout_scale<A>(dropout);
    const philox::Dropout ph = dropout.philox();
    at::parallel_for(0, rows, row_grain(hidden), [&](int64_t begin, int64_t end) {
      std::vector<A> v(hidden);
      std::vector<scalar_t> x_buf(lowp_x.mixed() ? hidden : 0), out_buf(lowp_out.mixed() ? hidden : 0);
      DropoutWords mask(ph);
      for (int64_t r = begin; r < end; ++r) {
        const int64_t base = r * hidden;
        const uint32_t* words = drop ? mask.fill(base, hidden) : nullptr;
        kb.store(r, words, mask.threshold());
        const scalar_t* x_row = lowp_x.mixed() ? lowp_x.load(base, hidden, x_buf.data()) : xp + base;
        RowSum sum = 0;
        for (int64_t j = 0; j < hidden; ++j) {
          A val = static_cast<A>(x_row[j]) + (bp ? static_cast<A>(bp[j]) : A(0));
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
        scalar_t* out_row = lowp_out.mixed() ? out_buf.data() : op + base;
        for (int64_t j = 0; j < hidden; ++j) {
          A y = (v[j] - mu) * rs * static_cast<A>(wp[j]);
          if (lbp) y += static_cast<A>(lbp[j]);
          out_row[j] = static_cast<scalar_t>(y);
        }
        if (lowp_out.mixed()) lowp_out.store(base, hidden, out_buf.data());
        if (lowp_out2.mixed()) lowp_out2.store(base, hidden, out_row);
      }
    });
  });
}

void layer_norm_backward(const at::Tensor& grad_out, const at::Tensor& grad_pre_norm, const at::Tensor& pre_norm,
                         const at::Tensor& weight, const at::Tensor& mean, const at::Tensor& rstd,
                         const DropoutArgs& dropout, const at::Tensor& keep_bits, const at::Tensor& grad_pre,
                         const at::Tensor& grad_x, const at::Tensor& grad_weight, const at::Tensor& grad_ln_bias,
                         const at::Tensor& grad_bias, const at::Tensor& grad_out2) {
  const KeepBits kb(keep_bits, dropout, weight.numel());
  const bool bias_sums = grad_bias.defined() && grad_x.defined();
  const bool want_dx = grad_x.defined();
  if (with_vec(pre_norm.scalar_type(), [&](const auto& k) {
        using T = typename std::decay_t<decltype(k)>::Scalar;
        const int64_t hidden = weight.numel();
        const int64_t rows = pre_norm.numel() / hidden;
        const GradRows<T> grads(grad_out, grad_out2, pre_norm.scalar_type());  // out_dtype's, or two of them
        const T* gsp = ptr_or_null<T>(grad_pre_norm);
        const T* vp = pre_norm.const_data_ptr<T>();
        const float* mp = mean.const_data_ptr<float>();
        const float* sp = rstd.const_data_ptr<float>();
        T* dpre = grad_pre.mutable_data_ptr<T>();
        // grad_x in a lower-precision dtype: the kernel writes a T row, rounded into it (LowpRows)
        const LowpRows<T> lowp_dx(grad_x, pre_norm.scalar_type());
        T* dx = want_dx && !lowp_dx.mixed() ? grad_x.mutable_data_ptr<T>() : nullptr;
        const float scale = dropout_scale<float>(dropout);
        const RowChunks chunks(rows);
        std::vector<float> partial_w(chunks.count * hidden, 0.f), partial_b(chunks.count * hidden, 0.f);
        std::vector<float> partial_x(bias_sums ? chunks.count * hidden : 0, 0.f);
        const FloatParams params(weight, at::Tensor());
        at::parallel_for(0, chunks.count, 1, [&](int64_t c0, int64_t c1) {
          DropoutWords mask(dropout.philox());
          std::vector<T> dx_row(lowp_dx.mixed() ? hidden : 0), g_row(grads.copies() ? hidden : 0),
              g2_row(grads.copies() ? hidden : 0);
          NormRow<T> row{};
          row.weight = params.weight;
          row.hidden = hidden;
          for (int64_t c = c0; c < c1; ++c) {
            row.partial_w = partial_w.data() + c * hidden;
            row.partial_b = partial_b.data() + c * hidden;
            row.partial_x = bias_sums ? partial_x.data() + c * hidden : nullptr;
            const int64_t r_end = std::min(rows, (c + 1) * chunks.rows_per_chunk);
            for (int64_t r = c * chunks.rows_per_chunk; r < r_end; ++r) {
              const int64_t base = r * hidden;
              row.grad = grads.row(base, hidden, g_row.data(), g2_row.data());
              row.grad_pre = gsp ? gsp + base : nullptr;
              row.x = vp + base;
              row.out = dpre + base;
              row.pre = lowp_dx.mixed() ? dx_row.data() : dx ? dx + base : nullptr;
              row.mean = mp[r];
              row.rstd = sp[r];
              row.drop = kb.stored() ? VecDropout{want_dx ? kb.words(mask, r) : nullptr, mask.threshold(), scale}
                                     : vec_dropout(mask, dropout.enabled() && want_dx, scale, base, hidden);
              k.layer_norm_backward(row);
              if (lowp_dx.mixed()) lowp_dx.store(base, hidden, dx_row.data());
            }
          }
        });
        reduce_chunks(partial_w, chunks.count, hidden, grad_weight.mutable_data_ptr<T>());
        reduce_chunks(partial_b, chunks.count, hidden, grad_ln_bias.mutable_data_ptr<T>());
        if (bias_sums) reduce_chunks(partial_x, chunks.count, hidden, grad_bias.mutable_data_ptr<T>());
      }))
    return;
  const auto dtype = pre_norm.scalar_type();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "ckpt_ext::layer_norm_backward", [&] {
    using A = at::opmath_type<scalar_t>;
    const int64_t hidden = weight.numel();
    const int64_t rows = pre_norm.numel() / hidden;
    const GradRows<scalar_t> grads(grad_out, grad_out2, dtype);
    const scalar_t* gsp = ptr_or_null<scalar_t>(grad_pre_norm);
    const scalar_t* vp = pre_norm.const_data_ptr<scalar_t>();
    const scalar_t* wp = weight.const_data_ptr<scalar_t>();
    const A* mp = mean.const_data_ptr<A>();
    const A* sp = rstd.const_data_ptr<A>();
    scalar_t* dpre = grad_pre.mutable_data_ptr<scalar_t>();
    const LowpRows<scalar_t> lowp_dx(grad_x, dtype);
    scalar_t* dx = want_dx && !lowp_dx.mixed() ? grad_x.mutable_data_ptr<scalar_t>() : nullptr;
    const bool drop = dropout.enabled();
    const A scale = dropout_scale<A>(dropout);
    const philox::Dropout ph = dropout.philox();
    const RowChunks chunks(rows);
    std::vector<A> partial_w(chunks.count * hidden, A(0)), partial_b(chunks.count * hidden, A(0));
    std::vector<A> partial_x(bias_sums ? chunks.count * hidden : 0, A(0));
    at::parallel_for(0, chunks.count, 1, [&](int64_t c0, int64_t c1) {
      DropoutWords mask(ph);
      std::vector<scalar_t> dx_buf(lowp_dx.mixed() ? hidden : 0), g_buf(grads.copies() ? hidden : 0),
          g2_buf(grads.copies() ? hidden : 0);
      for (int64_t c = c0; c < c1; ++c) {
        A* pw = partial_w.data() + c * hidden;
        A* pb = partial_b.data() + c * hidden;
        A* px = bias_sums ? partial_x.data() + c * hidden : nullptr;
        const int64_t r_end = std::min(rows, (c + 1) * chunks.rows_per_chunk);
        for (int64_t r = c * chunks.rows_per_chunk; r < r_end; ++r) {
          const int64_t base = r * hidden;
          const A mu = mp[r], rs = sp[r];
          const scalar_t* g_row = grads.row(base, hidden, g_buf.data(), g2_buf.data());
          RowSum sum_dy = 0, sum_dy_xhat = 0;  // dy = grad_out * weight
          for (int64_t j = 0; j < hidden; ++j) {
            const A g = static_cast<A>(g_row[j]);
            const A xhat = (static_cast<A>(vp[base + j]) - mu) * rs;
            const A dy = g * static_cast<A>(wp[j]);
            sum_dy += dy;
            sum_dy_xhat += dy * xhat;
            pw[j] += g * xhat;
            pb[j] += g;
          }
          const A c_mean = static_cast<A>(sum_dy / hidden), c_xhat = static_cast<A>(sum_dy_xhat / hidden);
          const uint32_t* words =
              !(drop && want_dx) ? nullptr : kb.stored() ? kb.words(mask, r) : mask.fill(base, hidden);
          scalar_t* dx_row = lowp_dx.mixed() ? dx_buf.data() : dx ? dx + base : nullptr;
          for (int64_t j = 0; j < hidden; ++j) {
            const A xhat = (static_cast<A>(vp[base + j]) - mu) * rs;
            A d = rs * (static_cast<A>(g_row[j]) * static_cast<A>(wp[j]) - c_mean - xhat * c_xhat);
            if (gsp) d += static_cast<A>(gsp[base + j]);
            dpre[base + j] = static_cast<scalar_t>(d);
            if (dx_row) {
              dx_row[j] = static_cast<scalar_t>(!drop ? d : mask.keep(words[j]) ? d * scale : A(0));
              if (px) px[j] += static_cast<A>(dx_row[j]);  // the bias gradient, of the stream's values
            }
          }
          if (lowp_dx.mixed()) lowp_dx.store(base, hidden, dx_buf.data());
        }
      }
    });
    reduce_chunks(partial_w, chunks.count, hidden, grad_weight.mutable_data_ptr<scalar_t>());
    reduce_chunks(partial_b, chunks.count, hidden, grad_ln_bias.mutable_data_ptr<scalar_t>());
    if (bias_sums) reduce_chunks(partial_x, chunks.count, hidden, grad_bias.mutable_data_ptr<scalar_t>());
  });
}

void rms_norm_forward(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
                      const at::Tensor& out, const at::Tensor& sum, const at::Tensor& rstd) {
  const auto stream = sum.scalar_type();  // x may be a lower-precision dtype (LowpRows)
  if (with_vec(stream, [&](const auto& k) {
        using T = typename std::decay_t<decltype(k)>::Scalar;
        const int64_t hidden = weight.numel();
        const LowpRows<T> lowp_x(x, stream);
        const T* xp = lowp_x.mixed() ? nullptr : x.const_data_ptr<T>();
        const T* rp = ptr_or_null<T>(residual);
        const LowpRows<T> lowp_out(out, stream);  // out in out_dtype: the T row rounded into it
        T* op = lowp_out.mixed() ? nullptr : out.mutable_data_ptr<T>();
        T* sump = sum.mutable_data_ptr<T>();
        float* sp = rstd.mutable_data_ptr<float>();
        const FloatParams params(weight, at::Tensor());
        at::parallel_for(0, x.numel() / hidden, row_grain(hidden), [&](int64_t begin, int64_t end) {
          std::vector<T> x_row(lowp_x.mixed() ? hidden : 0), out_row(lowp_out.mixed() ? hidden : 0);
          NormRow<T> row{};
          row.weight = params.weight;
          row.hidden = hidden;
          row.eps = eps;
          for (int64_t r = begin; r < end; ++r) {
            const int64_t base = r * hidden;
            row.x = lowp_x.mixed() ? lowp_x.load(base, hidden, x_row.data()) : xp + base;
            row.residual = rp ? rp + base : nullptr;
            row.out = lowp_out.mixed() ? out_row.data() : op + base;
            row.pre = sump + base;
            k.rms_norm_forward(row);
            if (lowp_out.mixed()) lowp_out.store(base, hidden, out_row.data());
            sp[r] = row.rstd;
          }
        });
      }))
    return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, stream, "ckpt_ext::rms_norm_forward", [&] {
    using A = at::opmath_type<scalar_t>;
    const int64_t hidden = weight.numel();
    const int64_t rows = x.numel() / hidden;
    const LowpRows<scalar_t> lowp_x(x, stream);
    const scalar_t* xp = lowp_x.mixed() ? nullptr : x.const_data_ptr<scalar_t>();
    const scalar_t* rp = ptr_or_null<scalar_t>(residual);
    const scalar_t* wp = weight.const_data_ptr<scalar_t>();
    const LowpRows<scalar_t> lowp_out(out, stream);
    scalar_t* op = lowp_out.mixed() ? nullptr : out.mutable_data_ptr<scalar_t>();
    scalar_t* sump = sum.mutable_data_ptr<scalar_t>();
    A* sp = rstd.mutable_data_ptr<A>();
    at::parallel_for(0, rows, row_grain(hidden), [&](int64_t begin, int64_t end) {
      std::vector<scalar_t> x_buf(lowp_x.mixed() ? hidden : 0), out_buf(lowp_out.mixed() ? hidden : 0);
      for (int64_t r = begin; r < end; ++r) {
        const int64_t base = r * hidden;
        const scalar_t* x_row = lowp_x.mixed() ? lowp_x.load(base, hidden, x_buf.data()) : xp + base;
        RowSum sum_sq = 0;
        for (int64_t j = 0; j < hidden; ++j) {
          A val = static_cast<A>(x_row[j]);
          if (rp) val += static_cast<A>(rp[base + j]);
          const scalar_t stored = static_cast<scalar_t>(val);
          sump[base + j] = stored;
          sum_sq += static_cast<RowSum>(stored) * static_cast<RowSum>(stored);
        }
        const A rs = static_cast<A>(1 / std::sqrt(sum_sq / hidden + eps));
        sp[r] = rs;
        scalar_t* out_row = lowp_out.mixed() ? out_buf.data() : op + base;
        for (int64_t j = 0; j < hidden; ++j) {
          // LlamaRMSNorm: normalise in float, cast back to the input dtype, then multiply by the weight.
          const scalar_t normed = static_cast<scalar_t>(static_cast<A>(sump[base + j]) * rs);
          out_row[j] = static_cast<scalar_t>(static_cast<A>(wp[j]) * static_cast<A>(normed));
        }
        if (lowp_out.mixed()) lowp_out.store(base, hidden, out_buf.data());
      }
    });
  });
}

void rms_norm_backward(const at::Tensor& grad_out, const at::Tensor& grad_out2, const at::Tensor& grad_sum,
                       const at::Tensor& sum, const at::Tensor& weight, const at::Tensor& rstd,
                       const at::Tensor& grad_input, const at::Tensor& grad_weight) {
  if (with_vec(sum.scalar_type(), [&](const auto& k) {
        using T = typename std::decay_t<decltype(k)>::Scalar;
        const int64_t hidden = weight.numel();
        const int64_t rows = sum.numel() / hidden;
        const GradRows<T> grads(grad_out, grad_out2, sum.scalar_type());  // out_dtype's, or two of them
        const T* gsp = ptr_or_null<T>(grad_sum);
        const T* vp = sum.const_data_ptr<T>();
        const float* sp = rstd.const_data_ptr<float>();
        T* dinp = grad_input.mutable_data_ptr<T>();
        const RowChunks chunks(rows);
        std::vector<float> partial_w(chunks.count * hidden, 0.f);
        const FloatParams params(weight, at::Tensor());
        at::parallel_for(0, chunks.count, 1, [&](int64_t c0, int64_t c1) {
          std::vector<T> g_row(grads.copies() ? hidden : 0), g2_row(grads.copies() ? hidden : 0);
          NormRow<T> row{};
          row.weight = params.weight;
          row.hidden = hidden;
          for (int64_t c = c0; c < c1; ++c) {
            row.partial_w = partial_w.data() + c * hidden;
            const int64_t r_end = std::min(rows, (c + 1) * chunks.rows_per_chunk);
            for (int64_t r = c * chunks.rows_per_chunk; r < r_end; ++r) {
              const int64_t base = r * hidden;
              row.grad = grads.row(base, hidden, g_row.data(), g2_row.data());
              row.grad_pre = gsp ? gsp + base : nullptr;
              row.x = vp + base;
              row.out = dinp + base;
              row.rstd = sp[r];
              k.rms_norm_backward(row);
            }
          }
        });
        reduce_chunks(partial_w, chunks.count, hidden, grad_weight.mutable_data_ptr<T>());
      }))
    return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, sum.scalar_type(), "ckpt_ext::rms_norm_backward", [&] {
    using A = at::opmath_type<scalar_t>;
    const int64_t hidden = weight.numel();
    const int64_t rows = sum.numel() / hidden;
    const GradRows<scalar_t> grads(grad_out, grad_out2, sum.scalar_type());
    const scalar_t* gsp = ptr_or_null<scalar_t>(grad_sum);
    const scalar_t* vp = sum.const_data_ptr<scalar_t>();
    const scalar_t* wp = weight.const_data_ptr<scalar_t>();
    const A* sp = rstd.const_data_ptr<A>();
    scalar_t* dinp = grad_input.mutable_data_ptr<scalar_t>();
    const RowChunks chunks(rows);
    std::vector<A> partial_w(chunks.count * hidden, A(0));
    at::parallel_for(0, chunks.count, 1, [&](int64_t c0, int64_t c1) {
      std::vector<scalar_t> g_buf(grads.copies() ? hidden : 0), g2_buf(grads.copies() ? hidden : 0);
      for (int64_t c = c0; c < c1; ++c) {
        A* pw = partial_w.data() + c * hidden;
        const int64_t r_end = std::min(rows, (c + 1) * chunks.rows_per_chunk);
        for (int64_t r = c * chunks.rows_per_chunk; r < r_end; ++r) {
          const int64_t base = r * hidden;
          const A rs = sp[r];
          const scalar_t* g_row = grads.row(base, hidden, g_buf.data(), g2_buf.data());
          RowSum sum_dn_n = 0;  // dn = grad_out * weight, n = sum * rstd
          for (int64_t j = 0; j < hidden; ++j) {
            const A g = static_cast<A>(g_row[j]);
            const A n = static_cast<A>(vp[base + j]) * rs;
            sum_dn_n += g * static_cast<A>(wp[j]) * n;
            pw[j] += g * static_cast<A>(static_cast<scalar_t>(n));  // out = weight * to_dtype(n)
          }
          const A c_n = static_cast<A>(sum_dn_n / hidden);
          for (int64_t j = 0; j < hidden; ++j) {
            const A n = static_cast<A>(vp[base + j]) * rs;
            A d = rs * (static_cast<A>(g_row[j]) * static_cast<A>(wp[j]) - n * c_n);
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
