// CUDA elementwise kernels: bias+GELU, bias+dropout+residual, dropout and its mask, SwiGLU, GeGLU, rotary.
//
// Each thread owns groups of four consecutive elements (grid-stride loop): one vector load/store per
// tensor when the pointers allow it, and one Philox call for the four dropout flags (the mask of element
// i is keep4(i / 4)[i % 4], the same stream the CPU kernels walk). All arithmetic is float. Autocast's
// float32 residual stream: bias_dropout_add reads a bfloat16/float16 x beside it (MixedPtrs2), dropout
// writes a bfloat16/float16 result of a float32 input; each pointer keeps its own vector loads/stores.
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>

#include "../math.h"
#include "common.cuh"

// The lower-precision side of the mixed-dtype calls (autocast's float32 residual stream beside the GEMMs' dtype).
#define CKPT_EXT_DISPATCH_CUDA_LOWP(TYPE, NAME, ...) \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__) AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

namespace ckpt_ext {
namespace kernels {
namespace cuda {
namespace {

constexpr int kThreads = 256;

// The kernels' inputs / outputs: kN pointers, loaded / stored four elements at a time as float (load4 /
// store4). One dtype for all (ConstPtrs, MutPtrs), or MixedPtrs2's two (x in a lower precision beside
// autocast's float32 residual); the unrolled loops over i / o pick the pointer at compile time.
template <typename T, int N>
struct ConstPtrs {
  static constexpr int kN = N;
  const T* p[N];
  __device__ __forceinline__ void load(int i, int64_t base, int count, bool vec, float (&out)[4]) const {
    load4(p[i], base, count, vec, out);
  }
  bool aligned() const {
    for (int i = 0; i < N; ++i)
      if (!pack4_aligned<T>(p[i])) return false;
    return true;
  }
};

template <typename X, typename T>
struct MixedPtrs2 {
  static constexpr int kN = 2;
  const X* x;
  const T* r;
  __device__ __forceinline__ void load(int i, int64_t base, int count, bool vec, float (&out)[4]) const {
    if (i == 0)
      load4(x, base, count, vec, out);
    else
      load4(r, base, count, vec, out);
  }
  bool aligned() const { return pack4_aligned<X>(x) && pack4_aligned<T>(r); }
};

template <typename T, int N>
struct MutPtrs {
  static constexpr int kN = N;
  T* p[N];
  __device__ __forceinline__ void store(int o, int64_t base, int count, bool vec, const float (&in)[4]) const {
    store4(p[o], base, count, vec, in);
  }
  bool aligned() const {
    for (int o = 0; o < N; ++o)
      if (!pack4_aligned<T>(p[o])) return false;
    return true;
  }
};

// Groups of four a thread loads before it computes and stores any: the grid is capped at a full machine
// (grid_for), so a large tensor gives each thread many groups, and with one group per iteration a thread
// has a single 8-byte (bf16) load per input in flight -- the stores of one iteration may alias the loads
// of the next, so the compiler cannot overlap them. Two groups double the bytes in flight. Which
// thread computes a group changes, what it computes does not (op is a function of the group), so the
// results and the Philox streams are the same bits.
constexpr int kGroupsInFlight = 2;

// in[i] / out[o]: four values of input i / output o for elements base .. base+count-1.
template <typename In, typename Out, typename Op>
__global__ void elementwise4_kernel(In in, Out out, int64_t n, bool vec, Op op) {
  constexpr int NIn = In::kN, NOut = Out::kN;
  const int64_t groups = (n + 3) / 4;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t g0 = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; g0 < groups;
       g0 += stride * kGroupsInFlight) {
    float a[kGroupsInFlight][NIn][4];
    float b[kGroupsInFlight][NOut][4];
#pragma unroll
    for (int u = 0; u < kGroupsInFlight; ++u) {
      const int64_t g = g0 + u * stride;
      if (g >= groups) break;
      const int64_t base = g * 4;
      const int count = static_cast<int>(min(static_cast<int64_t>(4), n - base));
#pragma unroll
      for (int i = 0; i < NIn; ++i) in.load(i, base, count, vec, a[u][i]);
    }
#pragma unroll
    for (int u = 0; u < kGroupsInFlight; ++u) {
      const int64_t g = g0 + u * stride;
      if (g >= groups) break;
      const int64_t base = g * 4;
      const int count = static_cast<int>(min(static_cast<int64_t>(4), n - base));
      op(g, base, count, a[u], b[u]);
#pragma unroll
      for (int o = 0; o < NOut; ++o) out.store(o, base, count, vec, b[u][o]);
    }
  }
}

template <typename In, typename Out, typename Op>
void launch_elementwise4(c10::Device device, const In& in, const Out& out, int64_t n, const Op& op) {
  const bool vec = in.aligned() && out.aligned();
  const int64_t groups = (n + 3) / 4;
  // Once per instantiation (the grid's size changes no result, only how well the SMs are filled).
  static const int resident = resident_blocks_per_sm(elementwise4_kernel<In, Out, Op>, kThreads);
  elementwise4_kernel<In, Out, Op><<<grid_for(groups, kThreads, std::min(resident, 8)), kThreads, 0,
                                     current_stream(device)>>>(in, out, n, vec, op);
  CKPT_EXT_CUDA_LAUNCH_CHECK();
}

// Bias broadcast over the last dim (`hidden`); `vec`: hidden % 4 == 0 and the bias is Pack4-aligned, so
// a group of four never wraps a row.
template <typename T>
struct RowBias {
  const T* bias;
  int64_t hidden;
  bool vec;

