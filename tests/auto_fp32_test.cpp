// auto_fp32 where it used to be refused: at O3 (no master weights, a static loss scale), with a lean master format
// (the fp32 value rebuilt exactly), and with FP8 (an FP8 layer drops to bfloat16 before fp32). Under amp::parallel:
// TwoRanksTest.AutoFp32MovesTheSameModuleOnEveryRank (tests/parallel_test.cpp).

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "amp/amp.h"
#include "casting/fp8.h"
#include "casting/model_casting.h"
#include "optim/fp32_values.h"
#include "casting/precision_policy.h"
#include "optim/optimizer_state_key.h"
#include "support/support.h"

namespace {

// Makes every product of `overflowing`'s weight overflow in any dtype: the layer before it outputs about 10, and its
// weight is 3e38.
void af_make_overflow(torch::nn::Sequential& net, size_t before, size_t overflowing) {
  torch::NoGradGuard no_grad;
  net[before]->as<torch::nn::LinearImpl>()->bias.fill_(10.0);
  net[overflowing]->as<torch::nn::LinearImpl>()->weight.fill_(3e38);
}

// Squared, so that an inf in the output makes the gradients inf too.
template <class Opt>
void af_train(amp::Model<torch::nn::Sequential>& model, amp::Optimizer<Opt>& optimizer, int from, int to,
              int64_t features = 4, double loss_factor = 1e-9, std::vector<double>* losses = nullptr) {
  for (int step = from; step < to; ++step) {
    torch::manual_seed(50 + step);
    optimizer.zero_grad();
    const torch::Tensor loss = model(torch::randn({16, features})).pow(2).mean() * loss_factor;
    if (losses) losses->push_back(loss.item<double>());
    amp::scale_loss(loss, optimizer).backward();
    optimizer.step();
  }
}

}  // namespace

// O3 keeps no fp32 value: the module's fp16 parameters and its SGD momentum are cast up. The static scale of 1 is
// its own floor, and with auto_fp32 the overflowing steps are skipped (Apex's static scaler would step on inf).
TEST(AutoFp32Test, AtO3TheParametersAndTheirStateAreCastUp) {
  SKIP_WITHOUT_CPU_KERNELS(torch::kHalf);
  torch::manual_seed(4);
  auto net = torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::Linear(8, 1));
  auto [model, optimizer] = amp::initialize(
      net, torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(1e-6).momentum(0.9)),
      amp::Options("O3").low_precision_dtype(torch::kHalf).auto_fp32(2).verbosity(0));
  // One clean step first, so that the head has an fp16 momentum buffer to carry up.
  {
    torch::NoGradGuard no_grad;
    net[1]->as<torch::nn::LinearImpl>()->weight.fill_(1.0);
  }
  af_train(model, optimizer, 0, 1);
  ASSERT_EQ(optimizer.skipped_steps(), 0);
  auto& head = *net[1]->as<torch::nn::LinearImpl>();
  {
    torch::NoGradGuard no_grad;  // about 10 x 6e4 x 8 overflows float16 (and its square fp32 does not)
    net[0]->as<torch::nn::LinearImpl>()->bias.fill_(10.0);
    head.weight.fill_(6e4);
  }
  std::vector<double> losses;
  af_train(model, optimizer, 1, 9, 4, 1e-9, &losses);
  // Overflows 1 and 2 count (patience 2), 3 is diagnosed and moves `1`; from then on the steps are taken.
  EXPECT_EQ(optimizer.skipped_steps(), 3);
  EXPECT_EQ(amp::fp32_modules(optimizer), std::vector<std::string>{"1 (auto_fp32)"});
  for (size_t i = 3; i < losses.size(); ++i) EXPECT_TRUE(std::isfinite(losses[i])) << i;
  EXPECT_EQ(head.weight.scalar_type(), torch::kFloat);
  EXPECT_EQ(net[0]->as<torch::nn::LinearImpl>()->weight.scalar_type(), torch::kHalf);
  auto& state = optimizer.state();
  const auto it = state.find(amp::detail::state_key(state, head.weight));
  ASSERT_NE(it, state.end());
  EXPECT_EQ(static_cast<torch::optim::SGDParamState&>(*it->second).momentum_buffer().scalar_type(), torch::kFloat);
}

