#pragma once
// Stochastic rounding to bfloat16 with AVX-512 (32 values a step) and AVX2 (16): stochastic_rounding.h's draws and
// rounding, so the same bits. Used by the codec's bf16 encode (cpu_state_codec.cpp) and by the bf16 Adam step that
// updates and rounds in one pass (cpu_optimizer_kernels.cpp); each caller has AMP_AVX512 or AMP_AVX2 on its function.

#include "optim/simd_targets.h"

#ifdef AMP_HAVE_SIMD_LOOPS
#include <immintrin.h>

#include <cstdint>

namespace amp::detail::cpu::avx512 {

/// splitmix64's draws n, n + 1, ... of the stream `seed` (random_bits), 8 at a time. The 8 draws' words side by side
/// are 32 values' 16-bit randoms in order (value 4k + j takes bits 16j of draw k: little-endian), so no shuffle pairs
/// them with their values.
class SplitMix8 {
 public:
  AMP_AVX512 SplitMix8(uint64_t seed, uint64_t first_draw)
      // z = seed + (n + 1) * kGolden for draws n = first_draw .. first_draw + 7
      : z_(_mm512_add_epi64(_mm512_set1_epi64(static_cast<int64_t>(seed)),
                            _mm512_mullo_epi64(_mm512_add_epi64(_mm512_set1_epi64(static_cast<int64_t>(first_draw + 1)),
                                                                _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7)),
                                               _mm512_set1_epi64(static_cast<int64_t>(kGolden))))) {}

  /// The next 8 draws.
  AMP_AVX512 __m512i next() {
    const __m512i mul1 = _mm512_set1_epi64(static_cast<int64_t>(0xbf58476d1ce4e5b9ULL));
    const __m512i mul2 = _mm512_set1_epi64(static_cast<int64_t>(0x94d049bb133111ebULL));
    __m512i z = _mm512_mullo_epi64(_mm512_xor_si512(z_, _mm512_srli_epi64(z_, 30)), mul1);
    z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)), mul2);
    z_ = _mm512_add_epi64(z_, _mm512_set1_epi64(static_cast<int64_t>(8 * kGolden)));
    return _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
  }

 private:
  static constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ULL;
  __m512i z_;
};

/// The random words of a moment's next 32 values, its value g = first + i taking word g & 3 of draw g >> 2: where
/// first is not a multiple of 4 they start 1-3 words into 16 draws.
class MomentWords {
 public:
  AMP_AVX512 MomentWords(uint64_t seed, uint64_t first) : draws_(seed, first >> 2), skip_(static_cast<int>(first & 3)) {
    if (skip_ != 0) {
      alignas(64) int16_t index[32];
      for (int j = 0; j < 32; ++j) index[j] = static_cast<int16_t>(skip_ + j);
      index_ = _mm512_load_si512(index);
      current_ = draws_.next();
    }
  }
  /// The random words of the next 32 values.
  AMP_AVX512 __m512i next() {
    if (skip_ == 0) return draws_.next();
    const __m512i following = draws_.next();
    const __m512i words = _mm512_permutex2var_epi16(current_, index_, following);
    current_ = following;
    return words;
  }

 private:
  SplitMix8 draws_;
  int skip_;
  __m512i index_ = _mm512_setzero_si512(), current_ = _mm512_setzero_si512();
};

/// round_stochastically for 16 floats, each with its 16 random bits.
AMP_AVX512 inline __m256i round16_stochastically(__m512 x, __m256i random16) {
  const __m512i exponent = _mm512_set1_epi32(0x7f800000), mantissa = _mm512_set1_epi32(0x007fffff);
  const __m512i random = _mm512_cvtepu16_epi32(random16);
  const __m512i b = _mm512_castps_si512(x);
  const __mmask16 special = _mm512_cmpeq_epi32_mask(_mm512_and_si512(b, exponent), exponent);
  const __mmask16 nan = _mm512_mask_test_epi32_mask(special, b, mantissa);
  const __m512i rounded = _mm512_srli_epi32(_mm512_mask_add_epi32(b, static_cast<__mmask16>(~special), b, random), 16);
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0)));
}

/// The halves of 32 random words: values 0-15's and 16-31's.
AMP_AVX512 inline __m256i low_words(__m512i words) { return _mm512_castsi512_si256(words); }
AMP_AVX512 inline __m256i high_words(__m512i words) { return _mm512_extracti64x4_epi64(words, 1); }

}  // namespace amp::detail::cpu::avx512

