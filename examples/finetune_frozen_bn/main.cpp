// Fine-tuning a pretrained backbone with frozen BatchNorm, the Apex failure "expected scalar type Half
// but found Float" (apex #122, #614): pretrain a conv + BatchNorm network in fp32 on digits 0-4, save
// it, reload it, freeze its BatchNorm with amp::freeze_batchnorm and fine-tune a new head on digits 5-9
// at the opt level from the config. The pretrained statistics must come out unchanged.
//
//   build/torch-2.13/examples/finetune_frozen_bn --config examples/configs/O2_bf16.ini --data build/data/digits.csv

#include <amp/amp.h>
#include <torch/torch.h>

#include <cstdio>
#include <iostream>

#include "../common/digits.h"
#include "../common/report_error.h"

namespace {

struct BackboneImpl : torch::nn::Module {
  BackboneImpl()
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 16, 3).padding(1)))),
        bn1(register_module("bn1", torch::nn::BatchNorm2d(16))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 32, 3).padding(1)))),
        bn2(register_module("bn2", torch::nn::BatchNorm2d(32))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::relu(bn1(conv1(x)));
    return torch::max_pool2d(torch::relu(bn2(conv2(h))), 2).flatten(1);  // [N, 512]
  }
  torch::nn::Conv2d conv1;
  torch::nn::BatchNorm2d bn1;
  torch::nn::Conv2d conv2;
  torch::nn::BatchNorm2d bn2;
};
TORCH_MODULE(Backbone);

struct ClassifierImpl : torch::nn::Module {
  ClassifierImpl(Backbone b, int64_t classes)
      : backbone(register_module("backbone", std::move(b))), head(register_module("head", torch::nn::Linear(512, classes))) {}
  torch::Tensor forward(const torch::Tensor& x) { return head(backbone(x)); }
  Backbone backbone;
  torch::nn::Linear head;
};
TORCH_MODULE(Classifier);

// Trains `model` with `optimizer` (plain or amp) for `epochs`; returns the validation accuracy.
template <class Model, class Optimizer>
double fit(Model& model, Optimizer& optimizer, const torch::Tensor& x, const torch::Tensor& y,
           const torch::Tensor& val_x, const torch::Tensor& val_y, int epochs) {
  for (int epoch = 0; epoch < epochs; ++epoch) {
    model->train();
    if constexpr (std::is_base_of_v<amp::OptimizerBase, Optimizer>) model.train();  // keeps frozen BN frozen
    const auto order = torch::randperm(x.size(0));
    for (int64_t start = 0; start < x.size(0); start += 32) {
      const auto index = order.narrow(0, start, std::min<int64_t>(32, x.size(0) - start));
      optimizer.zero_grad();
      auto loss = torch::nn::functional::cross_entropy(model(x.index_select(0, index)), y.index_select(0, index));
      if constexpr (std::is_base_of_v<amp::OptimizerBase, Optimizer>) {
        auto scaled_loss = amp::scale_loss(loss, optimizer);
        scaled_loss.backward();
      } else {
        loss.backward();
      }
      optimizer.step();
    }
  }
  model->eval();
  torch::NoGradGuard no_grad;
  return model(val_x).argmax(1).eq(val_y).to(torch::kFloat).mean().template item<double>();
}

}  // namespace

int main(int argc, char** argv) {
  std::string data, pretrained = "pretrained_backbone.pt";
  int pretrain_epochs = 4, finetune_epochs = 4;
  amp::ProgramFlags flags("finetune_frozen_bn: fine-tune a new head over a pretrained backbone with frozen BatchNorm");
  flags.add("data", &data, "digits.csv from scikit-learn (empty or missing: generated data)")
      .add("pretrained", &pretrained, "where the fp32 backbone is saved and reloaded from")
      .add("pretrain_epochs", &pretrain_epochs, "fp32 epochs on digits 0-4")
      .add("finetune_epochs", &finetune_epochs, "amp epochs on digits 5-9, BatchNorm frozen");
  try {
    const auto options = amp::parse_command_line(argc, argv, flags);
    if (!options) return 0;
    torch::manual_seed(0);
    torch::Tensor images, labels;
    std::cout << "data: " << load_digits(data, images, labels) << "\n";

    // 1. Pretrain in plain fp32 LibTorch and save the backbone.
    {
      auto [x, y, vx, vy] = split_digits(images, labels, /*low=*/true);
      Classifier net(Backbone(), 5);
      torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
      const double accuracy = fit(net, sgd, x, y, vx, vy, pretrain_epochs);
      std::printf("pretrained (fp32) on digits 0-4: %.2f%% validation accuracy\n", 100 * accuracy);
      torch::save(net->backbone, pretrained);
    }

    // 2. Reload, freeze BatchNorm, fine-tune a new head (and the convolutions) with amp.
    auto [x, y, vx, vy] = split_digits(images, labels, /*low=*/false);
    Backbone backbone;
    torch::load(backbone, pretrained);
    std::vector<torch::Tensor> statistics;
    for (auto& b : backbone->buffers()) statistics.push_back(b.clone());
    amp::freeze_batchnorm(*backbone);
    Classifier net(backbone, 5);
    std::vector<torch::Tensor> trainable;
    for (auto& p : net->parameters()) {
      if (p.requires_grad()) trainable.push_back(p);
    }
    torch::optim::SGD sgd(trainable, torch::optim::SGDOptions(0.02).momentum(0.9));
    auto [model, optimizer] = amp::initialize(net, std::move(sgd), *options);
    const double accuracy = fit(model, optimizer, x, y, vx, vy, finetune_epochs);
    const auto& properties = optimizer.properties();
    std::printf("fine-tuned at %s (%s) on digits 5-9: %.2f%% validation accuracy\n",
                amp::to_string(properties.opt_level).c_str(),
                properties.opt_level == amp::OptLevel::O0 ? "fp32" : amp::dtype_name(properties.low_precision_dtype).c_str(),
                100 * accuracy);

    bool unchanged = true;
    const auto buffers = backbone->buffers();
    for (size_t i = 0; i < buffers.size(); ++i) unchanged &= torch::equal(buffers[i].to(statistics[i].scalar_type()), statistics[i]);
    std::printf("BatchNorm statistics unchanged: %s (bn1/bn2 dtype %s)\n", unchanged ? "yes" : "NO",
                c10::toString(backbone->bn1->running_var.scalar_type()));
    return unchanged ? 0 : 2;
  } catch (const std::exception& e) {
    return report_error(e);
  }
}