TEST(AutoFp32Test, AtO3WithoutOverflowsNothingIsSkipped) {
  auto net = torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::Linear(8, 1));
  auto [model, optimizer] = amp::initialize(net, torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(1e-3)),
                                            amp::Options("O3").low_precision_dtype(torch::kBFloat16).auto_fp32(2).verbosity(0));
  af_train(model, optimizer, 0, 4);
  EXPECT_EQ(optimizer.skipped_steps(), 0);
  EXPECT_TRUE(amp::fp32_modules(optimizer).empty());
}

// A lean master format keeps each bf16 weight's fp32 value in the weight and its low bits: the module moved to
// fp32 gets that value exactly (kSplit), which no step changed while every step was skipped.
TEST(AutoFp32Test, ALeanMasterModuleMovesWithItsExactFp32Value) {
  for (const auto format : {amp::MasterWeights::kSplit, amp::MasterWeights::kKahan, amp::MasterWeights::kStochasticRounding}) {
    torch::manual_seed(4);
    auto net = torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::Linear(8, 1));
    af_make_overflow(net, 0, 1);  // bfloat16 and fp32 alike: every step overflows
    const torch::Tensor original = net[1]->as<torch::nn::LinearImpl>()->weight.detach().clone();
    auto [model, optimizer] = amp::initialize(
        net, amp::optim::FusedAdamW(net->parameters(), torch::optim::AdamWOptions(1e-3)),
        amp::Options("O2").low_precision_dtype(torch::kBFloat16).master_weights_format(format).init_scale(1.0)
            .auto_fp32(2).verbosity(0));
    const torch::Tensor lean_value = amp::detail::fp32_state(*net)[2].second.clone();  // 1.weight
    af_train(model, optimizer, 0, 3);
    ASSERT_EQ(amp::fp32_modules(optimizer), std::vector<std::string>{"1 (auto_fp32)"}) << amp::to_string(format);
    const torch::Tensor& moved = net[1]->as<torch::nn::LinearImpl>()->weight;
    EXPECT_EQ(moved.scalar_type(), torch::kFloat);
    EXPECT_TRUE(amp_test::bitwise_equal(moved, lean_value)) << amp::to_string(format);
    if (format == amp::MasterWeights::kSplit) EXPECT_TRUE(amp_test::bitwise_equal(moved, original));
    EXPECT_EQ(net[0]->as<torch::nn::LinearImpl>()->weight.scalar_type(), torch::kBFloat16);
    // The moved weight left the lean table: the next steps update it as a plain fp32 parameter (and the others
    // as lean ones), and the checkpoint round trip repeats the move.
    {
      torch::NoGradGuard no_grad;
      net[1]->as<torch::nn::LinearImpl>()->weight.fill_(0.5);
    }
    af_train(model, optimizer, 3, 5);
    EXPECT_EQ(optimizer.skipped_steps(), 3) << amp::to_string(format);
    const auto path = (std::filesystem::temp_directory_path() / "amp_af_lean.pt").string();
    torch::save(optimizer, path);
    torch::manual_seed(4);
    auto net2 = torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::Linear(8, 1));
    auto [model2, optimizer2] = amp::initialize(
        net2, amp::optim::FusedAdamW(net2->parameters(), torch::optim::AdamWOptions(1e-3)),
        amp::Options("O2").low_precision_dtype(torch::kBFloat16).master_weights_format(format).init_scale(1.0)
            .auto_fp32(2).verbosity(0));
    torch::load(optimizer2, path);
    EXPECT_EQ(amp::fp32_modules(optimizer2), std::vector<std::string>{"1 (auto_fp32)"}) << amp::to_string(format);
    EXPECT_EQ(net2[1]->as<torch::nn::LinearImpl>()->weight.scalar_type(), torch::kFloat);
    std::filesystem::remove(path);
  }
}