  __device__ __forceinline__ void load(int64_t base, int count, float (&out)[4]) const {
    if (bias == nullptr) {
#pragma unroll
      for (int k = 0; k < 4; ++k) out[k] = 0.f;
    } else if (vec) {
      load4(bias, base % hidden, count, true, out);
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k) out[k] = k < count ? static_cast<float>(bias[(base + k) % hidden]) : 0.f;
    }
  }
};

template <typename T>
RowBias<T> row_bias(const at::Tensor& bias, int64_t hidden) {
  const T* p = ptr_or_null<T>(bias);
  return RowBias<T>{p, hidden, p != nullptr && hidden % 4 == 0 && pack4_aligned<T>(p)};
}

using math::gelu;
using math::gelu_derivative;
using math::sigmoid;

template <typename T>
struct BiasGeluForward {
  RowBias<T> bias;
  bool tanh;
  __device__ void operator()(int64_t, int64_t base, int count, const float (&in)[1][4], float (&out)[1][4]) const {
    float b[4];
    bias.load(base, count, b);
#pragma unroll
    for (int k = 0; k < 4; ++k) out[0][k] = gelu(in[0][k] + b[k], tanh);
  }
};

template <typename T>
struct BiasGeluBackward {  // in: grad, x
  RowBias<T> bias;
  bool tanh;
  __device__ void operator()(int64_t, int64_t base, int count, const float (&in)[2][4], float (&out)[1][4]) const {
    float b[4];
    bias.load(base, count, b);
#pragma unroll
    for (int k = 0; k < 4; ++k) out[0][k] = in[0][k] * gelu_derivative(in[1][k] + b[k], tanh);
  }
};

template <typename T>
struct BiasDropoutAdd {  // in: x, residual
  RowBias<T> bias;
  philox::Dropout dropout;
  bool drop;
  __device__ void operator()(int64_t group, int64_t base, int count, const float (&in)[2][4],
                             float (&out)[1][4]) const {
    float b[4];
    bias.load(base, count, b);
    bool keep[4] = {true, true, true, true};
    if (drop) dropout.keep4(static_cast<uint64_t>(group), keep);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float v = in[0][k] + b[k];
      out[0][k] = in[1][k] + (drop ? (keep[k] ? v * dropout.scale : 0.f) : v);
    }
  }
};

struct DropoutScale {  // in: x (dropout, or the gradient of one)
  philox::Dropout dropout;
  __device__ void operator()(int64_t group, int64_t, int, const float (&in)[1][4], float (&out)[1][4]) const {
    bool keep[4];
    dropout.keep4(static_cast<uint64_t>(group), keep);
#pragma unroll
    for (int k = 0; k < 4; ++k) out[0][k] = keep[k] ? in[0][k] * dropout.scale : 0.f;
  }
};

struct SwigluForward {  // in: gate, up
  __device__ void operator()(int64_t, int64_t, int, const float (&in)[2][4], float (&out)[1][4]) const {
#pragma unroll
    for (int k = 0; k < 4; ++k) out[0][k] = in[0][k] * sigmoid(in[0][k]) * in[1][k];
  }
};

struct SwigluBackward {  // in: grad, gate, up; out: grad_gate, grad_up
  __device__ void operator()(int64_t, int64_t, int, const float (&in)[3][4], float (&out)[2][4]) const {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float d = in[0][k], g = in[1][k], u = in[2][k], s = sigmoid(g);
      out[0][k] = d * u * s * (1.f + g * (1.f - s));
      out[1][k] = d * g * s;
    }
  }
};

