#include "amp/opt_level.h"

#include <stdexcept>

#include "opt_levels/spec.h"

namespace amp {

OptLevel parse_opt_level(std::string_view text) {
  if (text == "O0") return OptLevel::O0;
  if (text == "O1") return OptLevel::O1;
  if (text == "O2") return OptLevel::O2;
  if (text == "O3") return OptLevel::O3;
  // Apex's message, plus the value as received so that whitespace and case mistakes show.
  throw std::invalid_argument("Unexpected optimization level '" + std::string(text) +
                              "'. Options are 'O0', 'O1', 'O2', 'O3'. Note that in `O0`, `O1`, etc., "
                              "the prefix O is the letter O, not the number zero.");
}

std::string to_string(OptLevel level) {
  switch (level) {
    case OptLevel::O0: return "O0";
    case OptLevel::O1: return "O1";
    case OptLevel::O2: return "O2";
    case OptLevel::O3: return "O3";
  }
  throw std::invalid_argument("amp: invalid OptLevel value " + std::to_string(static_cast<int>(level)));
}

std::string brief(OptLevel level) { return opt_levels::spec(level).brief; }

}  // namespace amp
