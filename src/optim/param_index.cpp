// amp::OptimizerBase's parameter index: which tensors param_groups hold (fp32 masters at O2, the model's own
// parameters otherwise), their names, and how groups added after initialize are adopted (NOTE [Masters follow
// the model] in master_weights.h). The step, the backward protocol and the checkpoints are optimizer.cpp.

#include <ATen/Functions.h>
#include <c10/core/GradMode.h>
#include <c10/util/Half.h>
#include <c10/util/Type.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>

#include <optional>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "amp/fused_optimizers.h"
#include "amp/opt_level.h"
#include "amp/optimizer.h"
#include "options/format.h"
#include "optim/lean_masters.h"
#include "optim/master_weights.h"
#include "casting/model_casting.h"
#include "optim/optimizer_grads.h"
#include "optim/optimizer_state_key.h"
#include "scaling/scaled_grads.h"

namespace amp {
namespace {

using detail::state_key;

// Returns the eps of the optimizers that add it to a denominator, if `options` is one of theirs.
std::optional<double> denominator_eps(const torch::optim::OptimizerOptions& options) {
  if (auto* o = dynamic_cast<const torch::optim::AdamOptions*>(&options)) return o->eps();
  if (auto* o = dynamic_cast<const torch::optim::AdamWOptions*>(&options)) return o->eps();
  if (auto* o = dynamic_cast<const torch::optim::RMSpropOptions*>(&options)) return o->eps();
  if (auto* o = dynamic_cast<const torch::optim::AdagradOptions*>(&options)) return o->eps();
  return std::nullopt;
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

std::vector<at::Tensor> OptimizerBase::grads_for_step(const char* caller) {
  if (properties_.enabled) {
    sync_param_groups();
    TORCH_CHECK(!backward_prepared_, "amp::", caller, ": an amp::scale_loss handle of this optimizer is still open "
                "and its backward() has not run, so there are no unscaled gradients yet. Call scaled_loss.backward() "
                "(or let the handle go out of scope) first.");
    TORCH_CHECK(!scaled_grads_loss_id_, "amp::", caller, ": the gradients are still multiplied by the loss scale, "
                "because the last scale_loss used delay_unscale(true). Run the last micro-batch's scale_loss without "
                "delay_unscale (it unscales every gradient), then clip.");
    detail::check_no_scaled_grads(model_side_, [this](size_t i) { return model_side_name(i); }, caller);
  }
  return detail::defined_grads(torch_optimizer());
}

void OptimizerBase::refresh_master_params() {
  if (!properties_.enabled) return;
  sync_param_groups();
  masters_->refresh_all();
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
  const bool lean_format = make_masters && properties_.master_weights_format != MasterWeights::kCopy;
  auto* fused = dynamic_cast<optim::FusedOptimizer*>(&torch_optimizer());
  TORCH_CHECK(!lean_format || fused, where, ": master_weights_format ", to_string(properties_.master_weights_format),
              " rebuilds each bf16 parameter's fp32 value inside the optimizer's step, which only amp's fused "
              "optimizers do; this optimizer is ", c10::demangle(typeid(torch_optimizer()).name()), ". Use "
              "amp::optim::FusedSGD, FusedAdam, FusedAdamW or FusedLAMB (same options as torch::optim's), or "
              "master_weights_format copy.");

  // What the optimizer already has, found through the tensors param_groups hold (masters at O2).
  std::unordered_map<const c10::TensorImpl*, size_t> known_master, known_direct;
  for (size_t i = 0; i < masters_->size(); ++i) known_master.emplace(masters_->master()[i].unsafeGetTensorImpl(), i);
  for (size_t i = 0; i < direct_params_.size(); ++i) known_direct.emplace(direct_params_[i].unsafeGetTensorImpl(), i);

  // First pass: classify and check every parameter, changing nothing.
  enum class Kind { kKnownMaster, kKnownDirect, kNewMaster, kNewLean, kNewDirect };
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
      if (cast && lean_format) {
        TORCH_CHECK(!detail::find_lean(p), where, ": parameter '", found->second, "' is already stepped by another "
                    "amp::Optimizer with lean master weights; two optimizers would update one weight's fp32 value "
                    "twice. Put each parameter in one optimizer.");
        plans[g].push_back({Kind::kNewLean, 0, found->second, true});
      } else if (cast && make_masters) {
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
  std::shared_ptr<detail::LeanMasters> lean;
  if (lean_format) {  // the stochastic rounding stream continues across re-indexing
    lean = lean_ ? std::make_shared<detail::LeanMasters>(lean_->format(), lean_->seed(), lean_->counter())
                 : std::make_shared<detail::LeanMasters>(properties_.master_weights_format,
                                                         detail::seed_from_default_generator());
  }
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
          masters->pending_grad(masters->size() - 1) = masters_->pending_grad(plan.known_index);
          masters->unreduced_grad(masters->size() - 1) = masters_->unreduced_grad(plan.known_index);
          break;
        case Kind::kKnownDirect:
          if (auto found = detail::find_lean(p); found && lean && found->first == lean_) lean->adopt(*lean_, found->second);
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
        case Kind::kNewLean:
          // At initialize, cast_model casts it (keeping its fp32 value); a group added later is cast here.
          lean->add(plan.name, p);
          if (!at_initialize) lean->cast_from_float(lean->size() - 1);
          direct.push_back(p);
          direct_names.push_back(plan.name);
          break;
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
  if (lean) {
    detail::register_lean(lean, lean_.get());
    lean_ = std::move(lean);
  }
  direct_params_ = std::move(direct);
  direct_names_ = std::move(direct_names);
  known_groups_.clear();
  for (auto& group : opt.param_groups()) {
    known_groups_.emplace_back();
    for (auto& p : group.params()) known_groups_.back().push_back(p.unsafeGetTensorImpl());
  }
  // A fused optimizer writes each master's rounded copy into the model in its own pass (no copy_to_model).
  if (fused) {
    fused->set_lean_masters(lean_);
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

}  // namespace amp
