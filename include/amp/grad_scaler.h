#pragma once
// torch.amp's front door: the C++ GradScaler that LibTorch lacks (pytorch #44710), for scripts written
// with torch.autocast + torch.amp.GradScaler rather than Apex.

#include <ATen/core/Dict.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace amp {

namespace detail {
class FoundInf;
}

/// GradScaler's constructor arguments, with torch.amp's defaults.
struct GradScalerOptions {
  /// The first scale.
  TORCH_ARG(double, init_scale) = 65536.0;
  /// The factor the scale grows by after growth_interval clean steps (> 1).
  TORCH_ARG(double, growth_factor) = 2.0;
  /// The factor the scale shrinks by after a step with inf/NaN gradients (in (0, 1)).
  TORCH_ARG(double, backoff_factor) = 0.5;
  /// Clean steps in a row before the scale grows.
  TORCH_ARG(int, growth_interval) = 2000;
  /// false makes every method a pass-through (scale returns its input, step just steps).
  TORCH_ARG(bool, enabled) = true;
};

/// torch.amp.GradScaler with its exact semantics, defaults, state_dict keys and errors, for any
/// torch::optim optimizer (no amp::initialize needed). Per optimizer and iteration: unscale_ at most
/// once (optional, e.g. before clipping), step once, then update once for all optimizers. Unscaling is
/// one fused pass per (device, dtype). As torch's, the scale and its growth tracker live on the device (created by
/// the first scale() on the outputs' device), updated there with torch's rule (`_amp_update_scale_`: no floor,
/// growth only while the grown scale is finite); an amp::optim::Fused* optimizer takes the inf/NaN flag and skips
/// inside its step, so nothing waits for the device; LibTorch's optimizers need the flag on the host, one read per
/// step. get_scale() and state_dict() read the device (a wait).
///
/// Example (the AMP tutorials' loop):
///   amp::GradScaler scaler;
///   for (auto& batch : *loader) {
///     optimizer.zero_grad();
///     torch::Tensor loss;
///     { amp::AutocastGuard autocast(torch::kCPU, torch::kBFloat16); loss = criterion(model(batch.data), batch.target); }
///     scaler.scale(loss).backward();
///     scaler.unscale_(optimizer);                                   // optional: clip unscaled gradients
///     torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0);
///     scaler.step(optimizer);                                       // skipped after inf/NaN gradients
///     scaler.update();
///   }
class GradScaler {
 public:
  /// Throws std::invalid_argument on torch's invalid values (growth factor <= 1, backoff factor >= 1)
  /// and on a non-positive or non-finite init_scale or a growth_interval below 1.
  explicit GradScaler(GradScalerOptions options = {});
  ~GradScaler();
  GradScaler(GradScaler&&) noexcept;
  GradScaler& operator=(GradScaler&&) noexcept;

  /// Returns outputs * scale (outputs untouched when disabled).
  torch::Tensor scale(const torch::Tensor& outputs);
  /// Divides the optimizer's gradients by the scale in place and records inf/NaN, without a host sync.
  /// Throws if called twice for an optimizer before update(), or after step().
  void unscale_(torch::optim::Optimizer& optimizer);
  /// torch.amp's clipping recipe in one call: unscale_(optimizer) unless this iteration already did, then
  /// amp::clip_grad_norm_'s clipping of the optimizer's gradients (norm_type 2, 1 or INFINITY). Returns the
  /// norm, a 0-dim fp32 tensor (no host sync); where the gradients hold inf/NaN (step() will skip), returns inf
  /// and leaves them as they are. Throws after step().
  torch::Tensor clip_grad_norm_(torch::optim::Optimizer& optimizer, double max_norm, double norm_type = 2.0);
  /// Unscales (unless unscale_ ran), then steps the optimizer unless its gradients held inf/NaN.
  /// Returns the optimizer's step result, or nullopt when a LibTorch optimizer's step was skipped. An
  /// amp::optim::Fused* optimizer takes the inf/NaN flag and skips inside its step (the result is its step's either
  /// way); without unscale_ it gets the scale too (torch's grad_scale): a read-only inf/NaN check, then its step
  /// unscales each gradient as it reads it and stores it back, as torch's fused kernels do.
  std::optional<torch::Tensor> step(torch::optim::Optimizer& optimizer);
  /// Backs the scale off if any optimizer stepped (or unscaled) this iteration saw inf/NaN, else counts a
  /// clean step and grows the scale every growth_interval of them. `new_scale` sets the scale instead.
  void update(std::optional<double> new_scale = std::nullopt);

  /// Returns the scale (init_scale before the first scale(), 1.0 when disabled).
  double get_scale() const;
  double get_growth_factor() const noexcept { return growth_factor_; }
  double get_backoff_factor() const noexcept { return backoff_factor_; }
  int get_growth_interval() const noexcept { return growth_interval_; }
  void set_growth_factor(double value);
  void set_backoff_factor(double value);
  void set_growth_interval(int value);
  bool is_enabled() const noexcept { return enabled_; }

  /// torch's keys: scale, growth_factor, backoff_factor, growth_interval, _growth_tracker (empty when disabled).
  c10::Dict<std::string, c10::IValue> state_dict() const;
  /// Restores state_dict(); throws on an empty dict or a missing or mistyped key, changing nothing.
  void load_state_dict(const c10::Dict<std::string, c10::IValue>& state);

 private:
  enum class Stage { kReady, kUnscaled, kStepped };
  struct OptimizerState;

  OptimizerState& state_of(torch::optim::Optimizer& optimizer);
  std::vector<at::Tensor> scaled_grads(torch::optim::Optimizer& optimizer) const;

  bool enabled_;
  double init_scale_;
  double growth_factor_;
  double backoff_factor_;
  int growth_interval_;
  at::Tensor scale_;           // fp32, created by the first scale(), as torch's lazily created _scale
  at::Tensor growth_tracker_;  // int32, beside it
  int64_t initial_growth_tracker_ = 0;  // what growth_tracker_ starts from (load_state_dict before the first scale)
  std::map<const torch::optim::Optimizer*, std::unique_ptr<OptimizerState>> per_optimizer_;
};

}  // namespace amp
