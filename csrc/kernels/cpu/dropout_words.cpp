// Philox words of 4-element groups in blocks, for the CPU dropout masks (common.h: philox_words):
// scalar, 32 groups at a time with AVX2, or 64 at a time with AVX-512 where the CPU has it and ATen's
// capability is AVX512 (ATEN_CPU_CAPABILITY=avx2 caps it, as it caps vec.h's kernels). Same bits as
// philox.h's per-element cursor, which the CUDA kernels and the reference use.
#include <ATen/Version.h>

#include <cstdint>
#include <string>

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

// The same rounds on 16 lanes: four independent 16-lane streams, 64 groups per step.
__attribute__((target("avx512f"), always_inline)) inline __m512i mulhilo_avx512(__m512i a, __m512i m, __m512i* hi) {
  const __m512i even = _mm512_mul_epu32(a, m);
  const __m512i odd = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), m);
  *hi = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 32), odd);
  return _mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64(odd, 32));
}

__attribute__((target("avx512f"))) void philox_words_avx512(const philox::Dropout& d, uint64_t g0, int64_t n,
                                                            uint32_t* out) {
  constexpr int U = 4;
  const __m512i m0 = _mm512_set1_epi32(static_cast<int>(philox::kMul0));
  const __m512i m1 = _mm512_set1_epi32(static_cast<int>(philox::kMul1));
  const __m512i off_lo = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(d.offset)));
  const __m512i off_hi = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(d.offset >> 32)));
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  int64_t j = 0;
  for (; j + 16 * U <= n; j += 16 * U) {
    __m512i x[U], y[U], z[U], w[U];
    const uint64_t g = g0 + static_cast<uint64_t>(j);
    // the step's 64 counters g .. g + 63; their high words differ only where the low word wraps
    const bool wraps = static_cast<uint32_t>(g) > UINT32_MAX - (16 * U - 1);
    for (int u = 0; u < U; ++u) {
      if (!wraps) {
        x[u] = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(g) + 16 * u)), iota);
        y[u] = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(g >> 32)));
      } else {
        alignas(64) uint32_t lo[16], hi[16];
        for (int l = 0; l < 16; ++l) {
          const uint64_t gl = g + static_cast<uint64_t>(16 * u + l);
          lo[l] = static_cast<uint32_t>(gl);
          hi[l] = static_cast<uint32_t>(gl >> 32);
        }
        x[u] = _mm512_load_si512(lo);
        y[u] = _mm512_load_si512(hi);
      }
      z[u] = off_lo;
      w[u] = off_hi;
    }
    uint32_t k0 = static_cast<uint32_t>(d.seed), k1 = static_cast<uint32_t>(d.seed >> 32);
    for (int r = 0; r < 10; ++r) {
      const __m512i key0 = _mm512_set1_epi32(static_cast<int>(k0)), key1 = _mm512_set1_epi32(static_cast<int>(k1));
      for (int u = 0; u < U; ++u) {
        __m512i hi0, hi1;
        const __m512i lo0 = mulhilo_avx512(x[u], m0, &hi0);
        const __m512i lo1 = mulhilo_avx512(z[u], m1, &hi1);
        x[u] = _mm512_ternarylogic_epi32(hi1, y[u], key0, 0x96);  // hi1 ^ y ^ key0
        z[u] = _mm512_ternarylogic_epi32(hi0, w[u], key1, 0x96);
        y[u] = lo1;
        w[u] = lo0;
      }
      k0 += philox::kWeyl0;
      k1 += philox::kWeyl1;
    }
    for (int u = 0; u < U; ++u) {
      // Within each 128-bit lane k: a0..a3 = groups 4k, 4k+1, 4k+2, 4k+3 as (x, y, z, w).
      const __m512i t0 = _mm512_unpacklo_epi32(x[u], y[u]), t1 = _mm512_unpackhi_epi32(x[u], y[u]);
      const __m512i t2 = _mm512_unpacklo_epi32(z[u], w[u]), t3 = _mm512_unpackhi_epi32(z[u], w[u]);
      const __m512i a0 = _mm512_unpacklo_epi64(t0, t2), a1 = _mm512_unpackhi_epi64(t0, t2);
      const __m512i a2 = _mm512_unpacklo_epi64(t1, t3), a3 = _mm512_unpackhi_epi64(t1, t3);
      const __m512i b0 = _mm512_shuffle_i32x4(a0, a1, 0x44), b1 = _mm512_shuffle_i32x4(a2, a3, 0x44);
      const __m512i b2 = _mm512_shuffle_i32x4(a0, a1, 0xEE), b3 = _mm512_shuffle_i32x4(a2, a3, 0xEE);
      uint32_t* o = out + 4 * (j + 16 * u);
      _mm512_storeu_si512(o, _mm512_shuffle_i32x4(b0, b1, 0x88));       // groups 0..3
      _mm512_storeu_si512(o + 16, _mm512_shuffle_i32x4(b0, b1, 0xDD));  // groups 4..7
      _mm512_storeu_si512(o + 32, _mm512_shuffle_i32x4(b2, b3, 0x88));  // groups 8..11
      _mm512_storeu_si512(o + 48, _mm512_shuffle_i32x4(b2, b3, 0xDD));  // groups 12..15
    }
  }
  philox_words_avx2(d, g0 + static_cast<uint64_t>(j), n - j, out + 4 * j);
}

enum class Isa { kScalar, kAvx2, kAvx512 };

Isa isa() {
  static const Isa i = [] {
    if (!__builtin_cpu_supports("avx2")) return Isa::kScalar;
    const bool avx512 = __builtin_cpu_supports("avx512f") && at::get_cpu_capability() == "AVX512";
    return avx512 ? Isa::kAvx512 : Isa::kAvx2;
  }();
  return i;
}
#endif

}  // namespace

void philox_words(const philox::Dropout& d, uint64_t g0, int64_t n, uint32_t* out) {
#ifdef CKPT_EXT_X86_AVX2
  switch (isa()) {
    case Isa::kAvx512:
      return philox_words_avx512(d, g0, n, out);
    case Isa::kAvx2:
      return philox_words_avx2(d, g0, n, out);
    case Isa::kScalar:
      break;
  }
#endif
  philox_words_scalar(d, g0, n, out);
}

}  // namespace cpu
}  // namespace kernels
}  // namespace ckpt_ext
