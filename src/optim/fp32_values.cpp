#include "optim/fp32_values.h"

#include <ATen/Functions.h>
#include <c10/core/GradMode.h>

#include <unordered_map>
#include <unordered_set>

#include "casting/model_casting.h"
#include "core/released_parameters.h"
#include "optim/float32_bytes.h"
#include "optim/lean_masters.h"
#include "optim/master_weights.h"

namespace amp::detail {

void write_loaded(const at::Tensor& target, const at::Tensor& value) {
  c10::NoGradGuard no_grad;
  at::Tensor t = target;
  if (holds_float32_bytes(t)) t.set_(at::empty(t.sizes(), t.options()));
  if (auto master = find_master(t)) {
    auto& [table, index] = *master;
    // A value in the model's own low precision is at best the master's rounding: kept where it is (NOTE [Masters
    // follow the model]); an fp32 value, or another dtype's, replaces the master exactly.
    const at::Tensor written = value.scalar_type() == t.scalar_type() ? value : value.to(at::kFloat);
    if (const auto shards = table->shards()) {  // ZeRO: this rank's slice of the master, the model its rounding
      shards->write_master(index, written);
      return;
    }
    const at::Tensor& m = table->master()[index];
    if (written.scalar_type() == at::kFloat) m.copy_(written);  // the fp32 value itself, not its rounded copy
    else keep_where_rounded_equal(m, written.to(m.device()));
    t.copy_(m);
    table->mark_synced(index);
  } else if (auto lean = find_lean(t)) {
    auto& [table, index] = *lean;
    if (value.scalar_type() == t.scalar_type() && !is_released(t)) {
      // The weight in its own dtype is a write to the model, as torch::load's: the aux keeps completing the elements
      // that repeat the weight it was paired with (follow_write; ZeRO's slices alias the weight and follow it at their
      // owner's next refresh, which every read of them starts with).
      t.copy_(value);
      if (!table->shards()) table->follow_write(index);
      return;
    }
    // The fp32 value in the lean form, not its rounded copy. A ZeRO stage-3 weight between uses has no memory to be
    // written in place, so a checkpoint in its own dtype is stored this way too: the value exactly, without the aux
    // (under GatheredParametersGuard it takes the branch above).
    table->store(index, value.to(t.device(), at::kFloat));
  } else {
    t.copy_(value);
  }
}

void check_loadable(const at::Tensor& target, const std::string& name, const char* where) {
  const auto master = find_master(target);
  if (master && master->first->shards()) return;  // its slice of the fp32 value takes it; the next gather brings it
  const auto lean = find_lean(target);
  const auto shards = lean ? lean->first->shards() : nullptr;
  if (shards && shards->holds_weights()) return;  // the same for the slices of a lean weight and its aux
  check_not_released(target, name, where);
}

std::vector<std::pair<std::string, at::Tensor>> fp32_state(torch::nn::Module& module) {
  auto out = named_tensors(module);
  // ZeRO stage 3: parameters stepped directly hold no values between uses; their owner makes them whole (collective,
  // as the gather of sharded masters below) and they are copied while whole.
  std::vector<std::shared_ptr<void>> whole;
  std::unordered_set<const void*> entered;
  for (const auto& [name, value] : out) {
    if (!is_released(value)) continue;
    const auto master = find_master(value);
    if (master && master->first->shards()) continue;  // its fp32 value comes from the masters' slices
    const WholeOwner owner = whole_owner_of(value);
    if (owner.scope && entered.insert(owner.owner).second) {
      if (auto made = owner.scope()) whole.push_back(std::move(made));
    }
  }
  for (auto& [name, value] : out) {
    if (!whole.empty() && !find_master(value) && !find_lean(value)) value = value.clone();
  }
  std::unordered_set<const MasterWeights*> refreshed;
  std::unordered_map<const MasterWeights*, std::vector<at::Tensor>> gathered;  // ZeRO: the masters whole, once
  std::unordered_map<const LeanMasters*, std::vector<at::Tensor>> gathered_aux;  // ZeRO: the lean aux whole, once
  for (auto& [name, value] : out) {
    if (auto master = find_master(value)) {
      auto& [table, index] = *master;
      if (const auto shards = table->shards()) {  // collective: every rank saves the model
        auto it = gathered.find(table.get());
        if (it == gathered.end()) it = gathered.emplace(table.get(), shards->gather_masters()).first;
        value = it->second[index];
        continue;
      }
      if (refreshed.insert(table.get()).second) table->refresh_changed();  // writes into the model since the last step
      value = table->master()[index];
    } else if (auto lean = find_lean(value)) {
      auto& [table, index] = *lean;
      if (const auto shards = table->shards()) {  // collective: every rank saves the model
        auto it = gathered_aux.find(table.get());
        if (it == gathered_aux.end()) it = gathered_aux.emplace(table.get(), shards->gather_aux()).first;
        value = table->value(index, it->second[index]);
        continue;
      }
      table->refresh_changed();
      value = table->value(index);  // the fp32 value the lean form keeps (master_weights_format)
    } else {
      check_not_released(value, name, "amp (writing the model's fp32 weights)");
      if (value.scalar_type() == at::kHalf || value.scalar_type() == at::kBFloat16) value = value.to(at::kFloat);
    }
  }
  return out;
}

}  // namespace amp::detail
