#pragma once
// amp::initialize: Apex's `model, optimizer = amp.initialize(model, optimizer, opt_level=...)`.

#include <torch/nn/module.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/optimizer.h>

#include <type_traits>
#include <utility>

#include "amp/model.h"
#include "amp/optimizer.h"
#include "amp/options.h"

namespace amp {

/// The patched pair returned by initialize, in Apex's order:
///   auto [model, optimizer] = amp::initialize(net, std::move(sgd), amp::OptLevel::O2);
template <class Module, class Opt>
struct Initialized {
  Model<Module> model;
  Optimizer<Opt> optimizer;
};

namespace detail {
/// Checks the model (fp32 parameters and buffers, not initialized before, dtype computable on its
/// device), prints the banner at verbosity >= 1 and returns the device the model lives on.
c10::DeviceType check_model(torch::nn::Module& module, const Options& options, const Properties& properties);
/// Casts parameters and buffers to cast_model_type (BatchNorm kept fp32 when asked) and marks the
/// model initialized.
void cast_model(torch::nn::Module& module, const Properties& properties);
}  // namespace detail

/// Rewrites the model's parameters in place for the opt level, builds fp32 master weights when asked
/// and returns the patched model and optimizer. `model` is a module holder or a shared_ptr to a
/// module (the returned Model shares it); `optimizer` is any torch::optim optimizer, moved in.
template <class Module, class Opt>
Initialized<Module, Opt> initialize(Module model, Opt optimizer, const Options& options) {
  static_assert(std::is_base_of_v<torch::optim::Optimizer, Opt>,
                "amp::initialize: the optimizer must be a torch::optim optimizer (SGD, Adam, AdamW, ...)");
  static_assert(!std::is_base_of_v<OptimizerBase, Opt>,
                "amp::initialize: this optimizer is already an amp::Optimizer, returned by an earlier "
                "amp::initialize. Pass each optimizer through amp::initialize once.");
  TORCH_CHECK(!(std::is_base_of_v<torch::optim::LBFGS, Opt>),
              "amp::initialize: LBFGS needs a closure in step(), and amp does not support closure use with "
              "optimizers (as Apex). Use an optimizer without closures (SGD, Adam, AdamW, RMSprop, Adagrad).");
  const Properties properties = options.resolve();
  auto module = detail::module_pointer(model);
  TORCH_CHECK(module != nullptr, "amp::initialize: the model is empty (a default-constructed holder or null pointer).");
  const c10::DeviceType device = detail::check_model(*module, options, properties);
  Optimizer<Opt> patched(std::move(optimizer), *module, properties);  // masters copy the fp32 originals
  detail::cast_model(*module, properties);
  return {Model<Module>(std::move(model), properties, device), std::move(patched)};
}

/// Initializes at `level`'s defaults.
template <class Module, class Opt>
Initialized<Module, Opt> initialize(Module model, Opt optimizer, OptLevel level) {
  return initialize(std::move(model), std::move(optimizer), Options(level));
}

}  // namespace amp
