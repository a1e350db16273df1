#pragma once
// Fused optimizers (Apex's apex.optimizers): torch::optim::SGD, Adam and AdamW whose step updates each
// parameter and its optimizer state in one pass over memory instead of LibTorch's chain of ATen ops,
// and at O2 also writes the model's low-precision copy of each fp32 master in that same pass.
//
// They are the LibTorch optimizers (same options, defaults, state types, param groups, schedulers and
// torch::save / torch::load archives; a checkpoint of one loads into the other), with step() replaced:
//   - CPU fp32 parameters: amp's own vectorized loop (src/optim/cpu_optimizer_kernels.cpp);
//   - other devices (CUDA), LibTorch >= 2.4: ATen's fused kernels (_fused_sgd_, _fused_adam_, _fused_adamw_);
//   - anything else (float16/bfloat16/double parameters, e.g. O3; non-contiguous tensors): LibTorch's
//     own per-op algorithm, bit for bit.
//
// Apex -> amp:  apex.optimizers.FusedSGD -> amp::optim::FusedSGD;  FusedAdam(adam_w_mode=False) ->
// amp::optim::FusedAdam;  FusedAdam(adam_w_mode=True), Apex's default -> amp::optim::FusedAdamW;
// FusedLAMB -> amp::optim::FusedLAMB (LibTorch has no LAMB: its options and state are amp's, below).
// torch.optim.Muon -> amp::optim::FusedMuon (amp/fused_muon.h, included at the end).

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/serialize.h>
#include <torch/optim/sgd.h>

#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include "amp/fused_optimizer.h"

namespace amp {
namespace optim {

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
  /// torch::optim::Adam's archive, with the step counts the device kept (FusedStepContext::set_found_inf).
  void save(torch::serialize::OutputArchive& archive) const override;
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
  /// torch::optim::AdamW's archive, with the step counts the device kept (FusedStepContext::set_found_inf).
  void save(torch::serialize::OutputArchive& archive) const override;
};

/// Apex's FusedLAMB keyword arguments, with Apex's defaults (fused_lamb.py; its docstring's eps 1e-8 and
/// weight_decay 0 are not what the code uses). One set per param group, as any torch::optim options.
struct FusedLAMBOptions : public torch::optim::OptimizerCloneableOptions<FusedLAMBOptions> {
  FusedLAMBOptions(double lr = 1e-3) : lr_(lr) {}
  TORCH_ARG(double, lr) = 1e-3;
  typedef std::tuple<double, double> betas_t;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-6;
  TORCH_ARG(double, weight_decay) = 0.01;
  /// Divides the moments by 1 - beta^step.
  TORCH_ARG(bool, bias_correction) = true;
  /// Decoupled weight decay, added to the update (Apex's default); false: L2, added to the gradient.
  TORCH_ARG(bool, adam_w_mode) = true;
  /// The gradient's coefficient in the first moment is 1 - beta1 (false: 1).
  TORCH_ARG(bool, grad_averaging) = true;
  /// The gradients are divided by norm / max_grad_norm first where their global norm (over every group) exceeds
  /// it. As in Apex, the value of the optimizer's defaults applies to all groups. 0: no clipping (Apex's kernel
  /// would divide by inf and zero every gradient).
  TORCH_ARG(double, max_grad_norm) = 1.0;
  /// Applies the trust ratio ||p|| / ||update|| also in groups whose weight_decay is 0 (NVIDIA's NVLAMB).
  TORCH_ARG(bool, use_nvlamb) = false;
  /// The group's step count, for the bias correction (Apex keeps it in the param group, not per parameter).
  TORCH_ARG(int64_t, step) = 0;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr(); }
  void set_lr(const double value) override { lr(value); }
};

/// FusedLAMB's state of one parameter: Adam's two moments, in the parameter's dtype (fp32 masters at O2), or as
/// Options::optimizer_state_format stores them.
struct FusedLAMBParamState : public torch::optim::OptimizerCloneableParamState<FusedLAMBParamState> {
  TORCH_ARG(at::Tensor, exp_avg);
  TORCH_ARG(at::Tensor, exp_avg_sq);

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
};

/// Apex's FusedLAMB (You et al., "Large Batch Optimization for Deep Learning", arXiv 1904.00962, as
/// csrc/multi_tensor_lamb.cu computes it): the gradients' global norm clipped to max_grad_norm, Adam's moments,
/// and a per-tensor trust ratio lr * ||p|| / ||update|| (lr where either norm is 0) applied where weight_decay
/// is not 0 or use_nvlamb is set. fp32 arithmetic in Apex's order; the norms accumulate in double and round
/// once. Apex's step also overwrites p.grad with the update; amp's leaves the gradients as they are.
///
/// Example:
///   amp::optim::FusedLAMB lamb(model->parameters(), amp::optim::FusedLAMBOptions(1e-3).weight_decay(0.01));
///   auto [amp_model, optimizer] = amp::initialize(model, std::move(lamb), amp::Options("O2"));
class FusedLAMB : public torch::optim::Optimizer, public FusedOptimizer {
 public:
  explicit FusedLAMB(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, FusedLAMBOptions defaults = {});
  explicit FusedLAMB(std::vector<at::Tensor> params, FusedLAMBOptions defaults = {})
      : FusedLAMB({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

  /// Adds a group; its options, where given, are kept as they are (LibTorch 2.13's Optimizer::add_param_group
  /// merges options only of the types it knows and would give this group the defaults instead).
  void add_param_group(const torch::optim::OptimizerParamGroup& param_group);
  /// Updates every parameter that has a gradient and advances each group's step count.
  torch::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

 private:
  // The step of a sharded FusedLAMB (ShardSums): the norms summed over every rank's pieces.
  void sharded_step(const std::vector<at::Tensor>& grads, amp::detail::StateFormat& format);
  template <typename Self, typename Archive>
  static void serialize(Self& self, Archive& archive) {
    torch::optim::serialize<FusedLAMBParamState, FusedLAMBOptions>(archive, self);
  }
};

}  // namespace optim
}  // namespace amp

#include "amp/fused_muon.h"  // FusedMuon: the same family, in its own header