namespace amp::detail::cpu::avx2 {

/// SplitMix8's draws 4 at a time: 16 values' random words in order. AVX2 has no 64-bit multiply; lo(a * b) is
/// lo(a) * lo(b) + ((hi(a) * lo(b) + lo(a) * hi(b)) << 32), exact modulo 2^64 as random_bits' products.
class SplitMix4 {
 public:
  AMP_AVX2 SplitMix4(uint64_t seed, uint64_t first_draw)
      : z_(_mm256_setr_epi64x(static_cast<int64_t>(seed + (first_draw + 1) * kGolden),
                              static_cast<int64_t>(seed + (first_draw + 2) * kGolden),
                              static_cast<int64_t>(seed + (first_draw + 3) * kGolden),
                              static_cast<int64_t>(seed + (first_draw + 4) * kGolden))) {}

  /// The next 4 draws.
  AMP_AVX2 __m256i next() {
    __m256i z = times(_mm256_xor_si256(z_, _mm256_srli_epi64(z_, 30)), 0xbf58476d1ce4e5b9ULL);
    z = times(_mm256_xor_si256(z, _mm256_srli_epi64(z, 27)), 0x94d049bb133111ebULL);
    z_ = _mm256_add_epi64(z_, _mm256_set1_epi64x(static_cast<int64_t>(4 * kGolden)));
    return _mm256_xor_si256(z, _mm256_srli_epi64(z, 31));
  }

 private:
  AMP_AVX2 static __m256i times(__m256i a, uint64_t b) {
    const __m256i b_lo = _mm256_set1_epi64x(static_cast<int64_t>(b & 0xffffffffu));
    const __m256i b_hi = _mm256_set1_epi64x(static_cast<int64_t>(b >> 32));
    const __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a, 32), b_lo), _mm256_mul_epu32(a, b_hi));
    return _mm256_add_epi64(_mm256_mul_epu32(a, b_lo), _mm256_slli_epi64(cross, 32));
  }
  static constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ULL;
  __m256i z_;
};

/// The random words of a moment's next 16 values, its value g = first + i taking word g & 3 of draw g >> 2: where
/// first is not a multiple of 4 they start 1-3 words into 8 draws.
class MomentWords {
 public:
  AMP_AVX2 MomentWords(uint64_t seed, uint64_t first) : draws_(seed, first >> 2), skip_(static_cast<int>(first & 3)) {
    if (skip_ != 0) current_ = draws_.next();
  }
  AMP_AVX2 __m256i next() {
    if (skip_ == 0) return draws_.next();
    const __m256i following = draws_.next();
    // [current's high half, following's low half]: alignr then shifts each 128-bit lane across the pair
    const __m256i middle = _mm256_permute2x128_si256(current_, following, 0x21);
    const __m256i words = skip_ == 1   ? _mm256_alignr_epi8(middle, current_, 2)
                          : skip_ == 2 ? _mm256_alignr_epi8(middle, current_, 4)
                                       : _mm256_alignr_epi8(middle, current_, 6);
    current_ = following;
    return words;
  }

 private:
  SplitMix4 draws_;
  int skip_;
  __m256i current_ = _mm256_setzero_si256();
};

/// round_stochastically for 8 floats, each with its 16 random bits (8 words).
AMP_AVX2 inline __m128i round8_stochastically(__m256 x, __m128i random8) {
  const __m256i exponent = _mm256_set1_epi32(0x7f800000), mantissa = _mm256_set1_epi32(0x007fffff);
  const __m256i b = _mm256_castps_si256(x);
  const __m256i special = _mm256_cmpeq_epi32(_mm256_and_si256(b, exponent), exponent);
  const __m256i nan = _mm256_andnot_si256(_mm256_cmpeq_epi32(_mm256_and_si256(b, mantissa), _mm256_setzero_si256()), special);
  const __m256i added = _mm256_add_epi32(b, _mm256_andnot_si256(special, _mm256_cvtepu16_epi32(random8)));
  const __m256i rounded = _mm256_blendv_epi8(_mm256_srli_epi32(added, 16), _mm256_set1_epi32(0x7fc0), nan);
  // 8 dwords below 2^16 to 8 words: packus works within 128-bit lanes, so the halves come together after it.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0x08);
  return _mm256_castsi256_si128(packed);
}

}  // namespace amp::detail::cpu::avx2

#endif
