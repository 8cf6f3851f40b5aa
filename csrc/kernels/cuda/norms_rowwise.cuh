// Row-in-registers norm kernels: (bias + dropout + residual +) LayerNorm and (residual +) RMSNorm, forward
// and backward, for rows of up to kMaxRegisterHidden elements (norms.cu picks the shape, and the multi-pass
// kernels of norms_multipass.cuh take wider rows).
//
// Layout. A row is owned by TPR = 32 * WPR threads (one warp, or WPR warps of one block); thread t owns the
// ITERS "slots" s = it * TPR + t, slot s being columns s*V .. s*V+V-1 with V = 16 bytes / sizeof(T). So every
// column of the row is owned by exactly one (thread, it, k), each slot is one 16-byte load, and a warp's loads
// of one `it` are 512 contiguous bytes. Columns past `hidden` load as zero and are never stored.
// VEC (host-checked: every pointer 16-byte aligned and hidden % V == 0) selects the 16-byte accesses;
// otherwise each slot is read and written element by element with bounds checks (odd hidden, offset views).
// It is a template parameter, not a flag: a kernel holding both paths needed registers for both (ptxas).
//
// Each tensor is read once and written once; row statistics are warp (WPR == 1) or block reductions.
// Backward keeps each thread's column partial sums of grad_weight / grad_bias in registers across all the
// rows it handles (grid-stride) and writes one [hidden] partial per block; column_sum_kernel adds them.
//
// Dropout: element i = row * hidden + col keeps philox::Dropout::keep(i), the mapping of philox.h shared
// with the CPU kernels. In the `vec` path a slot starts at a multiple of 4 (V and hidden are multiples of 4),
// so its flags are V/4 whole keep4 groups: one Philox call per four elements, as on the CPU.
#pragma once

#include <type_traits>

#include "common.cuh"

