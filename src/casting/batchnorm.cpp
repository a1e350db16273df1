#include "amp/batchnorm.h"

#include <ATen/Functions.h>
#include <torch/nn/modules/batchnorm.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <vector>

#include "casting/jit_mirror.h"

namespace amp {
namespace {

// Frozen layers, held weakly: a module that dies leaves the registry at the next sweep.
// NOTE: a registry rather than a flag on the module, because anything stored in the module
// (a buffer, a parameter) would change its state_dict and break loading pretrained checkpoints.
std::mutex registry_mutex;
std::vector<std::weak_ptr<torch::nn::Module>> frozen_layers;

bool is_frozen_locked(const torch::nn::Module& module) {
  return std::any_of(frozen_layers.begin(), frozen_layers.end(),
                     [&](const auto& weak) { auto m = weak.lock(); return m.get() == &module; });
}

}  // namespace

bool is_batchnorm(const torch::nn::Module& module) {
  if (const auto* node = dynamic_cast<const detail::JitModuleNode*>(&module)) return node->is_batchnorm();
  return dynamic_cast<const torch::nn::BatchNorm1dImpl*>(&module) ||
         dynamic_cast<const torch::nn::BatchNorm2dImpl*>(&module) ||
         dynamic_cast<const torch::nn::BatchNorm3dImpl*>(&module);
}

bool is_frozen(const torch::nn::Module& module) {
  // A TorchScript layer's mark lives on its TorchScript object (NOTE [TorchScript mirror]).
  if (const auto* node = dynamic_cast<const detail::JitModuleNode*>(&module)) return node->frozen();
  std::lock_guard<std::mutex> lock(registry_mutex);
  return is_frozen_locked(module);
}

void freeze_batchnorm(torch::nn::Module& module) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  frozen_layers.erase(std::remove_if(frozen_layers.begin(), frozen_layers.end(),
                                     [](const auto& weak) { return weak.expired(); }),
                      frozen_layers.end());
  auto freeze = [&](const std::shared_ptr<torch::nn::Module>& m) {
    if (!is_batchnorm(*m)) return;
    m->eval();
    for (auto& p : m->parameters(/*recurse=*/false)) p.set_requires_grad(false);
    if (!is_frozen_locked(*m)) frozen_layers.push_back(m);
  };
  // modules() includes `module` itself, as a shared_ptr (Module derives enable_shared_from_this).
  for (const auto& m : module.modules(/*include_self=*/true)) freeze(m);
}

std::vector<at::Tensor> detail::float16_batchnorm_statistics(torch::nn::Module& module) {
  std::vector<at::Tensor> out;
  for (const auto& m : module.modules(/*include_self=*/true)) {
    if (!is_batchnorm(*m)) continue;
    for (const auto& b : m->buffers(/*recurse=*/false)) {
      if (b.scalar_type() == at::kHalf) out.push_back(b);
    }
  }
  return out;
}

void detail::check_batchnorm_statistics(const std::vector<at::Tensor>& statistics) {
  if (statistics.empty()) return;
  std::vector<at::Tensor> flat;
  for (const auto& s : statistics) flat.push_back(s.reshape({-1}));
  TORCH_CHECK(at::isfinite(at::cat(flat)).all().item<bool>(),
              "amp: a BatchNorm running statistic overflowed float16 in this forward: this opt level keeps "
              "BatchNorm in float16, where a running variance above 65504 is inf (pytorch #115500); an inf or NaN "
              "input does the same. Keep BatchNorm in fp32 with keep_batchnorm_fp32(true) (config: "
              "keep_batchnorm_fp32 = true), or use bfloat16, which has fp32's range. The layer's running "
              "statistics now hold inf or NaN: reload them before evaluating.");
}

void detail::keep_frozen_layers_frozen(torch::nn::Module& module) {
  for (const auto& m : module.modules(/*include_self=*/true)) {
    if (is_frozen(*m)) m->eval();
  }
}

}  // namespace amp
