// amp::host_sync_count (amp/optimizer.h): the reads of device values amp's backward and step make on the host,
// counted per optimizer (NOTE [Counting host syncs]). The same reads happen on every device, so these CPU counts
// are a GPU step's; tests/cuda_test.cpp checks them against CUDA's own count on a GPU. amp's fused optimizers make
// none (NOTE [A step that never waits]; tests/sync_free_test.cpp runs their device path).

#include <torch/torch.h>

#include <limits>
#include <string>
#include <vector>

#include "support/models.h"
#include "support/support.h"
#include "support/training.h"

namespace {

struct HsCase {
  const char* level;
  c10::ScalarType dtype;
  const char* optimizer;  // "SGD" (LibTorch's), "FusedSGD", "FusedAdam", "FusedAdamW", "FusedLAMB"
};

class HostSyncTest : public ::testing::TestWithParam<HsCase> {};

constexpr double kHsInf = std::numeric_limits<double>::infinity();

// The syncs of each step. With amp's fused optimizers none, an overflowing step included: the scale, the skip and
// the report stay on the device until the host can read them without waiting. With LibTorch's optimizer (whose step
// can't skip on the device): one per step with finite gradients (the overflow flag), and on an overflowing step one
// more per parameter with a gradient (the overflow report checks each). Whatever the level and dtype.
TEST_P(HostSyncTest, NoneWithAFusedOptimizerOnePerStepWithLibTorchs) {
  const HsCase c = GetParam();
  SKIP_WITHOUT_CPU_KERNELS(c.dtype);
  const bool libtorch = std::string(c.optimizer) == "SGD";
  torch::manual_seed(0);
  amp_test::Mlp net(8, 16, 4);
  const auto params = net->parameters();
  // A dynamic loss scale at every level (O0's and O3's default is a static 1, whose backward reads nothing).
  const auto options =
      amp::Options(c.level).low_precision_dtype(c.dtype).loss_scale(amp::LossScale::dynamic()).verbosity(0);
  const torch::Tensor x = torch::randn({32, 8}), y = torch::randint(0, 4, {32});
  auto run = [&](auto optimizer_in) {
    auto [model, optimizer] = amp::initialize(net, std::move(optimizer_in), options);
    auto syncs_of = [&, &model = model, &optimizer = optimizer](double loss_factor) {
      const int64_t before = amp::host_sync_count(optimizer);
      amp_test::train_step(model, optimizer, x, y, amp_test::StepOptions().loss_factor(loss_factor));
      return amp::host_sync_count(optimizer) - before;
    };
    const int64_t per_step = libtorch ? 1 : 0;
    for (int step = 0; step < 3; ++step) EXPECT_EQ(syncs_of(1.0), per_step) << "clean step " << step;
    EXPECT_EQ(syncs_of(kHsInf), libtorch ? 1 + static_cast<int64_t>(params.size()) : 0) << "an overflowing step";
    EXPECT_EQ(optimizer.skipped_steps(), 1);
    EXPECT_EQ(syncs_of(1.0), per_step) << "the clean step after it";
  };
  const std::string o = c.optimizer;
  if (o == "SGD") run(torch::optim::SGD(params, torch::optim::SGDOptions(0.05).momentum(0.9)));
  if (o == "FusedSGD") run(amp::optim::FusedSGD(params, torch::optim::SGDOptions(0.05).momentum(0.9)));
  if (o == "FusedAdam") run(amp::optim::FusedAdam(params, torch::optim::AdamOptions(1e-3).eps(1e-4)));  // fp16 states at O3
  if (o == "FusedAdamW") run(amp::optim::FusedAdamW(params, torch::optim::AdamWOptions(1e-3).eps(1e-4)));
  if (o == "FusedLAMB") run(amp::optim::FusedLAMB(params, amp::optim::FusedLAMBOptions(1e-3)));
}

std::vector<HsCase> hs_cases() {
  std::vector<HsCase> out;
  for (const char* level : {"O0", "O1", "O2", "O3"}) {
    for (const auto dtype : amp_test::low_precision_dtypes()) {
      if (std::string(level) == "O0" && dtype == torch::kHalf) continue;  // O0 computes in fp32 whatever the dtype
      for (const char* optimizer : {"SGD", "FusedSGD", "FusedAdam", "FusedAdamW", "FusedLAMB"}) {
        out.push_back({level, dtype, optimizer});
      }
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Levels, HostSyncTest, ::testing::ValuesIn(hs_cases()), [](const auto& info) {
  return std::string(info.param.level) + "_" + amp_test::dtype_label(info.param.dtype) + "_" + info.param.optimizer;
});

// Two optimizers under one scale_loss share its one read of the overflow flag: each counts it, as each waited.
// amp::GradScaler stepping an amp optimizer counts its read for that optimizer too.
TEST(HostSyncCountTest, SharedBackwardsAndGradScalerCountForTheirOptimizers) {
  torch::manual_seed(0);
  amp_test::Mlp net(8, 16, 4);
  torch::optim::SGD sgd1(net->fc1->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD sgd2(net->fc2->parameters(), torch::optim::SGDOptions(0.1));
  auto [models, optimizers] = amp::initialize(std::make_tuple(net), std::make_tuple(std::move(sgd1), std::move(sgd2)),
                                              amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0));
  auto& [model] = models;
  auto& [opt1, opt2] = optimizers;
  const torch::Tensor x = torch::randn({32, 8}), y = torch::randint(0, 4, {32});
  opt1.zero_grad();
  opt2.zero_grad();
  const torch::Tensor loss = torch::nn::functional::cross_entropy(model(x), y);
  amp::scale_loss(loss, std::vector<amp::OptimizerBase*>{&opt1, &opt2}).backward();
  opt1.step();
  opt2.step();
  EXPECT_EQ(amp::host_sync_count(opt1), 1);
  EXPECT_EQ(amp::host_sync_count(opt2), 1);
  EXPECT_EQ(amp::host_sync_count(opt1), opt1.host_sync_count());

  // torch.amp's recipe: amp::GradScaler over amp::Optimizer at O0 (no scaler of amp's own in the loop).
  torch::manual_seed(0);
  amp_test::Mlp plain(8, 16, 4);
  auto [plain_model, plain_optimizer] =
      amp::initialize(plain, torch::optim::SGD(plain->parameters(), torch::optim::SGDOptions(0.1)),
                      amp::Options("O0").verbosity(0));
  amp::GradScaler scaler;
  for (int step = 0; step < 3; ++step) {
    plain_optimizer.zero_grad();
    scaler.scale(torch::nn::functional::cross_entropy(plain_model(x), y)).backward();
    scaler.step(plain_optimizer);
    scaler.update();
  }
  // Each step: scaler.step's read; the O0 optimizer's own backward did not run (GradScaler scaled the loss).
  EXPECT_EQ(amp::host_sync_count(plain_optimizer), 3);
}

}  // namespace