namespace ckpt_ext {
namespace kernels {
namespace cuda {
namespace rowwise {

template <typename T>
constexpr int kVec = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte access: 4 (float), 8 (half)

// Register budgets (ptxas; `tools/compile_cuda.py --ptxas-report` prints each instantiation's). A thread
// holds kElemsPerThread elements of a row while the row fits kWarpsPerRow warps that way, and up to
// kMaxElemsPerThread for the widest rows. Forward holds the row packed plus the weights: 32 elements fit.
// Backward holds dy, xhat and two column partials in float per element (about 5 registers each plus ~80):
// at 32 elements it needs all 255 registers (and spills on some paths), so it takes 16 while a row of up to
// 8 warps x 16 covers hidden, and 32 only beyond (4097..8192 elements). More warps per row do not help:
// 512 threads leave 128 registers a thread, fewer than 16 elements need.
struct ForwardLimits {
  static constexpr int kElemsPerThread = 32, kMaxElemsPerThread = 32, kWarpsPerRow = 8;
};
struct BackwardLimits {
  static constexpr int kElemsPerThread = 16, kMaxElemsPerThread = 32, kWarpsPerRow = 8;
};
// The widest row the register-resident kernels take, forward and backward alike.
constexpr int64_t kMaxRegisterHidden =
    int64_t(ForwardLimits::kWarpsPerRow) * kWarpSize * ForwardLimits::kMaxElemsPerThread;
static_assert(int64_t(BackwardLimits::kWarpsPerRow) * kWarpSize * BackwardLimits::kMaxElemsPerThread ==
                  kMaxRegisterHidden,
              "a row that forward holds in registers must fit backward too");

// One row per warp when WPR == 1 (four rows per 128-thread block); one row per block otherwise.
constexpr int rows_per_cta(int wpr) { return wpr == 1 ? 4 : 1; }
constexpr int cta_threads(int wpr) { return rows_per_cta(wpr) * wpr * kWarpSize; }
static_assert(cta_threads(BackwardLimits::kWarpsPerRow) <= 256 && cta_threads(ForwardLimits::kWarpsPerRow) <= 256,
              "blocks of at most 256 threads, so that a thread may use 255 registers");

// Aligned to its size: 16 bytes for the row's own dtype (V = kVec<T>); a narrower element type read with a
// float row's V (a bfloat16/float16 x or grad_x beside a float32 stream: TX below) is 8 bytes, which the host's
// 16-byte pointer check and hidden % V == 0 also guarantee.
template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

// Slot at `col` of the row starting at p + base (p may be null: zeros).
template <typename T, int V>
__device__ __forceinline__ Vec<T, V> load_slot(const T* p, int64_t base, int col, int hidden, bool vec) {
  Vec<T, V> r;
  if (vec && p != nullptr && col < hidden) return *reinterpret_cast<const Vec<T, V>*>(p + base + col);
#pragma unroll
  for (int k = 0; k < V; ++k) r.v[k] = (!vec && p != nullptr && col + k < hidden) ? p[base + col + k] : T(0.f);
  return r;  // with vec, a slot is wholly inside the row or wholly past its end (hidden % V == 0)
}

template <typename T, int V>
__device__ __forceinline__ void store_slot(T* p, int64_t base, int col, int hidden, bool vec, const float (&in)[V]) {
  Vec<T, V> r;
#pragma unroll
  for (int k = 0; k < V; ++k) r.v[k] = static_cast<T>(in[k]);
  if (vec) {
    if (col < hidden) *reinterpret_cast<Vec<T, V>*>(p + base + col) = r;
    return;
  }
#pragma unroll
  for (int k = 0; k < V; ++k)
    if (col + k < hidden) p[base + col + k] = r.v[k];
}

// Float column partials (16-byte aligned rows in the `vec` case, as hidden % V == 0 there).
template <int V>
__device__ __forceinline__ void store_floats(float* p, int col, int hidden, bool vec, const float (&in)[V]) {
  if (vec) {
    if (col >= hidden) return;
#pragma unroll
    for (int q = 0; q < V / 4; ++q)
      *reinterpret_cast<float4*>(p + col + 4 * q) = make_float4(in[4 * q], in[4 * q + 1], in[4 * q + 2], in[4 * q + 3]);
    return;
  }
#pragma unroll
  for (int k = 0; k < V; ++k)
    if (col + k < hidden) p[col + k] = in[k];
}

// Keep flags of the slot's elements i0 .. i0+V-1 (i0 = row * hidden + col); false past the row's end.
template <int V>
__device__ __forceinline__ void slot_keep(const philox::Dropout& d, uint64_t i0, int col, int hidden, bool vec,
                                          bool (&keep)[V]) {
  if (vec && col < hidden) {
#pragma unroll
    for (int q = 0; q < V / 4; ++q) d.keep4((i0 >> 2) + q, keep + 4 * q);
    return;
  }
  if (vec) {  // the whole slot is past the row's end
#pragma unroll
    for (int k = 0; k < V; ++k) keep[k] = false;
    return;
  }
  philox::DropoutCursor cursor(d);  // one Philox call per group of four, not per element
#pragma unroll
  for (int k = 0; k < V; ++k) keep[k] = col + k < hidden && cursor.keep(i0 + k);
}

// Keep flags of this thread's columns of the row starting at element `base`: bit it * V + k for column
// (it * TPR + t) * V + k (zero past the row's end).
template <int ITERS, int TPR, int V>
__device__ __forceinline__ uint32_t row_keep_bits(const philox::Dropout& d, int64_t base, int t, int hidden, bool vec) {
  static_assert(ITERS * V <= 32, "one bit per element a thread holds");
  uint32_t bits = 0;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int col = (it * TPR + t) * V;
    bool keep[V];
    slot_keep<V>(d, static_cast<uint64_t>(base + col), col, hidden, vec, keep);
#pragma unroll
    for (int k = 0; k < V; ++k) bits |= static_cast<uint32_t>(keep[k]) << (it * V + k);
  }
  return bits;
}

// Sum of N floats over the threads of one row; every thread of the row gets the totals.
template <int WPR, int N>
__device__ __forceinline__ void row_sum(float (&v)[N], float* shared) {
  if constexpr (WPR == 1) {
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = warp_sum(v[k]);
  } else {
    block_sum(v, shared);  // one row per block
  }
}

// TX: x's element type, T's or (autocast, a GEMM's output joining a float32 stream) bfloat16/float16, read
// as float like every other input (norms.cu instantiates TX != T only for T = float).
// TO (issue 32; T's, or TX's where TX != T): out2's element type. With TO != T the kernel writes the normalised
// value rounded once into out2 (an out written in out_dtype, or the dual op's out2) and, where out is not null,
// also in T into out (the dual op's float32 out): one pass, the bits of the float out's .to(TO).
template <typename T, typename TX = T, typename TO = T>
struct LayerNormForwardArgs {
  const TX* x;
  const T *bias, *residual, *weight, *ln_bias;
  T *out, *pre_norm;
  float *mean, *rstd;
  int64_t rows;
  int hidden;
  float eps;
  philox::Dropout dropout;
  bool drop;
  bool vec;    // the host's choice of the kernel's VEC
  TO* out2;    // TO != T only (not null there); out may then be null
};

template <typename T, int ITERS, int WPR, bool VEC, typename TX = T, typename TO = T>
__global__ void __launch_bounds__(cta_threads(WPR))
    layer_norm_forward_kernel(const LayerNormForwardArgs<T, TX, TO> a) {
  constexpr int V = kVec<T>, TPR = WPR * kWarpSize, RPC = rows_per_cta(WPR);
  __shared__ float shared[kWarpSize];
  const int t = threadIdx.x % TPR, hidden = a.hidden;
  Vec<T, V> w[ITERS], lb[ITERS], b[ITERS];  // this thread's columns of the vectors, loaded once
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int col = (it * TPR + t) * V;
    w[it] = load_slot<T, V>(a.weight, 0, col, hidden, VEC);
    lb[it] = load_slot<T, V>(a.ln_bias, 0, col, hidden, VEC);
    b[it] = load_slot<T, V>(a.bias, 0, col, hidden, VEC);
  }
  for (int64_t row = int64_t(blockIdx.x) * RPC + threadIdx.x / TPR; row < a.rows; row += int64_t(gridDim.x) * RPC) {
    const int64_t base = row * hidden;
    Vec<T, V> v[ITERS];  // the row of pre_norm, as stored (packed: half the registers of floats for 16-bit T)
    float sum[1] = {0.f};
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int col = (it * TPR + t) * V;
      const Vec<TX, V> xs = load_slot<TX, V>(a.x, base, col, hidden, VEC);
      const Vec<T, V> rs = load_slot<T, V>(a.residual, base, col, hidden, VEC);
      float stored[V];
      bool keep[V];
      if (a.drop) slot_keep<V>(a.dropout, static_cast<uint64_t>(base + col), col, hidden, VEC, keep);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        float h = static_cast<float>(xs.v[k]) + static_cast<float>(b[it].v[k]);
        if (a.drop) h = keep[k] ? h * a.dropout.scale : 0.f;
        // Normalise exactly the rounded value that is stored (and that backward reads).
        v[it].v[k] = static_cast<T>(h + static_cast<float>(rs.v[k]));
        stored[k] = static_cast<float>(v[it].v[k]);
        sum[0] += stored[k];  // zero past the row's end
      }
      store_slot<T, V>(a.pre_norm, base, col, hidden, VEC, stored);
    }
    row_sum<WPR>(sum, shared);
    const float mu = sum[0] / static_cast<float>(hidden);
    float var[1] = {0.f};
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int col = (it * TPR + t) * V;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float d = col + k < hidden ? static_cast<float>(v[it].v[k]) - mu : 0.f;
        var[0] += d * d;
      }
    }
    row_sum<WPR>(var, shared);
    const float rs = 1.f / sqrtf(var[0] / static_cast<float>(hidden) + a.eps);
    if (t == 0) {
      a.mean[row] = mu;
      a.rstd[row] = rs;
    }
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      float y[V];
#pragma unroll
      for (int k = 0; k < V; ++k)
        y[k] = (static_cast<float>(v[it].v[k]) - mu) * rs * static_cast<float>(w[it].v[k]) + static_cast<float>(lb[it].v[k]);
      if constexpr (std::is_same_v<TO, T>) {
        store_slot<T, V>(a.out, base, (it * TPR + t) * V, hidden, VEC, y);
      } else {  // the same float y: out in T (the dual op) and out2 rounded once
        if (a.out != nullptr) store_slot<T, V>(a.out, base, (it * TPR + t) * V, hidden, VEC, y);
        store_slot<TO, V>(a.out2, base, (it * TPR + t) * V, hidden, VEC, y);
      }
    }
  }
}

