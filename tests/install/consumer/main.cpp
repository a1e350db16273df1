// A program outside the amp tree, built against an installed amp.
#include <amp/amp.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <iostream>

int main() {
  torch::nn::Linear net(4, 2);
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  auto [model, optimizer] = amp::initialize(
      net, std::move(sgd), amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0));
  auto loss = model(torch::ones({3, 4})).sum();
  {
    auto scaled = amp::scale_loss(loss, optimizer);
    scaled.backward();
  }
  optimizer.step();
  std::cout << "O2 loss scale " << (amp::loss_scale(optimizer) == 65536.0 ? "65536.0" : "wrong") << "\n";
}
