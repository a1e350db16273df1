#pragma once
// Number and text formatting shared by amp's messages.

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace amp::detail {

/// Formats a double as Python's repr() does ("32768.0", "0.5", "1e-05", "inf"), so that amp's
/// messages read exactly like Apex's.
std::string format_float(double value);

/// "True" or "False", as Python prints a bool.
inline std::string python_bool(bool value) { return value ? "True" : "False"; }

/// Returns the offset of the first byte where `text` stops being valid UTF-8 (overlong forms, code points
/// above U+10FFFF and truncated sequences are invalid, as in Python's strict decoder), or nullopt if it is
/// valid. `surrogates` accepts encoded U+D800..U+DFFF, as pickle's 'surrogatepass' does for str opcodes.
std::optional<size_t> invalid_utf8_at(std::string_view text, bool surrogates = false);

/// Returns `text` with every byte outside printable ASCII written as \xNN, for messages.
std::string escape_bytes(std::string_view text);

/// fnmatch's rules over the whole text: `*` matches any characters (dots included), `?` one character.
bool glob_match(std::string_view pattern, std::string_view text);

/// Levenshtein distance (insertions, deletions, substitutions), for "did you mean" suggestions.
size_t edit_distance(std::string_view a, std::string_view b);

/// Returns the (at most `count`) candidates closest to `name` by edit_distance, closest first.
std::vector<std::string> closest_names(std::string_view name, const std::vector<std::string>& candidates,
                                       size_t count = 3);

}  // namespace amp::detail
