// Lean masters for bfloat16 at O2 (amp::MasterWeights, src/optim/lean_masters.h): kSplit reconstructs exactly the fp32
// master kCopy steps, kKahan keeps the fp32 value to the compensation's rounding, kStochasticRounding rounds without
// bias and reproducibly; all resume bitwise, skip overflowed steps, avoid the stall of O3's round-to-nearest
// updates, and keep fewer bytes per parameter. Plus the options' and initialize's errors.

#include <amp/amp.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>

#include "../examples/common/memory_meter.h"
#include "optim/fused_route.h"
#include "optim/lean_masters.h"
#include "optim/residual8.h"
#include "support/support.h"

namespace {

using amp::MasterWeights;
using amp::optim::detail::FusedRoute;

const std::vector<MasterWeights> kLeanFormats = {MasterWeights::kSplit, MasterWeights::kStochasticRounding,
                                                 MasterWeights::kKahan, MasterWeights::kResidual8};

amp::Options lean_options(MasterWeights format) {
  return amp::Options("O2").low_precision_dtype(torch::kBFloat16).master_weights_format(format).verbosity(0);
}

// Two linear layers in two param groups with different options, and fixed per-step "gradients": the loss
// sum(p * G) gives each parameter exactly G (rounded to bf16) whatever its value, so two runs that differ in their
// weights still receive the same gradients.
struct LmwNet : torch::nn::Module {
  LmwNet() : a(register_module("a", torch::nn::Linear(8, 16))), b(register_module("b", torch::nn::Linear(16, 4))) {}
  torch::Tensor forward(const torch::Tensor& x) { return b(torch::relu(a(x))); }
  torch::nn::Linear a, b;
};

std::shared_ptr<LmwNet> lmw_net() {
  torch::manual_seed(3);
  return std::make_shared<LmwNet>();
}

std::vector<torch::Tensor> lmw_gradients(const std::shared_ptr<LmwNet>& net, int step) {
  torch::manual_seed(100 + step);
  std::vector<torch::Tensor> g;
  for (const auto& p : net->parameters()) g.push_back(torch::randn(p.sizes()) * 0.1);
  return g;
}

template <class Optimizer>
void lmw_step_with(const std::shared_ptr<LmwNet>& net, Optimizer& optimizer, int step, bool overflow = false) {
  optimizer.zero_grad();
  const auto g = lmw_gradients(net, step);
  const auto params = net->parameters();
  torch::Tensor loss = torch::zeros({}, torch::kFloat);
  for (size_t i = 0; i < params.size(); ++i) loss = loss + (params[i] * g[i].to(params[i].scalar_type())).sum().to(torch::kFloat);
  if (overflow) loss = loss * std::numeric_limits<float>::infinity();
  {
    auto scaled = amp::scale_loss(loss, optimizer);
    scaled.backward();
  }
  optimizer.step();
}

// The fp32 value amp keeps for each of the model's parameters: the master (kCopy), the lean form's value, or the
// parameter itself (fp32).
std::vector<torch::Tensor> fp32_values(LmwNet& net) {
  std::vector<torch::Tensor> out;
  for (const auto& p : net.parameters()) {
    if (auto lean = amp::detail::find_lean(p)) {
      out.push_back(lean->first->value(lean->second));
    } else {
      out.push_back(p.detach().to(torch::kFloat));
    }
  }
  return out;
}

std::vector<torch::optim::OptimizerParamGroup> lmw_groups(const std::shared_ptr<LmwNet>& net) {
  return {torch::optim::OptimizerParamGroup(net->a->parameters()), torch::optim::OptimizerParamGroup(net->b->parameters())};
}

// One optimizer kind, built over the two groups (group 1 with other options), for the parameterised tests.
struct OptimizerKind {
  std::string name;
  FusedRoute route;
};

std::string kind_name(const ::testing::TestParamInfo<OptimizerKind>& info) {
  const char* route = info.param.route == FusedRoute::kAuto ? "own" : info.param.route == FusedRoute::kAten ? "aten" : "perop";
  return info.param.name + "_" + route;
}

using amp::optim::detail::FusedRouteGuard;

// Runs `steps` steps of the named optimizer at `options` and returns each step's fp32 values.
std::vector<std::vector<torch::Tensor>> lmw_trajectory(const std::string& kind, const amp::Options& options, int steps) {
  auto net = lmw_net();
  std::vector<std::vector<torch::Tensor>> out;
  auto run = [&](auto optimizer) {
    auto [model, amp_optimizer] = amp::initialize(net, std::move(optimizer), options);
    for (int s = 0; s < steps; ++s) {
      lmw_step_with(net, amp_optimizer, s);
      if (options.resolve().master_weights_format == MasterWeights::kCopy) {
        out.push_back({});
        for (const auto& m : amp_optimizer.master_params()) out.back().push_back(m.detach().clone());
      } else {
        out.push_back(fp32_values(*net));
      }
    }
  };
  auto groups = lmw_groups(net);
  if (kind == "sgd") {
    groups[1].set_options(std::make_unique<torch::optim::SGDOptions>(torch::optim::SGDOptions(0.05).momentum(0.5).nesterov(true)));
    run(amp::optim::FusedSGD(groups, torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(1e-2)));
  } else if (kind == "adam") {
    groups[1].set_options(std::make_unique<torch::optim::AdamOptions>(torch::optim::AdamOptions(3e-3).amsgrad(true)));
    run(amp::optim::FusedAdam(groups, torch::optim::AdamOptions(1e-2).weight_decay(1e-2)));
  } else if (kind == "adamw") {
    groups[1].set_options(std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(3e-3).weight_decay(0.1)));
    run(amp::optim::FusedAdamW(groups, torch::optim::AdamWOptions(1e-2)));
  } else {
    run(amp::optim::FusedLAMB(groups, amp::optim::FusedLAMBOptions(1e-2)));
  }
  return out;
}

