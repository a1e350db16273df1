#pragma once
// The small networks the tests train: an MLP and a conv -> BatchNorm net.

#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

namespace amp_test {

/// fc1 -> relu -> fc2.
struct MlpImpl : torch::nn::Module {
  MlpImpl(int in = 8, int hidden = 16, int out = 4)
      : fc1(register_module("fc1", torch::nn::Linear(in, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, out))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Mlp);

/// conv -> BatchNorm -> relu -> pool -> linear: the shape of the nets amp is used on.
struct ConvBnNetImpl : torch::nn::Module {
  ConvBnNetImpl(int classes = 4)
      : conv(register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 8, 3).padding(1)))),
        bn(register_module("bn", torch::nn::BatchNorm2d(8))),
        fc(register_module("fc", torch::nn::Linear(8 * 4 * 4, classes))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::max_pool2d(torch::relu(bn(conv(x))), 2);
    return fc(h.flatten(1));
  }
  torch::nn::Conv2d conv;
  torch::nn::BatchNorm2d bn;
  torch::nn::Linear fc;
};
TORCH_MODULE(ConvBnNet);

}  // namespace amp_test
