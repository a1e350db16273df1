#pragma once
// amp's CPU loops that read and write Adam's moments in a state format (NOTE [Optimizer state formats] in
// state_format.h): fp32, bfloat16 (written with stochastic rounding) or torchao's 8-bit blocks. A fused step decodes
// a chunk into fp32, updates it and encodes it back while it is in cache.

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace amp::detail::cpu {

enum class StateKind { kFloat, kBFloat16, kHalf, kCodes };

/// One bucket of a quantization map's table (NOTE [Finding a code] in the .cpp): bits 0-7 the code of its smallest
/// value, bits 8-24 the key from which a value's code is one more (0x10000: none).
using CodeBucket = uint32_t;

struct CodeLines;

/// One stored moment as the loops see it; element indices are the tensor's own (0 = its first value).
struct StateView {
  StateKind kind = StateKind::kFloat;
  void* data = nullptr;        // the values, or kCodes' codes
  float* scales = nullptr;     // kCodes: one per block of 256 values
  const float* map = nullptr;  // kCodes: the 256 values a code stands for
  const CodeBucket* buckets = nullptr;  // kCodes: code_buckets(map)
  const uint8_t* map_bytes = nullptr;   // kCodes: map_byte_planes(map), for decoding by permutes (may be null)
  const CodeLines* lines = nullptr;  // kCodes: code_lines(map), for encoding without gathers (may be null)
  bool stochastic = false;     // kBFloat16: written with stochastic rounding, element i taking number `first + i`
  uint64_t seed = 0, first = 0;
};

constexpr int64_t kCodeBlock = 256;

// The buckets: per sign, one for |y| < 2^kCodeMinExponent and 2^kCodeMantissaBits for each exponent up to 0.
constexpr int kCodeMantissaBits = 7;
constexpr int kCodeMinExponent = -24;
constexpr int64_t kCodeBucketsPerSign = (2 - kCodeMinExponent) * (int64_t{1} << kCodeMantissaBits);
constexpr int64_t kCodeBuckets = 2 * kCodeBucketsPerSign;
/// Fills `table` (kCodeBuckets entries) for `map` (256 floats); false if a bucket spans more than two codes or a
/// bucket of values below 2^-24 more than one.
bool code_buckets(const float* map, CodeBucket* table);

/// The bucket of y's bits (inf and NaN land in exponent 0's buckets: encode keeps them from here).
inline int32_t bucket_of(uint32_t b) {
  const int32_t sign = static_cast<int32_t>(b >> 31);
  const int32_t exponent = std::min(static_cast<int32_t>((b >> 23) & 0xffu) - 127, 0);
  const int32_t mantissa = static_cast<int32_t>((b >> (23 - kCodeMantissaBits)) & ((1u << kCodeMantissaBits) - 1));
  const int32_t at = (exponent - kCodeMinExponent + 1) * (1 << kCodeMantissaBits) + mantissa;
  return sign * static_cast<int32_t>(kCodeBucketsPerSign) + (exponent < kCodeMinExponent ? 0 : at);
}

/// y's key in its bucket: the low 16 bits, reversed where y < 0 (a larger magnitude is a smaller y).
inline uint32_t key_of(uint32_t b) { return (b ^ (0u - (b >> 31))) & 0xffffu; }

inline uint8_t code_in(CodeBucket word, uint32_t b) {
  return static_cast<uint8_t>((word & 0xffu) + (key_of(b) >= (word >> 8) ? 1u : 0u));
}

/// The code of one value y = x / s from the bucket table (x / s divided here, as torchao divides).
inline uint8_t code_by_buckets(float x, float s, const CodeBucket* table) {
  const float y = x / s;
  uint32_t b;
  std::memcpy(&b, &y, sizeof b);
  return code_in(table[bucket_of(b)], b);
}

/// A map's codes as lines (NOTE [Codes by lines] in the .cpp), for y = x / s computed as x * (1 / s): by the octave
/// of |y| (its exponent field, at least 96, mod 32) a word from which |y|'s bits give its piece; per piece a line
/// through the codes' boundaries in fixed point (kLineFraction bits), whose integer part capped at the piece's last
/// code is the code. A value is *uncertain*, and left to the bucket table, where its line is within kLineBand of a
/// whole number or it is within kSwitchBand floats of where the piece changes.
constexpr int kLineFraction = 12;
constexpr int32_t kLineBand = 2;
constexpr int32_t kSwitchBand = 16;
constexpr int kMaxLinePieces = 16;  // one register of lines
struct CodeLines {
  /// (the piece at the octave's start + 1) * 2^24 - where the next piece starts (none: kSwitchBand past the
  /// octave's end) + kSwitchBand, so that (max(|y|, 2^-31) + piece_word) >> 24 is |y|'s piece and its low 24 bits are below
  /// 2 * kSwitchBand within kSwitchBand of the change.
  alignas(64) uint32_t piece_word[32];
  alignas(64) float slope[kMaxLinePieces];
  alignas(64) float offset[kMaxLinePieces];  // the line's, plus kLineBand
  alignas(64) int32_t last_code[kMaxLinePieces];
  /// Signed maps: y < 0 takes max(mirror - code(|y|), 0). -1: an unsigned map, where y < 0 takes code(0).
  int32_t mirror = -1;
};
/// Fills `lines` for `map`; false where the map's codes are not such lines (then encoding looks every code up in the
/// bucket table). Every float y and every quotient within 2^-21 of it is checked, not sampled.
bool code_lines(const float* map, CodeLines* lines);
/// The lines' code for the bits of y, as the vector loops compute it; *uncertain where it is left to the table.
int32_t code_on_lines(const CodeLines& lines, uint32_t y_bits, bool* uncertain);

/// The map's floats as 4 planes of 256 bytes (plane k: byte k of each float), kMapByteSize bytes: decoding looks
/// codes up in them with AVX-512 VBMI's byte permutes (NOTE [Decoding by permutes] in codes_avx512.h).
constexpr int64_t kMapByteSize = 4 * 256;
void map_byte_planes(const float* map, uint8_t* planes);

/// torchao's quantize_8bit_with_qmap for one value y already divided by its block's scale, by its binary search:
/// the reference the bucket table is built from (and the route for blocks holding inf or NaN).
uint8_t code_by_search(float y, const float* map);

/// Whether x / s is computed with multiply-adds from 1 / s (NOTE [Dividing by the scale] in the .cpp).
inline bool divides_by_reciprocal(float s) { return s >= 0x1p-60f && s <= 0x1p100f; }

/// The loops the codec and the 8-bit Adam step run: the widest this CPU has (AVX-512 with VBMI's byte permutes, else
/// AVX-512, else AVX2, else portable), capped by force_codec_loops (tests and the bench, so every level is checked on
/// one CPU).
enum class CodecLoops { kAvx512Vbmi, kAvx512, kAvx2, kPortable };
/// The cap amp starts with: kAvx512Vbmi where the CPU has VBMI and decoding by permutes is the faster on it, timed
/// once at the first use (NOTE [Choosing the decode by timing it] in the .cpp), kAvx512 elsewhere. Every level gives
/// the same bits; only the time differs.
CodecLoops default_codec_loops();
void force_codec_loops(CodecLoops widest);
/// Seconds a value for the 8-bit step's two ways to decode codes, each its fastest of 8 passes over 64 blocks: what
/// default_codec_loops decides by. Zeros where the CPU has no VBMI (only gathers).
struct DecodeTimes {
  double by_gathers = 0, by_permutes = 0;
};
DecodeTimes time_decodes();
/// Whether the loops of `level` run here: the CPU has them and force_codec_loops allows them.
bool codec_loops_at(CodecLoops level);
/// Whether this CPU has the loops of `level`, whatever the cap.
bool codec_loops_on_cpu(CodecLoops level);

/// out[0, n) = the fp32 values of elements [begin, begin + n); kCodes: begin and n are multiples of the block.
void decode(const StateView& view, int64_t begin, int64_t n, float* out);
/// Stores in[0, n) as elements [begin, begin + n) (kCodes: whole blocks; each gets its absmax scale).
void encode(const StateView& view, int64_t begin, int64_t n, const float* in);

}  // namespace amp::detail::cpu