class SplitMastersTest : public ::testing::TestWithParam<OptimizerKind> {
 protected:
  void SetUp() override {
    SKIP_WITHOUT_CPU_KERNELS(torch::kBFloat16);
    if (GetParam().route == FusedRoute::kAten && !amp::optim::detail::has_aten_fused_optimizers()) {
      GTEST_SKIP() << "this LibTorch has no ATen fused optimizer kernels (they arrived in 2.4)";
    }
  }
};

TEST_P(SplitMastersTest, ReconstructedMasterIsBitwiseTheCopysMasterAfterEveryStep) {
  FusedRouteGuard route(GetParam().route);
  const auto copy = lmw_trajectory(GetParam().name, lean_options(MasterWeights::kCopy), 6);
  const auto split = lmw_trajectory(GetParam().name, lean_options(MasterWeights::kSplit), 6);
  ASSERT_EQ(copy.size(), split.size());
  for (size_t s = 0; s < copy.size(); ++s) {
    ASSERT_EQ(copy[s].size(), split[s].size());
    for (size_t i = 0; i < copy[s].size(); ++i) {
      EXPECT_TRUE(amp_test::bitwise_equal(copy[s][i], split[s][i])) << "step " << s << ", parameter " << i;
    }
  }
}

TEST_P(SplitMastersTest, KahanValueFollowsTheCopysMasterFarCloserThanRoundedWeights) {
  FusedRouteGuard route(GetParam().route);
  const auto copy = lmw_trajectory(GetParam().name, lean_options(MasterWeights::kCopy), 6);
  const auto kahan = lmw_trajectory(GetParam().name, lean_options(MasterWeights::kKahan), 6);
  // Kahan's value is each step's fp32 update to the compensation's bf16 rounding (2^-9 of the compensation, itself
  // at most half a bf16 ulp of the weight: 2^-18 of the weight), so after 6 steps it is within 6 * 2^-18 < 2^-14 of
  // the tensor's largest value from kCopy's master, while the bf16 weight alone is up to 2^-9 off.
  for (size_t i = 0; i < copy.back().size(); ++i) {
    const auto diff = (copy.back()[i] - kahan.back()[i]).abs();
    const double bound = copy.back()[i].abs().max().item<double>() * std::ldexp(1.0, -14);
    EXPECT_TRUE((diff <= bound).all().item<bool>()) << "parameter " << i << ": max |kahan - copy| " << diff.max().item<double>();
  }
}

INSTANTIATE_TEST_SUITE_P(Kinds, SplitMastersTest,
                         ::testing::Values(OptimizerKind{"sgd", FusedRoute::kAuto}, OptimizerKind{"adam", FusedRoute::kAuto},
                                           OptimizerKind{"adamw", FusedRoute::kAuto}, OptimizerKind{"lamb", FusedRoute::kAuto},
                                           OptimizerKind{"sgd", FusedRoute::kPerOp}, OptimizerKind{"adam", FusedRoute::kPerOp},
                                           OptimizerKind{"adamw", FusedRoute::kAten}, OptimizerKind{"sgd", FusedRoute::kAten}),
                         kind_name);

// ---- the lean forms themselves -------------------------------------------------------------------

TEST(LeanMastersTest, SplitIsExactAndItsWeightIsTheTruncatedHighHalf) {
  torch::manual_seed(0);
  const auto value = torch::randn({1000}) * 3;
  amp::detail::LeanMasters lean(MasterWeights::kSplit, 0);
  lean.add("w", torch::zeros({1000}, torch::kBFloat16));
  lean.store(0, value);
  EXPECT_TRUE(amp_test::bitwise_equal(lean.value(0), value));
  // Truncation: the weight's bits are the value's top 16 (toward zero, never rounded up).
  const auto high = value.view(torch::kInt).__rshift__(16).to(torch::kShort);
  EXPECT_TRUE(amp_test::bitwise_equal(lean.param(0).view(torch::kShort), high));
  EXPECT_TRUE((lean.param(0).to(torch::kFloat).abs() <= value.abs()).all().item<bool>());
}

TEST(LeanMastersTest, KahanWeightIsRoundedAndWeightPlusCompensationIsTheValueToTheCompensationsRounding) {
  torch::manual_seed(0);
  const auto value = torch::randn({1000}) * 3;
  amp::detail::LeanMasters lean(MasterWeights::kKahan, 0);
  lean.add("w", torch::zeros({1000}, torch::kBFloat16));
  lean.store(0, value);
  EXPECT_TRUE(amp_test::bitwise_equal(lean.param(0), value.to(torch::kBFloat16)));
  const auto lost = value - lean.param(0).to(torch::kFloat);  // exact in fp32
  EXPECT_TRUE(amp_test::bitwise_equal(lean.aux(0), lost.to(torch::kBFloat16)));
  const auto error = (lean.value(0) - value).abs();
  EXPECT_TRUE((error <= lost.abs() * std::ldexp(1.0, -8)).all().item<bool>()) << error.max().item<double>();
}

