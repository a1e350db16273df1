#pragma once
// The loss scale setting: Apex's `loss_scale="dynamic" | float` as a value type.

#include <string>
#include <string_view>

namespace amp {

/// A dynamic or fixed loss scale.
///
/// Example:
///   amp::Options("O2").loss_scale(amp::LossScale::fixed(128.0));
class LossScale {
 public:
  /// Returns a dynamic loss scale that starts at min(2^16, max_loss_scale).
  static LossScale dynamic();
  /// Returns a fixed loss scale; throws std::invalid_argument unless value is a normal positive float
  /// (in [2^-126, 3.4028234663852886e+38]).
  static LossScale fixed(double value);

  /// Returns whether the scale adapts to overflows.
  bool is_dynamic() const noexcept { return dynamic_; }
  /// Returns the fixed value, or the initial scale (2^16) if dynamic.
  double value() const noexcept { return value_; }

  friend bool operator==(const LossScale& a, const LossScale& b) noexcept {
    return a.dynamic_ == b.dynamic_ && a.value_ == b.value_;
  }
  friend bool operator!=(const LossScale& a, const LossScale& b) noexcept { return !(a == b); }

 private:
  LossScale(bool dynamic, double value) : dynamic_(dynamic), value_(value) {}
  bool dynamic_;
  double value_;
};

/// Parses "dynamic" or a positive finite number ("128", "128.0", "1e3"); throws std::invalid_argument.
LossScale parse_loss_scale(std::string_view text);

/// Returns "dynamic" or the value as Python prints a float ("128.0").
std::string to_string(const LossScale& scale);

}  // namespace amp
