#pragma once
// The names the documentation's C++ snippets use without declaring them (tests/docs/extract_snippets.py).
// Declarations only: the snippets are compiled, never linked or run. A snippet's own declarations (its
// `auto [model, optimizer] = amp::initialize(...)`) shadow these.
#include <torch/torch.h>

#include <optional>
#include <vector>

#include "amp/amp.h"

namespace amp_docs {

struct NetImpl : torch::nn::Module {
  torch::Tensor forward(const torch::Tensor& x);
};
TORCH_MODULE(Net);
struct BackboneImpl : torch::nn::Module {
  torch::Tensor forward(const torch::Tensor& x);
};
TORCH_MODULE(Backbone);
struct ClassifierImpl : torch::nn::Module {
  ClassifierImpl(Backbone backbone, int classes);
  torch::Tensor forward(const torch::Tensor& x);
};
TORCH_MODULE(Classifier);

torch::Tensor loss_fn(const torch::Tensor& output, const torch::Tensor& target);

// Before initialize.
extern Net net;
extern torch::optim::SGD sgd, sgd_backbone;
extern torch::optim::Adam adam_head, adam;
extern amp::GradScaler scaler;
extern amp::Options options;
extern int classes;
extern int argc;
extern char** argv;
// After initialize.
extern amp::Model<Net> model;
extern amp::Optimizer<torch::optim::SGD> optimizer;
extern amp::parallel::DistributedDataParallel<Net> ddp;
// The loop.
extern std::vector<torch::data::Example<>>* loader;
extern torch::Tensor loss, x, y;
extern int k, epoch, epochs;
extern double max_norm, train_loss, accuracy;

}  // namespace amp_docs
