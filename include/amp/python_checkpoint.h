#pragma once
// Checkpoints shared with Python: read what Python's torch.save wrote (an Apex or torch.amp run) and
// write what Python's torch.load reads, so a mixed precision run can move between the two mid-training.

#include <ATen/core/ivalue.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace torch::jit {
struct Module;
}

namespace amp {

class OptimizerBase;
class GradScaler;
template <class Opt>
class Optimizer;

/// How PythonCheckpoint::load_model matches the checkpoint's names to the module's.
///
/// Rules rewrite each checkpoint key in the order they were added; then every key must name a
/// parameter or buffer of the module and every parameter and buffer must be in the checkpoint
/// (strict, as Python's load_state_dict(strict=True)).
///
/// Example:
///   // a checkpoint saved from a DistributedDataParallel model: keys "module.fc.weight", ...
///   checkpoint.load_model(*model, "model", amp::PythonCheckpointLoadOptions().strip_prefix("module."));
class PythonCheckpointLoadOptions {
 public:
  /// Removes `prefix` from the start of every checkpoint key that has it ("module." of Python's DDP).
  PythonCheckpointLoadOptions& strip_prefix(std::string prefix);
  /// Replaces `from` at the start of every checkpoint key that has it by `to` ("backbone." -> "encoder.").
  PythonCheckpointLoadOptions& replace_prefix(std::string from, std::string to);
  /// Sets whether missing and unexpected keys are errors (true, the default) or skipped (false, as
  /// load_state_dict(strict=False)). Shape mismatches are errors either way.
  PythonCheckpointLoadOptions& strict(bool strict);

  /// Returns the rules, in order: (from, to) prefix pairs.
  const std::vector<std::pair<std::string, std::string>>& prefix_rules() const noexcept { return rules_; }
  /// Returns whether missing and unexpected keys are errors.
  bool strict() const noexcept { return strict_; }
  /// Returns `key` rewritten by the rules.
  std::string map_key(const std::string& key) const;

 private:
  std::vector<std::pair<std::string, std::string>> rules_;
  bool strict_ = true;
};

/// A checkpoint in Python's format: the dict that `torch.save({...}, path)` wrote, read without Python
/// (collections.OrderedDict state_dicts included, any pickle protocol torch.save uses), and written so
/// that Python's `torch.load` (weights_only=True included) and the standard load_state_dict calls read it.
///
/// Reading checks everything before it writes anything: a failed load_* leaves the model, the optimizer
/// and the loss scalers as they were. Errors name the entry, the key and both shapes.
///
/// Example (resume a Python Apex or torch.amp run in C++, then hand it back):
///   auto [model, optimizer] = amp::initialize(net, std::move(sgd), amp::Options("O2"));
///   auto checkpoint = amp::PythonCheckpoint::load("checkpoint.pt");
///   checkpoint.load_model(*model);                 // "model": fp32 values into the fp32 masters
///   checkpoint.load_optimizer(optimizer);          // "optimizer": state and hyperparameters
///   checkpoint.load_amp(optimizer, "scaler");      // Apex's amp.state_dict() or GradScaler.state_dict()
///   int64_t epoch = checkpoint.get("epoch").toInt();
///   ...
///   amp::PythonCheckpoint out;
///   out.put_model("model", *model);
///   out.put_optimizer("optimizer", optimizer);
///   out.put_amp("amp", optimizer);
///   out.put("epoch", epoch);
///   out.save("checkpoint.pt");
class PythonCheckpoint {
 public:
  /// An empty checkpoint, to fill with put_* and save.
  PythonCheckpoint() = default;

  /// Reads a file written by Python's torch.save of a dict (tensors come back on the CPU). Throws if
  /// the file is not a torch.save zip archive or does not hold a dict with string keys.
  static PythonCheckpoint load(const std::string& path);

  /// Returns whether the checkpoint has an entry `key`.
  bool contains(std::string_view key) const;
  /// Returns the keys of the entries, in the file's order.
  std::vector<std::string> keys() const;
  /// Returns the entry `key` ("epoch", "best_acc", ...): dicts, lists, tuples, strings, ints, floats, bools,
  /// None and tensors. Throws naming the key if there is none, or if it holds a Python object C++ cannot
  /// rebuild (argparse.Namespace, numpy scalars, ...; the other entries stay readable).
  c10::IValue get(std::string_view key) const;