// FP8 first drops the layer that keeps overflowing to bfloat16 (its GEMMs leave FP8, its weight stays bf16), and
// only if it keeps overflowing there moves it to fp32; both decisions resume from a checkpoint.
TEST(AutoFp32Test, AnFp8LayerDropsToBf16BeforeFp32) {
  if (!amp::detail::fp8_supported_by_build()) GTEST_SKIP() << "this LibTorch has no FP8 (2.1 and newer have)";
  torch::manual_seed(4);
  auto net = torch::nn::Sequential(torch::nn::Linear(16, 16), torch::nn::ReLU(), torch::nn::Linear(16, 16));
  af_make_overflow(net, 0, 2);
  const auto options = amp::Options("O2").low_precision_dtype(torch::kBFloat16).init_scale(1.0).auto_fp32(2)
                           .verbosity(0).fp8(amp::Fp8Options());
  auto [model, optimizer] = amp::initialize(net, torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(1e-3)),
                                            options);
  const auto fp8 = amp::detail::precision_policy_of(*net)->fp8();
  ASSERT_TRUE(fp8->in_fp8("2"));
  af_train(model, optimizer, 0, 3, 16);  // 2 counted, the third diagnosed: the FP8 layer leaves FP8
  EXPECT_FALSE(fp8->in_fp8("2"));
  EXPECT_TRUE(fp8->in_fp8("0"));
  EXPECT_TRUE(amp::fp32_modules(optimizer).empty());
  EXPECT_EQ(net[2]->as<torch::nn::LinearImpl>()->weight.scalar_type(), torch::kBFloat16);
  const auto path = (std::filesystem::temp_directory_path() / "amp_af_fp8.pt").string();
  torch::save(optimizer, path);
  af_train(model, optimizer, 3, 6, 16);  // still overflowing in bfloat16: fp32 next
  EXPECT_EQ(amp::fp32_modules(optimizer), std::vector<std::string>{"2 (auto_fp32)"});
  EXPECT_EQ(net[2]->as<torch::nn::LinearImpl>()->weight.scalar_type(), torch::kFloat);

  torch::manual_seed(4);
  auto net2 = torch::nn::Sequential(torch::nn::Linear(16, 16), torch::nn::ReLU(), torch::nn::Linear(16, 16));
  auto [model2, optimizer2] = amp::initialize(net2, torch::optim::SGD(net2->parameters(), torch::optim::SGDOptions(1e-3)),
                                              options);
  torch::load(optimizer2, path);
  const auto fp8_2 = amp::detail::precision_policy_of(*net2)->fp8();
  EXPECT_FALSE(fp8_2->in_fp8("2"));
  EXPECT_TRUE(fp8_2->in_fp8("0"));
  EXPECT_TRUE(amp::fp32_modules(optimizer2).empty());
  std::filesystem::remove(path);
}

namespace {

// An optimizer whose per-parameter state amp does not know: SGD's, re-wrapped after each step.
struct AfOpaqueState : torch::optim::OptimizerCloneableParamState<AfOpaqueState> {
  torch::Tensor buffer;
};

struct AfOpaqueSgd : torch::optim::SGD {
  using torch::optim::SGD::SGD;
  torch::Tensor step(LossClosure closure = nullptr) override {
    torch::Tensor loss = torch::optim::SGD::step(std::move(closure));
    for (auto& [key, state] : this->state()) {
      auto opaque = std::make_unique<AfOpaqueState>();
      opaque->buffer = static_cast<torch::optim::SGDParamState&>(*state).momentum_buffer();
      state = std::move(opaque);
    }
    return loss;
  }
};

}  // namespace

// Without masters the optimizer state must follow its parameter to fp32; a state amp can't cast stops the move with
// the parameter's name and the fixes.
TEST(AutoFp32Test, AtO3AnOptimizerStateAmpCannotCastIsNamed) {
  torch::manual_seed(4);
  auto net = torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::Linear(8, 1));
  auto [model, optimizer] = amp::initialize(
      net, AfOpaqueSgd(net->parameters(), torch::optim::SGDOptions(1e-6).momentum(0.9)),
      amp::Options("O3").low_precision_dtype(torch::kBFloat16).auto_fp32(2).verbosity(0));
  af_train(model, optimizer, 0, 1);  // a clean step: every parameter gets an opaque state
  ASSERT_EQ(optimizer.skipped_steps(), 0);
  af_make_overflow(net, 0, 1);
  af_train(model, optimizer, 1, 3);  // two overflows arm the diagnosis
  optimizer.zero_grad();
  torch::manual_seed(60);
  const torch::Tensor loss = model(torch::randn({16, 4})).pow(2).mean();
  ASSERT_THROWS_WITH(amp::scale_loss(loss, optimizer).backward(),
                     "amp::Optimizer: auto_fp32 moves parameter '1.weight' to fp32, but its optimizer state is a");
}
