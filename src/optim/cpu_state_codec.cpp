#include "optim/cpu_state_codec.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "optim/bf16_rounding_simd.h"
#include "optim/codes_avx2.h"
#include "optim/codes_avx512.h"
#include "optim/stochastic_rounding.h"
#include "scaling/cpu_kernels.h"

// Built with -ffp-contract=off (CMakeLists.txt): every product and quotient below is rounded as torchao's ATen ops
// round them, so the codes are torchao's bit for bit.

namespace amp::detail::cpu {
namespace {

// NOTE [Finding a code]
// torchao's code for y (a value divided by its block's absmax, so |y| <= 1) is the largest c with map[c] <= y, plus
// one where y - map[c] >= (map[c + 1] - map[c]) * 0.5 in fp32: 8 dependent lookups of a binary search. The code is
// a non-decreasing function of y, so a table over buckets of floats with the same sign, exponent and top 7 mantissa
// bits (|y| < 2^-24 is one bucket per sign) keeps, per bucket, the code of its smallest y and where in the bucket the
// code becomes one more: code_buckets finds that by bisection and checks that no bucket spans more than two codes.
// Inside a bucket y's order is the order of its low 16 bits (reversed where y < 0), its *key*, so one 32-bit word
// holds both: the code in bits 0-7, the first key of the next code in bits 8-24 (0x10000: none). The two buckets
// below 2^-24 span more than 16 bits: each must hold one code (torchao's maps' smallest nonzero entries are 3.25e-7
// and 5.5e-7, so they do). A code is then one lookup and one comparison, bit for bit the search's.
//
// NOTE [Dividing by the scale]
// y = x / s rounded to nearest, as torchao's division. The vector loops compute it as r = 1 / s once per block (a
// true division), q = x r, then twice q += (x - s q) r with fused multiply-adds: after the first correction q is
// within an ulp of x / s, so by Markstein's theorem (Muller et al., Handbook of Floating-Point Arithmetic, "Markstein")
// the second gives the correctly rounded quotient, provided nothing underflows. With 2^-60 <= s <= 2^100 every
// remainder of a quotient >= 2^-24 is exact; quotients below that fall in a one-code bucket either way (above). Other
// scales divide. On a Xeon a loop of vector divisions took 0.18 ns per value, one of the four multiply-adds 0.067.
constexpr int kMantissaBits = kCodeMantissaBits;
constexpr int kMinExponent = kCodeMinExponent;
constexpr int64_t kPerSign = kCodeBucketsPerSign;

float float_from(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

inline uint8_t round_code(float y, int c, const float* map) {
  const int up = std::min(c + 1, 255);
  const float down = map[c];
  return static_cast<uint8_t>(y - down >= (map[up] - down) * 0.5f ? up : c);
}


}  // namespace

void map_byte_planes(const float* map, uint8_t* planes) {
  for (int c = 0; c < 256; ++c) {
    uint32_t b;
    std::memcpy(&b, map + c, sizeof b);
    for (int k = 0; k < 4; ++k) planes[256 * k + c] = static_cast<uint8_t>(b >> (8 * k));
  }
}

uint8_t code_by_search(float y, const float* map) {
  int c = y >= map[128] ? 128 : 0;
  c += y >= map[c + 64] ? 64 : 0;
  c += y >= map[c + 32] ? 32 : 0;
  c += y >= map[c + 16] ? 16 : 0;
  c += y >= map[c + 8] ? 8 : 0;
  c += y >= map[c + 4] ? 4 : 0;
  c += y >= map[c + 2] ? 2 : 0;
  c += y >= map[c + 1] ? 1 : 0;
  return round_code(y, c, map);
}

bool code_buckets(const float* map, CodeBucket* table) {
  const uint32_t low_mask = (1u << (23 - kMantissaBits)) - 1;
  bool ok = true;
  // The bucket of magnitudes [first, last] (bit patterns) with `sign`; y grows with the magnitude for sign 0.
  auto fill = [&](int64_t at, uint32_t sign, uint32_t first, uint32_t last) {
    auto y_of = [&](uint32_t magnitude) { return float_from((sign << 31) | magnitude); };
    const int q_lo = code_by_search(y_of(sign ? last : first), map), q_hi = code_by_search(y_of(sign ? first : last), map);
    ok = ok && q_hi - q_lo <= 1 && (q_hi == q_lo || at % kPerSign != 0);  // a tiny bucket holds one code
    table[at] = static_cast<uint32_t>(q_lo) | (0x10000u << 8);
    if (q_hi == q_lo) return;
    // The magnitudes whose code is q_hi are one end of [first, last]: bisect for the boundary.
    auto is_hi = [&](uint32_t m) { return code_by_search(y_of(m), map) == q_hi; };
    uint32_t a = first, b = last;
    if (sign == 0) {  // the smallest magnitude with code q_hi
      while (a < b) {
        const uint32_t mid = a + (b - a) / 2;
        if (is_hi(mid)) b = mid; else a = mid + 1;
      }
    } else {  // the largest magnitude with code q_hi (the smallest y)
      while (a < b) {
        const uint32_t mid = a + (b - a + 1) / 2;
        if (is_hi(mid)) a = mid; else b = mid - 1;
      }
    }
    table[at] = static_cast<uint32_t>(q_lo) | (key_of((sign << 31) | a) << 8);
  };
  const uint32_t below_tiny = (static_cast<uint32_t>(127 + kMinExponent) << 23) - 1;
  for (uint32_t sign = 0; sign < 2; ++sign) {
    fill(sign * kPerSign, sign, 0, below_tiny);  // |y| < 2^-24, denormals included
    for (int exponent = kMinExponent; exponent <= 0; ++exponent) {
      for (uint32_t m = 0; m < (1u << kMantissaBits); ++m) {
        const uint32_t base = (static_cast<uint32_t>(exponent + 127) << 23) | (m << (23 - kMantissaBits));
        fill(bucket_of((sign << 31) | base), sign, base, base | low_mask);
      }
    }
  }
  return ok;
}

// NOTE [Codes by lines]
// The bucket table costs a gather per 16 values, and a gather of 16 words takes about 21 cycles on an AMD EPYC (Zen 5):
// with two moments that was half the 8-bit Adam step. torchao's maps are made of decades, each a run of evenly spaced
// values, so from where one run's codes start to where the next run's start the code of |y| is
// floor(slope * |y| + offset) (fixed point, kLineFraction bits) capped at the run's last code (between a run's last
// change and the next run's first, the code stays). code_lines finds these pieces from the places where the code
// changes (8 per map, each starting at such a place); the vector loop gets |y|'s piece from one 32-entry table indexed
// by its octave (at most one piece starts per octave: CodeLines::piece_word) and the line from registers. Negative y
// of a signed map mirror the positive ones (torchao's signed map is symmetric about its zero at code 127; 1.0, code
// 255, has no negative twin, hence the max with 0).
// Exactness: the loop takes y as x * (1 / s), within 2^-22 of x / s, not the quotient (four multiply-adds a vector
// less than NOTE [Dividing by the scale]). A value is *uncertain*, and takes the bucket table with the true quotient,
// where its line is within kLineBand / 2^kLineFraction of a whole number or |y| is within kSwitchBand floats of where
// a piece starts (there the code changes by the piece changing, not by the line crossing a whole number): about 0.1%
// of values. code_lines checks every float y in [0, 1 + 2^-22] of both signs against code_by_search: where the window
// of quotients within 2^-21 of y holds one code, the lines give it or call y uncertain; where the window holds a change,
// y is uncertain. Near each change this is checked float by float; between changes, per stretch with one piece, where
// the line is monotonic, so its ends bound it. A map that fails has no lines, and its codes come from the table.

namespace {

constexpr uint32_t kOneBits = 0x3f800000u;  // 1.0f
constexpr int32_t kLineScale = 1 << kLineFraction;

// The offsets hold kLineBand more than the line, so a certain value's fixed point is at least 2 * kLineBand past a
// whole number, and its code is the integer part either way.
bool line_uncertain(int32_t qi) { return (qi & (kLineScale - 2 * kLineBand)) == 0; }

// cvttps2dq: truncation, out of range (NaN included) giving INT32_MIN.
int32_t truncate_like_cvtt(float q) {
  return q >= -2147483648.0f && q < 2147483648.0f ? static_cast<int32_t>(q) : std::numeric_limits<int32_t>::min();
}

// The code of a magnitude on piece p before the mirror, and the fixed-point line it came from.
int32_t piece_code(const CodeLines& lines, int p, uint32_t a, int32_t* qi) {
  *qi = truncate_like_cvtt(std::fma(lines.slope[p], float_from(a), lines.offset[p]));
  return std::min(static_cast<int32_t>(static_cast<uint32_t>(*qi) >> kLineFraction), lines.last_code[p]);
}

constexpr uint32_t kSmallestSlot = 96u << 23;  // 2^-31: smaller magnitudes take its octave's piece

// a's piece, and whether a is within kSwitchBand floats of where the piece changes.
int piece_of(const CodeLines& lines, uint32_t a, bool* near_switch) {
  const uint32_t clamped = std::max(a, kSmallestSlot);
  const uint32_t t = clamped + lines.piece_word[(clamped >> 23) & 31u];
  *near_switch = (t & ((1u << 24) - 2 * kSwitchBand)) == 0;
  return static_cast<int>(t >> 24);
}

// The magnitudes where the code of sign * a changes, a in (0, 1]: the code is monotonic in a, so each is bisected.
std::vector<uint32_t> code_boundaries(const float* map, uint32_t sign) {
  auto code = [&](uint32_t a) { return code_by_search(float_from(sign | a), map); };
  std::vector<uint32_t> out;
  uint32_t from = 0;
  while (code(from) != code(kOneBits)) {
    uint32_t lo = from, hi = kOneBits;  // code(lo) == code(from) != code(hi)
    while (hi - lo > 1) {
      const uint32_t mid = lo + (hi - lo) / 2;
      (code(mid) == code(from) ? lo : hi) = mid;
    }
    out.push_back(hi);
    from = hi;
  }
  return out;
}

struct Piece {
  uint32_t start;  // magnitude bits
  double slope, offset;
  int32_t last_code;
};

// The pieces of the positive half: each starts at a boundary (the first at 0) and takes the line through the evenly
// spaced boundaries after it, up to the last that keeps the spacing; a lone boundary gets a line shallow enough to stay
// within half a code across its piece.
std::vector<Piece> positive_pieces(const float* map, const std::vector<uint32_t>& at) {
  const auto t = [&](size_t j) { return static_cast<double>(float_from(at[j - 1])); };  // boundary j, 1-based
  const auto code_after = [&](size_t j) { return static_cast<int32_t>(code_by_search(float_from(at[j - 1]), map)); };
  const size_t m = at.size();
  const double scale = kLineScale;
  std::vector<Piece> pieces;
  size_t s = 0;  // the piece starts at boundary s (0: at zero)
  while (true) {
    const double begin = s == 0 ? 0.0 : t(s);
    const uint32_t start = s == 0 ? 0u : at[s - 1];
    if (s == m) {  // beyond the last boundary: one code
      const int32_t c = static_cast<int32_t>(code_by_search(1.0f, map));
      pieces.push_back({start, 0.0, (c + 0.5) * scale + kLineBand, c});
      return pieces;
    }
    size_t e = s + 1;
    if (s + 2 <= m) {
      const double gap = t(s + 2) - t(s + 1);
      size_t run_end = s + 2;
      while (run_end + 1 <= m && std::abs(t(run_end + 1) - t(run_end) - gap) <= 1e-3 * gap) ++run_end;
      if (t(s + 1) - begin < gap) e = run_end;  // else [begin, t(s + 1)) is too long for the run's line
    }
    Piece piece{start, 0.0, 0.0, code_after(e)};
    if (e == s + 1) {
      const double end = s + 2 <= m ? t(s + 2) : 1.0;
      piece.slope = scale / (2 * (end - begin));
    } else {
      piece.slope = scale * static_cast<double>(e - s - 1) / (t(e) - t(s + 1));
    }
    piece.offset = scale * code_after(s + 1) - piece.slope * t(s + 1) + kLineBand;
    pieces.push_back(piece);
    if (e == m) {
      return pieces;
    }
    s = e + 1;
  }
}

// The check of NOTE [Codes by lines] for the values of one sign.
bool lines_hold(const CodeLines& lines, const float* map, uint32_t sign, const std::vector<uint32_t>& boundaries,
                const std::vector<uint32_t>& piece_starts) {
  const uint32_t top = kOneBits + 2;  // x * (1 / s) may pass 1 by an ulp
  auto truth = [&](uint32_t a) { return static_cast<int32_t>(code_by_search(float_from(sign | std::min(a, kOneBits)), map)); };
  // The magnitudes of the quotients x / s for which a is the loop's x * (1 / s), as bits.
  auto window = [&](uint32_t a, bool upper) {
    const double v = float_from(a), w = upper ? v * (1 + 0x1p-21) + 0x1p-140 : std::max(v * (1 - 0x1p-21) - 0x1p-140, 0.0);
    uint32_t b;
    const float f = static_cast<float>(w);
    std::memcpy(&b, &f, sizeof b);
    return std::min(upper ? b + 1 : (b == 0 ? 0 : b - 1), kOneBits);
  };
  auto holds_at = [&](uint32_t a) {
    bool uncertain = false;
    const int32_t code = code_on_lines(lines, sign | a, &uncertain);
    if (uncertain) return true;
    return truth(window(a, false)) == code && truth(window(a, true)) == code;
  };
  // Float by float near each boundary; between them, stretch by stretch.
  constexpr uint32_t kNear = 64;
  std::vector<std::pair<uint32_t, uint32_t>> near;
  for (const uint32_t b : boundaries) {
    const uint32_t lo = b > kNear ? b - kNear : 0, hi = std::min(b + kNear, top);
    for (uint32_t a = lo; a <= hi; ++a) {
      if (!holds_at(a)) return false;
    }
    near.emplace_back(lo, hi);
  }
  std::vector<uint32_t> cuts;  // where the piece may change
  for (uint32_t e = 97; e <= 127; ++e) cuts.push_back(e << 23);
  for (size_t p = 1; p < piece_starts.size(); ++p) cuts.push_back(piece_starts[p] - kSwitchBand);  // piece_of's change
  std::sort(cuts.begin(), cuts.end());
  uint32_t from = 0;
  auto stretch = [&](uint32_t lo, uint32_t hi) {  // [lo, hi] holds no boundary and one piece
    bool near_switch = false;
    const int p = piece_of(lines, lo, &near_switch);
    if (piece_of(lines, hi, &near_switch) != p || lines.slope[p] < 0) return false;
    const int32_t code = truth(lo);
    int32_t q_lo = 0, q_hi = 0;
    piece_code(lines, p, lo, &q_lo);
    piece_code(lines, p, hi, &q_hi);
    if (q_lo < 0 || q_hi < q_lo) return false;
    // Every certain fixed-point value between the ends must give the code.
    for (int32_t j = q_lo >> kLineFraction; j <= (q_hi >> kLineFraction); ++j) {
      const int32_t first = std::max(q_lo, j * kLineScale + 2 * kLineBand), last = std::min(q_hi, j * kLineScale + kLineScale - 1);
      if (first > last) continue;
      int32_t c = std::min(j, lines.last_code[p]);
      if (sign != 0) c = std::max(lines.mirror - c, 0);
      if (c != code) return false;
    }
    return true;
  };
  near.emplace_back(top + 1, top + 1);
  for (const auto& [lo, hi] : near) {
    if (lo > from) {  // [from, lo - 1] between boundaries, cut where the piece may change
      uint32_t a = from;
      for (const uint32_t cut : cuts) {
        if (cut <= a || cut > lo - 1) continue;
        if (!stretch(a, cut - 1)) return false;
        a = cut;
      }
      if (!stretch(a, std::min(lo - 1, top))) return false;
    }
    from = std::max(from, hi + 1);
  }
  return true;
}

}  // namespace

int32_t code_on_lines(const CodeLines& lines, uint32_t y_bits, bool* uncertain) {
  const bool negative = (y_bits >> 31) != 0;
  const uint32_t a = lines.mirror >= 0 ? y_bits & 0x7fffffffu : (negative ? 0u : y_bits);
  int32_t qi = 0;
  bool near_switch = false;
  int32_t code = piece_code(lines, piece_of(lines, a, &near_switch), a, &qi);
  *uncertain = line_uncertain(qi) || near_switch;
  if (negative && lines.mirror >= 0) code = std::max(lines.mirror - code, 0);
  return code;
}

bool code_lines(const float* map, CodeLines* lines) {
  const std::vector<uint32_t> positive = code_boundaries(map, 0);
  for (size_t j = 0; j < positive.size(); ++j) {  // the code rises by one at each boundary
    if (code_by_search(float_from(positive[j]), map) != code_by_search(0.0f, map) + j + 1) return false;
  }
  const std::vector<Piece> pieces = positive_pieces(map, positive);
  if (pieces.size() > kMaxLinePieces) return false;
  CodeLines out;
  for (size_t p = 0; p < kMaxLinePieces; ++p) {
    const Piece& piece = pieces[std::min(p, pieces.size() - 1)];
    out.slope[p] = static_cast<float>(piece.slope);
    out.offset[p] = static_cast<float>(piece.offset);
    out.last_code[p] = piece.last_code;
  }
  std::vector<uint32_t> starts;
  for (const Piece& piece : pieces) starts.push_back(piece.start);
  for (uint32_t slot = 0; slot < 32; ++slot) {
    const uint32_t lo = (96u + slot) << 23, hi = lo + (1u << 23);  // the octave's magnitudes (slot 0: from 0)
    int first = 0, inside = 0;
    for (size_t p = 0; p < pieces.size(); ++p) {
      if (pieces[p].start <= lo) first = static_cast<int>(p);
      if (pieces[p].start > lo && pieces[p].start < hi) ++inside;
    }
    if (inside > 1) return false;
    // None in the octave: as if the next piece started kSwitchBand past its end, so none of it is near a change.
    const uint32_t next = inside == 1 ? pieces[first + 1].start : hi + kSwitchBand;
    out.piece_word[slot] = (static_cast<uint32_t>(first) + 1) * (1u << 24) - next + kSwitchBand;
  }
  const bool is_signed = map[0] < 0.0f;
  out.mirror = is_signed ? 2 * static_cast<int32_t>(code_by_search(0.0f, map)) : -1;
  if (!lines_hold(out, map, 0, positive, starts)) return false;
  if (is_signed) {
    if (!lines_hold(out, map, 0x80000000u, code_boundaries(map, 0x80000000u), starts)) return false;
  } else if (code_by_search(-1.0f, map) != code_by_search(0.0f, map) || code_by_search(-0.0f, map) != code_by_search(0.0f, map)) {
    return false;  // negative y would not all take code(0)
  }
  *lines = out;
  return true;
}

namespace {

// torchao's scale_tensor: the block's absmax, clipped to 1e-12 (NaN propagates, as amax does); the values divided
// by it.
AMP_VECTOR_CLONES float scale_block(const float* __restrict in, float* __restrict scaled) {
  float amax = 0.0f;
  bool nan = false;
  for (int64_t i = 0; i < kCodeBlock; ++i) {
    const float a = std::fabs(in[i]);
    nan = nan || a != a;
    amax = a > amax ? a : amax;
  }
  const float s = nan ? std::numeric_limits<float>::quiet_NaN() : std::max(amax, 1e-12f);
  for (int64_t i = 0; i < kCodeBlock; ++i) scaled[i] = in[i] / s;
  return s;
}

// The codes of a block's scaled values through the bucket table (NOTE [Finding a code]).
AMP_VECTOR_CLONES void codes_by_buckets(const float* __restrict y, uint8_t* __restrict codes,
                                        const CodeBucket* __restrict table) {
  for (int64_t i = 0; i < kCodeBlock; ++i) {
    uint32_t b;
    std::memcpy(&b, y + i, sizeof b);
    codes[i] = code_in(table[bucket_of(b)], b);
  }
}

#if defined(__GNUC__) && defined(__x86_64__)
#define AMP_HAVE_AVX2_CODES 1
// A block with AVX2 (codes_avx2.h): the same scale, quotients and codes as the loops above (GCC vectorizes neither
// the table's lookups nor the NaN-aware maximum); false where the block holds inf or NaN.
AMP_AVX2 bool encode_block_avx2(const float* in, uint8_t* codes, float* scale, const CodeBucket* buckets,
                                const CodeLines* lines) {
  __m256i bits = _mm256_setzero_si256();
  for (int64_t i = 0; i < kCodeBlock; i += 8) bits = avx2::absmax_bits(bits, _mm256_loadu_ps(in + i));
  return avx2::encode_block(in, bits, codes, scale, buckets, lines);
}

AMP_AVX2 void decode_block_avx2(const uint8_t* codes, float scale, const float* map, float* out) {
  const __m256 s = _mm256_set1_ps(scale);
  for (int64_t i = 0; i < kCodeBlock; i += 8) _mm256_storeu_ps(out + i, avx2::decode8(codes + i, s, map));
}

// A block with AVX-512 (codes_avx512.h): the same scale, quotients and codes as the loops above.
AMP_AVX512 bool encode_block_avx512(const float* in, uint8_t* codes, float* scale, const CodeBucket* buckets,
                                   const CodeLines* lines) {
  __m512i bits = _mm512_setzero_si512();
  for (int64_t i = 0; i < kCodeBlock; i += 16) bits = avx512::absmax_bits(bits, _mm512_loadu_ps(in + i));
  return avx512::encode_block(in, bits, codes, scale, buckets, lines);
}

AMP_AVX512 void decode_block_avx512(const uint8_t* codes, float scale, const float* map, float* out) {
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < kCodeBlock; i += 16) _mm512_storeu_ps(out + i, avx512::decode16(codes + i, s, map));
}
#endif

// The cap force_codec_loops set; -1 until one is set: default_codec_loops(), decided at the first use.
std::atomic<int> widest_allowed{-1};

}  // namespace

bool codec_loops_on_cpu(CodecLoops level) {
#if defined(AMP_HAVE_AVX2_CODES)
  // __builtin_cpu_init first: a caller may run from a static initializer that comes before libgcc's.
  static const bool avx2 = (__builtin_cpu_init(), __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"));
  static const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  static const bool vbmi = avx512 && __builtin_cpu_supports("avx512vbmi");
  return level == CodecLoops::kPortable ||
         (level == CodecLoops::kAvx2 ? avx2 : level == CodecLoops::kAvx512 ? avx512 : vbmi);
#else
  return level == CodecLoops::kPortable;
#endif
}

namespace {

void encode_block(const float* in, uint8_t* codes, float* scale, const float* map, const CodeBucket* buckets,
                  const CodeLines* lines) {
#ifdef AMP_HAVE_AVX512_CODES
  if (codec_loops_at(CodecLoops::kAvx512) && encode_block_avx512(in, codes, scale, buckets, lines)) return;
#endif
#ifdef AMP_HAVE_AVX2_CODES
  if (codec_loops_at(CodecLoops::kAvx2) && encode_block_avx2(in, codes, scale, buckets, lines)) return;
#endif
  // The portable loops, and with vectors a block holding inf or NaN (the vector encodes return false there).
  float scaled[kCodeBlock];
  *scale = scale_block(in, scaled);
  if (std::isfinite(*scale)) {
    codes_by_buckets(scaled, codes, buckets);
  } else {  // inf or NaN in the block: the search, as torchao's
    for (int64_t i = 0; i < kCodeBlock; ++i) codes[i] = code_by_search(scaled[i], map);
  }
}

AMP_VECTOR_CLONES void decode_block(const uint8_t* __restrict codes, float scale, const float* __restrict map,
                                    float* __restrict out) {
  for (int64_t i = 0; i < kCodeBlock; ++i) out[i] = map[codes[i]] * scale;
}

AMP_VECTOR_CLONES void widen_bf16(const uint16_t* __restrict in, float* __restrict out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t b = static_cast<uint32_t>(in[i]) << 16;
    std::memcpy(out + i, &b, sizeof b);
  }
}

// Stochastic rounding to bf16, element i taking 16 bits of draw (first + i) / 4: one splitmix64 output serves 4
// consecutive elements of the optimizer's numbering, wherever a chunk or a shard starts.
// x86-64-v4's 64-bit vector multiplies (AVX-512DQ) vectorize splitmix64; v3 and the baseline emulate them.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void round_groups(const float* __restrict in, uint16_t* __restrict out, int64_t groups, uint64_t seed,
                  uint64_t first_draw) {
  for (int64_t k = 0; k < groups; ++k) {
    const uint64_t bits = random_bits(seed, first_draw + static_cast<uint64_t>(k));
    for (int j = 0; j < 4; ++j) out[4 * k + j] = round_stochastically(in[4 * k + j], static_cast<uint16_t>(bits >> (16 * j)));
  }
}

#ifdef AMP_HAVE_AVX512_CODES
// round_groups with AVX-512, 8 groups (32 values) a step (bf16_rounding_simd.h): the same draws and the same
// rounding, so the same bits (GCC's vectorization of the loop above left it 5x the cost of rounding to nearest on Zen 5).
AMP_AVX512 void round_groups_avx512(const float* in, uint16_t* out, int64_t groups, uint64_t seed, uint64_t first_draw) {
  avx512::SplitMix8 draws(seed, first_draw);
  int64_t k = 0;
  for (; k + 8 <= groups; k += 8) {
    const __m512i words = draws.next();
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 4 * k),
                        avx512::round16_stochastically(_mm512_loadu_ps(in + 4 * k), avx512::low_words(words)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 4 * k + 16),
                        avx512::round16_stochastically(_mm512_loadu_ps(in + 4 * k + 16), avx512::high_words(words)));
  }
  if (k < groups) round_groups(in + 4 * k, out + 4 * k, groups - k, seed, first_draw + static_cast<uint64_t>(k));
}
#endif

