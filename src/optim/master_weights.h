#pragma once
// The fp32 master weights of one amp::Optimizer and how they stay in step with the model.
//
// NOTE [Masters follow the model]
// Real scripts write into the model after amp::initialize: Apex's documented order is initialize, then
// load a checkpoint; fine-tuning loads pretrained weights; users edit weights in place. Masters copied
// once at initialize would make the next step() write the old weights back. So every master remembers
// the version counter and storage of its model parameter when the two last agreed; any tracked write
// since (in-place ops, copy_, torch::load's set_, set_data) shows up as a changed version or storage, and
// the master is refreshed from the model before it is used (step, master_params, save). A check per
// parameter is two loads, no pass over the data. A refresh keeps each master value whose rounding is exactly what
// was written: a resume that loads the optimizer (masters) before the model (their rounded copies) writes the same
// bits again, and must not lose the masters' low bits (keep_where_rounded_equal). Writes through `.data()` or raw pointers bypass version
// counters, as they bypass autograd: OptimizerBase::refresh_master_params() is the explicit way.
// amp::load_weights writes fp32 checkpoint values straight into the masters (no rounding through the
// low-precision copy) through a process-wide lookup from model parameter to master; a checkpoint in the model's
// own dtype is a write to the model, whose rounded masters keep their low bits as above.

#include <ATen/core/Tensor.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "optim/float32_bytes.h"

namespace amp::detail {

class MasterWeights {
 public:
  /// Adds a model parameter (low precision) and its fp32 master; `name` is used in errors.
  void add(std::string name, at::Tensor model, at::Tensor master);
  size_t size() const noexcept { return model_.size(); }
  bool empty() const noexcept { return model_.empty(); }
  const std::vector<at::Tensor>& model() const noexcept { return model_; }
  const std::vector<at::Tensor>& master() const noexcept { return master_; }
  const std::string& name(size_t i) const { return names_[i]; }

  /// Copies the model into the masters wherever the model was written since they last agreed; throws
  /// if such a write left the parameter unusable (fp32 bytes in a low-precision tensor, a new dtype).
  void refresh_changed();
  /// Copies every model parameter into its master.
  void refresh_all();
  /// Copies the masters into the model (one fused pass) and records that they agree.
  void copy_to_model();
  /// Records that model[i] and master[i] agree now.
  void mark_synced(size_t i);
  /// Records that every model parameter and its master agree now (a fused step wrote both).
  void mark_all_synced();

  /// The fp32 sum of still-scaled gradients that scale_loss with delay_unscale moved out of model[i]'s
  /// low-precision .grad, so micro-batches accumulate in fp32 (summing 256 + 1 - 256 in bf16 gives 0); the
  /// next unscale adds the last micro-batch and consumes it. Undefined when nothing is pending.
  at::Tensor& pending_grad(size_t i) { return pending_[i]; }
  /// Drops every pending sum (zero_grad).
  void clear_pending_grads();
  /// amp::parallel's no_sync(): model[i]'s gradient from the backward just finished was not all-reduced, so
  /// delay_unscale moves it into unreduced_grad(i) instead, which the next synchronized backward all-reduces
  /// (fp32, once per accumulation window) and adds to pending_grad(i).
  void mark_unreduced(size_t i) { unreduced_flag_[i] = 1; }
  bool take_unreduced(size_t i) { return std::exchange(unreduced_flag_[i], char{0}) != 0; }
  at::Tensor& unreduced_grad(size_t i) { return unreduced_[i]; }
  /// NOTE [fp32 reductions reach the masters]: with allreduce_always_fp32, amp::parallel's fp32 average of
  /// model[i]'s gradient, which .grad holds rounded to its dtype; the unscale takes it in place of .grad.
  /// Undefined when the last reduction was not in fp32 (or nothing was reduced since the backward began).
  at::Tensor& reduced_grad(size_t i) { return reduced_[i]; }
  /// Drops every reduced_grad (a backward begins).
  void clear_reduced_grads();

  /// What ZeRO does for a table whose masters it holds in slices (NOTE [Sharded optimizers] in sharding.h).
  class Shards {
   public:
    virtual ~Shards() = default;
    /// Writes `value` (the parameter's shape; every rank the same) as master i: this rank's slice of it (fp32: exactly;
    /// in the model's dtype: keep_where_rounded_equal), and its rounded copy into the model.
    virtual void write_master(size_t i, const at::Tensor& value) = 0;
    /// Collective (every rank calls it): every master whole, in this table's order.
    virtual std::vector<at::Tensor> gather_masters() = 0;
  };
  /// From now on the masters hold no values (placeholders that refuse writes) and `shards` holds them in slices;
  /// refreshing or copying them throws.
  void mark_sharded(std::weak_ptr<Shards> shards) { shards_ = std::move(shards); }
  bool sharded() const noexcept { return !shards_.expired(); }
  /// The sharding that holds the masters (null: not sharded).
  std::shared_ptr<Shards> shards() const { return shards_.lock(); }

 private:
  void check_usable(size_t i) const;

  std::vector<std::string> names_;
  std::vector<at::Tensor> model_;
  std::vector<at::Tensor> master_;
  std::vector<int64_t> version_;
  std::vector<const void*> storage_;
  std::vector<at::Tensor> pending_;
  std::vector<at::Tensor> unreduced_;
  std::vector<at::Tensor> reduced_;
  std::vector<char> unreduced_flag_;  // char, not bool: std::exchange needs a real reference
  std::weak_ptr<Shards> shards_;
};

/// Refreshes an fp32 `master` from the low-precision `written` value of its parameter element by element: where
/// `written` is bit for bit the master rounded to its dtype, the master keeps its value; elsewhere it takes
/// `written`.
void keep_where_rounded_equal(const at::Tensor& master, const at::Tensor& written);

/// Makes `table`'s masters findable from their model parameters (replacing earlier entries of the same
/// table). Throws if a parameter already has a live master in another table: two optimizers would
/// step two masters of one weight.
void register_masters(const std::shared_ptr<MasterWeights>& table);

/// Returns the master table and index holding `model_param`'s master, if it has one.
std::optional<std::pair<std::shared_ptr<MasterWeights>, size_t>> find_master(const at::Tensor& model_param);

}  // namespace amp::detail
