#pragma once
// NOTE [Fused step context]
// What amp wires into a fused optimizer's step from outside it, in one object each amp::optim::FusedOptimizer holds
// (its step_context()): from amp::Optimizer the model copies, the lean masters and the state format; from
// amp::GradScaler the loss scale the gradients still carry; from ZeRO the shard sums; and from the step ledger
// (NOTE [Step ledger] in step_ledger.h) a step's overflow flag, with the bookkeeping of the host step counts a step
// that never waits advances before the host knows whether it was skipped. The fused steps read it; scripts never
// need it.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

namespace torch::optim {
class Optimizer;
}

namespace amp::optim {
class FusedOptimizer;
}

namespace amp::detail {

class LeanMasters;
class StateFormat;

/// Set by amp::parallel::shard_optimizer (ZeRO) around a sharded step, whose param_groups hold pieces of whole
/// tensors: `over_ranks` sums a value over every rank; `per_tensor` turns each piece's partial sum (one per parameter
/// of param_groups, in order) into the sum over every piece of its whole tensor, on every rank. FusedLAMB takes its
/// global gradient norm and its per-tensor norms through them. `whole_shape` gives a piece's tensor's shape where the
/// piece is that whole tensor (flattened), nullopt where it is a part: FusedMuon, which ZeRO shards by whole tensors,
/// orthogonalizes each piece as its matrix.
struct ShardSums {
  std::function<double(double)> over_ranks;
  std::function<void(std::vector<double>&)> per_tensor;
  std::function<std::optional<std::vector<int64_t>>(const at::Tensor&)> whole_shape;
};

class FusedStepContext {
 public:
  /// Set by amp::Optimizer at O2: the step also writes each master's update, rounded, into the model tensor it maps
  /// to (keyed by the master's TensorImpl); empty: no copies.
  void set_model_copies(std::unordered_map<const c10::TensorImpl*, at::Tensor> copies) { model_copies_ = std::move(copies); }
  /// Returns the tensor p's update is also written into, or nullptr.
  const at::Tensor* model_copy(const at::Tensor& p) const;

  /// Set by amp::GradScaler::step around one step: the loss scale the gradients still carry (nullopt: none).
  void set_grad_scale(std::optional<double> scale) noexcept {
    grad_scale_ = scale;
    grad_scale_tensor_ = at::Tensor();
  }
  /// The same as a 0-dim fp32 tensor (torch's grad_scale), whose value the host need not know: ATen's kernels read
  /// it on the device; the routes that need it on the host read it there (a device's waited for, counted).
  void set_grad_scale(at::Tensor scale) {
    grad_scale_tensor_ = std::move(scale);
    grad_scale_.reset();
  }
  /// Returns the loss scale the gradients carry in this step (nullopt: they are unscaled), reading a tensor's on the
  /// host (see set_grad_scale).
  const std::optional<double>& grad_scale() const;
  /// Returns the scale as ATen's fused kernels take it, on `like`'s device (nullopt: none), without reading it.
  std::optional<at::Tensor> aten_grad_scale(const at::Tensor& like) const;

  /// Set by amp::Optimizer with a lean master_weights_format: the parameters that have lean masters.
  void set_lean_masters(std::shared_ptr<LeanMasters> lean) { lean_ = std::move(lean); }
  const std::shared_ptr<LeanMasters>& lean_masters() const noexcept { return lean_; }
  /// Set by amp::Optimizer (Options::optimizer_state_format): how the step stores Adam's moments, and the generator
  /// of bf16's stochastic rounding (NOTE [Optimizer state formats] in state_format.h); nullptr: fp32, as LibTorch.
  void set_state_format(std::shared_ptr<StateFormat> format) { state_format_ = std::move(format); }
  const std::shared_ptr<StateFormat>& state_format() const noexcept { return state_format_; }
  /// Set by ZeRO around a sharded step (nullptr: the step holds whole tensors).
  void set_shard_sums(const ShardSums* sums) noexcept { shard_sums_ = sums; }
  const ShardSums* shard_sums() const noexcept { return shard_sums_; }