TEST(LeanMastersTest, StochasticRoundingIsUnbiasedAndReproducible) {
  constexpr int64_t n = int64_t{1} << 20;
  for (const double fraction : {0.3, 0.9}) {
    for (const double sign : {1.0, -1.0}) {
      // A value between the bf16 neighbours 1.5 and 1.5 + 2^-7, `fraction` of the way up (in magnitude).
      const double v = sign * (1.5 + fraction * std::ldexp(1.0, -7));
      amp::detail::LeanMasters lean(MasterWeights::kStochasticRounding, 42);
      lean.add("w", torch::zeros({n}, torch::kBFloat16));
      lean.store(0, torch::full({n}, v));
      const auto w = lean.param(0).to(torch::kFloat);
      // Every weight is one of the two neighbours, and the mean is v: with p = fraction, the mean of n draws has a
      // standard deviation of 2^-7 sqrt(p (1 - p) / n) (3.5e-6 at n = 2^20); 5 of them is the tolerance.
      const double lower = sign * 1.5, upper = sign * (1.5 + std::ldexp(1.0, -7));
      EXPECT_TRUE((w.eq(lower) | w.eq(upper)).all().item<bool>());
      const double sd = std::ldexp(1.0, -7) * std::sqrt(fraction * (1 - fraction) / static_cast<double>(n));
      EXPECT_NEAR(w.to(torch::kDouble).mean().item<double>(), v, 5 * sd) << "fraction " << fraction << " sign " << sign;
      EXPECT_EQ(lean.counter(), static_cast<uint64_t>(n));
      // The same seed and counter give the same bits; the stream moves on after each store.
      amp::detail::LeanMasters again(MasterWeights::kStochasticRounding, 42);
      again.add("w", torch::zeros({n}, torch::kBFloat16));
      again.store(0, torch::full({n}, v));
      EXPECT_TRUE(amp_test::bitwise_equal(again.param(0), lean.param(0)));
      again.store(0, torch::full({n}, v));
      EXPECT_FALSE(amp_test::bitwise_equal(again.param(0), lean.param(0)));
    }
  }
  // Values already on the bf16 grid, infinities and NaN stay as they are.
  amp::detail::LeanMasters lean(MasterWeights::kStochasticRounding, 7);
  lean.add("w", torch::zeros({4}, torch::kBFloat16));
  const auto special = torch::tensor({1.5f, -2.0f, std::numeric_limits<float>::infinity(), std::nanf("")});
  lean.store(0, special);
  const auto w = lean.param(0).to(torch::kFloat);
  EXPECT_EQ(w[0].item<float>(), 1.5f);
  EXPECT_EQ(w[1].item<float>(), -2.0f);
  EXPECT_TRUE(std::isinf(w[2].item<float>()));
  EXPECT_TRUE(std::isnan(w[3].item<float>()));
}

// residual8 against FlashOptim 0.1.4's compute_ecc_bits / reconstruct_fp32_param, re-expressed in torch ops and run at
// test time (tests/python/residual8.py): the weight, the residual and the rebuilt value, bit for bit, over values of
// every magnitude (bf16 subnormals, exact bf16 values, midpoints, the largest finite); and decoding alone over every
// int8 residual and weights of every exponent.
// Stochastic rounding draws by place (NOTE [Lean masters]): a step's stores draw the same bits in any order, a slice
// (ZeRO's piece) draws its whole tensor's bits for its elements, and the counter moves past the numbering once a step.
TEST(LeanMastersTest, StochasticRoundingDrawsByPlaceOncePerStep) {
  torch::manual_seed(3);
  const auto a = torch::randn({1000}), b = torch::randn({3000});
  auto table = [] {
    auto t = std::make_shared<amp::detail::LeanMasters>(MasterWeights::kStochasticRounding, 99, 5);
    t->add("a", torch::zeros({1000}, torch::kBFloat16));
    t->add("b", torch::zeros({3000}, torch::kBFloat16));
    return t;
  };
  auto in_order = table(), reversed = table();
  in_order->begin_step();
  in_order->store(0, a);
  in_order->store(1, b);
  in_order->end_step();
  reversed->begin_step();
  reversed->store(1, b);
  reversed->store(0, a);
  reversed->end_step();
  EXPECT_TRUE(amp_test::bitwise_equal(in_order->param(0), reversed->param(0)));
  EXPECT_TRUE(amp_test::bitwise_equal(in_order->param(1), reversed->param(1)));
  EXPECT_EQ(in_order->counter(), uint64_t{5 + 4000});
  EXPECT_EQ(in_order->numbering(), 4000);
  // Elements [700, 2000) of b as a piece: the whole's bits for those elements.
  auto whole = table();
  amp::detail::LeanMasters pieces(MasterWeights::kStochasticRounding, 99, 5);
  pieces.add_slice(*whole, 1, torch::zeros({1300}, torch::kBFloat16), 700, torch::Tensor());
  EXPECT_EQ(pieces.numbering(), 4000);
  pieces.begin_step();
  pieces.store(0, b.narrow(0, 700, 1300));
  pieces.end_step();
  EXPECT_TRUE(amp_test::bitwise_equal(pieces.param(0), in_order->param(1).narrow(0, 700, 1300)));
  EXPECT_EQ(pieces.counter(), in_order->counter());
  // The next step draws anew; a store outside a step moves the counter by itself.
  in_order->begin_step();
  in_order->store(1, b);
  in_order->end_step();
  EXPECT_FALSE(amp_test::bitwise_equal(in_order->param(1), reversed->param(1)));
  reversed->store(0, a);
  EXPECT_EQ(reversed->counter(), uint64_t{5 + 8000});
}

