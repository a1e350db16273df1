#pragma once
// NOTE [Sharded optimizers]
// amp::parallel::shard_optimizer (ZeRO, src/parallel/zero.cpp) gives an OptimizerBase a Sharding. From then on the
// optimizer's param_groups keep naming the full tensors (masters, direct parameters: what schedulers, checks and
// archives see), but the masters hold no values (a one-element placeholder broadcast to their shape, which refuses
// writes) and the step runs on this rank's pieces: each param group's tensors, flattened in group order, cut into
// world_size contiguous equal slices; a piece is the part of one tensor inside this rank's slice. The torch
// optimizer's own step, save and load run with param_groups holding the pieces (on_shard), so the same kernels step
// a piece as they would the whole tensor, element for element, and the state they create is the pieces' state.
// The optimizer core asks the Sharding wherever it would touch masters or gradients: refresh before a step, the
// gather after it, stage 2's unscale of the reduce-scattered slices, zero_grad, clip_grad_norm_'s norm, checkpoints.

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <functional>
#include <vector>

namespace amp {
class OptimizerBase;
}

namespace amp::detail {

class FoundInf;
class InvScale;

class Sharding {
 public:
  virtual ~Sharding() = default;
  /// What on_shard is running: a step, or an archive of this rank's shard, or (consolidated) of the whole state.
  enum class Use { kStep, kSave, kLoad };
  /// Runs `fn` (the torch optimizer's own step, save or load of a shard archive) with param_groups holding this rank's
  /// pieces (and, for a step, their gradients). During save_consolidated a save runs `fn` with the full state instead
  /// (an unsharded archive loads into the full tensors without it: load() then slices the state).
  virtual void on_shard(torch::optim::Optimizer& opt, Use use, const std::function<void()>& fn) = 0;
  /// Before the parameter index follows a change of param_groups: throws, changing nothing, unless the change is one
  /// the sharding follows (groups appended, options changed).
  virtual void check_groups(const torch::optim::Optimizer& opt) const = 0;
  /// After the index followed it: lays out the appended groups (progressive unfreezing) and shards them.
  virtual void adopt_groups(OptimizerBase& optimizer) = 0;
  /// Before a step: the pieces follow writes into the model since the last gather (NOTE [Masters follow the model]).
  virtual void refresh_changed() = 0;
  /// Every piece from the model, written or not (OptimizerBase::refresh_master_params: writes through `.data()`).
  virtual void refresh_all() = 0;
  /// After a taken step: the updated pieces, in the model's dtypes, are all-gathered into every replica.
  virtual void after_step() = 0;
  /// Whether scale_loss's unscale is this object's (stage 2: only this rank's slices hold gradients).
  virtual bool owns_unscale() const = 0;
  /// Stage 2: unscales the reduce-scattered slices into the pieces' gradients (delay_unscale: leaves them scaled)
  /// and agrees on found_inf over the ranks.
  virtual void unscale(bool delay_unscale, const InvScale& inv_scale, FoundInf& found_inf) = 0;
  virtual void zero_grad(bool set_to_none) = 0;
  /// The gradients the next step uses, as this rank holds them (stage 1: the full ones; stage 2: its slices).
  virtual std::vector<at::Tensor> grads() = 0;
  /// The norm of order `norm_type` of every rank's `grads()` together (0-dim fp32), the same on every rank.
  virtual at::Tensor global_norm(const std::vector<at::Tensor>& grads, double norm_type) = 0;
  /// The tensors this rank steps (OptimizerBase::master_params of a sharded optimizer).
  virtual std::vector<at::Tensor> pieces() const = 0;
  /// Writes this rank's shard (its masters' pieces, the world size, rank and layout) into the optimizer's amp archive.
  virtual void save(torch::serialize::OutputArchive& amp_archive) const = 0;
  /// While save_consolidated writes (rank 0): the full masters, in the master table's order; else null.
  virtual const std::vector<at::Tensor>* consolidated_masters() const = 0;
  /// Checks `amp_archive` (a shard of this world and rank, or an unsharded archive) and returns what restores it;
  /// `full_masters` are the unsharded archive's masters (empty for a shard). A shard's restore is collective.
  virtual std::function<void()> load(OptimizerBase& optimizer, torch::serialize::InputArchive& amp_archive,
                                     const std::vector<at::Tensor>& full_masters, const char* where) = 0;
  /// Whether `archive` (an optimizer archive) holds one rank's shard.
  static bool is_shard_archive(torch::serialize::InputArchive& archive) {
    torch::serialize::InputArchive amp_archive;
    return archive.try_read("amp", amp_archive) && is_shard_amp_archive(amp_archive);
  }
  /// The same, given the archive's "amp" part.
  static bool is_shard_amp_archive(torch::serialize::InputArchive& amp_archive) {
    c10::IValue world;
    return amp_archive.try_read("zero/world_size", world);
  }
  /// Before the torch optimizer loads this rank's shard: throws unless `archive` was saved by this rank of this world
  /// with this layout.
  virtual void check_shard_archive(torch::serialize::InputArchive& archive, const char* where) = 0;
  /// Collective: runs `fn` with the torch optimizer holding every rank's state whole, keyed by the full tensors, as
  /// an unsharded optimizer holds it (PythonCheckpoint::put_optimizer).
  virtual void with_full_state(OptimizerBase& optimizer, const std::function<void()>& fn) = 0;
  /// Collective: runs `fn` (auto_fp32 moving a module up) with the optimizer whole, as an unsharded one holds it (the
  /// masters' values, every rank's state keyed by the full tensors, the lean masters' aux); the param-group sync `fn`
  /// ends with lays every group out again.
  virtual void with_whole(OptimizerBase& optimizer, const std::function<void()>& fn) = 0;
  /// After state was written for the full tensors (PythonCheckpoint::load_optimizer): each rank keeps its slices.
  virtual void adopt_loaded_state(OptimizerBase& optimizer) = 0;
  /// The storages this object holds, by StateBytes kind (params: stage 3's slices of the parameters stepped
  /// directly; masters, master_grads, grads of direct pieces).
  virtual void held(std::vector<at::Tensor>& params, std::vector<at::Tensor>& masters,
                    std::vector<at::Tensor>& master_grads, std::vector<at::Tensor>& grads) const = 0;
};

}  // namespace amp::detail
