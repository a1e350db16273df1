#pragma once
// The 8-bit codec's AVX2 steps, 8 values at a time: decoding codes by gathers, a block's absmax and scale, the
// correctly rounded quotient by the scale, and the codes on the map's lines (NOTE [Codes by lines]) or through the
// bucket table (NOTE [Finding a code]; both in cpu_state_codec.cpp). The codec's AVX2 block loops and the AVX2 8-bit Adam step in one pass use them (each caller
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

/// A map's lines (NOTE [Codes by lines] in cpu_state_codec.cpp) in registers, and lookups by a lane's index in their
/// tables of 32 and 16 entries: AVX2's permutes read 8, so 4 or 2 of them and blends on the index's next bits.
struct LineRegisters {
  __m256i piece_word[4];  // by octave: entries 0-7, 8-15, 16-23, 24-31
  __m256 slope[2], offset[2];
  __m256i last_code[2];
  __m256i mirror;
  bool is_signed;
  AMP_AVX2 explicit LineRegisters(const CodeLines& lines)
      : piece_word{_mm256_load_si256(reinterpret_cast<const __m256i*>(lines.piece_word)),
                   _mm256_load_si256(reinterpret_cast<const __m256i*>(lines.piece_word + 8)),
                   _mm256_load_si256(reinterpret_cast<const __m256i*>(lines.piece_word + 16)),
                   _mm256_load_si256(reinterpret_cast<const __m256i*>(lines.piece_word + 24))},
        slope{_mm256_load_ps(lines.slope), _mm256_load_ps(lines.slope + 8)},
        offset{_mm256_load_ps(lines.offset), _mm256_load_ps(lines.offset + 8)},
        last_code{_mm256_load_si256(reinterpret_cast<const __m256i*>(lines.last_code)),
                  _mm256_load_si256(reinterpret_cast<const __m256i*>(lines.last_code + 8))},
        mirror(_mm256_set1_epi32(lines.mirror)), is_signed(lines.mirror >= 0) {}
};

/// table[index & 15] from two registers of 8.
AMP_AVX2 inline __m256 lookup16(const __m256 table[2], __m256i index) {
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(table[0], index), _mm256_permutevar8x32_ps(table[1], index),
                          _mm256_castsi256_ps(_mm256_slli_epi32(index, 28)));
}
AMP_AVX2 inline __m256i lookup16(const __m256i table[2], __m256i index) {
  const __m256 t[2] = {_mm256_castsi256_ps(table[0]), _mm256_castsi256_ps(table[1])};
  return _mm256_castps_si256(lookup16(t, index));
}

/// codes16_by_lines (codes_avx512.h) for 8 values: the same arithmetic, the uncertain values from the bucket table.
template <bool kSigned>
AMP_AVX2 inline void codes8_by_lines(const float* x, __m256 s, __m256 r, bool by_reciprocal, float scale,
                                     const LineRegisters& lines, const CodeBucket* table, uint8_t* out) {
  const __m256 xv = _mm256_loadu_ps(x);
  const __m256i b = _mm256_castps_si256(by_reciprocal ? _mm256_mul_ps(xv, r) : _mm256_div_ps(xv, s));
  const __m256i a = kSigned ? _mm256_and_si256(b, _mm256_set1_epi32(0x7fffffff)) : _mm256_max_epi32(b, _mm256_setzero_si256());
  const __m256i clamped = _mm256_max_epu32(a, _mm256_set1_epi32(96 << 23));
  // The octave's low 5 bits pick the piece word: the permutes read bits 0-2, blends bits 3 and 4.
  const __m256i octave = _mm256_srli_epi32(clamped, 23);
  const __m256 bit3 = _mm256_castsi256_ps(_mm256_slli_epi32(octave, 28)), bit4 = _mm256_castsi256_ps(_mm256_slli_epi32(octave, 27));
  __m256 word[4];
  for (int k = 0; k < 4; ++k) word[k] = _mm256_castsi256_ps(_mm256_permutevar8x32_epi32(lines.piece_word[k], octave));
  const __m256 low = _mm256_blendv_ps(word[0], word[1], bit3), high = _mm256_blendv_ps(word[2], word[3], bit3);
  const __m256i t = _mm256_add_epi32(clamped, _mm256_castps_si256(_mm256_blendv_ps(low, high, bit4)));
  const __m256i p = _mm256_srli_epi32(t, 24);
  const __m256 q = _mm256_fmadd_ps(lookup16(lines.slope, p), _mm256_castsi256_ps(a), lookup16(lines.offset, p));
  const __m256i qi = _mm256_cvttps_epi32(q);
  const __m256i zero = _mm256_setzero_si256();
  const __m256i off_line =
      _mm256_cmpeq_epi32(_mm256_and_si256(qi, _mm256_set1_epi32((1 << kLineFraction) - 2 * kLineBand)), zero);
  const __m256i near_switch =
      _mm256_cmpeq_epi32(_mm256_and_si256(t, _mm256_set1_epi32((1 << 24) - 2 * kSwitchBand)), zero);
  __m256i code = _mm256_min_epi32(_mm256_srli_epi32(qi, kLineFraction), lookup16(lines.last_code, p));
  if constexpr (kSigned) {
    const __m256i mirrored = _mm256_blendv_epi8(code, _mm256_sub_epi32(lines.mirror, code), _mm256_srai_epi32(b, 31));
    code = _mm256_max_epi32(mirrored, zero);
  }
  const __m128i halves = _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packus_epi16(halves, halves));
  const int uncertain = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_or_si256(off_line, near_switch)));
  if (__builtin_expect(uncertain != 0, 0)) {
    for (unsigned lanes = static_cast<unsigned>(uncertain); lanes != 0; lanes &= lanes - 1) {
      const int l = __builtin_ctz(lanes);
      out[l] = code_by_buckets(x[l], scale, table);
    }
  }
}

/// A block's codes and scale from its values and absmax_bits, on the map's lines where it has them; false (nothing
/// written) where the block holds inf or NaN, which the codec's search encodes.
AMP_AVX2 inline bool encode_block(const float* values, __m256i absmax, uint8_t* codes, float* scale,
                                  const CodeBucket* table, const CodeLines* lines) {
  const float s = block_scale(absmax);
  if (!std::isfinite(s)) return false;
  *scale = s;
  const __m256 sv = _mm256_set1_ps(s), r = _mm256_set1_ps(1.0f / s);
  const bool by_reciprocal = divides_by_reciprocal(s);
  if (lines != nullptr) {
    const LineRegisters on(*lines);
    for (int64_t j = 0; j < kCodeBlock; j += 8) {
      if (on.is_signed) {
        codes8_by_lines<true>(values + j, sv, r, by_reciprocal, s, on, table, codes + j);
      } else {
        codes8_by_lines<false>(values + j, sv, r, by_reciprocal, s, on, table, codes + j);
      }
    }
    return true;
  }
  for (int64_t j = 0; j < kCodeBlock; j += 8) codes8(divide8(_mm256_loadu_ps(values + j), sv, r, by_reciprocal), table, codes + j);
  return true;
}

}  // namespace amp::detail::cpu::avx2

#endif
