#include "amp/scale_loss.h"

#include <algorithm>
#include <utility>

#include "amp/autocast_guard.h"
#include "amp/optimizer.h"
#include "optim/step_ledger.h"
#include "scaling/device_scale.h"
#include "scaling/multi_tensor.h"
#include "scaling/scaled_grads.h"
#include "scaling/scaler_access.h"

namespace amp {

ScaledLoss::ScaledLoss(const at::Tensor& loss, std::vector<OptimizerBase*> optimizers, ScaleLossOptions options)
    : optimizers_(std::move(optimizers)), options_(options) {
  TORCH_CHECK(!optimizers_.empty(), "amp::scale_loss: the list of optimizers is empty; pass the amp optimizers "
              "whose parameters the loss reaches.");
  for (size_t i = 0; i < optimizers_.size(); ++i) {
    TORCH_CHECK(optimizers_[i] != nullptr, "amp::scale_loss: optimizer ", i, " of the list is null.");
    TORCH_CHECK(std::find(optimizers_.begin(), optimizers_.begin() + static_cast<std::ptrdiff_t>(i), optimizers_[i]) ==
                    optimizers_.begin() + static_cast<std::ptrdiff_t>(i),
                "amp::scale_loss: optimizer ", i, " appears twice in the list; pass each optimizer once.");
    TORCH_CHECK(optimizers_[i]->scaler_bank() == optimizers_[0]->scaler_bank(), "amp::scale_loss: optimizer ", i,
                " was initialized separately from optimizer 0, so each has its own loss scalers, but one loss needs "
                "one scale. Initialize them together: auto [models, optimizers] = amp::initialize(std::tuple(model), "
                "std::tuple(std::move(optimizer_a), std::move(optimizer_b)), options).");
  }
  TORCH_CHECK(loss.defined(), "amp::scale_loss: the loss is an undefined tensor.");
  TORCH_CHECK(loss.numel() == 1, "amp::scale_loss: the loss must be a single-element tensor, got shape ",
              loss.sizes(), ". Reduce it first, e.g. loss.mean() or loss.sum().");
  TORCH_CHECK(loss.is_floating_point(), "amp::scale_loss: the loss must be a floating tensor, got dtype ",
              loss.scalar_type(), ".");
  OptimizerBase& first = *optimizers_[0];
  first.check_loss_id(options.loss_id());
  if (!first.scales_loss()) {
    // Disabled, or a fixed scale of 1 without master weights: Apex hands back loss.float() untouched.
    scaled_ = first.properties().enabled ? loss.to(at::kFloat) : loss;
    return;
  }
  size_t prepared = 0;
  try {
    for (; prepared < optimizers_.size(); ++prepared) optimizers_[prepared]->prepare_backward(options.loss_id());
  } catch (...) {
    for (size_t i = 0; i < prepared; ++i) optimizers_[i]->abort_backward();
    throw;
  }
  prepared_ = true;
  for (auto& leaf : detail::gradient_leaves(loss)) {
    const auto* impl = leaf.unsafeGetTensorImpl();
    const bool ours = std::any_of(optimizers_.begin(), optimizers_.end(),
                                  [impl](const OptimizerBase* o) { return o->owns_model_tensor(impl); });
    if (!ours) other_leaves_.push_back(std::move(leaf));
  }
  LossScaler& scaler = (*first.scaler_bank())[static_cast<size_t>(options.loss_id())];
  const bool on_device = std::all_of(optimizers_.begin(), optimizers_.end(),
                                     [](const OptimizerBase* o) { return o->skips_on_device(); });
  if (first.ledger_->graph_mode) {
    TORCH_CHECK(on_device, "amp::scale_loss: under amp::GraphCaptureGuard every optimizer of the loss must be one the "
                "guard holds (amp's fused optimizers); pass the same optimizers to the guard and to scale_loss.");
    const detail::DeviceScale* device = detail::ScalerAccess::device(std::as_const(scaler));
    TORCH_CHECK(device != nullptr && device->device() == loss.device(), "amp::scale_loss: loss scaler ",
                options.loss_id(), " has no state on ", loss.device(), " yet, and a CUDA graph capture can't create "
                "it. Run the warm-up steps the capture recipe takes (docs/cuda.md) with this loss_id before capturing.");
  }
  std::shared_ptr<detail::DeviceScale>& device = detail::ScalerAccess::device(scaler);
  if (on_device) {
    // NOTE [A step that never waits]: the scale is the device's; the host's copy only names it in messages.
    if (!device || device->device() != loss.device()) {
      for (auto* o : optimizers_) o->settle(/*wait=*/true);
      first.settle_scalers(/*wait=*/true);
      device = std::make_shared<detail::DeviceScale>(scaler, loss.device());
      detail::ScalerAccess::set_host_update(scaler, 0);
    }
    scale_ = scaler.loss_scale();
    inverse_ = device->inverse();
    scaled_ = loss.to(at::kFloat) * device->multiplier();
    return;
  }
  if (device) {  // the host decides this backward: its copy of the scaler catches up, then leads
    for (auto* o : optimizers_) o->settle(/*wait=*/true);
    first.settle_scalers(/*wait=*/true);
    device.reset();
  }
  scale_ = scaler.loss_scale();
  scaled_ = loss.to(at::kFloat) * scale_;
}

ScaledLoss::~ScaledLoss() {
  if (prepared_ && !done_) {
    for (auto* o : optimizers_) o->abort_backward();
  }
}

void ScaledLoss::backward() {
  TORCH_CHECK(!done_, "amp::ScaledLoss::backward: backward() was already called on this scaled loss. Call "
              "amp::scale_loss again for another backward pass.");
  // Its reads of device values (the overflow flag, the report, auto_fp32's diagnosis) count for its optimizers.
  const detail::HostSyncScope syncs(std::vector<const OptimizerBase*>(optimizers_.begin(), optimizers_.end()));
  {
    DisableCastsGuard no_casts;  // backward never runs under per-op casts
    scaled_.backward();          // on an exception, the destructor puts the gradients back
  }
  done_ = true;
  if (!prepared_) return;
  detail::record_scaled_grads(other_leaves_, scale_, options_.loss_id());
  other_leaves_.clear();
  const int loss_id = options_.loss_id();
  const bool delay = options_.delay_unscale();
  detail::FoundInf found_inf;
  const detail::InvScale inverse = inverse_.defined() ? detail::InvScale(inverse_) : detail::InvScale(1.0 / scale_);
  for (auto* o : optimizers_) o->unscale_grads(loss_id, delay, inverse, found_inf);
  if (delay) return;
  LossScaler& scaler = (*optimizers_[0]->scaler_bank())[static_cast<size_t>(loss_id)];
  if (inverse_.defined()) {  // NOTE [A step that never waits]
    detail::DeviceScale& device = *detail::ScalerAccess::device(scaler);
    const at::Tensor overflow = found_inf.any_on(device.device());
    if (optimizers_[0]->ledger_->graph_mode) {  // amp::GraphCaptureGuard: nothing for the host
      device.update_on_device(overflow);
      const at::Tensor flag = overflow.to(at::kFloat);
      for (auto* o : optimizers_) o->defer_outcome(nullptr, flag);
      return;
    }
    detail::HostView outcome = device.update(overflow);
    outcome_ = std::make_shared<detail::BackwardOutcomeView>(std::move(outcome), loss_id, device.updates(),
                                                             &device);
    const at::Tensor flag = overflow.to(at::kFloat);
    for (auto* o : optimizers_) o->defer_outcome(outcome_, flag);
    for (auto* o : optimizers_) o->settle(/*wait=*/false);  // on the CPU the outcome is there already
    return;
  }
  overflow_ = found_inf.any();  // the backward's one host sync
  if (overflow_) {
    for (auto* o : optimizers_) o->record_overflow(loss_id, scale_);
  }
  // One scale update per backward, whatever the number of optimizers (they share the scaler).
  // auto_fp32 must see a module overflow more than once to move it, so with a static scale (which Apex steps
  // through overflows with) it skips the overflowing steps, as torch.amp's GradScaler always does.
  const bool skip = scaler.update_scale(overflow_) || (overflow_ && optimizers_[0]->properties().auto_fp32 > 0);
  for (auto* o : optimizers_) o->finish_backward(loss_id, skip);
  // At or below a scale of 1 (or the dynamic scale's floor), a smaller scale can't cure an overflow; a static scale
  // is its own floor.
  const double floor = scaler.dynamic() ? std::max(scaler.min_loss_scale(), 1.0) : scale_;
  for (auto* o : optimizers_) o->after_backward(overflow_, scale_, floor);
  if (overflow_ && scaler.dynamic() && scale_ <= scaler.min_loss_scale()) {
    optimizers_[0]->warn_overflow_at_minimum(loss_id, scale_);
  }
}

bool ScaledLoss::overflow() const {
  TORCH_CHECK(done_, "amp::ScaledLoss::overflow: call backward() first; overflow is known only after it.");
  TORCH_CHECK(outcome_ || !optimizers_[0]->ledger_->graph_mode, "amp::ScaledLoss::overflow: under amp::GraphCaptureGuard "
              "the overflow stays on the device (a captured step can't tell the host). Read amp::skipped_steps or "
              "amp::loss_scale after the guard instead.");
  if (!outcome_) return overflow_;
  const detail::HostSyncScope syncs(std::vector<const OptimizerBase*>(optimizers_.begin(), optimizers_.end()));
  return outcome_->overflow();
}

ScaledLoss scale_loss(const at::Tensor& loss, OptimizerBase& optimizer, ScaleLossOptions options) {
  return ScaledLoss(loss, {&optimizer}, options);
}

ScaledLoss scale_loss(const at::Tensor& loss, std::vector<OptimizerBase*> optimizers, ScaleLossOptions options) {
  return ScaledLoss(loss, std::move(optimizers), options);
}

double loss_scale(const OptimizerBase& optimizer, int loss_id) { return optimizer.loss_scaler(loss_id).loss_scale(); }

std::vector<at::Tensor> master_params(OptimizerBase& optimizer) { return optimizer.master_params(); }

std::optional<OverflowReport> last_overflow(const OptimizerBase& optimizer) { return optimizer.last_overflow(); }

}  // namespace amp
