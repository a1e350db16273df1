#pragma once
// The patched TorchScript model (Model<torch::jit::Module>) and the tools for its module; initialize for it is in
// <amp/torchscript.h>.

#include <ATen/core/ivalue.h>
#include <torch/csrc/jit/api/module.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "amp/model.h"
#include "amp/options.h"
#include "amp/properties.h"

namespace amp {

/// The module's parameters (its submodules' included, in named_parameters order), to build the optimizer from.
std::vector<torch::Tensor> parameters(const torch::jit::Module& model);

/// freeze_batchnorm for a TorchScript module: every BatchNorm1d/2d/3d layer (found by its TorchScript type,
/// __torch__.torch.nn.modules.batchnorm.BatchNorm2d, traced modules' mangled names included) goes to eval mode,
/// stops its parameters' gradients and stays frozen through amp::Model::train(). Throws for a layer traced in
/// training mode: torch.jit.trace baked training=True into its graph, so no eval() can stop it from updating its
/// statistics.
void freeze_batchnorm(torch::jit::Module& model);

namespace detail {
/// The torch::nn::Module tree amp casts, steps and checkpoints for a TorchScript module (NOTE [TorchScript mirror]
/// in src/casting/jit_mirror.h): it holds the TorchScript module's own tensors.
std::shared_ptr<torch::nn::Module> jit_mirror(const torch::jit::Module& model);
/// Casts the floating tensors inside an IValue (a tensor; tuples, lists and dicts of them, recursively).
c10::IValue cast_ivalue(const c10::IValue& value, c10::ScalarType dtype);
}  // namespace detail

/// The patched TorchScript model: forward takes and returns what the module's forward does, with the level's
/// casts (floating input tensors to cast_model_type, per-op casts at O1, floating output tensors, inside tuples,
/// lists and dicts too, to cast_model_outputs). The forward runs op by op through the dispatcher, as eager
/// PyTorch: see NOTE [TorchScript runs op by op] in src/casting/torchscript.cpp.
template <>
class Model<torch::jit::Module> {
 public:
  Model(torch::jit::Module module, std::shared_ptr<torch::nn::Module> mirror, const Properties& properties,
        c10::DeviceType device);

  /// Runs the module's forward with the opt level's casts.
  c10::IValue forward(std::vector<c10::IValue> inputs);
  c10::IValue operator()(std::vector<c10::IValue> inputs) { return forward(std::move(inputs)); }
  /// model(x) / model(x, mask): each argument becomes one input.
  template <class... Args>
  c10::IValue operator()(Args&&... args) {
    return forward(std::vector<c10::IValue>{c10::IValue(std::forward<Args>(args))...});
  }

  /// Sets training mode, keeping layers frozen with amp::freeze_batchnorm in eval mode.
  void train(bool on = true);
  void eval() { train(false); }
  bool is_training() const { return module_.is_training(); }

  /// Saves the module as torch::jit::Module::save does, with fp32 weights (the fp32 masters' values where the
  /// level keeps them, as Apex's O2 state_dict hook): Python's torch.jit.load runs the file.
  void save(const std::string& path) const;

  /// The TorchScript module itself (no casts).
  torch::jit::Module* operator->() { return &module_; }
  torch::jit::Module& operator*() { return module_; }
  const torch::jit::Module& module() const noexcept { return module_; }
  const Properties& properties() const noexcept { return properties_; }
  /// The torch::nn::Module tree over the TorchScript module's own tensors (NOTE [TorchScript mirror]): what
  /// amp's optimizer, checkpoints and amp::parallel work on.
  const std::shared_ptr<torch::nn::Module>& mirror() const noexcept { return mirror_; }

 private:
  torch::jit::Module module_;
  std::shared_ptr<torch::nn::Module> mirror_;
  Properties properties_;
  c10::DeviceType device_;
  std::vector<at::Tensor> float16_bn_statistics_;
  std::vector<std::pair<std::string, at::Tensor>> low_precision_tensors_;
  std::shared_ptr<detail::PrecisionPolicy> policy_;
  bool warned_traced_batchnorm_ = false;
};

}  // namespace amp