struct GegluForward {  // in: gate, up
  bool tanh;
  __device__ void operator()(int64_t, int64_t, int, const float (&in)[2][4], float (&out)[1][4]) const {
#pragma unroll
    for (int k = 0; k < 4; ++k) out[0][k] = gelu(in[0][k], tanh) * in[1][k];
  }
};

struct GegluBackward {  // in: grad, gate, up; out: grad_gate, grad_up
  bool tanh;
  __device__ void operator()(int64_t, int64_t, int, const float (&in)[3][4], float (&out)[2][4]) const {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float d = in[0][k], g = in[1][k], u = in[2][k];
      out[0][k] = d * u * gelu_derivative(g, tanh);
      out[1][k] = d * gelu(g, tanh);
    }
  }
};

// The backwards that also write the forward's output `act` (issue 33), by the forward's functor itself (its bits);
// each output may be one of the inputs (the ops write them in place): the kernel loads a group's inputs before it
// stores any of its outputs, and a group's outputs are its own elements.
struct SwigluBackwardAct {  // in: grad, gate, up; out: grad_gate, grad_up, act
  __device__ void operator()(int64_t group, int64_t base, int count, const float (&in)[3][4],
                             float (&out)[3][4]) const {
    SwigluBackward{}(group, base, count, in, reinterpret_cast<float (&)[2][4]>(out));
    SwigluForward{}(group, base, count, reinterpret_cast<const float (&)[2][4]>(in[1]),
                    reinterpret_cast<float (&)[1][4]>(out[2]));
  }
};

struct GegluBackwardAct {  // in: grad, gate, up; out: grad_gate, grad_up, act
  bool tanh;
  __device__ void operator()(int64_t group, int64_t base, int count, const float (&in)[3][4],
                             float (&out)[3][4]) const {
    GegluBackward{tanh}(group, base, count, in, reinterpret_cast<float (&)[2][4]>(out));
    GegluForward{tanh}(group, base, count, reinterpret_cast<const float (&)[2][4]>(in[1]),
                       reinterpret_cast<float (&)[1][4]>(out[2]));
  }
};

template <typename T>
struct BiasGeluBackwardAct {  // in: grad, x; out: grad_x, act
  RowBias<T> bias;
  bool tanh;
  __device__ void operator()(int64_t group, int64_t base, int count, const float (&in)[2][4],
                             float (&out)[2][4]) const {
    BiasGeluBackward<T>{bias, tanh}(group, base, count, in, reinterpret_cast<float (&)[1][4]>(out[0]));
    BiasGeluForward<T>{bias, tanh}(group, base, count, reinterpret_cast<const float (&)[1][4]>(in[1]),
                                   reinterpret_cast<float (&)[1][4]>(out[1]));
  }
};

