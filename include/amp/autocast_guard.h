#pragma once
// RAII guards for amp's per-op casts (O1).

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include "amp/cast_policy.h"

namespace amp {

/// A RAII, thread local (!) guard that runs the ops of its scope under amp's O1 per-op casts on
/// `device`: LibTorch's native autocast lists plus amp's additions that follow Apex's lists
/// (opt_levels/o1_cast_lists.cpp). On destruction it restores the previous state and, when the
/// outermost guard ends, drops the weight-cast cache, so a cast made before an optimizer step is
/// never served after it. amp::Model uses it around the forward at O1; use it directly for code
/// outside the model.
///
/// Example:
///   { amp::AutocastGuard casts(torch::kCPU, torch::kBFloat16); auto y = torch::mm(a, b); }  // y is bf16
class AutocastGuard {
 public:
  AutocastGuard(c10::DeviceType device, c10::ScalarType dtype);
  /// torch.autocast(device, dtype, enabled, cache_enabled): `enabled` false turns autocast (and amp's
  /// casts) off in the scope, e.g. to run a numerically sensitive part in fp32 inside an autocast region;
  /// `cache_enabled` false stops caching casts of fp32 weights in the scope.
  ///
  /// Example:
  ///   amp::AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
  ///   auto features = backbone(x);                                   // bf16 GEMMs
  ///   { amp::AutocastGuard fp32(torch::kCPU, torch::kBFloat16, /*enabled=*/false); loss = head(features.to(torch::kFloat)); }
  AutocastGuard(c10::DeviceType device, c10::ScalarType dtype, bool enabled, bool cache_enabled = true);
  /// With `lists` kNative, only the LibTorch build's own autocast lists cast (torch.amp's O1): Apex's rows
  /// that LibTorch lacks (softmax, GELU, ... in fp32 on the CPU) run as the native lists leave them.
  /// amp::Model uses it at O1 with Options::cast_lists.
  AutocastGuard(c10::DeviceType device, c10::ScalarType dtype, CastLists lists);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;
  AutocastGuard(AutocastGuard&&) = delete;
  AutocastGuard& operator=(AutocastGuard&&) = delete;

 private:
  c10::DeviceType device_;
  bool prev_enabled_;
  c10::ScalarType prev_dtype_;
  bool prev_amp_casts_;
  bool prev_cache_enabled_;
  bool prev_apex_rows_;
};

/// A RAII, thread local (!) guard that turns every per-op cast off in its scope (Apex's
/// `disable_casts`). scale_loss runs backward under it.
class DisableCastsGuard {
 public:
  DisableCastsGuard();
  ~DisableCastsGuard();
  DisableCastsGuard(const DisableCastsGuard&) = delete;
  DisableCastsGuard& operator=(const DisableCastsGuard&) = delete;
  DisableCastsGuard(DisableCastsGuard&&) = delete;
  DisableCastsGuard& operator=(DisableCastsGuard&&) = delete;

 private:
  bool prev_cpu_;
  bool prev_cuda_;
  bool prev_amp_casts_;
};

namespace detail {
/// Returns whether amp's own cast rules apply on this thread (inside an AutocastGuard).
bool amp_casts_active() noexcept;
/// Sets it; for code that reinstates a recorded cast state (amp::checkpoint's recompute).
void set_amp_casts_active(bool active) noexcept;
/// Returns whether the rows of Apex's table apply with amp's casts (cast_lists kApex), and sets it.
bool apex_rows_active() noexcept;
void set_apex_rows_active(bool active) noexcept;
/// Registers amp's cast kernels on the autocast dispatch keys (once per process).
void register_cast_kernels();
}  // namespace detail

}  // namespace amp
