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
//
// This header holds initialize for them; the patched model, parameters and freeze_batchnorm are in
// <amp/torchscript_model.h>.

#include <utility>

#include "amp/initialize.h"
#include "amp/torchscript_model.h"

namespace amp {

namespace detail {
/// Checks a TorchScript module for initialize and prepares its mirror (policy, checks, banner); returns the mirror
/// and the device the module lives on.
std::pair<std::shared_ptr<torch::nn::Module>, c10::DeviceType> begin_initialize(const torch::jit::Module& model,
                                                                                const Options& options,
                                                                                const Properties& properties);
/// Throws unless some parameter of `optimizer` requires grad (a TorchScript module saved with its parameters'
/// requires_grad off would train nothing).
void check_trainable(const torch::optim::Optimizer& optimizer, const torch::nn::Module& mirror);
}  // namespace detail

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
