#pragma once
// Options::auto_fp32 as a training feature: a module whose overflows the loss scale can't cure moves to fp32.

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "optim/feature.h"

namespace amp::detail {

/// What auto_fp32 decided and where it stands: the modules it moved to fp32 (model index in initialize's order,
/// qualified name), the overflows at the scale's floor counted since the last move, whether the next forward is
/// diagnosed. Both checkpoint formats keep it.
struct AutoFp32State {
  std::vector<std::pair<int64_t, std::string>> moved;
  /// FP8 layers moved to bfloat16 (the first rung up), in the order decided.
  std::vector<std::pair<int64_t, std::string>> out_of_fp8;
  int64_t overflows = 0;
  bool armed = false;
};

class AutoFp32 : public Feature {
 public:
  explicit AutoFp32(int patience) : patience_(patience) {}
  const char* key() const override { return "auto_fp32"; }
  bool needs_overflow_on_host(const OptimizerBase&) const override { return patience_ > 0; }

  void after_backward(OptimizerBase& optimizer, const BackwardOutcome& outcome) override;
  void save(const OptimizerBase& optimizer, torch::serialize::OutputArchive& archive) const override;
  std::function<void()> load(OptimizerBase& optimizer, torch::serialize::InputArchive& archive,
                             const std::string& where) override;
  std::optional<c10::IValue> python_state(const OptimizerBase& optimizer) const override;
  std::function<void()> load_python_state(OptimizerBase& optimizer, const std::optional<c10::IValue>& entry,
                                          const std::string& where) override;
  void join_ranks(torch::nn::Module& model, const std::shared_ptr<RankLink>& link) override;
  void leave_ranks(torch::nn::Module& model) override;

  AutoFp32State state(const OptimizerBase& optimizer) const;
  /// Moves the modules `state` names to fp32 again, as the decisions did, and restores the count.
  void restore(OptimizerBase& optimizer, const AutoFp32State& state);

 private:
  // Moves module `name` of model `model` one rung up: out of FP8 if it holds FP8 layers still in FP8 (returns
  // true), else to fp32 where `to_fp32`.
  bool move_up(OptimizerBase& optimizer, size_t model, const std::string& name, bool to_fp32);
  void set_armed(OptimizerBase& optimizer, bool armed);

  int patience_;       // overflows at the floor before a module moves (0: off)
  int overflows_ = 0;  // overflows at the scale's floor since the last move
  bool armed_ = false;  // the next forward is diagnosed
  std::vector<std::pair<int64_t, std::string>> out_of_fp8_;
  std::weak_ptr<RankLink> link_;  // amp::parallel's ranks, which must move the same module
};

}  // namespace amp::detail
