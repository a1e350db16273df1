#pragma once
// The base every amp fused optimizer shares (amp/fused_optimizers.h, amp/fused_muon.h): what amp::Optimizer,
// amp::GradScaler and ZeRO hand to a fused step (model copies, the gradients' loss scale, lean masters, the state
// format, shard sums, a step's overflow flag) and the step-count bookkeeping of a step that never waits.

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

namespace amp {
namespace detail {
class LeanMasters;
class StateFormat;
}
namespace optim {

/// What the fused optimizers share:
///   - for each parameter, an optional low-precision tensor the step also writes the parameter's new value
///     into, rounded. amp::Optimizer fills it at O2 (fp32 master -> the model's float16/bfloat16 parameter),
///     so the separate master -> model copy pass disappears;
///   - the loss scale its gradients still carry when amp::GradScaler::step runs it without an unscale_ first
///     (torch's grad_scale for fused optimizers): the step multiplies each gradient by its inverse as it reads
///     it and stores it back, instead of a separate unscale pass. As in torch, the gradients are unscaled afterwards
///     (unless the step was skipped for inf/NaN: then they keep the scale);
///   - at O2 with a lean master_weights_format (split, stochastic_rounding, kahan, residual8), the bfloat16 parameters whose
///     fp32 value the step rebuilds, updates in fp32 with fp32 state, and stores back (NOTE [Lean masters] in
///     src/optim/lean_masters.h), one parameter at a time.
class FusedOptimizer {
 public:
  virtual ~FusedOptimizer() = default;

  /// Set by amp::Optimizer at O2: the step also writes each master's update, rounded, into the model tensor
  /// it maps to (keyed by the master's TensorImpl); empty: no copies.
  void set_model_copies(std::unordered_map<const c10::TensorImpl*, at::Tensor> copies) {
    model_copies_ = std::move(copies);
  }
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
  /// Set by amp::Optimizer with a lean master_weights_format: the parameters that have lean masters.
  void set_lean_masters(std::shared_ptr<amp::detail::LeanMasters> lean) { lean_ = std::move(lean); }

  /// Set by amp::Optimizer (Options::optimizer_state_format): how the step stores Adam's moments, and the
  /// generator of bf16's stochastic rounding (NOTE [Optimizer state formats] in src/optim/state_format.h).
  void set_state_format(std::shared_ptr<amp::detail::StateFormat> format) { state_format_ = std::move(format); }

  /// Set by amp::parallel::shard_optimizer (ZeRO) around a sharded step, whose param_groups hold pieces of whole
  /// tensors: `over_ranks` sums a value over every rank; `per_tensor` turns each piece's partial sum (one per
  /// parameter of param_groups, in order) into the sum over every piece of its whole tensor, on every rank. FusedLAMB
  /// takes its global gradient norm and its per-tensor norms through them. `whole_shape` gives a piece's tensor's
  /// shape where the piece is that whole tensor (flattened), nullopt where it is a part: FusedMuon, which ZeRO shards
  /// by whole tensors, orthogonalizes each piece as its matrix.
  struct ShardSums {
    std::function<double(double)> over_ranks;
    std::function<void(std::vector<double>&)> per_tensor;
    std::function<std::optional<std::vector<int64_t>>(const at::Tensor&)> whole_shape;
  };
  void set_shard_sums(const ShardSums* sums) noexcept { shard_sums_ = sums; }

  /// Set by amp::Optimizer around a step after a backward that never waited (NOTE [A step that never waits] in
  /// src/scaling/device_scale.h; on the CPU, where the host has seen the outcome already, too), undefined otherwise: a
  /// 0-dim fp32 tensor, non-zero when the step must change nothing. The step skips inside, as torch's fused optimizers
  /// do: ATen's kernels take the flag on a device (step counts on the device with it), amp's CPU loops read it where a
  /// device's kernels would. Where a step keeps host-side counts that the flag decides (FusedLAMB, the bf16 and 8-bit
  /// state formats, lean masters, a first momentum buffer, the per-op route), it is read on the host, a wait on a
  /// device (counted on every device: amp::host_sync_count).
  /// `step_id` names the step in settle_step; 0: a CUDA graph capture (amp::GraphCaptureGuard), whose flag stays on the
  /// device wherever the step's kernels can take it and whose skips the host never settles.
  void set_found_inf(at::Tensor found_inf, uint64_t step_id) {
    found_inf_ = std::move(found_inf);
    step_id_ = step_id;
  }
  /// Called by amp::Optimizer once the host knows whether step `step_id` (run with a flag) was skipped: the host
  /// step counts it advanced while only the device knew are put back.
  void settle_step(uint64_t step_id, bool skipped);
  /// Sets the host step counts from the device's (waits, counted): after CUDA graph replays, which advance them
  /// without the host.
  void pull_device_steps();