#ifdef AMP_HAVE_AVX2_CODES
// round_groups with AVX2, 4 groups (16 values) a step: the same draws and rounding (bf16_rounding_simd.h).
AMP_AVX2 void round_groups_avx2(const float* in, uint16_t* out, int64_t groups, uint64_t seed, uint64_t first_draw) {
  avx2::SplitMix4 draws(seed, first_draw);
  int64_t k = 0;
  for (; k + 4 <= groups; k += 4) {
    const __m256i words = draws.next();
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 4 * k),
                     avx2::round8_stochastically(_mm256_loadu_ps(in + 4 * k), _mm256_castsi256_si128(words)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 4 * k + 8),
                     avx2::round8_stochastically(_mm256_loadu_ps(in + 4 * k + 8), _mm256_extracti128_si256(words, 1)));
  }
  if (k < groups) round_groups(in + 4 * k, out + 4 * k, groups - k, seed, first_draw + static_cast<uint64_t>(k));
}
#endif

void round_bf16_stochastically(const float* in, uint16_t* out, int64_t n, uint64_t seed, uint64_t first) {
  auto one = [&](int64_t i) {
    const uint64_t g = first + static_cast<uint64_t>(i);
    out[i] = round_stochastically(in[i], static_cast<uint16_t>(random_bits(seed, g >> 2) >> (16 * (g & 3))));
  };
  int64_t i = 0;
  for (; i < n && ((first + static_cast<uint64_t>(i)) & 3) != 0; ++i) one(i);
  const int64_t groups = (n - i) / 4;
  const uint64_t first_draw = (first + static_cast<uint64_t>(i)) >> 2;
#ifdef AMP_HAVE_AVX512_CODES
  if (codec_loops_at(CodecLoops::kAvx512)) {
    round_groups_avx512(in + i, out + i, groups, seed, first_draw);
  } else if (codec_loops_at(CodecLoops::kAvx2)) {
    round_groups_avx2(in + i, out + i, groups, seed, first_draw);
  } else {
    round_groups(in + i, out + i, groups, seed, first_draw);
  }
#else
  round_groups(in + i, out + i, groups, seed, first_draw);
#endif
  for (i += 4 * groups; i < n; ++i) one(i);
}

