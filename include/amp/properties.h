#pragma once
// What an opt level means: Apex's `Properties`, fully resolved.

#include <c10/core/ScalarType.h>

#include <optional>
#include <string>

#include "amp/loss_scale.h"
#include "amp/opt_level.h"

namespace amp {

/// The resolved settings `initialize` acts on. `properties(level)` gives a level's defaults;
/// `Options::resolve()` gives them with user overrides applied and validated.
struct Properties {
  OptLevel opt_level = OptLevel::O1;
  bool enabled = true;
  /// The dtype parameters are cast to; nullopt leaves them as they are (O1).
  std::optional<c10::ScalarType> cast_model_type;
  /// Runs the forward under per-op casts (O1).
  bool patch_torch_functions = false;
  /// Keeps BatchNorm parameters and buffers fp32 when the model is cast; nullopt at O1.
  std::optional<bool> keep_batchnorm_fp32;
  /// Casts BatchNorm layers frozen with amp::freeze_batchnorm to low precision with the model (the
  /// tutorials' `bn.eval().half()`); by default frozen layers stay fp32 at every level, because the cast
  /// rounds their pretrained statistics. amp's extension.
  bool cast_frozen_batchnorm = false;
  /// Gives the optimizer fp32 master copies of low-precision parameters.
  bool master_weights = false;
  LossScale loss_scale = LossScale::fixed(1.0);
  /// kHalf or kBFloat16: what "low precision" means for this run.
  c10::ScalarType low_precision_dtype = c10::ScalarType::Half;
  /// The dtype floating outputs of the model are cast to.
  c10::ScalarType cast_model_outputs = c10::ScalarType::Float;
  /// How many losses (and loss scalers) scale_loss addresses through loss_id.
  int num_losses = 1;
  std::optional<double> min_loss_scale;
  double max_loss_scale = 16777216.0;  // 2^24
  /// The dynamic scale's first value, clamped into [min_loss_scale, max_loss_scale] (Apex's init_scale).
  double init_scale = 65536.0;  // 2^16
  /// The factor the dynamic scale grows by after growth_interval clean steps (> 1).
  double growth_factor = 2.0;
  /// The factor the dynamic scale shrinks by on an overflow (in (0, 1)).
  double backoff_factor = 0.5;
  /// Clean backward passes in a row before the scale grows (Apex's scale_window).
  int growth_interval = 2000;
  /// 1 is Apex: every overflow backs the scale off. k > 1 is DeepSpeed's delayed shift: every overflow
  /// skips its step, but the scale backs off only at the k-th overflow since the last growth.
  int hysteresis = 1;
  /// 0 is silent; 1 prints the initialize banner and overflow messages, like Apex.
  int verbosity = 1;
};

/// Returns the defaults of `level`: exactly Apex's table, with kHalf as the low-precision dtype.
Properties properties(OptLevel level);

/// Returns the properties as Apex's verbosity=1 banner prints them ("enabled : True" ...).
std::string to_string(const Properties& properties);

/// Returns "torch.float16" style names, as Apex prints dtypes.
std::string dtype_name(c10::ScalarType dtype);

}  // namespace amp
