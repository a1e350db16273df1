#pragma once
// The scaled-loss handle (Apex's `with amp.scale_loss(loss, optimizer) as scaled_loss:`).

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <initializer_list>
#include <memory>
#include <vector>

#include "amp/optimizer.h"

namespace amp {

/// Options of one scale_loss call.
///
/// Example:
///   amp::scale_loss(loss_d, optimizer, amp::ScaleLossOptions().loss_id(1).delay_unscale(true));
struct ScaleLossOptions {
  /// Selects which of the num_losses loss scalers scales this loss.
  TORCH_ARG(int, loss_id) = 0;
  /// Leaves the gradients scaled after backward (Apex's delay_unscale): the next scale_loss without
  /// it unscales everything at once. An optimization for gradient accumulation; never needed for correctness.
  TORCH_ARG(bool, delay_unscale) = false;
};

/// A RAII handle on a scaled loss. It models a control-flow construct, not a value (like
/// absl::Cleanup): scale_loss prepares the optimizer's gradients, backward() runs backward on
/// loss * scale (never under per-op casts), unscales the new gradients into fp32 (master) gradients,
/// checks them for inf/NaN in one fused pass and updates the loss scale; after an overflow the next
/// optimizer.step() is skipped. With amp's fused optimizers none of this waits for the device: the scale lives
/// there and the step skips there (NOTE [A step that never waits] in src/scaling/device_scale.h). If backward() is
/// never reached (an exception, an early return) the
/// destructor puts the gradients back as they were. Not copyable, not movable.
class [[nodiscard]] ScaledLoss {
 public:
  ScaledLoss(const ScaledLoss&) = delete;
  ScaledLoss& operator=(const ScaledLoss&) = delete;
  ScaledLoss(ScaledLoss&&) = delete;
  ScaledLoss& operator=(ScaledLoss&&) = delete;
  ~ScaledLoss();

  /// Returns the scaled loss (fp32).
  const at::Tensor& tensor() const noexcept { return scaled_; }
  /// Runs backward and the unscale / overflow check / scale update; call it once.
  void backward();
  /// Returns whether this backward overflowed; valid after backward(). Waits for the device if the backward did not.
  bool overflow() const;

 private:
  friend ScaledLoss scale_loss(const at::Tensor& loss, OptimizerBase& optimizer, ScaleLossOptions options);
  friend ScaledLoss scale_loss(const at::Tensor& loss, std::vector<OptimizerBase*> optimizers, ScaleLossOptions options);
  ScaledLoss(const at::Tensor& loss, std::vector<OptimizerBase*> optimizers, ScaleLossOptions options);

  std::vector<OptimizerBase*> optimizers_;
  ScaleLossOptions options_;
  at::Tensor scaled_;
  double scale_ = 1.0;
  std::vector<at::Tensor> other_leaves_;  // leaves the loss reaches outside optimizers_ (see scaled_grads.h)
  bool prepared_ = false;
  bool done_ = false;
  bool overflow_ = false;
  at::Tensor inverse_;  // a backward that never waits: 1/scale on the loss's device
  std::shared_ptr<detail::BackwardOutcomeView> outcome_;  // and what the host learns of it
};

/// Scales `loss` for backward with the optimizer's loss scaler `options.loss_id()`.
///
/// Example:
///   { auto scaled_loss = amp::scale_loss(loss, optimizer); scaled_loss.backward(); }
///   optimizer.step();
[[nodiscard]] ScaledLoss scale_loss(const at::Tensor& loss, OptimizerBase& optimizer, ScaleLossOptions options = {});

/// Scales one loss whose gradients reach the parameters of several optimizers (Apex's
/// `amp.scale_loss(loss, [opt_a, opt_b])`): one backward, every optimizer's gradients unscaled, one
/// overflow decision and one scale update for all. The optimizers must share one bank of loss scalers,
/// that is, come from one amp::initialize call; otherwise it throws.
///
/// Example:
///   { auto scaled_loss = amp::scale_loss(loss, {&backbone_optimizer, &head_optimizer}); scaled_loss.backward(); }
///   backbone_optimizer.step();
///   head_optimizer.step();
[[nodiscard]] ScaledLoss scale_loss(const at::Tensor& loss, std::vector<OptimizerBase*> optimizers,
                                    ScaleLossOptions options = {});

/// Returns the current loss scale of scaler `loss_id` (Apex's _amp_state.loss_scalers[id].loss_scale()).
double loss_scale(const OptimizerBase& optimizer, int loss_id = 0);

/// Returns the last backward that overflowed for this optimizer: the loss, the scale and the parameters
/// whose gradients were inf/NaN, in model order (nullopt before any overflow).
std::optional<OverflowReport> last_overflow(const OptimizerBase& optimizer);

/// Returns the parameters the optimizer steps (fp32 masters at O2): clip these, after backward().
///
/// Example:
///   torch::nn::utils::clip_grad_norm_(amp::master_params(optimizer), 1.0);
std::vector<at::Tensor> master_params(OptimizerBase& optimizer);

}  // namespace amp
