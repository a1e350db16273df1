#pragma once
// Whole parameters for reading under ZeRO stage 3 (DeepSpeed's zero.GatheredParameters, FSDP's summon_full_params).

#include <memory>
#include <utility>

#include "amp/parallel/distributed_data_parallel.h"

namespace amp::parallel {

/// Collective (every rank constructs it at the same point): while it lives, every parameter of the model a stage-3
/// sharded optimizer trains is whole on every rank, for evaluation outside the wrapper, an EMA, logging,
/// torch::save(model) or amp::load_weights. Values written meanwhile (on every rank alike) reach the shards when it
/// dies; then the parameters are freed again. At stages 0-2 the parameters are always whole and it does nothing.
///
///   { amp::parallel::GatheredParametersGuard whole(ddp); torch::save(net, "model.pt"); }
class [[nodiscard]] GatheredParametersGuard {
 public:
  template <class Module>
  explicit GatheredParametersGuard(DistributedDataParallel<Module>& ddp) : GatheredParametersGuard(ddp.core()) {}
  explicit GatheredParametersGuard(const std::shared_ptr<detail::DistributedCore>& core)
      : gathered_(core ? core->gather_parameters() : nullptr) {}
  GatheredParametersGuard(const GatheredParametersGuard&) = delete;
  GatheredParametersGuard& operator=(const GatheredParametersGuard&) = delete;
  GatheredParametersGuard(GatheredParametersGuard&&) = delete;
  GatheredParametersGuard& operator=(GatheredParametersGuard&&) = delete;

 private:
  std::shared_ptr<void> gathered_;
};

}  // namespace amp::parallel
