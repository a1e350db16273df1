#include "amp/options.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

#include <torch/version.h>

#include "options/format.h"
#include "options/option_text.h"
#include "opt_levels/spec.h"

namespace amp {
namespace {

bool is_low_precision(c10::ScalarType t) { return t == c10::ScalarType::Half || t == c10::ScalarType::BFloat16; }

bool is_model_dtype(c10::ScalarType t) { return t == c10::ScalarType::Float || is_low_precision(t); }

constexpr int kMaxNumLosses = 1024;  // a scaler per loss; far above any real model's count

[[noreturn]] void fail(const std::string& message) { throw std::invalid_argument("amp::Options: " + message); }

}  // namespace

Options::Options(std::string_view level) : level_(parse_opt_level(level)) {}

Properties Options::resolve() const {
  Properties p = properties(level_);
  // Every override replaces the level's value (the option table writes the copies) ...
#define AMP_APPLY_OVERRIDE(type, name, default_value, help) \
  if (name##_) p.name = *name##_;
  AMP_OPTION_FIELDS(AMP_APPLY_OVERRIDE)
#undef AMP_APPLY_OVERRIDE
  // ... and the level's "low precision" is low_precision_dtype (Apex hard-codes float16), unless cast_model_type
  // names it.
  if (cast_model_type_) {
    if (is_low_precision(*cast_model_type_)) p.low_precision_dtype = *cast_model_type_;
  } else if (p.cast_model_type && is_low_precision(*p.cast_model_type)) {
    p.cast_model_type = p.low_precision_dtype;
  }
  check_rules(p);
  return p;
}

// Apex's Properties.__setattr__ rules and amp's own, one field at a time in Apex's order. Each reads only the
// fields before it, so checking the resolved properties is checking them as Apex sets them.
void Options::check_rules(const Properties& p) const {
  const std::string level = to_string(level_);

  if (low_precision_dtype_ && !is_low_precision(*low_precision_dtype_)) {
    fail("low_precision_dtype must be torch::kHalf (float16) or torch::kBFloat16 (bfloat16), got " +
         dtype_name(*low_precision_dtype_) + ".");
  }
  if (cast_model_type_) {
    if (!is_model_dtype(*cast_model_type_)) {
      fail("cast_model_type must be torch::kFloat, torch::kHalf or torch::kBFloat16, got " +
           dtype_name(*cast_model_type_) + ".");
    }
    if (level_ == OptLevel::O1 && *cast_model_type_ != c10::ScalarType::Float) {
      fail("O1 inserts casts around Torch functions rather than model weights, so with O1, the model weights "
           "themselves should remain FP32. If you wish to cast the model to a different type, use opt_level='O2' "
           "or 'O3'. cast_model_type was " + dtype_name(*cast_model_type_) + ".");
    }
    if (low_precision_dtype_ && is_low_precision(*cast_model_type_) && *cast_model_type_ != *low_precision_dtype_) {
      fail("cast_model_type " + dtype_name(*cast_model_type_) + " contradicts low_precision_dtype " +
           dtype_name(*low_precision_dtype_) + ". Set only one of them, or set both to the same dtype.");
    }
  }
  if (patch_torch_functions_) {
    if (*patch_torch_functions_ && level_ != OptLevel::O1) {
      fail("Currently, patch_torch_functions=True should only be set by selecting opt_level='O1' (got opt_level " +
           level + ").");
    }
  }
  if (cast_lists_) {
    if (*cast_lists_ != CastLists::kApex && !p.patch_torch_functions) {
      fail(std::string("cast_lists chooses the lists of O1's per-op casts, so it applies where the forward runs under "
                       "them (O1) only; got cast_lists ") + to_string(*cast_lists_) + " at opt_level " + level +
           ". Remove it, or use O1.");
    }
  }
  if (keep_batchnorm_fp32_) {
    if (level_ == OptLevel::O1) {
      fail("With opt_level O1, batchnorm functions are automatically patched to run in FP32, so "
           "keep_batchnorm_fp32 should be None (do not set it). It was set to " + detail::python_bool(*keep_batchnorm_fp32_) +
           ".");
    }
  }
  if (cast_frozen_batchnorm_) {
    if (*cast_frozen_batchnorm_ && !(p.cast_model_type && is_low_precision(*p.cast_model_type))) {
      fail("cast_frozen_batchnorm casts frozen BatchNorm layers along with a model cast to low precision, so it "
           "applies at O2 and O3 only (got opt_level " + level + "). Remove it, or use O2.");
    }
  }
  if (master_weights_) {
    if (level_ == OptLevel::O1) {  // Apex rejects any value here, False included
      fail("It doesn't make sense to use master_weights with O1. With O1, your model weights themselves should "
           "be FP32. Remove master_weights (it was set to " + detail::python_bool(*master_weights_) + "), or use opt_level O2.");
    }
  }
  if (cast_model_outputs_) {
    if (!is_model_dtype(*cast_model_outputs_) && *cast_model_outputs_ != c10::ScalarType::Double) {
      fail("cast_model_outputs must be a floating dtype (kFloat, kHalf, kBFloat16 or kDouble), got " +
           dtype_name(*cast_model_outputs_) + ".");
    }
  }
  if (num_losses_) {
    if (*num_losses_ < 1 || *num_losses_ > kMaxNumLosses) {
      fail("num_losses must be in [1, " + std::to_string(kMaxNumLosses) + "] (one loss scaler per loss), got " +
           std::to_string(*num_losses_) + ".");
    }
  }
  constexpr double kFloatMax = std::numeric_limits<float>::max();
  constexpr double kSmallestNormal = 1.1754943508222875e-38;  // 2^-126
  if (max_loss_scale_) {
    if (!(*max_loss_scale_ > 0.0) || !(*max_loss_scale_ <= kFloatMax)) {
      fail("max_loss_scale must be positive and at most the largest float (3.4028234663852886e+38), got " +
           detail::format_float(*max_loss_scale_) + ".");
    }
  }
  if (min_loss_scale_) {
    if (!(*min_loss_scale_ > 0.0) || !std::isfinite(*min_loss_scale_)) {
      fail("min_loss_scale must be positive and finite, got " + detail::format_float(*min_loss_scale_) +
           ". Leave it unset for no floor.");
    }
  }
  if (p.min_loss_scale && *p.min_loss_scale > p.max_loss_scale) {
    fail("min_loss_scale (" + detail::format_float(*p.min_loss_scale) + ") is greater than max_loss_scale (" +
         detail::format_float(p.max_loss_scale) + ").");
  }
  if (init_scale_) {
    if (!(*init_scale_ >= kSmallestNormal) || !(*init_scale_ <= kFloatMax)) {
      fail("init_scale must be in [1.1754943508222875e-38, 3.4028234663852886e+38] (a normal float), got " +
           detail::format_float(*init_scale_) + ".");
    }
  }
  if (growth_factor_) {
    if (!(*growth_factor_ > 1.0) || !(*growth_factor_ <= kFloatMax)) {
      fail("growth_factor must be greater than 1.0 (and finite), got " + detail::format_float(*growth_factor_) +
           ". The default is 2.0.");
    }
  }
  if (backoff_factor_) {
    if (!(*backoff_factor_ > 0.0) || !(*backoff_factor_ < 1.0)) {
      fail("backoff_factor must be in (0, 1), got " + detail::format_float(*backoff_factor_) + ". The default is 0.5.");
    }
  }
  if (growth_interval_) {
    if (*growth_interval_ < 1) {
      fail("growth_interval must be at least 1 (clean steps before the scale grows), got " +
           std::to_string(*growth_interval_) + ". The default is 2000.");
    }
  }
  if (hysteresis_) {
    if (*hysteresis_ < 1) {
      fail("hysteresis must be at least 1 (1 backs off at every overflow, as Apex), got " +
           std::to_string(*hysteresis_) + ".");
    }
  }
  if (master_weights_format_) {  // after every field it depends on
    const MasterWeights format = *master_weights_format_;
    const std::string name = to_string(format);
    if (format != MasterWeights::kCopy) {
      if (!p.master_weights || !p.cast_model_type || !is_low_precision(*p.cast_model_type)) {
        fail("master_weights_format " + name + " is a form of O2's master weights, so it needs a model cast to "
             "bfloat16 with master_weights on; got opt_level " + level + " with master_weights " +
             detail::python_bool(p.master_weights) + ". Use opt_level O2 with low_precision_dtype bfloat16, or "
             "remove master_weights_format.");
      }
      if (*p.cast_model_type != c10::ScalarType::BFloat16) {
        fail("master_weights_format " + name + " keeps the fp32 value in a bfloat16 weight (plus 0, 1 or 2 bytes), "
             "which needs bfloat16's fp32-wide exponent; got " + dtype_name(*p.cast_model_type) + ". float16's "
             "range needs a separate fp32 master: use master_weights_format copy, or low_precision_dtype bfloat16.");
      }
    }
  }
  if (keep_fp32_) {
    for (const auto& pattern : *keep_fp32_) {
      if (pattern.empty()) fail("keep_fp32 got an empty module pattern. Give qualified module names as "
                                "named_modules() prints them, with * and ? wildcards, e.g. {\"head\", \"*.norm\"}.");
    }
  }
  if (keep_fp32_types_) {
    for (const auto& type : *keep_fp32_types_) {
      if (type.name.empty()) fail("keep_fp32_types got a module type without a name. Use keep_fp32_type<T>() or "
                                  "ModuleType::of<T>().");
    }
  }
  if (auto_fp32_) {  // after the level's casts, which it needs
    if (*auto_fp32_ < 0) {
      fail("auto_fp32 is the number of overflows at the loss scale's floor before a module moves to fp32, so it "
           "must be 0 (off) or more, got " + std::to_string(*auto_fp32_) + ". 8 is a good start.");
    }
    const bool low_precision = p.patch_torch_functions || (p.cast_model_type && is_low_precision(*p.cast_model_type));
    if (*auto_fp32_ > 0 && !(p.enabled && low_precision)) {
      fail("auto_fp32 moves modules that keep overflowing in low precision to fp32, so it needs a level with low "
           "precision; got opt_level " + level + (p.enabled ? "" : " with enabled false") + ", which computes "
           "everything in fp32 already. Use O1, O2 or O3, or set auto_fp32 0.");
    }
  }
  if (!fp8_ && !fp8_fields_.empty()) {
    fail(fp8_fields_.front() + " is set, but fp8 is off, so it would change nothing. Turn FP8 on (config: fp8 = true; "
         "code: Options::fp8()), or remove " + fp8_fields_.front() + ".");
  }
  if (fp8_) {  // after the level and dtype, which it depends on
    const Fp8Options& f = *fp8_;
    if (f.amax_history_len() < 1) {
      fail("fp8 amax_history_len is the number of steps of amax history delayed scaling keeps, so it must be at "
           "least 1, got " + std::to_string(f.amax_history_len()) + ". Transformer Engine's default is 1024.");
    }
    if (f.amax_compute_algo() != "max" && f.amax_compute_algo() != "most_recent") {
      fail("fp8 amax_compute_algo must be \"max\" or \"most_recent\" (Transformer Engine's names), got \"" +
           f.amax_compute_algo() + "\".");
    }
    if (f.margin() < 0 || f.margin() > 64) {
      fail("fp8 margin divides the scales by 2^margin, so it must be in [0, 64], got " + std::to_string(f.margin()) +
           ". The default is 0.");
    }
    const bool per_tensor = f.scaling() == Fp8Options::Scaling::kDynamic || f.scaling() == Fp8Options::Scaling::kDelayed;
    const std::string recipe = to_string(f.scaling());
    if (!per_tensor && f.margin() != 0) {
      fail("fp8 margin " + std::to_string(f.margin()) + " is set, but fp8_scaling " + recipe + " fixes its scales (" +
           "torchao's and the OCP MX rules have no margin). Remove margin, or use fp8_scaling dynamic or delayed.");
    }
    if (!per_tensor && std::find(fp8_fields_.begin(), fp8_fields_.end(), "fp8_format") != fp8_fields_.end()) {
      fail(std::string("fp8_format ") + to_string(f.format()) + " is set, but fp8_scaling " + recipe + " uses e4m3 for "
           "activations, weights and gradients alike (its recipe fixes it). Remove fp8_format, or use fp8_scaling "
           "dynamic or delayed.");
    }
    if (f.min_gemm_size() < 0) {
      fail("fp8 min_gemm_size is the smallest in_features * out_features a Linear needs to run in FP8, so it must be "
           "0 or more, got " + std::to_string(f.min_gemm_size()) + ". 0 (the default) puts every eligible Linear in "
           "FP8; docs/fp8.md gives the measured threshold.");
    }
    if (!p.enabled || !p.cast_model_type || !is_low_precision(*p.cast_model_type)) {
      fail("fp8 runs the Linear layers' GEMMs in FP8 on top of a model cast to bfloat16, so it needs opt_level O2 or "
           "O3; got opt_level " + level + (p.enabled ? "" : " with enabled false") + ". Use O2 (fp32 master weights) "
           "with low_precision_dtype bfloat16.");
    }
    if (p.low_precision_dtype != c10::ScalarType::BFloat16) {
      fail("fp8 computes everything outside the FP8 GEMMs in bfloat16 (Transformer Engine's and torchao's recipes), "
           "got low_precision_dtype " + dtype_name(p.low_precision_dtype) + ". Set low_precision_dtype bfloat16 "
           "(code: low_precision_dtype(torch::kBFloat16)).");
    }
#if TORCH_VERSION_MAJOR < 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 1)
    fail(std::string("fp8 needs FP8 dtypes and at::_scaled_mm, which LibTorch has from 2.1 on; this build is ") +
         TORCH_VERSION + ". Build amp against LibTorch 2.1 or newer, or remove fp8.");
#endif
  }
  if (verbosity_) {
    if (*verbosity_ < 0) fail("verbosity must be 0 (silent) or more, got " + std::to_string(*verbosity_) + ".");
  }
}

Options& Options::fp8(bool on) {
  if (on) {
    fp8_ = fp8_recipe_;
  } else {  // an explicit off (a command line over a config file) drops the recipe with it
    fp8_.reset();
    fp8_recipe_ = Fp8Options();
    fp8_fields_.clear();
  }
  return *this;
}

template <class F>
Options& Options::set_fp8_field(const char* key, F&& set) {
  set(fp8_recipe_);
  if (fp8_) set(*fp8_);
  if (std::find(fp8_fields_.begin(), fp8_fields_.end(), key) == fp8_fields_.end()) fp8_fields_.push_back(key);
  return *this;
}

Options& Options::fp8_format(Fp8Options::Format value) {
  return set_fp8_field("fp8_format", [&](Fp8Options& f) { f.format(value); });
}
Options& Options::fp8_scaling(Fp8Options::Scaling value) {
  return set_fp8_field("fp8_scaling", [&](Fp8Options& f) { f.scaling(value); });
}
Options& Options::fp8_amax_history_len(int value) {
  return set_fp8_field("fp8_amax_history_len", [&](Fp8Options& f) { f.amax_history_len(value); });
}
Options& Options::fp8_amax_compute_algo(std::string value) {
  return set_fp8_field("fp8_amax_compute_algo", [&](Fp8Options& f) { f.amax_compute_algo(value); });
}
Options& Options::fp8_margin(int value) {
  return set_fp8_field("fp8_margin", [&](Fp8Options& f) { f.margin(value); });
}
Options& Options::fp8_power_of_2_scales(bool value) {
  return set_fp8_field("fp8_power_of_2_scales", [&](Fp8Options& f) { f.power_of_2_scales(value); });
}
Options& Options::fp8_min_gemm_size(int64_t value) {
  return set_fp8_field("fp8_min_gemm_size", [&](Fp8Options& f) { f.min_gemm_size(value); });
}
Options& Options::fp8_auto_fallback(bool value) {
  return set_fp8_field("fp8_auto_fallback", [&](Fp8Options& f) { f.auto_fallback(value); });
}

std::string Options::describe_overrides() const {
  std::string out;
#define AMP_DESCRIBE_OVERRIDE(type, name, default_value, help) \
  if (name##_) detail::append_option_row(out, #name, detail::option_text(*name##_));
  AMP_OPTION_FIELDS(AMP_DESCRIBE_OVERRIDE)
#undef AMP_DESCRIBE_OVERRIDE
  return out;
}

}  // namespace amp