// Writes this thread's column partials (acc[it][k] of column (it*TPR+t)*V+k) as row blockIdx.x of
// `partial` [gridDim.x, hidden]. With several rows per block (WPR == 1) the warps own the same columns,
// so they are first added through shared memory, in a fixed order (deterministic).
template <int ITERS, int WPR, int V>
__device__ __forceinline__ void write_column_partials(float* partial, const float (&acc)[ITERS][V], int hidden,
                                                      bool vec, float* red, int reducer_warp) {
  constexpr int TPR = WPR * kWarpSize, RPC = rows_per_cta(WPR);
  const int t = threadIdx.x % TPR, slot_row = threadIdx.x / TPR;
  float* out = partial + int64_t(blockIdx.x) * hidden;
  if constexpr (RPC == 1) {
#pragma unroll
    for (int it = 0; it < ITERS; ++it) store_floats<V>(out, (it * TPR + t) * V, hidden, vec, acc[it]);
  } else {
#pragma unroll
    for (int it = 0; it < ITERS; ++it)
#pragma unroll
      for (int k = 0; k < V; ++k) red[((it * V + k) * RPC + slot_row) * TPR + t] = acc[it][k];
    __syncthreads();
    if (slot_row != reducer_warp) return;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      float s[V];
#pragma unroll
      for (int k = 0; k < V; ++k) {
        s[k] = 0.f;
#pragma unroll
        for (int r = 0; r < RPC; ++r) s[k] += red[((it * V + k) * RPC + r) * TPR + t];
      }
      store_floats<V>(out, (it * TPR + t) * V, hidden, vec, s);
    }
  }
}

