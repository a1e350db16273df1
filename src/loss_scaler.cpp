#include "amp/loss_scaler.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "format.h"

namespace amp {

LossScaler::LossScaler(LossScale loss_scale, std::optional<double> min_loss_scale, double max_loss_scale)
    : dynamic_(loss_scale.is_dynamic()),
      min_scale_(std::max(min_loss_scale.value_or(0.0), kSmallestScale)),
      max_scale_(max_loss_scale) {
  scale_ = dynamic_ ? std::min(max_scale_, loss_scale.value()) : loss_scale.value();
}

bool LossScaler::update_scale(bool overflow) {
  if (overflow) {
    if (dynamic_) scale_ = std::max(min_scale_, scale_ / 2.0);
    unskipped_ = 0;
    return true;
  }
  ++unskipped_;
  if (dynamic_ && unskipped_ == kScaleWindow) {
    scale_ = std::min(max_scale_, scale_ * 2.0);
    unskipped_ = 0;
  }
  return false;
}

void LossScaler::load(double loss_scale, int64_t unskipped) {
  const bool in_range = dynamic_ ? (loss_scale >= min_scale_ && loss_scale <= max_scale_)
                                 : (loss_scale > 0.0 && std::isfinite(loss_scale));
  if (!in_range) {
    throw std::invalid_argument("amp: checkpointed loss scale " + detail::format_float(loss_scale) +
                                " is outside this scaler's range [" + detail::format_float(min_scale_) + ", " +
                                detail::format_float(max_scale_) +
                                "]; load checkpoints with the min_loss_scale/max_loss_scale they were saved with.");
  }
  if (unskipped < 0 || (dynamic_ && unskipped >= kScaleWindow)) {
    throw std::invalid_argument("amp: checkpointed unskipped count " + std::to_string(unskipped) +
                                " is outside [0, 2000); the checkpoint is corrupt.");
  }
  scale_ = loss_scale;
  unskipped_ = unskipped;
}

}  // namespace amp
