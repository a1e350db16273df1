#pragma once
// ZeRO (Rajbhandari et al., arXiv 1910.02054) over amp::parallel: each rank keeps 1/N of the fp32 master weights
// and of the optimizer state (stage 1), at stage 2 of the gradients too, and at stage 3 of the parameters themselves
// (DeepSpeed's zero_optimization.stage 1/2/3, torch's ZeroRedundancyOptimizer for stage 1, FSDP2's fully_shard for
// stage 3). docs/distributed.md has the byte table and the mapping.
//
//   auto [model, optimizer] = amp::initialize(net, std::move(adam), amp::Options("O2"));
//   auto ddp = amp::parallel::make_distributed(model, group);
//   amp::parallel::shard_optimizer(ddp, optimizer, amp::parallel::ZeroOptions().stage(2));
//   ... the training loop is unchanged: scale_loss, clip_grad_norm_, step, zero_grad, torch::save ...
//   amp::parallel::save_consolidated(optimizer, "optimizer.pt");   // every rank calls it; rank 0 writes

#include <torch/arg.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "amp/optimizer.h"
#include "amp/parallel/distributed_data_parallel.h"

namespace amp::parallel {

/// Options of shard_optimizer.
struct ZeroOptions {
  /// 1: fp32 masters and optimizer state sharded; 2: the master gradients too (reduce-scattered during backward);
  /// 3: the parameters too (FSDP's full shard): each unit's are all-gathered when an op of a forward first reads
  /// one, again before the backward of what read them, and freed after.
  TORCH_ARG(int, stage) = 1;
  /// The size of a reduce-scatter / all-gather bucket in MiB.
  TORCH_ARG(double, bucket_cap_mb) = 25.0;
  /// Stage 3: the modules (qualified names as named_modules gives them, '*' matching any run of characters) whose
  /// parameters are gathered and freed together; a pattern matching a module and its children makes the outermost
  /// the unit. Empty: each direct child of the model. Parameters in no unit belong to the root unit.
  TORCH_ARG(std::vector<std::string>, units) = {};
  /// Stage 3: how many units, in the order the last forward (backward) gathered them, are all-gathered ahead of the
  /// one an op needs, in the background (0: each when needed).
  TORCH_ARG(int, prefetch) = 1;
  /// Stage 2 and 3: reduce-scatter each bucket as its gradients are ready during backward, where the
  /// DistributedDataParallel reaches every parameter in every backward (made without delay_allreduce); else, and
  /// with false, after backward. The same values either way.
  TORCH_ARG(bool, overlap) = true;
};

namespace detail {
/// The engine behind shard_optimizer, independent of the module and optimizer types.
void shard(const std::shared_ptr<DistributedCore>& core, OptimizerBase& optimizer, const ZeroOptions& options);
}  // namespace detail

/// Shards `optimizer` (it trains ddp's model) across ddp's process group: each parameter group's parameters,
/// flattened in model order, are cut into N contiguous equal slices; rank r keeps the fp32 masters and the optimizer
/// state of slice r only, steps only it (amp's fused kernels, the same arithmetic), and the updated parameters are
/// all-gathered into every replica in buckets. Stage 2 reduce-scatters the gradients after each synchronized backward
/// instead of all-reducing them, so a rank holds only its slice of the master gradients. The loss scale, skipped
/// steps, clip_grad_norm_ (the global norm), zero_grad and torch::save / torch::load (this rank's shard) keep
/// working; save_consolidated writes the unsharded archive. Call it once, after make_distributed and before the
/// first step, on every rank. Throws on what it cannot shard, naming it.
template <class Module, class Opt>
void shard_optimizer(DistributedDataParallel<Module>& ddp, Optimizer<Opt>& optimizer, ZeroOptions options = {}) {
  detail::shard(ddp.core(), optimizer, options);
}

/// Collective (every rank calls it): gathers the sharded optimizer and rank 0 writes one unsharded archive, what an
/// unsharded run's torch::save(optimizer, path) would write. torch::load(optimizer, path) reads it in a single process
/// or, after shard_optimizer, at any world size (each rank keeps its slice). On an unsharded optimizer it is
/// torch::save on rank 0.
void save_consolidated(OptimizerBase& optimizer, const std::string& path);

}  // namespace amp::parallel
