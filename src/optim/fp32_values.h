#pragma once
// Values in and out of a cast model through the fp32 value amp keeps of a parameter (its master or lean value),
// never its rounded copy.

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <string>
#include <utility>
#include <vector>

namespace amp::detail {

/// Writes a loaded `value` into the model tensor `target` (amp::load_weights, PythonCheckpoint::load_model),
/// converting dtype and device. Where `target` has an fp32 master, the master takes the value itself and
/// `target` its rounded copy, and the two are marked in step. Repairs what torch::load left in `target`
/// (fp32 bytes under a low-precision tensor) first.
void write_loaded(const at::Tensor& target, const at::Tensor& value);

/// Throws (naming `name`, for `where`) where write_loaded could not write `target`: a ZeRO stage-3 parameter between
/// uses that has no sharded master or lean slices to take the value (src/core/released_parameters.h).
void check_loadable(const at::Tensor& target, const std::string& name, const char* where);

/// Returns the module's parameters and buffers as a Python state_dict orders them, each with its fp32 value where
/// amp keeps one: a parameter's fp32 master (O2), the value a lean master format keeps, else low-precision tensors
/// cast to fp32 (Apex's O2 state_dict hook). Not copied: a tensor already fp32 is the model's own.
/// Under ZeRO (amp::parallel::shard_optimizer) it is collective: the sharded masters are gathered on every rank.
std::vector<std::pair<std::string, at::Tensor>> fp32_state(torch::nn::Module& module);

}  // namespace amp::detail