__global__ void dropout_mask_kernel(bool* mask, int64_t n, philox::Dropout dropout) {
  const int64_t groups = (n + 3) / 4;
  for (int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; g < groups;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    bool keep[4];
    dropout.keep4(static_cast<uint64_t>(g), keep);
    const int64_t base = g * 4;
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (base + k < n) mask[base + k] = keep[k];
  }
}

// One thread per (row, j < D/2) pair: it reads x[j], x[j + D/2] and writes both outputs.
struct RotaryShape {
  int64_t heads, seq, half, head_dim;
  int64_t x_stride[3], out_stride[3];  // batch, head, seq (the last dim is contiguous)
  int64_t table_batch_stride;         // 0 when cos/sin broadcast over the batch
};

template <typename T, bool kBackward>
__global__ void rotary_kernel(const T* x, const T* cos, const T* sin, T* out, RotaryShape s, int64_t total) {
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t j = idx % s.half, row = idx / s.half;
    const int64_t q = row % s.seq, h = (row / s.seq) % s.heads, b = row / (s.seq * s.heads);
    const T* xr = x + b * s.x_stride[0] + h * s.x_stride[1] + q * s.x_stride[2];
    T* yr = out + b * s.out_stride[0] + h * s.out_stride[1] + q * s.out_stride[2];
    const int64_t t = b * s.table_batch_stride + q * s.head_dim;
    const float x1 = static_cast<float>(xr[j]), x2 = static_cast<float>(xr[j + s.half]);
    const float c1 = static_cast<float>(cos[t + j]), c2 = static_cast<float>(cos[t + j + s.half]);
    const float s1 = static_cast<float>(sin[t + j]), s2 = static_cast<float>(sin[t + j + s.half]);
    if (!kBackward) {  // x * cos + [-x2, x1] * sin
      yr[j] = static_cast<T>(x1 * c1 - x2 * s1);
      yr[j + s.half] = static_cast<T>(x2 * c2 + x1 * s2);
    } else {  // transpose: g * cos + [g2 * s2, -g1 * s1]
      yr[j] = static_cast<T>(x1 * c1 + x2 * s2);
      yr[j + s.half] = static_cast<T>(x2 * c2 - x1 * s1);
    }
  }
}

// bias_gelu_backward with the bias's gradient (grad_bias): grad_x as BiasGeluBackward computes it, and the
// column sums of grad_x as stored, in the same pass. A thread owns four consecutive columns (one 8- or 16-byte
// access) and walks the rows blockIdx.y, + gridDim.y, ... two at a time (two rows' loads in flight), adding
// into four float registers; block row blockIdx.y of `partial` [gridDim.y, hidden] gets them, and
// column_sums_kernel adds the rows of `partial` in order (deterministic on a given device).
constexpr int kColumnThreads = 128;

template <typename T>
__global__ void __launch_bounds__(kColumnThreads)
    bias_gelu_backward_columns_kernel(const T* grad, const T* x, const T* bias, T* grad_x, float* partial,
                                      int64_t rows, int hidden, bool tanh, bool vec, T* act = nullptr) {
  const int col = (blockIdx.x * kColumnThreads + threadIdx.x) * 4;
  if (col >= hidden) return;
  const int count = min(4, hidden - col);
  float b[4] = {0.f, 0.f, 0.f, 0.f}, acc[4] = {0.f, 0.f, 0.f, 0.f};
  if (bias != nullptr) load4(bias, col, count, vec, b);
  const int64_t step = gridDim.y;
  for (int64_t r = blockIdx.y; r < rows; r += 2 * step) {
    const bool second = r + step < rows;
    float g[2][4], v[2][4];
    load4(grad, r * hidden + col, count, vec, g[0]);
    load4(x, r * hidden + col, count, vec, v[0]);
    if (second) {
      load4(grad, (r + step) * hidden + col, count, vec, g[1]);
      load4(x, (r + step) * hidden + col, count, vec, v[1]);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (h == 1 && !second) break;
      float d[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        d[k] = g[h][k] * gelu_derivative(v[h][k] + b[k], tanh);
        acc[k] += static_cast<float>(static_cast<T>(d[k]));  // as stored
      }
      store4(grad_x, (r + h * step) * hidden + col, count, vec, d);
      if (act != nullptr) {  // the forward's value (BiasGeluForward's expression); act may be x (both rows loaded)
        float a[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) a[k] = gelu(v[h][k] + b[k], tanh);
        store4(act, (r + h * step) * hidden + col, count, vec, a);
      }
    }
  }
  float* out = partial + int64_t(blockIdx.y) * hidden;
#pragma unroll
  for (int k = 0; k < 4; ++k)
    if (k < count) out[col + k] = acc[k];
}

