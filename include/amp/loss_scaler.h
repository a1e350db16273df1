#pragma once
// Apex's LossScaler: the dynamic loss-scale state machine, made safe at its bounds.

#include <cstdint>
#include <memory>
#include <optional>

#include "amp/loss_scale.h"
#include "amp/properties.h"

namespace amp {
class OptimizerBase;
class ScaledLoss;
namespace detail {
class DeviceScale;
struct ScalerAccess;
}  // namespace detail

/// One loss scaler (Apex's `LossScaler`). Dynamic scaling starts at init_scale (2^16) clamped into
/// [min_loss_scale, max_loss_scale]; an overflow multiplies the scale by backoff_factor (0.5; never
/// below min_loss_scale, and never below 2^-126, the smallest normal float, so it can't reach 0 or a
/// denormal) and skips the step; after growth_interval (2000) clean backward passes in a row the scale
/// grows by growth_factor (2), never above max_loss_scale (at most the largest float). With hysteresis
/// k > 1 (DeepSpeed's delayed shift) every overflow still skips its step, but the scale backs off only
/// from the k-th overflow since the last growth. A fixed scale never changes; an overflow under it
/// still skips the step.
///
/// Example:
///   amp::LossScaler scaler(amp::LossScale::dynamic());
///   bool skip = scaler.update_scale(/*overflow=*/true);   // skip == true, scale 32768
class LossScaler {
 public:
  static constexpr double kSmallestScale = 1.1754943508222875e-38;  // 2^-126

  /// A scaler with Apex's hyperparameters.
  explicit LossScaler(LossScale loss_scale, std::optional<double> min_loss_scale = std::nullopt,
                      double max_loss_scale = 16777216.0);
  /// A scaler with the loss-scale settings of resolved properties (init_scale, growth_factor, ...).
  explicit LossScaler(const Properties& properties);

  /// Returns the current scale.
  double loss_scale() const noexcept { return scale_; }
  /// Returns whether the scale adapts to overflows.
  bool dynamic() const noexcept { return dynamic_; }
  /// Returns the number of clean backward passes since the last overflow or growth (Apex's `_unskipped`).
  int64_t unskipped() const noexcept { return unskipped_; }
  /// Returns how many more overflows the scale tolerates before backing off (1: the next one backs off).
  int hysteresis_left() const noexcept { return hysteresis_left_; }
  /// Returns the floor of the dynamic scale (min_loss_scale, at least 2^-126).
  double min_loss_scale() const noexcept { return min_scale_; }
  /// Returns the ceiling of the dynamic scale (max_loss_scale).
  double max_loss_scale() const noexcept { return max_scale_; }
  /// Returns the overflows the scale tolerates after each growth before backing off (1: backs off at once).
  int hysteresis() const noexcept { return hysteresis_; }
  /// Returns the clean backward passes in a row after which the scale grows.
  int growth_interval() const noexcept { return growth_interval_; }
  /// Returns the factor the scale grows by after growth_interval clean passes.
  double growth_factor() const noexcept { return growth_factor_; }
  /// Returns the factor an overflow multiplies the scale by.
  double backoff_factor() const noexcept { return backoff_factor_; }

  /// Replaces the growth schedule (what torch's GradScaler.load_state_dict restores from a state); the
  /// caller validates the values (growth_factor > 1, backoff_factor in (0, 1), growth_interval >= 1).
  void set_schedule(double growth_factor, double backoff_factor, int growth_interval) noexcept {
    growth_factor_ = growth_factor, backoff_factor_ = backoff_factor, growth_interval_ = growth_interval;
  }

  /// Applies one backward pass's outcome (Apex's update_scale()); returns whether the step must be skipped.
  bool update_scale(bool overflow);

  /// Restores a saved state; throws std::invalid_argument on a scale outside [min, max] or a counter
  /// outside its range. `hysteresis_left` nullopt (a checkpoint from before hysteresis) means full.
  void load(double loss_scale, int64_t unskipped, std::optional<int64_t> hysteresis_left = std::nullopt);

 private:
  friend struct detail::ScalerAccess;  // amp's step protocol: the device state (src/scaling/scaler_access.h)

  bool dynamic_;
  double scale_;
  int64_t unskipped_ = 0;
  double min_scale_;
  double max_scale_;
  double growth_factor_ = 2.0;
  double backoff_factor_ = 0.5;
  int growth_interval_ = 2000;
  int hysteresis_ = 1;
  int hysteresis_left_ = 1;
  // This scaler's state on the loss's device, once a backward that never waits ran (NOTE [A step that never waits]
  // in src/scaling/device_scale.h); the values above are then the host's view, current up to host_update_.
  std::shared_ptr<detail::DeviceScale> device_;
  uint64_t host_update_ = 0;
};

}  // namespace amp
