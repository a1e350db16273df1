#include "amp/scale_loss.h"

#include "amp/autocast_guard.h"

namespace amp {

ScaledLoss::ScaledLoss(const at::Tensor& loss, OptimizerBase& optimizer, ScaleLossOptions options)
    : optimizer_(optimizer), options_(options) {
  TORCH_CHECK(loss.defined(), "amp::scale_loss: the loss is an undefined tensor.");
  TORCH_CHECK(loss.numel() == 1, "amp::scale_loss: the loss must be a single-element tensor, got shape ",
              loss.sizes(), ". Reduce it first, e.g. loss.mean() or loss.sum().");
  TORCH_CHECK(loss.is_floating_point(), "amp::scale_loss: the loss must be a floating tensor, got dtype ",
              loss.scalar_type(), ".");
  optimizer_.check_loss_id(options.loss_id());
  if (!optimizer_.scales_loss()) {
    // Disabled, or a fixed scale of 1 without master weights: Apex hands back loss.float() untouched.
    scaled_ = optimizer_.properties().enabled ? loss.to(at::kFloat) : loss;
    return;
  }
  optimizer_.prepare_backward(options.loss_id());
  prepared_ = true;
  scaled_ = loss.to(at::kFloat) * optimizer_.loss_scaler(options.loss_id()).loss_scale();
}

ScaledLoss::~ScaledLoss() {
  if (prepared_ && !done_) optimizer_.abort_backward();
}

void ScaledLoss::backward() {
  TORCH_CHECK(!done_, "amp::ScaledLoss::backward: backward() was already called on this scaled loss. Call "
              "amp::scale_loss again for another backward pass.");
  DisableCastsGuard no_casts;  // backward never runs under per-op casts
  scaled_.backward();          // on an exception, the destructor puts the gradients back
  done_ = true;
  if (prepared_) overflow_ = optimizer_.post_backward(options_.loss_id(), options_.delay_unscale());
}

bool ScaledLoss::overflow() const {
  TORCH_CHECK(done_, "amp::ScaledLoss::overflow: call backward() first; overflow is known only after it.");
  return overflow_;
}

ScaledLoss scale_loss(const at::Tensor& loss, OptimizerBase& optimizer, ScaleLossOptions options) {
  return ScaledLoss(loss, optimizer, options);
}

double loss_scale(const OptimizerBase& optimizer, int loss_id) { return optimizer.loss_scaler(loss_id).loss_scale(); }

std::vector<at::Tensor> master_params(OptimizerBase& optimizer) { return optimizer.master_params(); }

}  // namespace amp
