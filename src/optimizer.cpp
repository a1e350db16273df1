#include "amp/optimizer.h"

#include <ATen/Functions.h>
#include <c10/core/GradMode.h>
#include <c10/util/Half.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>

#include <algorithm>
#include <iostream>
#include <sstream>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>

#include "amp/fused_optimizers.h"
#include "amp/opt_level.h"
#include "format.h"
#include "model_casting.h"
#include "master_weights.h"
#include "multi_tensor.h"
#include "optimizer_state_key.h"
#include "scaled_grads.h"

namespace amp {
namespace {

using detail::state_key;

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

// Returns the eps of the optimizers that add it to a denominator, if `options` is one of theirs.
std::optional<double> denominator_eps(const torch::optim::OptimizerOptions& options) {
  if (auto* o = dynamic_cast<const torch::optim::AdamOptions*>(&options)) return o->eps();
  if (auto* o = dynamic_cast<const torch::optim::AdamWOptions*>(&options)) return o->eps();
  if (auto* o = dynamic_cast<const torch::optim::RMSpropOptions*>(&options)) return o->eps();
  if (auto* o = dynamic_cast<const torch::optim::AdagradOptions*>(&options)) return o->eps();
  return std::nullopt;
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

// LibTorch's Adagrad builds its state in the constructor. Untouched (step 0), that state is what a
// lazily built one in the parameter's dtype would be, so it may follow the parameter's cast.
bool is_untouched_adagrad_state(const torch::optim::OptimizerParamState& state) {
  const auto* adagrad = dynamic_cast<const torch::optim::AdagradParamState*>(&state);
  return adagrad != nullptr && adagrad->step() == 0;
}

using StateMap = std::remove_reference_t<decltype(std::declval<torch::optim::Optimizer&>().state())>;

void cast_initial_state(StateMap& state, const at::Tensor& p, c10::ScalarType dtype) {
  const auto it = state.find(state_key(state, p));
  if (it == state.end()) return;
  auto& adagrad = static_cast<torch::optim::AdagradParamState&>(*it->second);  // checked by is_untouched_adagrad_state
  adagrad.sum(adagrad.sum().to(dtype));
}

// Casts a parameter added to the optimizer after initialize, keeping its identity (as initialize does).
void cast_parameter(at::Tensor& p, c10::ScalarType dtype) {
  if (p.scalar_type() == dtype) return;
  c10::NoGradGuard no_grad;
  p.set_data(p.to(dtype));
  p.mutable_grad() = at::Tensor();
}

}  // namespace

const LossScaler& OptimizerBase::loss_scaler(int loss_id) const {
  check_loss_id(loss_id);
  return (*scalers_)[static_cast<size_t>(loss_id)];
}

void OptimizerBase::check_loss_id(int loss_id) const {
  TORCH_CHECK(loss_id >= 0 && loss_id < properties_.num_losses, "amp: loss_id ", loss_id,
              " is out of range: this optimizer was initialized with num_losses=", properties_.num_losses,
              ", so loss_id must be in [0, ", properties_.num_losses - 1,
              "]. Raise num_losses in amp::Options to scale more losses separately.");
}

torch::optim::Optimizer& OptimizerBase::synced_torch_optimizer() {
  if (properties_.enabled) sync_param_groups();
  return torch_optimizer();
}

std::unordered_map<const c10::TensorImpl*, std::string> OptimizerBase::param_group_names() const {
  std::unordered_map<const c10::TensorImpl*, std::string> names;
  if (masters_) {
    for (size_t i = 0; i < masters_->size(); ++i) names.emplace(masters_->master()[i].unsafeGetTensorImpl(), masters_->name(i));
  }
  for (size_t i = 0; i < direct_params_.size(); ++i) names.emplace(direct_params_[i].unsafeGetTensorImpl(), direct_names_[i]);
  return names;
}

void OptimizerBase::restore_loss_scalers(std::vector<LossScaler> scalers) {
  TORCH_CHECK(scalers.size() == scalers_->size(), "amp: restoring ", scalers.size(), " loss scaler(s) into an optimizer "
              "with ", scalers_->size(), " (num_losses).");
  // The schedule lives in the properties too (banner, torch::save archives): both follow the restored scalers.
  properties_.growth_factor = scalers.front().growth_factor();
  properties_.backoff_factor = scalers.front().backoff_factor();
  properties_.growth_interval = scalers.front().growth_interval();
  *scalers_ = std::move(scalers);
}

std::vector<at::Tensor> OptimizerBase::master_params() {
  if (properties_.enabled) {
    sync_param_groups();
    masters_->refresh_changed();
  }
  std::vector<at::Tensor> out;
  for (auto& group : torch_optimizer().param_groups()) {
    for (auto& p : group.params()) out.push_back(p);
  }
  return out;
}

void OptimizerBase::refresh_master_params() {
  if (!properties_.enabled) return;
  sync_param_groups();
  masters_->refresh_all();
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
                        properties.loss_scale.value() == 1.0;
  for (torch::nn::Module* module : modules) modules_.push_back(module->shared_from_this());
  masters_ = std::make_shared<detail::MasterWeights>();

  size_t count = 0;
  for (auto& group : torch_optimizer().param_groups()) count += group.params().size();
  TORCH_CHECK(count > 0, "amp::initialize: the optimizer holds no parameters. If it was std::move'd into an "
              "earlier amp::initialize, it is empty now: pass each optimizer through amp::initialize once, built "
              "from model->parameters().");
  sync_param_groups(/*at_initialize=*/true);
}

bool OptimizerBase::param_groups_changed() const {
  const auto& groups = torch_optimizer().param_groups();
  if (groups.size() != known_groups_.size()) return true;
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& params = groups[g].params();
    const auto& known = known_groups_[g];
    if (params.size() != known.size()) return true;
    for (size_t i = 0; i < params.size(); ++i) {
      if (params[i].unsafeGetTensorImpl() != known[i]) return true;
    }
  }
  return false;
}

void OptimizerBase::sync_param_groups(bool at_initialize) {
  if (!at_initialize && !param_groups_changed()) return;
  const char* where = at_initialize ? "amp::initialize" : "amp::Optimizer (a param group added after initialize)";

  std::unordered_map<const c10::TensorImpl*, std::string> model_params;
  std::unordered_set<const c10::TensorImpl*> to_cast;
  for (const auto& weak : modules_) {
    const auto module = weak.lock();
    TORCH_CHECK(module, where, ": a model this optimizer was initialized with no longer exists. Keep the model "
                "returned by amp::initialize alive as long as its optimizer.");
    for (const auto& item : module->named_parameters()) model_params.emplace(item.value().unsafeGetTensorImpl(), item.key());
    to_cast.merge(detail::tensors_to_cast(*module, properties_));
  }
  const bool make_masters = properties_.master_weights && detail::casts_model_to_low_precision(properties_);

  // What the optimizer already has, found through the tensors param_groups hold (masters at O2).
  std::unordered_map<const c10::TensorImpl*, size_t> known_master, known_direct;
  for (size_t i = 0; i < masters_->size(); ++i) known_master.emplace(masters_->master()[i].unsafeGetTensorImpl(), i);
  for (size_t i = 0; i < direct_params_.size(); ++i) known_direct.emplace(direct_params_[i].unsafeGetTensorImpl(), i);

  // First pass: classify and check every parameter, changing nothing.
  enum class Kind { kKnownMaster, kKnownDirect, kNewMaster, kNewDirect };
  struct Plan {
    Kind kind;
    size_t known_index = 0;
    std::string name;
    bool cast = false;
  };
  std::vector<std::vector<Plan>> plans;
  std::unordered_set<const c10::TensorImpl*> seen;
  torch::optim::Optimizer& opt = torch_optimizer();
  auto& state = opt.state();
  const c10::ScalarType lp = properties_.cast_model_type.value_or(at::kFloat);
  for (size_t g = 0; g < opt.param_groups().size(); ++g) {
    plans.emplace_back();
    const auto& params = opt.param_groups()[g].params();
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& p = params[i];
      TORCH_CHECK(seen.insert(p.unsafeGetTensorImpl()).second, where, ": parameter ", i, " of group ", g,
                  " (shape ", p.sizes(), ") appears twice in the optimizer's param_groups; list each parameter once.");
      if (const auto m = known_master.find(p.unsafeGetTensorImpl()); m != known_master.end()) {
        plans[g].push_back({Kind::kKnownMaster, m->second, masters_->name(m->second)});
        continue;
      }
      if (const auto d = known_direct.find(p.unsafeGetTensorImpl()); d != known_direct.end()) {
        plans[g].push_back({Kind::kKnownDirect, d->second, direct_names_[d->second]});
        continue;
      }
      const auto found = model_params.find(p.unsafeGetTensorImpl());
      TORCH_CHECK(found != model_params.end(), where, ": the optimizer's parameter ", i, " of group ", g,
                  " (shape ", p.sizes(), ") is not a parameter of the model", (modules_.size() > 1 ? "s" : ""),
                  ". Build the optimizer and its param groups from parameters of the model you pass to "
                  "amp::initialize.");
      const bool cast = to_cast.count(p.unsafeGetTensorImpl()) > 0;
      if (cast && make_masters) {
        TORCH_CHECK(!detail::find_master(p), where, ": parameter '", found->second, "' is already stepped by another "
                    "amp::Optimizer with fp32 master weights; two optimizers would update two masters of one "
                    "weight. Put each parameter in one optimizer.");
        plans[g].push_back({Kind::kNewMaster, 0, found->second, true});
      } else {
        if (cast) check_state_without_master(state, p, g, found->second, lp);
        plans[g].push_back({Kind::kNewDirect, 0, found->second, cast});
      }
    }
  }

