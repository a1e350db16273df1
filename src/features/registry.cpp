// The training features every amp::Optimizer gets (NOTE [Training features] in src/optim/feature.h), in the order
// their hooks run: auto_fp32 before the lean masters and FP8, because repeating its decisions on a load changes
// which parameters the others hold state for. A new feature is a file in this folder and a line here.

#include <algorithm>
#include <mutex>

#include "features/auto_fp32.h"
#include "features/fp8.h"
#include "features/islands.h"
#include "features/lean_masters.h"
#include "features/optimizer_state.h"
#include "optim/optimizer_access.h"

namespace amp::detail {
namespace {

Features make_features(OptimizerBase& optimizer) {
  const Properties& p = optimizer.properties();
  return {
      std::make_shared<IslandsFeature>(),
      std::make_shared<AutoFp32>(p.auto_fp32),
      std::make_shared<LeanMastersFeature>(OptimizerAccess::index_pointer(optimizer)),
      std::make_shared<OptimizerStateFeature>(OptimizerAccess::index_pointer(optimizer)),
      std::make_shared<Fp8Feature>(),
  };
}

// Which features ride on which model, for amp::parallel (which wraps a model, not an optimizer).
struct FeatureEntry {
  std::weak_ptr<torch::nn::Module> model;
  std::weak_ptr<Feature> feature;
};
std::mutex feature_registry_mutex;
std::vector<FeatureEntry> feature_registry;

}  // namespace

void attach_features(OptimizerBase& optimizer, const std::vector<torch::nn::Module*>& modules) {
  const Features features = make_features(optimizer);
  std::lock_guard<std::mutex> lock(feature_registry_mutex);
  feature_registry.erase(std::remove_if(feature_registry.begin(), feature_registry.end(),
                                [](const FeatureEntry& e) { return e.model.expired() || e.feature.expired(); }),
                 feature_registry.end());
  for (const auto& feature : features) {
    OptimizerAccess::add_feature(optimizer, feature);
    for (torch::nn::Module* m : modules) feature_registry.push_back({m->shared_from_this(), feature});
  }
}

Features features_of(const torch::nn::Module& model) {
  Features out;
  std::lock_guard<std::mutex> lock(feature_registry_mutex);
  for (const auto& e : feature_registry) {
    const auto m = e.model.lock();
    auto f = e.feature.lock();
    if (m.get() == &model && f) out.push_back(std::move(f));
  }
  return out;
}

}  // namespace amp::detail
