// CKPT_HOST_DEVICE: a function compiled for the host and, under nvcc, for the device too -- the
// pattern of the headers whose math the CPU and CUDA kernels share (philox.h, math.h).
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__)
#define CKPT_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define CKPT_HOST_DEVICE inline
#endif
