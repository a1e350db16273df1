#pragma once
// The 8-bit codec's AVX-512 steps, 16 values at a time: decoding codes (by gathers, or by VBMI's byte permutes a block
// at a time), a block's scale, and finding codes on the map's lines (NOTE [Codes by lines] in cpu_state_codec.cpp) or
// through the bucket table. Included by the codec's block loops (cpu_state_codec.cpp) and by the 8-bit Adam step that
// decodes, updates and encodes in one pass (cpu_optimizer_kernels.cpp); each caller has AMP_AVX512 on its function
// and runs where codec_loops_at(CodecLoops::kAvx512).
// The codes are the portable loops' bits: the table's arithmetic is theirs (the same roundings, the same
// comparisons), and the lines leave to the table every value they are not sure of.

#include "optim/simd_targets.h"

#ifdef AMP_HAVE_SIMD_LOOPS
#define AMP_HAVE_AVX512_CODES 1

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "optim/cpu_state_codec.h"

namespace amp::detail::cpu::avx512 {

/// map[code] * scale for 16 codes.
AMP_AVX512 inline __m512 decode16(const uint8_t* codes, __m512 scale, const float* map) {
  const __m512i index = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
  return _mm512_mul_ps(_mm512_i32gather_ps(index, map, 4), scale);
}

// NOTE [Decoding by permutes]
// A code's value is map[code] * scale. A gather of 16 floats takes about 21 cycles on an AMD EPYC (Zen 5; 0.36 ns a
// value, which made the 8-bit step's two decodes cost more than the whole fp32 step). With AVX-512 VBMI, vpermi2b
// looks 64 bytes up at once in a table of 128 held in two registers, so the map is kept as 4 planes of bytes (plane
// k: byte k of every entry): each plane is looked up with two permutes (codes below and from 128) and a blend on the
// code's top bit, and unpacking the planes' bytes into words and the words into dwords puts each float back together.
// Unpacks stay within 128-bit lanes, so the codes are first permuted so that the unpacks give 16 consecutive values
// per register. The floats are map[code]'s bytes, so the decoded values are the gather's bit for bit (0.08 ns a value
// on that EPYC). On an Intel Xeon (Sapphire Rapids) the gather was the faster (0.16 ns against 0.22), so which route
// runs is timed on the CPU (default_codec_loops). Not inline: callers without VBMI in their target call it where
// codec_loops_at(CodecLoops::kAvx512Vbmi).
AMP_AVX512_VBMI __attribute__((noinline)) inline void decode_block_by_permutes(const uint8_t* codes, float scale,
                                                                            const uint8_t* planes, float* out) {
  // Byte p of lane L of quarter q comes from code 16 q + 4 L + p: what unpacking 4 planes leaves in place.
  alignas(64) static constexpr uint8_t kOrder[64] = {
      0, 1, 2, 3, 16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51, 4, 5, 6, 7, 20, 21, 22, 23, 36, 37, 38, 39, 52, 53, 54, 55,
      8, 9, 10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59, 12, 13, 14, 15, 28, 29, 30, 31, 44, 45, 46, 47, 60, 61, 62, 63};
  const __m512i order = _mm512_load_si512(kOrder);
  const __m512 s = _mm512_set1_ps(scale);
  // The planes in 16 registers, loaded once: the compiler can't keep them across the stores to `out`, which it
  // must assume may alias them (loading them per 64 codes cost the 8-bit step 15% on Zen 5).
  __m512i table[16];
  for (int k = 0; k < 16; ++k) table[k] = _mm512_loadu_si512(planes + 64 * k);
  for (int64_t i = 0; i < kCodeBlock; i += 64) {
    const __m512i c = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(codes + i));
    const __mmask64 high = _mm512_movepi8_mask(c);
    __m512i byte[4];
    for (int k = 0; k < 4; ++k) {  // plane k: table[4k .. 4k + 3]
      const __m512i low_half = _mm512_permutex2var_epi8(table[4 * k], c, table[4 * k + 1]);
      const __m512i high_half = _mm512_permutex2var_epi8(table[4 * k + 2], c, table[4 * k + 3]);
      byte[k] = _mm512_mask_blend_epi8(high, low_half, high_half);
    }
    const __m512i lo01 = _mm512_unpacklo_epi8(byte[0], byte[1]), hi01 = _mm512_unpackhi_epi8(byte[0], byte[1]);
    const __m512i lo23 = _mm512_unpacklo_epi8(byte[2], byte[3]), hi23 = _mm512_unpackhi_epi8(byte[2], byte[3]);
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(lo01, lo23)), s));
    _mm512_storeu_ps(out + i + 16, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(lo01, lo23)), s));
    _mm512_storeu_ps(out + i + 32, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(hi01, hi23)), s));
    _mm512_storeu_ps(out + i + 48, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(hi01, hi23)), s));
  }
}

