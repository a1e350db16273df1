#include "amp/properties.h"

// What a resolved configuration is, in words: dtype names as Python prints them, and the table
// amp::initialize's banner and Apex's "Processing user overrides" print.

#include <string_view>

#include "options/option_text.h"
#include "opt_levels/spec.h"

namespace amp {

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

// Here, not with the lists in opt_levels/o1_cast_lists.cpp: the config reader and its fuzzer print it without
// linking the dispatcher's cast rules.
const char* to_string(CastLists lists) { return lists == CastLists::kNative ? "native" : "apex"; }

const char* to_string(MasterWeights format) {
  switch (format) {
    case MasterWeights::kCopy: return "copy";
    case MasterWeights::kSplit: return "split";
    case MasterWeights::kStochasticRounding: return "stochastic_rounding";
    case MasterWeights::kResidual8: return "residual8";
    case MasterWeights::kKahan: return "kahan";
  }
  return "copy";
}

const char* to_string(OptimizerStateFormat format) {
  switch (format) {
    case OptimizerStateFormat::kFp32: return "fp32";
    case OptimizerStateFormat::kBf16: return "bf16";
    case OptimizerStateFormat::k8Bit: return "8bit";
  }
  return "fp32";
}

Properties properties(OptLevel level) { return opt_levels::spec(level).defaults; }

std::string to_string(const Properties& p) {
  std::string out;
  detail::append_option_row(out, "enabled", detail::option_text(p.enabled));
  detail::append_option_row(out, "opt_level", to_string(p.opt_level));  // second, as Apex prints it
#define AMP_BANNER_ROW(type, name, default_value, help) \
  if (std::string_view(#name) != "enabled") detail::append_option_row(out, #name, detail::option_text(p.name));
  AMP_OPTION_FIELDS(AMP_BANNER_ROW)
#undef AMP_BANNER_ROW
  return out;
}

}  // namespace amp
