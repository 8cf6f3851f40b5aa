// Multi-pass norm kernels for rows wider than the register-resident kernels take (norms_rowwise.cuh,
// hidden > rowwise::kMaxRegisterHidden): one block per row, each thread walking groups of four columns, the
// row re-read from global memory (L1/L2) per pass, and column sums added per block into a zeroed float
// buffer [blocks, hidden] that norms.cu reduces as it does the rowwise kernels' partials. Slower than the
// rowwise kernels but with no limit on hidden; the dropout mask is the same philox::Dropout::keep(row *
// hidden + col). The launchers take the rowwise kernels' argument structs: norms.cu builds them once, in
// the dtype it dispatched, for whichever kernel runs.
#pragma once

#include <cmath>

#include "common.cuh"
#include "norms_rowwise.cuh"

namespace ckpt_ext {
namespace kernels {
namespace cuda {
namespace multipass {
namespace {

// Threads per row: a power of two in [32, 512], about hidden / 4.
int row_threads(int64_t hidden) {
  int threads = kWarpSize;
  while (threads < 512 && int64_t(threads) * 4 < hidden) threads *= 2;
  return threads;
}

int forward_grid(int64_t rows) { return static_cast<int>(std::min<int64_t>(rows, int64_t(1) << 20)); }

// Backward grids are smaller: each block owns a [hidden] slice of the column-sum buffers.
int backward_grid(int64_t rows) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(rows, int64_t(multiprocessor_count()) * 4)));
}

template <typename T>
__device__ __forceinline__ float value_or_zero(const T* p, int64_t i) {
  return p != nullptr ? static_cast<float>(p[i]) : 0.f;
}

template <typename T>
__global__ void layer_norm_forward_kernel(const T* x, const T* bias, const T* residual, const T* weight,
                                          const T* ln_bias, T* out, T* pre_norm, float* mean, float* rstd,
                                          int64_t rows, int64_t hidden, float eps, philox::Dropout dropout,
                                          bool drop) {
  __shared__ float shared[kWarpSize];
  const int64_t step = 4 * static_cast<int64_t>(blockDim.x);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t base = r * hidden;
    philox::DropoutCursor cursor(dropout);
    float sum[1] = {0.f};
    for (int64_t j0 = 4 * static_cast<int64_t>(threadIdx.x); j0 < hidden; j0 += step) {
      for (int64_t j = j0; j < min(j0 + 4, hidden); ++j) {
        float v = static_cast<float>(x[base + j]) + value_or_zero(bias, j);
        if (drop) v = cursor.keep(static_cast<uint64_t>(base + j)) ? v * dropout.scale : 0.f;
        v += value_or_zero(residual, base + j);
        const T stored = static_cast<T>(v);
        pre_norm[base + j] = stored;
        sum[0] += static_cast<float>(stored);  // normalise exactly what is stored (and what backward reads)
      }
    }
    block_sum(sum, shared);
    const float mu = sum[0] / static_cast<float>(hidden);
    float var[1] = {0.f};
    for (int64_t j0 = 4 * static_cast<int64_t>(threadIdx.x); j0 < hidden; j0 += step) {
      for (int64_t j = j0; j < min(j0 + 4, hidden); ++j) {
        const float d = static_cast<float>(pre_norm[base + j]) - mu;
        var[0] += d * d;
      }
    }
    block_sum(var, shared);
    const float rs = 1.f / sqrtf(var[0] / static_cast<float>(hidden) + eps);
    if (threadIdx.x == 0) {
      mean[r] = mu;
      rstd[r] = rs;
    }
    for (int64_t j0 = 4 * static_cast<int64_t>(threadIdx.x); j0 < hidden; j0 += step) {
      for (int64_t j = j0; j < min(j0 + 4, hidden); ++j) {
        const float y = (static_cast<float>(pre_norm[base + j]) - mu) * rs * static_cast<float>(weight[j]) +
                        value_or_zero(ln_bias, j);
        out[base + j] = static_cast<T>(y);
      }
    }
  }
}

template <typename T>
__global__ void layer_norm_backward_kernel(const T* grad_out, const T* grad_pre_norm, const T* pre_norm,
                                           const T* weight, const float* mean, const float* rstd, T* grad_pre,
                                           T* grad_x, float* partial_w, float* partial_b, float* partial_x,
                                           int64_t rows, int64_t hidden, philox::Dropout dropout, bool drop) {
  __shared__ float shared[2 * kWarpSize];
  const int64_t step = 4 * static_cast<int64_t>(blockDim.x);
  float* pw = partial_w + blockIdx.x * hidden;  // this block's column sums; column j is only ever
  float* pb = partial_b + blockIdx.x * hidden;  // touched by the thread that owns j
  float* px = partial_x != nullptr ? partial_x + blockIdx.x * hidden : nullptr;  // grad_x's (the dense bias's)
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t base = r * hidden;
    const float mu = mean[r], rs = rstd[r];
    float sums[2] = {0.f, 0.f};  // sum(dy), sum(dy * xhat) with dy = grad_out * weight
    for (int64_t j0 = 4 * static_cast<int64_t>(threadIdx.x); j0 < hidden; j0 += step) {
      for (int64_t j = j0; j < min(j0 + 4, hidden); ++j) {
        const float g = static_cast<float>(grad_out[base + j]);
        const float xhat = (static_cast<float>(pre_norm[base + j]) - mu) * rs;
        const float dy = g * static_cast<float>(weight[j]);
        sums[0] += dy;
        sums[1] += dy * xhat;
        pw[j] += g * xhat;
        pb[j] += g;
      }
    }
    block_sum(sums, shared);
    const float c_mean = sums[0] / static_cast<float>(hidden), c_xhat = sums[1] / static_cast<float>(hidden);
    philox::DropoutCursor cursor(dropout);
    for (int64_t j0 = 4 * static_cast<int64_t>(threadIdx.x); j0 < hidden; j0 += step) {
      for (int64_t j = j0; j < min(j0 + 4, hidden); ++j) {
        const float xhat = (static_cast<float>(pre_norm[base + j]) - mu) * rs;
        const float dy = static_cast<float>(grad_out[base + j]) * static_cast<float>(weight[j]);
        const float d = rs * (dy - c_mean - xhat * c_xhat) + value_or_zero(grad_pre_norm, base + j);
        grad_pre[base + j] = static_cast<T>(d);
        if (grad_x != nullptr) {
          const bool keep = !drop || cursor.keep(static_cast<uint64_t>(base + j));
          const T stored = static_cast<T>(keep ? (drop ? d * dropout.scale : d) : 0.f);
          grad_x[base + j] = stored;
          if (px != nullptr) px[j] += static_cast<float>(stored);
        }
      }
    }
  }
}

