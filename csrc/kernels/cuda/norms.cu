// CUDA row-wise norms: (bias + dropout + residual +) LayerNorm and (residual +) RMSNorm, forward and
// backward. Launchers of the kernels in norms_rowwise.cuh (a row held in registers, 16-byte accesses, one
// read and one write per tensor) for hidden <= rowwise::kMaxRegisterHidden, and of norms_multipass.cuh for
// wider rows.
//
// Launch shape: the smallest (warps per row, slots per thread) bucket that covers the row within the kernel's
// register budget (rowwise::ForwardLimits / BackwardLimits); a resident grid (SMs x blocks that fit per SM)
// walks the rows grid-stride. Backward writes one float column partial per block ([grid, hidden], no atomics:
// deterministic on a given device) and column_sum_kernel adds them into grad_weight / grad_bias in the
// weight's dtype; the multipass backward kernels leave the same kind of partials, summed the same way. The
// backward grid is one per row shape, whichever dtype variant runs (layer_norm_backward_blocks_per_sm): the
// variants' column sums are then the float path's bits.
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/copy.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <type_traits>

#include "norms_multipass.cuh"
#include "norms_rowwise.cuh"

namespace ckpt_ext {
namespace kernels {
namespace cuda {
namespace {

template <int ITERS, int WPR, bool VEC>
struct RowShape {
  static constexpr int iters = ITERS, warps = WPR;
  static constexpr bool vec = VEC;
};

// Tries the buckets from (ITERS, WPR) on: ITERS doubles up to IM with one warp per row, then WPR doubles up
// to MAXW, then ITERS doubles up to IMAX; calls f(RowShape<ITERS, WPR, vec>{}) with the first that holds
// hidden (32 * WPR * ITERS * V elements).
template <typename T, int ITERS, int WPR, int IM, int MAXW, int IMAX, typename F>
bool try_row_shape(int64_t hidden, bool vec, F& f) {
  if (hidden <= int64_t(WPR) * kWarpSize * ITERS * rowwise::kVec<T>) {
    if (vec)
      f(RowShape<ITERS, WPR, true>{});
    else
      f(RowShape<ITERS, WPR, false>{});
    return true;
  }
  if constexpr (WPR == 1 && ITERS < IM)
    return try_row_shape<T, 2 * ITERS, WPR, IM, MAXW, IMAX>(hidden, vec, f);
  else if constexpr (WPR < MAXW)
    return try_row_shape<T, ITERS, 2 * WPR, IM, MAXW, IMAX>(hidden, vec, f);
  else if constexpr (ITERS < IMAX)
    return try_row_shape<T, 2 * ITERS, WPR, IM, MAXW, IMAX>(hidden, vec, f);
  else
    return false;
}

// Calls f(RowShape<ITERS, WPR, vec>{}) for the smallest bucket that covers the row within Limits; false
// when hidden is too wide for the register-resident kernels (> rowwise::kMaxRegisterHidden).
template <typename T, typename Limits, typename F>
bool with_row_shape(int64_t hidden, bool vec, F&& f) {
  constexpr int V = rowwise::kVec<T>, IM = Limits::kElemsPerThread / V, IMAX = Limits::kMaxElemsPerThread / V;
  static_assert(IM >= 1 && (IM & (IM - 1)) == 0 && IMAX % IM == 0 && ((IMAX / IM) & (IMAX / IM - 1)) == 0,
                "slots per thread: powers of two");
  return try_row_shape<T, std::max(1, IM / 4), 1, IM, Limits::kWarpsPerRow, IMAX>(hidden, vec, f);
}

// 16-byte accesses need every pointer aligned and rows starting on a 16-byte boundary (hidden % V == 0).
template <typename T>
bool vector_ok(int64_t hidden, std::initializer_list<const void*> ptrs) {
  if (hidden % rowwise::kVec<T> != 0) return false;
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;  // null passes
  return true;
}

// A tensor's data for vector_ok (an undefined tensor: null, which passes).
const void* data(const at::Tensor& t) { return t.defined() ? t.const_data_ptr() : nullptr; }

// vector_ok for rows of the CUDA dtypes' `dtype` (float, or the 2-byte bfloat16/float16).
bool vector_ok_of(at::ScalarType dtype, int64_t hidden, std::initializer_list<const void*> ptrs) {
  return dtype == at::kFloat ? vector_ok<float>(hidden, ptrs) : vector_ok<at::Half>(hidden, ptrs);
}

// As many blocks as are resident at once (at least one, at most one per group of rows).
template <typename Kernel>
int resident_grid(Kernel kernel, int threads, int64_t rows, int rows_per_block) {
  int per_sm = 0;
  CKPT_EXT_CUDA_CHECK(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, reinterpret_cast<const void*>(kernel), threads, 0));
  const int64_t groups = (rows + rows_per_block - 1) / rows_per_block;
  const int64_t resident = int64_t(multiprocessor_count()) * std::max(per_sm, 1);
  return static_cast<int>(std::max<int64_t>(1, std::min(groups, resident)));
}

template <typename T>
struct Tag {
  using type = T;
};

template <typename Kernel>
int blocks_per_sm(Kernel kernel, int threads) {
  int n = 0;
  CKPT_EXT_CUDA_CHECK(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, reinterpret_cast<const void*>(kernel), threads, 0));
  return std::max(n, 1);
}

// The backward grid of a row shape: SMs x the fewest blocks per SM among the shape's variants (the one-dtype kernel,
// G2 and, for a float32 stream, the bfloat16/float16 gradient and grad_x ones; all instantiated anyway), whichever
// variant runs. Each block's column partials add the rows it walks, so two variants on different grids would give
// different grad_weight / grad_bias bits; their occupancy differs by a few registers (docs/cuda-audit.md). With the
// fewest, no variant runs a partial second wave. Once per shape (the first device's; a grid changes no value).
template <typename T, int I, int W, bool VEC, bool BIAS>
int layer_norm_backward_blocks_per_sm(int threads) {
  static const int n = [threads] {
    int m = blocks_per_sm(rowwise::layer_norm_backward_kernel<T, I, W, VEC, BIAS>, threads);
    if constexpr (VEC) {  // the mixed variants exist with 16-byte accesses only
      m = std::min(m, blocks_per_sm(rowwise::layer_norm_backward_kernel<T, I, W, true, BIAS, T, T, true>, threads));
      if constexpr (std::is_same_v<T, float>) {
        const auto lowp = [&](auto tag) {
          using L = typename decltype(tag)::type;
          m = std::min(m, blocks_per_sm(rowwise::layer_norm_backward_kernel<T, I, W, true, BIAS, L, L>, threads));
          m = std::min(m, blocks_per_sm(rowwise::layer_norm_backward_kernel<T, I, W, true, BIAS, L, T>, threads));
          m = std::min(m, blocks_per_sm(rowwise::layer_norm_backward_kernel<T, I, W, true, BIAS, L, T, true>, threads));
        };
        lowp(Tag<at::BFloat16>{});
        lowp(Tag<at::Half>{});
      }
    }
    return m;
  }();
  return n;
}

template <typename T, int I, int W, bool VEC>
int rms_norm_backward_blocks_per_sm(int threads) {
  static const int n = [threads] {
    int m = blocks_per_sm(rowwise::rms_norm_backward_kernel<T, I, W, VEC>, threads);
    if constexpr (VEC)
      m = std::min(m, blocks_per_sm(rowwise::rms_norm_backward_kernel<T, I, W, true, T, true>, threads));
    if constexpr (std::is_same_v<T, float>) {
      m = std::min(m, blocks_per_sm(rowwise::rms_norm_backward_kernel<T, I, W, VEC, at::BFloat16>, threads));
      m = std::min(m, blocks_per_sm(rowwise::rms_norm_backward_kernel<T, I, W, VEC, at::Half>, threads));
    }
    return m;
  }();
  return n;
}

// At least one block, at most one per group of rows, at most `per_sm` a SM.
inline int backward_grid(int per_sm, int64_t rows, int rows_per_block) {
  const int64_t groups = (rows + rows_per_block - 1) / rows_per_block;
  return static_cast<int>(std::max<int64_t>(1, std::min(groups, int64_t(multiprocessor_count()) * per_sm)));
}

// Calls f(Tag<TX>{}) for x's (or grad_x's) element type TX: T's, or beside a float32 stream bfloat16/float16
// (ops/checks.h's is_lowp_beside_float; instantiated for T = float only).
template <typename T, typename F>
void with_x_type(at::ScalarType x, F&& f) {
  if constexpr (std::is_same_v<T, float>) {
    if (x == at::kBFloat16) return f(Tag<at::BFloat16>{});
    if (x == at::kHalf) return f(Tag<at::Half>{});
  }
  TORCH_INTERNAL_ASSERT(x == c10::CppTypeToScalarType<T>::value, "ckpt_ext: a norm's x of dtype ", x, " beside a ",
                        c10::CppTypeToScalarType<T>::value, " stream");
  f(Tag<T>{});
}

template <typename T>
T* mutable_or_null(const at::Tensor& t) {
  return t.defined() ? t.mutable_data_ptr<T>() : nullptr;
}

// Float column partials [grid, hidden] of a backward kernel. The rowwise kernels write every element (zeros for
// a block that had no rows); the multipass kernels add their rows into them, so theirs start at zero.
at::Tensor column_partials(int grid, int64_t hidden, const at::Tensor& like, bool zeroed) {
  const at::TensorOptions floats = like.options().dtype(at::kFloat);
  return zeroed ? at::zeros({grid, hidden}, floats) : at::empty({grid, hidden}, floats);
}

// Adds the [parts, hidden] float partials into grad_w (and grad_b when partial_b is defined).
template <typename T>
void launch_column_sum(const at::Tensor& partial_w, const at::Tensor& partial_b, const at::Tensor& grad_w,
                       const at::Tensor& grad_b, cudaStream_t stream) {
  const int parts = static_cast<int>(partial_w.size(0)), hidden = static_cast<int>(partial_w.size(1));
  rowwise::column_sum_kernel<T><<<(hidden + kWarpSize - 1) / kWarpSize, kWarpSize * rowwise::kColumnSumRows, 0,
                                  stream>>>(partial_w.const_data_ptr<float>(),
                                            partial_b.defined() ? partial_b.const_data_ptr<float>() : nullptr, parts,
                                            hidden, grad_w.mutable_data_ptr<T>(), mutable_or_null<T>(grad_b));
  CKPT_EXT_CUDA_LAUNCH_CHECK();
}

// The register kernel of a's row shape (false: the row is wider than they take). A narrower x (TX) or out2 (TO)
// is read / written with 16-byte accesses only (the callers check a.vec): the element-by-element instantiations of
// a narrower x spilled on sm_90, so they are not instantiated.
template <typename T, typename TX, typename TO>
bool launch_rowwise_layer_norm_forward(const rowwise::LayerNormForwardArgs<T, TX, TO>& a, cudaStream_t stream) {
  return with_row_shape<T, rowwise::ForwardLimits>(a.hidden, a.vec, [&](auto shape) {
    using S = decltype(shape);
    if constexpr ((std::is_same_v<TX, T> && std::is_same_v<TO, T>) || S::vec) {
      const auto kernel = rowwise::layer_norm_forward_kernel<T, S::iters, S::warps, S::vec, TX, TO>;
      const int threads = rowwise::cta_threads(S::warps);
      const int grid = resident_grid(kernel, threads, a.rows, rowwise::rows_per_cta(S::warps));
      kernel<<<grid, threads, 0, stream>>>(a);
      CKPT_EXT_CUDA_LAUNCH_CHECK();
    } else {
      TORCH_INTERNAL_ASSERT(false, "ckpt_ext: an unaligned mixed-dtype row in the register kernels");
    }
  });
}

}  // namespace

// out (or out2) may be bfloat16/float16 beside a float32 stream (issue 32: an out written in out_dtype; the dual op's
// out2 beside a float32 out). The register kernels write it (TO, rounded once on the store, in the pass that writes
// the float32 out of the dual op) where x has that dtype too (autocast's GEMM output joining the stream) and the row
// is aligned; otherwise (rows wider than kMaxRegisterHidden, unaligned rows, a float32 x) a float32 out is written
// first and converted after (a correct, slower path: the bits are the same).
void layer_norm_forward(const at::Tensor& x, const at::Tensor& bias, const at::Tensor& residual,
                        const DropoutArgs& dropout, const at::Tensor& weight, const at::Tensor& ln_bias, double eps,
                        const at::Tensor& out, const at::Tensor& pre_norm, const at::Tensor& mean,
                        const at::Tensor& rstd, const at::Tensor& keep_bits, const at::Tensor& out2) {
  // The CUDA kernels regenerate the mask in backward (Philox is cheap next to the row's memory traffic).
  TORCH_INTERNAL_ASSERT(!keep_bits.defined(), "ckpt_ext: keep bits are stored by the CPU kernels only");
  const c10::DeviceGuard guard(x.device());
  const int64_t hidden = weight.numel(), rows = x.numel() / hidden;
  const auto dtype = pre_norm.scalar_type();  // the stream's; x may be a narrower one (rowwise::LayerNormForwardArgs)
  if (out.scalar_type() != dtype || out2.defined()) {
    TORCH_INTERNAL_ASSERT(!out2.defined() || out.scalar_type() == dtype,
                          "ckpt_ext: the dual LayerNorm's out in the stream's dtype");
    const at::Tensor& lowp = out2.defined() ? out2 : out;            // written rounded (TO)
    const at::Tensor out_f = out2.defined() ? out : at::Tensor();  // the dual op's float32 out
    const bool direct =
        dtype == at::kFloat && x.scalar_type() == lowp.scalar_type() && hidden <= rowwise::kMaxRegisterHidden &&
        vector_ok<float>(hidden, {data(x), data(bias), data(residual), data(weight), data(ln_bias), data(out_f),
                                  data(lowp), data(pre_norm)});
    if (!direct) {
      const at::Tensor f = out_f.defined() ? out_f : at::empty_like(pre_norm);
      layer_norm_forward(x, bias, residual, dropout, weight, ln_bias, eps, f, pre_norm, mean, rstd, keep_bits,
                         at::Tensor());
      lowp.copy_(f);
      return;
    }
    const cudaStream_t stream = current_stream(x.device());
    with_x_type<float>(lowp.scalar_type(), [&](auto tag) {
      using L = typename decltype(tag)::type;
      if constexpr (!std::is_same_v<L, float>) {
        rowwise::LayerNormForwardArgs<float, L, L> a{
            x.const_data_ptr<L>(), ptr_or_null<float>(bias), ptr_or_null<float>(residual),
            weight.const_data_ptr<float>(), ptr_or_null<float>(ln_bias), mutable_or_null<float>(out_f),
            pre_norm.mutable_data_ptr<float>(), mean.mutable_data_ptr<float>(), rstd.mutable_data_ptr<float>(), rows,
            static_cast<int>(hidden), static_cast<float>(eps), dropout.philox(), dropout.enabled(), true,
            lowp.mutable_data_ptr<L>()};
        TORCH_INTERNAL_ASSERT(launch_rowwise_layer_norm_forward(a, stream), "ckpt_ext: a row too wide");
      } else {
        TORCH_INTERNAL_ASSERT(false, "ckpt_ext: a lower-precision out of dtype float32");
      }
    });
    return;
  }
  if (x.scalar_type() != dtype &&
      (hidden > rowwise::kMaxRegisterHidden ||
       !vector_ok<float>(hidden, {data(x), data(bias), data(residual), data(weight), data(ln_bias), data(out),
                                  data(pre_norm)}))) {
    // The multi-pass kernels read one dtype, and the register kernels read a narrower x only with 16-byte
    // accesses (the element-by-element instantiations would spill on sm_90): x converted first (a correct,
    // slower path for the widest rows and for unaligned ones).
    layer_norm_forward(x.to(dtype), bias, residual, dropout, weight, ln_bias, eps, out, pre_norm, mean, rstd,
                       keep_bits, out2);
    return;
  }
  const cudaStream_t stream = current_stream(x.device());
  CKPT_EXT_DISPATCH_CUDA_FLOATING(dtype, "ckpt_ext::layer_norm_forward", [&] {
    using T = scalar_t;
    with_x_type<T>(x.scalar_type(), [&](auto tag) {
      using TX = typename decltype(tag)::type;
      rowwise::LayerNormForwardArgs<T, TX> a{x.const_data_ptr<TX>(), ptr_or_null<T>(bias), ptr_or_null<T>(residual),
                                             weight.const_data_ptr<T>(), ptr_or_null<T>(ln_bias),
                                             out.mutable_data_ptr<T>(), pre_norm.mutable_data_ptr<T>(),
                                             mean.mutable_data_ptr<float>(), rstd.mutable_data_ptr<float>(), rows,
                                             static_cast<int>(hidden), static_cast<float>(eps), dropout.philox(),
                                             dropout.enabled(), false};
      // 16-byte alignment of every pointer, x's included (its slots are 8 bytes when narrower than T).
      a.vec = vector_ok<T>(hidden, {a.x, a.bias, a.residual, a.weight, a.ln_bias, a.out, a.pre_norm});
      const bool fits = launch_rowwise_layer_norm_forward(a, stream);
      if constexpr (std::is_same_v<TX, T>) {
        if (!fits) multipass::layer_norm_forward<T>(a, stream);
      } else {
        TORCH_INTERNAL_ASSERT(fits, "ckpt_ext: a mixed-dtype row wider than the register kernels");
      }
    });
  });
}

namespace {

// Whether the register kernels sum the dense bias's gradient for a row of `hidden` (the BIAS instantiations: only
// within the default budget's slots; BackwardLimits' comment: at 32 elements a thread spills already).
template <typename T>
bool bias_kernel_for(int64_t hidden) {
  bool has = false;
  with_row_shape<T, rowwise::BackwardLimits>(hidden, true, [&](auto shape) {
    has = decltype(shape)::iters * rowwise::kVec<T> <= rowwise::BackwardLimits::kElemsPerThread;
  });
  return has;
}

// Runs the backward kernels on a (its partial_* set here) and the column sums into grad_weight / grad_ln_bias and,
// with bias_sums, grad_bias; returns whether grad_bias was summed (false: a row too wide for the BIAS kernels, whose
// caller sums grad_x). A narrower grad_x (TX) or grad_out2 (TG), or a second gradient of T's dtype (G2): aligned rows
// of the register kernels only.
template <typename T, typename TX, typename TG, bool G2 = false>
bool run_layer_norm_backward(rowwise::LayerNormBackwardArgs<T, TX, TG>& a, bool bias_sums, const at::Tensor& like,
                             const at::Tensor& grad_weight, const at::Tensor& grad_ln_bias,
                             const at::Tensor& grad_bias, cudaStream_t stream) {
  constexpr bool one_dtype = std::is_same_v<TX, T> && std::is_same_v<TG, T> && !G2;
  bool bias_summed = false;
  at::Tensor partial_w, partial_b, partial_x;
  const auto partials = [&](int grid, bool zeroed, bool with_x) {
    partial_w = column_partials(grid, a.hidden, like, zeroed);
    partial_b = column_partials(grid, a.hidden, like, zeroed);
    a.partial_w = partial_w.mutable_data_ptr<float>();
    a.partial_b = partial_b.mutable_data_ptr<float>();
    if (with_x) {
      partial_x = column_partials(grid, a.hidden, like, zeroed);
      a.partial_x = partial_x.mutable_data_ptr<float>();
      bias_summed = true;
    }
  };
  // per_sm: the shape's (layer_norm_backward_blocks_per_sm), the same for every variant: the same column-sum bits.
  const auto launch = [&](auto kernel, int per_sm, int threads, int rows_per_cta, bool with_x) {
    const int grid = backward_grid(per_sm, a.rows, rows_per_cta);
    partials(grid, false, with_x);
    kernel<<<grid, threads, 0, stream>>>(a);
    CKPT_EXT_CUDA_LAUNCH_CHECK();
  };
  const bool fits = with_row_shape<T, rowwise::BackwardLimits>(a.hidden, a.vec, [&](auto shape) {
    using S = decltype(shape);
    const int threads = rowwise::cta_threads(S::warps), rpc = rowwise::rows_per_cta(S::warps);
    if constexpr (!one_dtype && !S::vec) {  // a narrower grad_x / grad_out2, or G2: aligned rows only (the callers)
      TORCH_INTERNAL_ASSERT(false, "ckpt_ext: an unaligned mixed-dtype row in the register kernels");
    } else {
      // The bias's column sums hold one more float per element: only within the default budget's slots.
      if constexpr (S::iters * rowwise::kVec<T> <= rowwise::BackwardLimits::kElemsPerThread) {
        if (bias_sums) {
          launch(rowwise::layer_norm_backward_kernel<T, S::iters, S::warps, S::vec, true, TX, TG, G2>,
                 layer_norm_backward_blocks_per_sm<T, S::iters, S::warps, S::vec, true>(threads), threads, rpc, true);
          return;
        }
      }
      launch(rowwise::layer_norm_backward_kernel<T, S::iters, S::warps, S::vec, false, TX, TG, G2>,
             layer_norm_backward_blocks_per_sm<T, S::iters, S::warps, S::vec, false>(threads), threads, rpc, false);
    }
  });
  if constexpr (one_dtype) {
    if (!fits) {
      const int grid = multipass::backward_grid(a.rows);
      partials(grid, true, bias_sums);
      multipass::layer_norm_backward<T>(a, grid, stream);
    }
  } else {
    TORCH_INTERNAL_ASSERT(fits && (bias_summed || !bias_sums), "ckpt_ext: a mixed-dtype row the kernels do not take");
  }
  launch_column_sum<T>(partial_w, partial_b, grad_weight, grad_ln_bias, stream);
  if (bias_summed) launch_column_sum<T>(partial_x, at::Tensor(), grad_bias, at::Tensor(), stream);
  return bias_summed;
}

}  // namespace

// grad_out may be bfloat16/float16 beside a float32 stream (issue 32: the gradient of an out written in out_dtype),
// and grad_out2 (the dual op's out2's gradient) too beside a float32 grad_out. The register kernels read them (TG:
// float(grad_out) + float(grad_out2), or float of the one lower-precision gradient) where grad_x (if any) has their
// dtype (autocast's x), the row is aligned and, with the dense bias's sums, the row fits the BIAS kernels (wider
// ones spill); otherwise (rows wider than kMaxRegisterHidden or than the BIAS kernels' 4096, unaligned rows, a
// float32 grad_x, a lower-precision grad_out beside any grad_out2) the float32 gradient -- float(grad_out) +
// float(grad_out2), the same values -- is formed first by ATen (a correct, slower path: the bits are the same).
// grad_out2 may also have grad_out's dtype, the stream's (the fanout: a norm output with two uses, each gradient in
// the stream's dtype, e.g. BERT's h1): the register kernels add them (G2: T(float(g) + float(g2)), as autograd's add
// of two T tensors and the CPU's GradRows) on aligned rows that they take with the bias sums asked for; other rows
// add them first by ATen (at::add: the same rounded sum).
void layer_norm_backward(const at::Tensor& grad_out, const at::Tensor& grad_pre_norm, const at::Tensor& pre_norm,
                         const at::Tensor& weight, const at::Tensor& mean, const at::Tensor& rstd,
                         const DropoutArgs& dropout, const at::Tensor& keep_bits, const at::Tensor& grad_pre,
                         const at::Tensor& grad_x, const at::Tensor& grad_weight, const at::Tensor& grad_ln_bias,
                         const at::Tensor& grad_bias, const at::Tensor& grad_out2) {
  TORCH_INTERNAL_ASSERT(!keep_bits.defined(), "ckpt_ext: keep bits are read by the CPU kernels only");
  const bool bias_sums = grad_bias.defined() && grad_x.defined();
  const c10::DeviceGuard guard(pre_norm.device());
  const int64_t hidden = weight.numel(), rows = pre_norm.numel() / hidden;
  const auto dtype = pre_norm.scalar_type();
  const cudaStream_t stream = current_stream(pre_norm.device());
  if (grad_out.scalar_type() != dtype || (grad_out2.defined() && grad_out2.scalar_type() != dtype)) {
    // The kernels' form: g (the stream's dtype, or none) and g2 (lower precision).
    at::Tensor g, g2;
    if (!grad_out2.defined())
      g2 = grad_out;
    else if (grad_out.scalar_type() == dtype && grad_out2.scalar_type() != dtype)
      g = grad_out, g2 = grad_out2;
    const bool direct = g2.defined() && dtype == at::kFloat &&
                        (!grad_x.defined() || grad_x.scalar_type() == g2.scalar_type()) &&
                        hidden <= rowwise::kMaxRegisterHidden && (!bias_sums || bias_kernel_for<float>(hidden)) &&
                        vector_ok<float>(hidden, {data(g), data(g2), data(grad_pre_norm), data(pre_norm),
                                                  data(weight), data(grad_pre), data(grad_x)});
    if (!direct) {
      at::Tensor f = grad_out.to(dtype);
      if (grad_out2.defined()) f = at::add(f, grad_out2.to(dtype));
      layer_norm_backward(f, grad_pre_norm, pre_norm, weight, mean, rstd, dropout, keep_bits, grad_pre, grad_x,
                          grad_weight, grad_ln_bias, grad_bias, at::Tensor());
      return;
    }
    with_x_type<float>(g2.scalar_type(), [&](auto tag) {
      using L = typename decltype(tag)::type;
      if constexpr (!std::is_same_v<L, float>) {
        rowwise::LayerNormBackwardArgs<float, L, L> a{
            ptr_or_null<float>(g), ptr_or_null<float>(grad_pre_norm), pre_norm.const_data_ptr<float>(),
            weight.const_data_ptr<float>(), mean.const_data_ptr<float>(), rstd.const_data_ptr<float>(),
            grad_pre.mutable_data_ptr<float>(), mutable_or_null<L>(grad_x), nullptr, nullptr, nullptr, rows,
            static_cast<int>(hidden), dropout.philox(), dropout.enabled(), true, g2.const_data_ptr<L>()};
        run_layer_norm_backward(a, bias_sums, pre_norm, grad_weight, grad_ln_bias, grad_bias, stream);
      } else {
        TORCH_INTERNAL_ASSERT(false, "ckpt_ext: a lower-precision gradient of dtype float32");
      }
    });
    return;
  }
  // From here grad_out2 (if any) has the stream's dtype (G2).
  if (grad_out2.defined() &&
      !(hidden <= rowwise::kMaxRegisterHidden && (!bias_sums || bias_kernel_for<float>(hidden)) &&
        vector_ok_of(dtype, hidden, {data(grad_out), data(grad_out2), data(grad_pre_norm), data(pre_norm),
                                     data(weight), data(grad_pre), data(grad_x)}))) {
    // (bias_kernel_for<float>: the BIAS kernels hold 16 elements a thread, hidden <= 4096, for every dtype)
    layer_norm_backward(at::add(grad_out, grad_out2), grad_pre_norm, pre_norm, weight, mean, rstd, dropout, keep_bits,
                        grad_pre, grad_x, grad_weight, grad_ln_bias, grad_bias, at::Tensor());
    return;
  }
  if (grad_x.defined() && grad_x.scalar_type() != dtype) {
    // A narrower grad_x (rowwise::LayerNormBackwardArgs' TX) is written by the register kernels with 16-byte
    // accesses when they also sum the bias's gradient where it is asked for; otherwise (the widest rows:
    // multi-pass kernels; a bias sum the BIAS kernels do not hold; unaligned rows, whose element-by-element
    // instantiations would spill) a float grad_x is rounded into it after (a correct, slower path), so that the
    // sum adds the float values.
    const bool direct = hidden <= rowwise::kMaxRegisterHidden && (!bias_sums || bias_kernel_for<float>(hidden)) &&
                        vector_ok<float>(hidden, {data(grad_out), data(grad_pre_norm), data(pre_norm), data(weight),
                                                  data(grad_pre), data(grad_x)});
    if (!direct) {
      const at::Tensor grad_x_float = at::empty_like(grad_x, grad_x.options().dtype(dtype));
      layer_norm_backward(grad_out, grad_pre_norm, pre_norm, weight, mean, rstd, dropout, keep_bits, grad_pre,
                          grad_x_float, grad_weight, grad_ln_bias, grad_bias, grad_out2);
      grad_x.copy_(grad_x_float);
      return;
    }
  }
  bool bias_summed = false;  // false: by ATen after the kernel (a row too wide for the BIAS kernels)
  CKPT_EXT_DISPATCH_CUDA_FLOATING(dtype, "ckpt_ext::layer_norm_backward", [&] {
    using T = scalar_t;
    with_x_type<T>(grad_x.defined() ? grad_x.scalar_type() : dtype, [&](auto tag) {
      using TX = typename decltype(tag)::type;
      rowwise::LayerNormBackwardArgs<T, TX> a{grad_out.const_data_ptr<T>(), ptr_or_null<T>(grad_pre_norm),
                                              pre_norm.const_data_ptr<T>(), weight.const_data_ptr<T>(),
                                              mean.const_data_ptr<float>(), rstd.const_data_ptr<float>(),
                                              grad_pre.mutable_data_ptr<T>(), mutable_or_null<TX>(grad_x), nullptr,
                                              nullptr, nullptr, rows, static_cast<int>(hidden), dropout.philox(),
                                              dropout.enabled(), false, ptr_or_null<T>(grad_out2)};
      a.vec = vector_ok<T>(hidden, {a.grad_out, a.grad_pre_norm, a.pre_norm, a.weight, a.grad_pre, a.grad_x,
                                    a.grad_out2});
      if (a.grad_out2 != nullptr)  // aligned, and the bias sums (if any) in the BIAS kernels: checked above
        bias_summed = run_layer_norm_backward<T, TX, T, true>(a, bias_sums, pre_norm, grad_weight, grad_ln_bias,
                                                              grad_bias, stream);
      else
        bias_summed = run_layer_norm_backward(a, bias_sums, pre_norm, grad_weight, grad_ln_bias, grad_bias, stream);
    });
  });
  // The dense bias's gradient of a row the BIAS kernels do not take: grad_x summed over rows by ATen.
  if (bias_sums && !bias_summed) grad_bias.copy_(grad_x.view({rows, hidden}).sum(0));
}

// out may be bfloat16/float16 beside a float32 sum (issue 32): the register kernels store it rounded (TO); rows
// too wide for them write a float32 out first, converted after (a correct, slower path).
// x may be bfloat16/float16 beside a float32 sum (autocast: a GEMM's output joining the stream, Llama's o_proj at
// add_rms_norm, Qwen3's per-head q/k norms): the register kernels read it (TX, as float: exact) on aligned rows with
// out in the stream's dtype or x's; other rows (wider than kMaxRegisterHidden, unaligned -- the element-by-element
// instantiations of a narrower x spilled in LayerNorm's forward on sm_90, so they are not instantiated --, or an out
// of a third dtype) read x converted first (x.to(float32): the same values; a correct, slower path).
void rms_norm_forward(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
                      const at::Tensor& out, const at::Tensor& sum, const at::Tensor& rstd) {
  const c10::DeviceGuard guard(x.device());
  const int64_t hidden = weight.numel(), rows = x.numel() / hidden;
  const auto dtype = sum.scalar_type();  // the stream's
  if (x.scalar_type() != dtype) {
    const bool direct = hidden <= rowwise::kMaxRegisterHidden &&
                        (out.scalar_type() == dtype || out.scalar_type() == x.scalar_type()) &&
                        vector_ok<float>(hidden, {data(x), data(residual), data(weight), data(out), data(sum)});
    if (!direct) {
      rms_norm_forward(x.to(dtype), residual, weight, eps, out, sum, rstd);
      return;
    }
  }
  const cudaStream_t stream = current_stream(x.device());
  CKPT_EXT_DISPATCH_CUDA_FLOATING(dtype, "ckpt_ext::rms_norm_forward", [&] {
    using T = scalar_t;
    with_x_type<T>(out.scalar_type(), [&](auto out_tag) {
      using TO = typename decltype(out_tag)::type;
      with_x_type<T>(x.scalar_type(), [&](auto x_tag) {
        using TX = typename decltype(x_tag)::type;
        if constexpr (!std::is_same_v<TX, T> && !std::is_same_v<TO, T> && !std::is_same_v<TO, TX>) {
          TORCH_INTERNAL_ASSERT(false, "ckpt_ext: an RMSNorm x and out of two lower-precision dtypes");
        } else {
          rowwise::RmsNormForwardArgs<T, TO, TX> a{x.const_data_ptr<TX>(), ptr_or_null<T>(residual),
                                                   weight.const_data_ptr<T>(), out.mutable_data_ptr<TO>(),
                                                   sum.mutable_data_ptr<T>(), rstd.mutable_data_ptr<float>(), rows,
                                                   static_cast<int>(hidden), static_cast<float>(eps), false};
          // 16-byte alignment of every pointer, x's included (its slots are 8 bytes when narrower than T).
          a.vec = vector_ok<T>(hidden, {a.x, a.residual, a.weight, a.out, a.sum});
          const bool fits = with_row_shape<T, rowwise::ForwardLimits>(hidden, a.vec, [&](auto shape) {
            using S = decltype(shape);
            if constexpr (std::is_same_v<TX, T> || S::vec) {
              const auto kernel = rowwise::rms_norm_forward_kernel<T, S::iters, S::warps, S::vec, TO, TX>;
              const int threads = rowwise::cta_threads(S::warps);
              const int grid = resident_grid(kernel, threads, rows, rowwise::rows_per_cta(S::warps));
              kernel<<<grid, threads, 0, stream>>>(a);
              CKPT_EXT_CUDA_LAUNCH_CHECK();
            } else {
              TORCH_INTERNAL_ASSERT(false, "ckpt_ext: an unaligned mixed-dtype row in the register kernels");
            }
          });
          if (fits) return;
          if constexpr (!std::is_same_v<TX, T>) {
            TORCH_INTERNAL_ASSERT(false, "ckpt_ext: a mixed-dtype row wider than the register kernels");
          } else if constexpr (std::is_same_v<TO, T>) {
            multipass::rms_norm_forward<T>(a, stream);
          } else {
            const at::Tensor tmp = at::empty_like(sum);
            rowwise::RmsNormForwardArgs<T> f{a.x, a.residual, a.weight, tmp.mutable_data_ptr<T>(), a.sum, a.rstd,
                                             rows, a.hidden, a.eps, a.vec};
            multipass::rms_norm_forward<T>(f, stream);
            out.copy_(tmp);
          }
        }
      });
    });
  });
}

// grad_out (and grad_out2 of its dtype) may be bfloat16/float16 beside a float32 sum (issue 32): the register kernels
// read them (TG, added in float); rows too wide for them read the float32 sum of the two, formed first (a correct,
// slower path). grad_out2 may also have the stream's dtype beside a grad_out of it (the fanout: Llama's n2, read by
// two GEMMs, each gradient in the stream's dtype): the register kernels add them (G2: T(float(g) + float(g2)), as
// autograd's add of two T tensors and the CPU's GradRows) on aligned rows they take; other rows add them first by
// ATen (at::add: the same rounded sum). A grad_out2 of another dtype than grad_out: the float32 sum first.
void rms_norm_backward(const at::Tensor& grad_out, const at::Tensor& grad_out2, const at::Tensor& grad_sum,
                       const at::Tensor& sum, const at::Tensor& weight, const at::Tensor& rstd,
                       const at::Tensor& grad_input, const at::Tensor& grad_weight) {
  const c10::DeviceGuard guard(sum.device());
  const int64_t hidden = weight.numel(), rows = sum.numel() / hidden;
  const auto dtype = sum.scalar_type();
  if (grad_out2.defined() && grad_out2.scalar_type() != grad_out.scalar_type()) {
    rms_norm_backward(at::add(grad_out.to(dtype), grad_out2.to(dtype)), at::Tensor(), grad_sum, sum, weight, rstd,
                      grad_input, grad_weight);
    return;
  }
  const bool g2_same = grad_out2.defined() && grad_out.scalar_type() == dtype;  // G2
  if (g2_same && !(hidden <= rowwise::kMaxRegisterHidden &&
                   vector_ok_of(dtype, hidden, {data(grad_out), data(grad_out2), data(grad_sum), data(sum),
                                                data(weight), data(grad_input)}))) {
    rms_norm_backward(at::add(grad_out, grad_out2), at::Tensor(), grad_sum, sum, weight, rstd, grad_input,
                      grad_weight);
    return;
  }
  const cudaStream_t stream = current_stream(sum.device());
  CKPT_EXT_DISPATCH_CUDA_FLOATING(dtype, "ckpt_ext::rms_norm_backward", [&] {
    using T = scalar_t;
    with_x_type<T>(grad_out.scalar_type(), [&](auto tag) {
      using TG = typename decltype(tag)::type;
      rowwise::RmsNormBackwardArgs<T, TG> a{grad_out.const_data_ptr<TG>(), ptr_or_null<TG>(grad_out2),
                                            ptr_or_null<T>(grad_sum), sum.const_data_ptr<T>(),
                                            weight.const_data_ptr<T>(), rstd.const_data_ptr<float>(),
                                            grad_input.mutable_data_ptr<T>(), nullptr, rows, static_cast<int>(hidden),
                                            false};
      a.vec = vector_ok<T>(hidden, {a.grad_out, a.grad_out2, a.grad_sum, a.sum, a.weight, a.grad_input});
      at::Tensor partial_w;
      // per_sm: the shape's (rms_norm_backward_blocks_per_sm), whatever TG or G2: the same column-sum bits.
      const auto launch = [&](auto kernel, auto per_sm_of, int warps) {
        const int threads = rowwise::cta_threads(warps);
        const int grid = backward_grid(per_sm_of(threads), rows, rowwise::rows_per_cta(warps));
        partial_w = column_partials(grid, hidden, sum, false);
        a.partial_w = partial_w.mutable_data_ptr<float>();
        kernel<<<grid, threads, 0, stream>>>(a);
        CKPT_EXT_CUDA_LAUNCH_CHECK();
      };
      const bool fits = with_row_shape<T, rowwise::BackwardLimits>(hidden, a.vec, [&](auto shape) {
        using S = decltype(shape);
        if constexpr (std::is_same_v<TG, T>) {
          if (a.grad_out2 != nullptr) {  // G2: aligned rows only (checked above)
            if constexpr (S::vec)
              launch(rowwise::rms_norm_backward_kernel<T, S::iters, S::warps, true, T, true>,
                     rms_norm_backward_blocks_per_sm<T, S::iters, S::warps, true>, S::warps);
            else
              TORCH_INTERNAL_ASSERT(false, "ckpt_ext: an unaligned row with two gradients in the register kernels");
            return;
          }
        }
        launch(rowwise::rms_norm_backward_kernel<T, S::iters, S::warps, S::vec, TG>,
               rms_norm_backward_blocks_per_sm<T, S::iters, S::warps, S::vec>, S::warps);
      });
      if (!fits) {
        TORCH_INTERNAL_ASSERT(!g2_same, "ckpt_ext: two gradients of a row wider than the register kernels");
        const int grid = multipass::backward_grid(rows);
        partial_w = column_partials(grid, hidden, sum, true);
        if constexpr (std::is_same_v<TG, T>) {
          a.partial_w = partial_w.mutable_data_ptr<float>();
          multipass::rms_norm_backward<T>(a, grid, stream);
        } else {
          at::Tensor g = grad_out.to(dtype);
          if (grad_out2.defined()) g.add_(grad_out2.to(dtype));
          rowwise::RmsNormBackwardArgs<T> f{g.const_data_ptr<T>(), nullptr, a.grad_sum, a.sum, a.weight, a.rstd,
                                            a.grad_input, partial_w.mutable_data_ptr<float>(), rows, a.hidden, a.vec};
          multipass::rms_norm_backward<T>(f, grid, stream);
        }
      }
      launch_column_sum<T>(partial_w, at::Tensor(), grad_weight, at::Tensor(), stream);
    });
  });
}

}  // namespace cuda
}  // namespace kernels
}  // namespace ckpt_ext