  // Second pass: build the new index, making masters and casting where the level asks.
  auto masters = std::make_shared<detail::MasterWeights>();
  std::vector<at::Tensor> direct;
  std::vector<std::string> direct_names;
  for (size_t g = 0; g < opt.param_groups().size(); ++g) {
    auto& params = opt.param_groups()[g].params();
    for (size_t i = 0; i < params.size(); ++i) {
      at::Tensor& p = params[i];
      const Plan& plan = plans[g][i];
      switch (plan.kind) {
        case Kind::kKnownMaster:
          masters->add(plan.name, masters_->model()[plan.known_index], p);
          break;
        case Kind::kKnownDirect:
          direct.push_back(p);
          direct_names.push_back(plan.name);
          break;
        case Kind::kNewMaster: {
          // The master copies the fp32 value where there still is one (at initialize; Apex copied the
          // fp16 one, losing bits). A group added later has only the low-precision weights left.
          at::Tensor master = p.detach().clone().to(at::kFloat).set_requires_grad(true);
          auto old_state = state.find(state_key(state, p));
          if (old_state != state.end()) {  // fp32 state moves to the fp32 master unchanged
            auto moved = std::move(old_state->second);
            state.erase(old_state);
            state[state_key(state, master)] = std::move(moved);
          }
          if (!at_initialize) cast_parameter(p, lp);
          masters->add(plan.name, p, master);
          p = master;
          break;
        }
        case Kind::kNewDirect:
          if (plan.cast) {
            cast_initial_state(state, p, lp);
            if (!at_initialize) cast_parameter(p, lp);
          }
          direct.push_back(p);
          direct_names.push_back(plan.name);
          break;
      }
    }
  }
  // Everything checked: swap in the new index (an exception above changed only the masters' state keys).
  masters_.reset();
  detail::register_masters(masters);
  masters_ = std::move(masters);
  direct_params_ = std::move(direct);
  direct_names_ = std::move(direct_names);
  known_groups_.clear();
  for (auto& group : opt.param_groups()) {
    known_groups_.emplace_back();
    for (auto& p : group.params()) known_groups_.back().push_back(p.unsafeGetTensorImpl());
  }
  // A fused optimizer writes each master's rounded copy into the model in its own pass (no copy_to_model).
  if (auto* fused = dynamic_cast<optim::FusedOptimizer*>(&opt)) {
    std::unordered_map<const c10::TensorImpl*, at::Tensor> copies;
    for (size_t i = 0; i < masters_->size(); ++i) copies.emplace(masters_->master()[i].unsafeGetTensorImpl(), masters_->model()[i]);
    fused->set_model_copies(std::move(copies));
    step_writes_model_ = true;
  }
  model_side_ = masters_->model();
  model_side_.insert(model_side_.end(), direct_params_.begin(), direct_params_.end());
  model_side_set_.clear();
  for (const auto& t : model_side_) model_side_set_.insert(t.unsafeGetTensorImpl());
}

