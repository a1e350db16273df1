#include "amp/loss_scale.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <stdexcept>

#include "options/format.h"

namespace amp {

LossScale LossScale::dynamic() { return LossScale(true, 65536.0); }

LossScale LossScale::fixed(double value) {
  // The scale multiplies an fp32 loss: outside the normal float range it is inf or (nearly) 0 there,
  // and every step would overflow or vanish.
  constexpr double kSmallestNormal = 1.1754943508222875e-38, kFloatMax = 3.4028234663852886e+38;
  if (!(value > 0.0) || !std::isfinite(value)) {
    throw std::invalid_argument("amp: loss_scale must be positive and finite, got " + detail::format_float(value) +
                                ". Use a value such as 128.0, or LossScale::dynamic().");
  }
  if (value < kSmallestNormal || value > kFloatMax) {
    throw std::invalid_argument("amp: loss_scale " + detail::format_float(value) + " is outside the float range [" +
                                detail::format_float(kSmallestNormal) + ", " + detail::format_float(kFloatMax) +
                                "]: in fp32 it would be " + (value > kFloatMax ? "inf" : "0 or a denormal") +
                                ". Use a value such as 128.0, or LossScale::dynamic().");
  }
  return LossScale(false, value);
}

LossScale parse_loss_scale(std::string_view text) {
  if (text == "dynamic") return LossScale::dynamic();
  const std::string s(text);
  char* end = nullptr;
  errno = 0;
  const double value = s.empty() ? 0.0 : std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size() || errno == ERANGE) {
    throw std::invalid_argument("amp: loss_scale must be \"dynamic\" or a positive number such as 128.0, got '" +
                                s + "'");
  }
  return LossScale::fixed(value);
}

std::string to_string(const LossScale& scale) {
  return scale.is_dynamic() ? "dynamic" : detail::format_float(scale.value());
}

}  // namespace amp
