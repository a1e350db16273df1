// NOTE [LibTorch's optimizers on low-precision parameters]
// LibTorch's SGD, Adam and AdamW multiply by their hyperparameters with the Scalar overloads (buf.mul_(momentum),
// exp_avg_sq.mul_(beta2), ...): aten::mul_.Scalar rounds the number to the tensor's dtype first, so on bfloat16 state
// the momentum 0.9 becomes 0.8984375 and Adam's beta2 0.999 becomes 1.0 (the second moment never decays). Python's
// torch.optim passes those numbers as wrapped numbers (aten::mul_.Tensor) and multiplies by them in fp32. Every C++
// program stepping bf16 or fp16 parameters with LibTorch's optimizers (amp's O3, a model cast by hand) therefore
// trains with other hyperparameters than the Python script it ports. Where some parameter with a gradient is bf16 or
// fp16, amp::Optimizer<SGD / Adam / AdamW> steps with Python's torch.optim code instead (_single_tensor_sgd,
// _single_tensor_adam), op for op: the same bits (tests/optimizer_test.cpp against torch.optim at test time).
// fp32 parameters take LibTorch's own step, whose bits equal Python's for SGD (Adam's differ by torch.optim's
// lerp in the first moment: ulps, as documented in docs/porting.md).

#include <ATen/ScalarOps.h>
#include <c10/core/GradMode.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <cmath>

#include "amp/optimizer.h"
#include "optim/optimizer_state_key.h"
#include "optim/python_steps.h"

namespace amp::detail {
namespace {

bool steps_low_precision(const torch::optim::Optimizer& optimizer) {
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      if (p.grad().defined() && (p.scalar_type() == at::kBFloat16 || p.scalar_type() == at::kHalf)) return true;
    }
  }
  return false;
}

}  // namespace

at::Tensor python_number(double value) { return at::native::wrapped_scalar_tensor(value); }

void adam_step_as_python(at::Tensor& p, at::Tensor grad, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                         at::Tensor* max_exp_avg_sq, int64_t step, const PythonAdamHyperparameters& h) {
  if (h.weight_decay != 0) {
    if (h.decoupled) {
      p.mul_(python_number(1 - h.lr * h.weight_decay));
    } else {
      grad = grad.add(p, h.weight_decay);
    }
  }
  exp_avg.lerp_(grad, 1 - h.beta1);
  exp_avg_sq.mul_(python_number(h.beta2)).addcmul_(grad, grad, 1 - h.beta2);
  const auto steps = static_cast<double>(step);
  const double bias_correction1 = 1 - std::pow(h.beta1, steps), bias_correction2 = 1 - std::pow(h.beta2, steps);
  const double step_size = h.lr / bias_correction1, bias_correction2_sqrt = std::pow(bias_correction2, 0.5);
  at::Tensor second = exp_avg_sq;
  if (max_exp_avg_sq != nullptr) {
    at::maximum_out(*max_exp_avg_sq, *max_exp_avg_sq, exp_avg_sq);
    second = *max_exp_avg_sq;
  }
  const auto denom = second.sqrt().div(python_number(bias_correction2_sqrt)).add_(python_number(h.eps));
  p.addcdiv_(exp_avg, denom, -step_size);
}

namespace {

// torch.optim.adam's _single_tensor_adam (decoupled: AdamW), op for op, on LibTorch's state.
template <class Options, class State>
void adam_as_python(torch::optim::Optimizer& optimizer, bool decoupled) {
  torch::NoGradGuard no_grad;
  for (auto& group : optimizer.param_groups()) {
    const auto& options = static_cast<const Options&>(group.options());
    const PythonAdamHyperparameters h{options.lr(), std::get<0>(options.betas()), std::get<1>(options.betas()),
                                      options.weight_decay(), options.eps(), decoupled};
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      auto& slot = optimizer.state()[state_key(optimizer.state(), p)];
      if (!slot) {
        auto state = std::make_unique<State>();
        state->step(0);
        state->exp_avg(torch::zeros_like(p, at::MemoryFormat::Preserve));
        state->exp_avg_sq(torch::zeros_like(p, at::MemoryFormat::Preserve));
        if (options.amsgrad()) state->max_exp_avg_sq(torch::zeros_like(p, at::MemoryFormat::Preserve));
        slot = std::move(state);
      }
      auto& state = static_cast<State&>(*slot);
      state.step(state.step() + 1);
      auto exp_avg = state.exp_avg(), exp_avg_sq = state.exp_avg_sq(), max_exp_avg_sq = state.max_exp_avg_sq();
      adam_step_as_python(p, p.grad(), exp_avg, exp_avg_sq, options.amsgrad() ? &max_exp_avg_sq : nullptr,
                          state.step(), h);
    }
  }
}

}  // namespace

bool step_adam_as_python(torch::optim::Optimizer& optimizer, bool decoupled) {
  if (!steps_low_precision(optimizer)) return false;
  if (decoupled) {
    adam_as_python<torch::optim::AdamWOptions, torch::optim::AdamWParamState>(optimizer, true);
  } else {
    adam_as_python<torch::optim::AdamOptions, torch::optim::AdamParamState>(optimizer, false);
  }
  return true;
}

// torch.optim.sgd's _single_tensor_sgd, which is LibTorch's step but for the momentum's multiplication.
bool step_sgd_as_python(torch::optim::Optimizer& optimizer) {
  auto& sgd = static_cast<torch::optim::SGD&>(optimizer);
  if (!steps_low_precision(sgd)) return false;
  torch::NoGradGuard no_grad;
  for (auto& group : sgd.param_groups()) {
    const auto& options = static_cast<const torch::optim::SGDOptions&>(group.options());
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      auto d_p = p.grad().data();
      if (options.weight_decay() != 0) d_p = d_p.add(p.data(), options.weight_decay());
      if (options.momentum() != 0) {
        at::Tensor buf;
        auto& slot = sgd.state()[state_key(sgd.state(), p)];
        if (!slot) {
          buf = d_p.clone().detach();
          auto state = std::make_unique<torch::optim::SGDParamState>();
          state->momentum_buffer(buf);
          slot = std::move(state);
        } else {
          buf = static_cast<torch::optim::SGDParamState&>(*slot).momentum_buffer();
          buf.mul_(python_number(options.momentum())).add_(d_p, 1 - options.dampening());
        }
        d_p = options.nesterov() ? d_p.add(buf, options.momentum()) : buf;
      }
      p.data().add_(d_p, -1 * options.lr());
    }
  }
  return true;
}

}  // namespace amp::detail