  /// Set by amp::Optimizer around a step after a backward that never waited (NOTE [A step that never waits] in
  /// src/scaling/device_scale.h; on the CPU, where the host has seen the outcome already, too), undefined otherwise:
  /// a 0-dim fp32 tensor, non-zero when the step must change nothing. The step skips inside, as torch's fused
  /// optimizers do: ATen's kernels take the flag on a device (step counts on the device with it), amp's CPU loops read
  /// it where a device's kernels would (FusedLAMB's per-op step too: NOTE [LAMB on the device]). Where a step keeps
  /// host-side counts that the flag decides (the per-op route), it is read on the host, a wait on a device (counted on
  /// every device: amp::host_sync_count).
  /// `step_id` names the step in settle_step; 0: a CUDA graph capture (amp::GraphCaptureGuard, `captured`) or
  /// amp::GradScaler, whose flag stays on the device wherever the step's kernels can take it and whose skips the host
  /// never settles.
  void set_found_inf(at::Tensor found_inf, uint64_t step_id, bool captured = false) {
    found_inf_ = std::move(found_inf);
    step_id_ = step_id;
    captured_ = captured;
  }
  const at::Tensor& found_inf() const noexcept { return found_inf_; }
  /// Whether state that a device skip decides can wait on the device for the host: the host settles this step (a
  /// step id), or it is captured, where only a save reads it back. Not under amp::GradScaler, which settles nothing:
  /// there such state would wait until a save.
  bool device_skips_settle() const noexcept { return step_id_ != 0 || captured_; }

  /// How a step treats set_found_inf's flag.
  enum class Skip {
    kNo,        // no flag, or read on the host and clear: run as usual
    kYes,       // read on the host and set: change nothing
    kOnDevice,  // pass it to ATen's kernels (`aten_only`: every update of this step is one)
  };
  /// Decides at the start of step() (see set_found_inf). `on_device_there`: on a device, every update of this step
  /// would take the flag there (ATen's kernels, no host count it decides); where not, reading the flag is a wait on a
  /// device, counted on every device (NOTE [Counting host syncs]), the CPU's loops included.
  Skip found_inf_decision(bool aten_only, bool on_device_there) const;