// Zero past the row's end, where (0 - mu) * rs could be inf * 0.
template <typename T>
__device__ __forceinline__ float layer_norm_xhat(T x, float mu, float rs, bool inside) {
  return inside ? (static_cast<float>(x) - mu) * rs : 0.f;
}

// TX: grad_x's element type (the forward's x's, as LayerNormForwardArgs): rounded once from the float
// gradient, whose unrounded value the dense bias's column sums add.
// TG (issue 32; T's, or TX's where TX != T): grad_out2's element type. With TG != T the gradient of out is
// float(grad_out) + float(grad_out2) (the dual op: out's float32 gradient and out2's), or float(grad_out2) alone
// where grad_out is null (an out written in out_dtype: its one gradient is passed as grad_out2): the float values
// autograd's sum and ToCopyBackward give, as the CPU kernels add them (GradRows).
// G2 (the kernel's; TG == T): a second gradient of out in the stream's dtype (a norm output with two uses, whose
// backward receives both: the fanout), added as autograd adds two T tensors: T(float(grad_out) + float(grad_out2)),
// read back as float (the CPU's GradRows adds them in T; for T = float the float sum).
template <typename T, typename TX = T, typename TG = T>
struct LayerNormBackwardArgs {
  const T *grad_out, *grad_pre_norm, *pre_norm, *weight;
  const float *mean, *rstd;
  T* grad_pre;
  TX* grad_x;
  float *partial_w, *partial_b;  // [gridDim.x, hidden]
  float* partial_x;              // [gridDim.x, hidden]: grad_x's column sums (the dense bias's gradient), or null
  int64_t rows;
  int hidden;
  philox::Dropout dropout;
  bool drop;
  bool vec;              // the host's choice of the kernel's VEC
  const TG* grad_out2;  // TG != T (not null there; grad_out may then be null), or G2 (not null, nor is grad_out)
};