// grad_bias[c] = sum over p of partial[p, c], p in order.
template <typename T>
__global__ void column_sums_kernel(const float* partial, int parts, int hidden, T* grad_bias) {
  const int col = blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= hidden) return;
  float s = 0.f;
  for (int p = 0; p < parts; ++p) s += partial[int64_t(p) * hidden + col];
  grad_bias[col] = static_cast<T>(s);
}

// bias_gelu_backward's path with the bias's gradient: the column kernel, then the column sums of `partial`; `act`
// (undefined: none) also gets the activation (bias_gelu_backward_act).
void launch_bias_gelu_columns(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& bias, bool tanh,
                              const at::Tensor& grad_x, const at::Tensor& grad_bias, const at::Tensor& act) {
  const int64_t hidden = x.size(-1), rows = x.numel() / hidden;
  const cudaStream_t stream = current_stream(x.device());
  CKPT_EXT_DISPATCH_CUDA_FLOATING(x.scalar_type(), "ckpt_ext::bias_gelu_backward", [&] {
    using T = scalar_t;
    const T *gp = grad.const_data_ptr<T>(), *xp = x.const_data_ptr<T>(), *bp = ptr_or_null<T>(bias);
    T* dp = grad_x.mutable_data_ptr<T>();
    T* ap = act.defined() ? act.data_ptr<T>() : nullptr;
    const bool vec = hidden % 4 == 0 && pack4_aligned<T>(gp) && pack4_aligned<T>(xp) && pack4_aligned<T>(bp) &&
                     pack4_aligned<T>(dp) && pack4_aligned<T>(ap);
    const int col_blocks = static_cast<int>((hidden + 4 * kColumnThreads - 1) / (4 * kColumnThreads));
    // Enough row groups for about eight resident blocks per SM, each walking at least two rows.
    const int64_t want = std::max<int64_t>(1, int64_t(multiprocessor_count()) * 8 / col_blocks);
    const int row_groups = static_cast<int>(std::min<int64_t>({want, (rows + 1) / 2, 65535}));
    const at::Tensor partial = at::empty({row_groups, hidden}, x.options().dtype(at::kFloat));
    bias_gelu_backward_columns_kernel<T><<<dim3(col_blocks, row_groups), kColumnThreads, 0, stream>>>(
        gp, xp, bp, dp, partial.mutable_data_ptr<float>(), rows, static_cast<int>(hidden), tanh, vec, ap);
    CKPT_EXT_CUDA_LAUNCH_CHECK();
    column_sums_kernel<T><<<static_cast<int>((hidden + 255) / 256), 256, 0, stream>>>(
        partial.const_data_ptr<float>(), row_groups, static_cast<int>(hidden), grad_bias.mutable_data_ptr<T>());
    CKPT_EXT_CUDA_LAUNCH_CHECK();
  });
}

}  // namespace

