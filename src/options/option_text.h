#pragma once
// An option's value as Apex prints it (True, torch.float16, 32768.0, dynamic, None): one overload per type a
// row of amp/option_fields.h may have, for the initialize banner and describe_overrides().

#include <optional>
#include <string>
#include <vector>

#include "amp/loss_scale.h"
#include "amp/properties.h"
#include "options/format.h"

namespace amp::detail {

inline std::string option_text(bool value) { return python_bool(value); }
inline std::string option_text(int value) { return std::to_string(value); }
inline std::string option_text(double value) { return format_float(value); }
inline std::string option_text(c10::ScalarType value) { return dtype_name(value); }
inline std::string option_text(const LossScale& value) { return to_string(value); }
inline std::string option_text(CastLists value) { return to_string(value); }
inline std::string option_text(MasterWeights value) { return to_string(value); }
inline std::string option_text(OptimizerStateFormat value) { return to_string(value); }
inline std::string option_text(const std::vector<std::string>& values) {  // Python's list repr: ['head', '*.norm']
  std::string out = "[";
  for (const auto& v : values) out += (out.size() > 1 ? ", '" : "'") + v + "'";
  return out + "]";
}
inline std::string option_text(const std::vector<ModuleType>& types) {
  std::string out = "[";
  for (const auto& t : types) out += (out.size() > 1 ? ", " : "") + t.name;
  return out + "]";
}
inline std::string option_text(const Fp8Options& o) {
  return std::string("Fp8Options(format=") + to_string(o.format()) + ", scaling=" + to_string(o.scaling()) +
         ", amax_history_len=" + std::to_string(o.amax_history_len()) + ", amax_compute_algo=" +
         o.amax_compute_algo() + ", margin=" + std::to_string(o.margin()) + ", power_of_2_scales=" +
         (o.power_of_2_scales() ? "True" : "False") + ", min_gemm_size=" + std::to_string(o.min_gemm_size()) +
         ", auto_fallback=" + (o.auto_fallback() ? "True" : "False") + ")";
}
template <class T>
std::string option_text(const std::optional<T>& value) {
  return value ? option_text(*value) : "None";
}

/// Appends "name<padding>: value\n", the banner's row (names padded to 23 columns, as Apex).
inline void append_option_row(std::string& out, const std::string& name, const std::string& value) {
  out += name;
  out.append(name.size() < 23 ? 23 - name.size() : 0, ' ');
  out += ": " + value + "\n";
}

}  // namespace amp::detail
