#pragma once
// The lean master formats (master_weights_format split, kahan, stochastic_rounding, residual8) as a training feature.

#include <memory>

#include "optim/feature.h"

namespace amp::detail {

class ParamIndex;

class LeanMastersFeature : public Feature {
 public:
  /// `index`: the optimizer's (its lean table changes as param groups are adopted).
  explicit LeanMastersFeature(std::weak_ptr<ParamIndex> index) : index_(std::move(index)) {}
  const char* key() const override { return "lean"; }
  void save(const OptimizerBase& optimizer, torch::serialize::OutputArchive& archive) const override;
  std::function<void()> load(OptimizerBase& optimizer, torch::serialize::InputArchive& archive,
                             const std::string& where) override;
  void join_ranks(torch::nn::Module& model, const std::shared_ptr<RankLink>& link) override;

 private:
  std::weak_ptr<ParamIndex> index_;
};

}  // namespace amp::detail
