#pragma once
// Python's torch.optim arithmetic for amp's own code: NOTE [LibTorch's optimizers on low-precision parameters] in
// python_steps.cpp. amp::Optimizer<SGD / Adam / AdamW> (amp/optimizer.h) and the fused optimizers' per-op route on
// bf16 / fp16 parameters step with it.

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace amp::detail {

/// A number as Python passes it to a tensor method: a wrapped number, which the op takes in its compute dtype
/// (where C++'s Scalar overloads round it to the tensor's dtype first).
at::Tensor python_number(double value);

struct PythonAdamHyperparameters {
  double lr, beta1, beta2, weight_decay, eps;
  bool decoupled;  // AdamW
};

/// One parameter's step of torch.optim.adam's _single_tensor_adam (AdamW: decoupled), op for op; `step` is the
/// state's step count, this step included; max_exp_avg_sq: amsgrad's (nullptr: no amsgrad).
void adam_step_as_python(at::Tensor& p, at::Tensor grad, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                         at::Tensor* max_exp_avg_sq, int64_t step, const PythonAdamHyperparameters& h);

}  // namespace amp::detail