#ifdef AMP_HAVE_AVX512_CODES
// NOTE [Choosing the decode by timing it]
// Which decode is faster is the core's (and its microcode's): a gather of 16 floats takes about 21 cycles on Zen 5,
// where the planes' permutes decode 4x faster; on Sapphire Rapids the gather was the faster (0.16 ns a value against
// 0.22); Intel's cores with the Gather Data Sampling mitigation in their microcode (Skylake to Tiger Lake) run
// gathers several times slower than before it. No rule by vendor or model holds, so on a CPU with VBMI the first use
// times both the way the 8-bit step runs them (each block's codes decoded and consumed: from the block's buffer, or
// straight from the gathers' registers), alternating, and keeps the faster by each one's fastest pass. Both give the
// same bits (StateFormatCodecTest runs both); only time depends on the choice. About 0.1 ms, once per process.
constexpr int64_t kTimedBlocks = 64;  // 16 KiB of codes: the step's working set is a block, not the tensor

AMP_AVX512 double decode_pass_seconds(bool by_permutes, const uint8_t* codes, const float* map, const uint8_t* planes,
                                      float* sink) {
  alignas(64) float decoded[kCodeBlock];
  const __m512 one = _mm512_set1_ps(1.0f);
  __m512 sum = _mm512_setzero_ps();
  const auto start = std::chrono::steady_clock::now();
  for (int64_t b = 0; b < kTimedBlocks * kCodeBlock; b += kCodeBlock) {
    if (by_permutes) {
      avx512::decode_block_by_permutes(codes + b, 1.0f, planes, decoded);
      for (int64_t j = 0; j < kCodeBlock; j += 16) sum = _mm512_add_ps(sum, _mm512_load_ps(decoded + j));
    } else {
      for (int64_t j = 0; j < kCodeBlock; j += 16) sum = _mm512_add_ps(sum, avx512::decode16(codes + b + j, one, map));
    }
  }
  const auto seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  *sink += _mm512_reduce_add_ps(sum);  // the decodes' results are used
  return seconds;
}
#endif

}  // namespace

