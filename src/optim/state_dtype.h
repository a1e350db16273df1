#pragma once
// An optimizer's per-parameter state, cast to fp32 with its parameter (auto_fp32 without master weights).

#include <torch/optim/optimizer.h>

#include <string>

namespace amp::detail {

/// Casts every tensor of `state` (torch::optim's SGD, Adam, AdamW, RMSprop, Adagrad and amp::optim's fused
/// optimizers' states) to fp32; throws naming `param` for a state type it does not know.
void cast_state_to_float(torch::optim::OptimizerParamState& state, const std::string& param);

}  // namespace amp::detail