// BIAS: also the column sums of grad_x as stored (a.partial_x; a.grad_x defined), one more float per element
// held across rows -- instantiated only where the row's slots leave the registers for it (norms.cu).
// G2: grad_out2 of T's dtype added to grad_out (LayerNormBackwardArgs; instantiated with VEC only). With BIAS on
// 8-warp rows, one block per SM is asked for (min blocks 1; 0 = none given, the other kernels): ptxas otherwise
// held the 16-bit ones to 128 registers on sm_80 and spilled 4 bytes; they take 146-149 (sm_90 gives them 148).
template <typename T, int ITERS, int WPR, bool VEC, bool BIAS = false, typename TX = T, typename TG = T,
          bool G2 = false>
__global__ void __launch_bounds__(cta_threads(WPR), G2 && BIAS && WPR == BackwardLimits::kWarpsPerRow ? 1 : 0)
    layer_norm_backward_kernel(const LayerNormBackwardArgs<T, TX, TG> a) {
  static_assert(!G2 || std::is_same_v<TG, T>, "G2: a second gradient of the stream's dtype");
  constexpr int V = kVec<T>, TPR = WPR * kWarpSize, RPC = rows_per_cta(WPR);
  __shared__ float shared[2 * kWarpSize];
  const int t = threadIdx.x % TPR, hidden = a.hidden;
  Vec<T, V> w[ITERS];
  float dw[ITERS][V], db[ITERS][V];  // column partial sums over this thread's rows
  float dx[BIAS ? ITERS : 1][V];     // BIAS: grad_x's
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    w[it] = load_slot<T, V>(a.weight, 0, (it * TPR + t) * V, hidden, VEC);
#pragma unroll
    for (int k = 0; k < V; ++k) dw[it][k] = db[it][k] = 0.f;
  }
#pragma unroll
  for (int it = 0; it < (BIAS ? ITERS : 1); ++it)
#pragma unroll
    for (int k = 0; k < V; ++k) dx[it][k] = 0.f;
  for (int64_t row = int64_t(blockIdx.x) * RPC + threadIdx.x / TPR; row < a.rows; row += int64_t(gridDim.x) * RPC) {
    const int64_t base = row * hidden;
    const float mu = a.mean[row], rs = a.rstd[row];
    // The dropout mask of grad_x, drawn before the row is loaded: Philox next to the row's values (in the
    // second pass) needs registers that are not there (ptxas spilled).
    const uint32_t keep = a.drop && a.grad_x != nullptr ? row_keep_bits<ITERS, TPR, V>(a.dropout, base, t, hidden, VEC) : 0u;
    // dy = grad_out * weight and xhat of the row, kept for the second pass (the compiler would keep them
    // anyway rather than recompute them from the loaded rows, which then need no registers of their own).
    float dy[ITERS][V], xhat[ITERS][V];
    float sums[2] = {0.f, 0.f};  // sum(dy), sum(dy * xhat)
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int col = (it * TPR + t) * V;
      Vec<T, V> gs = load_slot<T, V>(a.grad_out, base, col, hidden, VEC);  // null: zeros
      [[maybe_unused]] Vec<TG, V> g2s;
      if constexpr (!std::is_same_v<TG, T>) g2s = load_slot<TG, V>(a.grad_out2, base, col, hidden, VEC);
      if constexpr (G2) {  // autograd's add of two T gradients: rounded to T (exact for T = float)
        const Vec<T, V> gs2 = load_slot<T, V>(a.grad_out2, base, col, hidden, VEC);
#pragma unroll
        for (int k = 0; k < V; ++k) gs.v[k] = static_cast<T>(static_cast<float>(gs.v[k]) + static_cast<float>(gs2.v[k]));
      }
      const Vec<T, V> xs = load_slot<T, V>(a.pre_norm, base, col, hidden, VEC);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        float g = static_cast<float>(gs.v[k]);  // zero past the row's end, so are dy and the partials
        if constexpr (!std::is_same_v<TG, T>)  // not 0 + g2 where grad_out is null: a -0 gradient stays -0
          g = a.grad_out != nullptr ? g + static_cast<float>(g2s.v[k]) : static_cast<float>(g2s.v[k]);
        xhat[it][k] = layer_norm_xhat(xs.v[k], mu, rs, col + k < hidden);
        dy[it][k] = g * static_cast<float>(w[it].v[k]);
        sums[0] += dy[it][k];
        sums[1] += dy[it][k] * xhat[it][k];
        dw[it][k] += g * xhat[it][k];
        db[it][k] += g;
      }
    }
    row_sum<WPR>(sums, shared);
    const float c_mean = sums[0] / static_cast<float>(hidden), c_xhat = sums[1] / static_cast<float>(hidden);
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int col = (it * TPR + t) * V;
      const Vec<T, V> gp = load_slot<T, V>(a.grad_pre_norm, base, col, hidden, VEC);
      float d[V];