DecodeTimes time_decodes() {
#ifdef AMP_HAVE_AVX512_CODES
  if (!codec_loops_on_cpu(CodecLoops::kAvx512Vbmi)) return {};
  std::vector<float> map(256);
  for (int c = 0; c < 256; ++c) map[c] = static_cast<float>(c - 128) / 128.0f;
  std::vector<uint8_t> planes(kMapByteSize), codes(kTimedBlocks * kCodeBlock);
  map_byte_planes(map.data(), planes.data());
  uint64_t state = 0x9e3779b97f4a7c15ull;  // codes in no order, as a moment's are
  for (auto& c : codes) c = static_cast<uint8_t>((state = state * 6364136223846793005ull + 1442695040888963407ull) >> 56);
  float sink = 0;
  DecodeTimes t{1e9, 1e9};
  for (int pass = 0; pass < 9; ++pass) {  // the first pass warms the caches; a minimum ignores interruptions
    for (const bool by_permutes : {false, true}) {
      const double s = decode_pass_seconds(by_permutes, codes.data(), map.data(), planes.data(), &sink) /
                       static_cast<double>(kTimedBlocks * kCodeBlock);
      double& fastest = by_permutes ? t.by_permutes : t.by_gathers;
      if (pass > 0) fastest = std::min(fastest, s);
    }
  }
  if (!std::isfinite(sink)) return {};  // the sums used, so the decodes are kept (finite map: never taken)
  return t;
#else
  return {};
#endif
}