// NOTE [Lean masters on the device]: value() and store() in ATen ops (a device's route; on the CPU under ATen's route
// forced) give the CPU loops' weights, aux and values bit for bit, for every format and every class of float (signs,
// subnormals, bf16 midpoints, the largest finite values, which round up to inf, inf and NaN), in a step and outside
// one; and a step whose flag the device holds keeps each weight and aux on a skip, its draws held back.
TEST(LeanMastersTest, DeviceRouteIsTheCpuLoopsBitForBit) {
  torch::manual_seed(4);
  const auto values = torch::cat(
      {torch::randn({5000}) * torch::logspace(-44, 38, 5000), torch::randn({1000}),
       torch::tensor({0.0f, -0.0f, 1e-45f, -3e-41f, 1.00390625f, -1.01171875f, 3.3961776e38f,
                      std::numeric_limits<float>::max(), -std::numeric_limits<float>::infinity(),
                      std::numeric_limits<float>::quiet_NaN()})});
  const auto later = values * 1.001f + 1e-3f;
  for (const auto format : {MasterWeights::kSplit, MasterWeights::kKahan, MasterWeights::kStochasticRounding,
                            MasterWeights::kResidual8}) {
    SCOPED_TRACE(amp::to_string(format));
    auto table = [&] {
      auto t = std::make_shared<amp::detail::LeanMasters>(format, 77, 9);
      t->add("a", torch::zeros({17}, torch::kBFloat16));
      t->add("b", values.clone());
      t->cast_from_float(1);  // a store outside a step
      return t;
    };
    auto run = [&](bool device_route, bool skip) {
      std::optional<amp::optim::detail::FusedRouteGuard> route;
      if (device_route) route.emplace(amp::optim::detail::FusedRoute::kAten);
      auto t = table();
      std::vector<torch::Tensor> out{t->value(1)};
      t->begin_step(skip ? torch::ones({}) : torch::Tensor());
      t->store(1, later);
      t->end_step();
      if (skip) t->rewind_step();  // the host learns of the skip
      out.push_back(t->param(1).clone());
      if (t->aux(1).defined()) out.push_back(t->aux(1).clone());
      out.push_back(t->value(1));
      t->begin_step();
      t->store(1, later * 3);  // the next step draws what the host's run draws
      t->end_step();
      out.push_back(t->param(1).clone());
      out.push_back(torch::tensor(static_cast<int64_t>(t->counter())));
      return out;
    };
    const auto host = run(false, false), device = run(true, false);
    ASSERT_EQ(host.size(), device.size());
    for (size_t i = 0; i < host.size(); ++i) {
      EXPECT_TRUE(torch::equal(host[i].view({-1}).view(torch::kByte), device[i].view({-1}).view(torch::kByte))) << i;
    }
    // Skipped on the device: the weight, aux and value as cast, then the same next step as a run without the skip's
    // store.
    auto unskipped = [&] {
      auto t = table();
      std::vector<torch::Tensor> out{t->value(1), t->param(1).clone()};
      if (t->aux(1).defined()) out.push_back(t->aux(1).clone());
      out.push_back(t->value(1));
      t->begin_step();
      t->store(1, later * 3);
      t->end_step();
      out.push_back(t->param(1).clone());
      out.push_back(torch::tensor(static_cast<int64_t>(t->counter())));
      return out;
    }();
    const auto skipped = run(true, true);
    for (size_t i = 0; i < skipped.size(); ++i) {
      EXPECT_TRUE(torch::equal(skipped[i].view({-1}).view(torch::kByte), unskipped[i].view({-1}).view(torch::kByte))) << i;
    }
  }
}

TEST(Residual8ReferenceTest, WeightResidualAndValueAreFlashOptimsBits) {
  if (!amp_test::python_has_torch()) GTEST_SKIP() << "needs Python with the torch wheel (AMP_PYTHON)";
  const auto dir = amp_test::run_python_reference(AMP_SOURCE_DIR "/tests/python/residual8.py", "residual8");
  ASSERT_FALSE(dir.empty());
  const auto reference = amp::PythonCheckpoint::load((dir / "residual8.pt").string());
  const torch::Tensor x = reference.get("x").toTensor();
  amp::detail::LeanMasters lean(MasterWeights::kResidual8, 0);
  lean.add("x", x.clone());
  lean.cast_from_float(0);  // initialize's cast: the fp32 value stored as weight + residual
  EXPECT_TRUE(amp_test::bitwise_equal(lean.param(0), reference.get("weight").toTensor()));
  EXPECT_TRUE(amp_test::bitwise_equal(lean.aux(0), reference.get("residual").toTensor()));
  EXPECT_TRUE(amp_test::bitwise_equal(lean.value(0), reference.get("value").toTensor()));
  const torch::Tensor w2 = reference.get("w2").toTensor().contiguous(), r2 = reference.get("r2").toTensor().contiguous();
  torch::Tensor v2 = torch::empty(w2.sizes(), torch::kFloat);
  amp::detail::residual8_decode(reinterpret_cast<const uint16_t*>(w2.data_ptr()), r2.data_ptr<int8_t>(),
                                v2.data_ptr<float>(), w2.numel());
  EXPECT_TRUE(amp_test::bitwise_equal(v2, reference.get("v2").toTensor()));
}

TEST(LeanMastersTest, Residual8KeepsTheValueTo1Over254OfAnUlp) {
  torch::manual_seed(0);
  const auto value = torch::randn({1000}) * 3;
  amp::detail::LeanMasters lean(MasterWeights::kResidual8, 0);
  lean.add("w", torch::zeros({1000}, torch::kBFloat16));
  lean.store(0, value);
  EXPECT_TRUE(amp_test::bitwise_equal(lean.param(0), value.to(torch::kBFloat16))) << "the weight is rounded to nearest";
  EXPECT_EQ(lean.aux(0).scalar_type(), torch::kChar);
  // |value() - value| <= half an ulp / 127 / 2 (the residual's own rounding) plus the float arithmetic's last bit.
  const auto w = lean.param(0).to(torch::kFloat);
  const auto ulp = torch::pow(2.0, torch::floor(torch::log2(w.abs())) - 7);
  const auto error = (lean.value(0) - value).abs();
  EXPECT_TRUE((error <= ulp / 2 / 127 / 2 + value.abs() * std::ldexp(1.0, -23)).all().item<bool>()) << error.max().item<double>();
}

// ---- training with each format ---------------------------------------------------------------------

class LeanFormatTest : public ::testing::TestWithParam<MasterWeights> {
 protected:
  void SetUp() override { SKIP_WITHOUT_CPU_KERNELS(torch::kBFloat16); }
};

std::string format_name(const ::testing::TestParamInfo<MasterWeights>& info) { return amp::to_string(info.param); }

