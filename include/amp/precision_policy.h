#pragma once
// The precision policy: modules kept in fp32 at every level (fp32 islands), by name and by type.
//
// Options::keep_fp32({"head", "*.norm"}) and Options::keep_fp32_type<torch::nn::LayerNormImpl>() name the
// modules; initialize keeps their parameters and floating buffers fp32 (at O2 they are their own masters) and
// every op that reads one of those tensors runs in fp32: its other floating inputs are cast up, its output stays
// fp32, and the next op that reads a low-precision parameter casts it down. The user's forward is not edited:
// see NOTE [Precision policy dispatch key] in src/casting/precision_policy.cpp.

#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Type.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <typeinfo>
#include <vector>

namespace torch::nn {
class Module;
}

namespace amp {

class OptimizerBase;

/// A module type for keep_fp32_types: its name (LibTorch's, such as "LayerNorm", or the demangled C++ name of
/// a user's module) and a test of a module against it. A type read from a config file holds the name alone;
/// initialize looks it up among LibTorch's modules.
struct ModuleType {
  std::string name;
  std::function<bool(const torch::nn::Module&)> matches = {};

  /// The type ModuleImpl and every type derived from it (LibTorch's torch::nn::LayerNormImpl is "LayerNorm").
  template <class ModuleImpl>
  static ModuleType of() {
    std::string name = c10::demangle(typeid(ModuleImpl).name());
    constexpr std::string_view prefix = "torch::nn::", suffix = "Impl";
    if (name.rfind(prefix, 0) == 0 && name.size() > prefix.size() + suffix.size() &&
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
      name = name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
    }
    return {std::move(name), [](const torch::nn::Module& m) { return dynamic_cast<const ModuleImpl*>(&m) != nullptr; }};
  }
};

/// Returns the modules kept in fp32 for the models `optimizer` trains, one "<qualified name> (<reason>)" per
/// module in model order, at every level: the reason is the first of "keep_fp32", "keep_fp32_type",
/// "keep_batchnorm_fp32" (BatchNorm layers the level keeps fp32, frozen ones included) and "auto_fp32" (moved
/// there during training by Options::auto_fp32).
///
/// Example:
///   for (const auto& line : amp::fp32_modules(optimizer)) std::cout << line << "\n";   // "head (keep_fp32)"
std::vector<std::string> fp32_modules(const OptimizerBase& optimizer);

struct Properties;

namespace detail {

class PrecisionPolicy;

/// Resolves keep_fp32 / keep_fp32_types against the models and records each one's precision policy
/// (src/casting/precision_policy.cpp); throws on a pattern or type that matches no module. amp::initialize calls it.
void resolve_precision_policy(const std::vector<torch::nn::Module*>& models, const Properties& properties);

/// Returns the policy initialize made for `module` (a model passed to initialize), or null.
std::shared_ptr<PrecisionPolicy> precision_policy_of(const torch::nn::Module& module);

/// A RAII, thread local (!) guard that runs the ops of its scope under `policy` (amp::Model's forward uses
/// it). Does nothing for a null policy or one without fp32 islands.
class PrecisionPolicyGuard {
 public:
  explicit PrecisionPolicyGuard(const std::shared_ptr<PrecisionPolicy>& policy);
  ~PrecisionPolicyGuard();
  PrecisionPolicyGuard(const PrecisionPolicyGuard&) = delete;
  PrecisionPolicyGuard& operator=(const PrecisionPolicyGuard&) = delete;
  PrecisionPolicyGuard(PrecisionPolicyGuard&&) = delete;
  PrecisionPolicyGuard& operator=(PrecisionPolicyGuard&&) = delete;

 private:
  std::shared_ptr<PrecisionPolicy> previous_;
  std::optional<c10::impl::IncludeDispatchKeyGuard> key_;
  bool engaged_ = false;
};

/// Returns the policy ops of this thread run under now (amp::checkpoint records it for its recompute).
std::shared_ptr<PrecisionPolicy> current_precision_policy();

}  // namespace detail
}  // namespace amp
