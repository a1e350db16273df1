#include "amp/grad_scaler.h"

#include <ATen/Functions.h>
#include <c10/core/GradMode.h>

#include <cmath>
#include <stdexcept>

#include "amp/clip_grad.h"
#include "amp/fused_optimizers.h"
#include "amp/optimizer.h"
#include "core/host_sync.h"
#include "optim/fused_step_context.h"
#include "options/format.h"
#include "scaling/multi_tensor.h"
#include "scaling/optimizer_grads.h"

namespace amp {
namespace {

void check_growth_factor(double value) {
  if (!(value > 1.0) || !std::isfinite(value)) {
    throw std::invalid_argument("amp::GradScaler: The growth factor must be > 1.0. Got " + detail::format_float(value) +
                                "; the default is 2.0.");
  }
}

void check_backoff_factor(double value) {
  if (!(value < 1.0) || !(value > 0.0)) {
    throw std::invalid_argument("amp::GradScaler: The backoff factor must be < 1.0 (and > 0). Got " +
                                detail::format_float(value) + "; the default is 0.5.");
  }
}

void check_growth_interval(int64_t value) {
  if (value < 1) {
    throw std::invalid_argument("amp::GradScaler: growth_interval must be at least 1 (clean steps before the scale "
                                "grows), got " + std::to_string(value) + "; the default is 2000.");
  }
}

void check_scale(double value, const char* what) {
  if (!(value > 0.0) || !std::isfinite(value) || !std::isfinite(static_cast<float>(value))) {
    throw std::invalid_argument(std::string("amp::GradScaler: ") + what + " must be a positive finite float, got " +
                                detail::format_float(value) + ".");
  }
}

}  // namespace

struct GradScaler::OptimizerState {
  Stage stage = Stage::kReady;
  detail::FoundInf found_inf;
  bool checked = false;  // unscale_ saw at least one gradient
};

GradScaler::GradScaler(GradScalerOptions options)
    : enabled_(options.enabled()),
      init_scale_(options.init_scale()),
      growth_factor_(options.growth_factor()),
      backoff_factor_(options.backoff_factor()),
      growth_interval_(options.growth_interval()) {
  check_growth_factor(growth_factor_);
  check_backoff_factor(backoff_factor_);
  check_growth_interval(growth_interval_);
  check_scale(init_scale_, "init_scale");
}

GradScaler::~GradScaler() = default;
GradScaler::GradScaler(GradScaler&&) noexcept = default;
GradScaler& GradScaler::operator=(GradScaler&&) noexcept = default;

GradScaler::OptimizerState& GradScaler::state_of(torch::optim::Optimizer& optimizer) {
  auto& slot = per_optimizer_[&optimizer];
  if (!slot) slot = std::make_unique<OptimizerState>();
  return *slot;
}

torch::Tensor GradScaler::scale(const torch::Tensor& outputs) {
  if (!enabled_) return outputs;
  TORCH_CHECK(outputs.defined(), "amp::GradScaler::scale: the tensor to scale is undefined.");
  if (!scale_.defined()) {
    const auto on = at::TensorOptions().device(outputs.device());
    scale_ = at::full({}, static_cast<float>(init_scale_), on.dtype(at::kFloat));
    growth_tracker_ = at::full({}, initial_growth_tracker_, on.dtype(at::kInt));
  }
  const at::Tensor scale = scale_.to(outputs.device());
  // fp16/bf16 outputs: the product in fp32, rounded once (a 2^16 scale is not an fp16 number).
  if (outputs.scalar_type() == at::kHalf || outputs.scalar_type() == at::kBFloat16) {
    return outputs.to(at::kFloat).mul(scale).to(outputs.scalar_type());
  }
  return outputs.mul(scale);
}

// The gradients of the optimizer's parameters, checked as torch's _unscale_grads_ checks them.
std::vector<at::Tensor> GradScaler::scaled_grads(torch::optim::Optimizer& optimizer) const {
  TORCH_CHECK(scale_.defined(), "Attempted unscale_ but _scale is None.  This may indicate your script did not use "
              "scaler.scale(loss or outputs) earlier in the iteration.");
  std::vector<at::Tensor> grads;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      const at::Tensor& g = p.grad();
      if (!g.defined()) continue;
      if (g.scalar_type() == at::kHalf) {
        throw std::invalid_argument("Attempting to unscale FP16 gradients. GradScaler needs fp32 parameters (run the "
                                    "forward under amp::AutocastGuard with an fp32 model); for float16 weights use "
                                    "amp::initialize at O2, whose fp32 master weights take the gradients.");
      }
      grads.push_back(g);
    }
  }
  return grads;
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (!enabled_) return;
  OptimizerState& state = state_of(optimizer);
  TORCH_CHECK(state.stage != Stage::kUnscaled,
              "unscale_() has already been called on this optimizer since the last update().");
  TORCH_CHECK(state.stage != Stage::kStepped, "unscale_() is being called after step().");
  const std::vector<at::Tensor> grads = scaled_grads(optimizer);
  // torch: inv_scale = scale.double().reciprocal().float(), on the device
  const at::Tensor inv_scale = scale_.to(at::kDouble).reciprocal().to(at::kFloat);
  detail::unscale_(grads, detail::InvScale(inv_scale), state.found_inf);
  state.checked = !grads.empty();
  state.stage = Stage::kUnscaled;
}