template <typename T>
__global__ void rms_norm_forward_kernel(const T* x, const T* residual, const T* weight, T* out, T* sum,
                                        float* rstd, int64_t rows, int64_t hidden, float eps) {
  __shared__ float shared[kWarpSize];
  const int64_t step = 4 * static_cast<int64_t>(blockDim.x);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t base = r * hidden;
    float sum_sq[1] = {0.f};
    for (int64_t j0 = 4 * static_cast<int64_t>(threadIdx.x); j0 < hidden; j0 += step) {
      for (int64_t j = j0; j < min(j0 + 4, hidden); ++j) {
        const T stored = static_cast<T>(static_cast<float>(x[base + j]) + value_or_zero(residual, base + j));
        sum[base + j] = stored;
        sum_sq[0] += static_cast<float>(stored) * static_cast<float>(stored);
      }
    }
    block_sum(sum_sq, shared);
    const float rs = 1.f / sqrtf(sum_sq[0] / static_cast<float>(hidden) + eps);
    if (threadIdx.x == 0) rstd[r] = rs;
    for (int64_t j0 = 4 * static_cast<int64_t>(threadIdx.x); j0 < hidden; j0 += step) {
      for (int64_t j = j0; j < min(j0 + 4, hidden); ++j) {
        // LlamaRMSNorm: normalise in float, cast back to the input dtype, then multiply by the weight.
        const T normed = static_cast<T>(static_cast<float>(sum[base + j]) * rs);
        out[base + j] = static_cast<T>(static_cast<float>(weight[j]) * static_cast<float>(normed));
      }
    }
  }
}

