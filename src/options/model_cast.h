#pragma once
// What a resolved configuration does to the model's own tensors.

#include "amp/properties.h"

namespace amp::detail {

/// Returns whether `p` casts the model to a low-precision dtype (O2, O3).
inline bool casts_model_to_low_precision(const Properties& p) {
  return p.enabled && p.cast_model_type && *p.cast_model_type != c10::ScalarType::Float;
}

}  // namespace amp::detail
