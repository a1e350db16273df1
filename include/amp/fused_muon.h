#pragma once
// Muon (Jordan et al. 2024; torch.optim.Muon in torch 2.13): SGD momentum whose update is orthogonalized by a
// Newton-Schulz iteration, for the 2-D weights of hidden layers (embeddings, norms, biases and the head go to AdamW).
// amp::optim::FusedMuon computes torch.optim.Muon's single-tensor step, op for op (bitwise on fp32 CPU parameters),
// under every amp level: fp32 masters at O2 (the model's copy written in the step), dynamic loss scaling (a skipped
// step changes nothing), lean masters and the bf16 / 8-bit state formats for its momentum buffer.
// Included by amp/fused_optimizers.h.

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/serialize.h>

#include <cstdint>
#include <string>
#include <vector>

#include "amp/fused_optimizer.h"

namespace amp::optim {

/// torch.optim.Muon's arguments, with its defaults; one set per param group, as any torch::optim options.
struct FusedMuonOptions : public torch::optim::OptimizerCloneableOptions<FusedMuonOptions> {
  FusedMuonOptions(double lr = 1e-3) : lr_(lr) {}
  TORCH_ARG(double, lr) = 1e-3;
  /// Decoupled: each step multiplies the weight by 1 - lr * weight_decay first.
  TORCH_ARG(double, weight_decay) = 0.1;
  TORCH_ARG(double, momentum) = 0.95;
  /// The update orthogonalized is grad.lerp(buffer, momentum) (false: the buffer itself).
  TORCH_ARG(bool, nesterov) = true;
  /// (a, b, c) of the quintic iteration X <- aX + (bA + cA^2)X, A = XX^T.
  TORCH_ARG(std::vector<double>, ns_coefficients) = std::vector<double>{3.4445, -4.7750, 2.0315};
  /// The update is divided by max(||update||_F, eps) before the iteration.
  TORCH_ARG(double, eps) = 1e-7;
  TORCH_ARG(int64_t, ns_steps) = 5;
  /// How lr scales with the weight's shape [A, B]: "original" (Keller Jordan's sqrt(max(1, A / B))) or
  /// "match_rms_adamw" (Moonshot's 0.2 sqrt(max(A, B)), for lr and weight_decay tuned for AdamW).
  TORCH_ARG(std::string, adjust_lr_fn) = "original";
  /// Weights of more than 2 dimensions (conv kernels [out, in, kh, kw]) are orthogonalized as [out, rest] and their
  /// lr adjusted for that shape; false: they are refused, as torch.optim.Muon refuses them. Not in Python's state_dict.
  TORCH_ARG(bool, flatten) = false;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr(); }
  void set_lr(const double value) override { lr(value); }
};

/// FusedMuon's state of one parameter: torch.optim.Muon's momentum buffer, in the parameter's dtype (fp32 beside a
/// master), or as Options::optimizer_state_format stores it (8-bit with the signed map, as Adam's exp_avg).
struct FusedMuonParamState : public torch::optim::OptimizerCloneableParamState<FusedMuonParamState> {
  TORCH_ARG(at::Tensor, momentum_buffer);

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
};

/// torch.optim.Muon, step for step: per parameter, buffer.lerp_(grad, 1 - momentum); the update grad.lerp(buffer,
/// momentum) (nesterov) or the buffer; in bfloat16, transposed when taller than wide, divided by its norm and put
/// through ns_steps Newton-Schulz iterations; then weight *= 1 - lr * weight_decay and weight -= adjusted_lr * update.
/// Parameters must be 2-D (or any shape of at least 2 dimensions with flatten), dense and real.
///
/// Example (the usual split: Muon for the hidden 2-D weights, AdamW for the rest, one loss):
///   amp::optim::FusedMuon muon(hidden_weights, amp::optim::FusedMuonOptions(0.02).momentum(0.95));
///   amp::optim::FusedAdamW adamw(other_params, torch::optim::AdamWOptions(3e-4).weight_decay(0.01));
class FusedMuon : public torch::optim::Optimizer, public FusedOptimizer {
 public:
  explicit FusedMuon(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, FusedMuonOptions defaults = {});
  explicit FusedMuon(std::vector<at::Tensor> params, FusedMuonOptions defaults = {})
      : FusedMuon({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

  /// Adds a group, checking its parameters' shapes; its options, where given, are kept as they are.
  void add_param_group(const torch::optim::OptimizerParamGroup& param_group);
  /// Updates every parameter that has a gradient.
  torch::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

 private:
  // The shape Muon sees for `p`: its own, or under ZeRO its whole tensor's (each rank steps whole tensors, flattened).
  std::vector<int64_t> shape_of(const at::Tensor& p) const;
  template <typename Self, typename Archive>
  static void serialize(Self& self, Archive& archive) {
    torch::optim::serialize<FusedMuonParamState, FusedMuonOptions>(archive, self);
  }
};

}  // namespace amp::optim