torch::Tensor GradScaler::clip_grad_norm_(torch::optim::Optimizer& optimizer, double max_norm, double norm_type) {
  detail::check_clip_arguments("amp::GradScaler::clip_grad_norm_", max_norm, norm_type);
  at::Tensor skip;
  if (enabled_) {
    OptimizerState& state = state_of(optimizer);
    TORCH_CHECK(state.stage != Stage::kStepped, "amp::GradScaler::clip_grad_norm_ is being called after step(): clip "
                "between scaler.scale(loss).backward() and scaler.step(optimizer).");
    if (state.stage == Stage::kReady) unscale_(optimizer);
  }
  const std::vector<at::Tensor> grads = detail::defined_grads(optimizer);
  if (enabled_ && !grads.empty()) skip = state_of(optimizer).found_inf.any_on(grads.front().device());
  return detail::clip_grads(grads, max_norm, norm_type, skip);
}

namespace {
// The amp optimizer `optimizer` is, if it is one (its host syncs count for it: amp::host_sync_count).
std::vector<const OptimizerBase*> amp_optimizers_of(const torch::optim::Optimizer& optimizer) {
  if (const auto* amp_optimizer = dynamic_cast<const OptimizerBase*>(&optimizer)) return {amp_optimizer};
  return {};
}
}  // namespace

std::optional<torch::Tensor> GradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!enabled_) return optimizer.step();
  OptimizerState& state = state_of(optimizer);
  TORCH_CHECK(state.stage != Stage::kStepped, "step() has already been called since the last update().");
  auto* fused = dynamic_cast<optim::FusedOptimizer*>(&optimizer);
  const bool fused_unscale = fused != nullptr && state.stage == Stage::kReady;
  if (fused_unscale) {
    // torch's path for optimizers that take grad_scale: a read-only inf/NaN check here, and the step divides
    // each gradient by the scale as it reads it and stores it back (one pass fewer than unscale_ then step).
    const std::vector<at::Tensor> grads = scaled_grads(optimizer);
    detail::check_finite(grads, state.found_inf);
    state.checked = !grads.empty();
  } else if (state.stage == Stage::kReady) {
    unscale_(optimizer);
  }
  TORCH_CHECK(state.checked, "No inf checks were recorded for this optimizer. (None of its parameters has a "
              "gradient: run scaler.scale(loss).backward() through parameters this optimizer holds before step().)");
  state.stage = Stage::kStepped;
  if (fused != nullptr) {
    // torch's path for optimizers that take found_inf: the step skips inside, nothing waits for the device.
    fused->step_context().set_found_inf(state.found_inf.any_on(scale_.device()).to(at::kFloat), /*step_id=*/0);
    if (fused_unscale) fused->step_context().set_grad_scale(scale_);
    struct ResetGuard {
      optim::FusedOptimizer* fused;
      ~ResetGuard() {
        fused->step_context().set_found_inf({}, 0);
        fused->step_context().set_grad_scale(std::nullopt);
      }
    } reset{fused};
    return optimizer.step();
  }
  bool found = false;
  {
    const detail::HostSyncScope syncs(amp_optimizers_of(optimizer));
    found = state.found_inf.any();  // the step's one host sync: LibTorch's step can't skip on the device
  }
  if (found) return std::nullopt;
  return optimizer.step();
}

