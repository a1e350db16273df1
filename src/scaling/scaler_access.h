#pragma once
// What amp's step protocol reads and writes inside a LossScaler: its state on the loss's device (NOTE [A step that
// never waits] in device_scale.h) and the host's view of that state. LossScaler's one friend.

#include <cstdint>
#include <memory>

#include "amp/loss_scaler.h"

namespace amp::detail {

class DeviceScale;

struct ScalerAccess {
  static std::shared_ptr<DeviceScale>& device(LossScaler& s) noexcept { return s.device_; }
  static const DeviceScale* device(const LossScaler& s) noexcept { return s.device_.get(); }
  /// The device update the host's view of `s` is current up to (0: none yet).
  static uint64_t host_update(const LossScaler& s) noexcept { return s.host_update_; }
  static void set_host_update(LossScaler& s, uint64_t update) noexcept { s.host_update_ = update; }
  /// The state of the host machine a CPU DeviceScale runs beside its tensors (its twin).
  static void set_state(LossScaler& s, double scale, int64_t unskipped, int hysteresis_left) noexcept {
    s.scale_ = scale;
    s.unskipped_ = unskipped;
    s.hysteresis_left_ = hysteresis_left;
  }
  /// The host's view becomes the device's state after update number `update`.
  static void take_device_state(LossScaler& s, double scale, int64_t unskipped, int hysteresis_left,
                                uint64_t update) noexcept {
    set_state(s, scale, unskipped, hysteresis_left);
    s.host_update_ = update;
  }
};

}  // namespace amp::detail