/// The running maximum of |x|'s bits: integers order non-negative floats as floats do and put a NaN above inf.
AMP_AVX512 inline __m512i absmax_bits(__m512i running, __m512 x) {
  return _mm512_max_epu32(running, _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fffffff)));
}

/// torchao's block scale from absmax_bits' lanes: the absmax clipped to 1e-12, NaN where a value is NaN.
AMP_AVX512 inline float block_scale(__m512i bits) {
  const uint32_t top = static_cast<uint32_t>(_mm512_reduce_max_epu32(bits));
  if (top > 0x7f800000u) return std::numeric_limits<float>::quiet_NaN();
  float amax;
  std::memcpy(&amax, &top, sizeof amax);
  return amax > 1e-12f ? amax : 1e-12f;
}

/// x / s correctly rounded (NOTE [Dividing by the scale] in cpu_state_codec.cpp); r = 1 / s, by_reciprocal =
/// divides_by_reciprocal(s).
AMP_AVX512 inline __m512 divide16(__m512 x, __m512 s, __m512 r, bool by_reciprocal) {
  if (!by_reciprocal) return _mm512_div_ps(x, s);
  __m512 q = _mm512_mul_ps(x, r);
  q = _mm512_fmadd_ps(_mm512_fnmadd_ps(q, s, x), r, q);
  return _mm512_fmadd_ps(_mm512_fnmadd_ps(q, s, x), r, q);
}

/// The codes of 16 values already divided by their scale (|y| <= 1, finite), through the bucket table (NOTE [Finding
/// a code]): the bucket is y's top 16 bits less the sign, shifted so exponent kCodeMinExponent's first is 1 (below
/// it: bucket 0), plus kCodeBucketsPerSign for negative y.
AMP_AVX512 inline void codes16(__m512 y, const CodeBucket* table, uint8_t* out) {
  constexpr int32_t kFirst = (127 + kCodeMinExponent) << kCodeMantissaBits;  // the top bits of 2^kCodeMinExponent
  const __m512i b = _mm512_castps_si512(y);
  const __m512i top = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(0x7fff));
  const __mmask16 normal = _mm512_cmpge_epi32_mask(top, _mm512_set1_epi32(kFirst));
  __m512i at = _mm512_maskz_sub_epi32(normal, top, _mm512_set1_epi32(kFirst - (1 << kCodeMantissaBits)));
  at = _mm512_min_epi32(at, _mm512_set1_epi32(static_cast<int32_t>(kCodeBucketsPerSign) - 1));
  const __mmask16 negative = _mm512_movepi32_mask(b);
  at = _mm512_mask_add_epi32(at, negative, at, _mm512_set1_epi32(static_cast<int32_t>(kCodeBucketsPerSign)));
  const __m512i word = _mm512_i32gather_epi32(at, reinterpret_cast<const int*>(table), 4);
  // The key: the low 16 bits, reversed for negative y ((b ^ sign) & 0xffff is the truth table 0x28).
  const __m512i key = _mm512_ternarylogic_epi32(b, _mm512_srai_epi32(b, 31), _mm512_set1_epi32(0xffff), 0x28);
  const __mmask16 up = _mm512_cmpge_epu32_mask(key, _mm512_srli_epi32(word, 8));
  const __m512i code = _mm512_and_si512(word, _mm512_set1_epi32(0xff));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out),
                   _mm512_cvtepi32_epi8(_mm512_mask_add_epi32(code, up, code, _mm512_set1_epi32(1))));
}

/// A map's lines (NOTE [Codes by lines] in cpu_state_codec.cpp) in registers: 6 of them.
struct LineRegisters {
  __m512i piece_word[2];  // by octave: entries 0-15, 16-31
  __m512 slope, offset;
  __m512i last_code, mirror;
  bool is_signed;
  AMP_AVX512 explicit LineRegisters(const CodeLines& lines)
      : piece_word{_mm512_load_si512(lines.piece_word), _mm512_load_si512(lines.piece_word + 16)},
        slope(_mm512_load_ps(lines.slope)), offset(_mm512_load_ps(lines.offset)),
        last_code(_mm512_load_si512(lines.last_code)), mirror(_mm512_set1_epi32(lines.mirror)),
        is_signed(lines.mirror >= 0) {}
};

