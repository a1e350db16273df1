#pragma once
// Stochastic rounding to bfloat16 in ATen ops, for tensors on a device: the generator and the bits of the CPU loops'
// (stochastic_rounding.h: draw g of stream `seed` is 16 bits of random_bits(seed, g / 4)), with the first draw's
// number a tensor on the values' device, so a step whose skip the device decides keeps its draw count there too
// (NOTE [Stored moments on the device] in fused_optimizers.cpp).

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace amp::detail {

/// How many values one 64-bit draw serves: bf16 moments take 16 bits of draw g / 4 for their element g (kFour), lean
/// masters the low 16 bits of draw g (kOne).
enum class ValuesPerDraw { kOne = 1, kFour = 4 };

/// `values` (fp32) rounded to bfloat16 stochastically, element i (row-major) taking number `first + i` of stream
/// `seed`, where `first` is a 0-dim int64 tensor holding the number's bits: bit for bit round_stochastically of
/// random_bits, as the CPU loops write them. Reads nothing on the host.
at::Tensor round_bf16_stochastically(const at::Tensor& values, uint64_t seed, const at::Tensor& first,
                                     ValuesPerDraw per_draw = ValuesPerDraw::kFour);

}  // namespace amp::detail
