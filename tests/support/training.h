#pragma once
// The training step the tests share (amp_tests and amp_parallel_worker): header-only, as the models and optimizers
// it takes are templates (amp::Model<Net>, amp::Optimizer<Opt>, DistributedDataParallel<Net>).

#include <torch/arg.h>
#include <torch/nn/functional/loss.h>

#include <functional>

#include "amp/scale_loss.h"

namespace amp_test {

/// What varies between the tests' steps.
/// Example: amp_test::train_step(model, optimizer, x, y, amp_test::StepOptions().loss_factor(INFINITY));
struct StepOptions {
  using Loss = std::function<torch::Tensor(const torch::Tensor& output, const torch::Tensor& target)>;
  /// The loss of the model's output against the target: cross-entropy (mean) by default.
  TORCH_ARG(Loss, loss) = [](const torch::Tensor& output, const torch::Tensor& target) {
    return torch::nn::functional::cross_entropy(output, target);
  };
  /// Multiplies the loss handed to scale_loss, not the one returned (INFINITY: an overflowing step).
  TORCH_ARG(double, loss_factor) = 1.0;
};

/// One step as the tests train: zero_grad, `model(x)`, its loss against `y`, amp::scale_loss(...).backward(), step.
/// `model` is anything callable on a tensor (an amp::Model, a DistributedDataParallel, a lambda choosing one).
/// Returns the loss, still attached to the graph (item() or detach() it).
template <class Model, class Optimizer>
torch::Tensor train_step(Model&& model, Optimizer& optimizer, const torch::Tensor& x, const torch::Tensor& y,
                         const StepOptions& options = {}) {
  optimizer.zero_grad();
  const torch::Tensor loss = options.loss()(model(x), y);
  // A factor of 1 multiplies nothing: the same bits as `loss * 1.0`, one op fewer.
  amp::scale_loss(options.loss_factor() == 1.0 ? loss : loss * options.loss_factor(), optimizer).backward();
  optimizer.step();
  return loss;
}

}  // namespace amp_test
