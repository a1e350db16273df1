#include "interop/optimizer_formats.h"

#include "amp/fused_optimizers.h"
#include "optim/optimizer_kinds.h"

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <cstring>

namespace amp::detail {
namespace {

using GroupOptions = torch::optim::OptimizerOptions;

template <class T, class Base>
const T& as(const Base& base) {
  return static_cast<const T&>(base);
}
template <class T, class Base>
T& as(Base& base) {
  return static_cast<T&>(base);
}
const c10::IValue kNone;

OptimizerFormat sgd() {
  OptimizerFormat f;
  f.python_class = "SGD";
  f.marker_keys = {"dampening", "nesterov"};
  f.group_keys = {{"lr", GroupValue::kNumber}, {"momentum", GroupValue::kNumber}, {"dampening", GroupValue::kNumber},
                  {"weight_decay", GroupValue::kNumber}, {"nesterov", GroupValue::kBool}};
  f.python_only_keys = {{"maximize", false}, {"foreach", kNone}, {"differentiable", false}, {"fused", kNone}};
  f.state_fields = {{"momentum_buffer", nullptr}};
  f.kinds = {"torch::optim::SGD", "amp::optim::FusedSGD"};
  f.read_group = [](const GroupOptions& o) -> Hyperparameters {
    const auto& s = as<torch::optim::SGDOptions>(o);
    return {{"lr", s.lr()}, {"momentum", s.momentum()}, {"dampening", s.dampening()},
            {"weight_decay", s.weight_decay()}, {"nesterov", s.nesterov()}};
  };
  f.write_group = [](const Hyperparameters& h, GroupOptions& o) {
    as<torch::optim::SGDOptions>(o).lr(h.at("lr")).momentum(h.at("momentum")).dampening(h.at("dampening"))
        .weight_decay(h.at("weight_decay")).nesterov(h.at("nesterov") != 0.0);
  };
  return f;
}

// Adam and AdamW: the same keys and state, different C++ types.
template <class OptOptions>
OptimizerFormat adam(const char* name, bool decoupled, std::vector<const char*> kinds) {
  OptimizerFormat f;
  f.python_class = name;
  f.marker_keys = {"betas"};
  f.decoupled_weight_decay = decoupled ? 1 : 0;
  f.group_keys = {{"lr", GroupValue::kNumber}, {"betas", GroupValue::kPair}, {"eps", GroupValue::kNumber},
                  {"weight_decay", GroupValue::kNumber}, {"amsgrad", GroupValue::kBool}};
  f.python_only_keys = {{"maximize", false}, {"foreach", kNone}, {"capturable", false}, {"differentiable", false},
                        {"fused", kNone}, {"decoupled_weight_decay", decoupled}};
  f.has_step = true;
  f.state_fields = {{"exp_avg", ""}, {"exp_avg_sq", ""}, {"max_exp_avg_sq", "amsgrad", true}};
  f.kinds = kinds;
  f.read_group = [](const GroupOptions& o) -> Hyperparameters {
    const auto& s = as<OptOptions>(o);
    return {{"lr", s.lr()}, {"beta1", std::get<0>(s.betas())}, {"beta2", std::get<1>(s.betas())}, {"eps", s.eps()},
            {"weight_decay", s.weight_decay()}, {"amsgrad", s.amsgrad()}};
  };
  f.write_group = [](const Hyperparameters& h, GroupOptions& o) {
    as<OptOptions>(o).lr(h.at("lr")).betas({h.at("beta1"), h.at("beta2")}).eps(h.at("eps"))
        .weight_decay(h.at("weight_decay")).amsgrad(h.at("amsgrad") != 0.0);
  };
  return f;
}

OptimizerFormat rmsprop() {
  OptimizerFormat f;
  f.python_class = "RMSprop";
  f.marker_keys = {"alpha", "centered"};
  f.group_keys = {{"lr", GroupValue::kNumber}, {"momentum", GroupValue::kNumber}, {"alpha", GroupValue::kNumber},
                  {"eps", GroupValue::kNumber}, {"centered", GroupValue::kBool}, {"weight_decay", GroupValue::kNumber}};
  f.python_only_keys = {{"capturable", false}, {"foreach", kNone}, {"maximize", false}, {"differentiable", false}};
  f.has_step = true;
  f.state_fields = {{"square_avg", ""}, {"momentum_buffer", "momentum"}, {"grad_avg", "centered"}};
  f.kinds = {"torch::optim::RMSprop"};
  f.read_group = [](const GroupOptions& o) -> Hyperparameters {
    const auto& s = as<torch::optim::RMSpropOptions>(o);
    return {{"lr", s.lr()}, {"momentum", s.momentum()}, {"alpha", s.alpha()}, {"eps", s.eps()},
            {"centered", s.centered()}, {"weight_decay", s.weight_decay()}};
  };
  f.write_group = [](const Hyperparameters& h, GroupOptions& o) {
    as<torch::optim::RMSpropOptions>(o).lr(h.at("lr")).alpha(h.at("alpha")).eps(h.at("eps")).weight_decay(h.at("weight_decay"))
        .momentum(h.at("momentum")).centered(h.at("centered") != 0.0);
  };
  return f;
}

OptimizerFormat adagrad() {
  OptimizerFormat f;
  f.python_class = "Adagrad";
  f.marker_keys = {"lr_decay", "initial_accumulator_value"};
  f.group_keys = {{"lr", GroupValue::kNumber}, {"lr_decay", GroupValue::kNumber}, {"eps", GroupValue::kNumber},
                  {"weight_decay", GroupValue::kNumber}, {"initial_accumulator_value", GroupValue::kNumber}};
  f.python_only_keys = {{"foreach", kNone}, {"maximize", false}, {"differentiable", false}, {"fused", kNone}};
  f.has_step = true;
  f.state_fields = {{"sum", ""}};
  f.kinds = {"torch::optim::Adagrad"};
  f.read_group = [](const GroupOptions& o) -> Hyperparameters {
    const auto& s = as<torch::optim::AdagradOptions>(o);
    return {{"lr", s.lr()}, {"lr_decay", s.lr_decay()}, {"eps", s.eps()}, {"weight_decay", s.weight_decay()},
            {"initial_accumulator_value", s.initial_accumulator_value()}};
  };
  f.write_group = [](const Hyperparameters& h, GroupOptions& o) {
    as<torch::optim::AdagradOptions>(o).lr(h.at("lr")).lr_decay(h.at("lr_decay")).weight_decay(h.at("weight_decay"))
        .initial_accumulator_value(h.at("initial_accumulator_value")).eps(h.at("eps"));
  };
  return f;
}

// Apex's apex.optimizers.FusedLAMB (amp::optim::FusedLAMB): its group keys, the step count per group, and Adam's
// two moments. adam_w_mode and use_nvlamb are attributes of Apex's optimizer, not in its state_dict: loading keeps
// the C++ optimizer's.
OptimizerFormat fused_lamb() {
  using amp::optim::FusedLAMBOptions;
  OptimizerFormat f;
  f.python_class = "apex.optimizers.FusedLAMB";
  f.marker_keys = {"max_grad_norm", "grad_averaging", "bias_correction"};
  f.group_keys = {{"lr", GroupValue::kNumber}, {"bias_correction", GroupValue::kBool}, {"betas", GroupValue::kPair},
                  {"eps", GroupValue::kNumber}, {"weight_decay", GroupValue::kNumber},
                  {"grad_averaging", GroupValue::kBool}, {"max_grad_norm", GroupValue::kNumber},
                  {"step", GroupValue::kCount}};
  f.state_fields = {{"exp_avg", ""}, {"exp_avg_sq", ""}};
  f.kinds = {"amp::optim::FusedLAMB"};
  f.read_group = [](const GroupOptions& o) -> Hyperparameters {
    const auto& s = as<FusedLAMBOptions>(o);
    return {{"lr", s.lr()}, {"bias_correction", s.bias_correction()}, {"beta1", std::get<0>(s.betas())},
            {"beta2", std::get<1>(s.betas())}, {"eps", s.eps()}, {"weight_decay", s.weight_decay()},
            {"grad_averaging", s.grad_averaging()}, {"max_grad_norm", s.max_grad_norm()},
            {"step", static_cast<double>(s.step())}};
  };
  f.write_group = [](const Hyperparameters& h, GroupOptions& o) {
    as<FusedLAMBOptions>(o).lr(h.at("lr")).bias_correction(h.at("bias_correction") != 0.0)
        .betas({h.at("beta1"), h.at("beta2")}).eps(h.at("eps")).weight_decay(h.at("weight_decay"))
        .grad_averaging(h.at("grad_averaging") != 0.0).max_grad_norm(h.at("max_grad_norm"))
        .step(static_cast<int64_t>(h.at("step")));
  };
  return f;
}

// torch.optim.Muon (amp::optim::FusedMuon). flatten is amp's (torch refuses weights of more than 2 dimensions), not in
// Python's state_dict: loading keeps the C++ optimizer's.
OptimizerFormat muon() {
  using amp::optim::FusedMuonOptions;
  OptimizerFormat f;
  f.python_class = "Muon";
  f.marker_keys = {"ns_coefficients", "ns_steps"};
  f.group_keys = {{"lr", GroupValue::kNumber}, {"weight_decay", GroupValue::kNumber},
                  {"momentum", GroupValue::kNumber}, {"nesterov", GroupValue::kBool},
                  {"ns_coefficients", GroupValue::kTriple}, {"eps", GroupValue::kNumber},
                  {"ns_steps", GroupValue::kInt}, {"adjust_lr_fn", GroupValue::kName}};
  f.names = {"original", "match_rms_adamw"};
  f.state_fields = {{"momentum_buffer", ""}};
  f.kinds = {"amp::optim::FusedMuon"};
  f.read_group = [](const GroupOptions& o) -> Hyperparameters {
    const auto& s = as<FusedMuonOptions>(o);
    const auto& abc = s.ns_coefficients();
    return {{"lr", s.lr()}, {"weight_decay", s.weight_decay()}, {"momentum", s.momentum()}, {"nesterov", s.nesterov()},
            {"ns_coefficients0", abc.at(0)}, {"ns_coefficients1", abc.at(1)}, {"ns_coefficients2", abc.at(2)},
            {"eps", s.eps()}, {"ns_steps", static_cast<double>(s.ns_steps())},
            {"adjust_lr_fn", s.adjust_lr_fn() == "match_rms_adamw" ? 1.0 : 0.0}};
  };
  f.write_group = [](const Hyperparameters& h, GroupOptions& o) {
    as<FusedMuonOptions>(o).lr(h.at("lr")).weight_decay(h.at("weight_decay")).momentum(h.at("momentum"))
        .nesterov(h.at("nesterov") != 0.0)
        .ns_coefficients({h.at("ns_coefficients0"), h.at("ns_coefficients1"), h.at("ns_coefficients2")})
        .eps(h.at("eps")).ns_steps(static_cast<int64_t>(h.at("ns_steps")))
        .adjust_lr_fn(h.at("adjust_lr_fn") != 0.0 ? "match_rms_adamw" : "original");
  };
  return f;
}

bool has(const c10::impl::GenericDict& group, const char* key) { return group.contains(c10::IValue(std::string(key))); }

}  // namespace

const std::vector<OptimizerFormat>& optimizer_formats() {
  static const std::vector<OptimizerFormat> rows = {
      sgd(),
      adam<torch::optim::AdamOptions>("Adam", false, {"torch::optim::Adam", "amp::optim::FusedAdam"}),
      adam<torch::optim::AdamWOptions>("AdamW", true, {"torch::optim::AdamW", "amp::optim::FusedAdamW"}),
      rmsprop(),
      adagrad(),
      fused_lamb(),
      muon(),
  };
  return rows;
}

bool OptimizerFormat::accepts(const c10::impl::GenericDict& group) const {
  for (const char* key : marker_keys) {
    if (!has(group, key)) return false;
  }
  if (decoupled_weight_decay < 0 || !has(group, "decoupled_weight_decay")) return true;
  // Before torch 2.7 Adam and AdamW wrote the same keys, so a group without the flag fits either.
  const c10::IValue& flag = group.at(c10::IValue(std::string("decoupled_weight_decay")));
  const bool decoupled = flag.isBool() ? flag.toBool() : flag.isDouble() ? flag.toDouble() != 0.0
                                                                         : flag.isInt() && flag.toInt() != 0;
  return decoupled == (decoupled_weight_decay == 1);
}

bool OptimizerFormat::needs(const StateField& field, const Hyperparameters& h) const {
  if (field.needed_when == nullptr) return false;
  if (field.needed_when[0] == '\0') return true;
  const auto it = h.find(field.needed_when);
  return it != h.end() && it->second != 0.0;
}

const OptimizerFormat* format_of(const torch::optim::Optimizer& optimizer) {
  const OptimizerKind* kind = kind_of(optimizer);
  if (kind == nullptr) return nullptr;
  for (const auto& row : optimizer_formats()) {
    for (const char* name : row.kinds) {
      if (std::strcmp(name, kind->name) == 0) return &row;
    }
  }
  return nullptr;
}

StateTensors OptimizerFormat::read_state(torch::optim::OptimizerParamState& state, int64_t* step) const {
  const StateFields fields = amp::detail::state_fields(state);
  TORCH_INTERNAL_ASSERT(fields.tensors.size() == state_fields.size(), "amp: ", python_class, "'s Python state names and "
                        "its C++ state's fields differ in number");
  StateTensors out;
  for (size_t i = 0; i < state_fields.size(); ++i) out[state_fields[i].name] = *fields.tensors[i];
  *step = fields.step ? *fields.step : 0;
  return out;
}

std::unique_ptr<torch::optim::OptimizerParamState> OptimizerFormat::make_state(const torch::optim::Optimizer& optimizer,
                                                                               const StateTensors& tensors,
                                                                               int64_t step) const {
  auto state = new_state_for(optimizer);
  const StateFields fields = amp::detail::state_fields(*state);
  TORCH_INTERNAL_ASSERT(fields.tensors.size() == state_fields.size(), "amp: ", python_class, "'s Python state names and "
                        "its C++ state's fields differ in number");
  bool any = fields.step != nullptr;
  for (size_t i = 0; i < state_fields.size(); ++i) {
    *fields.tensors[i] = tensors.at(state_fields[i].name);
    any = any || fields.tensors[i]->defined();
  }
  if (fields.step) *fields.step = step;
  return any ? std::move(state) : nullptr;
}

const OptimizerFormat* python_format_of(const c10::impl::GenericDict& group) {
  const OptimizerFormat* found = nullptr;
  for (const auto& row : optimizer_formats()) {
    if (!row.accepts(group)) continue;
    if (found) return nullptr;
    found = &row;
  }
  return found;
}

std::string optimizer_format_names() {
  std::vector<const char*> names;
  for (const auto& row : optimizer_formats()) {
    if (std::strchr(row.python_class, '.') == nullptr) names.push_back(row.python_class);
  }
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) {
    out += i == 0 ? "" : i + 1 == names.size() ? " and " : ", ";
    out += names[i];
  }
  return out;
}

}  // namespace amp::detail
