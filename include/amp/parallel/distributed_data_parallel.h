#pragma once
// Data-parallel training on c10d (Apex's apex.parallel.DistributedDataParallel, torch's DDP).

#include <torch/nn/module.h>
#include <torch/arg.h>

#include <cstdint>
#include <functional>
#include <vector>
#include <type_traits>
#include <memory>
#include <utility>

#include "amp/model.h"
#include "amp/parallel/process_group.h"

namespace torch::jit {
struct Module;
}

namespace amp::parallel {

/// Options of make_distributed; defaults as Apex's and torch's DistributedDataParallel.
///
/// Example:
///   auto ddp = amp::parallel::make_distributed(model, group,
///       amp::parallel::DistributedDataParallelOptions().bucket_cap_mb(10).delay_allreduce(true));
struct DistributedDataParallelOptions {
  /// The size of a gradient bucket in MiB (torch's bucket_cap_mb; the first bucket is at most 1 MiB).
  TORCH_ARG(double, bucket_cap_mb) = 25.0;
  /// Reduces bf16/fp16 gradients in fp32 (Apex's allreduce_always_fp32): twice the bytes, one rounding.
  TORCH_ARG(bool, allreduce_always_fp32) = false;
  /// Reduces all gradients once, after backward, instead of bucket by bucket during it (Apex's delay_allreduce).
  /// Also lifts the overlapped mode's rule that every backward reaches every trainable parameter.
  TORCH_ARG(bool, delay_allreduce) = false;
  /// Broadcasts the buffers (BatchNorm statistics) from rank 0 before every forward (torch's default).
  TORCH_ARG(bool, broadcast_buffers) = true;
  /// Divides gradients by this factor before the all-reduce and by world_size / factor after it (Apex's
  /// gradient_predivide_factor), to keep large sums of fp16 gradients in range.
  TORCH_ARG(double, gradient_predivide_factor) = 1.0;
};

/// What a DistributedDataParallel sent, counted since make_distributed.
struct CommunicationStats {
  int64_t allreduce_calls = 0;   // gradient buckets reduced
  int64_t allreduce_bytes = 0;   // bytes of gradients put on the wire (in the dtype they travel in)
  int64_t broadcast_bytes = 0;   // bytes broadcast from rank 0 (parameters at wrap time, buffers per forward)
  int64_t synced_backwards = 0;  // backward passes whose gradients were reduced
  // ZeRO (shard_optimizer): the tensor bytes reduce-scattered (gradients, stage 2) and all-gathered (updated
  // parameters). A ring moves (N-1)/N of these per rank, and 2 (N-1)/N of allreduce_bytes.
  int64_t reduce_scatter_bytes = 0;
  int64_t allgather_bytes = 0;
  // Of reduce_scatter_bytes, those started during backward (ZeroOptions::overlap).
  int64_t overlapped_reduce_scatter_bytes = 0;
};

namespace detail {

/// The engine behind DistributedDataParallel<Module>, independent of the module type: broadcasts from
/// rank 0, a c10d::Reducer (or the delayed reduction) on the parameters' gradient accumulators, checks.
class DistributedCore {
 public:
  DistributedCore(std::shared_ptr<torch::nn::Module> module, ProcessGroup group, DistributedDataParallelOptions options);
  ~DistributedCore();
  DistributedCore(const DistributedCore&) = delete;
  DistributedCore& operator=(const DistributedCore&) = delete;

  /// Runs before each forward: buffer broadcast, checks of the last backward, bucket rebuilding.
  void before_forward();
  /// Turns the reduction of the next backward passes on or off (no_sync).
  void set_sync(bool sync);
  bool sync() const;
  CommunicationStats stats() const;
  const ProcessGroup& group() const;
  const DistributedDataParallelOptions& options() const;

  /// ZeRO stage 2: after each synchronized backward, `reduce` gets the trainable parameters (model order), which
  /// of them some rank has a gradient for (and no earlier reduction took) and whether the backward closes a no_sync()
  /// window (whose fp32 sums it reduces too); it reduces those it shards and returns which; the rest are all-reduced.
  /// One per stage-2 sharded optimizer of the model.
  using Reduction = std::function<std::vector<bool>(const std::vector<at::Tensor>& params,
                                                    const std::vector<bool>& used_anywhere, bool closes_window)>;
  void add_reduction(Reduction reduce);
  /// Called with i as params()[i]'s gradient is ready during a synchronized backward (its accumulator's post hook),
  /// where every such backward reaches every trainable parameter (the options did not ask for delay_allreduce):
  /// ZeRO stage 2 starts a bucket's reduce-scatter there. Returns false, and adds nothing, where backward passes may
  /// reach only some parameters.
  using ReadyListener = std::function<void(size_t i)>;
  bool add_ready_listener(ReadyListener listener);
  /// The trainable parameters, in model order (those reduced).
  const std::vector<at::Tensor>& params() const;
  /// Counts ZeRO's collectives in stats().
  void count_zero_bytes(int64_t reduce_scatter_bytes, int64_t allgather_bytes, bool during_backward = false);
  /// The module the engine hooks (amp::parallel::shard_optimizer resolves stage 3's units in it).
  const std::shared_ptr<torch::nn::Module>& module() const;