void OptimizerBase::check_state_without_master(const StateMap& state, const at::Tensor& p,
                                               size_t group, const std::string& name, c10::ScalarType lp) const {
  const auto it = state.find(state_key(state, p));
  TORCH_CHECK(it == state.end() || is_untouched_adagrad_state(*it->second), "amp::initialize: the optimizer already "
              "has state for parameter '", name, "', which opt_level ", to_string(properties_.opt_level), " casts to ",
              dtype_name(lp), " without master weights; that fp32 state would no longer match. Call amp::initialize "
              "first, then torch::load the optimizer (Apex's documented order).");
  // Optimizer state in float16 (no master weights): an eps that rounds to 0 there makes Adam-style
  // denominators 0 on small gradients, and the step writes NaN into the weights (pytorch #8860, apex #240).
  const auto eps = denominator_eps(torch_optimizer().param_groups()[group].options());
  TORCH_CHECK(!(eps && lp == c10::ScalarType::Half && static_cast<float>(c10::Half(static_cast<float>(*eps))) == 0.0f),
              "amp::initialize: opt_level ", to_string(properties_.opt_level), " keeps parameter '", name,
              "' and its optimizer state in float16 without fp32 master weights, where the optimizer's eps=", *eps,
              " rounds to 0: steps with small gradients would divide 0 by 0 and write NaN into the weights. Use "
              "opt_level O2 (fp32 master weights), low_precision_dtype bfloat16, or an eps of at least 1e-4.");
}

