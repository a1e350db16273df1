// The main job: trains a small conv + BatchNorm classifier on scikit-learn's 8x8 handwritten digits
// (generated digits-like images if the file is absent) at the opt level a config file picks.
//
//   build/torch-2.13/examples/train --config examples/configs/O2_bf16.ini --data build/data/digits.csv
//
// It is the C++ shape of an Apex script: amp::initialize, amp::scale_loss, optimizer.step(), an LR
// schedule, validation each epoch, and checkpoints that include amp's state.

#include <amp/amp.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

namespace {

struct DigitsNetImpl : torch::nn::Module {
  DigitsNetImpl()
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 16, 3).padding(1)))),
        bn1(register_module("bn1", torch::nn::BatchNorm2d(16))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 32, 3).padding(1)))),
        bn2(register_module("bn2", torch::nn::BatchNorm2d(32))),
        fc(register_module("fc", torch::nn::Linear(32 * 4 * 4, 10))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::relu(bn1(conv1(x)));
    h = torch::max_pool2d(torch::relu(bn2(conv2(h))), 2);
    return fc(h.flatten(1));
  }
  torch::nn::Conv2d conv1;
  torch::nn::BatchNorm2d bn1;
  torch::nn::Conv2d conv2;
  torch::nn::BatchNorm2d bn2;
  torch::nn::Linear fc;
};
TORCH_MODULE(DigitsNet);

// Reads scikit-learn's digits.csv (64 pixel values 0..16, then the label, per line).
bool read_digits(const std::string& path, torch::Tensor& images, torch::Tensor& labels) {
  std::ifstream in(path);
  if (!in) return false;
  std::vector<float> pixels;
  std::vector<int64_t> targets;
  std::string line;
  while (std::getline(in, line)) {
    std::stringstream row(line);
    std::string cell;
    std::vector<float> values;
    while (std::getline(row, cell, ',')) values.push_back(std::stof(cell));
    if (values.size() != 65) throw std::runtime_error("train: " + path + ": expected 65 values per line");
    pixels.insert(pixels.end(), values.begin(), values.begin() + 64);
    targets.push_back(static_cast<int64_t>(values[64]));
  }
  const auto n = static_cast<int64_t>(targets.size());
  images = torch::from_blob(pixels.data(), {n, 1, 8, 8}).clone() / 16.0;
  labels = torch::from_blob(targets.data(), {n}, torch::kLong).clone();
  return true;
}

// Fallback data: each class is a fixed random 8x8 pattern plus noise.
void generate_digits(int64_t n, torch::Tensor& images, torch::Tensor& labels) {
  auto prototypes = torch::rand({10, 1, 8, 8});
  labels = torch::randint(10, {n}, torch::kLong);
  images = (prototypes.index_select(0, labels) + 0.3 * torch::randn({n, 1, 8, 8})).clamp(0, 1);
}

}  // namespace

