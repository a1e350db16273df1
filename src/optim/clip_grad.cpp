#include "amp/clip_grad.h"

#include <ATen/Functions.h>
#include <c10/core/GradMode.h>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "options/format.h"
#include "optim/optimizer_access.h"
#include "optim/sharding.h"
#include "scaling/multi_tensor.h"

namespace amp {
namespace detail {

void check_clip_arguments(const char* caller, double max_norm, double norm_type) {
  if (!(max_norm > 0.0) || !std::isfinite(max_norm)) {
    throw std::invalid_argument(std::string(caller) + ": max_norm must be positive and finite, got " +
                                format_float(max_norm) + ". It is the largest total norm the gradients may keep, "
                                "e.g. 1.0.");
  }
  if (norm_type != 1.0 && norm_type != 2.0 && norm_type != std::numeric_limits<double>::infinity()) {
    throw std::invalid_argument(std::string(caller) + ": norm_type must be 2 (the default), 1 or INFINITY (the "
                                "largest absolute value), got " + format_float(norm_type) + ".");
  }
}

at::Tensor clip_grads(const std::vector<at::Tensor>& grads, double max_norm, double norm_type, const at::Tensor& skip,
                      at::Tensor norm) {
  c10::NoGradGuard no_grad;
  if (!norm.defined()) norm = total_norm(grads, norm_type);
  if (grads.empty()) return norm;
  // torch's arithmetic, op for op: `max_norm / (norm + 1e-6)` is Tensor.__rtruediv__, reciprocal() * max_norm.
  at::Tensor coefficient = norm.add(1e-6).reciprocal().mul(max_norm).clamp_max(1.0);
  if (skip.defined()) {
    const at::Tensor on_device = skip.to(norm.device());
    norm = at::where(on_device, at::full({}, std::numeric_limits<float>::infinity(), norm.options()), norm);
    coefficient = at::where(on_device, at::ones({}, coefficient.options()), coefficient);
  }
  mul_(grads, coefficient);
  return norm;
}

}  // namespace detail

at::Tensor clip_grad_norm_(OptimizerBase& optimizer, double max_norm, double norm_type) {
  detail::check_clip_arguments("amp::clip_grad_norm_", max_norm, norm_type);
  const std::vector<at::Tensor> grads = detail::OptimizerAccess::grads_for_step(optimizer, "clip_grad_norm_");
  if (optimizer.step_will_be_skipped()) {
    // The overflow was read on the host already (scale_loss's one sync): nothing to clip, nothing touched.
    const c10::Device device = grads.empty() ? c10::Device(at::kCPU) : grads.front().device();
    return at::full({}, std::numeric_limits<float>::infinity(), at::TensorOptions().dtype(at::kFloat).device(device));
  }
  // A sharded optimizer's grads are this rank's slices (ZeRO stage 2): the norm is every rank's together.
  at::Tensor norm;
  if (auto* sharding = detail::OptimizerAccess::sharding(optimizer)) norm = sharding->global_norm(grads, norm_type);
  return detail::clip_grads(grads, max_norm, norm_type, at::Tensor(), norm);
}

}  // namespace amp
