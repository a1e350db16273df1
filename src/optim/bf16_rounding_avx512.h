#pragma once
// Stochastic rounding to bfloat16 with AVX-512, 32 values a step: stochastic_rounding.h's draws and rounding, so the
// same bits. Used by the codec's bf16 encode (cpu_state_codec.cpp) and by the bf16 Adam step that updates and
// rounds in one pass (cpu_optimizer_kernels.cpp); each caller has AMP_AVX512 on its function.

#include "optim/avx512_target.h"

#ifdef AMP_HAVE_AVX512_LOOPS
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

#endif
