#pragma once
// Loaded values into a cast model: through the fp32 master or lean value a parameter has, never its rounded copy.

#include <ATen/core/Tensor.h>

namespace amp::detail {

/// Writes a loaded `value` into the model tensor `target` (amp::load_weights, PythonCheckpoint::load_model),
/// converting dtype and device. Where `target` has an fp32 master, the master takes the value itself and
/// `target` its rounded copy, and the two are marked in step. Repairs what torch::load left in `target`
/// (fp32 bytes under a low-precision tensor) first.
void write_loaded(const at::Tensor& target, const at::Tensor& value);

}  // namespace amp::detail
