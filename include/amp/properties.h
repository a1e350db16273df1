#pragma once
// What an opt level means: Apex's `Properties`, fully resolved.

#include <c10/core/ScalarType.h>

#include <optional>
#include <string>

#include "amp/loss_scale.h"
#include "amp/opt_level.h"
#include "amp/option_fields.h"

namespace amp {

/// The resolved settings `initialize` acts on. `properties(level)` gives a level's defaults;
/// `Options::resolve()` gives them with user overrides applied and validated.
struct Properties {
  OptLevel opt_level = OptLevel::O1;
  // One member per row of amp/option_fields.h, in its order: `type name = default;`.
#define AMP_PROPERTIES_MEMBER(type, name, default_value, help) type name = default_value;
  AMP_OPTION_FIELDS(AMP_PROPERTIES_MEMBER)
#undef AMP_PROPERTIES_MEMBER
};

/// Returns the defaults of `level`: exactly Apex's table, with kHalf as the low-precision dtype.
Properties properties(OptLevel level);

/// Returns the properties as Apex's verbosity=1 banner prints them ("enabled : True" ...).
std::string to_string(const Properties& properties);

/// Returns "torch.float16" style names, as Apex prints dtypes.
std::string dtype_name(c10::ScalarType dtype);

}  // namespace amp