/// The codes of 16 values x of a block whose scale is s (r = 1 / s, by_reciprocal = divides_by_reciprocal(s)) on the
/// lines; code_on_lines' arithmetic, the uncertain values' codes from the bucket table.
template <bool kSigned>
AMP_AVX512 inline void codes16_by_lines(const float* x, __m512 s, __m512 r, bool by_reciprocal, float scale,
                                        const LineRegisters& lines, const CodeBucket* table, uint8_t* out) {
  const __m512 xv = _mm512_loadu_ps(x);
  const __m512i b = _mm512_castps_si512(by_reciprocal ? _mm512_mul_ps(xv, r) : _mm512_div_ps(xv, s));
  const __m512i a = kSigned ? _mm512_and_si512(b, _mm512_set1_epi32(0x7fffffff)) : _mm512_max_epi32(b, _mm512_setzero_si512());
  const __m512i clamped = _mm512_max_epu32(a, _mm512_set1_epi32(96 << 23));
  const __m512i t = _mm512_add_epi32(  // permutes read the octave's low 5 bits
      clamped, _mm512_permutex2var_epi32(lines.piece_word[0], _mm512_srli_epi32(clamped, 23), lines.piece_word[1]));
  const __m512i p = _mm512_srli_epi32(t, 24);
  const __m512 q = _mm512_fmadd_ps(_mm512_permutexvar_ps(p, lines.slope), _mm512_castsi512_ps(a),
                                   _mm512_permutexvar_ps(p, lines.offset));
  const __m512i qi = _mm512_cvttps_epi32(q);
  const __mmask16 off_line = _mm512_testn_epi32_mask(qi, _mm512_set1_epi32((1 << kLineFraction) - 2 * kLineBand));
  const __mmask16 near_switch = _mm512_testn_epi32_mask(t, _mm512_set1_epi32((1 << 24) - 2 * kSwitchBand));
  __m512i code = _mm512_min_epi32(_mm512_srli_epi32(qi, kLineFraction), _mm512_permutexvar_epi32(p, lines.last_code));
  if constexpr (kSigned) {
    code = _mm512_max_epi32(_mm512_mask_sub_epi32(code, _mm512_movepi32_mask(b), lines.mirror, code), _mm512_setzero_si512());
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(code));
  if (__builtin_expect(!_kortestz_mask16_u8(off_line, near_switch), 0)) {
    for (unsigned lanes = _kor_mask16(off_line, near_switch); lanes != 0; lanes &= lanes - 1) {
      const int l = __builtin_ctz(lanes);
      out[l] = code_by_buckets(x[l], scale, table);
    }
  }
}

/// Encodes a block of kCodeBlock values whose absmax_bits are `absmax` (codes and scale) on the map's lines where it has
/// them, else through its bucket table; or returns false leaving both as they were where the scale is inf or NaN (the
/// codec's search handles those).
AMP_AVX512 inline bool encode_block(const float* values, __m512i absmax, uint8_t* codes, float* scale,
                                    const CodeBucket* table, const CodeLines* lines) {
  const float s = block_scale(absmax);
  if (!std::isfinite(s)) return false;
  *scale = s;
  const __m512 sv = _mm512_set1_ps(s), r = _mm512_set1_ps(1.0f / s);
  const bool by_reciprocal = divides_by_reciprocal(s);
  if (lines != nullptr) {
    const LineRegisters on(*lines);
    for (int64_t j = 0; j < kCodeBlock; j += 16) {
      if (on.is_signed) {
        codes16_by_lines<true>(values + j, sv, r, by_reciprocal, s, on, table, codes + j);
      } else {
        codes16_by_lines<false>(values + j, sv, r, by_reciprocal, s, on, table, codes + j);
      }
    }
    return true;
  }
  for (int64_t j = 0; j < kCodeBlock; j += 16) {
    codes16(divide16(_mm512_loadu_ps(values + j), sv, r, by_reciprocal), table, codes + j);
  }
  return true;
}

}  // namespace amp::detail::cpu::avx512

#endif