  /// Loads a `model.state_dict()` into `module` by qualified name, converting each tensor to the dtype
  /// the parameter or buffer has now; where a parameter has an fp32 master weight (O2), the master gets
  /// the checkpoint's value exactly and the model its rounded copy. An empty key reads the whole file
  /// as the state_dict (`torch.save(model.state_dict(), path)`).
  void load_model(torch::nn::Module& module, std::string_view key = "model") const;
  void load_model(torch::nn::Module& module, std::string_view key, const PythonCheckpointLoadOptions& options) const;
  /// The same for a TorchScript module (amp/torchscript.h), before or after amp::initialize: a Python
  /// `model.state_dict()` loads into the scripted or traced module by the same qualified names.
  void load_model(torch::jit::Module& module, std::string_view key = "model") const;
  void load_model(torch::jit::Module& module, std::string_view key, const PythonCheckpointLoadOptions& options) const;
  /// Loads an `optimizer.state_dict()` (SGD, Adam, AdamW, RMSprop or Adagrad, the type the optimizer
  /// has) into `optimizer`: per-parameter state, at O2 into the fp32 masters' state, and each group's
  /// hyperparameters (the file's win, as in Python).
  void load_optimizer(OptimizerBase& optimizer, std::string_view key = "optimizer") const;
  /// The same for a plain torch::optim optimizer (a script ported as torch::optim::Adam + amp::GradScaler).
  void load_optimizer(torch::optim::Optimizer& optimizer, std::string_view key = "optimizer") const;
  template <class Opt>
  void load_optimizer(Optimizer<Opt>& optimizer, std::string_view key = "optimizer") const {
    load_optimizer(static_cast<OptimizerBase&>(optimizer), key);  // amp::Optimizer is both: take amp's route
  }
  /// Loads the loss scale and its clean-step counter from Apex's `amp.state_dict()` (`loss_scaler<i>`:
  /// `loss_scale`, `unskipped`) or torch.amp's `GradScaler.state_dict()` (`scale`, `_growth_tracker`, ...),
  /// told apart by their keys. An 'auto_fp32' entry (put_amp's) moves the modules auto_fp32 had moved back to fp32
  /// and restores its overflow count, as torch::load of the optimizer does; an 'fp8' entry restores the FP8 layers'
  /// scales and amax histories (without one, an FP8 run starts them afresh).
  void load_amp(OptimizerBase& optimizer, std::string_view key = "amp") const;
  /// Loads a torch.amp `GradScaler.state_dict()` into an amp::GradScaler (its scale, growth tracker and
  /// schedule), as `scaler.load_state_dict(checkpoint["scaler"])`.
  void load_grad_scaler(GradScaler& scaler, std::string_view key = "scaler") const;

  /// Sets the entry `key` (replacing one of that name in place): dicts with string/int keys, lists,
  /// tuples, strings, ints, floats, bools, None and tensors.
  void put(std::string_view key, c10::IValue value);
  /// Removes the entry `key`, if there is one.
  void erase(std::string_view key);
  /// Puts `module`'s state_dict, in fp32 as Apex's O2 state_dict hook returns it: the fp32 master's
  /// value where a parameter has one, else the tensor converted from float16/bfloat16.
  void put_model(std::string_view key, torch::nn::Module& module);
  void put_model(std::string_view key, torch::jit::Module& module);
  /// Puts `optimizer`'s state in `optimizer.state_dict()`'s format, for `optimizer.load_state_dict`.
  void put_optimizer(std::string_view key, OptimizerBase& optimizer);
  void put_optimizer(std::string_view key, torch::optim::Optimizer& optimizer);
  template <class Opt>
  void put_optimizer(std::string_view key, Optimizer<Opt>& optimizer) {
    put_optimizer(key, static_cast<OptimizerBase&>(optimizer));
  }
  /// Puts the loss scalers in Apex's `amp.state_dict()` format, for `amp.load_state_dict`. With Options::auto_fp32
  /// on, the dict also holds amp's 'auto_fp32' entry ({'models', 'modules', 'overflows', 'armed'}: the modules it
  /// moved to fp32), which Apex's amp.load_state_dict refuses as an unexpected key: pop it there. With Options::fp8,
  /// an 'fp8' entry holds, per model, {'layers': [str], 'scales', 'history', 'history_amax', 'position'} (tensors;
  /// slot 3 * layer + 0/1/2 is the layer's input/weight/grad), likewise amp's own.
  void put_amp(std::string_view key, const OptimizerBase& optimizer);
  /// Puts loss scaler `loss_id` in torch.amp's `GradScaler.state_dict()` format, for `scaler.load_state_dict`.
  void put_grad_scaler(std::string_view key, const OptimizerBase& optimizer, int loss_id = 0);
  /// Puts an amp::GradScaler's `state_dict()`, for Python's `scaler.load_state_dict`.
  void put_grad_scaler(std::string_view key, const GradScaler& scaler);

  /// Writes the checkpoint for Python's torch.load (to a temporary file, then renamed over `path`).
  void save(const std::string& path) const;

 private:
  struct Entry {
    std::string key;
    c10::IValue value;
    std::string unreadable;  // why `value` could not be rebuilt (a Python object), else empty
  };
  const Entry* find(std::string_view key) const;
  const c10::IValue& value_of(std::string_view key, const char* method) const;
  void load_optimizer_state(torch::optim::Optimizer& optimizer, std::string_view key,
                            const std::function<std::string(const at::Tensor&)>& name_of) const;
  void put_optimizer_state(std::string_view key, torch::optim::Optimizer& optimizer);
  std::string where() const;

  std::vector<Entry> entries_;
  std::string path_;  // the file it was loaded from, for messages
};

}  // namespace amp
