#pragma once
// amp's CPU loops that read and write Adam's moments in a state format (NOTE [Optimizer state formats] in
// state_format.h): fp32, bfloat16 (written with stochastic rounding) or torchao's 8-bit blocks. A fused step decodes
// a chunk into fp32, updates it and encodes it back while it is in cache.

#include <cstdint>

namespace amp::detail::cpu {

enum class StateKind { kFloat, kBFloat16, kHalf, kCodes };

/// One bucket of a quantization map's table (NOTE [Finding a code] in the .cpp): bits 0-7 the code of its smallest
/// value, bits 8-24 the key from which a value's code is one more (0x10000: none).
using CodeBucket = uint32_t;

/// One stored moment as the loops see it; element indices are the tensor's own (0 = its first value).
struct StateView {
  StateKind kind = StateKind::kFloat;
  void* data = nullptr;        // the values, or kCodes' codes
  float* scales = nullptr;     // kCodes: one per block of 256 values
  const float* map = nullptr;  // kCodes: the 256 values a code stands for
  const CodeBucket* buckets = nullptr;  // kCodes: code_buckets(map)
  const uint8_t* map_bytes = nullptr;   // kCodes: map_byte_planes(map), for decoding by permutes (may be null)
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
/// The cap amp starts with: kAvx512Vbmi where gathers are slow (AMD's cores: NOTE [Decoding by permutes] in
/// codes_avx512.h), kAvx512 elsewhere. Every level gives the same bits; only the time differs.
CodecLoops default_codec_loops();
void force_codec_loops(CodecLoops widest);
/// Whether the loops of `level` run here: the CPU has them and force_codec_loops allows them.
bool codec_loops_at(CodecLoops level);

/// out[0, n) = the fp32 values of elements [begin, begin + n); kCodes: begin and n are multiples of the block.
void decode(const StateView& view, int64_t begin, int64_t n, float* out);
/// Stores in[0, n) as elements [begin, begin + n) (kCodes: whole blocks; each gets its absmax scale).
void encode(const StateView& view, int64_t begin, int64_t n, const float* in);

}  // namespace amp::detail::cpu
