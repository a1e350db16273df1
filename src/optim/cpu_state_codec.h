#pragma once
// amp's CPU loops that read and write Adam's moments in a state format (NOTE [Optimizer state formats] in
// state_format.h): fp32, bfloat16 (written with stochastic rounding) or torchao's 8-bit blocks. A fused step decodes
// a chunk into fp32, updates it and encodes it back while it is in cache.

#include <cstdint>

namespace amp::detail::cpu {

enum class StateKind { kFloat, kBFloat16, kHalf, kCodes };

/// One stored moment as the loops see it; element indices are the tensor's own (0 = its first value).
struct StateView {
  StateKind kind = StateKind::kFloat;
  void* data = nullptr;        // the values, or kCodes' codes
  float* scales = nullptr;     // kCodes: one per block of 256 values
  const float* map = nullptr;  // kCodes: the 256 values a code stands for
  bool stochastic = false;     // kBFloat16: written with stochastic rounding, element i taking draw `first + i`
  uint64_t seed = 0, first = 0;
};

constexpr int64_t kCodeBlock = 256;

/// out[0, n) = the fp32 values of elements [begin, begin + n); kCodes: begin and n are multiples of the block.
void decode(const StateView& view, int64_t begin, int64_t n, float* out);
/// Stores in[0, n) as elements [begin, begin + n) (kCodes: whole blocks; each gets its absmax scale).
void encode(const StateView& view, int64_t begin, int64_t n, const float* in);

}  // namespace amp::detail::cpu