template <typename T>
__global__ void rms_norm_backward_kernel(const T* grad_out, const T* grad_sum, const T* sum, const T* weight,
                                         const float* rstd, T* grad_input, float* partial_w, int64_t rows,
                                         int64_t hidden) {
  __shared__ float shared[kWarpSize];
  const int64_t step = 4 * static_cast<int64_t>(blockDim.x);
  float* pw = partial_w + blockIdx.x * hidden;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t base = r * hidden;
    const float rs = rstd[r];
    float dn_n[1] = {0.f};  // sum(dn * n) with dn = grad_out * weight, n = sum * rstd
    for (int64_t j0 = 4 * static_cast<int64_t>(threadIdx.x); j0 < hidden; j0 += step) {
      for (int64_t j = j0; j < min(j0 + 4, hidden); ++j) {
        const float g = static_cast<float>(grad_out[base + j]);
        const float n = static_cast<float>(sum[base + j]) * rs;
        dn_n[0] += g * static_cast<float>(weight[j]) * n;
        pw[j] += g * static_cast<float>(static_cast<T>(n));  // out = weight * to_dtype(n)
      }
    }
    block_sum(dn_n, shared);
    const float c_n = dn_n[0] / static_cast<float>(hidden);
    for (int64_t j0 = 4 * static_cast<int64_t>(threadIdx.x); j0 < hidden; j0 += step) {
      for (int64_t j = j0; j < min(j0 + 4, hidden); ++j) {
        const float n = static_cast<float>(sum[base + j]) * rs;
        const float dn = static_cast<float>(grad_out[base + j]) * static_cast<float>(weight[j]);
        grad_input[base + j] = static_cast<T>(rs * (dn - n * c_n) + value_or_zero(grad_sum, base + j));
      }
    }
  }
}

}  // namespace

template <typename T>
void layer_norm_forward(const rowwise::LayerNormForwardArgs<T>& a, cudaStream_t stream) {
  layer_norm_forward_kernel<T><<<forward_grid(a.rows), row_threads(a.hidden), 0, stream>>>(
      a.x, a.bias, a.residual, a.weight, a.ln_bias, a.out, a.pre_norm, a.mean, a.rstd, a.rows, a.hidden, a.eps,
      a.dropout, a.drop);
  CKPT_EXT_CUDA_LAUNCH_CHECK();
}

// a.partial_w / a.partial_b (/ a.partial_x when not null): zero-filled [grid, hidden] (grid = backward_grid(rows)).
template <typename T>
void layer_norm_backward(const rowwise::LayerNormBackwardArgs<T>& a, int grid, cudaStream_t stream) {
  layer_norm_backward_kernel<T><<<grid, row_threads(a.hidden), 0, stream>>>(
      a.grad_out, a.grad_pre_norm, a.pre_norm, a.weight, a.mean, a.rstd, a.grad_pre, a.grad_x, a.partial_w,
      a.partial_b, a.partial_x, a.rows, a.hidden, a.dropout, a.drop);
  CKPT_EXT_CUDA_LAUNCH_CHECK();
}

template <typename T>
void rms_norm_forward(const rowwise::RmsNormForwardArgs<T>& a, cudaStream_t stream) {
  rms_norm_forward_kernel<T><<<forward_grid(a.rows), row_threads(a.hidden), 0, stream>>>(
      a.x, a.residual, a.weight, a.out, a.sum, a.rstd, a.rows, a.hidden, a.eps);
  CKPT_EXT_CUDA_LAUNCH_CHECK();
}

// a.partial_w: zero-filled [grid, hidden] (grid = backward_grid(rows)).
template <typename T>
void rms_norm_backward(const rowwise::RmsNormBackwardArgs<T>& a, int grid, cudaStream_t stream) {
  rms_norm_backward_kernel<T><<<grid, row_threads(a.hidden), 0, stream>>>(
      a.grad_out, a.grad_sum, a.sum, a.weight, a.rstd, a.grad_input, a.partial_w, a.rows, a.hidden);
  CKPT_EXT_CUDA_LAUNCH_CHECK();
}

}  // namespace multipass
}  // namespace cuda
}  // namespace kernels
}  // namespace ckpt_ext