void force_codec_loops(CodecLoops widest) { widest_allowed = static_cast<int>(widest); }

CodecLoops default_codec_loops() {
#ifdef AMP_HAVE_AVX512_CODES
  // Timed once (NOTE [Choosing the decode by timing it]); a function's static is thread-safe to initialize.
  static const CodecLoops chosen = [] {
    const DecodeTimes t = time_decodes();
    return t.by_permutes > 0 && t.by_permutes < t.by_gathers ? CodecLoops::kAvx512Vbmi : CodecLoops::kAvx512;
  }();
  return chosen;
#else
  return CodecLoops::kAvx512;
#endif
}

bool codec_loops_at(CodecLoops level) {
  int widest = widest_allowed.load();
  if (widest < 0) widest = static_cast<int>(default_codec_loops());
  return codec_loops_on_cpu(level) && static_cast<int>(level) >= widest;
}

void decode(const StateView& view, int64_t begin, int64_t n, float* out) {
  switch (view.kind) {
    case StateKind::kFloat: std::memcpy(out, static_cast<const float*>(view.data) + begin, n * sizeof(float)); return;
    case StateKind::kBFloat16: widen_bf16(static_cast<const uint16_t*>(view.data) + begin, out, n); return;
    case StateKind::kHalf: {
      const auto* in = static_cast<const c10::Half*>(view.data) + begin;
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(in[i]);
      return;
    }
    case StateKind::kCodes: {
      const auto* codes = static_cast<const uint8_t*>(view.data);
      for (int64_t b = 0; b < n; b += kCodeBlock) {
#ifdef AMP_HAVE_AVX512_CODES
        if (view.map_bytes != nullptr && codec_loops_at(CodecLoops::kAvx512Vbmi)) {
          avx512::decode_block_by_permutes(codes + begin + b, view.scales[(begin + b) / kCodeBlock], view.map_bytes,
                                           out + b);
          continue;
        }
        if (codec_loops_at(CodecLoops::kAvx512)) {
          decode_block_avx512(codes + begin + b, view.scales[(begin + b) / kCodeBlock], view.map, out + b);
          continue;
        }
#endif
#ifdef AMP_HAVE_AVX2_CODES
        if (codec_loops_at(CodecLoops::kAvx2)) {
          decode_block_avx2(codes + begin + b, view.scales[(begin + b) / kCodeBlock], view.map, out + b);
          continue;
        }
#endif
        decode_block(codes + begin + b, view.scales[(begin + b) / kCodeBlock], view.map, out + b);
      }
      return;
    }
  }
}

void encode(const StateView& view, int64_t begin, int64_t n, const float* in) {
  switch (view.kind) {
    case StateKind::kFloat: std::memcpy(static_cast<float*>(view.data) + begin, in, n * sizeof(float)); return;
    case StateKind::kBFloat16: {
      auto* out = static_cast<uint16_t*>(view.data) + begin;
      if (!view.stochastic) {
        convert(in, Dtype::BFloat16, out, n);
        return;
      }
      round_bf16_stochastically(in, out, n, view.seed, view.first + static_cast<uint64_t>(begin));
      return;
    }
    case StateKind::kHalf: convert(in, Dtype::Half, static_cast<char*>(view.data) + begin * 2, n); return;
    case StateKind::kCodes: {
      auto* codes = static_cast<uint8_t*>(view.data);
      for (int64_t b = 0; b < n; b += kCodeBlock) {
        encode_block(in + b, codes + begin + b, view.scales + (begin + b) / kCodeBlock, view.map, view.buckets, view.lines);
      }
      return;
    }
  }
}

}  // namespace amp::detail::cpu
