#include "optim/fused_step_context.h"

#include <ATen/Functions.h>
#include <torch/optim/optimizer.h>

#include "amp/fused_optimizer.h"
#include "core/host_sync.h"
#include "optim/lean_masters.h"
#include "optim/state_format.h"
#include "scaling/device_scale.h"

namespace amp::detail {

const at::Tensor* FusedStepContext::model_copy(const at::Tensor& p) const {
  if (model_copies_.empty()) return nullptr;
  const auto it = model_copies_.find(p.unsafeGetTensorImpl());
  return it == model_copies_.end() ? nullptr : &it->second;
}

const std::optional<double>& FusedStepContext::grad_scale() const {
  if (!grad_scale_ && grad_scale_tensor_.defined()) {
    if (!grad_scale_tensor_.device().is_cpu() || host_reads_count_) count_host_sync();
    grad_scale_ = static_cast<double>(grad_scale_tensor_.item<float>());
  }
  return grad_scale_;
}

// ATen's kernels divide each gradient by grad_scale themselves and store it back unscaled.
std::optional<at::Tensor> FusedStepContext::aten_grad_scale(const at::Tensor& like) const {
  if (grad_scale_tensor_.defined()) return grad_scale_tensor_.to(like.device(), at::kFloat);
  if (!grad_scale_) return std::nullopt;
  return at::full({}, *grad_scale_, like.options().dtype(at::kFloat));
}

void FusedStepContext::settle_step(optim::FusedOptimizer& owner, uint64_t step_id, bool skipped) {
  const auto it = settle_.find(step_id);
  if (it == settle_.end()) return;
  auto& self = dynamic_cast<torch::optim::Optimizer&>(owner);
  for (const auto& settle : it->second) settle(self, owner, skipped);
  settle_.erase(it);
}

at::Tensor FusedStepContext::first_step_flag(const at::Tensor& key, const at::Tensor& buffer, bool make, DropBuffer drop) {
  const c10::TensorImpl* impl = key.unsafeGetTensorImpl();
  auto it = first_steps_.find(impl);
  if (it != first_steps_.end() && it->second.buffer != buffer.unsafeGetTensorImpl()) {
    first_steps_.erase(it);
    it = first_steps_.end();
  }
  if (it == first_steps_.end()) {
    if (!make) return at::Tensor();
    it = first_steps_.emplace(impl, FirstStepFlag{at::ones({}, buffer.options().dtype(at::kBool)),
                                                  buffer.unsafeGetTensorImpl(), 0, false, ++first_step_generation_,
                                                  std::move(drop)}).first;
  }
  FirstStepFlag& entry = it->second;
  if (step_id_ == 0) {  // a graph capture: nobody settles (settle_first_step_flags does, from pull_device_steps)
    counts_ahead_ = true;
    entry.uncounted = true;
    return entry.flag;
  }
  ++entry.unsettled;
  settle_[step_id_].push_back([impl, generation = entry.generation](torch::optim::Optimizer& self,
                                                                     optim::FusedOptimizer& fused, bool skipped) {
    auto& firsts = fused.step_context().first_steps_;
    const auto found = firsts.find(impl);
    if (found == firsts.end() || found->second.generation != generation) return;
    if (!skipped) {  // a committed step: the buffer has had its first step
      firsts.erase(found);
    } else if (--found->second.unsettled == 0 && !found->second.uncounted) {  // every step since it was made skipped
      found->second.drop(self, found->second.buffer);
      firsts.erase(found);
    }
  });
  return entry.flag;
}

void FusedStepContext::settle_first_step_flags(optim::FusedOptimizer& owner) {
  if (first_steps_.empty()) return;
  auto& self = dynamic_cast<torch::optim::Optimizer&>(owner);
  for (auto& [impl, entry] : first_steps_) {
    count_host_sync();  // a device's flag (the CPU's only where tests force ATen's kernels there)
    if (entry.flag.item<bool>()) entry.drop(self, entry.buffer);
  }
  first_steps_.clear();
}

FusedStepContext::Skip FusedStepContext::found_inf_decision(bool aten_only, bool on_device_there) const {
  host_reads_count_ = !on_device_there;
  if (!found_inf_.defined()) return Skip::kNo;
  // (Tests run the device's path on the CPU: DeferredHostReadsGuard.)
  if (aten_only && (!found_inf_.device().is_cpu() || host_reads_deferred() || step_id_ == 0)) {
    return Skip::kOnDevice;
  }
  // NOTE [Counting host syncs]: amp's CPU loops read a CPU flag for free where a device's kernels would take it;
  // anything else is a wait on a device, and counts on the CPU too.
  if (!found_inf_.device().is_cpu() || !on_device_there) count_host_sync();
  return found_inf_.item<float>() != 0.0f ? Skip::kYes : Skip::kNo;
}

at::Tensor FusedStepContext::device_step(const at::Tensor& key, int64_t host_step, const c10::Device& device,
                                       SetHostCount set_host) {
  DeviceStep& entry = device_steps_[key.unsafeGetTensorImpl()];
  entry.set_host = std::move(set_host);
  if (entry.count.defined() && entry.count.device() == device && entry.host == host_step - 1) {
    entry.count.add_(1);
  } else {  // first use, or the host count changed under it (a loaded checkpoint): the host's count
    entry.count = at::full({}, static_cast<double>(host_step), at::TensorOptions().dtype(at::kFloat).device(device));
  }
  entry.host = host_step;
  return entry.count;
}

void FusedStepContext::pull_device_steps(optim::FusedOptimizer& owner) {
  counts_ahead_ = false;
  settle_first_step_flags(owner);
  if (state_format_) state_format_->pull_device_counter();
  if (lean_) lean_->pull_device_counter();
  auto& self = dynamic_cast<torch::optim::Optimizer&>(owner);
  for (auto& [key, entry] : device_steps_) {
    if (!entry.count.defined() || !entry.set_host) continue;
    count_host_sync();  // a device's count (the CPU's only where tests force ATen's kernels there)
    entry.host = static_cast<int64_t>(entry.count.item<float>());
    entry.set_host(self, entry.host);
  }
}

void FusedStepContext::end_format_step(StateFormat& format, bool on_device) {
  const uint64_t draws = format.end_step(on_device ? found_inf_ : at::Tensor());
  if (!on_device || draws == 0) return;
  on_skip_undo([draws](torch::optim::Optimizer&, optim::FusedOptimizer& self) {
    if (const auto& f = self.step_context().state_format()) f->rewind(draws);
  });
}

void FusedStepContext::rewind_lean_draws_on_skip() {
  if (!lean_ || lean_->format() != amp::MasterWeights::kStochasticRounding) return;
  on_skip_undo([](torch::optim::Optimizer&, optim::FusedOptimizer& self) {
    if (const auto& lean = self.step_context().lean_masters()) lean->rewind_step();
  });
}

void FusedStepContext::undo_device_step(const c10::TensorImpl* key) {
  const auto it = device_steps_.find(key);
  if (it != device_steps_.end()) --it->second.host;
}


}  // namespace amp::detail
