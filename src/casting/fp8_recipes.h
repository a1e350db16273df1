#pragma once
// The FP8 recipes that scale slices, tiles or blocks instead of whole tensors (Fp8Options::Scaling kRowwise,
// kRowwiseGwHp, kBlockwise, kMxfp8): how each quantizes the operands of a Linear's three GEMMs, and the autograd
// function that runs them. src/casting/fp8.cpp chooses the layers and calls fp8_recipe_linear for their GEMMs.

#include <ATen/core/Tensor.h>

#include <memory>

#include "amp/fp8.h"

namespace amp::detail {

class Fp8State;

/// Whether `scaling` scales whole tensors (kDynamic, kDelayed).
bool is_per_tensor(Fp8Options::Scaling scaling);
/// The multiple a Linear's in and out features need under `scaling`: 128 (blockwise), 32 (MXFP8), 16 (the rest,
/// at::_scaled_mm's own need).
int64_t fp8_block_of(Fp8Options::Scaling scaling);
/// Whether `scaling` emulates its GEMMs on `device` (dequantized FP8 values through a bfloat16 GEMM) because the
/// device has no kernel for it.
bool fp8_recipe_emulated(Fp8Options::Scaling scaling, const c10::Device& device);

/// An FP8 operand: its e4m3 values and the scales it was quantized with, `values = t * scales` (broadcast per slice,
/// tile or block) for rowwise and blockwise; for MXFP8, `scales` holds the E8M0 biased exponents (uint8, one per
/// block of 32) and `values = t / 2^(scales - 127)`. `amax` is the whole tensor's, in fp32, for the overflow report.
struct Fp8Quantized {
  at::Tensor values, scales, amax;
};

/// torchao's hp_tensor_to_float8_dynamic with AXISWISE granularity: amax per slice along `dim` (kept), scale
/// 448 / max(amax, 1e-12) in float64 then fp32, rounded down to a power of two when `power_of_2`.
Fp8Quantized quantize_rowwise(const at::Tensor& t, int64_t dim, bool power_of_2);
/// The same with one scale for the whole tensor (TENSORWISE; kRowwiseGwHp's weight in the grad-input GEMM).
Fp8Quantized quantize_tensorwise(const at::Tensor& t, bool power_of_2);
/// torchao's torch_blockwise_scale_act_quant_lhs: 2-d `t` in 1x128 tiles along its last dimension; scales [R, C/128].
Fp8Quantized quantize_tiles(const at::Tensor& t, bool power_of_2);
/// torchao's torch_blockwise_scale_weight_quant: 2-d `t` in 128x128 blocks; scales [R/128, C/128].
Fp8Quantized quantize_blocks(const at::Tensor& t, bool power_of_2);
/// torchao's to_mx (FLOOR): 2-d `t` in blocks of 32 along its last dimension; scales [R, C/32] uint8.
Fp8Quantized quantize_mx(const at::Tensor& t);

/// Back to bfloat16, as the emulated GEMMs read them: (values * (1 / scales)) for tiles and blocks, computed in fp32;
/// torchao's MXTensor dequantize (values and 2^(scales - 127) multiplied in bfloat16) for MXFP8.
at::Tensor dequantize_tiles(const Fp8Quantized& q);
at::Tensor dequantize_blocks(const Fp8Quantized& q);
at::Tensor dequantize_mx(const Fp8Quantized& q);

/// `input @ weight^T` (no bias) under `state`'s recipe, as an autograd function whose backward runs the recipe's
/// grad-input and grad-weight GEMMs. `record`: a training forward, whose amaxes feed the overflow report.
at::Tensor fp8_recipe_linear(const at::Tensor& input, const at::Tensor& weight, const std::shared_ptr<Fp8State>& state,
                             int64_t layer, bool record);

}  // namespace amp::detail
