#include "casting/model_casting.h"

#include "amp/batchnorm.h"
#include "casting/precision_policy.h"
#include "core/released_parameters.h"

namespace amp::detail {

std::unordered_set<const c10::TensorImpl*> tensors_to_cast(torch::nn::Module& module, const Properties& p) {
  std::unordered_set<const c10::TensorImpl*> out;
  if (!p.enabled || !p.cast_model_type) return out;
  const bool keep_bn = p.keep_batchnorm_fp32.value_or(false);
  const auto policy = precision_policy_of(module);  // fp32 islands stay fp32
  for (const auto& m : module.modules(/*include_self=*/true)) {
    if (is_batchnorm(*m)) {
      // Frozen layers hold pretrained statistics: they stay fp32 at every level unless asked otherwise.
      const bool keep = is_frozen(*m) ? !p.cast_frozen_batchnorm : keep_bn;
      if (keep) continue;
    }
    auto cast = [&](const at::Tensor& t) { return !policy || !policy->in_island(t.unsafeGetTensorImpl()); };
    for (const auto& t : m->parameters(/*recurse=*/false)) {
      if (cast(t)) out.insert(t.unsafeGetTensorImpl());
    }
    for (const auto& t : m->buffers(/*recurse=*/false)) {
      if (t.is_floating_point() && cast(t)) out.insert(t.unsafeGetTensorImpl());
    }
  }
  return out;
}

namespace {
void collect_tensors(torch::nn::Module& module, const std::string& prefix,
                     std::vector<std::pair<std::string, at::Tensor>>& out) {
  for (const auto& item : module.named_parameters(/*recurse=*/false)) {
    if (item.value().defined()) out.emplace_back(prefix + item.key(), item.value());
  }
  for (const auto& item : module.named_buffers(/*recurse=*/false)) {
    if (item.value().defined()) out.emplace_back(prefix + item.key(), item.value());
  }
  for (const auto& child : module.named_children()) collect_tensors(*child.value(), prefix + child.key() + ".", out);
}
}  // namespace

std::vector<std::pair<std::string, at::Tensor>> named_tensors(torch::nn::Module& module) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  collect_tensors(module, "", out);
  return out;
}


void check_parameters_gathered(const torch::nn::Module& module) {
  if (!stage3_shardings_exist() || gathering_forwards() > 0) return;
  for (const auto& item : module.named_parameters()) {
    TORCH_CHECK(!is_released(item.value()), "amp::Model::forward: parameter '", item.key(), "' holds no values on this "
                "rank: a ZeRO stage-3 optimizer keeps them in the ranks' shards between uses, and this forward does not "
                "gather them. Run it through the DistributedDataParallel (ddp(x); for evaluation too, on every rank), "
                "or under amp::parallel::GatheredParametersGuard.");
  }
}

}  // namespace amp::detail