void GradScaler::update(std::optional<double> new_scale) {
  if (!enabled_) return;
  TORCH_CHECK(scale_.defined(), "Attempted update but _scale is None.  This may indicate your script did not use "
              "scaler.scale(loss or outputs) earlier in the iteration.");
  c10::NoGradGuard no_grad;
  if (new_scale) {
    check_scale(*new_scale, "update(new_scale): new_scale");
    scale_.fill_(static_cast<float>(*new_scale));
  } else {
    at::Tensor found = at::zeros({}, scale_.options());
    bool any_checked = false;
    for (auto& [optimizer, state] : per_optimizer_) {
      if (!state->checked) continue;
      any_checked = true;
      found = at::maximum(found, state->found_inf.any_on(scale_.device()).to(at::kFloat));
    }
    TORCH_CHECK(any_checked, "No inf checks were recorded prior to update(). Call scaler.step(optimizer) (or "
                "scaler.unscale_(optimizer)) after scaler.scale(loss).backward(), then update().");
    // torch's _amp_update_scale_, on the device: backoff on inf, grow after growth_interval clean steps while the
    // grown scale is finite (the products in double, rounded to float, as its kernels compute them).
    const at::Tensor overflow = found.gt(0);
    const at::Tensor successful = growth_tracker_.add(1);
    const at::Tensor grow = successful.eq(growth_interval_).logical_and(overflow.logical_not());
    const at::Tensor wide = scale_.to(at::kDouble);
    const at::Tensor grown = wide.mul(growth_factor_).to(at::kFloat);
    const at::Tensor backed_off = wide.mul(backoff_factor_).to(at::kFloat);
    scale_.copy_(at::where(overflow, backed_off, at::where(grow.logical_and(grown.isfinite()), grown, scale_)));
    growth_tracker_.copy_(at::where(overflow.logical_or(successful.eq(growth_interval_)),
                                    at::zeros_like(growth_tracker_), successful));
  }
  per_optimizer_.clear();
}

double GradScaler::get_scale() const {
  if (!enabled_) return 1.0;
  if (!scale_.defined()) return init_scale_;
  if (!scale_.device().is_cpu()) detail::count_host_sync();
  return static_cast<double>(scale_.item<float>());
}

void GradScaler::set_growth_factor(double value) {
  check_growth_factor(value);
  growth_factor_ = value;
}

void GradScaler::set_backoff_factor(double value) {
  check_backoff_factor(value);
  backoff_factor_ = value;
}

void GradScaler::set_growth_interval(int value) {
  check_growth_interval(value);
  growth_interval_ = value;
}

c10::Dict<std::string, c10::IValue> GradScaler::state_dict() const {
  auto out = c10::impl::toTypedDict<std::string, c10::IValue>(
      c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get()));
  if (!enabled_) return out;
  out.insert("scale", c10::IValue(get_scale()));
  out.insert("growth_factor", c10::IValue(growth_factor_));
  out.insert("backoff_factor", c10::IValue(backoff_factor_));
  out.insert("growth_interval", c10::IValue(static_cast<int64_t>(growth_interval_)));
  out.insert("_growth_tracker",
             c10::IValue(growth_tracker_.defined() ? static_cast<int64_t>(growth_tracker_.item<int>()) : initial_growth_tracker_));
  return out;
}

void GradScaler::load_state_dict(const c10::Dict<std::string, c10::IValue>& state) {
  if (!enabled_) return;
  TORCH_CHECK(state.size() > 0, "The source state dict is empty, possibly because it was saved from a disabled "
              "instance of GradScaler.");
  auto number = [&](const char* key) {
    TORCH_CHECK(state.contains(key), "amp::GradScaler::load_state_dict: the state dict has no '", key,
                "'. It needs scale, growth_factor, backoff_factor, growth_interval and _growth_tracker, as "
                "torch.amp.GradScaler.state_dict() writes them.");
    const c10::IValue v = state.at(key);
    TORCH_CHECK(v.isDouble() || v.isInt(), "amp::GradScaler::load_state_dict: '", key, "' must be a number, got ",
                v.tagKind(), ".");
    return v.isDouble() ? v.toDouble() : static_cast<double>(v.toInt());
  };
  const double scale = number("scale");
  const double growth = number("growth_factor");
  const double backoff = number("backoff_factor");
  const double interval = number("growth_interval");
  const double tracker = number("_growth_tracker");
  check_scale(scale, "the state dict's scale");
  check_growth_factor(growth);
  check_backoff_factor(backoff);
  TORCH_CHECK(interval == std::floor(interval) && interval >= 1 && interval <= 2147483647.0,
              "amp::GradScaler::load_state_dict: growth_interval must be a positive integer, got ", interval, ".");
  TORCH_CHECK(tracker == std::floor(tracker) && tracker >= 0 && tracker < interval,
              "amp::GradScaler::load_state_dict: _growth_tracker must be an integer in [0, growth_interval), got ",
              tracker, ".");
  // Everything validated: now change state.
  init_scale_ = scale;
  initial_growth_tracker_ = static_cast<int64_t>(tracker);
  if (scale_.defined()) {
    scale_.fill_(static_cast<float>(scale));
    growth_tracker_.fill_(initial_growth_tracker_);
  }
  growth_factor_ = growth;
  backoff_factor_ = backoff;
  growth_interval_ = static_cast<int>(interval);
}

}  // namespace amp