#pragma unroll
      for (int k = 0; k < V; ++k) d[k] = rs * (dy[it][k] - c_mean - xhat[it][k] * c_xhat) + static_cast<float>(gp.v[k]);
      store_slot<T, V>(a.grad_pre, base, col, hidden, VEC, d);
      if (a.grad_x != nullptr) {
        if (a.drop) {
#pragma unroll
          for (int k = 0; k < V; ++k) d[k] = (keep >> (it * V + k)) & 1u ? d[k] * a.dropout.scale : 0.f;
        }
        store_slot<TX, V>(a.grad_x, base, col, hidden, VEC, d);
        if constexpr (BIAS) {
          // Of the values stored in the stream's dtype T (a narrower TX: the float values, as the float path
          // sums them); past the row's end the store writes nothing and the sum is not written.
#pragma unroll
          for (int k = 0; k < V; ++k) dx[it][k] += static_cast<float>(static_cast<T>(d[k]));
        }
      }
    }
  }
  __shared__ float red[BIAS ? 3 : 2][RPC > 1 ? RPC * TPR * ITERS * V : 1];
  write_column_partials<ITERS, WPR, V>(a.partial_w, dw, hidden, VEC, red[0], 0);
  write_column_partials<ITERS, WPR, V>(a.partial_b, db, hidden, VEC, red[1], 1);
  if constexpr (BIAS) write_column_partials<ITERS, WPR, V>(a.partial_x, dx, hidden, VEC, red[2], 2 % RPC);
}

// TO: out's element type, T's or (autocast, issue 32: an out that only feeds GEMMs) bfloat16/float16 beside a
// float32 stream, the float value rounded once on the store (norms.cu instantiates TO != T only for T = float).
// TX: x's element type, T's or (autocast: a GEMM's output joining the float32 stream, Llama's o_proj at add_rms_norm,
// Qwen3's per-head q/k norms) bfloat16/float16, read as float like LayerNormForwardArgs' x (norms.cu instantiates
// TX != T only for T = float, with VEC, and TO T's or TX's).
template <typename T, typename TO = T, typename TX = T>
struct RmsNormForwardArgs {
  const TX* x;
  const T *residual, *weight;
  TO* out;
  T* sum;
  float* rstd;
  int64_t rows;
  int hidden;
  float eps;
  bool vec;  // the host's choice of the kernel's VEC
};

