// End to end: every level x {fp16, bf16} trains an MLP and a conv+BatchNorm net to a low loss on every
// device; O0 is bitwise identical to plain LibTorch on the same device.
#include "support/data.h"
#include "support/models.h"
#include "support/support.h"
#include "support/training.h"

namespace {

class TrainingTest : public amp_test::LevelTest {};

class TrainingO0Test : public amp_test::DeviceTest {};

// Trains `net` on (x, y), moving all three to `device` first (the data is drawn on the CPU, so every device
// trains on the same numbers).
template <class Net>
std::pair<double, double> train(Net net, torch::Tensor x, torch::Tensor y, const amp::Options& options, int epochs,
                                torch::Device device) {
  net->to(device);
  x = x.to(device);
  y = y.to(device);
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  auto [model, optimizer] = amp::initialize(net, std::move(sgd), options);
  double first = 0, last = 0;
  for (int epoch = 0; epoch < epochs; ++epoch) {
    double total = 0;
    int batches = 0;
    for (int64_t start = 0; start < x.size(0); start += 32) {
      auto xb = x.narrow(0, start, std::min<int64_t>(32, x.size(0) - start));
      auto yb = y.narrow(0, start, xb.size(0));
      total += amp_test::train_step(model, optimizer, xb, yb).template item<double>();
      ++batches;
    }
    (epoch == 0 ? first : last) = total / batches;
  }
  model.eval();
  torch::NoGradGuard no_grad;
  const double accuracy = model(x).argmax(1).eq(y).to(torch::kFloat).mean().template item<double>();
  EXPECT_LT(last, first * 0.5) << "loss did not fall: " << first << " -> " << last;
  return {last, accuracy};
}

}  // namespace

TEST_P(TrainingTest, MlpConverges) {
  auto [x, y] = amp_test::blobs(512, 8, 4, 1);
  torch::manual_seed(2);
  auto [loss, accuracy] = train(amp_test::Mlp(8, 32, 4), x, y, options(), 8, device());
  EXPECT_GT(accuracy, 0.9) << GetParam().level << " loss " << loss;
}

TEST_P(TrainingTest, ConvBatchNormNetConverges) {
  auto [x, y] = amp_test::quadrant_images(384, 3);
  torch::manual_seed(4);
  auto [loss, accuracy] = train(amp_test::ConvBnNet(4), x, y, options(), 6, device());
  EXPECT_GT(accuracy, 0.9) << GetParam().level << " loss " << loss;
}

AMP_INSTANTIATE_FOR_LEVELS(TrainingTest, amp_test::level_cases());

// Both runs do the same ops on the same device (deterministic cuDNN on CUDA), so exact is exact there too.
TEST_P(TrainingO0Test, O0IsBitwiseIdenticalToPlainLibTorch) {
  auto [x_cpu, y_cpu] = amp_test::quadrant_images(128, 5);
  const auto x = x_cpu.to(device()), y = y_cpu.to(device());
  auto run = [&](bool with_amp) {
    torch::manual_seed(11);
    amp_test::ConvBnNet net(4);
    net->to(device());
    torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-2));
    std::vector<torch::Tensor> losses;
    auto body = [&](auto& model, auto& optimizer) {
      for (int step = 0; step < 12; ++step) {
        auto xb = x.narrow(0, (step * 32) % 128, 32), yb = y.narrow(0, (step * 32) % 128, 32);
        optimizer.zero_grad();
        auto loss = torch::nn::functional::cross_entropy(model(xb), yb);
        if constexpr (std::is_base_of_v<amp::OptimizerBase, std::decay_t<decltype(optimizer)>>) {
          auto scaled = amp::scale_loss(loss, optimizer);
          scaled.backward();
        } else {
          loss.backward();
        }
        optimizer.step();
        losses.push_back(loss.detach());
      }
    };
    if (with_amp) {
      auto [model, optimizer] = amp::initialize(net, std::move(adam), amp::Options("O0").verbosity(0));
      body(model, optimizer);
    } else {
      body(net, adam);
    }
    std::vector<torch::Tensor> state = losses;
    for (auto& p : net->parameters()) state.push_back(p.detach().clone());
    for (auto& b : net->buffers()) state.push_back(b.detach().clone());
    return state;
  };
  const auto plain = run(false), with_amp = run(true);
  ASSERT_EQ(plain.size(), with_amp.size());
  for (size_t i = 0; i < plain.size(); ++i) {
    EXPECT_TRUE(amp_test::bitwise_equal(plain[i].cpu(), with_amp[i].cpu())) << i;
  }
}

AMP_INSTANTIATE_FOR_DEVICES(TrainingO0Test);