  // The fused steps' side of set_found_inf.
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
  const at::Tensor& found_inf() const noexcept { return found_inf_; }
  /// A step run with the flag on the device advanced a host count; `undo` puts it back if the step was skipped.
  /// Without a step id (a graph capture, amp::GradScaler) nobody settles it: the host counts may run ahead of the
  /// device's until pull_device_steps (torch::save does it).
  /// The callbacks take the optimizer (this object as a torch::optim::Optimizer, and as a FusedOptimizer) rather than
  /// capturing it, so a moved optimizer carries them safely.
  using Undo = std::function<void(torch::optim::Optimizer&, FusedOptimizer&)>;
  using SetHostCount = std::function<void(torch::optim::Optimizer&, int64_t)>;
  void on_skip_undo(Undo undo) {
    if (step_id_ != 0) undo_[step_id_].push_back(std::move(undo));
    else counts_ahead_ = true;
  }
  /// Whether host step counts may be ahead of the device's (see on_skip_undo).
  bool counts_ahead() const noexcept { return counts_ahead_; }
  /// The fp32 step count ATen's kernels read for `key`, kept on the device across steps: advanced by one for this
  /// step (`host_step` is the host's count after it), the flag subtracted after the kernel. `set_host` writes a count
  /// into the host's state (pull_device_steps).
  at::Tensor device_step(const at::Tensor& key, int64_t host_step, const c10::Device& device, SetHostCount set_host);
  /// Puts back device_step's host count of `key` (its step was skipped on the device).
  void undo_device_step(const c10::TensorImpl* key);
  /// Returns the loss scale the gradients carry in this step (nullopt: they are unscaled), reading a tensor's on the
  /// host (see set_grad_scale).
  const std::optional<double>& grad_scale() const;
  /// Returns the scale as ATen's fused kernels take it, on `like`'s device (nullopt: none), without reading it.
  std::optional<at::Tensor> aten_grad_scale(const at::Tensor& like) const;

 protected:
  FusedOptimizer() = default;
  FusedOptimizer(FusedOptimizer&&) = default;
  FusedOptimizer& operator=(FusedOptimizer&&) = default;

  /// Returns the tensor p's update is also written into, or nullptr.
  const at::Tensor* model_copy(const at::Tensor& p) const;
  /// Returns the parameters with lean masters (nullptr: none).
  const std::shared_ptr<amp::detail::LeanMasters>& lean_masters() const noexcept { return lean_; }
  /// Returns the state format (nullptr: fp32, as LibTorch).
  const std::shared_ptr<amp::detail::StateFormat>& state_format() const noexcept { return state_format_; }
  /// Returns the sums of a sharded step (nullptr: the step holds whole tensors).
  const ShardSums* shard_sums() const noexcept { return shard_sums_; }

 private:
  std::unordered_map<const c10::TensorImpl*, at::Tensor> model_copies_;
  mutable std::optional<double> grad_scale_;  // a tensor's, once read
  mutable bool host_reads_count_ = true;      // this step's: a device would read the flag and scale on the host too
  at::Tensor grad_scale_tensor_;
  std::shared_ptr<amp::detail::LeanMasters> lean_;
  std::shared_ptr<amp::detail::StateFormat> state_format_;
  const ShardSums* shard_sums_ = nullptr;
  at::Tensor found_inf_;
  uint64_t step_id_ = 0;
  bool counts_ahead_ = false;
  std::map<uint64_t, std::vector<Undo>> undo_;  // by step id, until settled
  struct DeviceStep {
    at::Tensor count;
    int64_t host = 0;  // the host count it equals unless the device skipped
    SetHostCount set_host;
  };
  std::unordered_map<const c10::TensorImpl*, DeviceStep> device_steps_;
};

}  // namespace optim
}  // namespace amp