TEST_P(LeanFormatTest, InitializeCastsToBf16AndKeepsTheFp32Value) {
  auto net = lmw_net();
  std::vector<torch::Tensor> original;
  for (const auto& p : net->parameters()) original.push_back(p.detach().clone());
  auto [model, optimizer] = amp::initialize(net, amp::optim::FusedAdam(net->parameters(), torch::optim::AdamOptions(1e-3)),
                                            lean_options(GetParam()));
  const auto params = net->parameters();
  const auto values = fp32_values(*net);
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(params[i].scalar_type(), torch::kBFloat16);
    const auto& value = values[i];
    if (GetParam() == MasterWeights::kStochasticRounding) {
      // No master: the weight is one of the value's two bf16 neighbours.
      EXPECT_TRUE(((value - original[i]).abs() <= original[i].abs() * std::ldexp(1.0, -7)).all().item<bool>());
    } else if (GetParam() == MasterWeights::kSplit) {
      EXPECT_TRUE(amp_test::bitwise_equal(value, original[i])) << "parameter " << i;
    } else {
      EXPECT_TRUE(((value - original[i]).abs() <= original[i].abs() * std::ldexp(1.0, -16)).all().item<bool>());
    }
  }
  // The optimizer steps the model's parameters themselves: no fp32 copies.
  EXPECT_EQ(optimizer.master_params().front().unsafeGetTensorImpl(), params.front().unsafeGetTensorImpl());
}

TEST_P(LeanFormatTest, SkipsOverflowsAndResumesBitwise) {
  auto net_a = lmw_net();
  torch::manual_seed(11);  // the stochastic rounding seed comes from here
  auto [model_a, opt_a] = amp::initialize(net_a, amp::optim::FusedAdamW(net_a->parameters(), torch::optim::AdamWOptions(1e-2)),
                                          lean_options(GetParam()));
  for (int s = 0; s < 3; ++s) lmw_step_with(net_a, opt_a, s);
  // An overflowing step changes nothing: weights, low bits / compensation, generator.
  const auto before = fp32_values(*net_a);
  std::vector<torch::Tensor> weights_before;
  for (const auto& p : net_a->parameters()) weights_before.push_back(p.detach().clone());
  const auto lean = amp::detail::find_lean(net_a->parameters().front())->first;
  const uint64_t counter_before = lean->counter();
  lmw_step_with(net_a, opt_a, 99, /*overflow=*/true);
  EXPECT_EQ(opt_a.skipped_steps(), 1);
  const auto after = fp32_values(*net_a);
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_TRUE(amp_test::bitwise_equal(before[i], after[i]));
    EXPECT_TRUE(amp_test::bitwise_equal(weights_before[i], net_a->parameters()[i].detach()));
  }
  EXPECT_EQ(lean->counter(), counter_before);

  std::stringstream model_bytes, opt_bytes;
  torch::save(net_a, model_bytes);
  torch::save(opt_a, opt_bytes);
  for (int s = 3; s < 6; ++s) lmw_step_with(net_a, opt_a, s);

  // Either load order: the model's bf16 weights loaded after the optimizer repeat the weights its low bits /
  // compensation were saved with, so the fp32 values stay whole.
  // amp::load_weights of the bf16 file (the way that works under ZeRO) is such a write too.
  for (const int order : {0, 1, 2}) {
    const bool model_first = order == 0;
    SCOPED_TRACE(order == 0 ? "model loaded first" : order == 1 ? "optimizer loaded first" : "optimizer, then load_weights");
    auto net_b = lmw_net();
    torch::manual_seed(11);
    auto [model_b, opt_b] = amp::initialize(net_b, amp::optim::FusedAdamW(net_b->parameters(), torch::optim::AdamWOptions(1e-2)),
                                            lean_options(GetParam()));
    torch::manual_seed(12345);  // another seed: the archive's generator state must win
    model_bytes.seekg(0), opt_bytes.seekg(0);
    if (model_first) torch::load(net_b, model_bytes);
    torch::load(opt_b, opt_bytes);
    if (order == 1) torch::load(net_b, model_bytes);
    if (order == 2) {
      torch::serialize::InputArchive archive;
      archive.load_from(model_bytes);
      amp::load_weights(*net_b, archive);
    }
    for (int s = 3; s < 6; ++s) lmw_step_with(net_b, opt_b, s);
    const auto va = fp32_values(*net_a), vb = fp32_values(*net_b);
    for (size_t i = 0; i < va.size(); ++i) {
      EXPECT_TRUE(amp_test::bitwise_equal(va[i], vb[i])) << "value " << i;
      EXPECT_TRUE(amp_test::bitwise_equal(net_a->parameters()[i], net_b->parameters()[i])) << "weight " << i;
    }
  }
}

