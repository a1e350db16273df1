#pragma once
// The loss scaler on the device, and what the host learns of it later: the pieces of a step that never waits.
//
// NOTE [A step that never waits]
// A backward of amp::scale_loss whose optimizers can all skip a step on the device (amp's fused optimizers,
// OptimizerBase::skips_on_device) never reads the overflow flag on the host. Instead:
//   - the loss scale, its clean-pass counter and its hysteresis live on the loss's device (DeviceScale), and
//     LossScaler::update_scale's state machine runs there, op for op on the same doubles, so the device state is
//     what the host scaler would hold;
//   - the loss is multiplied by, and the gradients unscaled with, tensors of that state, never a host number;
//   - the fused optimizers take the flag and skip inside their step (FusedStepContext::set_found_inf), their step
//     counts on the device with it;
//   - the host learns each backward's outcome when it is there (HostView: a non-blocking copy and an event), at the
//     next poll that finds it ready (the end of a backward, the start of a step or a scale_loss); then the host
//     LossScaler takes the same update, and skipped_steps(), the "Gradient overflow" notice and the overflow report
//     follow. Asking for them before that (loss_scale(), skipped_steps(), ScaledLoss::overflow(), a checkpoint) waits,
//     and counts as a host sync.
// On the CPU every value is there at once, so the host knows each outcome by the end of its backward; the fused step
// takes the flag all the same (a device's step runs before its host knows), so the CPU runs the device's path and
// counts the host syncs a device would make (NOTE [Counting host syncs]). DeferredHostReadsGuard makes the CPU behave as
// a GPU that is never done (the host learns each outcome only when it asks), and HostDecidesGuard as LibTorch's
// optimizers (the host decides every skip): the tests compare the three. amp::GraphCaptureGuard goes one step further for a CUDA graph capture:
// nothing is recorded for the host at all, and the host reads the device afterwards (src/optim/graph_capture.cpp).

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <utility>

#include "amp/loss_scaler.h"

namespace amp::detail {

class DeviceScale;

/// A few device values (a 1-d float64 tensor) the host reads once the device has written them, without waiting.
class HostView {
 public:
  /// Starts the copy of `values` to the host (non-blocking on a device).
  explicit HostView(const at::Tensor& values);
  /// Returns whether the values are on the host; never waits.
  bool ready() const;
  /// Returns value i, waiting for the device if it is not ready (then counted: detail::count_host_sync).
  double value(int64_t i);

 private:
  at::Tensor device_;
  at::Tensor host_;              // pinned on a device, the values themselves on the CPU
  std::shared_ptr<void> event_;  // the device's event after the copy (a c10::Event), none on the CPU
  uint64_t sequence_;
  bool waited_ = false;
};

/// While alive, every HostView on this thread stays not ready until it is waited for: the CPU behaves as a device
/// that never finishes before the host asks (tests of the device path).
class DeferredHostReadsGuard {
 public:
  DeferredHostReadsGuard();
  ~DeferredHostReadsGuard();
  DeferredHostReadsGuard(const DeferredHostReadsGuard&) = delete;
  DeferredHostReadsGuard& operator=(const DeferredHostReadsGuard&) = delete;

 private:
  bool previous_;
};

/// Whether a DeferredHostReadsGuard is alive on this thread (the fused steps then treat a CPU flag as a device's).
bool host_reads_deferred();

/// While alive, every backward on this thread is decided on the host, as with LibTorch's optimizers, even where amp's
/// fused optimizers could skip on the device (tests comparing the two paths).
class HostDecidesGuard {
 public:
  HostDecidesGuard();
  ~HostDecidesGuard();
  HostDecidesGuard(const HostDecidesGuard&) = delete;
  HostDecidesGuard& operator=(const HostDecidesGuard&) = delete;

 private:
  bool previous_;
};

/// Whether a HostDecidesGuard is alive on this thread.
bool host_decides();

/// What the host learns of one unscaled backward of a step that never waits: whether it overflowed, the scale it
/// ran with, and the scaler's state after its update (`source`'s update number `update`).
struct BackwardOutcomeView {
  BackwardOutcomeView(HostView values, int loss_id, uint64_t update, const DeviceScale* source)
      : values(std::move(values)), loss_id(loss_id), update(update), source(source) {}
  bool overflow() { return values.value(0) != 0; }
  HostView values;  // overflow, scale before, scale after, unskipped after, hysteresis_left after
  int loss_id;
  uint64_t update;
  const DeviceScale* source;
};

/// A LossScaler's state on a device: scale (float64), clean passes and hysteresis left (int64), updated by the same
/// state machine as LossScaler::update_scale, without the host.
class DeviceScale {
 public:
  /// Seeds the device state from the host scaler's current state.
  DeviceScale(const LossScaler& host, const c10::Device& device);

  const c10::Device& device() const noexcept { return device_; }
  /// The fp32 factor the loss is multiplied by (the scale rounded to float, as a host multiply rounds it).
  const at::Tensor& multiplier() const noexcept { return multiplier_; }
  /// The fp32 [1] factor gradients are unscaled by: 1/scale in double, rounded to float.
  const at::Tensor& inverse() const noexcept { return inverse_; }
  /// The scale, clean passes and hysteresis left (float64, int64, int64 0-dim tensors).
  const at::Tensor& scale() const noexcept { return scale_; }
  const at::Tensor& unskipped() const noexcept { return unskipped_; }
  const at::Tensor& hysteresis_left() const noexcept { return hysteresis_left_; }

  /// LossScaler::update_scale(overflow) on the device; `overflow` is a 0-dim bool tensor on device(). Returns the
  /// host's view of the outcome (BackwardOutcomeView::values; started, not waited for).
  HostView update(const at::Tensor& overflow);
  /// The same update, with no view for the host (a CUDA graph capture: amp::GraphCaptureGuard).
  void update_on_device(const at::Tensor& overflow);
  /// How many updates ran (the host scaler is current when it has taken the last one's state).
  uint64_t updates() const noexcept { return updates_; }
  /// Copies the device state into `host`, waiting for the device (counted).
  void read_into(LossScaler& host) const;

 private:
  void refresh_factors();

  c10::Device device_;
  // On the CPU (unless DeferredHostReadsGuard makes it a device) the state machine is a LossScaler run on the host,
  // its state copied into the tensors: one ATen op fewer per field, the same numbers (it is the same code).
  std::unique_ptr<LossScaler> cpu_;
  bool dynamic_;
  double min_scale_, max_scale_, growth_factor_, backoff_factor_;
  int64_t growth_interval_, hysteresis_;
  at::Tensor scale_, unskipped_, hysteresis_left_;
  at::Tensor multiplier_, inverse_;
  uint64_t updates_ = 0;
};

}  // namespace amp::detail
