#pragma once
// The random bits amp's stochastic rounding to bfloat16 draws (lean masters' kStochasticRounding, bf16 optimizer
// states): a counter-based generator, so a draw depends on (seed, index) alone: reproducible under a seed,
// independent of threading and of how a tensor is split, and its whole state is two integers a checkpoint keeps.

#include <cstdint>
#include <cstring>

namespace amp::detail {

/// splitmix64's output function: 64 well-mixed bits of draw n of the stream `seed`.
inline uint64_t random_bits(uint64_t seed, uint64_t n) {
  uint64_t z = seed + (n + 1) * 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

/// Rounds f to one of its two bfloat16 neighbours, the upper (in magnitude) with probability equal to the fraction
/// of the gap below it: adding 16 uniform bits under the kept 16 carries into them exactly that often. inf and NaN
/// round to nearest (they stay what they are).
/// Branch-free, so loops over it vectorize; inf keeps its bits, NaN becomes c10's quiet NaN (0x7fc0).
inline uint16_t round_stochastically(float f, uint16_t random) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  const bool special = (b & 0x7f800000u) == 0x7f800000u;
  const bool nan = special && (b & 0x007fffffu) != 0;
  const uint32_t rounded = special ? b : b + random;
  return nan ? uint16_t{0x7fc0} : static_cast<uint16_t>(rounded >> 16);
}

}  // namespace amp::detail
