#include "amp/memory.h"

#include <ATen/core/Tensor.h>

#include <unordered_set>
#include <vector>

#include "optim/lean_masters.h"
#include "optim/master_weights.h"
#include "optim/optimizer_access.h"
#include "optim/param_index.h"
#include "optim/sharding.h"
#include "optim/optimizer_kinds.h"

namespace amp {

StateBytes state_bytes(const OptimizerBase& optimizer) {
  using detail::OptimizerAccess;
  StateBytes out;
  std::unordered_set<const void*> seen;  // each storage once (views, a direct parameter stepped as itself)
  auto count = [&seen](const at::Tensor& t, int64_t& into) {
    if (!t.defined() || !t.has_storage()) return;
    if (seen.insert(t.storage().unsafeGetStorageImpl()).second) into += static_cast<int64_t>(t.storage().nbytes());
  };
  const detail::ParamIndex& index = OptimizerAccess::index(optimizer);
  const detail::MasterWeights& masters = index.masters();
  for (const auto& p : index.model_side()) count(p, out.params);
  for (const auto& p : index.model_side()) count(p.grad(), out.grads);
  for (const auto& m : masters.master()) count(m, out.masters);
  if (const auto& lean = index.lean()) {
    for (size_t i = 0; i < lean->size(); ++i) count(lean->aux(i), out.masters);
  }
  for (const auto& m : masters.master()) count(m.grad(), out.master_grads);
  if (const detail::Sharding* sharding = OptimizerAccess::sharding(optimizer)) {
    std::vector<at::Tensor> held_params, held_masters, held_master_grads, held_grads;
    sharding->held(held_params, held_masters, held_master_grads, held_grads);
    for (const auto& t : held_params) count(t, out.params);
    for (const auto& t : held_masters) count(t, out.masters);
    for (const auto& t : held_master_grads) count(t, out.master_grads);
    for (const auto& t : held_grads) count(t, out.grads);
  }
  auto& opt = OptimizerAccess::torch_optimizer(const_cast<OptimizerBase&>(optimizer));
  for (auto& [key, state] : opt.state()) {
    if (!state) continue;
    for (const at::Tensor* t : detail::state_fields(*state).tensors) count(*t, out.optimizer_state);
  }
  return out;
}

}  // namespace amp
