#pragma once
// The patched optimizer: skips steps after an overflow and keeps fp32 master weights (O2).

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "amp/loss_scaler.h"
#include "amp/overflow_report.h"
#include "amp/properties.h"

namespace torch::optim {
class Adam;
class AdamW;
class SGD;
}  // namespace torch::optim

namespace amp::detail {
class FoundInf;
class InvScale;
struct BackwardOutcomeView;
struct OverflowReportView;
struct StepLedger;
class Feature;
class ParamIndex;
class Sharding;
struct OptimizerAccess;
}  // namespace amp::detail

namespace amp {

class ScaledLoss;
class OptimizerBase;

namespace detail {
/// torch::optim::SGD's / Adam's / AdamW's (decoupled) step as Python's torch.optim computes it, where some parameter
/// is bf16 or fp16 (NOTE [LibTorch's optimizers on low-precision parameters] in src/optim/python_steps.cpp); false,
/// stepping nothing, where all are fp32.
bool step_sgd_as_python(torch::optim::Optimizer& sgd);
bool step_adam_as_python(torch::optim::Optimizer& adam, bool decoupled);

/// Gives `optimizer` its training features (NOTE [Training features], src/features/registry.cpp), once it has
/// attached to `modules`.
void attach_features(OptimizerBase& optimizer, const std::vector<torch::nn::Module*>& modules);

/// While alive, the host syncs amp makes on this thread (detail::count_host_sync) count for `optimizers` too:
/// their step, their backward (NOTE [Counting host syncs] in src/optim/optimizer.cpp).
class HostSyncScope {
 public:
  explicit HostSyncScope(std::vector<const OptimizerBase*> optimizers);
  ~HostSyncScope();
  HostSyncScope(const HostSyncScope&) = delete;
  HostSyncScope& operator=(const HostSyncScope&) = delete;

 private:
  std::vector<int64_t*> previous_;
};
}  // namespace detail

/// What every amp::Optimizer<Opt> is, whatever Opt: the loss scalers, the fp32 master weights and
/// the skip decision. scale_loss, loss_scale and master_params take it.
///
/// It follows what changes after amp::initialize (see NOTE [Masters follow the model] in
/// src/optim/master_weights.h): parameter groups added with add_param_group are adopted at the next
/// scale_loss, step or zero_grad (cast where the level casts, fp32 masters at O2, unscaled like the
/// rest); weights written into the model (torch::load, amp::load_weights, in-place edits) are copied
/// into the masters before the next step; and a step on gradients still multiplied by a loss scale
/// throws instead of updating.
class OptimizerBase {
 public:
  virtual ~OptimizerBase();

  /// Returns the resolved properties this optimizer was initialized with.
  const Properties& properties() const noexcept { return properties_; }
  /// Returns the scaler of loss `loss_id`; throws if loss_id is outside [0, num_losses). After a backward that never
  /// waited (NOTE [A step that never waits]) the host's copy of it catches up first, waiting for the device if it must.
  const LossScaler& loss_scaler(int loss_id = 0) const;
  /// Returns the parameters the optimizer updates: fp32 masters where the model is low precision.
  std::vector<at::Tensor> master_params();
  /// Returns whether the next step() will be skipped because a backward overflowed. These three wait for the
  /// outcome of backwards the host has not seen yet (a step that never waits learns them later; counted).
  bool step_will_be_skipped() const;
  /// Returns how many steps were skipped after overflows.
  int64_t skipped_steps() const;
  /// Returns the last backward that overflowed, with the parameters whose gradients were non-finite
  /// (nullopt before any overflow). amp::last_overflow(optimizer) is the same.
  const std::optional<OverflowReport>& last_overflow() const;
  /// Copies the model's current weights into the fp32 masters. amp does this by itself after any write
  /// that bumps a tensor's version counter; call it after writes that don't (through `.data()` or raw
  /// pointers).
  void refresh_master_params();
  /// Returns how many times this optimizer's backwards and steps made the host wait for a device value
  /// (amp::host_sync_count).
  int64_t host_sync_count() const noexcept;

 protected:
  OptimizerBase();
  OptimizerBase(OptimizerBase&&) noexcept;
  OptimizerBase& operator=(OptimizerBase&&) noexcept;

  /// Returns the torch optimizer this object is.
  virtual torch::optim::Optimizer& torch_optimizer() = 0;
  virtual const torch::optim::Optimizer& torch_optimizer() const = 0;

