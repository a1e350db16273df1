#pragma once
// FP8 GEMMs for Linear layers on top of O2/O3 (Options::fp8): Transformer Engine's and torchao's recipe.
//
// Every torch::nn::Linear the precision policy does not keep in fp32, with in_features and out_features
// multiples of 16, runs its three GEMMs in FP8 through at::_scaled_mm with per-tensor scales:
//   forward      y  = x_e4m3 @ w_e4m3^T                       (out: the level's bfloat16)
//   grad input   dx = g_e5m2 @ w_e4m3                          (kHybrid; g_e4m3 with kE4M3)
//   grad weight  dw = g_e5m2^T @ x_e4m3
// Each tensor is quantized as `(t.float() * scale).clamp(-max, max).to(fp8)` with `scale = max / amax / 2^margin`
// in fp32 (e4m3 max 448, e5m2 max 57344). The GEMM gets the inverse scales, so its result is in the tensor's own
// units. See docs/fp8.md for the mapping to Transformer Engine's DelayedScaling and torchao's Float8LinearConfig.

#include <torch/arg.h>

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
  enum class Scaling { kDynamic, kDelayed };

  TORCH_ARG(Format, format) = Format::kHybrid;
  TORCH_ARG(Scaling, scaling) = Scaling::kDynamic;
  /// Steps of amax history kDelayed keeps (Transformer Engine's default 1024).
  TORCH_ARG(int, amax_history_len) = 1024;
  /// "max" (the history's largest amax) or "most_recent" (the last step's), for kDelayed.
  TORCH_ARG(std::string, amax_compute_algo) = "max";
  /// Scales are divided by 2^margin: headroom for amax growing between updates.
  TORCH_ARG(int, margin) = 0;
};

/// "e4m3" | "hybrid"; "dynamic" | "delayed": the config file's spellings.
inline const char* to_string(Fp8Options::Format format) {
  return format == Fp8Options::Format::kE4M3 ? "e4m3" : "hybrid";
}
inline const char* to_string(Fp8Options::Scaling scaling) {
  return scaling == Fp8Options::Scaling::kDynamic ? "dynamic" : "delayed";
}

/// One FP8 layer and its current per-tensor scales. With kDelayed these are the scales the next step will use
/// (1.0 until the first step has an amax; the first step scales by its own amax); with kDynamic, the scales of
/// the most recent GEMMs.
struct Fp8LayerState {
  std::string name;  // qualified module name ("blocks.0.fc1")
  double input_scale, weight_scale, grad_scale;
};

/// Returns the FP8 layers of the models `optimizer` trains, in model order (empty without Options::fp8).
///
/// Example:
///   for (const auto& l : amp::fp8_layers(optimizer)) std::cout << l.name << " " << l.grad_scale << "\n";
std::vector<Fp8LayerState> fp8_layers(const OptimizerBase& optimizer);

}  // namespace amp
