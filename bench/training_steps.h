#pragma once
// The two training steps the benchmarks compare: amp's, and the same math written by hand against LibTorch.

#include <amp/amp.h>
#include <torch/torch.h>

#include <memory>
#include <optional>
#include <vector>

#include "casting/autocast_adapter.h"

namespace bench {

// The amp training step every section times.
template <class Model, class Optimizer>
torch::Tensor amp_step(Model& model, Optimizer& optimizer, const torch::Tensor& x, const torch::Tensor& y) {
  optimizer.zero_grad();
  auto loss = torch::nn::functional::cross_entropy(model(x), y);
  {
    auto scaled_loss = amp::scale_loss(loss, optimizer);
    scaled_loss.backward();
  }
  optimizer.step();
  return loss;
}

// The same math as amp's O1/O2 step, written directly against LibTorch: the casts of amp::AutocastGuard (O1)
// or a cast model with hand-kept fp32 masters and fp32 BatchNorm (O2), loss * scale, ATen's fused unscale +
// inf check, one host read, a conditional step (the scale halves on overflow) and the masters copied back.
template <class Net>
struct HandWritten {
  Net net;
  std::vector<torch::Tensor> lp_params, masters, fp32_params;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  bool o2;
  c10::ScalarType dtype;
  torch::Device device;
  double scale = 65536.0;
  amp::CastLists lists = amp::CastLists::kApex;  // O1: the lists the hand loop's casts follow
  explicit HandWritten(bool o2_, bool adam = false, c10::ScalarType dtype_ = torch::kBFloat16,
                       torch::Device device_ = torch::kCPU)
      : o2(o2_), dtype(dtype_), device(device_) {
    net->to(device);
    std::vector<torch::Tensor> stepped;
    if (o2) {
      for (auto& m : net->modules(true)) {
        const bool bn = amp::is_batchnorm(*m);
        for (auto& p : m->parameters(false)) {
          if (bn) {
            fp32_params.push_back(p), stepped.push_back(p);
          } else {
            masters.push_back(p.detach().clone().requires_grad_(true));
            p.set_data(p.detach().to(dtype));
            lp_params.push_back(p), stepped.push_back(masters.back());
          }
        }
        if (!bn) for (auto& b : m->buffers(false)) b.set_data(b.to(dtype));
      }
    } else {
      for (auto& p : net->parameters()) fp32_params.push_back(p), stepped.push_back(p);
    }
    if (adam) optimizer = std::make_unique<torch::optim::Adam>(stepped, torch::optim::AdamOptions(1e-4));
    else optimizer = std::make_unique<torch::optim::SGD>(stepped, torch::optim::SGDOptions(0.01).momentum(0.9));
  }
  void step(const torch::Tensor& x, const torch::Tensor& y) {
    for (auto& p : lp_params) p.mutable_grad() = torch::Tensor();
    optimizer->zero_grad();
    torch::Tensor out;
    if (o2) {
      out = net(x.to(dtype)).to(torch::kFloat);
    } else {
      amp::AutocastGuard casts(device.type(), dtype, lists);
      out = net(x);
    }
    (torch::nn::functional::cross_entropy(out.to(torch::kFloat), y) * scale).backward();
    std::vector<torch::Tensor> grads;
    for (size_t i = 0; i < masters.size(); ++i) {
      masters[i].mutable_grad() = lp_params[i].grad().to(torch::kFloat);
      grads.push_back(masters[i].grad());
    }
    for (auto& p : fp32_params) grads.push_back(p.grad());
    auto found_inf = torch::zeros({1}, torch::TensorOptions(device));
    at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, torch::full({1}, 1.0 / scale, found_inf.options()));
    if (found_inf.item<float>() == 0.0f) {
      optimizer->step();
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < masters.size(); ++i) lp_params[i].copy_(masters[i]);
    } else {
      scale /= 2;
    }
  }
};

// bench/python_amp.py's loop, op for op, in C++: torch.amp's O1 (ATen's autocast around the forward, amp::GradScaler)
// with a dtype, plain LibTorch (no autocast, scaler disabled) without one. amp's only part is the GradScaler.
template <class Net>
struct TorchAmpStep {
  Net net;
  torch::optim::SGD sgd{net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9)};
  std::optional<c10::ScalarType> dtype;
  amp::GradScaler scaler;
  explicit TorchAmpStep(std::optional<c10::ScalarType> dtype_)
      : dtype(dtype_), scaler(amp::GradScalerOptions().enabled(dtype_.has_value())) {}
  void step(const torch::Tensor& x, const torch::Tensor& y) {
    sgd.zero_grad();
    torch::Tensor out;
    if (dtype) {
      amp::detail::autocast::NativeAutocastGuard autocast(x.device().type(), *dtype);
      out = net->forward(x);
    } else {
      out = net->forward(x);
    }
    scaler.scale(torch::nn::functional::cross_entropy(out.to(torch::kFloat), y)).backward();
    scaler.step(sgd);
    scaler.update();
  }
};

}  // namespace bench
