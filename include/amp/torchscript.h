#pragma once
// TorchScript models: a network defined in Python and saved with torch.jit.script / torch.jit.trace, loaded with
// torch::jit::load and fine-tuned in C++ at an opt level, without rewriting it as a torch::nn::Module.
//
//   torch::jit::Module net = torch::jit::load("resnet_scripted.pt");
//   amp::freeze_batchnorm(net);                                   // pretrained statistics stay as they are
//   torch::optim::SGD sgd(amp::parameters(net), torch::optim::SGDOptions(0.01).momentum(0.9));
//   auto [model, optimizer] = amp::initialize(net, std::move(sgd), amp::Options("O2"));
//   at::Tensor logits = model({images}).toTensor();                 // bf16 inside, fp32 logits
//   ...
//   model.save("finetuned.pt");                                     // fp32 weights; Python's torch.jit.load runs it

#include <ATen/core/ivalue.h>
#include <torch/csrc/jit/api/module.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "amp/initialize.h"

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
/// Checks a TorchScript module for initialize and prepares its mirror (policy, checks, banner); returns the mirror
/// and the device the module lives on.
std::pair<std::shared_ptr<torch::nn::Module>, c10::DeviceType> begin_initialize(const torch::jit::Module& model,
                                                                                const Options& options,
                                                                                const Properties& properties);
/// Throws unless some parameter of `optimizer` requires grad (a TorchScript module saved with its parameters'
/// requires_grad off would train nothing).
void check_trainable(const torch::optim::Optimizer& optimizer, const torch::nn::Module& mirror);
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

/// initialize for a TorchScript module, at every level; `optimizer` holds parameters of the module
/// (amp::parameters(model)).
template <class Opt>
Initialized<torch::jit::Module, Opt> initialize(torch::jit::Module model, Opt optimizer, const Options& options) {
  detail::check_optimizer_type<Opt>();
  const Properties properties = options.resolve();
  auto [mirror, device] = detail::begin_initialize(model, options, properties);
  detail::check_trainable(optimizer, *mirror);
  Optimizer<Opt> patched(std::move(optimizer), {mirror.get()}, properties);  // masters copy the fp32 originals
  detail::cast_model(*mirror, properties);
  return {Model<torch::jit::Module>(std::move(model), mirror, properties, device), std::move(patched)};
}

/// Model-only initialize for a TorchScript module (evaluation and inference at an opt level).
Model<torch::jit::Module> initialize(torch::jit::Module model, const Options& options);

}  // namespace amp
