// A step that never waits for the device (NOTE [A step that never waits] in src/scaling/device_scale.h): the loss
// scaler's state machine on the device, bit for bit the host's; amp's fused optimizers skipping inside their step;
// the host learning each outcome later. On the CPU every value is there at once, so DeferredHostReadsGuard makes it a
// device that is never done before the host asks: these tests run the device's path here and compare it with the
// host's, bit for bit.

#include <torch/torch.h>
#include <torch/version.h>

#include <filesystem>
#include <iostream>
#include <limits>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/host_sync.h"
#include "optim/fused_route.h"
#include "optim/fused_step_context.h"
#include "optim/optimizer_state_key.h"
#include "scaling/device_scale.h"
#include "scaling/multi_tensor.h"
#include "support/models.h"
#include "support/support.h"
#include "support/training.h"

namespace {

using amp::detail::DeferredHostReadsGuard;
using amp::detail::DeviceScale;

constexpr double kNwInf = std::numeric_limits<double>::infinity();

// ---- The scaler's state machine on the device ------------------------------------------------------------------

struct ScaleCase {
  const char* name;
  amp::Options options;
};

class DeviceScaleTest : public ::testing::TestWithParam<ScaleCase> {};

// Random overflows (and runs of clean passes long enough to grow): after each update the device's scale, clean
// passes, hysteresis, loss multiplier and unscale factor are the host LossScaler's, and so is what the host reads. The
// scaler runs two ways: the tensor ops a device runs (DeferredHostReadsGuard makes the CPU one), checked against the
// host LossScaler (another implementation of the state machine), and the CPU's shortcut (the host machine's state
// copied into the tensors), checked against the tensor ops, bit for bit, update by update.
TEST_P(DeviceScaleTest, FollowsTheHostScalerBitForBit) {
  amp::LossScaler host(GetParam().options.resolve());
  DeviceScale device(host, torch::kCPU), cpu(host, torch::kCPU);
  std::mt19937 rng(7);
  std::bernoulli_distribution overflow_draw(0.3);
  int growths = 0, backoffs = 0;
  for (int i = 0; i < 400; ++i) {
    const bool overflow = i % 50 < 12 ? false : overflow_draw(rng);  // some runs of 12 clean passes
    const double before = host.loss_scale();
    host.update_scale(overflow);
    growths += host.loss_scale() > before;
    backoffs += host.loss_scale() < before;
    std::optional<amp::detail::HostView> view;
    {
      DeferredHostReadsGuard as_device;
      view.emplace(device.update(torch::tensor(overflow)));
    }
    amp::detail::HostView cpu_view = cpu.update(torch::tensor(overflow));
    ASSERT_EQ(device.scale().item<double>(), host.loss_scale()) << "update " << i;
    ASSERT_EQ(device.unskipped().item<int64_t>(), host.unskipped()) << "update " << i;
    ASSERT_EQ(device.hysteresis_left().item<int64_t>(), host.hysteresis_left()) << "update " << i;
    ASSERT_EQ(device.multiplier().item<float>(), static_cast<float>(host.loss_scale()));
    ASSERT_EQ(device.inverse().item<float>(), static_cast<float>(1.0 / host.loss_scale()));
    ASSERT_EQ(view->value(0), overflow ? 1.0 : 0.0);
    ASSERT_EQ(view->value(1), before);
    ASSERT_EQ(view->value(2), host.loss_scale());
    ASSERT_EQ(view->value(3), static_cast<double>(host.unskipped()));
    ASSERT_EQ(view->value(4), static_cast<double>(host.hysteresis_left()));
    for (const auto& [a, b] : {std::pair(cpu.scale(), device.scale()), std::pair(cpu.unskipped(), device.unskipped()),
                               std::pair(cpu.hysteresis_left(), device.hysteresis_left()),
                               std::pair(cpu.multiplier(), device.multiplier()), std::pair(cpu.inverse(), device.inverse())}) {
      ASSERT_TRUE(amp_test::bitwise_equal(a, b)) << "update " << i << ": the CPU's shortcut left " << a << ", the tensor ops "
                                                 << b;
    }
    for (int64_t k = 0; k < 5; ++k) ASSERT_EQ(cpu_view.value(k), view->value(k)) << "update " << i << ", value " << k;
  }
  EXPECT_EQ(device.updates(), 400u);
  EXPECT_EQ(cpu.updates(), 400u);
  if (host.dynamic()) {
    EXPECT_GT(growths, 0) << "the sequence must exercise growth";
    EXPECT_GT(backoffs, 0) << "and backoff";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, DeviceScaleTest,
    ::testing::Values(
        ScaleCase{"apex_defaults_short_interval", amp::Options("O2").growth_interval(5)},
        ScaleCase{"hysteresis_3", amp::Options("O2").hysteresis(3).growth_interval(4)},
        ScaleCase{"odd_factors_and_bounds", amp::Options("O2")
                                                .growth_factor(1.5)
                                                .backoff_factor(0.3)
                                                .growth_interval(3)
                                                .min_loss_scale(7.0)
                                                .max_loss_scale(1e5)},
        ScaleCase{"at_the_ceiling", amp::Options("O2").init_scale(1024.0).max_loss_scale(1024.0).growth_interval(2)},
        ScaleCase{"fixed_scale", amp::Options("O2").loss_scale(amp::LossScale::fixed(128.0))}),
    [](const auto& info) { return std::string(info.param.name); });

// ---- Steps the host has not seen --------------------------------------------------------------------------------

struct NwCase {
  const char* level;
  c10::ScalarType dtype;
  const char* optimizer;  // "FusedSGD", "FusedAdam", "FusedAdamW", "FusedLAMB"
  amp::OptimizerStateFormat format = amp::OptimizerStateFormat::kFp32;
  amp::MasterWeights master = amp::MasterWeights::kCopy;
};

std::string nw_name(const NwCase& c) {
  const std::string format = c.format == amp::OptimizerStateFormat::kFp32 ? ""
                             : c.format == amp::OptimizerStateFormat::kBf16 ? "_bf16_moments"
                                                                            : "_8bit_moments";
  const std::string master = c.master == amp::MasterWeights::kCopy ? "" : std::string("_") + amp::to_string(c.master);
  return std::string(c.level) + "_" + amp_test::dtype_label(c.dtype) + "_" + c.optimizer + format + master;
}

template <class Run>
void with_optimizer(const std::string& name, const std::vector<torch::Tensor>& params, Run run) {
  if (name == "FusedSGD") run(amp::optim::FusedSGD(params, torch::optim::SGDOptions(0.05).momentum(0.9)));
  if (name == "FusedSGD_nesterov") {
    run(amp::optim::FusedSGD(params, torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(true).weight_decay(0.01)));
  }
  if (name == "FusedSGD_dampening") {
    run(amp::optim::FusedSGD(params, torch::optim::SGDOptions(0.05).momentum(0.9).dampening(0.25)));
  }
  if (name == "FusedAdam") run(amp::optim::FusedAdam(params, torch::optim::AdamOptions(1e-3).eps(1e-4)));
  if (name == "FusedAdamW") {
    run(amp::optim::FusedAdamW(params, torch::optim::AdamWOptions(1e-3).eps(1e-4).weight_decay(0.01)));
  }
  if (name == "FusedLAMB") run(amp::optim::FusedLAMB(params, amp::optim::FusedLAMBOptions(1e-3)));
}

// What a run ends with: every model parameter and master, the loss scale, the skips.
struct NwOutcome {
  std::vector<torch::Tensor> params, masters;
  double loss_scale = 0;
  int64_t skipped = 0;
  int64_t syncs_while_training = 0;
};

// The loss factors of a run: overflows in a row, alone, first of an accumulation, right before the end.
const std::vector<std::vector<double>> kNwSchedule = {{1}, {1}, {kNwInf}, {1}, {kNwInf}, {kNwInf}, {1},
                                                     {kNwInf, 1}, {1, 1}, {1}, {1}, {kNwInf}, {1}, {1}};

// How the host learns each backward's outcome: as the CPU does (at once; the fused step still takes the flag), as a
// device that is never done before the host asks (DeferredHostReadsGuard), or deciding every skip itself, as for
// LibTorch's optimizers (HostDecidesGuard).
enum class NwPath { kCpu, kDevice, kHost };

NwOutcome nw_train(const NwCase& c, NwPath path, bool aten_kernels = false,
                   const std::vector<std::vector<double>>& schedule = kNwSchedule) {
  std::optional<amp::optim::detail::FusedRouteGuard> route;
  if (aten_kernels) route.emplace(amp::optim::detail::FusedRoute::kAten);
  torch::manual_seed(0);
  // With a state format, a first layer of 4096 weights: 8-bit moments for it, its dtype's for the rest.
  const bool formatted = c.format != amp::OptimizerStateFormat::kFp32;
  amp_test::Mlp net(8, formatted ? 512 : 16, 4);
  const auto options = amp::Options(c.level)
                           .low_precision_dtype(c.dtype)
                           .loss_scale(amp::LossScale::dynamic())
                           .growth_interval(3)
                           .optimizer_state_format(c.format)
                           .master_weights_format(c.master)
                           .verbosity(0);
  const torch::Tensor x = torch::randn({32, 8}), y = torch::randint(0, 4, {32});
  NwOutcome out;
  with_optimizer(c.optimizer, net->parameters(), [&](auto optimizer_in) {
    auto [model, optimizer] = amp::initialize(net, std::move(optimizer_in), options);
    {
      std::optional<DeferredHostReadsGuard> deferred;
      std::optional<amp::detail::HostDecidesGuard> host_decides;
      if (path == NwPath::kDevice) deferred.emplace();
      if (path == NwPath::kHost) host_decides.emplace();
      for (const auto& factors : schedule) {
        optimizer.zero_grad();
        for (const double factor : factors) {  // several: gradient accumulation
          const torch::Tensor loss = torch::nn::functional::cross_entropy(model(x), y);
          amp::scale_loss(factor == 1.0 ? loss : loss * factor, optimizer).backward();
        }
        optimizer.step();
      }
      out.syncs_while_training = amp::host_sync_count(optimizer);
    }
    for (const auto& p : model->parameters()) out.params.push_back(p.detach().clone());
    for (const auto& p : amp::master_params(optimizer)) out.masters.push_back(p.detach().clone());
    out.loss_scale = amp::loss_scale(optimizer);
    out.skipped = optimizer.skipped_steps();
  });
  return out;
}

class SyncFreeStepTest : public ::testing::TestWithParam<NwCase> {};

// The waits of the whole schedule (14 steps, 15 backwards) as a device makes them (NOTE [Counting host syncs]): none
// where the step's kernels take the flag (FusedSGD's first step too: NOTE [A first momentum buffer on the device];
// FusedLAMB's per-op step: NOTE [LAMB on the device]); per op (no ATen fused kernels before 2.4) every step reads it. The host's path reads it after every
// unscaled backward, and on an overflowing one checks each gradient (the report).
int64_t nw_expected_syncs(const std::string& optimizer, NwPath path, int64_t num_params) {
  const auto steps = static_cast<int64_t>(kNwSchedule.size());
  if (path == NwPath::kHost) {
    int64_t backwards = 0, overflows = 0;
    for (const auto& factors : kNwSchedule) {
      for (const double f : factors) {
        ++backwards;
        overflows += f != 1.0;
      }
    }
    return backwards + overflows * num_params;
  }
  if (optimizer != "FusedLAMB" && !amp::optim::detail::has_aten_fused_optimizers()) return steps;
  return 0;
}

// The device's path (the flag passed into the step, the scale updated there, the host learning it all at the end)
// trains exactly as the CPU's (the host sees each outcome at once, the step still takes the flag) and as the host's
// (the host decides every skip and the step never sees a flag), skips and growths included, and waits only where a
// device's step must.
TEST_P(SyncFreeStepTest, DeviceSkipsGiveTheHostPathsBits) {
  const NwCase c = GetParam();
  SKIP_WITHOUT_CPU_KERNELS(c.dtype);
  const NwOutcome host = nw_train(c, NwPath::kHost);
  const NwOutcome cpu = nw_train(c, NwPath::kCpu);
  const NwOutcome device = nw_train(c, NwPath::kDevice);
  const auto num_params = static_cast<int64_t>(host.params.size());
  EXPECT_EQ(host.syncs_while_training, nw_expected_syncs(c.optimizer, NwPath::kHost, num_params));
  EXPECT_EQ(cpu.syncs_while_training, nw_expected_syncs(c.optimizer, NwPath::kCpu, num_params));
  EXPECT_EQ(device.syncs_while_training, nw_expected_syncs(c.optimizer, NwPath::kDevice, num_params))
      << "nothing else waits for the device";
  EXPECT_EQ(host.skipped, 5);
  for (const NwOutcome* other : {&cpu, &device}) {
    SCOPED_TRACE(other == &cpu ? "the CPU's path" : "the device's path");
    EXPECT_EQ(other->skipped, host.skipped);
    EXPECT_EQ(other->loss_scale, host.loss_scale);
    ASSERT_EQ(other->params.size(), host.params.size());
    for (size_t i = 0; i < host.params.size(); ++i) {
      EXPECT_TRUE(amp_test::bitwise_equal(other->params[i], host.params[i])) << "model parameter " << i;
    }
    ASSERT_EQ(other->masters.size(), host.masters.size());
    for (size_t i = 0; i < host.masters.size(); ++i) {
      EXPECT_TRUE(amp_test::bitwise_equal(other->masters[i], host.masters[i])) << "master " << i;
    }
  }
}

std::vector<NwCase> nw_cases() {
  std::vector<NwCase> out;
  for (const char* level : {"O0", "O1", "O2", "O3"}) {
    for (const auto dtype : amp_test::low_precision_dtypes()) {
      if (std::string(level) == "O0" && dtype == torch::kHalf) continue;  // O0 computes in fp32 whatever the dtype
      for (const char* optimizer : {"FusedSGD", "FusedAdam", "FusedAdamW", "FusedLAMB"}) {
        out.push_back({level, dtype, optimizer});
      }
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Levels, SyncFreeStepTest, ::testing::ValuesIn(nw_cases()),
                         [](const auto& info) { return nw_name(info.param); });

// bf16 and 8-bit moments on amp's CPU loop, which reads the CPU's flag where a device's kernels take it.
INSTANTIATE_TEST_SUITE_P(
    Formats, SyncFreeStepTest,
    ::testing::Values(NwCase{"O2", torch::kBFloat16, "FusedAdamW", amp::OptimizerStateFormat::kBf16},
                      NwCase{"O2", torch::kBFloat16, "FusedAdam", amp::OptimizerStateFormat::k8Bit},
                      NwCase{"O3", torch::kBFloat16, "FusedAdamW", amp::OptimizerStateFormat::k8Bit},
                      NwCase{"O2", torch::kBFloat16, "FusedLAMB", amp::OptimizerStateFormat::kBf16}),
    [](const auto& info) { return nw_name(info.param); });

// The lean master formats (NOTE [Lean masters on the device]), alone and beside 8-bit moments.
const amp::OptimizerStateFormat kNwFp32 = amp::OptimizerStateFormat::kFp32;
std::vector<NwCase> nw_lean_cases() {
  return {NwCase{"O2", torch::kBFloat16, "FusedAdamW", kNwFp32, amp::MasterWeights::kSplit},
          NwCase{"O2", torch::kBFloat16, "FusedAdam", kNwFp32, amp::MasterWeights::kKahan},
          NwCase{"O2", torch::kBFloat16, "FusedSGD", kNwFp32, amp::MasterWeights::kStochasticRounding},
          NwCase{"O2", torch::kBFloat16, "FusedAdamW", kNwFp32, amp::MasterWeights::kStochasticRounding},
          NwCase{"O2", torch::kBFloat16, "FusedLAMB", kNwFp32, amp::MasterWeights::kResidual8},
          NwCase{"O2", torch::kBFloat16, "FusedLAMB", kNwFp32, amp::MasterWeights::kSplit},
          NwCase{"O2", torch::kBFloat16, "FusedAdam", kNwFp32, amp::MasterWeights::kResidual8},
          NwCase{"O2", torch::kBFloat16, "FusedAdamW", amp::OptimizerStateFormat::k8Bit, amp::MasterWeights::kSplit},
          NwCase{"O2", torch::kBFloat16, "FusedAdamW", amp::OptimizerStateFormat::kBf16,
                 amp::MasterWeights::kStochasticRounding}};
}
INSTANTIATE_TEST_SUITE_P(LeanMasters, SyncFreeStepTest, ::testing::ValuesIn(nw_lean_cases()),
                         [](const auto& info) { return nw_name(info.param); });

class SyncFreeAtenStepTest : public ::testing::TestWithParam<NwCase> {};

// ATen's fused kernels, the route of CUDA parameters, forced on the CPU: the flag goes into _fused_sgd_ /
// _fused_adam_ / _fused_adamw_, the Adam step counts live in tensors with the flag subtracted after each kernel, and
// the host puts its counts back when it learns of a skip. Same bits as the host's path on the same kernels.
TEST_P(SyncFreeAtenStepTest, DeviceStepCountsGiveTheHostPathsBits) {
  const NwCase c = GetParam();
  SKIP_WITHOUT_CPU_KERNELS(c.dtype);
  if (!amp::optim::detail::has_aten_fused_optimizers()) GTEST_SKIP() << "ATen's fused optimizers arrived in 2.4";
  const NwOutcome host = nw_train(c, NwPath::kHost, /*aten_kernels=*/true);
  const NwOutcome device = nw_train(c, NwPath::kDevice, /*aten_kernels=*/true);
  EXPECT_EQ(device.syncs_while_training, nw_expected_syncs(c.optimizer, NwPath::kDevice, 0));
  EXPECT_EQ(device.skipped, host.skipped);
  EXPECT_EQ(device.loss_scale, host.loss_scale);
  for (size_t i = 0; i < host.params.size(); ++i) EXPECT_TRUE(amp_test::bitwise_equal(device.params[i], host.params[i]));
  for (size_t i = 0; i < host.masters.size(); ++i) {
    EXPECT_TRUE(amp_test::bitwise_equal(device.masters[i], host.masters[i])) << "master " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Levels, SyncFreeAtenStepTest,
                         ::testing::Values(NwCase{"O1", torch::kBFloat16, "FusedAdam"},
                                           NwCase{"O2", torch::kBFloat16, "FusedAdamW"},
                                           NwCase{"O2", torch::kHalf, "FusedAdam"},
                                           NwCase{"O2", torch::kBFloat16, "FusedSGD"},
                                           NwCase{"O2", torch::kBFloat16, "FusedLAMB"},
                                           NwCase{"O2", torch::kHalf, "FusedLAMB"},
                                           NwCase{"O3", torch::kBFloat16, "FusedLAMB"},
                                           NwCase{"O3", torch::kBFloat16, "FusedAdamW"}),
                         [](const auto& info) { return nw_name(info.param); });

// bf16 and 8-bit moments on ATen's route (NOTE [Stored moments on the device]): decoded, the fp32 kernel with the
// flag (FusedLAMB: its per-op step with the flag), encoded back with the stored bytes kept on a skip and bf16's draws
// counted on the device.
INSTANTIATE_TEST_SUITE_P(
    Formats, SyncFreeAtenStepTest,
    ::testing::Values(NwCase{"O2", torch::kBFloat16, "FusedAdamW", amp::OptimizerStateFormat::kBf16},
                      NwCase{"O2", torch::kBFloat16, "FusedAdam", amp::OptimizerStateFormat::k8Bit},
                      NwCase{"O2", torch::kHalf, "FusedAdam", amp::OptimizerStateFormat::kBf16},
                      NwCase{"O1", torch::kBFloat16, "FusedAdamW", amp::OptimizerStateFormat::k8Bit},
                      NwCase{"O3", torch::kBFloat16, "FusedAdamW", amp::OptimizerStateFormat::kBf16},
                      NwCase{"O3", torch::kBFloat16, "FusedAdam", amp::OptimizerStateFormat::k8Bit},
                      NwCase{"O2", torch::kBFloat16, "FusedLAMB", amp::OptimizerStateFormat::kBf16},
                      NwCase{"O2", torch::kHalf, "FusedLAMB", amp::OptimizerStateFormat::k8Bit},
                      NwCase{"O3", torch::kBFloat16, "FusedLAMB", amp::OptimizerStateFormat::k8Bit}),
    [](const auto& info) { return nw_name(info.param); });

// Lean masters on ATen's route: value and store in ATen ops, the stores keeping the old weight and aux on a device
// skip, kStochasticRounding's draws counted on the device (NOTE [Lean masters on the device]).
INSTANTIATE_TEST_SUITE_P(LeanMasters, SyncFreeAtenStepTest, ::testing::ValuesIn(nw_lean_cases()),
                         [](const auto& info) { return nw_name(info.param); });

// A first step that overflows (NOTE [A first momentum buffer on the device]): without dampening the step makes -0.0
// buffers and the kernels skip on the device, so the next step is the first, bit for bit the host's path (which made
// no buffer); with dampening the kernel runs both ways while the device's flag says whether a buffer has had its
// first step. ATen's kernels as on CUDA, and amp's CPU loop.
TEST(SyncFreeFirstStepTest, FirstMomentumBuffersWaitForNothing) {
  if (!amp::optim::detail::has_aten_fused_optimizers()) GTEST_SKIP() << "ATen's fused optimizers arrived in 2.4";
  const std::vector<std::vector<double>> schedule = {{kNwInf}, {1}, {kNwInf}, {1}, {1}};
  for (const char* optimizer : {"FusedSGD", "FusedSGD_nesterov", "FusedSGD_dampening"}) {
    for (const bool aten : {true, false}) {
      SCOPED_TRACE(std::string(optimizer) + (aten ? ", ATen's kernels" : ", amp's CPU loop"));
      const NwCase c{"O2", torch::kBFloat16, optimizer};
      const NwOutcome host = nw_train(c, NwPath::kHost, aten, schedule);
      const NwOutcome device = nw_train(c, NwPath::kDevice, aten, schedule);
      EXPECT_EQ(device.syncs_while_training, 0);
      EXPECT_EQ(host.skipped, 2);
      EXPECT_EQ(device.skipped, host.skipped);
      EXPECT_EQ(device.loss_scale, host.loss_scale);
      for (size_t i = 0; i < host.params.size(); ++i) {
        EXPECT_TRUE(amp_test::bitwise_equal(device.params[i], host.params[i])) << "model parameter " << i;
      }
      for (size_t i = 0; i < host.masters.size(); ++i) {
        EXPECT_TRUE(amp_test::bitwise_equal(device.masters[i], host.masters[i])) << "master " << i;
      }
    }
  }
}

// A dampened buffer's first step taken in a graph capture (step id 0, which nobody settles) and then a skipped step
// the host settles: the host can't tell from its counts whether a step committed, so it keeps the buffer (the flag,
// read when asked, says) rather than dropping it as if every step had been skipped.
TEST(SyncFreeFirstStepTest, ACapturedFirstStepIsNotUndoneBySettlingALaterSkip) {
  if (!amp::optim::detail::has_aten_fused_optimizers()) GTEST_SKIP() << "ATen's fused optimizers arrived in 2.4";
  const amp::optim::detail::FusedRouteGuard route(amp::optim::detail::FusedRoute::kAten);
  auto run = [](bool on_device) {
    auto p = torch::tensor({1.0f, -0.5f, 0.25f, 2.0f}).requires_grad_();
    p.mutable_grad() = torch::tensor({0.5f, -1.0f, 0.125f, 3.0f});
    amp::optim::FusedSGD sgd(std::vector<torch::Tensor>{p}, torch::optim::SGDOptions(0.1).momentum(0.9).dampening(0.25));
    std::optional<DeferredHostReadsGuard> deferred;
    if (on_device) deferred.emplace();
    if (on_device) sgd.step_context().set_found_inf(torch::zeros({}), /*step_id=*/0, /*captured=*/true);  // clear
    sgd.step();
    if (on_device) {
      sgd.step_context().set_found_inf(torch::ones({}), /*step_id=*/7);  // skipped on the device
      sgd.step();
      sgd.settle_step(7, /*skipped=*/true);
    }
    const auto& state = static_cast<const torch::optim::SGDParamState&>(*sgd.state().begin()->second);
    return std::make_pair(p.detach().clone(), state.momentum_buffer());
  };
  const auto host = run(false), device = run(true);
  ASSERT_TRUE(device.second.defined()) << "the captured step committed: its buffer stays";
  EXPECT_TRUE(amp_test::bitwise_equal(device.second, host.second));
  EXPECT_TRUE(amp_test::bitwise_equal(device.first, host.first));
}

// A state loaded over a buffer whose flag still waits (here by hand; amp::Optimizer settles before it loads): settling
// the flag's skipped step later must not drop the loaded buffer, and the next step is a later one on it.
TEST(SyncFreeFirstStepTest, SettlingAStaleFlagLeavesALoadedBufferAlone) {
  if (!amp::optim::detail::has_aten_fused_optimizers()) GTEST_SKIP() << "ATen's fused optimizers arrived in 2.4";
  const amp::optim::detail::FusedRouteGuard route(amp::optim::detail::FusedRoute::kAten);
  auto p = torch::tensor({1.0f, -0.5f, 0.25f, 2.0f}).requires_grad_();
  p.mutable_grad() = torch::tensor({0.5f, -1.0f, 0.125f, 3.0f});
  amp::optim::FusedSGD sgd(std::vector<torch::Tensor>{p}, torch::optim::SGDOptions(0.1).momentum(0.9).dampening(0.25));
  const DeferredHostReadsGuard deferred;
  sgd.step_context().set_found_inf(torch::ones({}), /*step_id=*/3);  // skipped on the device: a flag waits
  sgd.step();
  ASSERT_EQ(sgd.step_context().first_step_flags(), 1u);
  auto& state = static_cast<torch::optim::SGDParamState&>(*sgd.state().begin()->second);
  const auto loaded = torch::tensor({0.25f, 0.5f, -0.75f, 1.0f});
  state.momentum_buffer(loaded);
  sgd.settle_step(3, /*skipped=*/true);
  ASSERT_TRUE(state.momentum_buffer().defined()) << "the loaded buffer was dropped";
  EXPECT_TRUE(state.momentum_buffer().is_same(loaded));
}

// amp::GradScaler settles no step: a dampened buffer's first step there reads the skip on the host until the buffer
// exists (one wait a step, as LibTorch's optimizers), so no flag is left to run the kernel both ways until a save.
TEST(SyncFreeFirstStepTest, UnderGradScalerNoFlagIsLeftWaiting) {
  if (!amp::optim::detail::has_aten_fused_optimizers()) GTEST_SKIP() << "ATen's fused optimizers arrived in 2.4";
  const amp::optim::detail::FusedRouteGuard route(amp::optim::detail::FusedRoute::kAten);
  torch::manual_seed(0);
  amp_test::Mlp net(8, 16, 4);
  const torch::Tensor x = torch::randn({32, 8}), y = torch::randint(0, 4, {32});
  amp::optim::FusedSGD sgd(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9).dampening(0.25));
  amp::GradScaler scaler;
  std::vector<int64_t> syncs;
  for (const double factor : {kNwInf, 1.0, 1.0, 1.0}) {
    sgd.zero_grad();
    const int64_t before = amp::detail::host_sync_count();
    scaler.scale(torch::nn::functional::cross_entropy(net(x), y) * factor).backward();
    scaler.step(sgd);
    scaler.update();
    syncs.push_back(amp::detail::host_sync_count() - before);
    EXPECT_EQ(sgd.step_context().first_step_flags(), 0u);
  }
  EXPECT_EQ(syncs, (std::vector<int64_t>{1, 1, 0, 0})) << "a read while the buffers are missing, none after";
}

// The -0.0 of NOTE [A first momentum buffer on the device]: a first step on the device whose gradient holds -0.0 and
// +0.0 leaves the buffer LibTorch's clone leaves, each zero's sign included, and the same parameter (buffers of +0.0
// would turn the -0.0 gradients into +0.0).
TEST(SyncFreeFirstStepTest, ZeroGradientsKeepTheirSignInTheBuffer) {
  if (!amp::optim::detail::has_aten_fused_optimizers()) GTEST_SKIP() << "ATen's fused optimizers arrived in 2.4";
  auto run = [](bool on_device) {
    const amp::optim::detail::FusedRouteGuard route(amp::optim::detail::FusedRoute::kAten);
    auto p = torch::tensor({1.0f, -0.0f, 0.5f, 0.0f, -2.0f}).requires_grad_();
    p.mutable_grad() = torch::tensor({-0.0f, 0.0f, -1.5f, -0.0f, 2.0f});
    amp::optim::FusedSGD sgd(std::vector<torch::Tensor>{p}, torch::optim::SGDOptions(0.1).momentum(0.9));
    std::optional<DeferredHostReadsGuard> deferred;
    if (on_device) {  // the flag stays on the device, clear
      deferred.emplace();
      sgd.step_context().set_found_inf(torch::zeros({}), /*step_id=*/1);
    }
    sgd.step();
    const auto& state = static_cast<const torch::optim::SGDParamState&>(*sgd.state().begin()->second);
    return std::make_pair(p.detach().clone(), state.momentum_buffer().clone());
  };
  const auto host = run(false), device = run(true);
  EXPECT_TRUE(amp_test::bitwise_equal(device.second, host.second)) << device.second << " vs " << host.second;
  EXPECT_TRUE(amp_test::bitwise_equal(device.first, host.first));
}

// The pieces of one O2 bf16 FusedAdam run that the tests below drive by hand.
struct NwRig {
  NwRig() : net(8, 16, 4), x(torch::randn({32, 8})), y(torch::randint(0, 4, {32})) {}
  amp_test::Mlp net;
  torch::Tensor x, y;
  amp::Options options = amp::Options("O2").low_precision_dtype(torch::kBFloat16).growth_interval(3).verbosity(0);
};

// With dampening (NOTE [A first momentum buffer on the device]) a buffer's first step clones, and on the device the
// host does not know which step that is: once the host has settled the steps, the optimizer is the host path's, each
// buffer dropped where every step since it was made was skipped and kept otherwise, and resuming continues bit for bit.
TEST(SyncFreeFirstStepTest, DampenedBuffersSettleToTheHostPaths) {
  if (!amp::optim::detail::has_aten_fused_optimizers()) GTEST_SKIP() << "ATen's fused optimizers arrived in 2.4";
  struct Run {
    std::vector<torch::Tensor> params, buffers, resumed;
    int64_t skipped = 0, syncs = 0;
  };
  auto run = [](const amp::Options& options, const std::vector<double>& factors, bool on_device) {
    const amp::optim::detail::FusedRouteGuard route(amp::optim::detail::FusedRoute::kAten);
    torch::manual_seed(0);
    NwRig rig;
    auto [model, optimizer] = amp::initialize(
        rig.net,
        amp::optim::FusedSGD(rig.net->parameters(),
                             torch::optim::SGDOptions(0.05).momentum(0.9).dampening(0.25).weight_decay(0.01)),
        options);
    Run out;
    {
      std::optional<DeferredHostReadsGuard> deferred;
      std::optional<amp::detail::HostDecidesGuard> host_decides;
      if (on_device) deferred.emplace();
      else host_decides.emplace();
      for (const double factor : factors) {
        amp_test::train_step(model, optimizer, rig.x, rig.y, amp_test::StepOptions().loss_factor(factor));
      }
      out.syncs = amp::host_sync_count(optimizer);
    }
    out.skipped = optimizer.skipped_steps();  // the host learns every outcome
    for (const auto& p : model->parameters()) out.params.push_back(p.detach().clone());
    auto& state = optimizer.state();
    for (const auto& master : amp::master_params(optimizer)) {
      const auto it = state.find(amp::detail::state_key(state, master));
      out.buffers.push_back(it == state.end() || !it->second
                                ? torch::Tensor()
                                : static_cast<torch::optim::SGDParamState&>(*it->second).momentum_buffer());
    }
    for (int i = 0; i < 2; ++i) amp_test::train_step(model, optimizer, rig.x, rig.y);
    for (const auto& p : model->parameters()) out.resumed.push_back(p.detach().clone());
    return out;
  };
  const std::vector<std::vector<double>> schedules = {
      {kNwInf}, {kNwInf, kNwInf}, {kNwInf, 1}, {1, kNwInf, 1}, {kNwInf, kNwInf, 1, kNwInf, 1}};
  const amp::Options base = NwRig().options;
  const std::vector<std::pair<std::string, amp::Options>> configs = {
      {"O2 bf16", base},
      {"O2 bf16, split masters", amp::Options(base).master_weights_format(amp::MasterWeights::kSplit)},
      {"O2 bf16, stochastic rounding masters",
       amp::Options(base).master_weights_format(amp::MasterWeights::kStochasticRounding)},
      {"O2 fp16", amp::Options(base).low_precision_dtype(torch::kHalf)},
      {"O1 bf16", amp::Options("O1").low_precision_dtype(torch::kBFloat16).loss_scale(amp::LossScale::dynamic())
                      .growth_interval(3).verbosity(0)}};
  // Not O3: its bf16 parameters would step through ATen's CPU _fused_sgd_, whose bf16 / fp16 kernel in LibTorch 2.13
  // reads momentum buffers through float pointers (past their end) and skips whole vectors of the update (pytorch
  // #191763, fixed after 2.13 by #192545). amp's own CPU routes never take it (route_for: per op); CUDA's kernel is
  // another.
  for (const auto& [config, options] : configs) {
    for (const auto& factors : schedules) {
      SCOPED_TRACE(config + ", schedule of " + std::to_string(factors.size()) + " steps, first " +
                   std::to_string(factors[0]));
      const Run host = run(options, factors, false), device = run(options, factors, true);
      EXPECT_EQ(device.syncs, 0);
      EXPECT_EQ(device.skipped, host.skipped);
      ASSERT_EQ(device.buffers.size(), host.buffers.size());
      for (size_t i = 0; i < host.buffers.size(); ++i) {
        ASSERT_EQ(device.buffers[i].defined(), host.buffers[i].defined()) << "buffer " << i;
        if (host.buffers[i].defined()) EXPECT_TRUE(amp_test::bitwise_equal(device.buffers[i], host.buffers[i])) << i;
      }
      for (size_t i = 0; i < host.params.size(); ++i) {
        EXPECT_TRUE(amp_test::bitwise_equal(device.params[i], host.params[i])) << "parameter " << i;
        EXPECT_TRUE(amp_test::bitwise_equal(device.resumed[i], host.resumed[i])) << "parameter " << i << " resumed";
      }
    }
  }
}

// What the host asks waits once for the newest outcome (counted), then knows all of them; ScaledLoss::overflow() of a
// backward the host has not seen waits too.
TEST(SyncFreeReadsTest, AskingWaitsOnceAndCounts) {
  torch::manual_seed(0);
  NwRig rig;
  auto [model, optimizer] = amp::initialize(
      rig.net, amp::optim::FusedAdam(rig.net->parameters(), torch::optim::AdamOptions(1e-3)), rig.options);
  DeferredHostReadsGuard deferred;
  // Each step's own read of the flag: none on ATen's kernels, one per op (LibTorch < 2.4: NOTE [Counting host syncs]).
  const int64_t per_step = amp::optim::detail::has_aten_fused_optimizers() ? 0 : 1;
  for (int i = 0; i < 3; ++i) amp_test::train_step(model, optimizer, rig.x, rig.y);
  optimizer.zero_grad();
  auto scaled = amp::scale_loss(torch::nn::functional::cross_entropy(model(rig.x), rig.y) * kNwInf, optimizer);
  scaled.backward();
  EXPECT_EQ(amp::host_sync_count(optimizer), 3 * per_step);
  EXPECT_TRUE(scaled.overflow());
  const int64_t after_overflow_read = amp::host_sync_count(optimizer);
  EXPECT_EQ(after_overflow_read, 3 * per_step + 1) << "overflow() waited for its backward";
  optimizer.step();
  EXPECT_EQ(optimizer.skipped_steps(), 1);
  EXPECT_EQ(amp::loss_scale(optimizer), 65536.0) << "grown to 2^17 after 3 clean steps, then halved";
  // The step learned the overflow from the outcome overflow() read and started the report's checks of each gradient
  // on the device; asking for the skips waits for those (one stacked read), nothing else.
  EXPECT_EQ(amp::host_sync_count(optimizer), after_overflow_read + per_step + 1);
  EXPECT_FALSE(optimizer.step_will_be_skipped());
}

// The notice of a skip and the overflow report come when the host learns of the overflow, not before; the report
// still names the gradients if they are those of the overflowing backward.
TEST(SyncFreeReadsTest, NoticeAndReportWhenTheHostLearns) {
  torch::manual_seed(0);
  NwRig rig;
  auto [model, optimizer] = amp::initialize(
      rig.net, amp::optim::FusedSGD(rig.net->parameters(), torch::optim::SGDOptions(0.1)), rig.options.verbosity(1));
  DeferredHostReadsGuard deferred;
  testing::internal::CaptureStdout();
  amp_test::train_step(model, optimizer, rig.x, rig.y, amp_test::StepOptions().loss_factor(kNwInf));
  const std::string during = testing::internal::GetCapturedStdout();
  EXPECT_EQ(during.find("Gradient overflow"), std::string::npos) << during;
  testing::internal::CaptureStdout();
  const auto report = optimizer.last_overflow();
  const std::string after = testing::internal::GetCapturedStdout();
  EXPECT_NE(after.find("Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0"),
            std::string::npos) << after;
  ASSERT_TRUE(report.has_value());
  EXPECT_EQ(report->loss_scale, 65536.0);
  EXPECT_EQ(report->parameters, (std::vector<std::string>{"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}));
  // A skip the device made drops the overflowed gradients once the host learns of it, as the host's skip does.
  for (const auto& p : model->parameters()) EXPECT_FALSE(p.grad().defined());
}

// zero_grad between an overflowing backward and the step drops that overflow's skip, on both paths alike.
TEST(SyncFreeReadsTest, ZeroGradBeforeTheStepCancelsAnUnseenSkip) {
  for (const bool deferred : {false, true}) {
    torch::manual_seed(0);
    NwRig rig;
    auto [model, optimizer] = amp::initialize(
        rig.net, amp::optim::FusedAdamW(rig.net->parameters(), torch::optim::AdamWOptions(1e-3)), rig.options);
    std::optional<DeferredHostReadsGuard> guard;
    if (deferred) guard.emplace();
    optimizer.zero_grad();
    amp::scale_loss(torch::nn::functional::cross_entropy(model(rig.x), rig.y) * kNwInf, optimizer).backward();
    optimizer.zero_grad();
    amp::scale_loss(torch::nn::functional::cross_entropy(model(rig.x), rig.y), optimizer).backward();
    const torch::Tensor before = model->fc1->weight.detach().clone();
    optimizer.step();
    guard.reset();
    EXPECT_EQ(optimizer.skipped_steps(), 0) << "deferred " << deferred;
    EXPECT_FALSE(amp_test::bitwise_equal(model->fc1->weight, before)) << "the step was taken, deferred " << deferred;
    EXPECT_EQ(amp::loss_scale(optimizer), 32768.0) << "the overflow still halved the scale";
  }
}

// A checkpoint written while the host has not seen the last steps holds what the device did: resuming it on the
// host's path continues bit for bit as the uninterrupted host run.
// The model's weights and the fp32 masters, flattened into one fp32 tensor (the bf16 weights alone can hide a master's
// difference).
template <class Model, class Optimizer>
torch::Tensor weights_and_masters(Model& model, Optimizer& optimizer) {
  std::vector<torch::Tensor> parts;
  for (const auto& p : model->parameters()) parts.push_back(p.detach().flatten().to(torch::kFloat));
  for (const auto& p : amp::master_params(optimizer)) parts.push_back(p.detach().flatten().to(torch::kFloat));
  return torch::cat(parts);
}

// A checkpoint taken while the host has not seen every skip (DeferredHostReadsGuard: it learns of the first midway
// and of the second at the save) resumes as the run that did not stop: FusedAdam on amp's CPU loop, FusedAdam and
// FusedLAMB on ATen's route (forced on the CPU: their step counts on the device, NOTE [LAMB on the device]), through
// torch::save and through a Python checkpoint (`python`).
template <class Make>
void checkpoint_of_unseen_steps(Make make, bool aten, bool python,
                                amp::OptimizerStateFormat format = amp::OptimizerStateFormat::kFp32) {
  std::optional<amp::optim::detail::FusedRouteGuard> route;
  if (aten) route.emplace(amp::optim::detail::FusedRoute::kAten);
  const std::string path = (std::filesystem::temp_directory_path() / "amp_unseen_steps.pt").string();
  auto run = [&](bool deferred, bool resume) {
    torch::manual_seed(0);
    NwRig rig;
    rig.options.optimizer_state_format(format);
    auto [model, optimizer] = amp::initialize(rig.net, make(rig.net), rig.options);
    std::stringstream model_bytes, optimizer_bytes;
    {
      std::optional<DeferredHostReadsGuard> guard;
      if (deferred) guard.emplace();
      int step = 0;
      for (const double factor : {1.0, kNwInf, 1.0, 1.0, kNwInf}) {
        amp_test::train_step(model, optimizer, rig.x, rig.y, amp_test::StepOptions().loss_factor(factor));
        if (++step == 3) EXPECT_EQ(optimizer.skipped_steps(), 1);  // the host learns of the first skip midway
      }
      if (resume && python) {
        amp::PythonCheckpoint out;
        out.put_model("model", *model);
        out.put_optimizer("optimizer", optimizer);
        out.put_amp("amp", optimizer);
        out.save(path);
      } else if (resume) {
        torch::save(rig.net, model_bytes);
        torch::save(optimizer, optimizer_bytes);
      }
    }
    if (resume) {
      torch::manual_seed(1);
      amp_test::Mlp fresh(8, 16, 4);
      auto [fresh_model, fresh_optimizer] = amp::initialize(fresh, make(fresh), rig.options);
      if (python) {
        const auto checkpoint = amp::PythonCheckpoint::load(path);
        checkpoint.load_model(*fresh_model);
        checkpoint.load_optimizer(fresh_optimizer);
        checkpoint.load_amp(fresh_optimizer, "amp");
        std::filesystem::remove(path);
      } else {
        torch::load(fresh, model_bytes);
        torch::load(fresh_optimizer, optimizer_bytes);
      }
      for (int i = 0; i < 4; ++i) amp_test::train_step(fresh_model, fresh_optimizer, rig.x, rig.y);
      return std::make_pair(weights_and_masters(fresh_model, fresh_optimizer), amp::loss_scale(fresh_optimizer));
    }
    for (int i = 0; i < 4; ++i) amp_test::train_step(model, optimizer, rig.x, rig.y);
    return std::make_pair(weights_and_masters(model, optimizer), amp::loss_scale(optimizer));
  };
  const auto uninterrupted = run(/*deferred=*/false, /*resume=*/false);
  const auto resumed = run(/*deferred=*/true, /*resume=*/true);
  EXPECT_TRUE(amp_test::bitwise_equal(resumed.first, uninterrupted.first))
      << (aten ? "ATen's route" : "amp's CPU loop") << (python ? ", a Python checkpoint" : ", torch::save");
  EXPECT_EQ(resumed.second, uninterrupted.second);
}

TEST(SyncFreeReadsTest, CheckpointOfUnseenStepsResumesExactly) {
  auto adam = [](amp_test::Mlp& net) { return amp::optim::FusedAdam(net->parameters(), torch::optim::AdamOptions(1e-3)); };
  auto lamb = [](amp_test::Mlp& net) { return amp::optim::FusedLAMB(net->parameters(), amp::optim::FusedLAMBOptions(1e-3)); };
  for (const bool python : {false, true}) {
    checkpoint_of_unseen_steps(adam, /*aten=*/false, python);
    if (!amp::optim::detail::has_aten_fused_optimizers()) continue;
    checkpoint_of_unseen_steps(adam, /*aten=*/true, python);
    checkpoint_of_unseen_steps(lamb, /*aten=*/true, python);
    // bf16 moments: the generator's counter the archive holds (NOTE [Stored moments on the device])
    checkpoint_of_unseen_steps(adam, /*aten=*/true, python, amp::OptimizerStateFormat::kBf16);
  }
}

// NOTE [Stored moments on the device]: a skip the device decides leaves every stored byte as it was, where encoding
// the decoded moments again would not: here an 8-bit block whose codes stop short of the map's 1.0 (as a moment
// converted from another run's or edited can), which a new encode would give another scale.
TEST(SyncFreeFormatTest, ASkipOnTheDeviceKeepsTheStoredBytes) {
  if (!amp::optim::detail::has_aten_fused_optimizers()) GTEST_SKIP() << "ATen's fused optimizers arrived in 2.4";
  amp::optim::detail::FusedRouteGuard route(amp::optim::detail::FusedRoute::kAten);
  for (const auto format : {amp::OptimizerStateFormat::k8Bit, amp::OptimizerStateFormat::kBf16}) {
    SCOPED_TRACE(format == amp::OptimizerStateFormat::k8Bit ? "8-bit moments" : "bf16 moments");
    torch::manual_seed(0);
    NwRig rig;
    amp_test::Mlp net(8, 512, 4);
    auto [model, optimizer] = amp::initialize(
        net, amp::optim::FusedAdam(net->parameters(), torch::optim::AdamOptions(1e-3)),
        amp::Options(rig.options).optimizer_state_format(format));
    amp_test::train_step(model, optimizer, rig.x, rig.y);
    const torch::Tensor weight = amp::master_params(optimizer).at(0);  // fc1's, 4096 values: 8-bit moments
    ASSERT_EQ(weight.numel(), 4096);
    auto& states = optimizer.state();
    auto& state = static_cast<torch::optim::AdamParamState&>(*states.at(amp::detail::state_key(states, weight)));
    if (format == amp::OptimizerStateFormat::k8Bit) {
      ASSERT_EQ(state.exp_avg().scalar_type(), torch::kByte);
      state.exp_avg().narrow(0, 0, weight.numel()).fill_(200);  // one code below the map's 1.0 (255) in every block
    } else {
      state.exp_avg().view(torch::kShort)[0] = static_cast<int16_t>(0x7fa1);  // a NaN whose payload encoding quiets
    }
    std::vector<torch::Tensor> before;
    for (const auto& [key, s] : states) {
      auto& adam = static_cast<torch::optim::AdamParamState&>(*s);
      before.push_back(adam.exp_avg().clone()), before.push_back(adam.exp_avg_sq().clone());
    }
    {
      const DeferredHostReadsGuard deferred;
      amp_test::train_step(model, optimizer, rig.x, rig.y, amp_test::StepOptions().loss_factor(kNwInf));
    }
    EXPECT_EQ(optimizer.skipped_steps(), 1);
    size_t i = 0;
    for (const auto& [key, s] : states) {
      auto& adam = static_cast<torch::optim::AdamParamState&>(*s);
      EXPECT_TRUE(torch::equal(adam.exp_avg().view(torch::kByte), before[i++].view(torch::kByte)));
      EXPECT_TRUE(torch::equal(adam.exp_avg_sq().view(torch::kByte), before[i++].view(torch::kByte)));
    }
  }
}

// Two fused optimizers under one loss share its outcome; a LibTorch optimizer among them puts the decision back
// on the host (its step can't skip on the device): one wait per backward.
TEST(SyncFreeReadsTest, SharedLossesAndALibTorchOptimizer) {
  auto run = [](bool deferred, bool libtorch_second) {
    torch::manual_seed(0);
    NwRig rig;
    amp::optim::FusedAdam first(rig.net->fc1->parameters(), torch::optim::AdamOptions(1e-3));
    std::vector<torch::Tensor> weights;
    auto train = [&](auto second_in) {
      auto [models, optimizers] = amp::initialize(std::make_tuple(rig.net),
                                                  std::make_tuple(std::move(first), std::move(second_in)), rig.options);
      auto& [model] = models;
      auto& [opt1, opt2] = optimizers;
      std::optional<DeferredHostReadsGuard> guard;
      if (deferred) guard.emplace();
      for (const double factor : {1.0, kNwInf, 1.0, kNwInf, kNwInf, 1.0}) {
        opt1.zero_grad();
        opt2.zero_grad();
        const torch::Tensor loss = torch::nn::functional::cross_entropy(model(rig.x), rig.y) * factor;
        amp::scale_loss(loss, std::vector<amp::OptimizerBase*>{&opt1, &opt2}).backward();
        opt1.step();
        opt2.step();
      }
      const int64_t syncs = amp::host_sync_count(opt1);
      guard.reset();
      EXPECT_EQ(opt1.skipped_steps(), 3);
      EXPECT_EQ(opt2.skipped_steps(), 3);
      for (const auto& p : model->parameters()) weights.push_back(p.detach().clone());
      return syncs;
    };
    const int64_t syncs =
        libtorch_second
            ? train(torch::optim::SGD(rig.net->fc2->parameters(), torch::optim::SGDOptions(0.1)))
            : train(amp::optim::FusedSGD(rig.net->fc2->parameters(), torch::optim::SGDOptions(0.1)));
    return std::make_pair(syncs, weights);
  };
  const auto host = run(false, false);
  const auto device = run(true, false);
  // Fused steps on ATen's kernels read nothing; per op (LibTorch < 2.4) each of the 6 steps reads the flag.
  const int64_t fused_steps = amp::optim::detail::has_aten_fused_optimizers() ? 0 : 6;
  EXPECT_EQ(host.first, fused_steps);
  EXPECT_EQ(device.first, fused_steps);
  for (size_t i = 0; i < host.second.size(); ++i) EXPECT_TRUE(amp_test::bitwise_equal(device.second[i], host.second[i]));
  const auto mixed = run(true, true);
  // With LibTorch's SGD among the optimizers the host decides: one wait per backward, and on each of the 3 overflows
  // the report's check of the 4 gradients (both optimizers count every read of their shared backward).
  EXPECT_EQ(mixed.first, 6 + 3 * 4);
}

}  // namespace

// ---- amp::GraphCaptureGuard ----------------------------------------------------------------------------------------

namespace {

// What a run under the guard ends with, and three more steps after a torch::save / torch::load round trip.
struct GcOutcome {
  std::vector<torch::Tensor> params, resumed;
  double loss_scale = 0;
  int64_t skipped = 0;
  int64_t syncs_under_guard = -1;
};

template <class Make>
GcOutcome gc_run(bool guarded, bool aten_kernels, amp::OptimizerStateFormat format, amp::MasterWeights master,
                 Make make, double warm_up_factor = 1.0) {
  std::optional<amp::optim::detail::FusedRouteGuard> route;
  if (aten_kernels) route.emplace(amp::optim::detail::FusedRoute::kAten);
  torch::manual_seed(0);
  NwRig rig;
  rig.options.optimizer_state_format(format).master_weights_format(master);
  const int64_t hidden = format == amp::OptimizerStateFormat::kFp32 ? 16 : 512;  // 512: 8-bit moments for fc1
  rig.net = amp_test::Mlp(8, hidden, 4);
  auto [model, optimizer] = amp::initialize(rig.net, make(rig.net), rig.options);
  GcOutcome out;
  amp_test::train_step(model, optimizer, rig.x, rig.y, amp_test::StepOptions().loss_factor(warm_up_factor));  // the warm-up
  {
    std::optional<amp::GraphCaptureGuard> capture;
    if (guarded) capture.emplace(optimizer);
    const int64_t before = amp::host_sync_count(optimizer);
    for (const double factor : {1.0, kNwInf, 1.0, 1.0, 1.0, kNwInf, kNwInf, 1.0}) {
      amp_test::train_step(model, optimizer, rig.x, rig.y, amp_test::StepOptions().loss_factor(factor));
    }
    out.syncs_under_guard = amp::host_sync_count(optimizer) - before;
  }
  for (const auto& p : model->parameters()) out.params.push_back(p.detach().clone());
  out.loss_scale = amp::loss_scale(optimizer);
  out.skipped = optimizer.skipped_steps();
  std::stringstream model_bytes, optimizer_bytes;
  torch::save(rig.net, model_bytes);
  torch::save(optimizer, optimizer_bytes);
  torch::manual_seed(1);
  amp_test::Mlp fresh(8, hidden, 4);
  auto [fresh_model, fresh_optimizer] = amp::initialize(fresh, make(fresh), rig.options);
  torch::load(fresh, model_bytes);
  torch::load(fresh_optimizer, optimizer_bytes);
  for (int i = 0; i < 3; ++i) amp_test::train_step(fresh_model, fresh_optimizer, rig.x, rig.y);
  for (const auto& p : fresh_model->parameters()) out.resumed.push_back(p.detach().clone());
  return out;
}

enum class GcOptimizer { kAdamW, kLamb, kSgdDampening };

GcOutcome gc_train(bool guarded, bool aten_kernels, amp::OptimizerStateFormat format, amp::MasterWeights master,
                   GcOptimizer kind, double warm_up_factor) {
  if (kind == GcOptimizer::kLamb) {
    return gc_run(guarded, aten_kernels, format, master, [](amp_test::Mlp& net) {
      return amp::optim::FusedLAMB(net->parameters(), amp::optim::FusedLAMBOptions(1e-3).weight_decay(0.01));
    }, warm_up_factor);
  }
  if (kind == GcOptimizer::kSgdDampening) {
    return gc_run(guarded, aten_kernels, format, master, [](amp_test::Mlp& net) {
      return amp::optim::FusedSGD(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9).dampening(0.25));
    }, warm_up_factor);
  }
  return gc_run(guarded, aten_kernels, format, master, [](amp_test::Mlp& net) {
    return amp::optim::FusedAdamW(net->parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
  }, warm_up_factor);
}

}  // namespace

// Under the guard (here without a capture: the same host code a capture records runs each step) the host records
// nothing, the device keeps the scale, the skips and the step counts, and what the host reads afterwards (loss scale,
// skipped steps, a checkpoint) is what the host's own path holds: resuming from it continues bit for bit.
TEST(GraphCaptureGuardTest, StepsUnderTheGuardGiveTheHostPathsBits) {
  if (!amp::optim::detail::has_aten_fused_optimizers()) {  // a per-op step reads the flag: refused, named
    torch::manual_seed(0);
    NwRig rig;
    auto [model, optimizer] = amp::initialize(
        rig.net, amp::optim::FusedAdamW(rig.net->parameters(), torch::optim::AdamWOptions(1e-3)), rig.options);
    amp_test::train_step(model, optimizer, rig.x, rig.y);
    ASSERT_THROWS_WITH(amp::GraphCaptureGuard{optimizer}, std::string("this LibTorch (") + TORCH_VERSION +
                       ") has no ATen fused optimizer kernels (they arrived in LibTorch 2.4)");
    GTEST_SKIP() << "CUDA graphs of amp's step need ATen's fused optimizer kernels (LibTorch 2.4 or later)";
  }
  // bf16 and 8-bit moments and the lean master formats too (NOTE [Stored moments on the device], NOTE [Lean masters
  // on the device]): their draw counters read back at the save. FusedLAMB: its groups' step counts, clip and trust
  // ratios on the device (NOTE [LAMB on the device]). FusedSGD with dampening whose warm-up overflowed: its buffers'
  // first step comes under the guard, where the kernel runs both ways and the device's flags pick (NOTE [A first
  // momentum buffer on the device]); the save reads them.
  struct GcCase {
    amp::OptimizerStateFormat format;
    amp::MasterWeights master;
    GcOptimizer optimizer;
    double warm_up_factor = 1.0;
  };
  using F = amp::OptimizerStateFormat;
  using M = amp::MasterWeights;
  using O = GcOptimizer;
  for (const GcCase& c : {GcCase{F::kFp32, M::kCopy, O::kAdamW}, GcCase{F::kBf16, M::kCopy, O::kAdamW},
                          GcCase{F::k8Bit, M::kCopy, O::kAdamW}, GcCase{F::kFp32, M::kSplit, O::kAdamW},
                          GcCase{F::kFp32, M::kKahan, O::kAdamW}, GcCase{F::kBf16, M::kStochasticRounding, O::kAdamW},
                          GcCase{F::k8Bit, M::kResidual8, O::kAdamW}, GcCase{F::kFp32, M::kCopy, O::kLamb},
                          GcCase{F::k8Bit, M::kSplit, O::kLamb}, GcCase{F::kFp32, M::kCopy, O::kSgdDampening, kNwInf}}) {
    for (const bool aten : {false, true}) {
      SCOPED_TRACE(std::string(c.optimizer == O::kLamb ? "FusedLAMB, " : c.optimizer == O::kAdamW ? "FusedAdamW, "
                                                                                                : "FusedSGD (dampening), ") +
                   (aten ? "the device's route, " : "amp's CPU loop, ") + amp::to_string(c.format) + " moments, " +
                   amp::to_string(c.master) + " masters");
      const GcOutcome host = gc_train(/*guarded=*/false, aten, c.format, c.master, c.optimizer, c.warm_up_factor);
      const GcOutcome graph = gc_train(/*guarded=*/true, aten, c.format, c.master, c.optimizer, c.warm_up_factor);
      EXPECT_EQ(graph.syncs_under_guard, 0);
      EXPECT_EQ(host.skipped, c.warm_up_factor == 1.0 ? 3 : 4);
      EXPECT_EQ(graph.skipped, host.skipped);
      EXPECT_EQ(graph.loss_scale, host.loss_scale);
      for (size_t i = 0; i < host.params.size(); ++i) {
        EXPECT_TRUE(amp_test::bitwise_equal(graph.params[i], host.params[i])) << "parameter " << i;
        EXPECT_TRUE(amp_test::bitwise_equal(graph.resumed[i], host.resumed[i]))
            << "parameter " << i << " after resuming (the step counts and the draw counters came from the device)";
      }
    }
  }
}

// What a replayed graph can't do is refused when the guard is made, naming the fix; overflow() under it too.
TEST(GraphCaptureGuardTest, RefusesWhatAReplayCantDo) {
  torch::manual_seed(0);
  NwRig rig;
  {
    auto [model, optimizer] = amp::initialize(rig.net, torch::optim::SGD(rig.net->parameters(), 0.1), rig.options);
    amp_test::train_step(model, optimizer, rig.x, rig.y);
    ASSERT_THROWS_WITH(amp::GraphCaptureGuard{optimizer}, "optimizer 0 is a LibTorch optimizer, whose step can't skip");
  }
  {
    amp_test::Mlp net(8, 16, 4);
    auto [model, optimizer] = amp::initialize(
        net, amp::optim::FusedAdam(net->parameters(), torch::optim::AdamOptions(1e-3)), amp::Options(rig.options).auto_fp32(2));
    ASSERT_THROWS_WITH(amp::GraphCaptureGuard{optimizer}, "must see each overflow on the host");
  }
  amp_test::Mlp net(8, 16, 4);
  auto [model, optimizer] =
      amp::initialize(net, amp::optim::FusedSGD(net->parameters(), torch::optim::SGDOptions(0.1)), rig.options);
  if (!amp::optim::detail::has_aten_fused_optimizers()) {  // then nothing else can be captured (StepsUnderTheGuard...)
    ASSERT_THROWS_WITH(amp::GraphCaptureGuard{optimizer}, "has no ATen fused optimizer kernels");
    return;
  }
  ASSERT_THROWS_WITH(amp::GraphCaptureGuard{optimizer}, "has not taken a step with amp::scale_loss yet");
  amp_test::train_step(model, optimizer, rig.x, rig.y);
  amp::GraphCaptureGuard capture(optimizer);
  ASSERT_THROWS_WITH(amp::GraphCaptureGuard{optimizer}, "optimizer 0 is already under a GraphCaptureGuard");
  auto scaled = amp::scale_loss(torch::nn::functional::cross_entropy(model(rig.x), rig.y), optimizer);
  scaled.backward();
  ASSERT_THROWS_WITH(scaled.overflow(), "under amp::GraphCaptureGuard the overflow stays on the device");
}

// ---- amp::GradScaler with a fused optimizer ------------------------------------------------------------------------

namespace {

// torch.amp's recipe on a plain FusedAdam (ATen's kernel, the route of CUDA parameters): `via_step` lets
// GradScaler::step hand the flag into the kernel, which skips inside with the step counts on the device; otherwise
// the host decides each skip from the unscaled gradients. Returns the weights after the run and after a torch::save /
// torch::load round trip and two more steps (the step counts the checkpoint holds).
std::pair<std::vector<torch::Tensor>, int64_t> gs_train(bool via_step) {
  amp::optim::detail::FusedRouteGuard route(amp::optim::detail::FusedRoute::kAten);
  torch::manual_seed(0);
  amp_test::Mlp net(8, 16, 4);
  const torch::Tensor x = torch::randn({32, 8}), y = torch::randint(0, 4, {32});
  auto make = [](amp_test::Mlp& m) { return amp::optim::FusedAdam(m->parameters(), torch::optim::AdamOptions(1e-3)); };
  amp::optim::FusedAdam optimizer = make(net);
  amp::GradScaler scaler(amp::GradScalerOptions().growth_interval(2));
  const int64_t syncs_before = amp::detail::host_sync_count();
  auto step = [&](amp::optim::FusedAdam& opt, amp_test::Mlp& model, double factor, bool device_skip) {
    opt.zero_grad();
    torch::Tensor loss;
    {
      amp::AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
      loss = torch::nn::functional::cross_entropy(model(x), y) * factor;
    }
    scaler.scale(loss).backward();
    if (device_skip) {
      scaler.step(opt);
    } else {
      scaler.unscale_(opt);
      bool finite = true;
      for (const auto& p : model->parameters()) finite = finite && torch::isfinite(p.grad()).all().item<bool>();
      if (finite) opt.step();
    }
    scaler.update();
  };
  for (const double factor : {1.0, kNwInf, 1.0, 1.0, kNwInf, 1.0}) step(optimizer, net, factor, via_step);
  const int64_t syncs = amp::detail::host_sync_count() - syncs_before;
  std::stringstream bytes;
  torch::save(optimizer, bytes);
  amp_test::Mlp resumed_net(8, 16, 4);
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < net->parameters().size(); ++i) resumed_net->parameters()[i].copy_(net->parameters()[i]);
  }
  amp::optim::FusedAdam resumed = make(resumed_net);
  torch::load(resumed, bytes);
  for (int i = 0; i < 2; ++i) step(resumed, resumed_net, 1.0, via_step);
  std::vector<torch::Tensor> out;
  for (const auto& p : net->parameters()) out.push_back(p.detach().clone());
  for (const auto& p : resumed_net->parameters()) out.push_back(p.detach().clone());
  return {out, syncs};
}

}  // namespace

// GradScaler::step on amp's fused optimizers waits for nothing (the flag goes into the kernel, the scale update runs
// on the device, as torch's GradScaler with a fused optimizer) and trains as the host-decided skips do, bit for bit,
// step counts in the checkpoint included.
TEST(GradScalerSyncFreeTest, FusedStepsSkipInsideAndMatchHostDecidedSkips) {
  if (!amp::optim::detail::has_aten_fused_optimizers()) GTEST_SKIP() << "ATen's fused optimizers arrived in 2.4";
  const auto device = gs_train(/*via_step=*/true);
  const auto host = gs_train(/*via_step=*/false);
  EXPECT_EQ(device.second, 0) << "GradScaler::step and update never read the device";
  ASSERT_EQ(device.first.size(), host.first.size());
  for (size_t i = 0; i < host.first.size(); ++i) {
    EXPECT_TRUE(amp_test::bitwise_equal(device.first[i], host.first[i])) << "tensor " << i;
  }
}

// torch.amp.GradScaler itself, run at test time (tests/python/grad_scaler.py): the scale and growth tracker after
// each update (odd growth and backoff factors, overflows at steps 1 and 5) and the weights, bit for bit, through
// LibTorch's SGD (the host reads the flag) and FusedSGD (the flag goes into the step).
TEST(GradScalerPythonTest, ScaleSequenceAndWeightsAreTorchsBits) {
  if (!amp_test::python_has_torch()) GTEST_SKIP() << "needs Python with the torch wheel (AMP_PYTHON)";
  const auto dir = amp_test::run_python_reference(AMP_SOURCE_DIR "/tests/python/grad_scaler.py", "grad_scaler");
  ASSERT_FALSE(dir.empty());
  const amp::PythonCheckpoint reference = amp::PythonCheckpoint::load((dir / "grad_scaler.pt").string());
  const std::string version = reference.get("torch_version").toStringRef();
  if (version.substr(0, version.find('+')) != TORCH_VERSION) GTEST_SKIP() << "Python's torch " << version << " is not this build's";
  const torch::Tensor scales = reference.get("scales").toTensor(), trackers = reference.get("trackers").toTensor();
  const std::vector<double> factors = {1, kNwInf, 1, 1, 1, kNwInf, 1, 1, 1, 1};
  for (const bool fused : {false, true}) {
    SCOPED_TRACE(fused ? "FusedSGD" : "LibTorch SGD");
    torch::Tensor w = (torch::arange(8, torch::kFloat) / 8 + 0.5).requires_grad_(true);
    const torch::Tensor x = (torch::arange(8, torch::kFloat) - 3.5) / 4;
    std::unique_ptr<torch::optim::Optimizer> optimizer;
    if (fused) optimizer = std::make_unique<amp::optim::FusedSGD>(std::vector<torch::Tensor>{w}, torch::optim::SGDOptions(0.1));
    else optimizer = std::make_unique<torch::optim::SGD>(std::vector<torch::Tensor>{w}, torch::optim::SGDOptions(0.1));
    amp::GradScaler scaler(
        amp::GradScalerOptions().init_scale(1000.0).growth_factor(1.5).backoff_factor(0.3).growth_interval(2));
    for (size_t i = 0; i < factors.size(); ++i) {
      optimizer->zero_grad();
      scaler.scale((w * x).sum() * factors[i]).backward();
      if (fused) scaler.unscale_(*optimizer);  // then the fused step reads unscaled gradients, as LibTorch's does
      scaler.step(*optimizer);
      scaler.update();
      EXPECT_EQ(static_cast<float>(scaler.get_scale()), scales[static_cast<int64_t>(i)].item<float>()) << "step " << i;
      EXPECT_EQ(scaler.state_dict().at("_growth_tracker").toInt(), trackers[static_cast<int64_t>(i)].item<int64_t>())
          << "step " << i;
    }
    EXPECT_TRUE(amp_test::bitwise_equal(w.detach(), reference.get("w").toTensor()));
  }
}
