#pragma once
// amp::initialize: Apex's `model, optimizer = amp.initialize(model, optimizer, opt_level=...)`.

#include <torch/nn/module.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/optimizer.h>

#include <memory>
#include <tuple>
#include <type_traits>
#include <vector>
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

/// The patched models and optimizers of a multi-model initialize, each tuple in the order given:
///   auto [models, optimizers] = amp::initialize(std::tuple(netD, netG), std::tuple(std::move(optD), std::move(optG)), options);
///   auto& [modelD, modelG] = models;
///   auto& [optimizerD, optimizerG] = optimizers;
template <class Models, class Optimizers>
struct InitializedMany {
  Models models;
  Optimizers optimizers;
};

namespace detail {
/// Checks the model (fp32 parameters and buffers, not initialized before, dtype computable on its
/// device), prints the banner at verbosity >= 1 and returns the device the model lives on.
c10::DeviceType check_model(torch::nn::Module& module, const Options& options, const Properties& properties);
/// Returns whether `module` went through initialize already.
bool already_initialized(const torch::nn::Module& module);
/// Casts parameters and buffers to cast_model_type (BatchNorm kept fp32 when asked) and marks the
/// model initialized.
void cast_model(torch::nn::Module& module, const Properties& properties);

inline Properties quiet(Properties p) {
  p.verbosity = 0;  // one banner per initialize call
  return p;
}

/// What initialize accepts as an optimizer, checked at compile time where it can be.
template <class Opt>
void check_optimizer_type() {
  static_assert(std::is_base_of_v<torch::optim::Optimizer, Opt>,
                "amp::initialize: the optimizer must be a torch::optim optimizer (SGD, Adam, AdamW, ...)");
  static_assert(!std::is_base_of_v<OptimizerBase, Opt>,
                "amp::initialize: this optimizer is already an amp::Optimizer, returned by an earlier "
                "amp::initialize. Pass each optimizer through amp::initialize once.");
  TORCH_CHECK(!(std::is_base_of_v<torch::optim::LBFGS, Opt>),
              "amp::initialize: LBFGS needs a closure in step(), and amp does not support closure use with "
              "optimizers (as Apex). Use an optimizer without closures (SGD, Adam, AdamW, RMSprop, Adagrad).");
}

template <class... Modules, size_t... I>
std::tuple<Model<Modules>...> make_models(std::tuple<Modules...> models, const Properties& properties,
                                          const std::vector<c10::DeviceType>& devices, std::index_sequence<I...>) {
  return std::tuple<Model<Modules>...>(Model<Modules>(std::move(std::get<I>(models)), properties, devices[I])...);
}
}  // namespace detail

/// Rewrites the model's parameters in place for the opt level, builds fp32 master weights when asked
/// and returns the patched model and optimizer. `model` is a module holder or a shared_ptr to a
/// module (the returned Model shares it); `optimizer` is any torch::optim optimizer, moved in.
template <class Module, class Opt>
Initialized<Module, Opt> initialize(Module model, Opt optimizer, const Options& options) {
  detail::check_optimizer_type<Opt>();
  const Properties properties = options.resolve();
  auto module = detail::module_pointer(model);
  TORCH_CHECK(module != nullptr, "amp::initialize: the model is empty (a default-constructed holder or null pointer).");
  const c10::DeviceType device = detail::check_model(*module, options, properties);
  detail::resolve_precision_policy({module.get()}, properties);
  Optimizer<Opt> patched(std::move(optimizer), {module.get()}, properties);  // masters copy the fp32 originals
  detail::cast_model(*module, properties);
  return {Model<Module>(std::move(model), properties, device), std::move(patched)};
}

/// Initializes several models and optimizers together (Apex's
/// `[netD, netG], [optD, optG] = amp.initialize([netD, netG], [optD, optG], ...)`): the optimizers share
/// one bank of num_losses loss scalers, so `ScaleLossOptions().loss_id(i)` names the same scaler whichever
/// optimizer scale_loss is given. Each optimizer may hold parameters of any of the models.
template <class... Modules, class... Opts>
InitializedMany<std::tuple<Model<Modules>...>, std::tuple<Optimizer<Opts>...>> initialize(
    std::tuple<Modules...> models, std::tuple<Opts...> optimizers, const Options& options) {
  static_assert(sizeof...(Modules) > 0 && sizeof...(Opts) > 0, "amp::initialize: pass at least one model and optimizer");
  static_assert((std::is_base_of_v<torch::optim::Optimizer, Opts> && ...),
                "amp::initialize: every optimizer must be a torch::optim optimizer");
  static_assert(!(std::is_base_of_v<OptimizerBase, Opts> || ...),
                "amp::initialize: an optimizer is already an amp::Optimizer; pass each through amp::initialize once.");
  TORCH_CHECK(!(std::is_base_of_v<torch::optim::LBFGS, Opts> || ...),
              "amp::initialize: LBFGS needs a closure in step(), and amp does not support closure use with "
              "optimizers (as Apex). Use an optimizer without closures (SGD, Adam, AdamW, RMSprop, Adagrad).");
  const Properties properties = options.resolve();
  const auto pointers = std::apply([](const auto&... m) { return std::vector<std::shared_ptr<torch::nn::Module>>{
                                                              detail::module_pointer(m)...}; }, models);
  std::vector<torch::nn::Module*> modules;
  std::vector<c10::DeviceType> devices;
  for (const auto& m : pointers) {
    TORCH_CHECK(m != nullptr, "amp::initialize: model ", modules.size(), " is empty.");
    for (auto* seen : modules) {
      TORCH_CHECK(seen != m.get(), "amp::initialize: the same model appears twice in the models tuple.");
    }
    devices.push_back(detail::check_model(*m, options, devices.empty() ? properties : detail::quiet(properties)));
    modules.push_back(m.get());
  }
  detail::resolve_precision_policy(modules, properties);
  auto scalers = std::make_shared<std::vector<LossScaler>>(
      static_cast<size_t>(properties.num_losses),
      LossScaler(properties));
  auto patched = std::apply(
      [&](auto&... opt) {
        return std::tuple<Optimizer<Opts>...>(Optimizer<Opts>(std::move(opt), modules, properties, scalers)...);
      },
      optimizers);
  for (auto* m : modules) detail::cast_model(*m, properties);
  auto wrapped = detail::make_models(std::move(models), properties, devices, std::index_sequence_for<Modules...>{});
  return {std::move(wrapped), std::move(patched)};
}

/// Initializes a model alone, for evaluation and inference at an opt level (Apex's `optimizers=None`).
///
/// Example:
///   auto model = amp::initialize(net, amp::Options("O2"));
///   auto logits = model(images);   // bf16/fp16 compute, fp32 logits
template <class Module>
Model<Module> initialize(Module model, const Options& options) {
  const Properties properties = options.resolve();
  auto module = detail::module_pointer(model);
  TORCH_CHECK(module != nullptr, "amp::initialize: the model is empty (a default-constructed holder or null pointer).");
  const c10::DeviceType device = detail::check_model(*module, options, properties);
  detail::resolve_precision_policy({module.get()}, properties);
  detail::cast_model(*module, properties);
  return Model<Module>(std::move(model), properties, device);
}

/// Initializes a model alone at `level`'s defaults.
template <class Module>
Model<Module> initialize(Module model, OptLevel level) {
  return initialize(std::move(model), Options(level));
}

/// Initializes at `level`'s defaults.
template <class Module, class Opt>
Initialized<Module, Opt> initialize(Module model, Opt optimizer, OptLevel level) {
  return initialize(std::move(model), std::move(optimizer), Options(level));
}

}  // namespace amp