  /// Checks the optimizer against the models it trains, builds fp32 masters and re-keys optimizer
  /// state. Runs before the models are cast, so masters copy the original fp32 values. `scalers`
  /// shares one bank of loss scalers between optimizers initialized together (nullptr: a new bank).
  void attach(const std::vector<torch::nn::Module*>& modules, const Properties& properties,
              std::shared_ptr<std::vector<LossScaler>> scalers);
  /// How step() runs: not at all (an overflow the host decided: grads are dropped and nothing changes), the torch
  /// optimizer's step, or a fused step handed the overflow flag of an overflow the host knows of already, which skips
  /// inside as on a device (NOTE [A step that never waits]), followed by the skip's bookkeeping.
  enum class StepPlan { kSkip, kStep, kSkipInside };
  /// Decides the step.
  StepPlan begin_step();
  /// After a kStep: copies the updated masters into the model's low-precision parameters (one fused pass), unless the
  /// step wrote them itself (amp::optim::Fused*).
  void end_step();
  /// After a kSkipInside: what a skip the host decided does (the notice, the count, the gradients dropped).
  void end_skipped_step();
  /// Clears model and master gradients and any pending backward state.
  void zero_all_grads(bool set_to_none);
  void save_amp_state(torch::serialize::OutputArchive& archive) const;
  void load_amp_state(torch::serialize::InputArchive& archive);
  enum class OwnCall { kStep, kSave, kLoad };
  /// Runs the torch optimizer's own step, save or load (`fn`); once amp::parallel::shard_optimizer sharded it, on
  /// this rank's pieces (NOTE [Sharded optimizers] in src/optim/sharding.h). `loading` is the archive a load reads.
  void run_own(OwnCall call, const std::function<void()>& fn, torch::serialize::InputArchive* loading = nullptr) const;

 private:
  friend class ScaledLoss;
  friend struct detail::OptimizerAccess;  // amp's checkpoint formats, gradient tools, training features, graph capture

  // scale_loss protocol (Apex's _prepare_amp_backward / _post_amp_backward), split so that several
  // optimizers share one overflow decision and one scale update.
  void prepare_backward(int loss_id);
  void unscale_grads(int loss_id, bool delay_unscale, const detail::InvScale& inv_scale, detail::FoundInf& found_inf);
  void finish_backward(int loss_id, bool skip);
  // On an overflowing backward only: records which of this optimizer's gradients are non-finite.
  void record_overflow(int loss_id, double loss_scale);
  // After each unscaled backward: the training features' turn (auto_fp32 counts overflows at the scale's floor).
  void after_backward(bool overflow, double loss_scale, double floor);
  void abort_backward() noexcept;
  // NOTE [A step that never waits] (src/scaling/device_scale.h): whether this optimizer's steps can skip on the
  // device (amp's fused optimizers, no feature that must see each overflow on the host, not sharded).
  bool skips_on_device() const;
  // A backward that never waited: `overflow` (0-dim fp32 on the loss's device) joins the next step's flag, and
  // its outcome is applied when the host sees it.
  void defer_outcome(std::shared_ptr<detail::BackwardOutcomeView> outcome, const at::Tensor& overflow);
  // Applies the outcomes the host can see now, in order; with `wait`, all of them (waiting: counted).
  void settle(bool wait) const;
  void apply_outcome(detail::BackwardOutcomeView& outcome, uint64_t grads_generation);
  void apply_device_step(uint64_t grads_generation, uint64_t step_id);
  // An overflowing backward of a step that never waits: the report's checks start on the device.
  std::shared_ptr<detail::OverflowReportView> start_overflow_report(int loss_id, double loss_scale);
  void finish_overflow_report(detail::OverflowReportView& view);
  void clear_grads(bool set_to_none);
  // Brings the host copy of every loss scaler up to its device state (with `wait`, waiting for it).
  void settle_scalers(bool wait) const;
  void announce_skip() const;
  // A skip the host decided: the notice, the features, the gradients dropped, the count.
  void take_skip();
  void warn_overflow_at_minimum(int loss_id, double loss_scale);
  bool scales_loss() const noexcept { return properties_.enabled && !unscaled_fast_path_; }
  void check_loss_id(int loss_id) const;
  bool owns_model_tensor(const c10::TensorImpl* t) const;
  const std::shared_ptr<std::vector<LossScaler>>& scaler_bank() const noexcept { return scalers_; }
  // Adopts param groups added since initialize (the index follows param_groups).
  void sync_param_groups(bool at_initialize = false);
  std::vector<std::shared_ptr<torch::nn::Module>> models() const;
  std::vector<at::Tensor> grads_for_step(const char* caller);
  // Throws if a gradient of the model's parameters is still multiplied by a loss scale (scaled_grads.h's ledger).
  void check_no_scaled_model_grads(const char* caller) const;

