// Philox words of 4-element groups in blocks, for the CPU dropout masks (common.h: philox_words):
// scalar, or 32 groups at a time with AVX2 where the CPU has it. Same bits as philox.h's per-element
// cursor, which the CUDA kernels and the reference use.
#include <cstdint>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define CKPT_EXT_X86_AVX2 1
#endif

#include "common.h"

namespace ckpt_ext {
namespace kernels {
namespace cpu {
namespace {

void philox_words_scalar(const philox::Dropout& d, uint64_t g0, int64_t n, uint32_t* out) {
  for (int64_t j = 0; j < n; ++j) {
    const philox::Uint4 w = philox::dropout_bits(d.seed, d.offset, g0 + static_cast<uint64_t>(j));
    out[4 * j] = w.x;
    out[4 * j + 1] = w.y;
    out[4 * j + 2] = w.z;
    out[4 * j + 3] = w.w;
  }
}

#ifdef CKPT_EXT_X86_AVX2
// The 32x32->64 products of the even and odd 32-bit lanes (vpmuludq), recombined into low and high halves.
__attribute__((target("avx2"), always_inline)) inline __m256i mulhilo_avx2(__m256i a, __m256i m, __m256i* hi) {
  const __m256i even = _mm256_mul_epu32(a, m);
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);
  *hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
  return _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
}

// Philox4x32-10 of 32 consecutive groups per step: four independent 8-lane streams, so the rounds'
// multiply latencies overlap; the four words of each group are then transposed into place.
__attribute__((target("avx2"))) void philox_words_avx2(const philox::Dropout& d, uint64_t g0, int64_t n,
                                                        uint32_t* out) {
  constexpr int U = 4;
  const __m256i m0 = _mm256_set1_epi32(static_cast<int>(philox::kMul0));
  const __m256i m1 = _mm256_set1_epi32(static_cast<int>(philox::kMul1));
  const __m256i off_lo = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(d.offset)));
  const __m256i off_hi = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(d.offset >> 32)));
  int64_t j = 0;
  for (; j + 8 * U <= n; j += 8 * U) {
    __m256i x[U], y[U], z[U], w[U];
    for (int u = 0; u < U; ++u) {
      alignas(32) uint32_t lo[8], hi[8];
      for (int l = 0; l < 8; ++l) {
        const uint64_t g = g0 + static_cast<uint64_t>(j + 8 * u + l);
        lo[l] = static_cast<uint32_t>(g);
        hi[l] = static_cast<uint32_t>(g >> 32);
      }
      x[u] = _mm256_load_si256(reinterpret_cast<const __m256i*>(lo));
      y[u] = _mm256_load_si256(reinterpret_cast<const __m256i*>(hi));
      z[u] = off_lo;
      w[u] = off_hi;
    }
    uint32_t k0 = static_cast<uint32_t>(d.seed), k1 = static_cast<uint32_t>(d.seed >> 32);
    for (int r = 0; r < 10; ++r) {
      const __m256i key0 = _mm256_set1_epi32(static_cast<int>(k0)), key1 = _mm256_set1_epi32(static_cast<int>(k1));
      for (int u = 0; u < U; ++u) {
        __m256i hi0, hi1;
        const __m256i lo0 = mulhilo_avx2(x[u], m0, &hi0);
        const __m256i lo1 = mulhilo_avx2(z[u], m1, &hi1);
        x[u] = _mm256_xor_si256(_mm256_xor_si256(hi1, y[u]), key0);
        z[u] = _mm256_xor_si256(_mm256_xor_si256(hi0, w[u]), key1);
        y[u] = lo1;
        w[u] = lo0;
      }
      k0 += philox::kWeyl0;
      k1 += philox::kWeyl1;
    }
    for (int u = 0; u < U; ++u) {
      // (x, y, z, w) of lanes 0..7 -> groups 0..7 of four consecutive words.
      const __m256i t0 = _mm256_unpacklo_epi32(x[u], y[u]), t1 = _mm256_unpackhi_epi32(x[u], y[u]);
      const __m256i t2 = _mm256_unpacklo_epi32(z[u], w[u]), t3 = _mm256_unpackhi_epi32(z[u], w[u]);
      const __m256i a0 = _mm256_unpacklo_epi64(t0, t2), a1 = _mm256_unpackhi_epi64(t0, t2);  // groups 0,1 | 4,5
      const __m256i a2 = _mm256_unpacklo_epi64(t1, t3), a3 = _mm256_unpackhi_epi64(t1, t3);  // groups 2,3 | 6,7
      uint32_t* o = out + 4 * (j + 8 * u);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm256_permute2x128_si256(a0, a1, 0x20));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 8), _mm256_permute2x128_si256(a2, a3, 0x20));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16), _mm256_permute2x128_si256(a0, a1, 0x31));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 24), _mm256_permute2x128_si256(a2, a3, 0x31));
    }
  }
  philox_words_scalar(d, g0 + static_cast<uint64_t>(j), n - j, out + 4 * j);
}

bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}
#endif

}  // namespace

void philox_words(const philox::Dropout& d, uint64_t g0, int64_t n, uint32_t* out) {
#ifdef CKPT_EXT_X86_AVX2
  if (cpu_has_avx2()) return philox_words_avx2(d, g0, n, out);
#endif
  philox_words_scalar(d, g0, n, out);
}

}  // namespace cpu
}  // namespace kernels
}  // namespace ckpt_ext
