#pragma once
// A training feature: state that rides on an amp::Optimizer's steps and must follow it everywhere.
//
// NOTE [Training features]
// FP8 scaling, the lean master formats, auto_fp32's decisions and the fp32 islands each keep state beside the
// optimizer's: it changes after a step (taken or skipped), it belongs in torch::save archives and Python
// checkpoints, and under amp::parallel the ranks must agree on it. The optimizer, amp::parallel and both
// checkpoint formats loop over an optimizer's features and name none of them; each feature is one file in
// src/features/ and one line in src/features/registry.cpp's list. Every feature is made for every optimizer, on or off, so an
// off feature still refuses a checkpoint that holds its state.

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <torch/nn/module.h>
#include <torch/serialize/archive.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "amp/overflow_report.h"

namespace amp {
class OptimizerBase;
}

namespace amp::detail {

/// What amp::parallel lends the features of a model it wraps, for as long as the wrapper lives.
class RankLink {
 public:
  virtual ~RankLink() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  /// Adds `tensors` to make_distributed's one broadcast of rank 0's state; `then` runs once they hold rank 0's values.
  virtual void broadcast_from_rank0(std::vector<at::Tensor> tensors, std::function<void()> then) = 0;
  /// Replaces `t` by its element-wise maximum over the ranks (every rank calls it, in the same order).
  virtual void max_over_ranks(at::Tensor& t) = 0;
};

/// What one unscaled backward ended with.
struct BackwardOutcome {
  bool overflow = false;
  double loss_scale = 1.0;
  /// The scale below which a smaller scale can't cure an overflow: the dynamic scale's floor (at least 1), or the
  /// static scale itself.
  double floor = 1.0;
};

/// The hooks a training feature implements; each does nothing unless overridden. Checks come before changes: a
/// load returns the function that applies it, so a checkpoint that fails a later check changes nothing.
class Feature {
 public:
  virtual ~Feature() = default;
  /// Its key: the prefix of its entries in the optimizer's torch::save archive, its entry in put_amp's dict.
  virtual const char* key() const = 0;

  /// After each backward that unscaled the gradients (not after delay_unscale's).
  virtual void after_backward(OptimizerBase& optimizer, const BackwardOutcome& outcome) {}
  /// Adds what it knows to the report of an overflowing backward.
  virtual void describe_overflow(const OptimizerBase& optimizer, OverflowReport& report) const {}
  /// After a step: `taken`, or skipped after an overflow.
  virtual void after_step(OptimizerBase& optimizer, bool taken) {}
  /// Whether the hooks above must see each backward's overflow as it happens: the host then reads the overflow
  /// flag every backward (NOTE [A step that never waits] in src/scaling/device_scale.h).
  virtual bool needs_overflow_on_host(const OptimizerBase& optimizer) const { return false; }

  /// torch::save(optimizer): writes its state into the optimizer's amp archive.
  virtual void save(const OptimizerBase& optimizer, torch::serialize::OutputArchive& archive) const {}
  /// torch::load(optimizer): checks `archive`'s state against this optimizer (`where` starts each error) and
  /// returns what restores it (null: nothing to restore).
  virtual std::function<void()> load(OptimizerBase& optimizer, torch::serialize::InputArchive& archive,
                                     const std::string& where) {
    return nullptr;
  }
  /// PythonCheckpoint::put_amp: its entry (none: the feature is off and writes nothing).
  virtual std::optional<c10::IValue> python_state(const OptimizerBase& optimizer) const { return std::nullopt; }
  /// PythonCheckpoint::load_amp: checks put_amp's `entry` (none in an Apex or older checkpoint; `where` names it)
  /// and returns what restores it.
  virtual std::function<void()> load_python_state(OptimizerBase& optimizer, const std::optional<c10::IValue>& entry,
                                                  const std::string& where) {
    return nullptr;
  }

  /// amp::parallel wraps `model`, one of this optimizer's: agree with the other ranks from now on.
  virtual void join_ranks(torch::nn::Module& model, const std::shared_ptr<RankLink>& link) {}
  /// The wrapper of `model` goes away.
  virtual void leave_ranks(torch::nn::Module& model) {}
};

using Features = std::vector<std::shared_ptr<Feature>>;

/// The features of the optimizers that train `model`, in the order they were made.
Features features_of(const torch::nn::Module& model);

}  // namespace amp::detail