std::string OptimizerBase::model_side_name(size_t i) const {
  return i < masters_->size() ? masters_->name(i) : direct_names_[i - masters_->size()];
}

bool OptimizerBase::begin_step() {
  if (!properties_.enabled) return true;
  sync_param_groups();
  TORCH_CHECK(!backward_prepared_, "amp::Optimizer::step: an amp::scale_loss handle of this optimizer is still "
              "open and its backward() has not run. Call scaled_loss.backward() (or let the handle go out of "
              "scope) before step().");
  TORCH_CHECK(!scaled_grads_loss_id_, "amp::Optimizer::step: the gradients are still scaled, because the last "
              "scale_loss used delay_unscale(true). Run the last micro-batch's scale_loss without delay_unscale "
              "before step().");
  detail::check_no_scaled_grads(model_side_, [this](size_t i) { return model_side_name(i); }, "step");
  if (skip_next_step_) {
    if (properties_.verbosity >= 1) {
      std::cout << "Gradient overflow.  Skipping step, loss scaler " << skip_loss_id_ << " reducing loss scale to "
              << detail::format_float(loss_scaler(skip_loss_id_).loss_scale());
    if (last_overflow_ && !last_overflow_->parameters.empty()) std::cout << " (non-finite gradients: " << describe_parameters(last_overflow_->parameters) << ")";
    std::cout << std::endl;
    }
    // The overflowed gradients are dropped, so a skipped step leaves no trace in the next one.
    zero_all_grads(/*set_to_none=*/true);
    ++skipped_steps_;
    return false;
  }
  masters_->refresh_changed();  // the step starts from the weights the model holds now
  for (size_t i = 0; i < direct_params_.size(); ++i) {
    if (detail::holds_float32_bytes(direct_params_[i])) detail::fail_float32_bytes("parameter", direct_names_[i], direct_params_[i]);
  }
  return true;
}