TEST_P(LeanFormatTest, SameSeedSameRunAndLoadWeightsStoresTheFp32Value) {
  auto run = [&](uint64_t seed) {
    auto net = lmw_net();
    torch::manual_seed(seed);
    auto [model, optimizer] = amp::initialize(net, amp::optim::FusedSGD(net->parameters(), torch::optim::SGDOptions(0.1)),
                                              lean_options(GetParam()));
    for (int s = 0; s < 4; ++s) lmw_step_with(net, optimizer, s);
    return fp32_values(*net);
  };
  const auto a = run(5), b = run(5);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(amp_test::bitwise_equal(a[i], b[i]));

  // load_weights writes the checkpoint's fp32 value into the lean form (split: exactly), and an in-place edit of a
  // weight makes the weight the value (its low bits / compensation are dropped).
  auto net = lmw_net();
  torch::manual_seed(0);
  const auto fp32_weight = torch::randn({16, 8});
  auto [model, optimizer] = amp::initialize(net, amp::optim::FusedSGD(net->parameters(), torch::optim::SGDOptions(0.1)),
                                            lean_options(GetParam()));
  const std::string path = ::testing::TempDir() + "/lean_masters_weights.pt";
  {
    auto plain = lmw_net();
    torch::NoGradGuard no_grad;
    plain->a->weight.copy_(fp32_weight);
    torch::save(plain, path);
  }
  amp::load_weights(*net, path);
  const auto loaded = fp32_values(*net)[0];
  if (GetParam() == MasterWeights::kSplit) EXPECT_TRUE(amp_test::bitwise_equal(loaded, fp32_weight));
  if (GetParam() == MasterWeights::kKahan) {
    EXPECT_TRUE(((loaded - fp32_weight).abs() <= fp32_weight.abs() * std::ldexp(1.0, -16)).all().item<bool>());
  }
  torch::NoGradGuard no_grad;
  net->a->weight.fill_(0.25);
  amp::detail::find_lean(net->a->weight)->first->refresh_changed();  // what the next step does first
  EXPECT_TRUE(amp_test::bitwise_equal(fp32_values(*net)[0], torch::full({16, 8}, 0.25)));
}

// Python checkpoints hold the fp32 state_dict Apex's O2 writes: the lean form's fp32 value. Loading it back stores
// that value (split: exactly; kahan: the same weight and compensation), so with the optimizer's fp32 state the run
// continues bitwise; stochastic rounding's generator is not part of Python's format, so there only the values match.
TEST_P(LeanFormatTest, PythonCheckpointsHoldTheFp32ValueAndResume) {
  auto net_a = lmw_net();
  torch::manual_seed(11);
  auto [model_a, opt_a] = amp::initialize(net_a, amp::optim::FusedAdam(net_a->parameters(), torch::optim::AdamOptions(1e-2)),
                                          lean_options(GetParam()));
  for (int s = 0; s < 3; ++s) lmw_step_with(net_a, opt_a, s);
  amp::PythonCheckpoint checkpoint;
  checkpoint.put_model("model", *net_a);
  checkpoint.put_optimizer("optimizer", opt_a);
  checkpoint.put_amp("amp", opt_a);
  const std::string path = ::testing::TempDir() + "/lean_masters_python.pt";
  checkpoint.save(path);
  const auto saved = amp::PythonCheckpoint::load(path).get("model").toGenericDict();
  const auto values = fp32_values(*net_a);
  size_t i = 0;
  for (const auto& item : net_a->named_parameters()) {
    const auto t = saved.at(item.key()).toTensor();
    EXPECT_EQ(t.scalar_type(), torch::kFloat);
    EXPECT_TRUE(amp_test::bitwise_equal(t, values[i++])) << item.key();
  }
  for (int s = 3; s < 5; ++s) lmw_step_with(net_a, opt_a, s);

  auto net_b = lmw_net();
  torch::manual_seed(11);
  auto [model_b, opt_b] = amp::initialize(net_b, amp::optim::FusedAdam(net_b->parameters(), torch::optim::AdamOptions(1e-2)),
                                          lean_options(GetParam()));
  const auto loaded = amp::PythonCheckpoint::load(path);
  loaded.load_model(*net_b);
  loaded.load_optimizer(opt_b);
  loaded.load_amp(opt_b);
  for (const auto& [key, state] : opt_b.state()) {
    const auto& adam = static_cast<const torch::optim::AdamParamState&>(*state);
    EXPECT_EQ(adam.exp_avg().scalar_type(), torch::kFloat) << "the optimizer state stays fp32";
  }
  const auto restored = fp32_values(*net_b);
  for (size_t k = 0; k < restored.size(); ++k) EXPECT_TRUE(amp_test::bitwise_equal(restored[k], values[k])) << k;
  if (GetParam() == MasterWeights::kStochasticRounding) return;
  for (int s = 3; s < 5; ++s) lmw_step_with(net_b, opt_b, s);
  const auto va = fp32_values(*net_a), vb = fp32_values(*net_b);
  for (size_t k = 0; k < va.size(); ++k) EXPECT_TRUE(amp_test::bitwise_equal(va[k], vb[k])) << "value " << k;
}

// A param group added after initialize is adopted with a lean master too (its fp32 value kept from the cast).
TEST_P(LeanFormatTest, GroupAddedAfterInitializeGetsALeanMaster) {
  auto net = lmw_net();
  const auto original = net->b->weight.detach().clone();
  auto [model, optimizer] = amp::initialize(net, amp::optim::FusedSGD(net->a->parameters(), torch::optim::SGDOptions(0.1)),
                                            lean_options(GetParam()));
  // initialize casts the whole model; b's weight, outside the optimizer, is rounded to nearest and has no lean master.
  EXPECT_FALSE(amp::detail::find_lean(net->b->weight));
  optimizer.add_param_group(torch::optim::OptimizerParamGroup(net->b->parameters()));
  lmw_step_with(net, optimizer, 0);
  const auto found = amp::detail::find_lean(net->b->weight);
  ASSERT_TRUE(found);
  EXPECT_EQ(net->b->weight.scalar_type(), torch::kBFloat16);
  // Its step started from the bf16 weight (exact, aux 0) and moved it by -lr * gradient in fp32.
  const auto g = lmw_gradients(net, 0)[2].to(torch::kBFloat16).to(torch::kFloat);
  const auto expected = original.to(torch::kBFloat16).to(torch::kFloat).add(g, -0.1f);
  const auto value = found->first->value(found->second);
  if (GetParam() == MasterWeights::kSplit) EXPECT_TRUE(amp_test::bitwise_equal(value, expected));
  EXPECT_TRUE(((value - expected).abs() <= expected.abs() * std::ldexp(1.0, -7)).all().item<bool>());
}