int main(int argc, char** argv) {
  int epochs = 6;
  int64_t batch_size = 64;
  double lr = 0.05;
  int64_t seed = 0;
  std::string data;
  std::string checkpoint;
  bool resume = false;
  amp::ProgramFlags flags("train: a digits classifier trained with amp at the opt level from --config");
  flags.add("epochs", &epochs, "passes over the training set")
      .add("batch_size", &batch_size, "examples per step")
      .add("lr", &lr, "initial learning rate (halved every 2 epochs)")
      .add("seed", &seed, "random seed")
      .add("data", &data, "digits.csv from scikit-learn (empty: generated data)")
      .add("checkpoint", &checkpoint, "file to save model + optimizer + amp state to after each epoch")
      .add("resume", &resume, "load --checkpoint before training");
  try {
    const auto options = amp::parse_command_line(argc, argv, flags);
    if (!options) return 0;
    torch::manual_seed(static_cast<uint64_t>(seed));

    torch::Tensor images, labels;
    std::string source = data;
    if (data.empty() || !read_digits(data, images, labels)) {
      if (!data.empty()) std::cout << "train: " << data << " not found; using generated digits\n";
      source = "generated";
      generate_digits(1797, images, labels);
    }
    const auto permutation = torch::randperm(images.size(0));
    images = images.index_select(0, permutation);
    labels = labels.index_select(0, permutation);
    const int64_t n_train = images.size(0) * 4 / 5;
    auto train_x = images.narrow(0, 0, n_train), train_y = labels.narrow(0, 0, n_train);
    auto val_x = images.narrow(0, n_train, images.size(0) - n_train);
    auto val_y = labels.narrow(0, n_train, images.size(0) - n_train);
    std::cout << "data: " << source << ", " << n_train << " train / " << val_x.size(0) << " validation images\n";

    DigitsNet net;
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(lr).momentum(0.9).weight_decay(1e-4));
    auto [model, optimizer] = amp::initialize(net, std::move(sgd), *options);
    torch::optim::StepLR schedule(optimizer, /*step_size=*/2, /*gamma=*/0.5);
    int start_epoch = 0;
    if (resume) {
      torch::serialize::InputArchive archive;
      archive.load_from(checkpoint);
      torch::serialize::InputArchive model_archive, optimizer_archive;
      archive.read("model", model_archive);
      archive.read("optimizer", optimizer_archive);
      net->load(model_archive);
      optimizer.load(optimizer_archive);
      c10::IValue epoch;
      archive.read("epoch", epoch);
      start_epoch = static_cast<int>(epoch.toInt());
      for (int e = 0; e < start_epoch; ++e) schedule.step();
      std::cout << "resumed from " << checkpoint << " at epoch " << start_epoch << "\n";
    }

    std::printf("%5s %10s %9s %12s %8s %8s\n", "epoch", "train_loss", "val_acc", "loss_scale", "skipped", "sec");
    for (int epoch = start_epoch; epoch < epochs; ++epoch) {
      const auto started = std::chrono::steady_clock::now();
      model.train();
      const auto order = torch::randperm(n_train);
      double total = 0;
      int64_t batches = 0;
      for (int64_t start = 0; start < n_train; start += batch_size) {
        const auto index = order.narrow(0, start, std::min(batch_size, n_train - start));
        optimizer.zero_grad();
        auto loss = torch::nn::functional::cross_entropy(model(train_x.index_select(0, index)),
                                                         train_y.index_select(0, index));
        {
          auto scaled_loss = amp::scale_loss(loss, optimizer);
          scaled_loss.backward();
        }
        optimizer.step();
        total += loss.item<double>();
        ++batches;
      }
      schedule.step();
      model.eval();
      double accuracy;
      {
        torch::NoGradGuard no_grad;
        accuracy = model(val_x).argmax(1).eq(val_y).to(torch::kFloat).mean().item<double>();
      }
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
      std::printf("%5d %10.4f %8.2f%% %12.1f %8lld %8.2f\n", epoch + 1, total / static_cast<double>(batches),
                  100.0 * accuracy, amp::loss_scale(optimizer), static_cast<long long>(optimizer.skipped_steps()),
                  seconds);
      if (!checkpoint.empty()) {
        torch::serialize::OutputArchive archive, model_archive, optimizer_archive;
        net->save(model_archive);
        optimizer.save(optimizer_archive);
        archive.write("model", model_archive);
        archive.write("optimizer", optimizer_archive);
        archive.write("epoch", c10::IValue(static_cast<int64_t>(epoch + 1)));
        archive.save_to(checkpoint);
      }
    }
  } catch (const std::exception& e) {
    std::cerr << (dynamic_cast<const c10::Error*>(&e) ? dynamic_cast<const c10::Error*>(&e)->what_without_backtrace()
                                                      : e.what())
              << "\n";
    return 1;
  }
  return 0;
}
