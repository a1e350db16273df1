#include "amp/properties.h"

// What a resolved configuration is, in words: dtype names as Python prints them, and the table
// amp::initialize's banner and Apex's "Processing user overrides" print.

#include <sstream>
#include <type_traits>

#include "format.h"
#include "opt_levels/spec.h"

namespace amp {
namespace {

template <class T>
std::string optional_str(const std::optional<T>& v) {
  if (!v) return "None";
  if constexpr (std::is_same_v<T, bool>) return detail::python_bool(*v);
  else if constexpr (std::is_same_v<T, c10::ScalarType>) return dtype_name(*v);
  else if constexpr (std::is_same_v<T, double>) return detail::format_float(*v);
  else return std::to_string(*v);
}

}  // namespace

std::string dtype_name(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::ScalarType::Float: return "torch.float32";
    case c10::ScalarType::Half: return "torch.float16";
    case c10::ScalarType::BFloat16: return "torch.bfloat16";
    case c10::ScalarType::Double: return "torch.float64";
    case c10::ScalarType::Int: return "torch.int32";
    case c10::ScalarType::Long: return "torch.int64";
    case c10::ScalarType::Short: return "torch.int16";
    case c10::ScalarType::Char: return "torch.int8";
    case c10::ScalarType::Byte: return "torch.uint8";
    case c10::ScalarType::Bool: return "torch.bool";
    default: return std::string("torch.") + c10::toString(dtype);
  }
}

Properties properties(OptLevel level) { return opt_levels::spec(level).defaults; }

std::string to_string(const Properties& p) {
  std::ostringstream os;
  auto row = [&os](const char* name, const std::string& value) {
    os << name << std::string(23 - std::string(name).size(), ' ') << ": " << value << "\n";
  };
  row("enabled", detail::python_bool(p.enabled));
  row("opt_level", to_string(p.opt_level));
  row("cast_model_type", optional_str(p.cast_model_type));
  row("patch_torch_functions", detail::python_bool(p.patch_torch_functions));
  row("keep_batchnorm_fp32", optional_str(p.keep_batchnorm_fp32));
  row("cast_frozen_batchnorm", detail::python_bool(p.cast_frozen_batchnorm));
  row("master_weights", detail::python_bool(p.master_weights));
  row("loss_scale", to_string(p.loss_scale));
  row("low_precision_dtype", dtype_name(p.low_precision_dtype));
  row("cast_model_outputs", dtype_name(p.cast_model_outputs));
  row("num_losses", std::to_string(p.num_losses));
  row("min_loss_scale", optional_str(p.min_loss_scale));
  row("max_loss_scale", detail::format_float(p.max_loss_scale));
  row("verbosity", std::to_string(p.verbosity));
  row("init_scale", detail::format_float(p.init_scale));
  row("growth_factor", detail::format_float(p.growth_factor));
  row("backoff_factor", detail::format_float(p.backoff_factor));
  row("growth_interval", std::to_string(p.growth_interval));
  row("hysteresis", std::to_string(p.hysteresis));
  return os.str();
}

}  // namespace amp
