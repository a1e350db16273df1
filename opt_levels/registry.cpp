#include <stdexcept>
#include <string>

#include "spec.h"

namespace amp::opt_levels {

const OptLevelSpec& spec(OptLevel level) {
  // A switch without default: a new OptLevel without a case is a -Wswitch warning.
  static const OptLevelSpec s0 = o0(), s1 = o1(), s2 = o2(), s3 = o3();
  switch (level) {
    case OptLevel::O0: return s0;
    case OptLevel::O1: return s1;
    case OptLevel::O2: return s2;
    case OptLevel::O3: return s3;
  }
  throw std::invalid_argument("amp: invalid OptLevel value " + std::to_string(static_cast<int>(level)));
}

}  // namespace amp::opt_levels
