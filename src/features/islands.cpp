// The fp32 islands as a training feature. At initialize, resolve_precision_policy (src/casting/precision_policy.cpp)
// decides them before the optimizer attaches, so no island gets a master; auto_fp32 adds to them during training
// and keeps its own decisions in the checkpoints (features/auto_fp32.cpp). What is left here is the ranks' check.

#include "features/islands.h"

#include <functional>

#include "amp/precision_policy.h"
#include "casting/precision_policy.h"
#include "optim/optimizer_access.h"

namespace amp::detail {

void IslandsFeature::join_ranks(torch::nn::Module& model, const std::shared_ptr<RankLink>& link) {
  std::string kept;
  if (const auto policy = precision_policy_of(model)) {
    for (const auto& k : policy->kept()) kept += (kept.empty() ? "" : ", ") + k.name + " (" + k.reason + ")";
  }
  // 52 bits of the list's hash, exact in a double's mantissa and in int64: its maximum and minimum over the ranks
  // agree only if every rank keeps the same list.
  const auto hash = static_cast<int64_t>(std::hash<std::string>{}(kept) & ((uint64_t{1} << 52) - 1));
  at::Tensor both = at::tensor({hash, -hash}, at::kLong);
  link->max_over_ranks(both);
  TORCH_CHECK(both[0].item<int64_t>() == hash && both[1].item<int64_t>() == -hash, "amp::parallel::make_distributed: "
              "rank ", link->rank(), " keeps other modules in fp32 than another rank (this rank: ",
              kept.empty() ? "none" : kept, "). Give every rank the same keep_fp32 / keep_fp32_types options; a "
              "checkpoint with auto_fp32's decisions resumes them on every rank that loads it.");
}

}  // namespace amp::detail

namespace amp {

std::vector<std::string> fp32_modules(const OptimizerBase& optimizer) {
  std::vector<std::string> out;
  for (const auto& model : detail::OptimizerAccess::models(optimizer)) {
    const auto policy = detail::precision_policy_of(*model);
    if (!policy) continue;
    for (const auto& m : policy->kept()) out.push_back(m.name + " (" + m.reason + ")");
  }
  return out;
}

}  // namespace amp
