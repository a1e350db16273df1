// amp::host_sync_count (amp/optimizer.h): the reads of device values amp's backward and step make on the host,
// counted per optimizer (NOTE [Counting host syncs]). The CPU runs a device's path and counts the reads a device would
// wait for, so these CPU counts are a GPU step's; tests/cuda_test.cpp checks them against CUDA's own count on a GPU.
// amp's fused optimizers make none where their kernels take the overflow flag (NOTE [A step that never waits];
// tests/sync_free_test.cpp runs the device path with the host learning late).

#include <torch/torch.h>

#include <limits>
#include <string>
#include <vector>

#include "optim/fused_route.h"
#include "support/models.h"
#include "support/support.h"
#include "support/training.h"

namespace {

struct HsCase {
  const char* level;
  c10::ScalarType dtype;
  const char* optimizer;  // "SGD" (LibTorch's), "FusedSGD", "FusedSGD_dampening", "FusedAdam", "FusedAdamW", "FusedLAMB"
};

class HostSyncTest : public ::testing::TestWithParam<HsCase> {};

constexpr double kHsInf = std::numeric_limits<double>::infinity();

// What each step waits for on a device, as docs/cuda.md's table has it. LibTorch's SGD (its step can't skip on the
// device): the overflow flag on every step, and on an overflowing one the report's check of each gradient. amp's fused
// optimizers take the flag inside their step, where a device's kernels read it: no wait, an overflowing step included;
// FusedSGD's first step makes its momentum buffers on the device, with dampening a flag there that picks the first
// step's result while the host does not know whether it was (NOTE [A first momentum buffer on the device]), and
// FusedLAMB keeps its groups' step counts there too (NOTE [LAMB on the device]): neither waits.
// Without ATen's fused kernels (LibTorch < 2.4) a device steps per op and every fused step but FusedLAMB's (whose
// device route is per op anyway) reads it. Whatever the level
// and dtype; counted on the CPU as on a device (NOTE [Counting host syncs]).
std::vector<int64_t> expected_step_syncs(const std::string& optimizer, int64_t num_params, const std::vector<bool>& overflows) {
  std::vector<int64_t> out;
  for (size_t i = 0; i < overflows.size(); ++i) {
    if (optimizer == "SGD") {
      out.push_back(overflows[i] ? 1 + num_params : 1);
    } else if (optimizer != "FusedLAMB" && !amp::optim::detail::has_aten_fused_optimizers()) {
      out.push_back(1);
    } else {
      out.push_back(0);
    }
  }
  return out;
}

TEST_P(HostSyncTest, EachStepWaitsAsADeviceWould) {
  const HsCase c = GetParam();
  SKIP_WITHOUT_CPU_KERNELS(c.dtype);
  torch::manual_seed(0);
  amp_test::Mlp net(8, 16, 4);
  const auto params = net->parameters();
  // A dynamic loss scale at every level (O0's and O3's default is a static 1, whose backward reads nothing).
  const auto options =
      amp::Options(c.level).low_precision_dtype(c.dtype).loss_scale(amp::LossScale::dynamic()).verbosity(0);
  const torch::Tensor x = torch::randn({32, 8}), y = torch::randint(0, 4, {32});
  const std::vector<bool> overflows = {false, false, false, true, false};
  const auto expected = expected_step_syncs(c.optimizer, static_cast<int64_t>(params.size()), overflows);
  auto run = [&](auto optimizer_in) {
    auto [model, optimizer] = amp::initialize(net, std::move(optimizer_in), options);
    for (size_t step = 0; step < overflows.size(); ++step) {
      const int64_t before = amp::host_sync_count(optimizer);
      amp_test::train_step(model, optimizer, x, y, amp_test::StepOptions().loss_factor(overflows[step] ? kHsInf : 1.0));
      EXPECT_EQ(amp::host_sync_count(optimizer) - before, expected[step]) << "step " << step
          << (overflows[step] ? " (overflowing)" : "");
    }
    EXPECT_EQ(optimizer.skipped_steps(), 1);
  };
  const std::string o = c.optimizer;
  if (o == "SGD") run(torch::optim::SGD(params, torch::optim::SGDOptions(0.05).momentum(0.9)));
  if (o == "FusedSGD") run(amp::optim::FusedSGD(params, torch::optim::SGDOptions(0.05).momentum(0.9)));
  if (o == "FusedSGD_dampening") {
    run(amp::optim::FusedSGD(params, torch::optim::SGDOptions(0.05).momentum(0.9).dampening(0.25)));
  }
  if (o == "FusedAdam") run(amp::optim::FusedAdam(params, torch::optim::AdamOptions(1e-3).eps(1e-4)));  // fp16 states at O3
  if (o == "FusedAdamW") run(amp::optim::FusedAdamW(params, torch::optim::AdamWOptions(1e-3).eps(1e-4)));
  if (o == "FusedLAMB") run(amp::optim::FusedLAMB(params, amp::optim::FusedLAMBOptions(1e-3)));
}

std::vector<HsCase> hs_cases() {
  std::vector<HsCase> out;
  for (const char* level : {"O0", "O1", "O2", "O3"}) {
    for (const auto dtype : amp_test::low_precision_dtypes()) {
      if (std::string(level) == "O0" && dtype == torch::kHalf) continue;  // O0 computes in fp32 whatever the dtype
      for (const char* optimizer : {"SGD", "FusedSGD", "FusedSGD_dampening", "FusedAdam", "FusedAdamW", "FusedLAMB"}) {
        out.push_back({level, dtype, optimizer});
      }
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Levels, HostSyncTest, ::testing::ValuesIn(hs_cases()), [](const auto& info) {
  return std::string(info.param.level) + "_" + amp_test::dtype_label(info.param.dtype) + "_" + info.param.optimizer;
});

struct HsFormatCase {
  const char* name;
  amp::Options options;
  bool sgd;               // FusedSGD (else FusedAdamW)
  int64_t step_syncs;     // per step, overflowing or not
};

class HostSyncFormatTest : public ::testing::TestWithParam<HsFormatCase> {};

// bf16 and 8-bit moments and the lean master formats keep their generators' counters on the device too (NOTE [Stored
// moments on the device], NOTE [Lean masters on the device]): no wait. (Per op, before LibTorch 2.4's fused kernels,
// a step reads it once.)
TEST_P(HostSyncFormatTest, WaitsOfTheFormatsStep) {
  const HsFormatCase c = GetParam();
  torch::manual_seed(0);
  amp_test::Mlp net(8, 512, 4);  // 4096 weights in the first layer: 8-bit moments
  const torch::Tensor x = torch::randn({32, 8}), y = torch::randint(0, 4, {32});
  auto run = [&](auto optimizer_in) {
    auto [model, optimizer] = amp::initialize(net, std::move(optimizer_in), c.options);
    for (const bool overflow : {false, false, true, false}) {
      const int64_t before = amp::host_sync_count(optimizer);
      amp_test::train_step(model, optimizer, x, y, amp_test::StepOptions().loss_factor(overflow ? kHsInf : 1.0));
      const int64_t expected = amp::optim::detail::has_aten_fused_optimizers() ? c.step_syncs : 1;
      EXPECT_EQ(amp::host_sync_count(optimizer) - before, expected) << (overflow ? "an overflowing step" : "a clean step");
    }
    EXPECT_EQ(optimizer.skipped_steps(), 1);
  };
  if (c.sgd) run(amp::optim::FusedSGD(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9)));
  else run(amp::optim::FusedAdamW(net->parameters(), torch::optim::AdamWOptions(1e-3)));
}

amp::Options hs_o2_bf16() { return amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0); }

INSTANTIATE_TEST_SUITE_P(
    Formats, HostSyncFormatTest,
    ::testing::Values(
        HsFormatCase{"bf16_moments", hs_o2_bf16().optimizer_state_format(amp::OptimizerStateFormat::kBf16), false, 0},
        HsFormatCase{"8bit_moments", hs_o2_bf16().optimizer_state_format(amp::OptimizerStateFormat::k8Bit), false, 0},
        HsFormatCase{"split_masters", hs_o2_bf16().master_weights_format(amp::MasterWeights::kSplit), false, 0},
        HsFormatCase{"stochastic_rounding_masters",
                     hs_o2_bf16().master_weights_format(amp::MasterWeights::kStochasticRounding), true, 0},
        HsFormatCase{"kahan_masters", hs_o2_bf16().master_weights_format(amp::MasterWeights::kKahan), true, 0},
        HsFormatCase{"residual8_masters_8bit_moments",
                     hs_o2_bf16().master_weights_format(amp::MasterWeights::kResidual8)
                         .optimizer_state_format(amp::OptimizerStateFormat::k8Bit), false, 0}),
    [](const auto& info) { return std::string(info.param.name); });

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
