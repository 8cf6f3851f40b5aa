// Philox words of 4-element groups in blocks, for the CPU dropout masks (common.h: philox_words):
// scalar, 32 groups at a time with AVX2, or 64 at a time with AVX-512 where the CPU has it and ATen's
// capability is AVX512 (ATEN_CPU_CAPABILITY caps it, as it caps vec.h's kernels). Same bits as
// philox.h's per-element cursor, which the CUDA kernels and the reference use.
// Also the keep bits (common.h: pack_keep_bits / expand_keep_bits): one bit per element, stored by the
// LayerNorm forward so that its backward reads them instead of running Philox again.
#include <ATen/Version.h>

#include <algorithm>
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

// Keep bits: bit k of out[j / 8] = DropoutWords::keep(words[j]) (j = 8 * (j / 8) + k), the last byte's spare
// bits 0; and back: word j = all ones where its bit is set, else 0.
void pack_keep_bits_scalar(const uint32_t* words, int64_t n, uint32_t threshold, uint8_t* out) {
  for (int64_t j = 0; j < n; j += 8) {
    uint8_t b = 0;
    for (int64_t k = j; k < std::min<int64_t>(n, j + 8); ++k)
      b |= static_cast<uint8_t>(((words[k] >> 8) >= threshold) << (k - j));
    out[j >> 3] = b;
  }
}

void expand_keep_bits_scalar(const uint8_t* bits, int64_t n, uint32_t* words) {
  for (int64_t j = 0; j < n; ++j) words[j] = ((bits[j >> 3] >> (j & 7)) & 1) ? ~uint32_t(0) : 0u;
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

// Keep bits of 8 words at a time: (word >> 8) >= threshold, as DropoutWords::keep; the words are < 2^24
// after the shift, so the signed compare with threshold - 1 is exact (threshold >= 1 when dropout is on).
__attribute__((target("avx2"))) void pack_keep_bits_avx2(const uint32_t* words, int64_t n, uint32_t threshold,
                                                          uint8_t* out) {
  const __m256i below = _mm256_set1_epi32(static_cast<int>(threshold) - 1);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256i w = _mm256_srli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + j)), 8);
    out[j >> 3] = static_cast<uint8_t>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(w, below))));
  }
  pack_keep_bits_scalar(words + j, n - j, threshold, out + (j >> 3));
}

// Bit k of byte j/8 -> word j = all ones (kept) or 0 (dropped), 8 words per byte.
__attribute__((target("avx2"))) void expand_keep_bits_avx2(const uint8_t* bits, int64_t n, uint32_t* words) {
  const __m256i lanes = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256i b = _mm256_and_si256(_mm256_set1_epi32(bits[j >> 3]), lanes);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(words + j), _mm256_cmpeq_epi32(b, lanes));
  }
  expand_keep_bits_scalar(bits + (j >> 3), n - j, words + j);
}

enum class Isa { kScalar, kAvx2, kAvx512 };

Isa isa() {
  static const Isa i = [] {
    // ATEN_CPU_CAPABILITY=default runs the scalar loops, as it runs vec.h's portable ones (so that the
    // tests reach them on any CPU).
    const std::string cap = at::get_cpu_capability();
    if (!__builtin_cpu_supports("avx2") || cap == "DEFAULT") return Isa::kScalar;
    const bool avx512 = __builtin_cpu_supports("avx512f") && cap == "AVX512";
    return avx512 ? Isa::kAvx512 : Isa::kAvx2;
  }();
  return i;
}
#endif

}  // namespace

void pack_keep_bits(const uint32_t* words, int64_t n, uint32_t threshold, uint8_t* out) {
#ifdef CKPT_EXT_X86_AVX2
  if (isa() != Isa::kScalar) return pack_keep_bits_avx2(words, n, threshold, out);
#endif
  pack_keep_bits_scalar(words, n, threshold, out);
}

void expand_keep_bits(const uint8_t* bits, int64_t n, uint32_t* words) {
#ifdef CKPT_EXT_X86_AVX2
  if (isa() != Isa::kScalar) return expand_keep_bits_avx2(bits, n, words);
#endif
  expand_keep_bits_scalar(bits, n, words);
}

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
