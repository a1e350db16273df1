#pragma once
// FP8 GEMMs for Linear layers on top of O2/O3 (Options::fp8): Transformer Engine's, torchao's and DeepSeek-V3's
// recipes.
//
// Every torch::nn::Linear the precision policy does not keep in fp32, with in_features and out_features
// multiples of the recipe's block (16; 128 blockwise, 32 MXFP8) and in*out at least min_gemm_size, runs its three
// GEMMs in FP8. With per-tensor scales (kDynamic, kDelayed) through at::_scaled_mm:
//   forward      y  = x_e4m3 @ w_e4m3^T                       (out: the level's bfloat16)
//   grad input   dx = g_e5m2 @ w_e4m3                          (kHybrid; g_e4m3 with kE4M3)
//   grad weight  dw = g_e5m2^T @ x_e4m3
// Each tensor is quantized as `(t.float() * scale).clamp(-max, max).to(fp8)` with `scale = max / amax / 2^margin`
// in fp32 (e4m3 max 448, e5m2 max 57344). The GEMM gets the inverse scales, so its result is in the tensor's own
// units. kRowwise, kRowwiseGwHp, kBlockwise and kMxfp8 scale slices, tiles or blocks instead (src/casting/
// fp8_recipes.h). See docs/fp8.md for the mapping to Transformer Engine's and torchao's names.

#include <torch/arg.h>

#include <cstdint>

#include <string>
#include <vector>

namespace amp {

class OptimizerBase;

/// The FP8 recipe of Options::fp8.
///
/// Example:
///   amp::Options("O2").low_precision_dtype(torch::kBFloat16)
///       .fp8(amp::Fp8Options().scaling(amp::Fp8Options::Scaling::kDelayed).amax_history_len(16));
struct Fp8Options {
  /// kHybrid: e4m3 for activations and weights, e5m2 (wider range) for gradients; kE4M3: e4m3 for all three.
  enum class Format { kE4M3, kHybrid };
  /// kDynamic: each GEMM scales by this step's amax (torchao's tensorwise recipe); kDelayed: by the amax history
  /// of the last amax_history_len steps, updated after each optimizer step (Transformer Engine's DelayedScaling).
  /// The others are dynamic, e4m3 for all three tensors (`format` and `margin` are theirs to fix):
  /// kRowwise: torchao's ROWWISE (Float8LinearConfig.from_recipe_name("rowwise")), each operand of each GEMM
  ///   scaled per slice along that GEMM's reduction dimension, power-of-two scales, through at::_scaled_mm;
  /// kRowwiseGwHp: torchao's ROWWISE_WITH_GW_HP: as kRowwise, but the weight of the grad-input GEMM per tensor and
  ///   the grad-weight GEMM in bfloat16;
  /// kBlockwise: DeepSeek-V3: 1x128 tiles of activations and gradients, 128x128 blocks of weights, each scaled by
  ///   448 / amax (torchao's blockwise_fp8_training);
  /// kMxfp8: OCP MX v1.0: blocks of 32 along the reduction dimension, E8M0 scales 2^(floor(log2(amax)) - 8)
  ///   (torchao's to_mx, FLOOR mode).
  /// Blockwise and MXFP8 are emulated for now, on every device (the same FP8 values, dequantized, through a
  /// bfloat16 GEMM: the numerics, not the speed, of SM90's and SM100's kernels); Fp8LayerState::emulated says so.
  enum class Scaling { kDynamic, kDelayed, kRowwise, kRowwiseGwHp, kBlockwise, kMxfp8 };

  TORCH_ARG(Format, format) = Format::kHybrid;
  TORCH_ARG(Scaling, scaling) = Scaling::kDynamic;
  /// Steps of amax history kDelayed keeps (Transformer Engine's default 1024).
  TORCH_ARG(int, amax_history_len) = 1024;
  /// "max" (the history's largest amax) or "most_recent" (the last step's), for kDelayed.
  TORCH_ARG(std::string, amax_compute_algo) = "max";
  /// Scales are divided by 2^margin: headroom for amax growing between updates (kDynamic, kDelayed).
  TORCH_ARG(int, margin) = 0;
  /// Scales rounded down to a power of two, so that scaling loses no bits (kDynamic, kDelayed, kBlockwise;
  /// kRowwise* always do, as torchao's recipes; MXFP8's E8M0 scales are powers of two by construction).
  TORCH_ARG(bool, power_of_2_scales) = false;
  /// Linear layers with in_features * out_features below this stay in bfloat16: small GEMMs lose with FP8
  /// (docs/fp8.md has the measured table).
  TORCH_ARG(int64_t, min_gemm_size) = 0;
  /// A layer the FP8 overflow report names on 8 optimizer steps in a row (taken or skipped) leaves FP8 for
  /// bfloat16 for good: a notice names it, fp8_layers() drops it, fp8_fallbacks() lists it, checkpoints keep it.
  TORCH_ARG(bool, auto_fallback) = false;
};

/// "e4m3" | "hybrid"; "dynamic" | "delayed" | "rowwise" | "rowwise_gw_hp" | "blockwise" | "mxfp8": the config
/// file's spellings.
inline const char* to_string(Fp8Options::Format format) {
  return format == Fp8Options::Format::kE4M3 ? "e4m3" : "hybrid";
}
inline const char* to_string(Fp8Options::Scaling scaling) {
  switch (scaling) {
    case Fp8Options::Scaling::kDynamic: return "dynamic";
    case Fp8Options::Scaling::kDelayed: return "delayed";
    case Fp8Options::Scaling::kRowwise: return "rowwise";
    case Fp8Options::Scaling::kRowwiseGwHp: return "rowwise_gw_hp";
    case Fp8Options::Scaling::kBlockwise: return "blockwise";
    case Fp8Options::Scaling::kMxfp8: return "mxfp8";
  }
  return "?";
}

/// One FP8 layer and its current per-tensor scales. With kDelayed these are the scales the next step will use
/// (1.0 until the first step has an amax; the first step scales by its own amax); with kDynamic, the scales of
/// the most recent GEMMs; with the slice, tile and block recipes, the smallest scale of each tensor's most recent
/// quantization (that of its largest slice, tile or block).
struct Fp8LayerState {
  std::string name;  // qualified module name ("blocks.0.fc1")
  double input_scale, weight_scale, grad_scale;
  bool emulated = false;  // the GEMMs emulate a kernel this device lacks (blockwise, MXFP8; docs/fp8.md)
};

/// Returns the FP8 layers of the models `optimizer` trains, in model order (empty without Options::fp8).
///
/// Example:
///   for (const auto& l : amp::fp8_layers(optimizer)) std::cout << l.name << " " << l.grad_scale << "\n";
std::vector<Fp8LayerState> fp8_layers(const OptimizerBase& optimizer);

/// The layers Fp8Options::auto_fallback moved to bfloat16 so far, in the order it moved them.
std::vector<std::string> fp8_fallbacks(const OptimizerBase& optimizer);

}  // namespace amp
