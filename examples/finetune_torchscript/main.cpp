// Fine-tuning a network defined in Python, without rewriting it in C++: pretrain.py pretrains a small ResNet in
// Python on digits 0-4 and saves it with torch.jit.script; this program loads it, freezes its BatchNorm, fine-tunes
// it on digits 5-9 at the opt level from the config, checks that the pretrained statistics came through unchanged,
// and saves it with fp32 weights for Python's torch.jit.load (evaluate.py).
//
//   python3 examples/finetune_torchscript/pretrain.py build/data/digits.csv build/pretrained_resnet.pt
//   build/torch-2.13/examples/finetune_torchscript --config examples/configs/O2_bf16.ini \
//       --data build/data/digits.csv --model build/pretrained_resnet.pt --out build/finetuned_resnet.pt
//   cd examples/finetune_torchscript && python3 evaluate.py ../../build/data/digits.csv ../../build/finetuned_resnet.pt

#include <amp/amp.h>
#include <torch/script.h>
#include <torch/torch.h>

#include <cstdio>
#include <iostream>
#include <tuple>

#include "../common/digits.h"
#include "../common/report_error.h"

int main(int argc, char** argv) {
  std::string data, model_path = "pretrained_resnet.pt", out_path = "finetuned_resnet.pt";
  int epochs = 6;
  double lr = 0.02;
  amp::ProgramFlags flags("finetune_torchscript: fine-tune a TorchScript model saved by Python, BatchNorm frozen");
  flags.add("data", &data, "digits.csv from scikit-learn (the file pretrain.py read)")
      .add("model", &model_path, "the module pretrain.py saved with torch.jit.script")
      .add("out", &out_path, "where the fine-tuned module is saved (fp32 weights)")
      .add("epochs", &epochs, "fine-tuning epochs on digits 5-9")
      .add("lr", &lr, "SGD learning rate (momentum 0.9)");
  try {
    const auto options = amp::parse_command_line(argc, argv, flags);
    if (!options) return 0;
    torch::manual_seed(0);
    torch::Tensor images, labels;
    std::cout << "data: " << load_digits(data, images, labels) << "\n";
    torch::Tensor x, y, val_x, val_y;  // digits 5-9, split as pretrain.py splits them (captured below: no binding)
    std::tie(x, y, val_x, val_y) = split_digits(images, labels, /*low=*/false);

    torch::jit::Module net = torch::jit::load(model_path);
    std::vector<torch::Tensor> statistics;
    for (const auto& b : net.buffers()) statistics.push_back(b.clone());
    amp::freeze_batchnorm(net);  // eval mode, no gradients; amp::Model::train() keeps them so
    torch::optim::SGD sgd(amp::parameters(net), torch::optim::SGDOptions(lr).momentum(0.9));
    auto [model, optimizer] = amp::initialize(net, std::move(sgd), *options);

    auto accuracy = [&] {
      model.eval();
      torch::NoGradGuard no_grad;
      return model(val_x).toTensor().argmax(1).eq(val_y).to(torch::kFloat).mean().item<double>();
    };
    std::printf("before fine-tuning: %.2f%% validation accuracy on digits 5-9\n", 100 * accuracy());
    for (int epoch = 1; epoch <= epochs; ++epoch) {
      model.train();
      const auto order = torch::randperm(x.size(0));
      double total = 0.0;
      int64_t batches = 0;
      for (int64_t start = 0; start < x.size(0); start += 32, ++batches) {
        const auto index = order.narrow(0, start, std::min<int64_t>(32, x.size(0) - start));
        optimizer.zero_grad();
        const auto loss = torch::nn::functional::cross_entropy(model(x.index_select(0, index)).toTensor(),
                                                               y.index_select(0, index));
        {
          auto scaled_loss = amp::scale_loss(loss, optimizer);
          scaled_loss.backward();
        }
        optimizer.step();
        total += loss.item<double>();
      }
      std::printf("epoch %d: train loss %.4f, loss scale %.0f\n", epoch, total / static_cast<double>(batches),
                  amp::loss_scale(optimizer));
    }
    const auto& properties = optimizer.properties();
    std::printf("fine-tuned at %s (%s) on digits 5-9: %.2f%% validation accuracy\n",
                amp::to_string(properties.opt_level).c_str(),
                properties.opt_level == amp::OptLevel::O0 ? "fp32" : amp::dtype_name(properties.low_precision_dtype).c_str(),
                100 * accuracy());

    bool unchanged = true;
    size_t i = 0;
    for (const auto& b : net.buffers()) {
      unchanged = unchanged && torch::equal(b.to(statistics[i].scalar_type()), statistics[i]);
      ++i;
    }
    std::printf("BatchNorm statistics unchanged: %s\n", unchanged ? "yes" : "NO");
    model.save(out_path);
    std::printf("saved for Python's torch.jit.load (fp32 weights): %s\n", out_path.c_str());
    return unchanged ? 0 : 2;
  } catch (const std::exception& e) {
    return report_error(e);
  }
}
