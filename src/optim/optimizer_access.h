#pragma once
// The one way into an amp::OptimizerBase's internals, for amp's own code: the checkpoint formats, the gradient
// tools and the training features. Training scripts use the public API of amp/optimizer.h.

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "amp/loss_scaler.h"
#include "amp/optimizer.h"
#include "optim/step_ledger.h"
#include "scaling/scaler_access.h"

namespace amp::detail {

class DeviceScale;
class Feature;
class ParamIndex;
class Sharding;

struct OptimizerAccess {
  /// Adopts param groups added since initialize, as scale_loss and step do, and returns the torch optimizer.
  static torch::optim::Optimizer& synced_torch_optimizer(OptimizerBase& o);
  /// Adopts param groups added since initialize.
  static void sync_param_groups(OptimizerBase& o) { o.sync_param_groups(); }
  static ParamIndex& index(const OptimizerBase& o) { return *o.index_; }
  /// The optimizer's host-sync count (NOTE [Counting host syncs]), counted while a HostSyncScope holds it.
  static int64_t& host_syncs(const OptimizerBase& o) { return o.ledger_->host_syncs; }
  static const std::shared_ptr<ParamIndex>& index_pointer(const OptimizerBase& o) { return o.index_; }
  /// Names of the tensors param_groups hold, by TensorImpl (fp32 masters carry their model parameter's name).
  static std::unordered_map<const c10::TensorImpl*, std::string> param_group_names(const OptimizerBase& o);
  /// The models the optimizer trains (those still alive), in initialize's order.
  static std::vector<std::shared_ptr<torch::nn::Module>> models(const OptimizerBase& o) { return o.models(); }
  /// Every loss scaler, by loss_id (shared by the optimizers initialized together).
  static const std::vector<LossScaler>& loss_scalers(const OptimizerBase& o) {
    o.settle(/*wait=*/true);
    o.settle_scalers(/*wait=*/true);
    return *o.scalers_;
  }
  /// Replaces every loss scaler (a checkpoint's state, growth schedule included) for all optimizers sharing them.
  static void restore_loss_scalers(OptimizerBase& o, std::vector<LossScaler> scalers);
  /// The defined gradients the next step() will use (the fp32 masters' at O2), after checking that none is still
  /// multiplied by a loss scale; `caller` names the call in the error.
  static std::vector<at::Tensor> grads_for_step(OptimizerBase& o, const char* caller) { return o.grads_for_step(caller); }
  static const std::vector<std::shared_ptr<Feature>>& features(const OptimizerBase& o) { return o.features_; }
  static void add_feature(OptimizerBase& o, std::shared_ptr<Feature> feature) { o.features_.push_back(std::move(feature)); }
  /// The optimizer's ZeRO sharding (NOTE [Sharded optimizers] in src/optim/sharding.h), or null.
  static Sharding* sharding(const OptimizerBase& o) { return o.sharding_.get(); }
  static void set_sharding(OptimizerBase& o, std::shared_ptr<Sharding> sharding) { o.sharding_ = std::move(sharding); }
  /// How many times step() ran (taken or skipped).
  static int64_t steps(const OptimizerBase& o) { return o.ledger_->steps; }
  static torch::optim::Optimizer& torch_optimizer(OptimizerBase& o) { return o.torch_optimizer(); }
  static bool unscaled_fast_path(const OptimizerBase& o) { return o.unscaled_fast_path_; }

  // amp::GraphCaptureGuard (src/optim/graph_capture.cpp).
  /// Whether a GraphCaptureGuard holds the optimizer now.
  static bool graph_mode(const OptimizerBase& o) { return o.ledger_->graph_mode; }
  /// Whether the optimizer's fused step takes the overflow flag on the device (no fp8, auto_fp32 or ZeRO).
  static bool skips_on_device(const OptimizerBase& o) { return o.skips_on_device(); }
  /// Settles everything the host has not seen yet, then returns the device's loss scale (null before the first
  /// scale_loss created it).
  static const DeviceScale* settled_device_scale(const OptimizerBase& o) {
    o.settle(/*wait=*/true);
    const DeviceScale* scale = nullptr;
    for (const LossScaler& s : *o.scalers_) {
      if (const DeviceScale* d = ScalerAccess::device(s)) scale = d;
    }
    return scale;
  }
  /// Enters graph mode: from now on the device holds the truth (skips counted in a device tensor on `device`).
  static void enter_graph_mode(OptimizerBase& o, const c10::Device& device) {
    if (!o.ledger_->device_skips.defined()) o.ledger_->device_skips = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device));
    o.ledger_->graph_mode = true;
    o.ledger_->device_truth = true;
  }
  static void leave_graph_mode(OptimizerBase& o) { o.ledger_->graph_mode = false; }
};

}  // namespace amp::detail
