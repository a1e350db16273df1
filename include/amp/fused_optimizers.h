#pragma once
// Fused optimizers (Apex's apex.optimizers): torch::optim::SGD, Adam and AdamW whose step updates each
// parameter and its optimizer state in one pass over memory instead of LibTorch's chain of ATen ops,
// and at O2 also writes the model's low-precision copy of each fp32 master in that same pass.
//
// They are the LibTorch optimizers (same options, defaults, state types, param groups, schedulers and
// torch::save / torch::load archives; a checkpoint of one loads into the other), with step() replaced:
//   - CPU fp32 parameters: amp's own vectorized loop (src/cpu_optimizer_kernels.cpp);
//   - other devices (CUDA), LibTorch >= 2.4: ATen's fused kernels (_fused_sgd_, _fused_adam_, _fused_adamw_);
//   - anything else (float16/bfloat16/double parameters, e.g. O3; non-contiguous tensors): LibTorch's
//     own per-op algorithm, bit for bit.
//
// Apex -> amp:  apex.optimizers.FusedSGD -> amp::optim::FusedSGD;  FusedAdam(adam_w_mode=False) ->
// amp::optim::FusedAdam;  FusedAdam(adam_w_mode=True), Apex's default -> amp::optim::FusedAdamW.

#include <ATen/core/Tensor.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <optional>
#include <unordered_map>
#include <utility>

namespace amp {
namespace optim {

/// What the fused optimizers share:
///   - for each parameter, an optional low-precision tensor the step also writes the parameter's new value
///     into, rounded. amp::Optimizer fills it at O2 (fp32 master -> the model's float16/bfloat16 parameter),
///     so the separate master -> model copy pass disappears;
///   - the loss scale its gradients still carry when amp::GradScaler::step runs it without an unscale_ first
///     (torch's grad_scale for fused optimizers): the step multiplies each gradient by its inverse as it reads
///     it and stores it back, instead of a separate unscale pass. As in torch, the gradients are unscaled afterwards
///     (unless the step was skipped for inf/NaN: then they keep the scale).
class FusedOptimizer {
 public:
  virtual ~FusedOptimizer() = default;

  /// Set by amp::Optimizer at O2: the step also writes each master's update, rounded, into the model tensor
  /// it maps to (keyed by the master's TensorImpl); empty: no copies.
  void set_model_copies(std::unordered_map<const c10::TensorImpl*, at::Tensor> copies) {
    model_copies_ = std::move(copies);
  }
  /// Set by amp::GradScaler::step around one step: the loss scale the gradients still carry (nullopt: none).
  void set_grad_scale(std::optional<double> scale) noexcept { grad_scale_ = scale; }

 protected:
  FusedOptimizer() = default;
  FusedOptimizer(FusedOptimizer&&) = default;
  FusedOptimizer& operator=(FusedOptimizer&&) = default;

  /// Returns the tensor p's update is also written into, or nullptr.
  const at::Tensor* model_copy(const at::Tensor& p) const;
  /// Returns the loss scale the gradients carry in this step (nullopt: they are unscaled).
  const std::optional<double>& grad_scale() const noexcept { return grad_scale_; }

 private:
  std::unordered_map<const c10::TensorImpl*, at::Tensor> model_copies_;
  std::optional<double> grad_scale_;
};

/// torch::optim::SGD (momentum, dampening, nesterov, weight_decay) with a fused step.
///
/// Example:
///   amp::optim::FusedSGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
///   auto [amp_model, amp_optimizer] = amp::initialize(model, std::move(optimizer), amp::Options().opt_level("O2"));
class FusedSGD : public torch::optim::SGD, public FusedOptimizer {
 public:
  using torch::optim::SGD::SGD;
  /// Updates every parameter that has a gradient, as torch::optim::SGD::step does.
  torch::Tensor step(LossClosure closure = nullptr) override;
};

/// torch::optim::Adam (L2 weight decay added to the gradient, amsgrad) with a fused step.
///
/// Example:
///   amp::optim::FusedAdam optimizer(model->parameters(), torch::optim::AdamOptions(1e-3).amsgrad(true));
class FusedAdam : public torch::optim::Adam, public FusedOptimizer {
 public:
  using torch::optim::Adam::Adam;
  /// Updates every parameter that has a gradient, as torch::optim::Adam::step does.
  torch::Tensor step(LossClosure closure = nullptr) override;
};

/// torch::optim::AdamW (decoupled weight decay, amsgrad) with a fused step: Apex's FusedAdam with its
/// default adam_w_mode=True.
///
/// Example:
///   amp::optim::FusedAdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
class FusedAdamW : public torch::optim::AdamW, public FusedOptimizer {
 public:
  using torch::optim::AdamW::AdamW;
  /// Updates every parameter that has a gradient, as torch::optim::AdamW::step does.
  torch::Tensor step(LossClosure closure = nullptr) override;
};

}  // namespace optim
}  // namespace amp
