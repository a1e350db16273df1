#pragma once
// The precision policy of one model (amp/precision_policy.h): which modules are kept in fp32 and why, the
// tensors behind them, and the dispatcher kernel that runs the ops reading them in fp32.

#include <ATen/core/Tensor.h>
#include <ATen/core/stack.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "amp/precision_policy.h"
#include "amp/properties.h"

namespace amp::detail {

/// Replaces one layer's training-mode batch_norm: amp::parallel's synchronized statistics for a BatchNorm a
/// module holds as a member (convert_syncbn_model can't swap those). Returns an undefined tensor to let the op
/// run as it is (one rank).
using BatchNormKernel = std::function<at::Tensor(const at::Tensor& input, const at::Tensor& weight,
                                                 const at::Tensor& bias, const at::Tensor& running_mean,
                                                 const at::Tensor& running_var, double momentum, double eps)>;
/// Runs `layer`'s training-mode batch_norm through `kernel` whenever an amp::Model's forward reaches it
/// (replacing an earlier kernel of the layer).
void replace_batch_norm(torch::nn::Module& layer, BatchNormKernel kernel);

/// One module kept in fp32, and the first reason that applies ("keep_fp32", "keep_fp32_type",
/// "keep_batchnorm_fp32", "auto_fp32").
struct KeptModule {
  std::string name;
  std::string reason;
  std::weak_ptr<torch::nn::Module> module;
};

class Fp8State;

class PrecisionPolicy {
 public:
  PrecisionPolicy(const Properties& properties, std::vector<KeptModule> kept, torch::nn::Module& root);

  /// Whether ops need the policy's kernel: fp32 islands exist and the level computes in low precision.
  bool active() const noexcept { return active_; }
  /// Whether the forward runs under the policy's key: active(), or a layer's batch_norm is replaced.
  bool engaged();
  /// The replacement of the batch_norm reading `t` (a layer's weight or running_mean), or null.
  const BatchNormKernel* batch_norm_kernel(const c10::TensorImpl* t) const;
  /// Whether a parameter or floating buffer belongs to an fp32 island (it stays fp32, its ops run in fp32).
  bool in_island(const c10::TensorImpl* t) const { return island_.count(t) > 0; }
  /// The kept modules in model order.
  const std::vector<KeptModule>& kept() const noexcept { return kept_; }
  /// Records the model's low-precision tensors, once initialize has cast it.
  void note_cast(torch::nn::Module& root);
  /// Makes `module` (qualified `name`) an fp32 island for `reason` (auto_fp32): its tensors join the island
  /// (the caller made them fp32) and its ops run in fp32 from the next forward.
  void keep(torch::nn::Module& module, const std::string& name, const std::string& reason);
  /// The model's FP8 layers (Options::fp8), or null.
  const std::shared_ptr<Fp8State>& fp8() const noexcept { return fp8_; }
  /// The root module the policy belongs to (null once it is gone).
  std::shared_ptr<torch::nn::Module> root() const { return root_.lock(); }

  // auto_fp32's diagnosis (NOTE [Finding the module that overflows]): the next forward checks each op that reads
  // a low-precision module's parameter; its backward reports where gradients first turned non-finite.
  void arm_diagnosis();
  void disarm_diagnosis();
  bool diagnosing() const noexcept { return diagnosis_ != nullptr; }
  /// The module the diagnosed forward and backward blame, if they found one.
  std::optional<std::string> diagnosed_module() const;
  struct OpRecord;
  /// Called by the policy's kernel around an op during a diagnosed forward.
  std::optional<size_t> before_op(const c10::IValue* args, size_t n);
  void after_op(size_t record, const torch::jit::Stack& stack, size_t returns);

  /// What an op's tensor arguments ask for.
  enum class Action { kNone, kFp32, kLowPrecision, kPromote };
  Action decide(const c10::IValue* args, size_t n) const;
  c10::ScalarType low_precision_dtype() const noexcept { return low_dtype_; }
  bool per_op() const noexcept { return per_op_; }

 private:
  void collect_island(torch::nn::Module& module);

  Properties properties_;
  bool per_op_;                // O1: autocast casts the rest; islands turn it off for their ops
  bool cast_model_;            // O2/O3: the model is low precision outside the islands
  c10::ScalarType low_dtype_;
  bool active_ = false;
  std::vector<KeptModule> kept_;
  std::unordered_set<const c10::TensorImpl*> island_;  // parameters and floating buffers of fp32 islands
  std::unordered_set<const c10::TensorImpl*> low_;     // the model's low-precision parameters and buffers
  std::weak_ptr<torch::nn::Module> root_;
  uint64_t batch_norm_epoch_ = 0;                      // replace_batch_norm's registrations seen
  std::unordered_map<const c10::TensorImpl*, BatchNormKernel> batch_norm_kernels_;  // this model's layers
  std::shared_ptr<Fp8State> fp8_;  // Options::fp8's layers and scales
  struct Diagnosis;
  std::shared_ptr<Diagnosis> diagnosis_;  // shared with the backward hooks of the diagnosed forward
};

/// The policy the ops of this thread run under now, or null: what interception handlers act for (no reference
/// count taken, as current_precision_policy() does, on every op).
PrecisionPolicy* active_precision_policy() noexcept;


}  // namespace amp::detail