void bias_gelu_forward(const at::Tensor& x, const at::Tensor& bias, bool tanh, const at::Tensor& out) {
  const c10::DeviceGuard guard(x.device());
  CKPT_EXT_DISPATCH_CUDA_FLOATING(x.scalar_type(), "ckpt_ext::bias_gelu", [&] {
    launch_elementwise4(x.device(), ConstPtrs<scalar_t, 1>{{x.const_data_ptr<scalar_t>()}},
                        MutPtrs<scalar_t, 1>{{out.mutable_data_ptr<scalar_t>()}}, x.numel(),
                        BiasGeluForward<scalar_t>{row_bias<scalar_t>(bias, x.size(-1)), tanh});
  });
}

void bias_gelu_backward(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& bias, bool tanh,
                        const at::Tensor& grad_x, const at::Tensor& grad_bias) {
  const c10::DeviceGuard guard(x.device());
  if (grad_bias.defined()) {
    launch_bias_gelu_columns(grad, x, bias, tanh, grad_x, grad_bias, at::Tensor());
    return;
  }
  CKPT_EXT_DISPATCH_CUDA_FLOATING(x.scalar_type(), "ckpt_ext::bias_gelu_backward", [&] {
    launch_elementwise4(x.device(),
                        ConstPtrs<scalar_t, 2>{{grad.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>()}},
                        MutPtrs<scalar_t, 1>{{grad_x.mutable_data_ptr<scalar_t>()}}, x.numel(),
                        BiasGeluBackward<scalar_t>{row_bias<scalar_t>(bias, x.size(-1)), tanh});
  });
}

void bias_dropout_add_forward(const at::Tensor& x, const at::Tensor& bias, const at::Tensor& residual,
                              const DropoutArgs& dropout, const at::Tensor& out) {
  const c10::DeviceGuard guard(x.device());
  if (x.scalar_type() != residual.scalar_type()) {  // autocast: a bfloat16 / float16 x, a float32 stream
    CKPT_EXT_DISPATCH_CUDA_LOWP(x.scalar_type(), "ckpt_ext::bias_dropout_add", [&] {
      launch_elementwise4(
          x.device(), MixedPtrs2<scalar_t, float>{x.const_data_ptr<scalar_t>(), residual.const_data_ptr<float>()},
          MutPtrs<float, 1>{{out.mutable_data_ptr<float>()}}, x.numel(),
          BiasDropoutAdd<float>{row_bias<float>(bias, x.size(-1)), dropout.philox(), dropout.enabled()});
    });
    return;
  }
  CKPT_EXT_DISPATCH_CUDA_FLOATING(x.scalar_type(), "ckpt_ext::bias_dropout_add", [&] {
    launch_elementwise4(
        x.device(),
        ConstPtrs<scalar_t, 2>{{x.const_data_ptr<scalar_t>(), residual.const_data_ptr<scalar_t>()}},
        MutPtrs<scalar_t, 1>{{out.mutable_data_ptr<scalar_t>()}}, x.numel(),
        BiasDropoutAdd<scalar_t>{row_bias<scalar_t>(bias, x.size(-1)), dropout.philox(), dropout.enabled()});
  });
}

void dropout(const at::Tensor& x, const DropoutArgs& dropout, const at::Tensor& out) {
  const c10::DeviceGuard guard(x.device());
  if (!dropout.enabled()) {  // a copy, or the one cast to the result's dtype
    at::Tensor o = out;
    o.copy_(x);
    return;
  }
  if (out.scalar_type() != x.scalar_type()) {  // autocast: a float32 x dropped into bfloat16 / float16
    CKPT_EXT_DISPATCH_CUDA_LOWP(out.scalar_type(), "ckpt_ext::dropout", [&] {
      launch_elementwise4(x.device(), ConstPtrs<float, 1>{{x.const_data_ptr<float>()}},
                          MutPtrs<scalar_t, 1>{{out.mutable_data_ptr<scalar_t>()}}, x.numel(),
                          DropoutScale{dropout.philox()});
    });
    return;
  }
  CKPT_EXT_DISPATCH_CUDA_FLOATING(x.scalar_type(), "ckpt_ext::dropout", [&] {
    launch_elementwise4(x.device(), ConstPtrs<scalar_t, 1>{{x.const_data_ptr<scalar_t>()}},
                        MutPtrs<scalar_t, 1>{{out.mutable_data_ptr<scalar_t>()}}, x.numel(),
                        DropoutScale{dropout.philox()});
  });
}

