#pragma once
// The 8-bit codec's AVX2 steps, 8 values at a time: decoding codes by gathers, a block's absmax and scale, the
// correctly rounded quotient by the scale and the codes through the bucket table (NOTE [Finding a code] in
// cpu_state_codec.cpp). The codec's AVX2 block loops and the AVX2 8-bit Adam step in one pass use them (each caller
// has AMP_AVX2 on its function and runs where codec_loops_at(CodecLoops::kAvx2)): the portable loops' arithmetic and
// comparisons, so their bits.

#include "optim/simd_targets.h"

#ifdef AMP_HAVE_SIMD_LOOPS
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "optim/cpu_state_codec.h"

namespace amp::detail::cpu::avx2 {

/// map[code] * scale for 8 codes.
AMP_AVX2 inline __m256 decode8(const uint8_t* codes, __m256 scale, const float* map) {
  const __m256i index = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes)));
  return _mm256_mul_ps(_mm256_i32gather_ps(map, index, 4), scale);
}

/// The running maximum of |x|'s bits: integers order non-negative floats as floats do and put a NaN above inf.
AMP_AVX2 inline __m256i absmax_bits(__m256i running, __m256 x) {
  return _mm256_max_epu32(running, _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7fffffff)));
}

/// torchao's block scale from absmax_bits' lanes: the absmax clipped to 1e-12, NaN where a value is NaN.
AMP_AVX2 inline float block_scale(__m256i bits) {
  alignas(32) uint32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), bits);
  uint32_t top = 0;
  for (const uint32_t lane : lanes) top = lane > top ? lane : top;
  if (top > 0x7f800000u) return std::numeric_limits<float>::quiet_NaN();
  float amax;
  std::memcpy(&amax, &top, sizeof amax);
  return amax > 1e-12f ? amax : 1e-12f;
}

/// x / s correctly rounded (NOTE [Dividing by the scale] in cpu_state_codec.cpp); r = 1 / s, by_reciprocal =
/// divides_by_reciprocal(s).
AMP_AVX2 inline __m256 divide8(__m256 x, __m256 s, __m256 r, bool by_reciprocal) {
  if (!by_reciprocal) return _mm256_div_ps(x, s);
  __m256 q = _mm256_mul_ps(x, r);
  q = _mm256_fmadd_ps(_mm256_fnmadd_ps(q, s, x), r, q);
  return _mm256_fmadd_ps(_mm256_fnmadd_ps(q, s, x), r, q);
}

/// The codes of 8 values already divided by their scale (|y| <= 1, finite), through the bucket table.
AMP_AVX2 inline void codes8(__m256 y, const CodeBucket* table, uint8_t* out) {
  const __m256i zero = _mm256_setzero_si256();
  const __m256i b = _mm256_castps_si256(y);
  const __m256i negative = _mm256_srai_epi32(b, 31);
  const __m256i exponent = _mm256_min_epi32(
      _mm256_sub_epi32(_mm256_and_si256(_mm256_srli_epi32(b, 23), _mm256_set1_epi32(0xff)), _mm256_set1_epi32(127)), zero);
  const __m256i mantissa =
      _mm256_and_si256(_mm256_srli_epi32(b, 23 - kCodeMantissaBits), _mm256_set1_epi32((1 << kCodeMantissaBits) - 1));
  __m256i at = _mm256_add_epi32(
      _mm256_slli_epi32(_mm256_add_epi32(exponent, _mm256_set1_epi32(1 - kCodeMinExponent)), kCodeMantissaBits), mantissa);
  at = _mm256_andnot_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(kCodeMinExponent), exponent), at);  // tiny: bucket 0
  at = _mm256_add_epi32(at, _mm256_and_si256(negative, _mm256_set1_epi32(static_cast<int32_t>(kCodeBucketsPerSign))));
  const __m256i word = _mm256_i32gather_epi32(reinterpret_cast<const int*>(table), at, 4);
  const __m256i key = _mm256_and_si256(_mm256_xor_si256(b, negative), _mm256_set1_epi32(0xffff));
  // code - mask adds one where the mask is all ones (key >= the word's first key of the next code).
  const __m256i up = _mm256_cmpgt_epi32(_mm256_add_epi32(key, _mm256_set1_epi32(1)), _mm256_srli_epi32(word, 8));
  const __m256i c = _mm256_sub_epi32(_mm256_and_si256(word, _mm256_set1_epi32(0xff)), up);
  const __m128i halves = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packus_epi16(halves, halves));
}

/// A block's codes and scale from its values and absmax_bits; false (nothing written) where the block holds inf or
/// NaN, which the codec's search encodes.
AMP_AVX2 inline bool encode_block(const float* values, __m256i absmax, uint8_t* codes, float* scale,
                                  const CodeBucket* table) {
  const float s = block_scale(absmax);
  if (!std::isfinite(s)) return false;
  *scale = s;
  const __m256 sv = _mm256_set1_ps(s), r = _mm256_set1_ps(1.0f / s);
  const bool by_reciprocal = divides_by_reciprocal(s);
  for (int64_t j = 0; j < kCodeBlock; j += 8) codes8(divide8(_mm256_loadu_ps(values + j), sv, r, by_reciprocal), table, codes + j);
  return true;
}

}  // namespace amp::detail::cpu::avx2

#endif