  /// A step run with the flag on the device advanced a host count; `undo` puts it back if the step was skipped.
  /// Without a step id (a graph capture, amp::GradScaler) nobody settles it: the host counts may run ahead of the
  /// device's until pull_device_steps (torch::save does it). The callbacks take the optimizer (as a
  /// torch::optim::Optimizer, and as a FusedOptimizer) rather than capturing it, so a moved optimizer carries them.
  using Undo = std::function<void(torch::optim::Optimizer&, optim::FusedOptimizer&)>;
  using SetHostCount = std::function<void(torch::optim::Optimizer&, int64_t)>;
  void on_skip_undo(Undo undo) {
    if (step_id_ == 0) {
      counts_ahead_ = true;
      return;
    }
    settle_[step_id_].push_back([undo = std::move(undo)](torch::optim::Optimizer& self, optim::FusedOptimizer& fused,
                                                         bool skipped) {
      if (skipped) undo(self, fused);
    });
  }
  /// Whether host step counts may be ahead of the device's (see on_skip_undo).
  bool counts_ahead() const noexcept { return counts_ahead_; }
  /// The fp32 step count ATen's kernels read for `key`, kept on the device across steps: advanced by one for this
  /// step (`host_step` is the host's count after it), the flag subtracted after the kernel. `set_host` writes a count
  /// into the host's state (pull_device_steps).
  at::Tensor device_step(const at::Tensor& key, int64_t host_step, const c10::Device& device, SetHostCount set_host);
  /// Puts back device_step's host count of `key` (its step was skipped on the device).
  void undo_device_step(const c10::TensorImpl* key);
  /// Where the lean masters' step keeps its flag on the device: their generator's host counter goes back if the host
  /// learns the step was skipped (NOTE [Lean masters on the device]).
  void rewind_lean_draws_on_skip();
  /// Ends a step's numbering of stochastic rounding draws (StateFormat::end_step), with this step's flag where it
  /// stayed on the device (`on_device`): the host's counter goes back if the host learns the step was skipped.
  void end_format_step(StateFormat& format, bool on_device);
  /// NOTE [A first momentum buffer on the device] in fused_optimizers.cpp (FusedSGD with dampening): the 0-dim bool on
  /// the device that is set while every step since `key`'s momentum buffer was made has been skipped, or undefined
  /// where the host knows the buffer has had a step. `make`: the buffer `buffer` was just made for a step whose
  /// flag stays on the device, so a set flag is made for it. Each call counts this step against the flag; when the host
  /// learns a step committed it forgets the flag, when it learns every counted step was skipped it calls `drop` (the
  /// host's buffer goes, as if never made) and forgets it; after steps of a graph capture (uncounted) only reading the
  /// flag settles it. A flag made for another buffer (a loaded state) is forgotten, and `drop` is given the buffer the
  /// flag was made for, to leave a buffer that has replaced it alone.
  using DropBuffer = std::function<void(torch::optim::Optimizer&, const c10::TensorImpl* buffer)>;
  at::Tensor first_step_flag(const at::Tensor& key, const at::Tensor& buffer, bool make, DropBuffer drop);
  /// Reads every remaining first-step flag on the host (counted) and settles it: set, the buffer is dropped. Steps
  /// whose flag the host reads anyway, and pull_device_steps, call it.
  void settle_first_step_flags(optim::FusedOptimizer& owner);
  /// How many first-step flags wait for the host (tests: none are left where nobody would settle them).
  size_t first_step_flags() const noexcept { return first_steps_.size(); }

  /// FusedOptimizer::settle_step and pull_device_steps, for `owner` (the optimizer holding this context).
  void settle_step(optim::FusedOptimizer& owner, uint64_t step_id, bool skipped);
  void pull_device_steps(optim::FusedOptimizer& owner);

 private:
  std::unordered_map<const c10::TensorImpl*, at::Tensor> model_copies_;
  mutable std::optional<double> grad_scale_;  // a tensor's, once read
  mutable bool host_reads_count_ = true;      // this step's: a device would read the flag and scale on the host too
  at::Tensor grad_scale_tensor_;
  std::shared_ptr<LeanMasters> lean_;
  std::shared_ptr<StateFormat> state_format_;
  const ShardSums* shard_sums_ = nullptr;
  at::Tensor found_inf_;
  uint64_t step_id_ = 0;
  bool captured_ = false;
  bool counts_ahead_ = false;
  using Settle = std::function<void(torch::optim::Optimizer&, optim::FusedOptimizer&, bool skipped)>;
  std::map<uint64_t, std::vector<Settle>> settle_;  // by step id, until settled
  struct FirstStepFlag {
    at::Tensor flag;                           // set: no step since the buffer was made has committed
    const c10::TensorImpl* buffer = nullptr;   // the buffer it was made for
    int64_t unsettled = 0;                     // steps counted against it that the host has not settled
    bool uncounted = false;                    // steps of a graph capture, which nobody settles, ran on it too
    uint64_t generation = 0;                   // tells a settle of an earlier flag of the same key apart
    DropBuffer drop;
  };
  std::unordered_map<const c10::TensorImpl*, FirstStepFlag> first_steps_;
  uint64_t first_step_generation_ = 0;
  struct DeviceStep {
    at::Tensor count;
    int64_t host = 0;  // the host count it equals unless the device skipped
    SetHostCount set_host;
  };
  std::unordered_map<const c10::TensorImpl*, DeviceStep> device_steps_;
};

}  // namespace amp::detail
