#pragma once
// Number formatting shared by amp's messages.

#include <string>

namespace amp::detail {

/// Formats a double as Python's repr() does ("32768.0", "0.5", "1e-05", "inf"), so that amp's
/// messages read exactly like Apex's.
std::string format_float(double value);

}  // namespace amp::detail
