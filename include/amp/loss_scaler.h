#pragma once
// Apex's LossScaler: the dynamic loss-scale state machine, made safe at its bounds.

#include <cstdint>
#include <optional>

#include "amp/loss_scale.h"

namespace amp {

/// One loss scaler (Apex's `LossScaler`). Dynamic scaling starts at min(2^16, max_loss_scale); an
/// overflow halves the scale (never below min_loss_scale, and never below 2^-126, the smallest normal
/// float, so it can't reach 0 or a denormal) and skips the step; after `scale_window` (2000) clean
/// backward passes in a row the scale doubles, never above max_loss_scale (at most the largest float).
/// A fixed scale never changes; an overflow under it still skips the step.
///
/// Example:
///   amp::LossScaler scaler(amp::LossScale::dynamic());
///   bool skip = scaler.update_scale(/*overflow=*/true);   // skip == true, scale 32768
class LossScaler {
 public:
  static constexpr int64_t kScaleWindow = 2000;
  static constexpr double kSmallestScale = 1.1754943508222875e-38;  // 2^-126

  explicit LossScaler(LossScale loss_scale, std::optional<double> min_loss_scale = std::nullopt,
                      double max_loss_scale = 16777216.0);

  /// Returns the current scale.
  double loss_scale() const noexcept { return scale_; }
  /// Returns whether the scale adapts to overflows.
  bool dynamic() const noexcept { return dynamic_; }
  /// Returns the number of clean backward passes since the last overflow or growth (Apex's `_unskipped`).
  int64_t unskipped() const noexcept { return unskipped_; }

  /// Applies one backward pass's outcome (Apex's update_scale()); returns whether the step must be skipped.
  bool update_scale(bool overflow);

  /// Restores a saved state; throws std::invalid_argument on a scale outside [min, max] or a negative counter.
  void load(double loss_scale, int64_t unskipped);

 private:
  bool dynamic_;
  double scale_;
  int64_t unskipped_ = 0;
  double min_scale_;
  double max_scale_;
};

}  // namespace amp