template <typename T, int ITERS, int WPR, bool VEC, typename TO = T, typename TX = T>
__global__ void __launch_bounds__(cta_threads(WPR)) rms_norm_forward_kernel(const RmsNormForwardArgs<T, TO, TX> a) {
  constexpr int V = kVec<T>, TPR = WPR * kWarpSize, RPC = rows_per_cta(WPR);
  __shared__ float shared[kWarpSize];
  const int t = threadIdx.x % TPR, hidden = a.hidden;
  Vec<T, V> w[ITERS];
#pragma unroll
  for (int it = 0; it < ITERS; ++it) w[it] = load_slot<T, V>(a.weight, 0, (it * TPR + t) * V, hidden, VEC);
  for (int64_t row = int64_t(blockIdx.x) * RPC + threadIdx.x / TPR; row < a.rows; row += int64_t(gridDim.x) * RPC) {
    const int64_t base = row * hidden;
    Vec<T, V> v[ITERS];  // the row of sum, as stored
    float sum_sq[1] = {0.f};
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int col = (it * TPR + t) * V;
      const Vec<TX, V> xs = load_slot<TX, V>(a.x, base, col, hidden, VEC);
      const Vec<T, V> rs = load_slot<T, V>(a.residual, base, col, hidden, VEC);
      float stored[V];
#pragma unroll
      for (int k = 0; k < V; ++k) {
        v[it].v[k] = static_cast<T>(static_cast<float>(xs.v[k]) + static_cast<float>(rs.v[k]));
        stored[k] = static_cast<float>(v[it].v[k]);
        sum_sq[0] += stored[k] * stored[k];
      }
      store_slot<T, V>(a.sum, base, col, hidden, VEC, stored);
    }
    row_sum<WPR>(sum_sq, shared);
    const float rs = 1.f / sqrtf(sum_sq[0] / static_cast<float>(hidden) + a.eps);
    if (t == 0) a.rstd[row] = rs;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      float y[V];
#pragma unroll
      for (int k = 0; k < V; ++k)  // LlamaRMSNorm: normalise in float, round to T, then scale by the weight
        y[k] = static_cast<float>(w[it].v[k]) * static_cast<float>(static_cast<T>(static_cast<float>(v[it].v[k]) * rs));
      store_slot<TO, V>(a.out, base, (it * TPR + t) * V, hidden, VEC, y);
    }
  }
}

// TG: grad_out's element type, T's or the TO of the forward's out (bfloat16/float16 beside a float32 stream, read
// as float); grad_out2 (TG != T, may be null; or the kernel's G2, not null): a second gradient of out, added to
// grad_out in float and rounded to T (TG != T: T = float, exact; G2: autograd's add of two T tensors, as GradRows).
template <typename T, typename TG = T>
struct RmsNormBackwardArgs {
  const TG *grad_out, *grad_out2;
  const T *grad_sum, *sum, *weight;
  const float* rstd;
  T* grad_input;
  float* partial_w;  // [gridDim.x, hidden]
  int64_t rows;
  int hidden;
  bool vec;  // the host's choice of the kernel's VEC
};

