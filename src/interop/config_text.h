#pragma once
// The config parser on a stream: what load_options does after opening the file (and what the fuzzer drives).

#include <istream>
#include <string>

#include "amp/options.h"

namespace amp::detail {

/// Parses INI text; errors name `source_name` and the line, as load_options's name the file.
Options parse_config_text(std::istream& in, const std::string& source_name);

}  // namespace amp::detail