void OptimizerBase::end_step() {
  if (step_writes_model_) {
    masters_->mark_all_synced();
  } else {
    masters_->copy_to_model();
  }
}

void OptimizerBase::zero_all_grads(bool set_to_none) {
  if (properties_.enabled) sync_param_groups();
  for (auto& p : masters_->model()) clear_grad(p, set_to_none);
  for (auto& p : masters_->master()) clear_grad(p, set_to_none);
  for (auto& p : direct_params_) clear_grad(p, set_to_none);
  stash_.clear();
  backward_prepared_ = false;
  scaled_grads_loss_id_.reset();
  skip_next_step_ = false;
}

void OptimizerBase::prepare_backward(int loss_id) {
  check_loss_id(loss_id);
  TORCH_CHECK(!backward_prepared_, "amp::scale_loss: another amp::scale_loss handle of this optimizer is still "
              "open and its backward() has not run. Finish one scaled loss (backward(), then let the handle go "
              "out of scope) before scaling the next; for several losses, call scale_loss once per loss, one "
              "after the other.");
  sync_param_groups();
  detail::check_no_scaled_grads(model_side_, [this](size_t i) { return model_side_name(i); }, "backward");
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
  stash_.assign(direct_params_.size(), at::Tensor());
  for (size_t i = 0; i < direct_params_.size(); ++i) stash_[i] = std::exchange(direct_params_[i].mutable_grad(), {});
  for (const auto& p : masters_->model()) p.mutable_grad() = at::Tensor();  // consumed into the masters already
  backward_prepared_ = true;
}

void OptimizerBase::unscale_grads(int loss_id, bool delay_unscale, double inv_scale, detail::FoundInf& found_inf) {
  TORCH_INTERNAL_ASSERT(backward_prepared_);
  backward_prepared_ = false;
  if (delay_unscale) {
    scaled_grads_loss_id_ = loss_id;
    return;
  }
  std::vector<at::Tensor> new_grads;
  for (auto& p : direct_params_) {
    if (p.grad().defined()) new_grads.push_back(p.grad());
  }
  detail::unscale_(new_grads, inv_scale, found_inf);

  std::vector<at::Tensor> fresh_in, fresh_out, acc_in, acc_out;
  const auto& model = masters_->model();
  const auto& master = masters_->master();
  for (size_t i = 0; i < model.size(); ++i) {
    const at::Tensor& g = model[i].grad();
    if (!g.defined()) continue;
    at::Tensor& master_grad = master[i].mutable_grad();
    if (master_grad.defined()) {
      acc_in.push_back(g);
      acc_out.push_back(master_grad);
    } else {
      master_grad = at::empty_like(master[i]);
      fresh_in.push_back(g);
      fresh_out.push_back(master_grad);
    }
  }
  detail::unscale_into(fresh_in, fresh_out, /*accumulate=*/false, inv_scale, found_inf);
  detail::unscale_into(acc_in, acc_out, /*accumulate=*/true, inv_scale, found_inf);
  for (const auto& p : model) p.mutable_grad() = at::Tensor();

  for (size_t i = 0; i < stash_.size(); ++i) {
    if (!stash_[i].defined()) continue;
    at::Tensor& grad = direct_params_[i].mutable_grad();
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
    if (!grad.defined() || at::isfinite(grad).all().item<bool>()) return;
    const auto it = model_order.find(model_param.unsafeGetTensorImpl());
    bad.emplace_back(it == model_order.end() ? model_order.size() : it->second, name);
  };
  for (size_t i = 0; i < masters_->size(); ++i) check(masters_->model()[i], masters_->master()[i].grad(), masters_->name(i));
  for (size_t i = 0; i < direct_params_.size(); ++i) check(direct_params_[i], direct_params_[i].grad(), direct_names_[i]);
  std::sort(bad.begin(), bad.end());
  OverflowReport report;
  report.loss_id = loss_id;
  report.loss_scale = loss_scale;
  for (auto& [order, name] : bad) report.parameters.push_back(std::move(name));
  last_overflow_ = std::move(report);
}