  Properties properties_;
  bool attached_ = false;
  // Apex skips all scaling bookkeeping for a fixed scale of 1 without master weights (O0, O3).
  bool unscaled_fast_path_ = false;
  std::shared_ptr<std::vector<LossScaler>> scalers_;        // shared by optimizers initialized together
  std::vector<std::weak_ptr<torch::nn::Module>> modules_;  // the models this optimizer trains
  std::shared_ptr<detail::ParamIndex> index_;              // which tensors it steps (src/optim/param_index.h)
  std::vector<std::shared_ptr<detail::Feature>> features_;  // NOTE [Training features]
  std::shared_ptr<detail::Sharding> sharding_;              // set by amp::parallel::shard_optimizer
  std::vector<at::Tensor> stash_;            // grads of direct parameters before the current backward
  bool backward_prepared_ = false;
  std::optional<int> scaled_grads_loss_id_;  // grads still scaled after delay_unscale
  std::optional<OverflowReport> last_overflow_;
  std::vector<bool> warned_at_min_scale_;  // per loss_id: the "still overflowing at the minimum" notice, once
  std::unique_ptr<detail::StepLedger> ledger_;  // NOTE [Step ledger] (src/optim/step_ledger.h)
};

/// The patched optimizer: an Opt whose step() skips the update after a gradient overflow and, with
/// master weights, copies the updated fp32 masters back into the model. Built by amp::initialize.
/// torch::save / torch::load round-trip its state, masters and loss scalers.
template <class Opt>
class Optimizer : public Opt, public OptimizerBase {
 public:
  Optimizer(Opt&& optimizer, const std::vector<torch::nn::Module*>& modules, const Properties& properties,
            std::shared_ptr<std::vector<LossScaler>> scalers = nullptr)
      : Opt(std::move(optimizer)) {
    attach(modules, properties, std::move(scalers));
    detail::attach_features(*this, modules);
  }

  /// Steps, unless a backward since the last step overflowed. Closures are not supported (as in Apex).
  torch::Tensor step(torch::optim::Optimizer::LossClosure closure = nullptr) override {
    TORCH_CHECK(closure == nullptr,
                "amp::Optimizer::step: Currently, amp does not support closure use with optimizers. Compute the "
                "loss, run amp::scale_loss(loss, optimizer).backward(), then call step() without a closure.");
    const detail::HostSyncScope syncs({this});
    const StepPlan plan = begin_step();
    if (plan == StepPlan::kSkip) return {};
    torch::Tensor loss;
    run_own(OwnCall::kStep, [&] {
      if constexpr (std::is_same_v<Opt, torch::optim::SGD>) {
        if (detail::step_sgd_as_python(*this)) return;
      } else if constexpr (std::is_same_v<Opt, torch::optim::Adam> || std::is_same_v<Opt, torch::optim::AdamW>) {
        if (detail::step_adam_as_python(*this, std::is_same_v<Opt, torch::optim::AdamW>)) return;
      }
      loss = Opt::step(nullptr);
    });
    if (plan == StepPlan::kSkipInside) {
      end_skipped_step();
      return {};
    }
    end_step();
    return loss;
  }

  /// Clears the gradients of the model's parameters and of the fp32 masters.
  void zero_grad(bool set_to_none = true) { zero_all_grads(set_to_none); }

  void save(torch::serialize::OutputArchive& archive) const override {
    run_own(OwnCall::kSave, [&] { Opt::save(archive); });
    save_amp_state(archive);
  }

  void load(torch::serialize::InputArchive& archive) override {
    run_own(OwnCall::kLoad, [&] { Opt::load(archive); }, &archive);
    load_amp_state(archive);
  }

 protected:
  torch::optim::Optimizer& torch_optimizer() override { return *this; }
  const torch::optim::Optimizer& torch_optimizer() const override { return *this; }
};

/// Returns how many times `optimizer` made the host wait for a device value since it was created. With amp's fused
/// optimizers a step makes none (NOTE [A step that never waits]); with LibTorch's, the overflow flag after each
/// unscaled backward and the overflow report's checks on an overflowing one; besides, the norms of ZeRO's LAMB and
/// stage-2 clipping, FP8 auto_fallback's flags, auto_fp32's diagnosis, and reading what the host has not seen yet
/// (loss_scale, skipped_steps, a checkpoint). A CPU never waits, but amp counts the same reads there, so the count is
/// what the step costs on a GPU (docs/cuda.md has the table).
///
/// Example:
///   const int64_t before = amp::host_sync_count(optimizer);
///   train_step();
///   std::cout << amp::host_sync_count(optimizer) - before << " host syncs\n";
int64_t host_sync_count(const OptimizerBase& optimizer);

}  // namespace amp