// clip_grad_norm_ clips the bf16 gradients the lean step reads: the norm is kCopy's (whose fp32 master gradients
// are those bf16 gradients widened), and after clipping their norm is max_norm to bf16 rounding.
TEST_P(LeanFormatTest, ClipGradNormClipsTheGradientsTheStepReads) {
  auto norm_with = [&](MasterWeights format, double* clipped_norm) {
    auto net = lmw_net();
    auto [model, optimizer] = amp::initialize(net, amp::optim::FusedSGD(net->parameters(), torch::optim::SGDOptions(0.1)),
                                              lean_options(format));
    optimizer.zero_grad();
    const auto g = lmw_gradients(net, 0);
    const auto params = net->parameters();
    torch::Tensor loss = torch::zeros({}, torch::kFloat);
    for (size_t i = 0; i < params.size(); ++i) loss = loss + (params[i] * g[i].to(torch::kBFloat16)).sum().to(torch::kFloat);
    {
      auto scaled = amp::scale_loss(loss, optimizer);
      scaled.backward();
    }
    const double norm = amp::clip_grad_norm_(optimizer, 0.5).item<double>();
    std::vector<torch::Tensor> flat;
    for (const auto& p : optimizer.master_params()) flat.push_back(p.grad().to(torch::kFloat).flatten());
    *clipped_norm = torch::cat(flat).norm().item<double>();
    return norm;
  };
  double copy_clipped = 0, lean_clipped = 0;
  const double copy = norm_with(MasterWeights::kCopy, &copy_clipped);
  const double lean = norm_with(GetParam(), &lean_clipped);
  EXPECT_GT(copy, 0.5);
  EXPECT_EQ(lean, copy);
  EXPECT_NEAR(copy_clipped, 0.5, 1e-5);
  EXPECT_NEAR(lean_clipped, 0.5, 0.5 * std::ldexp(1.0, -8));
}

INSTANTIATE_TEST_SUITE_P(Formats, LeanFormatTest, ::testing::ValuesIn(kLeanFormats), format_name);

// The stalling task: linear regression whose 64 weights start at 1 with optima in [1, 1.08], where each SGD update
// (at most 2 lr 0.08 = 1.6e-3) is less than half a bf16 ulp (2^-8 there). O3's round-to-nearest updates vanish and
// the loss (about the sum of the weights' squared errors, 0.14 at the start) never moves; every O2 format reaches
// O2 kCopy's loss. The tolerance is the forward's bf16 weights: once each weight is within one ulp (2^-7) of its
// optimum, the loss is at most 64 ulp^2 = 3.9e-3 above the optimum.
TEST(LeanFormatQualityTest, UpdatesBelowHalfAnUlpStallO3ButNotTheLeanFormats) {
  SKIP_WITHOUT_CPU_KERNELS(torch::kBFloat16);
  constexpr int64_t dim = 64, batch = 256;
  torch::manual_seed(0);
  const auto target = 1.0 + 0.08 * torch::rand({1, dim});
  auto train = [&](const amp::Options& options) {
    torch::manual_seed(1);
    auto net = torch::nn::Linear(torch::nn::LinearOptions(dim, 1).bias(false));
    {
      torch::NoGradGuard no_grad;
      net->weight.fill_(1.0);
    }
    auto [model, optimizer] = amp::initialize(net, amp::optim::FusedSGD(net->parameters(), torch::optim::SGDOptions(0.01)), options);
    double first = 0, last = 0;
    torch::manual_seed(2);
    for (int s = 0; s < 400; ++s) {
      const auto x = torch::randn({batch, dim});
      const auto y = torch::matmul(x, target.t());
      optimizer.zero_grad();
      const auto loss = torch::mse_loss(model(x), y);
      {
        auto scaled = amp::scale_loss(loss, optimizer);
        scaled.backward();
      }
      optimizer.step();
      if (s == 0) first = loss.item<double>();
      last = loss.item<double>();
    }
    return std::make_pair(first, last);
  };
  const auto o2 = train(lean_options(MasterWeights::kCopy));
  const auto o3 = train(amp::Options("O3").low_precision_dtype(torch::kBFloat16).verbosity(0));
  std::printf("[ curves   ] first -> last loss: O2 copy %.3g -> %.3g, O3 %.3g -> %.3g", o2.first, o2.second, o3.first, o3.second);
  EXPECT_LT(o2.second, 0.1 * o2.first);
  EXPECT_GT(o3.second, 0.9 * o3.first) << "O3's updates should vanish in bf16 here";
  for (const auto format : kLeanFormats) {
    const auto lean = train(lean_options(format));
    std::printf(", %s %.3g -> %.3g", amp::to_string(format), lean.first, lean.second);
    EXPECT_LT(lean.second, o2.second + dim * std::ldexp(1.0, -14)) << amp::to_string(format);
  }
  std::printf("\n");
}

