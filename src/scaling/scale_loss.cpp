#include "amp/scale_loss.h"

#include <algorithm>
#include <iostream>

#include "amp/autocast_guard.h"
#include "amp/optimizer.h"
#include "options/format.h"
#include "scaling/multi_tensor.h"
#include "scaling/scaled_grads.h"

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
  scale_ = first.loss_scaler(options.loss_id()).loss_scale();
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
  for (auto* o : optimizers_) o->unscale_grads(loss_id, delay, 1.0 / scale_, found_inf);
  if (delay) return;
  overflow_ = found_inf.any();  // the backward's one host sync
  if (overflow_) {
    for (auto* o : optimizers_) o->record_overflow(loss_id, scale_);
  }
  // One scale update per backward, whatever the number of optimizers (they share the scaler).
  LossScaler& scaler = (*optimizers_[0]->scaler_bank())[static_cast<size_t>(loss_id)];
  // auto_fp32 must see a module overflow more than once to move it, so with a static scale (which Apex steps
  // through overflows with) it skips the overflowing steps, as torch.amp's GradScaler always does.
  const bool skip = scaler.update_scale(overflow_) || (overflow_ && optimizers_[0]->properties().auto_fp32 > 0);
  for (auto* o : optimizers_) o->finish_backward(loss_id, skip);
  // At or below a scale of 1 (or the dynamic scale's floor), a smaller scale can't cure an overflow; a static scale
  // is its own floor.
  const double floor = scaler.dynamic() ? std::max(scaler.min_loss_scale(), 1.0) : scale_;
  for (auto* o : optimizers_) o->after_backward(overflow_, scale_, floor);
  if (overflow_ && scaler.dynamic() && scale_ <= scaler.min_loss_scale()) warn_overflow_at_minimum();
}

// The scale can't fall any further and the gradients still overflow: the inf/NaN does not come from
// scaling. Said once per optimizer and loss, at verbosity >= 1.
void ScaledLoss::warn_overflow_at_minimum() const {
  OptimizerBase& first = *optimizers_[0];
  const auto loss_id = static_cast<size_t>(options_.loss_id());
  if (first.properties().verbosity < 1) return;
  auto& warned = first.warned_at_min_scale_;
  if (warned.size() <= loss_id) warned.resize(loss_id + 1, false);
  if (warned[loss_id]) return;
  warned[loss_id] = true;
  std::string names;
  if (first.last_overflow() && !first.last_overflow()->parameters.empty()) {
    for (const auto& n : first.last_overflow()->parameters) names += (names.empty() ? "" : ", ") + n;
  }
  std::cout << "amp: loss scaler " << loss_id << " is at its minimum (" << detail::format_float(scale_)
            << ") and the gradients still hold inf/NaN" << (names.empty() ? "" : " (in " + names + ")")
            << ". Lowering the scale can't fix this: look for a NaN or inf produced in the forward or the loss "
               "(bad inputs, log of 0, division by 0), a diverging learning rate, or an op that overflows in low "
               "precision (amp::register_float_function). Steps stay skipped until the gradients are finite."
            << std::endl;
}

bool ScaledLoss::overflow() const {
  TORCH_CHECK(done_, "amp::ScaledLoss::overflow: call backward() first; overflow is known only after it.");
  return overflow_;
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
