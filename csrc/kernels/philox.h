// Counter-based Philox4x32-10 and the dropout keep-mask built on it. One header for host and device
// code, so that the CPU and CUDA kernels draw bit-identical masks for the same (seed, offset).
//
// Mask of element i of a tensor (row-major logical index) for (seed, offset):
//   bits = philox4x32_10(key = {lo32(seed), hi32(seed)},
//                        counter = {lo32(i / 4), hi32(i / 4), lo32(offset), hi32(offset)})[i % 4]
//   u    = (bits >> 8) * 2^-24                       (exact float in [0, 1))
//   keep = u >= float(p),   kept values are scaled by 1 / (1 - p)
// The mask of element i depends only on (seed, offset, i): never on numel, layout or launch shape.
// Masks are regenerated in backward (flash-attention's discipline), with one exception on CPU: the LayerNorm
// with dropout stores its mask as one bit per element (cpu/common.h: pack_keep_bits), because there Philox
// costs what the rest of that backward costs.
#pragma once

#include <cstdint>

#include "host_device.h"

namespace ckpt_ext {
namespace philox {

struct Uint4 {
  uint32_t x, y, z, w;
};

constexpr uint32_t kMul0 = 0xD2511F53u;
constexpr uint32_t kMul1 = 0xCD9E8D57u;
constexpr uint32_t kWeyl0 = 0x9E3779B9u;
constexpr uint32_t kWeyl1 = 0xBB67AE85u;

CKPT_HOST_DEVICE uint32_t mulhilo(uint32_t a, uint32_t b, uint32_t* hi) {
#if defined(__CUDA_ARCH__)
  *hi = __umulhi(a, b);
  return a * b;
#else
  const uint64_t prod = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(prod >> 32);
  return static_cast<uint32_t>(prod);
#endif
}

CKPT_HOST_DEVICE Uint4 round(Uint4 c, uint32_t k0, uint32_t k1) {
  uint32_t hi0, hi1;
  const uint32_t lo0 = mulhilo(kMul0, c.x, &hi0);
  const uint32_t lo1 = mulhilo(kMul1, c.z, &hi1);
  return Uint4{hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0};
}

// Philox4x32 with 10 rounds (Salmon et al., SC'11); same stream as Random123 and at::Philox4_32.
CKPT_HOST_DEVICE Uint4 philox4x32_10(Uint4 counter, uint32_t k0, uint32_t k1) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int r = 0; r < 9; ++r) {
    counter = round(counter, k0, k1);
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return round(counter, k0, k1);
}

// 24 random bits -> float in [0, 1), exact, so host and device compare the same number with p.
CKPT_HOST_DEVICE float bits_to_uniform(uint32_t bits) {
  return static_cast<float>(bits >> 8) * (1.0f / 16777216.0f);
}

// The four 32-bit words for elements 4*group .. 4*group+3.
CKPT_HOST_DEVICE Uint4 dropout_bits(uint64_t seed, uint64_t offset, uint64_t group) {
  const Uint4 counter{static_cast<uint32_t>(group), static_cast<uint32_t>(group >> 32),
                      static_cast<uint32_t>(offset), static_cast<uint32_t>(offset >> 32)};
  return philox4x32_10(counter, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

// Dropout parameters as the kernels see them. p is compared in float; scale is 1/(1-p), 0 when p == 1.
struct Dropout {
  uint64_t seed;
  uint64_t offset;
  float p;
  float scale;

  // Keep flags of elements 4*group .. 4*group+3: one Philox call for four elements. CUDA threads that
  // own four consecutive elements (4-aligned) use this directly.
  CKPT_HOST_DEVICE void keep4(uint64_t group, bool keep[4]) const {
    const Uint4 b = dropout_bits(seed, offset, group);
    keep[0] = bits_to_uniform(b.x) >= p;
    keep[1] = bits_to_uniform(b.y) >= p;
    keep[2] = bits_to_uniform(b.z) >= p;
    keep[3] = bits_to_uniform(b.w) >= p;
  }

  // Keep flag of one element (one Philox call; prefer DropoutCursor when walking consecutive elements).
  CKPT_HOST_DEVICE bool keep(uint64_t i) const {
    const Uint4 b = dropout_bits(seed, offset, i >> 2);
    const uint32_t words[4] = {b.x, b.y, b.z, b.w};
    return bits_to_uniform(words[i & 3]) >= p;
  }
};

// Walks elements in increasing order and reuses the Philox output of the current group of four, so a
// row-wise kernel pays one Philox call per four elements whatever the row length.
struct DropoutCursor {
  Dropout d;
  uint64_t group = ~uint64_t(0);
  bool flags[4] = {false, false, false, false};

  CKPT_HOST_DEVICE explicit DropoutCursor(const Dropout& dropout) : d(dropout) {}

  CKPT_HOST_DEVICE bool keep(uint64_t i) {
    const uint64_t g = i >> 2;
    if (g != group) {
      group = g;
      d.keep4(g, flags);
    }
    return flags[i & 3];
  }
};

}  // namespace philox
}  // namespace ckpt_ext
