#include "optim/optimizer_kinds.h"

#include <c10/util/Type.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <typeinfo>

#include "amp/fused_optimizers.h"

namespace amp::detail {
namespace {

template <class Opt>
bool is_a(const torch::optim::Optimizer& o) {
  return dynamic_cast<const Opt*>(&o) != nullptr;
}

template <class State>
std::unique_ptr<torch::optim::OptimizerParamState> fresh_state() {
  return std::make_unique<State>();
}

// The fields of each state type, in the order state formats and Python's state_dict read them.
template <class State>
StateFields fields_of(torch::optim::OptimizerParamState& base, bool& ok);

template <>
StateFields fields_of<torch::optim::SGDParamState>(torch::optim::OptimizerParamState& base, bool& ok) {
  auto* s = dynamic_cast<torch::optim::SGDParamState*>(&base);
  if (!(ok = s != nullptr)) return {};
  return {{&s->momentum_buffer()}};
}

template <class AdamState>
StateFields adam_fields(torch::optim::OptimizerParamState& base, bool& ok) {
  auto* s = dynamic_cast<AdamState*>(&base);
  if (!(ok = s != nullptr)) return {};
  return {{&s->exp_avg(), &s->exp_avg_sq(), &s->max_exp_avg_sq()}, &s->step()};
}
template <>
StateFields fields_of<torch::optim::AdamParamState>(torch::optim::OptimizerParamState& base, bool& ok) {
  return adam_fields<torch::optim::AdamParamState>(base, ok);
}
template <>
StateFields fields_of<torch::optim::AdamWParamState>(torch::optim::OptimizerParamState& base, bool& ok) {
  return adam_fields<torch::optim::AdamWParamState>(base, ok);
}

template <>
StateFields fields_of<torch::optim::RMSpropParamState>(torch::optim::OptimizerParamState& base, bool& ok) {
  auto* s = dynamic_cast<torch::optim::RMSpropParamState*>(&base);
  if (!(ok = s != nullptr)) return {};
  return {{&s->square_avg(), &s->momentum_buffer(), &s->grad_avg()}, &s->step()};
}

template <>
StateFields fields_of<torch::optim::AdagradParamState>(torch::optim::OptimizerParamState& base, bool& ok) {
  auto* s = dynamic_cast<torch::optim::AdagradParamState*>(&base);
  if (!(ok = s != nullptr)) return {};
  return {{&s->sum()}, &s->step()};
}

template <>
StateFields fields_of<optim::FusedLAMBParamState>(torch::optim::OptimizerParamState& base, bool& ok) {
  auto* s = dynamic_cast<optim::FusedLAMBParamState*>(&base);
  if (!(ok = s != nullptr)) return {};
  return {{&s->exp_avg(), &s->exp_avg_sq()}};
}

template <>
StateFields fields_of<optim::FusedMuonParamState>(torch::optim::OptimizerParamState& base, bool& ok) {
  auto* s = dynamic_cast<optim::FusedMuonParamState*>(&base);
  if (!(ok = s != nullptr)) return {};
  return {{&s->momentum_buffer()}};
}

template <class Opt, class State>
OptimizerKind row(const char* name) {
  return {name, is_a<Opt>, fields_of<State>, fresh_state<State>};
}

const std::vector<OptimizerKind>& kinds() {
  static const std::vector<OptimizerKind> table = [] {
    std::vector<OptimizerKind> t;
    // The fused ones first: each derives from its LibTorch base (FusedAdam from Adam, ...).
    t.push_back(row<optim::FusedSGD, torch::optim::SGDParamState>("amp::optim::FusedSGD"));
    t.back().fused = true;
    t.push_back(row<optim::FusedAdam, torch::optim::AdamParamState>("amp::optim::FusedAdam"));
    t.back().fused = t.back().stores_formats = true;
    t.push_back(row<optim::FusedAdamW, torch::optim::AdamWParamState>("amp::optim::FusedAdamW"));
    t.back().fused = t.back().stores_formats = true;
    t.push_back(row<optim::FusedLAMB, optim::FusedLAMBParamState>("amp::optim::FusedLAMB"));
    t.back().fused = t.back().stores_formats = t.back().skips_without_fused_kernels = true;
    t.push_back(row<optim::FusedMuon, optim::FusedMuonParamState>("amp::optim::FusedMuon"));
    t.back().fused = t.back().stores_formats = t.back().skips_without_fused_kernels = true;
    t.back().shards_whole_tensors = true;
    t.push_back(row<torch::optim::SGD, torch::optim::SGDParamState>("torch::optim::SGD"));
    t.push_back(row<torch::optim::Adam, torch::optim::AdamParamState>("torch::optim::Adam"));
    t.push_back(row<torch::optim::AdamW, torch::optim::AdamWParamState>("torch::optim::AdamW"));
    t.push_back(row<torch::optim::RMSprop, torch::optim::RMSpropParamState>("torch::optim::RMSprop"));
    t.back().unshardable = "keeps a state ZeRO does not slice";
    t.push_back(row<torch::optim::Adagrad, torch::optim::AdagradParamState>("torch::optim::Adagrad"));
    t.back().state_at_construction = true;
    t.back().unshardable = "keeps a state ZeRO does not slice";
    return t;
  }();
  return table;
}

}  // namespace

const OptimizerKind* kind_of(const torch::optim::Optimizer& optimizer) {
  for (const auto& k : kinds()) {
    if (k.is(optimizer)) return &k;
  }
  return nullptr;
}

StateFields state_fields(torch::optim::OptimizerParamState& state) {
  for (const auto& k : kinds()) {
    bool ok = false;
    StateFields f = k.fields(state, ok);
    if (ok) return f;
  }
  return {};
}

std::unique_ptr<torch::optim::OptimizerParamState> new_state_for(const torch::optim::Optimizer& optimizer) {
  const OptimizerKind* k = kind_of(optimizer);
  return k ? k->fresh() : nullptr;
}

void cast_state_to_float(torch::optim::OptimizerParamState& state, const std::string& param) {
  const StateFields f = state_fields(state);
  TORCH_CHECK(!f.tensors.empty(), "amp::Optimizer: auto_fp32 moves parameter '", param, "' to fp32, but its optimizer "
              "state is a ", c10::demangle(typeid(state).name()), ", which amp cannot cast with it. Use one of "
              "torch::optim's SGD, Adam, AdamW, RMSprop, Adagrad or amp::optim's fused optimizers, master weights (O2), "
              "or keep the module in fp32 from the start (keep_fp32).");
  for (at::Tensor* t : f.tensors) {
    if (t->defined() && t->is_floating_point()) *t = t->to(at::kFloat);
  }
}

std::string fused_kinds_with(bool OptimizerKind::*flag) {
  std::vector<std::string> names;
  for (const auto& k : kinds()) {
    if (k.fused && k.*flag) names.push_back(std::string(k.name).substr(std::string("amp::optim::").size()));
  }
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) out += (i == 0 ? "" : i + 1 == names.size() ? " or " : ", ") + names[i];
  return out;
}

}  // namespace amp::detail
