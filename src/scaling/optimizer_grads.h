#pragma once
// The gradients an optimizer's step reads: every defined .grad() of its param groups, in group order.

#include <torch/optim/optimizer.h>

#include <vector>

namespace amp::detail {

inline std::vector<at::Tensor> defined_grads(const torch::optim::Optimizer& optimizer) {
  std::vector<at::Tensor> grads;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      if (p.grad().defined()) grads.push_back(p.grad());
    }
  }
  return grads;
}

}  // namespace amp::detail
