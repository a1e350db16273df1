#pragma once
// The patched model: the module's forward with the opt level's casts around it.

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "amp/autocast_guard.h"
#include "amp/batchnorm.h"
#include "amp/precision_policy.h"
#include "amp/properties.h"

namespace amp {
namespace detail {

template <class T>
struct is_shared_ptr : std::false_type {};
template <class T>
struct is_shared_ptr<std::shared_ptr<T>> : std::true_type {};

/// Returns the module a holder (TORCH_MODULE type, Sequential, ...) or a shared_ptr points to.
template <class Module>
auto module_pointer(const Module& module) {
  if constexpr (is_shared_ptr<Module>::value) {
    return module;
  } else {
    return module.ptr();
  }
}

inline at::Tensor cast_floating(const at::Tensor& t, c10::ScalarType dtype) {
  return t.defined() && t.is_floating_point() && t.scalar_type() != dtype ? t.to(dtype) : t;
}

/// Casts floating tensors (and vectors of them) to `dtype`; passes anything else through untouched.
template <class T>
decltype(auto) cast_input(T&& value, std::optional<c10::ScalarType> dtype) {
  using D = std::decay_t<T>;
  if constexpr (std::is_same_v<D, at::Tensor>) {
    return dtype ? cast_floating(value, *dtype) : at::Tensor(value);
  } else if constexpr (std::is_same_v<D, std::vector<at::Tensor>>) {
    std::vector<at::Tensor> out(value.begin(), value.end());
    if (dtype) for (auto& t : out) t = cast_floating(t, *dtype);
    return out;
  } else {
    return std::forward<T>(value);
  }
}

template <class T, class = void>
struct is_tuple_like : std::false_type {};
template <class T>
struct is_tuple_like<T, std::void_t<decltype(std::tuple_size<T>::value)>> : std::true_type {};

/// Casts floating tensors in an output (a tensor, a vector of tensors, tuples and pairs of outputs,
/// recursively); anything else passes through.
template <class T>
T cast_result(T value, c10::ScalarType dtype) {
  if constexpr (std::is_same_v<T, at::Tensor>) {
    return cast_floating(value, dtype);
  } else if constexpr (std::is_same_v<T, std::vector<at::Tensor>>) {
    for (auto& t : value) t = cast_floating(t, dtype);
    return value;
  } else if constexpr (is_tuple_like<T>::value) {
    std::apply([dtype](auto&... elements) { ((elements = cast_result(std::move(elements), dtype)), ...); }, value);
    return value;
  } else {
    return value;
  }
}

/// Returns the model's float16/bfloat16 parameters and buffers with their names (what initialize cast).
std::vector<std::pair<std::string, at::Tensor>> low_precision_tensors(torch::nn::Module& module);
/// Throws if one of them holds fp32 bytes: torch::load into a cast model (see amp::load_weights).
void check_low_precision_tensors(const std::vector<std::pair<std::string, at::Tensor>>& tensors);
/// Throws if a parameter of `module` holds no values (its ZeRO stage-3 optimizer keeps them in shards) and this
/// forward does not gather them (it does not run through the DistributedDataParallel). One load where no stage-3
/// sharding exists.
void check_parameters_gathered(const torch::nn::Module& module);

}  // namespace detail

/// The patched model returned by amp::initialize. model(args...) and model.forward(args...) run the
/// module's forward with the level's casts: floating inputs cast to cast_model_type (O0/O2/O3), per-op
/// casts inside the forward (O1), floating outputs cast to cast_model_outputs. model-> and *model
/// reach the module itself, without casts. Copies share the module.
template <class Module>
class Model {
 public:
  Model(Module module, const Properties& properties, c10::DeviceType device)
      : module_(std::move(module)),
        properties_(properties),
        device_(device),
        float16_bn_statistics_(detail::float16_batchnorm_statistics(*module_pointer())),
        low_precision_tensors_(detail::low_precision_tensors(*module_pointer())),
        policy_(detail::precision_policy_of(*module_pointer())) {}

  /// Runs the module's forward with the opt level's casts.
  template <class... Args>
  auto forward(Args&&... args) {
    std::optional<AutocastGuard> casts;
    std::optional<c10::ScalarType> input_dtype;
    detail::PrecisionPolicyGuard policy(policy_);  // fp32 islands (amp/precision_policy.h); inactive without
    if (properties_.enabled) {
      if (properties_.patch_torch_functions) casts.emplace(device_, properties_.low_precision_dtype, properties_.cast_lists);
      input_dtype = properties_.cast_model_type;
      detail::check_low_precision_tensors(low_precision_tensors_);  // a few loads per tensor, no data read
    }
    detail::check_parameters_gathered(*module_pointer());
    auto output = impl().forward(detail::cast_input(std::forward<Args>(args), input_dtype)...);
    if (!properties_.enabled) return output;
    if (!float16_bn_statistics_.empty() && impl().is_training()) detail::check_batchnorm_statistics(float16_bn_statistics_);
    return detail::cast_result(std::move(output), properties_.cast_model_outputs);
  }

  template <class... Args>
  auto operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  /// Sets training mode on the module, keeping layers frozen with amp::freeze_batchnorm in eval mode.
  void train(bool on = true) {
    impl().train(on);
    detail::keep_frozen_layers_frozen(impl());
  }
  /// Sets evaluation mode on the module.
  void eval() { train(false); }
  /// Returns whether the module is in training mode.
  bool is_training() const { return module_pointer()->is_training(); }

  /// Returns the module itself (no casts).
  auto operator->() const { return module_pointer().get(); }
  auto& operator*() const { return *module_pointer(); }
  /// Returns the module as it was passed to initialize (holder or shared_ptr, sharing the module).
  const Module& module() const noexcept { return module_; }
  /// Returns the resolved properties.
  const Properties& properties() const noexcept { return properties_; }

 private:
  auto module_pointer() const { return detail::module_pointer(module_); }
  auto& impl() { return *module_pointer(); }

  Module module_;
  Properties properties_;
  c10::DeviceType device_;
  std::vector<at::Tensor> float16_bn_statistics_;  // O3 + float16 only: checked after training forwards
  std::vector<std::pair<std::string, at::Tensor>> low_precision_tensors_;  // checked before each forward
  std::shared_ptr<detail::PrecisionPolicy> policy_;  // the model's fp32 islands, or null
};

}  // namespace amp