// State bytes per parameter held between steps with Adam (weights, gradients, moments, masters / low bits), the
// gradients kept (zero_grad(false)): kCopy 18 (bf16 weight 2, fp32 master 4 and its gradient 4, moments 8; amp
// drops the bf16 gradient once it is unscaled into the master's, which Apex's count of 20 keeps), split and kahan
// 14 (weight 2, bf16 gradient 2, moments 8, low bits / compensation 2), stochastic rounding 12, residual8 13.
TEST(LeanFormatMemoryTest, BytesPerParameterBetweenSteps) {
  SKIP_WITHOUT_CPU_KERNELS(torch::kBFloat16);
  MemoryMeter& meter = MemoryMeter::install();
  const auto x = torch::randn({8, 512});
  auto bytes_per_param = [&](const amp::Options& options) {
    const size_t baseline = meter.current_bytes();
    double result = 0;
    {
      torch::manual_seed(0);
      auto net = torch::nn::Linear(512, 512);
      const double params = 512.0 * 513.0;
      auto [model, optimizer] = amp::initialize(net, amp::optim::FusedAdam(net->parameters(), torch::optim::AdamOptions(1e-3)), options);
      for (int s = 0; s < 2; ++s) {
        optimizer.zero_grad(/*set_to_none=*/false);
        const auto loss = model(x).pow(2).mean();
        {
          auto scaled = amp::scale_loss(loss, optimizer);
          scaled.backward();
        }
        optimizer.step();
      }
      result = static_cast<double>(meter.current_bytes() - baseline) / params;
    }
    return result;
  };
  const double copy = bytes_per_param(lean_options(MasterWeights::kCopy));
  const double split = bytes_per_param(lean_options(MasterWeights::kSplit));
  const double sr = bytes_per_param(lean_options(MasterWeights::kStochasticRounding));
  const double kahan = bytes_per_param(lean_options(MasterWeights::kKahan));
  const double residual8 = bytes_per_param(lean_options(MasterWeights::kResidual8));
  std::printf("[ B/param  ] copy %.2f, split %.2f, stochastic_rounding %.2f, kahan %.2f, residual8 %.2f\n", copy, split,
              sr, kahan, residual8);
  // Within 0.1 B/param of the count (a few scalars and the loss scaler's tensors are the rest).
  EXPECT_NEAR(copy, 18.0, 0.1);
  EXPECT_NEAR(split, 14.0, 0.1);
  EXPECT_NEAR(sr, 12.0, 0.1);
  EXPECT_NEAR(kahan, 14.0, 0.1);
  EXPECT_NEAR(residual8, 13.0, 0.1);
}

// ---- errors ----------------------------------------------------------------------------------------

TEST(LeanFormatErrorsTest, OptionsRefuseWhatCannotHoldALeanMaster) {
  ASSERT_THROWS_WITH(amp::Options("O2").low_precision_dtype(torch::kHalf).master_weights_format(MasterWeights::kSplit).resolve(),
                     "master_weights_format split keeps the fp32 value in a bfloat16 weight (plus 0, 1 or 2 bytes), which "
                     "needs bfloat16's fp32-wide exponent; got torch.float16. float16's range needs a separate fp32 "
                     "master: use master_weights_format copy, or low_precision_dtype bfloat16.");
  ASSERT_THROWS_WITH(amp::Options("O3").low_precision_dtype(torch::kBFloat16).master_weights_format(MasterWeights::kKahan).resolve(),
                     "master_weights_format kahan is a form of O2's master weights, so it needs a model cast to "
                     "bfloat16 with master_weights on; got opt_level O3 with master_weights False.");
  ASSERT_THROWS_WITH(amp::Options("O1").master_weights_format(MasterWeights::kStochasticRounding).resolve(),
                     "got opt_level O1 with master_weights False");
  EXPECT_EQ(amp::Options("O1").master_weights_format(MasterWeights::kCopy).resolve().master_weights_format, MasterWeights::kCopy);
  EXPECT_EQ(amp::Options("O3").low_precision_dtype(torch::kBFloat16).master_weights(true)
                .master_weights_format(MasterWeights::kSplit).resolve().master_weights_format,
            MasterWeights::kSplit);
}

TEST(LeanFormatErrorsTest, ConfigKeyAndItsBadValue) {
  auto config = [](const std::string& text) {
    const std::string path = ::testing::TempDir() + "/lean_masters.cfg";
    std::ofstream(path) << text;
    return path;
  };
  const auto options = amp::load_options(config("opt_level = O2\nlow_precision_dtype = bfloat16\nmaster_weights_format = stochastic_rounding\n"));
  EXPECT_EQ(options.resolve().master_weights_format, MasterWeights::kStochasticRounding);
  const std::string bad = config("opt_level = O2\nmaster_weights_format = fp32\n");
  ASSERT_THROWS_WITH(amp::load_options(bad), "master_weights_format");
  ASSERT_THROWS_WITH(amp::load_options(bad), "expected copy, split, stochastic_rounding, kahan or residual8");
}

TEST(LeanFormatErrorsTest, InitializeRefusesOptimizersThatCannotRebuildTheValue) {
  auto net = lmw_net();
  ASSERT_THROWS_WITH(amp::initialize(net, torch::optim::Adam(net->parameters()), lean_options(MasterWeights::kSplit)),
                     "amp::initialize: master_weights_format split rebuilds each bf16 parameter's fp32 value inside the "
                     "optimizer's step, which only amp's fused optimizers do; this optimizer is "
                     "amp::Optimizer<torch::optim::Adam>. Use amp::optim::FusedSGD, FusedAdam, FusedAdamW, FusedLAMB or FusedMuon");
  EXPECT_EQ(net->parameters().front().scalar_type(), torch::kFloat) << "a refused initialize leaves the model as it was";
}

TEST(LeanFormatErrorsTest, ResumeWithAnotherFormatIsRefused) {
  SKIP_WITHOUT_CPU_KERNELS(torch::kBFloat16);
  auto net = lmw_net();
  auto [model, optimizer] = amp::initialize(net, amp::optim::FusedAdam(net->parameters()), lean_options(MasterWeights::kKahan));
  lmw_step_with(net, optimizer, 0);
  std::stringstream bytes;
  torch::save(optimizer, bytes);
  for (const auto other : {MasterWeights::kCopy, MasterWeights::kSplit}) {
    auto net2 = lmw_net();
    auto [model2, optimizer2] = amp::initialize(net2, amp::optim::FusedAdam(net2->parameters()), lean_options(other));
    std::stringstream copy(bytes.str());
    ASSERT_THROWS_WITH(torch::load(optimizer2, copy),
                       std::string("amp::Optimizer::load: the checkpoint was saved with master_weights_format kahan, this "
                                   "optimizer runs with ") + amp::to_string(other) + ". Resume with the format the checkpoint was saved with");
  }
}

}  // namespace