  /// ZeRO stage 3 (src/parallel/zero.cpp): the parameters live in every rank's shards; these make them whole.
  class ShardedParameters {
   public:
    virtual ~ShardedParameters() = default;
    /// Runs one forward: the ops of this thread gather the units they read until the returned object dies, which
    /// frees them again (backward gathers what it needs itself).
    virtual std::shared_ptr<void> forward() = 0;
    /// Collective: every parameter whole until the returned object dies; what was written to them meanwhile then
    /// reaches the shards (GatheredParametersGuard).
    virtual std::shared_ptr<void> gather_all() = 0;
  };
  /// One per stage-3 sharded optimizer of the model (two optimizers for one loss each shard their parameters).
  void set_sharded_parameters(std::weak_ptr<ShardedParameters> parameters);
  /// What forward() and GatheredParametersGuard call: null where the parameters are not sharded.
  std::shared_ptr<void> begin_forward();
  std::shared_ptr<void> gather_parameters();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace detail

/// Turns off gradient reduction while it lives (torch DDP's `with ddp.no_sync():`): backward passes
/// then accumulate each rank's own gradients, and the next backward outside the guard reduces the sum.
/// Under amp's dynamic loss scaling (O1, O2) the micro-batches inside must keep their gradients scaled:
/// pass amp::ScaleLossOptions().delay_unscale(true) to their scale_loss (the last, synchronized micro-batch
/// without it), as in Apex's gradient accumulation; otherwise the next forward throws. Not copyable or movable.
class [[nodiscard]] NoSyncGuard {
 public:
  explicit NoSyncGuard(std::shared_ptr<detail::DistributedCore> core)
      : core_(std::move(core)), previous_(core_->sync()) {
    core_->set_sync(false);
  }
  ~NoSyncGuard() { core_->set_sync(previous_); }
  NoSyncGuard(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(const NoSyncGuard&) = delete;
  NoSyncGuard(NoSyncGuard&&) = delete;
  NoSyncGuard& operator=(NoSyncGuard&&) = delete;

 private:
  std::shared_ptr<detail::DistributedCore> core_;
  bool previous_;
};

/// Data-parallel training of a model returned by amp::initialize. Construction broadcasts parameters,
/// fp32 master weights and buffers from rank 0 after checking that every rank has the same shapes.
/// ddp(args...) runs the model's forward (amp's casts included); the backward of a loss computed from it
/// averages the gradients over the ranks in their own dtype (bf16/fp16 at O2/O3), overlapped with backward
/// in buckets (c10d::Reducer) or, with delay_allreduce, once after it; either way before amp::scale_loss
/// unscales them, so every rank sees the same gradients, takes the same overflow decision and keeps the
/// same loss scale. Parameters that don't require grad at construction (frozen) are not reduced. Copies
/// share the model and the engine.
///
/// Example:
///   auto [model, optimizer] = amp::initialize(net, std::move(sgd), amp::Options("O2"));
///   auto ddp = amp::parallel::make_distributed(model, group);
///   auto loss = torch::nll_loss(ddp(batch.data), batch.target);
///   { auto scaled_loss = amp::scale_loss(loss, optimizer); scaled_loss.backward(); }
///   optimizer.step();
namespace detail {
/// The torch::nn::Module tree amp::parallel hooks: the module itself, or a TorchScript model's mirror (its tensors
/// are the TorchScript module's own).
template <class Module>
std::shared_ptr<torch::nn::Module> distributed_module(const Model<Module>& model) {
  if constexpr (std::is_same_v<Module, torch::jit::Module>) {
    return model.mirror();
  } else {
    return amp::detail::module_pointer(model.module());
  }
}
}  // namespace detail

template <class Module>
class DistributedDataParallel {
 public:
  DistributedDataParallel(Model<Module> model, ProcessGroup group, DistributedDataParallelOptions options = {})
      : model_(std::move(model)),
        core_(std::make_shared<detail::DistributedCore>(detail::distributed_module(model_), std::move(group), options)) {}

  /// Runs the model's forward (with amp's casts), after broadcasting buffers from rank 0.
  template <class... Args>
  auto forward(Args&&... args) {
    core_->before_forward();
    const std::shared_ptr<void> gathering = core_->begin_forward();  // ZeRO stage 3: ops gather what they read
    return model_(std::forward<Args>(args)...);
  }
  template <class... Args>
  auto operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  /// Returns a guard under which backward passes don't reduce gradients (gradient accumulation).
  NoSyncGuard no_sync() { return NoSyncGuard(core_); }

  /// Returns the wrapped amp model (Apex's and torch's `ddp.module`).
  Model<Module>& module() noexcept { return model_; }
  const Model<Module>& module() const noexcept { return model_; }
  /// Returns the module itself (no casts), as amp::Model does.
  auto operator->() const { return model_.operator->(); }
  auto& operator*() const { return *model_; }

  /// Sets training mode (frozen BatchNorm layers stay frozen).
  void train(bool on = true) { model_.train(on); }
  void eval() { model_.eval(); }
  bool is_training() const { return model_.is_training(); }

  /// Returns the process group the gradients are reduced over.
  const ProcessGroup& process_group() const { return core_->group(); }
  const DistributedDataParallelOptions& options() const { return core_->options(); }
  /// Returns what was communicated so far (gradient bytes per dtype show amp's bandwidth win at O2).
  CommunicationStats communication_stats() const { return core_->stats(); }
  /// The engine behind this wrapper, shared by its copies (amp::parallel::shard_optimizer attaches to it).
  const std::shared_ptr<detail::DistributedCore>& core() const noexcept { return core_; }

 private:
  Model<Module> model_;
  std::shared_ptr<detail::DistributedCore> core_;
};

/// Wraps the Model that amp::initialize returned (Apex's order: initialize, then DDP).
template <class Module>
DistributedDataParallel<Module> make_distributed(Model<Module> model, ProcessGroup group,
                                                 DistributedDataParallelOptions options = {}) {
  return DistributedDataParallel<Module>(std::move(model), std::move(group), options);
}

}  // namespace amp::parallel
