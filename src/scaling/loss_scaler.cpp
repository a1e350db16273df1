#include "amp/loss_scaler.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "options/format.h"

namespace amp {

LossScaler::LossScaler(LossScale loss_scale, std::optional<double> min_loss_scale, double max_loss_scale)
    : dynamic_(loss_scale.is_dynamic()),
      min_scale_(std::max(min_loss_scale.value_or(0.0), kSmallestScale)),
      max_scale_(max_loss_scale) {
  scale_ = dynamic_ ? std::clamp(loss_scale.value(), min_scale_, std::max(min_scale_, max_scale_)) : loss_scale.value();
}

LossScaler::LossScaler(const Properties& p) : LossScaler(p.loss_scale, p.min_loss_scale, p.max_loss_scale) {
  growth_factor_ = p.growth_factor;
  backoff_factor_ = p.backoff_factor;
  growth_interval_ = p.growth_interval;
  hysteresis_ = hysteresis_left_ = p.hysteresis;
  // The first scale is init_scale clamped into [min_loss_scale, max_loss_scale] (Apex clamps only at the top,
  // so a floor above 2^16 started the scaler below its own minimum).
  if (dynamic_) scale_ = std::clamp(p.init_scale, min_scale_, std::max(min_scale_, max_scale_));
}

bool LossScaler::update_scale(bool overflow) {
  if (overflow) {
    if (dynamic_) {
      if (hysteresis_left_ > 1) {
        --hysteresis_left_;  // delayed shift: skip the step, keep the scale
      } else {
        scale_ = std::max(min_scale_, scale_ * backoff_factor_);
      }
    }
    unskipped_ = 0;
    return true;
  }
  ++unskipped_;
  if (dynamic_ && unskipped_ >= growth_interval_) {
    scale_ = std::min(max_scale_, scale_ * growth_factor_);
    unskipped_ = 0;
    hysteresis_left_ = hysteresis_;
  }
  return false;
}

void LossScaler::load(double loss_scale, int64_t unskipped, std::optional<int64_t> hysteresis_left) {
  const bool in_range = dynamic_ ? (loss_scale >= min_scale_ && loss_scale <= max_scale_)
                                 : (loss_scale > 0.0 && std::isfinite(loss_scale));
  if (!in_range) {
    throw std::invalid_argument("amp: checkpointed loss scale " + detail::format_float(loss_scale) +
                                " is outside this scaler's range [" + detail::format_float(min_scale_) + ", " +
                                detail::format_float(max_scale_) +
                                "]; load checkpoints with the min_loss_scale/max_loss_scale they were saved with.");
  }
  if (unskipped < 0 || (dynamic_ && unskipped >= growth_interval_)) {
    throw std::invalid_argument("amp: checkpointed unskipped count " + std::to_string(unskipped) + " is outside [0, " +
                                std::to_string(growth_interval_) + ") (growth_interval " +
                                std::to_string(growth_interval_) + "); resume with the growth_interval the "
                                "checkpoint was saved with.");
  }
  const int64_t left = hysteresis_left.value_or(hysteresis_);
  if (left < 1 || left > hysteresis_) {
    throw std::invalid_argument("amp: checkpointed hysteresis count " + std::to_string(left) + " is outside [1, " +
                                std::to_string(hysteresis_) + "]; resume with the hysteresis the checkpoint was "
                                "saved with.");
  }
  scale_ = loss_scale;
  unskipped_ = unskipped;
  hysteresis_left_ = static_cast<int>(left);
  device_.reset();  // the next backward that never waits starts its device state from this one
}

}  // namespace amp
