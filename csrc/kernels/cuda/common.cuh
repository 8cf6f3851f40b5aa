// Shared pieces of the CUDA kernels: dtype dispatch, float reductions, 4-wide loads, launch shapes.
// Only device-generic c10 headers and the CUDA runtime: neither ATen/cuda (cuBLAS/cuSPARSE headers) nor
// c10/cuda (a generated header absent from CPU wheels), so tools/compile_cuda.py can compile the sources
// with a bare nvcc against the CPU torch of CI. The current stream and the device guard come through
// c10's device-generic interfaces, which libc10_cuda implements at run time.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

#include "../kernels.h"

// CUDA kernels take float32, float16 and bfloat16 (ops/checks.h rejects the rest with a clear message).
#define CKPT_EXT_DISPATCH_CUDA_FLOATING(TYPE, NAME, ...)      \
  AT_DISPATCH_SWITCH(TYPE, NAME,                               \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)  \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

namespace ckpt_ext {
namespace kernels {
namespace cuda {

constexpr int kWarpSize = 32;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sums N floats over the block; every thread gets the totals. blockDim.x must be a multiple of 32 (at most
// 1024); `shared` holds at least 32 * N floats. Safe to call repeatedly with the same `shared`.
template <int N>
__device__ __forceinline__ void block_sum(float (&v)[N], float* shared) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize, warps = blockDim.x / kWarpSize;
#pragma unroll
  for (int k = 0; k < N; ++k) v[k] = warp_sum(v[k]);
  __syncthreads();  // the previous call's readers are done with `shared`
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < N; ++k) shared[k * kWarpSize + warp] = v[k];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < N; ++k) v[k] = warp_sum(lane < warps ? shared[k * kWarpSize + lane] : 0.f);
}

// Four consecutive elements as one aligned access (16 bytes for float, 8 for half/bfloat16).
template <typename T>
struct alignas(4 * sizeof(T)) Pack4 {
  T v[4];
};

// Loads elements base .. base+count-1 (count <= 4) as float; `vec` says the pointer is Pack4-aligned and
// base is a multiple of 4, so a full group is one vector load.
template <typename T>
__device__ __forceinline__ void load4(const T* p, int64_t base, int count, bool vec, float (&out)[4]) {
  if (vec && count == 4) {
    const Pack4<T> pk = *reinterpret_cast<const Pack4<T>*>(p + base);
#pragma unroll
    for (int k = 0; k < 4; ++k) out[k] = static_cast<float>(pk.v[k]);
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) out[k] = k < count ? static_cast<float>(p[base + k]) : 0.f;
  }
}

template <typename T>
__device__ __forceinline__ void store4(T* p, int64_t base, int count, bool vec, const float (&in)[4]) {
  if (vec && count == 4) {
    Pack4<T> pk;
#pragma unroll
    for (int k = 0; k < 4; ++k) pk.v[k] = static_cast<T>(in[k]);
    *reinterpret_cast<Pack4<T>*>(p + base) = pk;
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (k < count) p[base + k] = static_cast<T>(in[k]);
  }
}

template <typename T>
inline bool pack4_aligned(const void* p) {
  return p == nullptr || reinterpret_cast<uintptr_t>(p) % sizeof(Pack4<T>) == 0;
}

#define CKPT_EXT_CUDA_CHECK(expr)                                                                     \
  do {                                                                                                \
    const cudaError_t ckpt_ext_err = (expr);                                                          \
    TORCH_CHECK(ckpt_ext_err == cudaSuccess, "ckpt_ext CUDA error: ", cudaGetErrorString(ckpt_ext_err), \
                " (", #expr, ")");                                                                    \
  } while (0)

// After every kernel launch (launch-configuration errors surface here, execution errors later).
#define CKPT_EXT_CUDA_LAUNCH_CHECK() CKPT_EXT_CUDA_CHECK(cudaGetLastError())

inline int multiprocessor_count() {
  int device = 0, count = 0;
  CKPT_EXT_CUDA_CHECK(cudaGetDevice(&device));
  CKPT_EXT_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

// PyTorch's current CUDA stream on `device` (what at::cuda::getCurrentCUDAStream returns).
inline cudaStream_t current_stream(c10::Device device) {
  const c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
  return static_cast<cudaStream_t>(impl.getStream(device).native_handle());
}

// Blocks of `threads` threads of `kernel` that one SM holds at once (its registers and shared memory decide).
// A grid-stride grid of more blocks than that runs the rest as a second, partly empty wave: each block has an
// equal share, so the kernel takes two block-times where one and a fraction would do (256-thread blocks
// above 32 registers a thread: 8 per SM do not fit).
template <typename Kernel>
int resident_blocks_per_sm(Kernel kernel, int threads) {
  int blocks = 0;
  CKPT_EXT_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, 0));
  return std::max(blocks, 1);
}

// Grid for a grid-stride loop over `items` work items with `threads` threads per block.
inline int grid_for(int64_t items, int threads, int blocks_per_sm = 8) {
  const int64_t needed = (items + threads - 1) / threads;
  const int64_t most = int64_t(multiprocessor_count()) * blocks_per_sm;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(needed, most)));
}

template <typename T>
const T* ptr_or_null(const at::Tensor& t) {
  return t.defined() ? t.const_data_ptr<T>() : nullptr;
}

}  // namespace cuda
}  // namespace kernels
}  // namespace ckpt_ext
