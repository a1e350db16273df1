#pragma once
// What every fused optimizer's step does the same way (fused_optimizers.cpp, fused_muon.cpp): check everything
// before writing anything, evaluate a closure, find what one parameter's update reads and writes (the parameter,
// or a lean master's fp32 value), and run an update on moments held in a state format through fp32.

#include <ATen/Functions.h>
#include <ATen/core/Tensor.h>
#include <c10/core/GradMode.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/serialize.h>
#include <torch/version.h>

#include <memory>
#include <vector>

#include "optim/fused_step_context.h"
#include "optim/lean_masters.h"
#include "optim/state_format.h"

namespace amp::optim::detail {

inline void check_dense(const at::Tensor& grad, const char* name, size_t group, size_t index) {
  TORCH_CHECK(!grad.is_sparse(), name, " does not support sparse gradients (parameter ", index, " of param group ",
              group, "). Build the layer with dense gradients (e.g. Embedding without sparse(true)).");
}

// Checks every group's options and every gradient before anything is updated, so an error leaves the
// optimizer and the parameters as they were.
template <class CheckOptions>
void check_all(const torch::optim::Optimizer& opt, const char* name, CheckOptions check_options) {
  for (size_t g = 0; g < opt.param_groups().size(); ++g) {
    const auto& group = opt.param_groups()[g];
    check_options(group.options(), g);
    for (size_t i = 0; i < group.params().size(); ++i) {
      const at::Tensor& grad = group.params()[i].grad();
      if (grad.defined()) check_dense(grad, name, g, i);
    }
  }
}

// LibTorch's optimizers evaluate a closure with gradients on before stepping.
inline torch::Tensor evaluate(const torch::optim::Optimizer::LossClosure& closure) {
  if (!closure) return {};
  at::AutoGradMode enable_grad(true);
  return closure();
}

// A raw-pointer update is a write like any in-place op: version counters must say so (amp's masters,
// autograd's saved-tensor checks and weight caches read them).
inline void bump(at::TensorList written) {
  for (const auto& t : written) {
    if (t.defined()) t.unsafeGetTensorImpl()->bump_version();
  }
}

// After an optimizer of amp's own options type loaded `archive`: LibTorch 1.13 reads the saved groups' options but does
// not install them, so the groups' step counts (FusedLAMB) and changed hyperparameters would restart. Installs them, as
// LibTorch 2.x does (a no-op there).
template <class Options>
void install_saved_group_options(torch::serialize::InputArchive& archive,
                                 std::vector<torch::optim::OptimizerParamGroup>& groups, const char* where) {
#if TORCH_VERSION_MAJOR < 2
  torch::serialize::InputArchive groups_archive;
  archive.read("param_groups", groups_archive);
  std::vector<std::pair<std::vector<std::string>, std::unique_ptr<torch::optim::OptimizerOptions>>> saved;
  torch::optim::detail::serialize<Options>(groups_archive, saved);
  TORCH_CHECK(saved.size() == groups.size(), where, ": the archive has ", saved.size(), " param groups, this optimizer ",
              groups.size(), ".");
  for (size_t i = 0; i < saved.size(); ++i) groups[i].set_options(std::move(saved[i].second));
#else
  (void)archive, (void)groups, (void)where;
#endif
}

// What one parameter's update reads and writes: the parameter and its gradient, or, for a bfloat16 parameter with a
// lean master, its rebuilt fp32 value and its gradient in fp32, stored back by finish() (NOTE [Lean masters]).
// Optimizer state stays keyed by the parameter itself and is created like the fp32 value (fp32).
struct Work {
  at::Tensor param, grad;
  std::shared_ptr<amp::detail::LeanMasters> lean;
  size_t index = 0;
  void finish() const {
    if (lean) lean->store(index, param);
  }
};
using LeanTable = std::shared_ptr<amp::detail::LeanMasters>;

inline Work work_for(const at::Tensor& p, const LeanTable& lean) {
  if (lean) {
    if (auto found = amp::detail::find_lean(p); found && found->first == lean) {
      return {lean->value(found->second), p.grad().to(at::kFloat), lean, found->second};
    }
  }
  return {p, p.grad(), nullptr, 0};
}

// A taken step's stores, in one numbering of stochastic rounding's draws; the generator moves past it however the
// step ends (NOTE [Lean masters]). `on_device`: the step's context where its flag stays on the device, whose skip
// the stores then keep on the device too, the host's counter going back when it learns of it (NOTE [Lean masters on
// the device]).
class LeanStepGuard {
 public:
  explicit LeanStepGuard(const LeanTable& lean, amp::detail::FusedStepContext* on_device = nullptr) : lean_(lean.get()) {
    if (!lean_) return;
    lean_->begin_step(on_device ? on_device->found_inf() : at::Tensor());
    if (on_device) on_device->rewind_lean_draws_on_skip();
  }
  ~LeanStepGuard() {
    if (lean_) lean_->end_step();
  }
  LeanStepGuard(const LeanStepGuard&) = delete;
  LeanStepGuard& operator=(const LeanStepGuard&) = delete;

 private:
  amp::detail::LeanMasters* lean_;
};

// The format a step stores moments in: the optimizer's, or LibTorch's fp32 for one used without amp::initialize.
inline std::shared_ptr<amp::detail::StateFormat> format_for(const std::shared_ptr<amp::detail::StateFormat>& format) {
  return format ? format : std::make_shared<amp::detail::StateFormat>(amp::OptimizerStateFormat::kFp32, 0);
}

struct StoredMoment {
  at::Tensor* stored;
  amp::detail::Moment moment;
  int slot;  // its draws (StateFormat::draws)
};

// Encodes fp32 `values` (one per moment) into the stored moments. `on_device`: bf16's draws counted on the stepped
// tensor's device, and, with `skipped` (the device's flag, as a 0-dim bool), each stored tensor keeps its bytes where
// it is set (NOTE [Stored moments on the device] in fused_optimizers.cpp).
inline void store_moments(const std::vector<StoredMoment>& moments, const std::vector<at::Tensor>& values,
                          amp::detail::StateFormat& format, const amp::detail::StateFormat::Place& place, bool on_device,
                          const at::Tensor& skipped = at::Tensor()) {
  for (size_t i = 0; i < moments.size(); ++i) {
    const StoredMoment& m = moments[i];
    const auto draws = on_device ? format.draws_on(place, m.slot, values[i].device()) : format.draws(place, m.slot);
    if (!skipped.defined()) {
      amp::detail::encode_moment(values[i], *m.stored, m.moment, draws);
      continue;
    }
    const at::Tensor taken = at::empty_like(*m.stored);
    amp::detail::encode_moment(values[i], taken, m.moment, draws);
    m.stored->copy_(at::where(skipped, *m.stored, taken));
  }
}

// Any route but the CPU loops': the moments decoded to fp32, `step` on them (the fp32 route's per-op arithmetic),
// encoded back (store_moments; `found_inf`: the device's flag, which `step` takes too).
template <class Step>
void through_fp32(const std::vector<StoredMoment>& moments, const at::Tensor& like, amp::detail::StateFormat& format,
                  const amp::detail::StateFormat::Place& place, Step step, const at::Tensor& found_inf = at::Tensor()) {
  std::vector<at::Tensor> values;
  for (const auto& m : moments) values.push_back(amp::detail::decode_moment(*m.stored, like.sizes(), m.moment));
  step(values);
  store_moments(moments, values, format, place, found_inf.defined(), found_inf.defined() ? found_inf.ne(0) : at::Tensor());
}

}  // namespace amp::optim::detail
