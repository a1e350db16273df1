#pragma once
// master_weights_format residual8: FlashOptim's 24-bit master (arXiv 2602.23349, flashoptim 0.1.4's
// compute_ecc_bits / reconstruct_fp32_param), the bf16 weight plus one int8 per value.
//
// NOTE [Residual8 masters]
// The weight is the fp32 value rounded to nearest. The residual is the rounding error x - w in units of half the
// weight's ulp (2^(e - 8), e the weight's unbiased exponent, -126 for zero and subnormals), times 127, clamped to
// [-127, 127] and rounded half away from zero: int8. The value is w + r / 127 * 2^(e - 8). Every step is FlashOptim's,
// in its order and in fp32 (the powers of two split in two factors as its kernel does), so the bits are its bits;
// compiled without contracted products (CMakeLists.txt), as a product fused into the final sum would round otherwise
// where the correction is subnormal.

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace amp::detail {

/// residual[k] of fp32 `value[k]` beside its bf16 `weight[k]` (raw bits), for k in [0, n).
void residual8_encode(const float* value, const uint16_t* weight, int8_t* residual, int64_t n);
/// The fp32 value of bf16 `weight[k]` (raw bits) and `residual[k]`, for k in [0, n).
void residual8_decode(const uint16_t* weight, const int8_t* residual, float* value, int64_t n);

/// The same in ATen ops on tensors of any device, bit for bit the loops' (a device's route: NOTE [Lean masters on
/// the device] in lean_masters.h): the int8 residual of fp32 `value` beside its bf16 `weight`, and the fp32 value of
/// `weight` and `residual`.
at::Tensor residual8_encode(const at::Tensor& value, const at::Tensor& weight);
at::Tensor residual8_decode(const at::Tensor& weight, const at::Tensor& residual);

}  // namespace amp::detail
