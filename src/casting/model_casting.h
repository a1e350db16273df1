#pragma once
// Which of a model's tensors an opt level casts (shared by initialize and the optimizer's masters).

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "amp/properties.h"
#include "options/model_cast.h"

namespace amp::detail {

/// Returns the TensorImpls of the parameters and floating buffers that cast_model will cast to
/// cast_model_type: all of them, except BatchNorm layers' when keep_batchnorm_fp32.
std::unordered_set<const c10::TensorImpl*> tensors_to_cast(torch::nn::Module& module, const Properties& properties);

/// Returns the module's parameters and buffers by qualified name, in Python's state_dict order (each module's own
/// parameters, then its buffers, then its children).
std::vector<std::pair<std::string, at::Tensor>> named_tensors(torch::nn::Module& module);

/// Records that amp::initialize ran (user cast registrations must come before it; defined beside them in
/// src/casting/cast_kernels.cpp).
void note_initialize();

}  // namespace amp::detail