template <typename T, int ITERS, int WPR, bool VEC, typename TG = T, bool G2 = false>
__global__ void __launch_bounds__(cta_threads(WPR)) rms_norm_backward_kernel(const RmsNormBackwardArgs<T, TG> a) {
  static_assert(!G2 || std::is_same_v<TG, T>, "G2: a second gradient of the stream's dtype");
  constexpr int V = kVec<T>, TPR = WPR * kWarpSize, RPC = rows_per_cta(WPR);
  __shared__ float shared[kWarpSize];
  const int t = threadIdx.x % TPR, hidden = a.hidden;
  Vec<T, V> w[ITERS];
  float dw[ITERS][V];
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    w[it] = load_slot<T, V>(a.weight, 0, (it * TPR + t) * V, hidden, VEC);
#pragma unroll
    for (int k = 0; k < V; ++k) dw[it][k] = 0.f;
  }
  for (int64_t row = int64_t(blockIdx.x) * RPC + threadIdx.x / TPR; row < a.rows; row += int64_t(gridDim.x) * RPC) {
    const int64_t base = row * hidden;
    const float rs = a.rstd[row];
    Vec<T, V> gs[ITERS], ss[ITERS];  // the row of grad_out and sum, packed (dn and n are recomputed)
    float dn_n[1] = {0.f};            // sum(dn * n) with dn = grad_out * weight, n = sum * rstd
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int col = (it * TPR + t) * V;
      if constexpr (std::is_same_v<TG, T> && !G2) {
        gs[it] = load_slot<T, V>(a.grad_out, base, col, hidden, VEC);
      } else {  // in T: the two gradients added as autograd adds them (TG != T: in float, exact in T = float)
        const Vec<TG, V> g1 = load_slot<TG, V>(a.grad_out, base, col, hidden, VEC);
        const Vec<TG, V> g2 = load_slot<TG, V>(a.grad_out2, base, col, hidden, VEC);  // null: zeros
#pragma unroll
        for (int k = 0; k < V; ++k) {
          const float g = static_cast<float>(g1.v[k]);
          gs[it].v[k] = static_cast<T>(G2 || a.grad_out2 != nullptr ? g + static_cast<float>(g2.v[k]) : g);
        }
      }
      ss[it] = load_slot<T, V>(a.sum, base, col, hidden, VEC);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float g = static_cast<float>(gs[it].v[k]);  // zero past the row's end, as is n
        const float n = col + k < hidden ? static_cast<float>(ss[it].v[k]) * rs : 0.f;
        dn_n[0] += g * static_cast<float>(w[it].v[k]) * n;
        dw[it][k] += g * static_cast<float>(static_cast<T>(n));  // out = weight * to_dtype(n)
      }
    }
    row_sum<WPR>(dn_n, shared);
    const float c_n = dn_n[0] / static_cast<float>(hidden);
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int col = (it * TPR + t) * V;
      const Vec<T, V> gsum = load_slot<T, V>(a.grad_sum, base, col, hidden, VEC);
      float d[V];
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float n = col + k < hidden ? static_cast<float>(ss[it].v[k]) * rs : 0.f;
        const float dn = static_cast<float>(gs[it].v[k]) * static_cast<float>(w[it].v[k]);
        d[k] = rs * (dn - n * c_n) + static_cast<float>(gsum.v[k]);
      }
      store_slot<T, V>(a.grad_input, base, col, hidden, VEC, d);
    }
  }
  __shared__ float red[RPC > 1 ? RPC * TPR * ITERS * V : 1];
  write_column_partials<ITERS, WPR, V>(a.partial_w, dw, hidden, VEC, red, 0);
}

// grad[c] = sum over p of partial[p, c] (and the same for a second buffer), in a fixed order; one block
// per 32 columns, kColumnSumRows threads down the partials, then a shared-memory sum.
constexpr int kColumnSumRows = 16;

template <typename T>
__global__ void __launch_bounds__(kWarpSize* kColumnSumRows)
    column_sum_kernel(const float* partial_w, const float* partial_b, int parts, int hidden, T* grad_w, T* grad_b) {
  __shared__ float sw[kColumnSumRows][kWarpSize + 1], sb[kColumnSumRows][kWarpSize + 1];
  const int tx = threadIdx.x % kWarpSize, ty = threadIdx.x / kWarpSize;
  const int col = blockIdx.x * kWarpSize + tx;
  float aw = 0.f, ab = 0.f;
  if (col < hidden) {
    for (int p = ty; p < parts; p += kColumnSumRows) {
      aw += partial_w[int64_t(p) * hidden + col];
      if (partial_b != nullptr) ab += partial_b[int64_t(p) * hidden + col];
    }
  }
  sw[ty][tx] = aw;
  sb[ty][tx] = ab;
  __syncthreads();
  if (ty != 0 || col >= hidden) return;
  for (int r = 1; r < kColumnSumRows; ++r) {
    aw += sw[r][tx];
    ab += sb[r][tx];
  }
  grad_w[col] = static_cast<T>(aw);
  if (grad_b != nullptr) grad_b[col] = static_cast<T>(ab);
}

}  // namespace rowwise
}  // namespace cuda
}  // namespace kernels
}  // namespace ckpt_ext
