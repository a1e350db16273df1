#pragma once
// How amp's messages about Python checkpoints describe what they found: shared by src/interop/python_checkpoint.cpp
// (models and optimizers) and src/interop/python_scaler_state.cpp (Apex's amp and torch.amp's GradScaler states).

#include <ATen/core/ivalue.h>

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace amp::detail {

/// Returns "'a', 'b', ... (n more)": at most `limit` names, quoted.
inline std::string quoted_list(const std::vector<std::string>& names, size_t limit = 12) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < limit; ++i) out += (i ? ", '" : "'") + names[i] + "'";
  if (names.size() > limit) out += ", ... (" + std::to_string(names.size() - limit) + " more)";
  return out;
}

/// Returns how Python would name the value's type, with its article ("a dict", "an int", "None").
inline std::string type_of(const c10::IValue& v) {
  if (v.isNone()) return "None";
  if (v.isTensor()) return "a tensor";
  if (v.isGenericDict()) return "a dict";
  if (v.isList()) return "a list";
  if (v.isTuple()) return "a tuple";
  if (v.isString()) return "a str";
  if (v.isInt()) return "an int";
  if (v.isDouble()) return "a float";
  if (v.isBool()) return "a bool";
  return std::string("a ") + v.tagKind();
}

/// Returns a Python number (int, float, bool or a one-element tensor) as a double, or nullopt.
inline std::optional<double> as_number(const c10::IValue& v) {
  if (v.isDouble()) return v.toDouble();
  if (v.isInt()) return static_cast<double>(v.toInt());
  if (v.isBool()) return v.toBool() ? 1.0 : 0.0;
  if (v.isTensor() && v.toTensor().numel() == 1) return v.toTensor().item<double>();
  return std::nullopt;
}

inline std::string key_text(std::string_view key) { return std::string(key); }

}  // namespace amp::detail
