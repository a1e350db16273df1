#pragma once
// Options::optimizer_state_format as a training feature: the format and the generator of bf16's stochastic rounding.

#include <memory>

#include "optim/feature.h"

namespace amp::detail {

class ParamIndex;

class OptimizerStateFeature : public Feature {
 public:
  /// `index`: the optimizer's (it holds the state format).
  explicit OptimizerStateFeature(std::weak_ptr<ParamIndex> index) : index_(std::move(index)) {}
  const char* key() const override { return "state_format"; }
  void save(const OptimizerBase& optimizer, torch::serialize::OutputArchive& archive) const override;
  std::function<void()> load(OptimizerBase& optimizer, torch::serialize::InputArchive& archive,
                             const std::string& where) override;
  std::optional<c10::IValue> python_state(const OptimizerBase& optimizer) const override;
  std::function<void()> load_python_state(OptimizerBase& optimizer, const std::optional<c10::IValue>& entry,
                                          const std::string& where) override;
  void join_ranks(torch::nn::Module& model, const std::shared_ptr<RankLink>& link) override;

 private:
  std::weak_ptr<ParamIndex> index_;
};

}  // namespace amp::detail
