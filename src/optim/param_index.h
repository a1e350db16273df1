#pragma once
// An amp::Optimizer's parameter index: which tensors its param_groups hold and what each stands for. At O2 a
// model parameter cast to low precision is stepped through its fp32 master (MasterWeights) or, with a lean
// master_weights_format, in place with its low bits (LeanMasters); every other parameter is stepped directly.
// Groups added after initialize are adopted at the next sync (NOTE [Masters follow the model] in master_weights.h).

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "amp/properties.h"

namespace amp::detail {

class LeanMasters;
class MasterWeights;
class StateFormat;

class ParamIndex {
 public:
  ParamIndex();

  /// Brings the index in line with `opt`'s param_groups: checks every parameter against `models`, makes masters
  /// (or lean masters) for the new ones the level casts and casts them (`at_initialize`: the model is not cast yet,
  /// initialize casts it). Changes nothing when a check fails.
  void sync(torch::optim::Optimizer& opt, const std::vector<std::weak_ptr<torch::nn::Module>>& models,
            const Properties& properties, bool at_initialize);
  /// Whether param_groups differ from what the last sync saw.
  bool changed(const torch::optim::Optimizer& opt) const;
  /// Makes the next sync rebuild the index though param_groups are unchanged (a parameter changed dtype).
  void invalidate() { known_groups_.clear(); }

  MasterWeights& masters() const { return *masters_; }
  /// The lean masters (master_weights_format other than copy), or null.
  const std::shared_ptr<LeanMasters>& lean() const noexcept { return lean_; }
  /// How a fused optimizer stores Adam's moments (Options::optimizer_state_format); null before the first sync.
  const std::shared_ptr<StateFormat>& state_format() const noexcept { return state_format_; }
  /// Parameters the optimizer updates in place (lean ones included), and their names.
  const std::vector<at::Tensor>& direct() const noexcept { return direct_; }
  const std::vector<std::string>& direct_names() const noexcept { return direct_names_; }
  /// A fused optimizer's step writes the masters' rounded copies into the model itself.
  bool step_writes_model() const noexcept { return step_writes_model_; }

  /// The model's tensors the optimizer trains (masters' model parameters, then direct ones), for checks.
  const std::vector<at::Tensor>& model_side() const noexcept { return model_side_; }
  std::string model_side_name(size_t i) const;
  bool owns(const c10::TensorImpl* t) const { return model_side_set_.count(t) > 0; }
  /// Names of the tensors param_groups hold, by TensorImpl (fp32 masters carry their model parameter's name).
  std::unordered_map<const c10::TensorImpl*, std::string> names() const;

  /// Masters and lean values follow writes into the model since they last agreed.
  void refresh_changed();

 private:
  using StateMap = std::remove_reference_t<decltype(std::declval<torch::optim::Optimizer&>().state())>;
  void check_state_without_master(const torch::optim::Optimizer& opt, const StateMap& state, const at::Tensor& p,
                                  size_t group, const std::string& name, const Properties& properties, bool at_initialize) const;

  std::shared_ptr<MasterWeights> masters_;  // low-precision params and their fp32 masters
  std::shared_ptr<LeanMasters> lean_;       // bf16 params with lean masters, or null
  std::shared_ptr<StateFormat> state_format_;
  std::vector<at::Tensor> direct_;
  std::vector<std::string> direct_names_;
  std::vector<std::vector<const c10::TensorImpl*>> known_groups_;  // param_groups as last synced
  std::vector<at::Tensor> model_side_;
  std::unordered_set<const c10::TensorImpl*> model_side_set_;
  bool step_writes_model_ = false;
};

}  // namespace amp::detail
