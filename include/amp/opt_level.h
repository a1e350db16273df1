#pragma once
// Apex's optimization levels O0..O3 and their names.

#include <string>
#include <string_view>

namespace amp {

/// Apex's optimization levels. Each one is a preset of `Properties` (see opt_levels/).
enum class OptLevel {
  /// Pure fp32 training: a baseline that must match plain LibTorch bit for bit.
  O0,
  /// Per-op casts inside the forward (GEMM/conv in low precision, reductions and losses in fp32).
  O1,
  /// Low-precision model with fp32 BatchNorm and fp32 master weights in the optimizer.
  O2,
  /// Everything in low precision: a speed ceiling, not a recipe.
  O3,
};

/// Parses exactly "O0", "O1", "O2" or "O3"; throws std::invalid_argument otherwise.
OptLevel parse_opt_level(std::string_view text);

/// Returns "O0".."O3".
std::string to_string(OptLevel level);

/// Returns Apex's one-line description, e.g. "O2:  FP16 training with FP32 batchnorm and FP32 master weights."
std::string brief(OptLevel level);

}  // namespace amp
