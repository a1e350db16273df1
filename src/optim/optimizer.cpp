#include "amp/optimizer.h"

// The step, the backward protocol (scale_loss's side) and torch::save archives of amp::OptimizerBase. Which
// tensors it steps and how groups added after initialize are adopted is its parameter index (param_index.h); what
// rides on its steps beside them are its training features (NOTE [Training features] in src/optim/feature.h).

#include <ATen/Functions.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <iostream>
#include <sstream>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "amp/fused_optimizers.h"
#include "amp/opt_level.h"
#include "core/host_sync.h"
#include "optim/feature.h"
#include "optim/fused_step_context.h"
#include "optim/master_weights.h"
#include "optim/optimizer_access.h"
#include "optim/param_index.h"
#include "optim/sharding.h"
#include "optim/step_ledger.h"
#include "options/format.h"
#include "scaling/device_scale.h"
#include "scaling/multi_tensor.h"
#include "scaling/optimizer_grads.h"
#include "scaling/scaled_grads.h"
#include "scaling/scaler_access.h"

namespace amp {
namespace {

using Pending = detail::StepLedger::Pending;

void clear_grad(const at::Tensor& t, bool set_to_none) {
  at::Tensor& grad = t.mutable_grad();
  if (!grad.defined()) return;
  if (set_to_none) {
    grad = at::Tensor();
  } else {
    grad = grad.detach();
    grad.zero_();
  }
}

// "a, b, c and 4 more": the first few names of a list.
std::string describe_parameters(const std::vector<std::string>& names) {
  constexpr size_t kShown = 3;
  std::string out;
  for (size_t i = 0; i < names.size() && i < kShown; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > kShown) out += " and " + std::to_string(names.size() - kShown) + " more";
  return out;
}

// The loss-scaler hyperparameters a checkpoint records and a resume must match, as doubles (init_scale
// matters only before the first step, so it may differ).
// The schedule the bank's scalers run (PythonCheckpoint::load_amp may have restored a Python GradScaler's).
std::vector<std::pair<std::string, double>> scaler_settings(const Properties& p, const LossScaler& s) {
  return {{"growth_factor", s.growth_factor()},
          {"backoff_factor", s.backoff_factor()},
          {"growth_interval", static_cast<double>(s.growth_interval())},
          {"hysteresis", static_cast<double>(p.hysteresis)}};
}

}  // namespace

OptimizerBase::OptimizerBase()
    : index_(std::make_shared<detail::ParamIndex>()), ledger_(std::make_unique<detail::StepLedger>()) {}
OptimizerBase::~OptimizerBase() = default;
OptimizerBase::OptimizerBase(OptimizerBase&&) noexcept = default;
OptimizerBase& OptimizerBase::operator=(OptimizerBase&&) noexcept = default;

int64_t OptimizerBase::host_sync_count() const noexcept { return ledger_->host_syncs; }

// NOTE [Counting host syncs]
// A host sync is a read of a device value on the host: .item(), a copy to the CPU. amp makes them in a few known
// places (the overflow flag after each unscaled backward, the overflow report, the norms of ZeRO's LAMB and stage-2
// clipping, FP8 auto_fallback's flags, auto_fp32's diagnosis), and each calls detail::count_host_sync(), which counts for the
// process (detail::host_sync_count, for the benchmarks) and for the optimizers of this thread's HostSyncScope:
// amp::Optimizer::step opens one for itself, amp::scale_loss's backward for its optimizers, amp::GradScaler for an
// amp optimizer it steps. The counting is the same on every device, so the CPU's count is the GPU's
// (CudaSyncTest checks them against CUDA's own count).
namespace detail {
HostSyncScope::HostSyncScope(std::vector<const OptimizerBase*> optimizers) {
  std::vector<int64_t*> counters;
  for (const OptimizerBase* o : optimizers) counters.push_back(&OptimizerAccess::host_syncs(*o));
  previous_ = exchange_host_sync_counters(std::move(counters));
}
HostSyncScope::~HostSyncScope() { exchange_host_sync_counters(std::move(previous_)); }
}  // namespace detail

int64_t host_sync_count(const OptimizerBase& optimizer) { return optimizer.host_sync_count(); }

const LossScaler& OptimizerBase::loss_scaler(int loss_id) const {
  check_loss_id(loss_id);
  const detail::HostSyncScope syncs({this});
  settle(/*wait=*/true);
  settle_scalers(/*wait=*/true);
  return (*scalers_)[static_cast<size_t>(loss_id)];
}

bool OptimizerBase::step_will_be_skipped() const {
  const detail::HostSyncScope syncs({this});
  settle(/*wait=*/true);
  return ledger_->skip_next_step;
}

int64_t OptimizerBase::skipped_steps() const {
  const detail::HostSyncScope syncs({this});
  settle(/*wait=*/true);
  if (!ledger_->device_skips.defined()) return ledger_->skipped_steps;
  if (!ledger_->device_skips.device().is_cpu()) detail::count_host_sync();
  return ledger_->skipped_steps + static_cast<int64_t>(ledger_->device_skips.item<float>());
}

const std::optional<OverflowReport>& OptimizerBase::last_overflow() const {
  const detail::HostSyncScope syncs({this});
  settle(/*wait=*/true);
  return last_overflow_;
}

// ---- A step that never waits (NOTE [A step that never waits] in src/scaling/device_scale.h) ----------------

struct detail::OverflowReportView {
  detail::HostView finite;  // per gradient checked: 1 if finite
  std::vector<std::pair<size_t, std::string>> checked;  // (model order, name) of each
  int loss_id;
  double loss_scale;
};

bool OptimizerBase::skips_on_device() const {
  if (!properties_.enabled || detail::host_decides()) return false;
  if (dynamic_cast<const optim::FusedOptimizer*>(&torch_optimizer()) == nullptr) return false;
  return std::none_of(features_.begin(), features_.end(),
                      [this](const std::shared_ptr<detail::Feature>& f) { return f->needs_overflow_on_host(*this); });
}

void OptimizerBase::defer_outcome(std::shared_ptr<detail::BackwardOutcomeView> outcome, const at::Tensor& overflow) {
  ledger_->step_found_inf = ledger_->step_found_inf.defined() ? at::maximum(ledger_->step_found_inf, overflow) : overflow;
  if (outcome) ledger_->pending.push_back({Pending::Kind::kBackward, std::move(outcome), ledger_->grads_generation, 0, nullptr});
}

void OptimizerBase::settle(bool wait) const {
  auto& self = const_cast<OptimizerBase&>(*this);
  if (wait) {  // one wait, for the newest: the device's queue is done up to it
    for (auto it = ledger_->pending.rbegin(); it != ledger_->pending.rend(); ++it) {
      if (it->kind == Pending::Kind::kBackward) {
        it->outcome->values.value(0);
        break;
      }
      if (it->kind == Pending::Kind::kReport) {
        if (!it->report->checked.empty()) it->report->finite.value(0);
        break;
      }
    }
  }
  while (!ledger_->pending.empty()) {
    Pending& front = ledger_->pending.front();
    if (front.kind == Pending::Kind::kBackward || front.kind == Pending::Kind::kReport) {
      const bool ready = front.kind == Pending::Kind::kBackward ? front.outcome->values.ready() : front.report->finite.ready();
      if (!wait && !ready) return;
    }
    Pending entry = std::move(front);
    ledger_->pending.pop_front();
    switch (entry.kind) {
      case Pending::Kind::kBackward: self.apply_outcome(*entry.outcome, entry.grads_generation); break;
      case Pending::Kind::kReport: self.finish_overflow_report(*entry.report); break;
      case Pending::Kind::kStep: self.apply_device_step(entry.grads_generation, entry.step_id); break;
      case Pending::Kind::kZeroGrad: self.ledger_->skip_next_step = false; break;
    }
  }
}

void OptimizerBase::apply_outcome(detail::BackwardOutcomeView& outcome, uint64_t grads_generation) {
  const bool overflow = outcome.overflow();
  LossScaler& host = (*scalers_)[static_cast<size_t>(outcome.loss_id)];
  if (detail::ScalerAccess::device(std::as_const(host)) == outcome.source &&
      outcome.update > detail::ScalerAccess::host_update(host)) {  // once per shared scaler
    detail::ScalerAccess::take_device_state(host, outcome.values.value(2), static_cast<int64_t>(outcome.values.value(3)),
                                            static_cast<int>(outcome.values.value(4)), outcome.update);
  }
  if (!overflow) return;
  const double scale = outcome.values.value(1);
  if (grads_generation == ledger_->grads_generation) {
    ledger_->pending.push_front({Pending::Kind::kReport, nullptr, 0, 0, start_overflow_report(outcome.loss_id, scale)});
  } else {  // its gradients are gone: the report can't name them
    OverflowReport report;
    report.loss_id = outcome.loss_id;
    report.loss_scale = scale;
    last_overflow_ = std::move(report);
  }
  finish_backward(outcome.loss_id, /*skip=*/true);
  if (host.dynamic() && scale <= host.min_loss_scale()) warn_overflow_at_minimum(outcome.loss_id, scale);
}

void OptimizerBase::apply_device_step(uint64_t grads_generation, uint64_t step_id) {
  const bool skipped = ledger_->skip_next_step;
  if (auto* fused = dynamic_cast<optim::FusedOptimizer*>(&torch_optimizer())) fused->settle_step(step_id, skipped);
  if (!skipped) return;
  ledger_->skip_next_step = false;
  announce_skip();
  ++ledger_->skipped_steps;
  // The overflowed gradients go, as after a skip the host decided (unless the script has moved on from them).
  if (grads_generation == ledger_->grads_generation) clear_grads(/*set_to_none=*/true);
}

void OptimizerBase::settle_scalers(bool wait) const {
  for (LossScaler& scaler : *scalers_) {
    const detail::DeviceScale* device = detail::ScalerAccess::device(std::as_const(scaler));
    if (device == nullptr || !wait) continue;
    // After a CUDA graph capture, replays update the device without telling the host: always read it.
    if (detail::ScalerAccess::host_update(scaler) >= device->updates() && !ledger_->device_truth) continue;
    device->read_into(scaler);
  }
}

std::shared_ptr<detail::OverflowReportView> OptimizerBase::start_overflow_report(int loss_id, double loss_scale) {
  std::unordered_map<const c10::TensorImpl*, size_t> model_order;
  for (const auto& weak : modules_) {
    if (const auto module = weak.lock()) {
      for (const auto& p : module->parameters()) model_order.emplace(p.unsafeGetTensorImpl(), model_order.size());
    }
  }
  std::vector<std::pair<size_t, std::string>> checked;
  std::vector<at::Tensor> finite;
  auto check = [&](const at::Tensor& model_param, const at::Tensor& grad, const std::string& name) {
    if (!grad.defined()) return;
    const auto it = model_order.find(model_param.unsafeGetTensorImpl());
    checked.emplace_back(it == model_order.end() ? model_order.size() : it->second, name);
    finite.push_back(at::isfinite(grad).all().to(finite.empty() ? grad.device() : finite.front().device()));
  };
  const detail::MasterWeights& masters = index_->masters();
  for (size_t i = 0; i < masters.size(); ++i) check(masters.model()[i], masters.master()[i].grad(), masters.name(i));
  const auto& direct = index_->direct();
  for (size_t i = 0; i < direct.size(); ++i) check(direct[i], direct[i].grad(), index_->direct_names()[i]);
  const at::Tensor values = finite.empty() ? at::zeros({0}, at::TensorOptions().dtype(at::kDouble))
                                           : at::stack(finite).to(at::kDouble);
  return std::make_shared<detail::OverflowReportView>(detail::OverflowReportView{detail::HostView(values), std::move(checked), loss_id,
                                                                 loss_scale});
}

void OptimizerBase::finish_overflow_report(detail::OverflowReportView& view) {
  std::vector<std::pair<size_t, std::string>> bad;
  for (size_t i = 0; i < view.checked.size(); ++i) {
    if (view.finite.value(static_cast<int64_t>(i)) == 0) bad.push_back(view.checked[i]);
  }
  std::sort(bad.begin(), bad.end());
  OverflowReport report;
  report.loss_id = view.loss_id;
  report.loss_scale = view.loss_scale;
  for (auto& [order, name] : bad) report.parameters.push_back(std::move(name));
  for (const auto& feature : features_) feature->describe_overflow(*this, report);
  last_overflow_ = std::move(report);
}

void OptimizerBase::announce_skip() const {
  if (properties_.verbosity < 1) return;
  const double scale = (*scalers_)[static_cast<size_t>(ledger_->skip_loss_id)].loss_scale();
  std::cout << "Gradient overflow.  Skipping step, loss scaler " << ledger_->skip_loss_id << " reducing loss scale to "
            << detail::format_float(scale);
  if (last_overflow_ && !last_overflow_->parameters.empty()) {
    std::cout << " (non-finite gradients: " << describe_parameters(last_overflow_->parameters) << ")";
  }
  if (last_overflow_ && !last_overflow_->fp8_layers.empty()) {
    std::cout << " (FP8 layers with a non-finite amax: " << describe_parameters(last_overflow_->fp8_layers) << ")";
  }
  std::cout << std::endl;
}

// The scale can't fall any further and the gradients still overflow: the inf/NaN does not come from
// scaling. Said once per optimizer and loss, at verbosity >= 1.
void OptimizerBase::warn_overflow_at_minimum(int loss_id, double loss_scale) {
  const auto id = static_cast<size_t>(loss_id);
  if (properties_.verbosity < 1) return;
  if (warned_at_min_scale_.size() <= id) warned_at_min_scale_.resize(id + 1, false);
  if (warned_at_min_scale_[id]) return;
  warned_at_min_scale_[id] = true;
  std::string names;
  if (last_overflow_ && last_overflow_->loss_id == loss_id) {
    for (const auto& n : last_overflow_->parameters) names += (names.empty() ? "" : ", ") + n;
  }
  std::cout << "amp: loss scaler " << loss_id << " is at its minimum (" << detail::format_float(loss_scale)
            << ") and the gradients still hold inf/NaN" << (names.empty() ? "" : " (in " + names + ")")
            << ". Lowering the scale can't fix this: look for a NaN or inf produced in the forward or the loss "
               "(bad inputs, log of 0, division by 0), a diverging learning rate, or an op that overflows in low "
               "precision (amp::register_float_function). Steps stay skipped until the gradients are finite."
            << std::endl;
}

void OptimizerBase::check_loss_id(int loss_id) const {
  TORCH_CHECK(loss_id >= 0 && loss_id < properties_.num_losses, "amp: loss_id ", loss_id,
              " is out of range: this optimizer was initialized with num_losses=", properties_.num_losses,
              ", so loss_id must be in [0, ", properties_.num_losses - 1,
              "]. Raise num_losses in amp::Options to scale more losses separately.");
}

void detail::OptimizerAccess::restore_loss_scalers(OptimizerBase& o, std::vector<LossScaler> scalers) {
  o.settle(/*wait=*/true);
  TORCH_CHECK(scalers.size() == o.scalers_->size(), "amp: restoring ", scalers.size(), " loss scaler(s) into an "
              "optimizer with ", o.scalers_->size(), " (num_losses).");
  // The schedule lives in the properties too (banner, torch::save archives): both follow the restored scalers.
  o.properties_.growth_factor = scalers.front().growth_factor();
  o.properties_.backoff_factor = scalers.front().backoff_factor();
  o.properties_.growth_interval = scalers.front().growth_interval();
  *o.scalers_ = std::move(scalers);
}

torch::optim::Optimizer& detail::OptimizerAccess::synced_torch_optimizer(OptimizerBase& o) {
  if (o.properties_.enabled) o.sync_param_groups();
  {  // what the device did: unseen skips put the step counts back; a capture's counts come from the device
    const detail::HostSyncScope syncs({&o});
    o.settle(/*wait=*/true);
  }
  if (auto* fused = dynamic_cast<optim::FusedOptimizer*>(&o.torch_optimizer())) {
    if (fused->step_context().counts_ahead()) fused->pull_device_steps();
  }
  return o.torch_optimizer();
}

std::unordered_map<const c10::TensorImpl*, std::string> detail::OptimizerAccess::param_group_names(const OptimizerBase& o) {
  return o.index_->names();
}

std::vector<at::Tensor> OptimizerBase::master_params() {
  if (sharding_) {
    sharding_->refresh_changed();
    return sharding_->pieces();  // this rank's pieces (NOTE [Sharded optimizers])
  }
  if (properties_.enabled) {
    sync_param_groups();
    index_->masters().refresh_changed();
  }
  std::vector<at::Tensor> out;
  for (auto& group : torch_optimizer().param_groups()) {
    for (auto& p : group.params()) out.push_back(p);
  }
  return out;
}

std::vector<at::Tensor> OptimizerBase::grads_for_step(const char* caller) {
  if (properties_.enabled) {
    sync_param_groups();
    TORCH_CHECK(!backward_prepared_, "amp::", caller, ": an amp::scale_loss handle of this optimizer is still open "
                "and its backward() has not run, so there are no unscaled gradients yet. Call scaled_loss.backward() "
                "(or let the handle go out of scope) first.");
    TORCH_CHECK(!scaled_grads_loss_id_, "amp::", caller, ": the gradients are still multiplied by the loss scale, "
                "because the last scale_loss used delay_unscale(true). Run the last micro-batch's scale_loss without "
                "delay_unscale (it unscales every gradient), then clip.");
    check_no_scaled_model_grads(caller);
  }
  if (sharding_) return sharding_->grads();
  return detail::defined_grads(torch_optimizer());
}

void OptimizerBase::refresh_master_params() {
  if (!properties_.enabled) return;
  sync_param_groups();
  if (sharding_) {
    sharding_->refresh_all();
    return;
  }
  index_->masters().refresh_all();
}

void OptimizerBase::sync_param_groups(bool at_initialize) {
  const bool reshard = sharding_ && index_->changed(torch_optimizer());
  if (reshard) sharding_->check_groups(torch_optimizer());  // NOTE [Sharded optimizers]: groups may be appended only
  index_->sync(torch_optimizer(), modules_, properties_, at_initialize);
  if (reshard) sharding_->adopt_groups(*this);
}

bool OptimizerBase::owns_model_tensor(const c10::TensorImpl* t) const { return index_->owns(t); }

void OptimizerBase::check_no_scaled_model_grads(const char* caller) const {
  const detail::ParamIndex& index = *index_;
  detail::check_no_scaled_grads(index.model_side(), [&index](size_t i) { return index.model_side_name(i); }, caller);
}

std::vector<std::shared_ptr<torch::nn::Module>> OptimizerBase::models() const {
  std::vector<std::shared_ptr<torch::nn::Module>> out;
  for (const auto& weak : modules_) {
    if (auto m = weak.lock()) out.push_back(std::move(m));
  }
  return out;
}

void OptimizerBase::attach(const std::vector<torch::nn::Module*>& modules, const Properties& properties,
                           std::shared_ptr<std::vector<LossScaler>> scalers) {
  TORCH_INTERNAL_ASSERT(!attached_, "amp: OptimizerBase attached twice");
  properties_ = properties;
  attached_ = true;
  if (!scalers) scalers = std::make_shared<std::vector<LossScaler>>(static_cast<size_t>(properties.num_losses),
                                                                    LossScaler(properties));
  scalers_ = std::move(scalers);
  unscaled_fast_path_ = !properties.master_weights && !properties.loss_scale.is_dynamic() &&
                        properties.loss_scale.value() == 1.0 && properties.auto_fp32 == 0;  // auto_fp32 needs the check
  for (torch::nn::Module* module : modules) modules_.push_back(module->shared_from_this());

  size_t count = 0;
  for (auto& group : torch_optimizer().param_groups()) count += group.params().size();
  TORCH_CHECK(count > 0, "amp::initialize: the optimizer holds no parameters. If it was std::move'd into an "
              "earlier amp::initialize, it is empty now: pass each optimizer through amp::initialize once, built "
              "from model->parameters().");
  sync_param_groups(/*at_initialize=*/true);
}

OptimizerBase::StepPlan OptimizerBase::begin_step() {
  ++ledger_->steps;
  if (!properties_.enabled) return StepPlan::kStep;
  sync_param_groups();
  TORCH_CHECK(!backward_prepared_, "amp::Optimizer::step: an amp::scale_loss handle of this optimizer is still "
              "open and its backward() has not run. Call scaled_loss.backward() (or let the handle go out of "
              "scope) before step().");
  TORCH_CHECK(!scaled_grads_loss_id_, "amp::Optimizer::step: the gradients are still scaled, because the last "
              "scale_loss used delay_unscale(true). Run the last micro-batch's scale_loss without delay_unscale "
              "before step().");
  check_no_scaled_model_grads("step");
  auto* fused = dynamic_cast<optim::FusedOptimizer*>(&torch_optimizer());
  if (fused && std::exchange(ledger_->set_found_inf, false)) fused->step_context().set_found_inf({}, 0);  // (amp::GradScaler sets its own)
  ledger_->settle_after_step = 0;
  if (ledger_->graph_mode) {  // amp::GraphCaptureGuard: the device decides and counts, the host records nothing
    if (ledger_->step_found_inf.defined()) ledger_->device_skips.add_(ledger_->step_found_inf.to(ledger_->device_skips.device()));
    fused->step_context().set_found_inf(std::exchange(ledger_->step_found_inf, at::Tensor()), /*step_id=*/0,
                                        /*captured=*/true);
    ledger_->set_found_inf = true;
    index_->refresh_changed();
    return StepPlan::kStep;
  }
  settle(/*wait=*/false);
  const bool unseen = std::any_of(ledger_->pending.begin(), ledger_->pending.end(),
                                  [](const Pending& p) { return p.kind == Pending::Kind::kBackward; });
  const auto id = static_cast<uint64_t>(ledger_->steps);
  if (unseen) {
    // The host has not seen every backward since the last step: the device decides the skip (NOTE [A step that
    // never waits]), and the host learns it with those backwards.
    // (No flag: a zero_grad came after those backwards, so none of them can skip this step.)
    TORCH_INTERNAL_ASSERT(fused, "amp: a backward that never waits without a fused step");
    fused->step_context().set_found_inf(ledger_->step_found_inf, id);
    ledger_->set_found_inf = true;
    ledger_->pending.push_back({Pending::Kind::kStep, nullptr, ledger_->grads_generation, id, nullptr});
  } else if (ledger_->step_found_inf.defined()) {
    // The host has seen those backwards already (on the CPU it always has), but a device's step would run before it
    // does: the fused step takes the flag all the same, so the CPU runs and counts (NOTE [Counting host syncs]) the
    // path a device takes, and the host settles the step right after it.
    TORCH_INTERNAL_ASSERT(fused, "amp: a backward that never waits without a fused step");
    fused->step_context().set_found_inf(ledger_->step_found_inf, id);
    ledger_->set_found_inf = true;
    ledger_->settle_after_step = id;
  }
  ledger_->step_found_inf = at::Tensor();
  const bool skip = !unseen && ledger_->skip_next_step;
  if (skip && ledger_->settle_after_step == 0) {
    take_skip();
    return StepPlan::kSkip;
  }
  if (sharding_) sharding_->refresh_changed();  // the step starts from the weights the model holds now
  else index_->refresh_changed();
  const auto& direct = index_->direct();
  for (size_t i = 0; i < direct.size(); ++i) {
    if (detail::holds_float32_bytes(direct[i])) detail::fail_float32_bytes("parameter", index_->direct_names()[i], direct[i]);
  }
  return skip ? StepPlan::kSkipInside : StepPlan::kStep;
}

void OptimizerBase::take_skip() {
  announce_skip();
  for (const auto& feature : features_) feature->after_step(*this, /*taken=*/false);
  // The overflowed gradients are dropped, so a skipped step leaves no trace in the next one.
  zero_all_grads(/*set_to_none=*/true);
  ++ledger_->skipped_steps;
}

void OptimizerBase::end_skipped_step() {
  if (auto* fused = dynamic_cast<optim::FusedOptimizer*>(&torch_optimizer())) {
    fused->settle_step(std::exchange(ledger_->settle_after_step, 0), /*skipped=*/true);
  }
  take_skip();
}

void OptimizerBase::end_step() {
  if (ledger_->settle_after_step != 0) {
    if (auto* fused = dynamic_cast<optim::FusedOptimizer*>(&torch_optimizer())) {
      fused->settle_step(std::exchange(ledger_->settle_after_step, 0), /*skipped=*/false);
    }
  }
  if (sharding_) {
    sharding_->after_step();
  } else if (index_->step_writes_model()) {
    index_->masters().mark_all_synced();
  } else {
    index_->masters().copy_to_model();
  }
  for (const auto& feature : features_) feature->after_step(*this, /*taken=*/true);
}

void OptimizerBase::zero_all_grads(bool set_to_none) {
  if (properties_.enabled) sync_param_groups();
  clear_grads(set_to_none);
  stash_.clear();
  backward_prepared_ = false;
  scaled_grads_loss_id_.reset();
  ledger_->skip_next_step = false;
  ledger_->step_found_inf = at::Tensor();
  ++ledger_->grads_generation;
  // A skip learned later is dropped too.
  if (!ledger_->pending.empty()) ledger_->pending.push_back({Pending::Kind::kZeroGrad, nullptr, 0, 0, nullptr});
}

void OptimizerBase::clear_grads(bool set_to_none) {
  detail::MasterWeights& masters = index_->masters();
  for (auto& p : masters.model()) clear_grad(p, set_to_none);
  for (auto& p : masters.master()) clear_grad(p, set_to_none);
  for (auto& p : index_->direct()) clear_grad(p, set_to_none);
  masters.clear_pending_grads();
  if (sharding_) sharding_->zero_grad(set_to_none);
}

void OptimizerBase::prepare_backward(int loss_id) {
  check_loss_id(loss_id);
  TORCH_CHECK(!backward_prepared_, "amp::scale_loss: another amp::scale_loss handle of this optimizer is still "
              "open and its backward() has not run. Finish one scaled loss (backward(), then let the handle go "
              "out of scope) before scaling the next; for several losses, call scale_loss once per loss, one "
              "after the other.");
  sync_param_groups();
  check_no_scaled_model_grads("backward");
  settle(/*wait=*/false);
  ++ledger_->grads_generation;
  if (scaled_grads_loss_id_) {
    TORCH_CHECK(*scaled_grads_loss_id_ == loss_id, "amp::scale_loss: the gradients hold values scaled by loss "
                "scaler ", *scaled_grads_loss_id_, " (delay_unscale), so the next scale_loss must use the same "
                "loss_id, got ", loss_id, ". Finish that accumulation without delay_unscale first.");
    backward_prepared_ = true;  // keep accumulating into the still-scaled grads, Apex's way
    return;
  }
  // Apex's grad-copy elision: move existing grads aside so backward writes only this loss's grads,
  // which are then unscaled with this loss's scale and added back. Accumulation stays exact even when
  // the scale changes between backward passes.
  const auto& direct = index_->direct();
  stash_.assign(direct.size(), at::Tensor());
  for (size_t i = 0; i < direct.size(); ++i) stash_[i] = std::exchange(direct[i].mutable_grad(), {});
  for (const auto& p : index_->masters().model()) p.mutable_grad() = at::Tensor();  // consumed into the masters already
  index_->masters().clear_reduced_grads();
  backward_prepared_ = true;
}

void OptimizerBase::unscale_grads(int loss_id, bool delay_unscale, const detail::InvScale& inv_scale,
                                  detail::FoundInf& found_inf) {
  TORCH_INTERNAL_ASSERT(backward_prepared_);
  backward_prepared_ = false;
  if (sharding_ && sharding_->owns_unscale()) {
    // ZeRO stage 2: the gradients are this rank's reduce-scattered slices; the model's .grad are gone.
    if (delay_unscale) scaled_grads_loss_id_ = loss_id;
    else scaled_grads_loss_id_.reset();
    sharding_->unscale(delay_unscale, inv_scale, found_inf);
    stash_.clear();
    return;
  }
  detail::MasterWeights& masters = index_->masters();
  const auto& model = masters.model();
  const auto& master = masters.master();
  const auto& direct = index_->direct();
  if (delay_unscale) {
    // Masters' gradients accumulate in fp32, still scaled, beside the model (whose .grad would round each sum
    // to its dtype); direct parameters keep theirs in .grad, in their own dtype, as Apex.
    scaled_grads_loss_id_ = loss_id;
    c10::NoGradGuard no_grad;
    for (size_t i = 0; i < model.size(); ++i) {
      at::Tensor& g = model[i].mutable_grad();
      const at::Tensor reduced = std::exchange(masters.reduced_grad(i), at::Tensor());
      if (!g.defined()) continue;
      const at::Tensor& sum = reduced.defined() ? reduced : g;  // NOTE [fp32 reductions reach the masters]
      at::Tensor& pending = masters.take_unreduced(i) ? masters.unreduced_grad(i) : masters.pending_grad(i);
      if (pending.defined()) pending.add_(sum);
      else pending = sum.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
      g = at::Tensor();
    }
    return;
  }
  std::vector<at::Tensor> new_grads;
  for (const auto& p : direct) {
    if (p.grad().defined()) new_grads.push_back(p.grad());
  }
  detail::unscale_(new_grads, inv_scale, found_inf);

  std::vector<at::Tensor> fresh_in, fresh_out, acc_in, acc_out;
  for (size_t i = 0; i < model.size(); ++i) {
    at::Tensor g = model[i].grad();
    // NOTE [fp32 reductions reach the masters]: the fp32 average .grad holds rounded, unscaled in its place.
    if (at::Tensor reduced = std::exchange(masters.reduced_grad(i), at::Tensor()); reduced.defined() && g.defined()) {
      g = reduced;
    }
    (void)masters.take_unreduced(i);  // a plain scale_loss inside no_sync(): amp::parallel refuses it next forward
    if (at::Tensor& pending = masters.pending_grad(i); pending.defined()) {  // delay_unscale's fp32 sum
      if (g.defined()) {
        c10::NoGradGuard no_grad;
        pending.add_(g);
      }
      g = std::exchange(pending, at::Tensor());
    }
    if (!g.defined()) continue;
    at::Tensor& master_grad = master[i].mutable_grad();
    if (master_grad.defined()) {
      acc_in.push_back(g);
      acc_out.push_back(master_grad);
    } else {
      // The fp32 sum is unscaled in place and becomes the master's gradient.
      master_grad = g.scalar_type() == at::kFloat && g.sizes() == master[i].sizes() ? g : at::empty_like(master[i]);
      fresh_in.push_back(g);
      fresh_out.push_back(master_grad);
    }
  }
  detail::unscale_into(fresh_in, fresh_out, /*accumulate=*/false, inv_scale, found_inf);
  detail::unscale_into(acc_in, acc_out, /*accumulate=*/true, inv_scale, found_inf);
  for (const auto& p : model) p.mutable_grad() = at::Tensor();

  for (size_t i = 0; i < stash_.size(); ++i) {
    if (!stash_[i].defined()) continue;
    at::Tensor& grad = direct[i].mutable_grad();
    if (grad.defined()) stash_[i].add_(grad);  // stashed + new * (1/scale), Apex's axpby
    grad = stash_[i];
  }
  stash_.clear();
  scaled_grads_loss_id_.reset();
}

void OptimizerBase::record_overflow(int loss_id, double loss_scale) {
  // Only overflowing backward passes get here, so a host read per gradient is affordable.
  std::unordered_map<const c10::TensorImpl*, size_t> model_order;
  for (const auto& weak : modules_) {
    if (const auto module = weak.lock()) {
      for (const auto& p : module->parameters()) model_order.emplace(p.unsafeGetTensorImpl(), model_order.size());
    }
  }
  std::vector<std::pair<size_t, std::string>> bad;
  auto check = [&](const at::Tensor& model_param, const at::Tensor& grad, const std::string& name) {
    if (!grad.defined()) return;
    detail::count_host_sync();
    if (at::isfinite(grad).all().item<bool>()) return;
    const auto it = model_order.find(model_param.unsafeGetTensorImpl());
    bad.emplace_back(it == model_order.end() ? model_order.size() : it->second, name);
  };
  const detail::MasterWeights& masters = index_->masters();
  for (size_t i = 0; i < masters.size(); ++i) check(masters.model()[i], masters.master()[i].grad(), masters.name(i));
  const auto& direct = index_->direct();
  for (size_t i = 0; i < direct.size(); ++i) check(direct[i], direct[i].grad(), index_->direct_names()[i]);
  std::sort(bad.begin(), bad.end());
  OverflowReport report;
  report.loss_id = loss_id;
  report.loss_scale = loss_scale;
  for (auto& [order, name] : bad) report.parameters.push_back(std::move(name));
  for (const auto& feature : features_) feature->describe_overflow(*this, report);
  last_overflow_ = std::move(report);
}

void OptimizerBase::after_backward(bool overflow, double loss_scale, double floor) {
  for (const auto& feature : features_) feature->after_backward(*this, {overflow, loss_scale, floor});
}

void OptimizerBase::finish_backward(int loss_id, bool skip) {
  if (skip && !ledger_->skip_next_step) {
    ledger_->skip_next_step = true;
    ledger_->skip_loss_id = loss_id;
  }
}

void OptimizerBase::abort_backward() noexcept {
  if (!backward_prepared_) return;
  backward_prepared_ = false;
  if (scaled_grads_loss_id_) return;  // nothing was moved aside
  for (size_t i = 0; i < stash_.size(); ++i) index_->direct()[i].mutable_grad() = stash_[i];
  stash_.clear();
}

void OptimizerBase::save_amp_state(torch::serialize::OutputArchive& archive) const {
  settle(/*wait=*/true);  // a checkpoint holds what the device did
  settle_scalers(/*wait=*/true);
  if (properties_.enabled) {
    // Saving is logically const, but the index and the masters must first catch up with the model:
    // a checkpoint taken after loading weights must hold those weights.
    auto& self = const_cast<OptimizerBase&>(*this);
    self.sync_param_groups();
    if (sharding_) sharding_->refresh_changed();
    else self.index_->refresh_changed();
  }
  const detail::MasterWeights& masters = index_->masters();
  torch::serialize::OutputArchive amp_archive(archive.compilation_unit());
  amp_archive.write("opt_level", c10::IValue(static_cast<int64_t>(properties_.opt_level)));
  amp_archive.write("master_weights", c10::IValue(static_cast<int64_t>(masters.size())));
  const std::vector<LossScaler>& scalers = *scalers_;
  amp_archive.write("num_losses", c10::IValue(static_cast<int64_t>(scalers.size())));
  amp_archive.write("skipped_steps", c10::IValue(skipped_steps()));
  for (size_t i = 0; i < scalers.size(); ++i) {
    const std::string prefix = "loss_scaler" + std::to_string(i) + "/";
    amp_archive.write(prefix + "loss_scale", c10::IValue(scalers[i].loss_scale()));
    amp_archive.write(prefix + "unskipped", c10::IValue(scalers[i].unskipped()));
    amp_archive.write(prefix + "hysteresis_left", c10::IValue(static_cast<int64_t>(scalers[i].hysteresis_left())));
  }
  for (const auto& [key, value] : scaler_settings(properties_, scalers.front())) amp_archive.write(key, c10::IValue(value));
  if (!sharding_) {
    for (size_t i = 0; i < masters.size(); ++i) amp_archive.write("master/" + std::to_string(i), masters.master()[i]);
  } else if (const auto* full = sharding_->consolidated_masters()) {  // save_consolidated: what an unsharded run writes
    for (size_t i = 0; i < full->size(); ++i) amp_archive.write("master/" + std::to_string(i), (*full)[i]);
  } else {
    sharding_->save(amp_archive);  // this rank's pieces and the layout
  }
  for (const auto& feature : features_) feature->save(*this, amp_archive);
  archive.write("amp", amp_archive);
}

void OptimizerBase::load_amp_state(torch::serialize::InputArchive& archive) {
  const char* where = "amp::Optimizer::load";
  settle(/*wait=*/true);
  torch::serialize::InputArchive amp_archive;
  TORCH_CHECK(archive.try_read("amp", amp_archive), where, ": the checkpoint has no amp state: it was saved from a "
              "plain torch::optim optimizer, not an amp::Optimizer. Save the optimizer returned by amp::initialize.");
  auto read_int = [&](const std::string& key) {
    c10::IValue v;
    TORCH_CHECK(amp_archive.try_read(key, v) && v.isInt(), where, ": the checkpoint's amp state has no integer '", key,
                "'; it is corrupt or from another program.");
    return v.toInt();
  };
  const auto level = static_cast<OptLevel>(read_int("opt_level"));
  TORCH_CHECK(level == properties_.opt_level, where, ": the checkpoint was saved at opt_level ", to_string(level),
              ", this optimizer runs at ", to_string(properties_.opt_level), ". Resume at the level the checkpoint "
              "was saved with.");
  const auto num_losses = read_int("num_losses");
  TORCH_CHECK(num_losses == static_cast<int64_t>(scalers_->size()), where, ": the checkpoint has ", num_losses,
              " loss scalers, this optimizer has ", scalers_->size(), " (num_losses). Resume with num_losses=",
              num_losses, ".");
  if (properties_.enabled) sync_param_groups();
  const bool shard_archive = detail::Sharding::is_shard_archive(archive);
  // The features check their state first (auto_fp32 repeats its decisions right away: they decide which
  // parameters have masters); what they restore waits for the last check.
  std::vector<std::function<void()>> restore;
  for (const auto& feature : features_) {
    if (auto apply = feature->load(*this, amp_archive, where)) restore.push_back(std::move(apply));
  }
  const detail::MasterWeights& mine = index_->masters();
  const auto num_masters = read_int("master_weights");
  TORCH_CHECK(num_masters == static_cast<int64_t>(mine.size()), where, ": the checkpoint has ", num_masters,
              " fp32 master weights, this optimizer has ", mine.size(), ". Resume with the same model, opt level, "
              "master_weights setting and param groups.");
  for (const auto& [key, value] : scaler_settings(properties_, scalers_->front())) {
    c10::IValue saved;
    if (!amp_archive.try_read(key, saved)) continue;  // checkpoints from before these settings: Apex's values
    TORCH_CHECK(saved.isDouble() && saved.toDouble() == value, where, ": the checkpoint was saved with ", key, " = ",
                saved.isDouble() ? detail::format_float(saved.toDouble()) : saved.tagKind(), ", this optimizer has ",
                key, " = ", detail::format_float(value), ". Resume with the loss-scaler settings the checkpoint was "
                "saved with (amp::Options / config key ", key, ").");
  }
  std::vector<LossScaler> scalers = *scalers_;
  for (size_t i = 0; i < scalers.size(); ++i) {
    const std::string prefix = "loss_scaler" + std::to_string(i) + "/";
    c10::IValue scale, left;
    TORCH_CHECK(amp_archive.try_read(prefix + "loss_scale", scale) && scale.isDouble(), where, ": the checkpoint's "
                "amp state has no '", prefix, "loss_scale'.");
    const bool has_left = amp_archive.try_read(prefix + "hysteresis_left", left) && left.isInt();
    scalers[i].load(scale.toDouble(), read_int(prefix + "unskipped"),
                    has_left ? std::optional<int64_t>(left.toInt()) : std::nullopt);
  }
  std::vector<at::Tensor> masters(shard_archive ? 0 : mine.size());
  for (size_t i = 0; i < masters.size(); ++i) {
    amp_archive.read("master/" + std::to_string(i), masters[i]);
    TORCH_CHECK(masters[i].sizes() == mine.master()[i].sizes(), where, ": master weight ", i, " ('", mine.name(i),
                "') has shape ", masters[i].sizes(), " in the checkpoint, ", mine.master()[i].sizes(), " here.");
  }
  const int64_t skipped_steps = read_int("skipped_steps");
  if (sharding_) restore.push_back(sharding_->load(*this, amp_archive, masters, where));
  // Everything validated: now change state.
  for (const auto& apply : restore) apply();
  *scalers_ = std::move(scalers);  // optimizers sharing the bank see the restored scales
  ledger_->skipped_steps = skipped_steps;
  ledger_->device_skips = at::Tensor();  // the host holds the truth again, until the next amp::GraphCaptureGuard
  ledger_->device_truth = false;
  if (!sharding_) {
    c10::NoGradGuard no_grad;
    for (size_t i = 0; i < mine.size(); ++i) mine.master()[i].copy_(masters[i]);
    index_->masters().copy_to_model();  // the model's low-precision params follow the restored masters
  }
  zero_all_grads(/*set_to_none=*/true);
}

void OptimizerBase::run_own(OwnCall call, const std::function<void()>& fn, torch::serialize::InputArchive* loading) const {
  auto& opt = const_cast<OptimizerBase&>(*this).torch_optimizer();
  // The optimizer's own archive first holds what the device did: a skip the host has not seen yet puts back the step
  // counts the step advanced (Adam's on ATen's route, FusedLAMB's groups') before they are written.
  if (call == OwnCall::kSave) {
    const detail::HostSyncScope syncs({this});
    settle(/*wait=*/true);
  }
  if (call == OwnCall::kLoad && detail::Sharding::is_shard_archive(*loading)) {
    if (!sharding_) {
      torch::serialize::InputArchive amp_archive;
      loading->read("amp", amp_archive);
      c10::IValue world, rank;
      const bool described = amp_archive.try_read("zero/world_size", world) && world.isInt() &&
                             amp_archive.try_read("zero/rank", rank) && rank.isInt();
      TORCH_CHECK(false, "amp::Optimizer::load: the checkpoint holds ",
                  described ? "rank " + std::to_string(rank.toInt()) + "'s shard of a ZeRO world of " +
                                  std::to_string(world.toInt()) + " ranks"
                            : std::string("one rank's shard of a ZeRO-sharded optimizer"),
                  " (torch::save on a rank after amp::parallel::shard_optimizer), and this optimizer is not sharded. "
                  "Load it after shard_optimizer, on the same rank of the same world size; a single process or another "
                  "world size loads what amp::parallel::save_consolidated writes.");
    }
    sharding_->check_shard_archive(*loading, "amp::Optimizer::load");
    sharding_->on_shard(opt, detail::Sharding::Use::kLoad, fn);
    return;
  }
  if (call == OwnCall::kSave && ledger_->device_truth) {  // the step counts a CUDA graph advanced on the device
    if (auto* fused = dynamic_cast<optim::FusedOptimizer*>(&opt)) fused->pull_device_steps();
  }
  if (!sharding_ || call == OwnCall::kLoad) {
    fn();  // an unsharded archive loads into the full tensors; load_amp_state hands it to the sharding after
    return;
  }
  sharding_->on_shard(opt, call == OwnCall::kStep ? detail::Sharding::Use::kStep : detail::Sharding::Use::kSave, fn);
}

}  // namespace amp
