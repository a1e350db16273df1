// Options::auto_fp32: a module whose overflows the loss scale can't cure moves to fp32, and training goes on.
//
// Each unscaled backward reports to auto_fp32_after_backward. An overflow while the dynamic scale is at its floor
// (min_loss_scale, or 1: below that a smaller scale only shrinks gradients that were non-finite already) counts;
// `patience` of them arm a diagnosis of the next iteration (NOTE [Finding the module that overflows] in
// src/casting/precision_policy.cpp). If that iteration overflows again, the module the diagnosis blames (or, failing that,
// the overflow report's last module in model order) becomes an fp32 island: at O2 each of its fp32 masters becomes
// the parameter itself, with its optimizer state, so no value is rounded and nothing is lost; at O1 its ops run
// in fp32 from the next forward. The decision is part of the optimizer's torch::save archive.

#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <iostream>

#include "amp/optimizer.h"
#include "options/format.h"
#include "optim/master_weights.h"
#include "optim/optimizer_state_key.h"
#include "casting/precision_policy.h"

namespace amp {
namespace {

std::shared_ptr<torch::nn::Module> find_module(torch::nn::Module& root, const std::string& name) {
  for (const auto& item : root.named_modules("", /*include_self=*/false)) {
    if (item.key() == name) return item.value();
  }
  return nullptr;
}

// The module holding a parameter named "blocks.1.fc.weight": "blocks.1.fc".
std::string module_of(const std::string& parameter) {
  const auto dot = parameter.rfind('.');
  return dot == std::string::npos ? std::string() : parameter.substr(0, dot);
}

bool is_island(const detail::PrecisionPolicy& policy, const std::string& name) {
  for (const auto& k : policy.kept()) {
    if (k.name == name && k.reason != "keep_batchnorm_fp32") return true;
  }
  return false;
}

}  // namespace

void OptimizerBase::auto_fp32_after_backward(bool overflow, double loss_scale, double floor) {
  if (properties_.auto_fp32 <= 0) return;
  const auto models = this->models();
  auto disarm = [&] {
    for (const auto& m : models) {
      if (auto policy = detail::precision_policy_of(*m)) policy->disarm_diagnosis();
    }
    auto_fp32_armed_ = false;
  };
  if (!overflow || loss_scale > floor) {
    if (loss_scale > floor) auto_fp32_overflows_ = 0;
    if (auto_fp32_armed_) disarm();  // the diagnosed iteration did not overflow: nothing to blame yet
    return;
  }
  ++auto_fp32_overflows_;
  if (!auto_fp32_armed_) {
    if (auto_fp32_overflows_ < properties_.auto_fp32) return;
    for (const auto& m : models) {
      if (auto policy = detail::precision_policy_of(*m)) policy->arm_diagnosis();
    }
    auto_fp32_armed_ = true;
    return;
  }
  // This backward followed a diagnosed forward and overflowed again: find the module.
  std::optional<std::pair<size_t, std::string>> culprit;
  for (size_t k = 0; k < models.size() && !culprit; ++k) {
    if (auto policy = detail::precision_policy_of(*models[k])) {
      if (auto name = policy->diagnosed_module()) culprit.emplace(k, *name);
    }
  }
  if (!culprit && last_overflow_) {  // the report lists non-finite gradients in model order: the last is nearest the loss
    for (auto it = last_overflow_->parameters.rbegin(); it != last_overflow_->parameters.rend() && !culprit; ++it) {
      const std::string name = module_of(*it);
      for (size_t k = 0; k < models.size() && !culprit; ++k) {
        const auto policy = detail::precision_policy_of(*models[k]);
        if (policy && find_module(*models[k], name) && !is_island(*policy, name)) culprit.emplace(k, name);
      }
    }
  }
  disarm();
  if (!culprit) {
    if (properties_.verbosity >= 1) {
      std::cout << "amp: auto_fp32: the loss scale is at its floor (" << detail::format_float(loss_scale)
                << ") and gradients keep overflowing, but no module still in low precision produced the first "
                   "inf/NaN (the loss or the inputs may hold it). Trying again at the next overflow." << std::endl;
    }
    auto_fp32_overflows_ = properties_.auto_fp32 - 1;  // the next overflow re-arms
    return;
  }
  move_to_fp32(culprit->first, culprit->second);
  auto_fp32_overflows_ = 0;
  if (properties_.verbosity >= 1) {
    std::cout << "amp: auto_fp32: module '" << culprit->second << "' kept overflowing with the loss scale at its floor ("
              << detail::format_float(loss_scale) << "); it runs in fp32 from now on"
              << (properties_.master_weights ? " (its fp32 masters became its parameters)" : "")
              << ". Keep it there from the start with keep_fp32 = " << culprit->second << "." << std::endl;
  }
}

void OptimizerBase::move_to_fp32(size_t model, const std::string& name) {
  const auto models = this->models();
  TORCH_CHECK(model < models.size(), "amp::Optimizer: auto_fp32 names model ", model, " of a checkpoint, but this "
              "optimizer trains ", models.size(), " model(s). Resume with the models the checkpoint was saved with.");
  const auto module = find_module(*models[model], name);
  const auto policy = detail::precision_policy_of(*models[model]);
  TORCH_CHECK(module && policy, "amp::Optimizer: auto_fp32 moved module '", name, "' to fp32, but the model has no "
              "module of that name. Resume with the model the checkpoint was saved with.");
  if (is_island(*policy, name)) return;
  c10::NoGradGuard no_grad;
  torch::optim::Optimizer& opt = torch_optimizer();
  auto& state = opt.state();
  for (at::Tensor p : module->parameters(/*recurse=*/true)) {
    const auto master = detail::find_master(p);
    if (master && master->first == masters_) {
      at::Tensor m = master->first->master()[master->second];
      // The master's fp32 value becomes the parameter's (its storage, no copy), and the parameter takes the
      // master's place in param_groups, keyed optimizer state included. Where the model's weights were loaded
      // before this optimizer's checkpoint, torch::load left the checkpoint's fp32 bytes under the bf16 tensor:
      // those are the value.
      if (detail::holds_float32_bytes(p)) {
        at::Tensor value = at::empty({0}, p.options().dtype(at::kFloat));
        value.set_(p.storage(), 0, p.sizes(), p.strides());
        p.set_data(value.clone());
      } else {
        p.set_data(m.detach());
      }
      p.mutable_grad() = at::Tensor();
      for (auto& group : opt.param_groups()) {
        for (auto& q : group.params()) {
          if (q.unsafeGetTensorImpl() == m.unsafeGetTensorImpl()) q = p;
        }
      }
      if (auto it = state.find(detail::state_key(state, m)); it != state.end()) {
        auto moved = std::move(it->second);
        state.erase(it);
        state[detail::state_key(state, p)] = std::move(moved);
      }
    }
  }
  for (at::Tensor b : module->buffers(/*recurse=*/true)) {
    if (b.is_floating_point() && b.scalar_type() != at::kFloat) b.set_data(b.to(at::kFloat));
  }
  policy->keep(*module, name, "auto_fp32");
  sync_param_groups();  // the moved parameters are direct ones now; their masters are dropped
}

}  // namespace amp