void dropout_mask(const DropoutArgs& dropout, const at::Tensor& mask) {
  const c10::DeviceGuard guard(mask.device());
  if (!dropout.enabled()) {
    mask.fill_(true);
    return;
  }
  const int64_t n = mask.numel();
  dropout_mask_kernel<<<grid_for((n + 3) / 4, kThreads), kThreads, 0, current_stream(mask.device())>>>(
      mask.mutable_data_ptr<bool>(), n, dropout.philox());
  CKPT_EXT_CUDA_LAUNCH_CHECK();
}

void swiglu_forward(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& out) {
  const c10::DeviceGuard guard(gate.device());
  CKPT_EXT_DISPATCH_CUDA_FLOATING(gate.scalar_type(), "ckpt_ext::swiglu", [&] {
    launch_elementwise4(gate.device(),
                        ConstPtrs<scalar_t, 2>{{gate.const_data_ptr<scalar_t>(), up.const_data_ptr<scalar_t>()}},
                        MutPtrs<scalar_t, 1>{{out.mutable_data_ptr<scalar_t>()}}, gate.numel(), SwigluForward{});
  });
}

void swiglu_backward(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& up,
                     const at::Tensor& grad_gate, const at::Tensor& grad_up) {
  const c10::DeviceGuard guard(gate.device());
  CKPT_EXT_DISPATCH_CUDA_FLOATING(gate.scalar_type(), "ckpt_ext::swiglu_backward", [&] {
    launch_elementwise4(
        gate.device(),
        ConstPtrs<scalar_t, 3>{
            {grad.const_data_ptr<scalar_t>(), gate.const_data_ptr<scalar_t>(), up.const_data_ptr<scalar_t>()}},
        MutPtrs<scalar_t, 2>{{grad_gate.mutable_data_ptr<scalar_t>(), grad_up.mutable_data_ptr<scalar_t>()}},
        gate.numel(), SwigluBackward{});
  });
}

void geglu_forward(const at::Tensor& gate, const at::Tensor& up, bool tanh, const at::Tensor& out) {
  const c10::DeviceGuard guard(gate.device());
  CKPT_EXT_DISPATCH_CUDA_FLOATING(gate.scalar_type(), "ckpt_ext::geglu", [&] {
    launch_elementwise4(gate.device(),
                        ConstPtrs<scalar_t, 2>{{gate.const_data_ptr<scalar_t>(), up.const_data_ptr<scalar_t>()}},
                        MutPtrs<scalar_t, 1>{{out.mutable_data_ptr<scalar_t>()}}, gate.numel(), GegluForward{tanh});
  });
}

void geglu_backward(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& up, bool tanh,
                    const at::Tensor& grad_gate, const at::Tensor& grad_up) {
  const c10::DeviceGuard guard(gate.device());
  CKPT_EXT_DISPATCH_CUDA_FLOATING(gate.scalar_type(), "ckpt_ext::geglu_backward", [&] {
    launch_elementwise4(
        gate.device(),
        ConstPtrs<scalar_t, 3>{
            {grad.const_data_ptr<scalar_t>(), gate.const_data_ptr<scalar_t>(), up.const_data_ptr<scalar_t>()}},
        MutPtrs<scalar_t, 2>{{grad_gate.mutable_data_ptr<scalar_t>(), grad_up.mutable_data_ptr<scalar_t>()}},
        gate.numel(), GegluBackward{tanh});
  });
}

