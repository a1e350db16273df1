#include "amp/optimizer.h"

#include <ATen/Functions.h>
#include <c10/core/GradMode.h>
#include <c10/util/Half.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>

#include <iostream>
#include <sstream>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>

#include "amp/opt_level.h"
#include "format.h"
#include "model_casting.h"
#include "multi_tensor.h"

namespace amp {
namespace {

// torch::optim keys per-parameter state by TensorImpl: a void* from LibTorch 2.0, a string of the
// pointer before.
template <class Map>
typename Map::key_type state_key(const Map&, const at::Tensor& t) {
  if constexpr (std::is_same_v<typename Map::key_type, std::string>) {
    std::ostringstream key;  // what c10::guts::to_string(TensorImpl*) produced in LibTorch 1.x
    key << t.unsafeGetTensorImpl();
    return key.str();
  } else {
    return t.unsafeGetTensorImpl();
  }
}

void clear_grad(at::Tensor& t, bool set_to_none) {
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

std::vector<at::Tensor> OptimizerBase::master_params() {
  std::vector<at::Tensor> out;
  for (auto& group : torch_optimizer().param_groups()) {
    for (auto& p : group.params()) out.push_back(p);
  }
  return out;
}

void OptimizerBase::attach(const std::vector<torch::nn::Module*>& modules, const Properties& properties,
                           std::shared_ptr<std::vector<LossScaler>> scalers) {
  TORCH_INTERNAL_ASSERT(!attached_, "amp: OptimizerBase attached twice");
  properties_ = properties;
  attached_ = true;
  if (!scalers) {
    scalers = std::make_shared<std::vector<LossScaler>>(
        static_cast<size_t>(properties.num_losses),
        LossScaler(properties.loss_scale, properties.min_loss_scale, properties.max_loss_scale));
  }
  scalers_ = std::move(scalers);
  unscaled_fast_path_ = !properties.master_weights && !properties.loss_scale.is_dynamic() &&
                        properties.loss_scale.value() == 1.0;

  torch::optim::Optimizer& opt = torch_optimizer();
  size_t count = 0;
  for (auto& group : opt.param_groups()) count += group.params().size();
  TORCH_CHECK(count > 0, "amp::initialize: the optimizer holds no parameters. If it was std::move'd into an "
              "earlier amp::initialize, it is empty now: pass each optimizer through amp::initialize once, built "
              "from model->parameters().");

  std::unordered_map<const c10::TensorImpl*, std::string> model_params;
  std::unordered_set<const c10::TensorImpl*> to_cast;
  for (torch::nn::Module* module : modules) {
    for (const auto& item : module->named_parameters()) {
      model_params.emplace(item.value().unsafeGetTensorImpl(), item.key());
    }
    to_cast.merge(detail::tensors_to_cast(*module, properties));
  }
  const bool make_masters = properties.master_weights && detail::casts_model_to_low_precision(properties);

  std::unordered_set<const c10::TensorImpl*> seen;
  auto& state = opt.state();
  for (size_t g = 0; g < opt.param_groups().size(); ++g) {
    auto& params = opt.param_groups()[g].params();
    for (size_t i = 0; i < params.size(); ++i) {
      at::Tensor& p = params[i];
      const auto found = model_params.find(p.unsafeGetTensorImpl());
      TORCH_CHECK(found != model_params.end(), "amp::initialize: the optimizer's parameter ", i, " of group ", g,
                  " (shape ", p.sizes(), ") is not a parameter of the model", (modules.size() > 1 ? "s" : ""),
                  ". Build the optimizer from model->parameters() of the same model you pass to amp::initialize.");
      TORCH_CHECK(seen.insert(p.unsafeGetTensorImpl()).second, "amp::initialize: parameter '", found->second,
                  "' appears twice in the optimizer's param_groups; list each parameter once.");
      const bool cast = to_cast.count(p.unsafeGetTensorImpl()) > 0;
      if (cast && make_masters) {
        // The master copies the original fp32 value (Apex copied the fp16 one, losing bits).
        at::Tensor master = p.detach().clone().to(at::kFloat).set_requires_grad(true);
        auto old_state = state.find(state_key(state, p));
        if (old_state != state.end()) {  // fp32 state moves to the fp32 master unchanged
          auto moved = std::move(old_state->second);
          state.erase(old_state);
          state[state_key(state, master)] = std::move(moved);
        }
        model_lp_params_.push_back(p);
        masters_.push_back(master);
        p = master;
      } else {
        TORCH_CHECK(!cast || state.find(state_key(state, p)) == state.end(), "amp::initialize: the optimizer "
                    "already has state for parameter '", found->second, "', which opt_level ",
                    to_string(properties.opt_level), " casts to ", dtype_name(*properties.cast_model_type),
                    " without master weights; that fp32 state would no longer match. Call amp::initialize first, "
                    "then torch::load the optimizer (Apex's documented order).");
        // Optimizer state in float16 (no master weights): an eps that rounds to 0 there makes
        // Adam-style denominators 0 on small gradients, and the step writes NaN (pytorch #8860, apex #240).
        const auto eps = denominator_eps(opt.param_groups()[g].options());
        TORCH_CHECK(!(cast && eps && *properties.cast_model_type == c10::ScalarType::Half &&
                      static_cast<float>(c10::Half(static_cast<float>(*eps))) == 0.0f),
                    "amp::initialize: opt_level ", to_string(properties.opt_level), " keeps parameter '",
                    found->second, "' and its optimizer state in float16 without fp32 master weights, where the "
                    "optimizer's eps=", *eps, " rounds to 0: steps with small gradients would divide 0 by 0 and "
                    "write NaN into the weights. Use opt_level O2 (fp32 master weights), low_precision_dtype "
                    "bfloat16, or an eps of at least 1e-4.");
        direct_params_.push_back(p);
      }
    }
  }
}

bool OptimizerBase::begin_step() {
  if (!properties_.enabled) return true;
  TORCH_CHECK(!scaled_grads_loss_id_, "amp::Optimizer::step: the gradients are still scaled, because the last "
              "scale_loss used delay_unscale(true). Run the last micro-batch's scale_loss without delay_unscale "
              "before step().");
  if (!skip_next_step_) return true;
  if (properties_.verbosity >= 1) {
    std::cout << "Gradient overflow.  Skipping step, loss scaler " << skip_loss_id_ << " reducing loss scale to "
              << detail::format_float(loss_scaler(skip_loss_id_).loss_scale()) << std::endl;
  }
  // The overflowed gradients are dropped, so a skipped step leaves no trace in the next one.
  zero_all_grads(/*set_to_none=*/true);
  ++skipped_steps_;
  return false;
}

void OptimizerBase::end_step() {
  if (!masters_.empty()) detail::copy_(model_lp_params_, masters_);
}

void OptimizerBase::zero_all_grads(bool set_to_none) {
  for (auto& p : model_lp_params_) clear_grad(p, set_to_none);
  for (auto& p : masters_) clear_grad(p, set_to_none);
  for (auto& p : direct_params_) clear_grad(p, set_to_none);
  stash_.clear();
  backward_prepared_ = false;
  scaled_grads_loss_id_.reset();
  skip_next_step_ = false;
}

void OptimizerBase::prepare_backward(int loss_id) {
  check_loss_id(loss_id);
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
  for (auto& p : model_lp_params_) p.mutable_grad() = at::Tensor();  // consumed into the masters already
  backward_prepared_ = true;
}

bool OptimizerBase::post_backward(int loss_id, bool delay_unscale) {
  TORCH_INTERNAL_ASSERT(backward_prepared_);
  backward_prepared_ = false;
  if (delay_unscale) {
    scaled_grads_loss_id_ = loss_id;
    return false;
  }
  LossScaler& scaler = (*scalers_)[static_cast<size_t>(loss_id)];
  const double inv_scale = 1.0 / scaler.loss_scale();
  detail::FoundInf found_inf;

  std::vector<at::Tensor> new_grads;
  for (auto& p : direct_params_) {
    if (p.grad().defined()) new_grads.push_back(p.grad());
  }
  detail::unscale_(new_grads, inv_scale, found_inf);

  std::vector<at::Tensor> fresh_in, fresh_out, acc_in, acc_out;
  for (size_t i = 0; i < masters_.size(); ++i) {
    const at::Tensor& g = model_lp_params_[i].grad();
    if (!g.defined()) continue;
    at::Tensor& master_grad = masters_[i].mutable_grad();
    if (master_grad.defined()) {
      acc_in.push_back(g);
      acc_out.push_back(master_grad);
    } else {
      master_grad = at::empty_like(masters_[i]);
      fresh_in.push_back(g);
      fresh_out.push_back(master_grad);
    }
  }
  detail::unscale_into(fresh_in, fresh_out, /*accumulate=*/false, inv_scale, found_inf);
  detail::unscale_into(acc_in, acc_out, /*accumulate=*/true, inv_scale, found_inf);
  for (auto& p : model_lp_params_) p.mutable_grad() = at::Tensor();

  const bool overflow = found_inf.any();  // the backward's one host sync

  for (size_t i = 0; i < stash_.size(); ++i) {
    if (!stash_[i].defined()) continue;
    at::Tensor& grad = direct_params_[i].mutable_grad();
    if (grad.defined()) stash_[i].add_(grad);  // stashed + new * (1/scale), Apex's axpby
    grad = stash_[i];
  }
  stash_.clear();
  scaled_grads_loss_id_.reset();

  if (scaler.update_scale(overflow) && !skip_next_step_) {
    skip_next_step_ = true;
    skip_loss_id_ = loss_id;
  }
  return overflow;
}

void OptimizerBase::abort_backward() noexcept {
  if (!backward_prepared_) return;
  backward_prepared_ = false;
  if (scaled_grads_loss_id_) return;  // nothing was moved aside
  for (size_t i = 0; i < stash_.size(); ++i) direct_params_[i].mutable_grad() = stash_[i];
  stash_.clear();
}

void OptimizerBase::save_amp_state(torch::serialize::OutputArchive& archive) const {
  torch::serialize::OutputArchive amp_archive(archive.compilation_unit());
  amp_archive.write("opt_level", c10::IValue(static_cast<int64_t>(properties_.opt_level)));
  amp_archive.write("master_weights", c10::IValue(static_cast<int64_t>(masters_.size())));
  const std::vector<LossScaler>& scalers = *scalers_;
  amp_archive.write("num_losses", c10::IValue(static_cast<int64_t>(scalers.size())));
  amp_archive.write("skipped_steps", c10::IValue(skipped_steps_));
  for (size_t i = 0; i < scalers.size(); ++i) {
    const std::string prefix = "loss_scaler" + std::to_string(i) + "/";
    amp_archive.write(prefix + "loss_scale", c10::IValue(scalers[i].loss_scale()));
    amp_archive.write(prefix + "unskipped", c10::IValue(scalers[i].unskipped()));
  }
  for (size_t i = 0; i < masters_.size(); ++i) amp_archive.write("master/" + std::to_string(i), masters_[i]);
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
  const auto num_masters = read_int("master_weights");
  TORCH_CHECK(num_masters == static_cast<int64_t>(masters_.size()), "amp::Optimizer::load: the checkpoint has ",
              num_masters, " fp32 master weights, this optimizer has ", masters_.size(),
              ". Resume with the same model, opt level and master_weights setting.");
  std::vector<std::pair<double, int64_t>> scaler_states;
  for (size_t i = 0; i < scalers_->size(); ++i) {
    const std::string prefix = "loss_scaler" + std::to_string(i) + "/";
    c10::IValue scale;
    TORCH_CHECK(amp_archive.try_read(prefix + "loss_scale", scale) && scale.isDouble(),
                "amp::Optimizer::load: the checkpoint's amp state has no '", prefix, "loss_scale'.");
    scaler_states.emplace_back(scale.toDouble(), read_int(prefix + "unskipped"));
  }
  std::vector<at::Tensor> masters(masters_.size());
  for (size_t i = 0; i < masters_.size(); ++i) {
    amp_archive.read("master/" + std::to_string(i), masters[i]);
    TORCH_CHECK(masters[i].sizes() == masters_[i].sizes(), "amp::Optimizer::load: master weight ", i,
                " has shape ", masters[i].sizes(), " in the checkpoint, ", masters_[i].sizes(), " here.");
  }
  const int64_t skipped_steps = read_int("skipped_steps");
  std::vector<LossScaler> scalers = *scalers_;
  for (size_t i = 0; i < scalers.size(); ++i) scalers[i].load(scaler_states[i].first, scaler_states[i].second);
  // Everything validated: now change state.
  *scalers_ = std::move(scalers);  // optimizers sharing the bank see the restored scales
  skipped_steps_ = skipped_steps;
  {
    c10::NoGradGuard no_grad;
    for (size_t i = 0; i < masters_.size(); ++i) masters_[i].copy_(masters[i]);
  }
  end_step();  // the model's low-precision params follow the restored masters
  zero_all_grads(/*set_to_none=*/true);
}

}  // namespace amp
