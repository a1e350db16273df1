#pragma once
// The tensors inside one parameter's optimizer state, for the state types amp knows (LibTorch's SGD, Adam, AdamW,
// Adagrad, RMSprop and amp's FusedLAMB and FusedMuon): what amp::state_bytes counts and what ZeRO slices and gathers.

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <memory>
#include <vector>

namespace amp::detail {

/// Pointers to the tensor fields of `state` (an undefined field stays in its place) and to its per-parameter step
/// count (null where the type keeps none); empty `tensors` for a type amp does not know.
struct StateFields {
  std::vector<at::Tensor*> tensors;
  int64_t* step = nullptr;
};
StateFields state_fields(torch::optim::OptimizerParamState& state);

/// Returns a fresh, empty state of the type `optimizer` keeps per parameter, or null if amp does not know it.
std::unique_ptr<torch::optim::OptimizerParamState> new_state_for(const torch::optim::Optimizer& optimizer);

}  // namespace amp::detail