void OptimizerBase::finish_backward(int loss_id, bool skip) {
  if (skip && !skip_next_step_) {
    skip_next_step_ = true;
    skip_loss_id_ = loss_id;
  }
}

void OptimizerBase::abort_backward() noexcept {
  if (!backward_prepared_) return;
  backward_prepared_ = false;
  if (scaled_grads_loss_id_) return;  // nothing was moved aside
  for (size_t i = 0; i < stash_.size(); ++i) direct_params_[i].mutable_grad() = stash_[i];
  stash_.clear();
}

void OptimizerBase::save_amp_state(torch::serialize::OutputArchive& archive) const {
  if (properties_.enabled) {
    // Saving is logically const, but the index and the masters must first catch up with the model:
    // a checkpoint taken after loading weights must hold those weights.
    auto& self = const_cast<OptimizerBase&>(*this);
    self.sync_param_groups();
    self.masters_->refresh_changed();
  }
  torch::serialize::OutputArchive amp_archive(archive.compilation_unit());
  amp_archive.write("opt_level", c10::IValue(static_cast<int64_t>(properties_.opt_level)));
  amp_archive.write("master_weights", c10::IValue(static_cast<int64_t>(masters_->size())));
  const std::vector<LossScaler>& scalers = *scalers_;
  amp_archive.write("num_losses", c10::IValue(static_cast<int64_t>(scalers.size())));
  amp_archive.write("skipped_steps", c10::IValue(skipped_steps_));
  for (size_t i = 0; i < scalers.size(); ++i) {
    const std::string prefix = "loss_scaler" + std::to_string(i) + "/";
    amp_archive.write(prefix + "loss_scale", c10::IValue(scalers[i].loss_scale()));
    amp_archive.write(prefix + "unskipped", c10::IValue(scalers[i].unskipped()));
    amp_archive.write(prefix + "hysteresis_left", c10::IValue(static_cast<int64_t>(scalers[i].hysteresis_left())));
  }
  for (const auto& [key, value] : scaler_settings(properties_, scalers.front())) amp_archive.write(key, c10::IValue(value));
  for (size_t i = 0; i < masters_->size(); ++i) amp_archive.write("master/" + std::to_string(i), masters_->master()[i]);
  archive.write("amp", amp_archive);
}

