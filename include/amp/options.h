#pragma once
// Overrides on top of an opt level: Apex's initialize(...) keyword arguments.

#include <c10/core/ScalarType.h>

#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "amp/loss_scale.h"
#include "amp/opt_level.h"
#include "amp/option_fields.h"
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

  // One setter per row of amp/option_fields.h (documented there), e.g. `Options& enabled(bool value)`.
#define AMP_OPTIONS_SETTER(type, name, default_value, help)      \
  Options& name(detail::unoptional_t<type> value) {              \
    name##_ = std::move(value);                                  \
    return *this;                                                \
  }
  AMP_OPTION_FIELDS(AMP_OPTIONS_SETTER)
#undef AMP_OPTIONS_SETTER
  /// Keeps every module of type ModuleImpl (and types derived from it) in fp32, as keep_fp32 keeps modules by
  /// name; adds to keep_fp32_types.
  ///
  /// Example:
  ///   amp::Options("O2").low_precision_dtype(torch::kBFloat16).keep_fp32_type<torch::nn::LayerNormImpl>();
  template <class ModuleImpl>
  Options& keep_fp32_type() {
    if (!keep_fp32_types_) keep_fp32_types_.emplace();
    keep_fp32_types_->push_back(ModuleType::of<ModuleImpl>());
    return *this;
  }
  /// Turns FP8 Linear layers on with the default recipe (amp/fp8.h); fp8(Fp8Options) above takes a recipe.
  Options& fp8() { return fp8(Fp8Options()); }
  /// Turns FP8 on with the recipe the fp8_* setters built (config `fp8 = true`), or off, dropping the recipe.
  Options& fp8(bool on);
  // The recipe one field at a time, as the config keys fp8_format, fp8_scaling, ... set it; they need fp8 on.
  Options& fp8_format(Fp8Options::Format value);
  Options& fp8_scaling(Fp8Options::Scaling value);
  Options& fp8_amax_history_len(int value);
  Options& fp8_amax_compute_algo(std::string value);
  Options& fp8_margin(int value);
  Options& fp8_power_of_2_scales(bool value);
  Options& fp8_min_gemm_size(int64_t value);
  Options& fp8_auto_fallback(bool value);

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
  OptLevel level_;
  // What the user set, per field; nullopt keeps the level's value.
#define AMP_OPTIONS_OVERRIDE(type, name, default_value, help) std::optional<detail::unoptional_t<type>> name##_;
  AMP_OPTION_FIELDS(AMP_OPTIONS_OVERRIDE)
#undef AMP_OPTIONS_OVERRIDE
  template <class F>
  Options& set_fp8_field(const char* key, F&& set);
  // Throws when the resolved `p` breaks a rule (resolve()'s checks).
  void check_rules(const Properties& p) const;
  Fp8Options fp8_recipe_;                 // what the fp8_* setters built, applied by fp8(true)
  std::vector<std::string> fp8_fields_;   // the fp8_* setters called, for resolve's check
};

}  // namespace amp
