#pragma once
// The base every amp fused optimizer shares (amp/fused_optimizers.h, amp/fused_muon.h): it holds what amp::Optimizer,
// amp::GradScaler and ZeRO hand to a fused step (model copies, the gradients' loss scale, lean masters, the state
// format, shard sums, a step's overflow flag: NOTE [Fused step context]) and settles the step counts of a step that
// never waits.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>

namespace amp {
namespace detail {
class FusedStepContext;
class LeanMasters;
class StateFormat;
struct ShardSums;
}  // namespace detail
namespace optim {

/// What the fused optimizers share:
///   - for each parameter, an optional low-precision tensor the step also writes the parameter's new value
///     into, rounded. amp::Optimizer fills it at O2 (fp32 master -> the model's float16/bfloat16 parameter),
///     so the separate master -> model copy pass disappears;
///   - the loss scale its gradients still carry when amp::GradScaler::step runs it without an unscale_ first
///     (torch's grad_scale for fused optimizers): the step multiplies each gradient by its inverse as it reads
///     it and stores it back, instead of a separate unscale pass. As in torch, the gradients are unscaled afterwards
///     (unless the step was skipped for inf/NaN: then they keep the scale);
///   - at O2 with a lean master_weights_format (split, stochastic_rounding, kahan, residual8), the bfloat16 parameters whose
///     fp32 value the step rebuilds, updates in fp32 with fp32 state, and stores back (NOTE [Lean masters] in
///     src/optim/lean_masters.h), one parameter at a time.
class FusedOptimizer {
 public:
  virtual ~FusedOptimizer();

  /// Called by amp::Optimizer once the host knows whether step `step_id` (run with an overflow flag on the device) was
  /// skipped: the host step counts it advanced while only the device knew are put back.
  void settle_step(uint64_t step_id, bool skipped);
  /// Sets the host step counts from the device's (waits, counted): after CUDA graph replays, which advance them
  /// without the host. torch::save does it.
  void pull_device_steps();

  /// What amp wires into the step (NOTE [Fused step context] in src/optim/fused_step_context.h): amp::Optimizer,
  /// amp::GradScaler and ZeRO set it; scripts never need it.
  amp::detail::FusedStepContext& step_context() noexcept { return *context_; }
  const amp::detail::FusedStepContext& step_context() const noexcept { return *context_; }

 protected:
  FusedOptimizer();
  // A moved-from optimizer keeps a fresh context of its own.
  FusedOptimizer(FusedOptimizer&& other);
  FusedOptimizer& operator=(FusedOptimizer&& other);

  /// Returns the tensor p's update is also written into, or nullptr.
  const at::Tensor* model_copy(const at::Tensor& p) const;
  /// Returns the parameters with lean masters (nullptr: none).
  const std::shared_ptr<amp::detail::LeanMasters>& lean_masters() const noexcept;
  /// Returns the state format (nullptr: fp32, as LibTorch).
  const std::shared_ptr<amp::detail::StateFormat>& state_format() const noexcept;
  /// Returns the sums of a sharded step (nullptr: the step holds whole tensors).
  const amp::detail::ShardSums* shard_sums() const noexcept;

 private:
  std::unique_ptr<amp::detail::FusedStepContext> context_;
};

}  // namespace optim
}  // namespace amp