namespace amp {

OptimizerBase::AutoFp32State OptimizerBase::auto_fp32_state() const {
  AutoFp32State state;
  const auto models = this->models();
  for (size_t k = 0; k < models.size(); ++k) {
    const auto policy = detail::precision_policy_of(*models[k]);
    if (!policy) continue;
    for (const auto& m : policy->kept()) {
      if (m.reason == "auto_fp32") state.moved.emplace_back(static_cast<int64_t>(k), m.name);
    }
  }
  state.overflows = auto_fp32_overflows_;
  state.armed = auto_fp32_armed_;
  return state;
}

void OptimizerBase::restore_auto_fp32_state(const AutoFp32State& state) {
  for (const auto& [model, name] : state.moved) {
    TORCH_CHECK(model >= 0, "amp::Optimizer: auto_fp32 names model ", model, " of a checkpoint; it is corrupt.");
    move_to_fp32(static_cast<size_t>(model), name);
  }
  auto_fp32_overflows_ = static_cast<int>(state.overflows);
  auto_fp32_armed_ = state.armed;
  for (const auto& m : models()) {
    if (auto policy = detail::precision_policy_of(*m)) {
      if (auto_fp32_armed_) policy->arm_diagnosis();
      else policy->disarm_diagnosis();
    }
  }
}

}  // namespace amp
