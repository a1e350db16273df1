#include "optim/param_index.h"

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
#include "optim/fused_step_context.h"
#include "amp/opt_level.h"
#include "casting/model_casting.h"
#include "optim/lean_masters.h"
#include "optim/master_weights.h"
#include "optim/optimizer_state_key.h"
#include "optim/state_format.h"
#include "optim/optimizer_kinds.h"
#include "options/format.h"

namespace amp::detail {
namespace {

// Returns the eps of the optimizers that add it to a denominator, if `options` is one of theirs.
std::optional<double> denominator_eps(const torch::optim::OptimizerOptions& options) {
  if (auto* o = dynamic_cast<const torch::optim::AdamOptions*>(&options)) return o->eps();
  if (auto* o = dynamic_cast<const torch::optim::AdamWOptions*>(&options)) return o->eps();
  if (auto* o = dynamic_cast<const torch::optim::RMSpropOptions*>(&options)) return o->eps();
  if (auto* o = dynamic_cast<const torch::optim::AdagradOptions*>(&options)) return o->eps();
  return std::nullopt;
}

// A state the optimizer's constructor built (LibTorch's Adagrad), untouched (step 0), is what a lazily built one in
// the parameter's dtype would be, so it may follow the parameter's cast.
bool is_untouched_initial_state(const torch::optim::Optimizer& opt, torch::optim::OptimizerParamState& state) {
  const OptimizerKind* kind = kind_of(opt);
  const StateFields fields = state_fields(state);
  return kind != nullptr && kind->state_at_construction && fields.step != nullptr && *fields.step == 0;
}

using StateMap = std::remove_reference_t<decltype(std::declval<torch::optim::Optimizer&>().state())>;

// The state of a parameter cast without a master follows it: Adagrad's untouched sum at initialize, or (a group added
// later) the state a torch::load gave it, whose floating tensors take the parameter's dtype.
void cast_initial_state(StateMap& state, const at::Tensor& p, c10::ScalarType dtype) {
  const auto it = state.find(state_key(state, p));
  if (it == state.end() || !it->second) return;
  for (at::Tensor* t : state_fields(*it->second).tensors) {
    if (t->defined() && t->is_floating_point() && t->scalar_type() != dtype) *t = t->to(dtype);
  }
}

// Casts a parameter added to the optimizer after initialize, keeping its identity (as initialize does).
void cast_parameter(at::Tensor& p, c10::ScalarType dtype) {
  if (p.scalar_type() == dtype) return;
  c10::NoGradGuard no_grad;
  p.set_data(p.to(dtype));
  p.mutable_grad() = at::Tensor();
}

}  // namespace

ParamIndex::ParamIndex() : masters_(std::make_shared<MasterWeights>()) {}

std::unordered_map<const c10::TensorImpl*, std::string> ParamIndex::names() const {
  std::unordered_map<const c10::TensorImpl*, std::string> names;
  for (size_t i = 0; i < masters_->size(); ++i) names.emplace(masters_->master()[i].unsafeGetTensorImpl(), masters_->name(i));
  for (size_t i = 0; i < direct_.size(); ++i) names.emplace(direct_[i].unsafeGetTensorImpl(), direct_names_[i]);
  return names;
}

void ParamIndex::refresh_changed() {
  masters_->refresh_changed();
  if (lean_) lean_->refresh_changed();
}

bool ParamIndex::changed(const torch::optim::Optimizer& opt) const {
  const auto& groups = opt.param_groups();
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

void ParamIndex::sync(torch::optim::Optimizer& opt, const std::vector<std::weak_ptr<torch::nn::Module>>& models,
                      const Properties& properties, bool at_initialize) {
  if (!at_initialize && !changed(opt)) return;
  const char* where = at_initialize ? "amp::initialize" : "amp::Optimizer (a param group added after initialize)";

  std::unordered_map<const c10::TensorImpl*, std::string> model_params;
  std::unordered_set<const c10::TensorImpl*> to_cast;
  for (const auto& weak : models) {
    const auto module = weak.lock();
    TORCH_CHECK(module, where, ": a model this optimizer was initialized with no longer exists. Keep the model "
                "returned by amp::initialize alive as long as its optimizer.");
    for (const auto& item : module->named_parameters()) model_params.emplace(item.value().unsafeGetTensorImpl(), item.key());
    to_cast.merge(tensors_to_cast(*module, properties));
  }
  const bool make_masters = properties.master_weights && casts_model_to_low_precision(properties);
  const bool lean_format = make_masters && properties.master_weights_format != amp::MasterWeights::kCopy;
  auto* fused = dynamic_cast<optim::FusedOptimizer*>(&opt);
  TORCH_CHECK(!lean_format || fused, where, ": master_weights_format ", to_string(properties.master_weights_format),
              " rebuilds each bf16 parameter's fp32 value inside the optimizer's step, which only amp's fused "
              "optimizers do; this optimizer is ", c10::demangle(typeid(opt).name()), ". Use "
              "amp::optim::", fused_kinds_with(&OptimizerKind::fused), " (same options as torch::optim's), or "
              "master_weights_format copy.");
  const amp::OptimizerStateFormat state_format = properties.optimizer_state_format;
  if (state_format != amp::OptimizerStateFormat::kFp32) {
    const OptimizerKind* kind = kind_of(opt);
    const bool stores_formats = kind != nullptr && kind->stores_formats;
    const std::string formats_kinds = fused_kinds_with(&OptimizerKind::stores_formats);
    TORCH_CHECK(stores_formats || kind == nullptr || !kind->fused, where, ": optimizer_state_format ",
                to_string(state_format), " stores Adam's two moments; ", kind ? kind->name : "", " keeps one momentum "
                "buffer, which stays in the parameter's dtype. Use amp::optim::", formats_kinds, ", or "
                "optimizer_state_format fp32.");
    TORCH_CHECK(stores_formats, where, ": optimizer_state_format ", to_string(state_format), " stores Adam's moments "
                "inside amp's fused step; this optimizer is ", c10::demangle(typeid(opt).name()), ", whose step keeps "
                "them in fp32. Use amp::optim::", formats_kinds, " (same options as torch::optim's Adam and AdamW), or "
                "optimizer_state_format fp32.");
  }

  // What the optimizer already has, found through the tensors param_groups hold (masters at O2).
  std::unordered_map<const c10::TensorImpl*, size_t> known_master, known_direct;
  for (size_t i = 0; i < masters_->size(); ++i) known_master.emplace(masters_->master()[i].unsafeGetTensorImpl(), i);
  for (size_t i = 0; i < direct_.size(); ++i) known_direct.emplace(direct_[i].unsafeGetTensorImpl(), i);

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
  auto& state = opt.state();
  const c10::ScalarType lp = properties.cast_model_type.value_or(at::kFloat);
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
                  " (shape ", p.sizes(), ") is not a parameter of the model", (models.size() > 1 ? "s" : ""),
                  ". Build the optimizer and its param groups from parameters of the model you pass to "
                  "amp::initialize.");
      const bool cast = to_cast.count(p.unsafeGetTensorImpl()) > 0;
      if (cast && lean_format) {
        TORCH_CHECK(!find_lean(p), where, ": parameter '", found->second, "' is already stepped by another "
                    "amp::Optimizer with lean master weights; two optimizers would update one weight's fp32 value "
                    "twice. Put each parameter in one optimizer.");
        plans[g].push_back({Kind::kNewLean, 0, found->second, true});
      } else if (cast && make_masters) {
        TORCH_CHECK(!find_master(p), where, ": parameter '", found->second, "' is already stepped by another "
                    "amp::Optimizer with fp32 master weights; two optimizers would update two masters of one "
                    "weight. Put each parameter in one optimizer.");
        plans[g].push_back({Kind::kNewMaster, 0, found->second, true});
      } else {
        if (cast) check_state_without_master(opt, state, p, g, found->second, properties, at_initialize);
        plans[g].push_back({Kind::kNewDirect, 0, found->second, cast});
      }
    }
  }

  // Second pass: build the new index, making masters and casting where the level asks.
  auto masters = std::make_shared<MasterWeights>();
  std::shared_ptr<LeanMasters> lean;
  if (lean_format) {  // the stochastic rounding stream continues across re-indexing
    lean = lean_ ? std::make_shared<LeanMasters>(lean_->format(), lean_->seed(), lean_->counter())
                 : std::make_shared<LeanMasters>(properties.master_weights_format,
                                                         seed_from_default_generator());
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
          masters->reduced_grad(masters->size() - 1) = masters_->reduced_grad(plan.known_index);
          break;
        case Kind::kKnownDirect:
          // A lean parameter stays lean while it is bf16 (auto_fp32 may have moved it to fp32).
          if (auto found = find_lean(p); found && lean && found->first == lean_ && p.scalar_type() == at::kBFloat16) {
            lean->adopt(*lean_, found->second);
          }
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
  register_masters(masters);
  masters_ = std::move(masters);
  if (lean) {
    register_lean(lean, lean_.get());
    lean_ = std::move(lean);
  }
  direct_ = std::move(direct);
  direct_names_ = std::move(direct_names);
  known_groups_.clear();
  for (auto& group : opt.param_groups()) {
    known_groups_.emplace_back();
    for (auto& p : group.params()) known_groups_.back().push_back(p.unsafeGetTensorImpl());
  }
  // A fused optimizer writes each master's rounded copy into the model in its own pass (no copy_to_model).
  if (!state_format_) {  // once: its generator lives as long as the optimizer (seeded as kStochasticRounding's)
    const bool draws = state_format == amp::OptimizerStateFormat::kBf16;
    state_format_ = std::make_shared<StateFormat>(state_format, draws ? seed_from_default_generator() : 0);
  }
  if (fused) {
    fused->step_context().set_state_format(state_format_);
    fused->step_context().set_lean_masters(lean_);
    std::unordered_map<const c10::TensorImpl*, at::Tensor> copies;
    for (size_t i = 0; i < masters_->size(); ++i) copies.emplace(masters_->master()[i].unsafeGetTensorImpl(), masters_->model()[i]);
    fused->step_context().set_model_copies(std::move(copies));
    step_writes_model_ = true;
  }
  model_side_ = masters_->model();
  model_side_.insert(model_side_.end(), direct_.begin(), direct_.end());
  model_side_set_.clear();
  for (const auto& t : model_side_) model_side_set_.insert(t.unsafeGetTensorImpl());
}

