#include "scaling/device_scale.h"

#include <ATen/Functions.h>
#include <c10/core/Event.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>

#include "amp/loss_scaler.h"
#include "core/host_sync.h"
#include "scaling/scaler_access.h"

namespace amp::detail {
namespace {
thread_local bool defer_host_reads = false;
// Waiting for one value waits for the device's queue up to it: views made before it are ready too.
thread_local uint64_t views_made = 0;
thread_local uint64_t waited_up_to = 0;
}  // namespace

DeferredHostReadsGuard::DeferredHostReadsGuard() : previous_(defer_host_reads) { defer_host_reads = true; }
DeferredHostReadsGuard::~DeferredHostReadsGuard() { defer_host_reads = previous_; }
bool host_reads_deferred() { return defer_host_reads; }

namespace {
thread_local bool host_decides_steps = false;
}  // namespace

HostDecidesGuard::HostDecidesGuard() : previous_(host_decides_steps) { host_decides_steps = true; }
HostDecidesGuard::~HostDecidesGuard() { host_decides_steps = previous_; }
bool host_decides() { return host_decides_steps; }

HostView::HostView(const at::Tensor& values) : device_(values), sequence_(++views_made) {
  if (values.device().is_cpu()) {
    host_ = values;
    return;
  }
  host_ = at::empty(values.sizes(), values.options().device(at::kCPU).pinned_memory(true));
  host_.copy_(values, /*non_blocking=*/true);
  const c10::impl::VirtualGuardImpl guard(values.device().type());
  auto event = std::make_shared<c10::Event>(values.device().type());
  event->record(guard.getStream(values.device()));
  event_ = std::move(event);
}

bool HostView::ready() const {
  if (waited_ || sequence_ <= waited_up_to) return true;
  if (defer_host_reads) return false;
  return !event_ || static_cast<const c10::Event*>(event_.get())->query();
}

double HostView::value(int64_t i) {
  if (!ready()) {
    count_host_sync();
    // Blocking: a synchronous copy waits for the stream (LibTorch 1.13's c10::Event cannot wait by itself).
    if (event_) host_ = device_.to(at::kCPU);
    waited_up_to = std::max(waited_up_to, sequence_);
  }
  waited_ = true;
  return host_.data_ptr<double>()[i];
}

DeviceScale::DeviceScale(const LossScaler& host, const c10::Device& device)
    : device_(device),
      dynamic_(host.dynamic()),
      min_scale_(host.min_loss_scale()),
      max_scale_(host.max_loss_scale()),
      growth_factor_(host.growth_factor()),
      backoff_factor_(host.backoff_factor()),
      growth_interval_(host.growth_interval()),
      hysteresis_(host.hysteresis()) {
  const auto on = at::TensorOptions().device(device);
  scale_ = at::full({}, host.loss_scale(), on.dtype(at::kDouble));
  unskipped_ = at::full({}, host.unskipped(), on.dtype(at::kLong));
  hysteresis_left_ = at::full({}, static_cast<int64_t>(host.hysteresis_left()), on.dtype(at::kLong));
  refresh_factors();
  if (device.is_cpu()) cpu_ = std::make_unique<LossScaler>(host);
}

// In place: a captured CUDA graph reads the tensors it was captured with on every replay.
void DeviceScale::refresh_factors() {
  if (!multiplier_.defined()) {
    multiplier_ = at::empty({}, scale_.options().dtype(at::kFloat));
    inverse_ = at::empty({1}, scale_.options().dtype(at::kFloat));
  }
  multiplier_.copy_(scale_);
  inverse_.copy_(scale_.reciprocal().reshape({1}));  // 1.0 / scale in double, then to float: the host's factor
}

HostView DeviceScale::update(const at::Tensor& overflow) {
  if (cpu_ && !host_reads_deferred()) {
    const double before = cpu_->loss_scale();
    update_on_device(overflow);
    const at::Tensor values = at::empty({5}, at::TensorOptions().dtype(at::kDouble));
    double* v = values.data_ptr<double>();
    v[0] = overflow.item<bool>() ? 1.0 : 0.0;
    v[1] = before;
    v[2] = cpu_->loss_scale();
    v[3] = static_cast<double>(cpu_->unskipped());
    v[4] = cpu_->hysteresis_left();
    return HostView(values);
  }
  const at::Tensor before = scale_.clone();
  update_on_device(overflow);
  return HostView(at::stack({overflow.to(at::kDouble), before, scale_, unskipped_.to(at::kDouble),
                             hysteresis_left_.to(at::kDouble)}));
}

// LossScaler::update_scale, branch for branch, as selects over both outcomes.
void DeviceScale::update_on_device(const at::Tensor& overflow) {
  c10::NoGradGuard no_grad;
  if (cpu_ && !host_reads_deferred()) {
    cpu_->update_scale(overflow.item<bool>());  // a CPU tensor: nothing to wait for
    scale_.data_ptr<double>()[0] = cpu_->loss_scale();
    unskipped_.data_ptr<int64_t>()[0] = cpu_->unskipped();
    hysteresis_left_.data_ptr<int64_t>()[0] = cpu_->hysteresis_left();
    multiplier_.data_ptr<float>()[0] = static_cast<float>(cpu_->loss_scale());
    inverse_.data_ptr<float>()[0] = static_cast<float>(1.0 / cpu_->loss_scale());
    ++updates_;
    return;
  }
  const at::Tensor clean_passes = unskipped_.add(1);
  if (dynamic_) {
    const at::Tensor delay = hysteresis_left_.gt(1);
    const at::Tensor backed_off = at::where(delay, scale_, scale_.mul(backoff_factor_).clamp_min(min_scale_));
    const at::Tensor grow = clean_passes.ge(growth_interval_);
    const at::Tensor grown = at::where(grow, scale_.mul(growth_factor_).clamp_max(max_scale_), scale_);
    const at::Tensor left_after_overflow = at::where(delay, hysteresis_left_.sub(1), hysteresis_left_);
    const at::Tensor left_after_clean = at::where(grow, at::full_like(hysteresis_left_, hysteresis_), hysteresis_left_);
    scale_.copy_(at::where(overflow, backed_off, grown));
    hysteresis_left_.copy_(at::where(overflow, left_after_overflow, left_after_clean));
    unskipped_.copy_(at::where(overflow.logical_or(grow), at::zeros_like(unskipped_), clean_passes));
    refresh_factors();
  } else {
    unskipped_.copy_(at::where(overflow, at::zeros_like(unskipped_), clean_passes));
  }
  ++updates_;
  if (cpu_) {  // a CPU scale run as a device's (DeferredHostReadsGuard): the host machine follows
    ScalerAccess::set_state(*cpu_, scale_.item<double>(), unskipped_.item<int64_t>(),
                            static_cast<int>(hysteresis_left_.item<int64_t>()));
  }
}

void DeviceScale::read_into(LossScaler& host) const {
  count_host_sync();
  const at::Tensor values =
      at::stack({scale_, unskipped_.to(at::kDouble), hysteresis_left_.to(at::kDouble)}).to(at::kCPU);
  const double* v = values.data_ptr<double>();
  ScalerAccess::take_device_state(host, v[0], static_cast<int64_t>(v[1]), static_cast<int>(v[2]), updates_);
}

}  // namespace amp::detail
