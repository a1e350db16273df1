#pragma once
// Options::fp8's scaling state as a training feature (NOTE [Training features]).

#include "optim/feature.h"

namespace amp::detail {

class Fp8Feature : public Feature {
 public:
  const char* key() const override { return "fp8"; }
  bool needs_overflow_on_host(const OptimizerBase& optimizer) const override;
  void describe_overflow(const OptimizerBase& optimizer, OverflowReport& report) const override;
  void after_step(OptimizerBase& optimizer, bool taken) override;
  void save(const OptimizerBase& optimizer, torch::serialize::OutputArchive& archive) const override;
  std::function<void()> load(OptimizerBase& optimizer, torch::serialize::InputArchive& archive,
                             const std::string& where) override;
  std::optional<c10::IValue> python_state(const OptimizerBase& optimizer) const override;
  std::function<void()> load_python_state(OptimizerBase& optimizer, const std::optional<c10::IValue>& entry,
                                          const std::string& where) override;
  void join_ranks(torch::nn::Module& model, const std::shared_ptr<RankLink>& link) override;
  void leave_ranks(torch::nn::Module& model) override;
};

}  // namespace amp::detail