void ParamIndex::check_state_without_master(const torch::optim::Optimizer& opt, const StateMap& state,
                                            const at::Tensor& p, size_t group, const std::string& name,
                                            const Properties& properties, bool at_initialize) const {
  const c10::ScalarType lp = properties.cast_model_type.value_or(at::kFloat);
  const auto it = state.find(state_key(state, p));
  // A group added later may hold state a torch::load after initialize gave it (a resumed script adds its groups, then
  // loads): that state was saved for the cast parameter.
  TORCH_CHECK(!at_initialize || it == state.end() || is_untouched_initial_state(opt, *it->second), "amp::initialize: the optimizer already "
              "has state for parameter '", name, "', which opt_level ", to_string(properties.opt_level), " casts to ",
              dtype_name(lp), " without master weights; that fp32 state would no longer match. Call amp::initialize "
              "first, then torch::load the optimizer (Apex's documented order).");
  // Optimizer state in float16 (no master weights): an eps that rounds to 0 there makes Adam-style
  // denominators 0 on small gradients, and the step writes NaN into the weights (pytorch #8860, apex #240).
  const auto eps = denominator_eps(opt.param_groups()[group].options());
  TORCH_CHECK(!(eps && lp == c10::ScalarType::Half && static_cast<float>(c10::Half(static_cast<float>(*eps))) == 0.0f),
              "amp::initialize: opt_level ", to_string(properties.opt_level), " keeps parameter '", name,
              "' and its optimizer state in float16 without fp32 master weights, where the optimizer's eps=", *eps,
              " rounds to 0: steps with small gradients would divide 0 by 0 and write NaN into the weights. Use "
              "opt_level O2 (fp32 master weights), low_precision_dtype bfloat16, or an eps of at least 1e-4.");
}

std::string ParamIndex::model_side_name(size_t i) const {
  return i < masters_->size() ? masters_->name(i) : direct_names_[i - masters_->size()];
}

}  // namespace amp::detail