void swiglu_backward_act(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& up,
                         const at::Tensor& grad_gate, const at::Tensor& grad_up, const at::Tensor& act) {
  const c10::DeviceGuard guard(gate.device());
  CKPT_EXT_DISPATCH_CUDA_FLOATING(gate.scalar_type(), "ckpt_ext::swiglu_backward_act", [&] {
    launch_elementwise4(
        gate.device(),
        ConstPtrs<scalar_t, 3>{
            {grad.const_data_ptr<scalar_t>(), gate.const_data_ptr<scalar_t>(), up.const_data_ptr<scalar_t>()}},
        MutPtrs<scalar_t, 3>{{grad_gate.mutable_data_ptr<scalar_t>(), grad_up.mutable_data_ptr<scalar_t>(),
                              act.data_ptr<scalar_t>()}},
        gate.numel(), SwigluBackwardAct{});
  });
}

void geglu_backward_act(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& up, bool tanh,
                        const at::Tensor& grad_gate, const at::Tensor& grad_up, const at::Tensor& act) {
  const c10::DeviceGuard guard(gate.device());
  CKPT_EXT_DISPATCH_CUDA_FLOATING(gate.scalar_type(), "ckpt_ext::geglu_backward_act", [&] {
    launch_elementwise4(
        gate.device(),
        ConstPtrs<scalar_t, 3>{
            {grad.const_data_ptr<scalar_t>(), gate.const_data_ptr<scalar_t>(), up.const_data_ptr<scalar_t>()}},
        MutPtrs<scalar_t, 3>{{grad_gate.mutable_data_ptr<scalar_t>(), grad_up.mutable_data_ptr<scalar_t>(),
                              act.data_ptr<scalar_t>()}},
        gate.numel(), GegluBackwardAct{tanh});
  });
}

void bias_gelu_backward_act(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& bias, bool tanh,
                            const at::Tensor& grad_x, const at::Tensor& grad_bias, const at::Tensor& act) {
  const c10::DeviceGuard guard(x.device());
  if (grad_bias.defined()) {  // bias_gelu_backward's column kernel, also storing act
    launch_bias_gelu_columns(grad, x, bias, tanh, grad_x, grad_bias, act);
    return;
  }
  CKPT_EXT_DISPATCH_CUDA_FLOATING(x.scalar_type(), "ckpt_ext::bias_gelu_backward_act", [&] {
    launch_elementwise4(x.device(),
                        ConstPtrs<scalar_t, 2>{{grad.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>()}},
                        MutPtrs<scalar_t, 2>{{grad_x.mutable_data_ptr<scalar_t>(), act.data_ptr<scalar_t>()}},
                        x.numel(), BiasGeluBackwardAct<scalar_t>{row_bias<scalar_t>(bias, x.size(-1)), tanh});
  });
}

void rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool backward,
            const at::Tensor& out) {
  const c10::DeviceGuard guard(x.device());
  RotaryShape s;
  s.heads = x.size(1);
  s.seq = x.size(2);
  s.head_dim = x.size(3);
  s.half = s.head_dim / 2;
  for (int d = 0; d < 3; ++d) {
    s.x_stride[d] = x.stride(d);
    s.out_stride[d] = out.stride(d);
  }
  s.table_batch_stride = cos.size(0) == 1 ? 0 : s.seq * s.head_dim;
  const int64_t total = x.size(0) * s.heads * s.seq * s.half;
  const cudaStream_t stream = current_stream(x.device());
  CKPT_EXT_DISPATCH_CUDA_FLOATING(x.scalar_type(), "ckpt_ext::rotary", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* cp = cos.const_data_ptr<scalar_t>();
    const scalar_t* sp = sin.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    if (backward) {
      rotary_kernel<scalar_t, true><<<grid_for(total, kThreads), kThreads, 0, stream>>>(xp, cp, sp, op, s, total);
    } else {
      rotary_kernel<scalar_t, false><<<grid_for(total, kThreads), kThreads, 0, stream>>>(xp, cp, sp, op, s, total);
    }
    CKPT_EXT_CUDA_LAUNCH_CHECK();
  });
}

}  // namespace cuda
}  // namespace kernels
}  // namespace ckpt_ext
