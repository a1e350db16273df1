#pragma once
// BatchNorm over the batch of all ranks (Apex's SyncBatchNorm and convert_syncbn_model).

#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/pimpl.h>
#include <torch/version.h>

#include <memory>
#include <optional>
#include <ostream>
#include <type_traits>

#include "amp/parallel/process_group.h"

namespace amp::parallel {

namespace detail {
/// Batch norm in training mode over the union of every rank's batch: per-rank count, mean and M2 (sum of
/// squared deviations) in fp32, merged with Chan's parallel formula, so the statistics equal those of the whole
/// batch; running statistics are updated with `momentum` (unbiased variance). Differentiable in input, weight
/// and bias; the input gradient sums over all ranks. Output in the input's dtype.
at::Tensor sync_batch_norm(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias,
                           const at::Tensor& running_mean, const at::Tensor& running_var, double momentum, double eps,
                           const ProcessGroup& group);
}  // namespace detail

/// A BatchNorm layer whose training-mode statistics cover the batch of every rank of its process group.
/// It is a torch::nn::BatchNorm{1,2,3}dImpl (`Base`), with the same options, parameters, buffers and
/// state_dict, so amp treats it as BatchNorm (fp32 at O2, amp::freeze_batchnorm) and checkpoints load either
/// way. Without a group (or with one rank), and in eval mode, it is exactly its Base. Declaring it directly
/// is optional: convert_syncbn_model synchronizes plain BatchNorm members too; then
/// convert_syncbn_model(*model, group) attaches the group.
///
/// Example:
///   struct NetImpl : torch::nn::Module {
///     amp::parallel::SyncBatchNorm2d bn{register_module("bn", amp::parallel::SyncBatchNorm2d(64))};
///   };
template <class Base>
class SyncBatchNormImpl : public Base {
 public:
  explicit SyncBatchNormImpl(const torch::nn::BatchNormOptions& options, std::optional<ProcessGroup> group = std::nullopt)
      : Base(options), group_(std::move(group)) {}
  /// Makes a SyncBatchNorm sharing `bn`'s parameters and buffers (the same tensors) and training mode.
#if TORCH_VERSION_MAJOR < 2
  // LibTorch 1.x: Module is a virtual base, which the most derived class constructs: copy it explicitly, or the
  // copy would start with no parameters.
  SyncBatchNormImpl(const Base& bn, std::optional<ProcessGroup> group)
      : torch::nn::Module(bn), Base(bn), group_(std::move(group)) {}
#else
  SyncBatchNormImpl(const Base& bn, std::optional<ProcessGroup> group) : Base(bn), group_(std::move(group)) {}
#endif

  /// Normalizes with statistics over every rank's batch (training mode) or as the Base layer.
  at::Tensor forward(const at::Tensor& input) {
    if (!this->is_training() || !group_ || group_->world_size() == 1) return Base::forward(input);
    this->_check_input_dim(input);
    double momentum = this->options.momentum().value_or(0.0);
    at::Tensor running_mean, running_var;
    if (this->options.track_running_stats()) {
      running_mean = this->running_mean;
      running_var = this->running_var;
      if (this->num_batches_tracked.defined()) {
        this->num_batches_tracked += 1;
        if (!this->options.momentum()) momentum = 1.0 / this->num_batches_tracked.template item<double>();
      }
    }
    return detail::sync_batch_norm(input, this->weight, this->bias, running_mean, running_var, momentum,
                                   this->options.eps(), *group_);
  }

  /// Sets the process group whose ranks share statistics.
  void set_process_group(ProcessGroup group) { group_ = std::move(group); }
  /// Returns the process group, if one was set.
  const std::optional<ProcessGroup>& process_group() const noexcept { return group_; }

  /// Deep-copies the layer, keeping it a SyncBatchNorm with the same group.
  std::shared_ptr<torch::nn::Module> clone(const c10::optional<torch::Device>& device = c10::nullopt) const override {
    auto copy = std::dynamic_pointer_cast<Base>(Base::clone(device));
    return std::make_shared<SyncBatchNormImpl>(*copy, group_);
  }

  void pretty_print(std::ostream& stream) const override {
    const int dims = std::is_same_v<Base, torch::nn::BatchNorm1dImpl> ? 1 : std::is_same_v<Base, torch::nn::BatchNorm2dImpl> ? 2 : 3;
    stream << std::boolalpha << "amp::parallel::SyncBatchNorm" << dims << "d(" << this->options.num_features()
           << ", eps=" << this->options.eps() << ", momentum=";
    if (this->options.momentum()) {
      stream << *this->options.momentum();
    } else {
      stream << "None";
    }
    stream << ", affine=" << this->options.affine() << ", track_running_stats=" << this->options.track_running_stats()
           << ")";
  }

 private:
  std::optional<ProcessGroup> group_;
};

using SyncBatchNorm1dImpl = SyncBatchNormImpl<torch::nn::BatchNorm1dImpl>;
using SyncBatchNorm2dImpl = SyncBatchNormImpl<torch::nn::BatchNorm2dImpl>;
using SyncBatchNorm3dImpl = SyncBatchNormImpl<torch::nn::BatchNorm3dImpl>;

/// Module holders, as torch::nn::BatchNorm2d: SyncBatchNorm2d(64) or SyncBatchNorm2d(BatchNormOptions(64).momentum(0.01)).
TORCH_MODULE_IMPL(SyncBatchNorm1d, SyncBatchNorm1dImpl);
TORCH_MODULE_IMPL(SyncBatchNorm2d, SyncBatchNorm2dImpl);
TORCH_MODULE_IMPL(SyncBatchNorm3d, SyncBatchNorm3dImpl);

/// Returns whether `module` is one of the SyncBatchNorm layers.
bool is_sync_batchnorm(const torch::nn::Module& module);

/// Makes every BatchNorm{1,2,3}d under `module` compute training-mode statistics over every rank of `group`
/// (Apex's convert_syncbn_model), and gives SyncBatchNorm layers already there the group. Layers inside a
/// torch::nn::Sequential are replaced by a SyncBatchNorm sharing their parameters, statistics and mode. A
/// layer a custom module holds as a member (every ResNet block's) can't be swapped in C++, so it stays and its
/// batch_norm op runs synchronized whenever the forward goes through amp::Model (make_distributed's wrapper
/// included; NOTE [Precision policy dispatch key]); a forward called on the module itself, bypassing amp,
/// normalizes with this rank's batch. Throws if `module` is itself a BatchNorm layer.
void convert_syncbn_model(torch::nn::Module& module, const ProcessGroup& group);

}  // namespace amp::parallel
