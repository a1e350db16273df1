#pragma once
// Overrides on top of an opt level: Apex's initialize(...) keyword arguments.

#include <c10/core/ScalarType.h>

#include <optional>
#include <string_view>

#include "amp/loss_scale.h"
#include "amp/opt_level.h"
#include "amp/properties.h"

namespace amp {

/// An opt level plus the overrides a user asked for. A setter not called keeps the level's
/// value (Apex's `None`). `resolve()` applies Apex's validation rules.
///
/// Example:
///   auto props = amp::Options("O2").low_precision_dtype(torch::kBFloat16).max_loss_scale(1024).resolve();
class Options {
 public:
  explicit Options(OptLevel level = OptLevel::O1) : level_(level) {}
  /// Parses the level with parse_opt_level.
  explicit Options(std::string_view level);

  Options& enabled(bool value) { return set(enabled_, value); }
  Options& cast_model_type(c10::ScalarType value) { return set(cast_model_type_, value); }
  Options& patch_torch_functions(bool value) { return set(patch_torch_functions_, value); }
  Options& keep_batchnorm_fp32(bool value) { return set(keep_batchnorm_fp32_, value); }
  Options& cast_frozen_batchnorm(bool value) { return set(cast_frozen_batchnorm_, value); }
  Options& master_weights(bool value) { return set(master_weights_, value); }
  Options& loss_scale(LossScale value) { return set(loss_scale_, value); }
  Options& low_precision_dtype(c10::ScalarType value) { return set(low_precision_dtype_, value); }
  Options& cast_model_outputs(c10::ScalarType value) { return set(cast_model_outputs_, value); }
  Options& num_losses(int value) { return set(num_losses_, value); }
  Options& min_loss_scale(double value) { return set(min_loss_scale_, value); }
  Options& max_loss_scale(double value) { return set(max_loss_scale_, value); }
  Options& verbosity(int value) { return set(verbosity_, value); }
  /// Loss-scaler hyperparameters, named as in torch.amp.GradScaler; the defaults are Apex's values.
  Options& init_scale(double value) { return set(init_scale_, value); }
  Options& growth_factor(double value) { return set(growth_factor_, value); }
  Options& backoff_factor(double value) { return set(backoff_factor_, value); }
  Options& growth_interval(int value) { return set(growth_interval_, value); }
  Options& hysteresis(int value) { return set(hysteresis_, value); }
  /// Replaces the opt level, keeping the overrides.
  Options& opt_level(OptLevel value) { level_ = value; return *this; }

  /// Returns the opt level the overrides apply to.
  OptLevel opt_level() const noexcept { return level_; }

  /// Returns the level's properties with the overrides applied; throws std::invalid_argument
  /// naming the field, the value and the allowed values when a rule is broken.
  Properties resolve() const;

  /// Returns a report of the overrides as Apex prints them ("Processing user overrides ...").
  std::string describe_overrides() const;

 private:
  template <class T, class V>
  Options& set(std::optional<T>& field, V value) {
    field = value;
    return *this;
  }

  OptLevel level_;
  std::optional<bool> enabled_;
  std::optional<c10::ScalarType> cast_model_type_;
  std::optional<bool> patch_torch_functions_;
  std::optional<bool> keep_batchnorm_fp32_;
  std::optional<bool> cast_frozen_batchnorm_;
  std::optional<bool> master_weights_;
  std::optional<LossScale> loss_scale_;
  std::optional<c10::ScalarType> low_precision_dtype_;
  std::optional<c10::ScalarType> cast_model_outputs_;
  std::optional<int> num_losses_;
  std::optional<double> min_loss_scale_;
  std::optional<double> max_loss_scale_;
  std::optional<int> verbosity_;
  std::optional<double> init_scale_;
  std::optional<double> growth_factor_;
  std::optional<double> backoff_factor_;
  std::optional<int> growth_interval_;
  std::optional<int> hysteresis_;
};

}  // namespace amp
