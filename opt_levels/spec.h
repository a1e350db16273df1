#pragma once
// The shape of an opt level: Apex's `brief` plus its table of defaults. One file per level
// (o0.cpp .. o3.cpp) holds nothing but this data; registry.cpp maps OptLevel to it.

#include "amp/properties.h"

namespace amp::opt_levels {

struct OptLevelSpec {
  const char* brief;    // Apex's one-line description, word for word.
  Properties defaults;  // Apex's frontend.py table, with kHalf as the low-precision dtype.
};

OptLevelSpec o0();
OptLevelSpec o1();
OptLevelSpec o2();
OptLevelSpec o3();

/// Returns the spec of `level`.
const OptLevelSpec& spec(OptLevel level);

}  // namespace amp::opt_levels