void OptimizerBase::load_amp_state(torch::serialize::InputArchive& archive) {
  torch::serialize::InputArchive amp_archive;
  TORCH_CHECK(archive.try_read("amp", amp_archive), "amp::Optimizer::load: the checkpoint has no amp state: it was "
              "saved from a plain torch::optim optimizer, not an amp::Optimizer. Save the optimizer returned by "
              "amp::initialize.");
  auto read_int = [&](const std::string& key) {
    c10::IValue v;
    TORCH_CHECK(amp_archive.try_read(key, v) && v.isInt(), "amp::Optimizer::load: the checkpoint's amp state has "
                "no integer '", key, "'; it is corrupt or from another program.");
    return v.toInt();
  };
  const auto level = static_cast<OptLevel>(read_int("opt_level"));
  TORCH_CHECK(level == properties_.opt_level, "amp::Optimizer::load: the checkpoint was saved at opt_level ",
              to_string(level), ", this optimizer runs at ", to_string(properties_.opt_level),
              ". Resume at the level the checkpoint was saved with.");
  const auto num_losses = read_int("num_losses");
  TORCH_CHECK(num_losses == static_cast<int64_t>(scalers_->size()), "amp::Optimizer::load: the checkpoint has ",
              num_losses, " loss scalers, this optimizer has ", scalers_->size(), " (num_losses). Resume with "
              "num_losses=", num_losses, ".");
  if (properties_.enabled) sync_param_groups();
  const auto num_masters = read_int("master_weights");
  TORCH_CHECK(num_masters == static_cast<int64_t>(masters_->size()), "amp::Optimizer::load: the checkpoint has ",
              num_masters, " fp32 master weights, this optimizer has ", masters_->size(),
              ". Resume with the same model, opt level, master_weights setting and param groups.");
  for (const auto& [key, value] : scaler_settings(properties_, scalers_->front())) {
    c10::IValue saved;
    if (!amp_archive.try_read(key, saved)) continue;  // checkpoints from before these settings: Apex's values
    TORCH_CHECK(saved.isDouble() && saved.toDouble() == value, "amp::Optimizer::load: the checkpoint was saved with ",
                key, " = ", saved.isDouble() ? detail::format_float(saved.toDouble()) : saved.tagKind(),
                ", this optimizer has ", key, " = ", detail::format_float(value), ". Resume with the loss-scaler "
                "settings the checkpoint was saved with (amp::Options / config key ", key, ").");
  }
  struct ScalerState {
    double scale;
    int64_t unskipped;
    std::optional<int64_t> hysteresis_left;
  };
  std::vector<ScalerState> scaler_states;
  for (size_t i = 0; i < scalers_->size(); ++i) {
    const std::string prefix = "loss_scaler" + std::to_string(i) + "/";
    c10::IValue scale;
    TORCH_CHECK(amp_archive.try_read(prefix + "loss_scale", scale) && scale.isDouble(),
                "amp::Optimizer::load: the checkpoint's amp state has no '", prefix, "loss_scale'.");
    c10::IValue left;
    const bool has_left = amp_archive.try_read(prefix + "hysteresis_left", left) && left.isInt();
    scaler_states.push_back({scale.toDouble(), read_int(prefix + "unskipped"),
                             has_left ? std::optional<int64_t>(left.toInt()) : std::nullopt});
  }
  std::vector<at::Tensor> masters(masters_->size());
  for (size_t i = 0; i < masters_->size(); ++i) {
    amp_archive.read("master/" + std::to_string(i), masters[i]);
    TORCH_CHECK(masters[i].sizes() == masters_->master()[i].sizes(), "amp::Optimizer::load: master weight ", i, " ('",
                masters_->name(i), "') has shape ", masters[i].sizes(), " in the checkpoint, ",
                masters_->master()[i].sizes(), " here.");
  }
  const int64_t skipped_steps = read_int("skipped_steps");
  std::vector<LossScaler> scalers = *scalers_;
  for (size_t i = 0; i < scalers.size(); ++i) {
    scalers[i].load(scaler_states[i].scale, scaler_states[i].unskipped, scaler_states[i].hysteresis_left);
  }
  // Everything validated: now change state.
  *scalers_ = std::move(scalers);  // optimizers sharing the bank see the restored scales
  skipped_steps_ = skipped_steps;
  {
    c10::NoGradGuard no_grad;
    for (size_t i = 0; i < masters_->size(); ++i) masters_->master()[i].copy_(masters[i]);
  }
  masters_->copy_to_model();  // the model's low-precision params follow the restored masters
  zero_all_grads(/*set_to_none=*/true);
}

}  // namespace amp
