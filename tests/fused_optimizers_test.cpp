// amp::optim::FusedSGD / FusedAdam / FusedAdamW: the same trajectories as LibTorch's SGD / Adam / AdamW
// on each route (amp's CPU loop, ATen's fused kernels, per-op), interchangeable checkpoints, schedulers and
// param groups, errors; and inside amp at every level: the O2 step that also writes the model's copy equals
// the unfused step bitwise, a skipped step changes nothing, resume is bitwise. Ports the idea of PyTorch's
// test_optim fused-vs-for-loop comparisons (TestOptimRenewed.test_fused_matches_forloop) and Apex's
// tests/L0/run_optimizers/test_adam.py (FusedAdam against torch.optim.Adam, many shapes, then a step).
#include <cstdio>
#include <filesystem>
#include <functional>

#include "amp/fused_optimizers.h"
#include "fused_route.h"
#include "optimizer_state_key.h"
#include "support.h"

namespace {

using amp::optim::detail::FusedRoute;

// Restores the default route when a test forced another.
struct RouteGuard {
  explicit RouteGuard(FusedRoute route) { amp::optim::detail::force_fused_route(route); }
  ~RouteGuard() { amp::optim::detail::force_fused_route(FusedRoute::kAuto); }
};

// Sizes around the loops' vector widths and the 4096-element chunk of the O2 model copy.
std::vector<torch::Tensor> make_params(c10::ScalarType dtype = torch::kFloat) {
  torch::manual_seed(0);
  std::vector<torch::Tensor> params;
  for (int64_t n : {1, 7, 33, 4095, 4097, 10000}) params.push_back(torch::randn({n}).to(dtype).requires_grad_(true));
  params.push_back(torch::randn({17, 9}).to(dtype).requires_grad_(true));
  return params;
}

std::vector<torch::Tensor> clone_params(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> out;
  for (const auto& p : params) out.push_back(p.detach().clone().requires_grad_(true));
  return out;
}

// The same gradients into both lists, a new draw per step (some exactly zero, as dead units give).
void set_grads(int step, std::vector<torch::Tensor>& a, std::vector<torch::Tensor>& b) {
  torch::manual_seed(100 + step);
  for (size_t i = 0; i < a.size(); ++i) {
    auto g = torch::randn(a[i].sizes()) * torch::bernoulli(torch::full(a[i].sizes(), 0.9));
    a[i].mutable_grad() = g.to(a[i].scalar_type());
    b[i].mutable_grad() = g.to(b[i].scalar_type());
  }
}

// The largest difference between two tensors in units of the reference's magnitude (|x| + 1e-3).
double relative_error(const torch::Tensor& a, const torch::Tensor& b) {
  const auto x = a.to(torch::kDouble), y = b.to(torch::kDouble);
  return ((x - y).abs() / (y.abs() + 1e-3)).max().item<double>();
}

struct OptimizerCase {
  std::string name;
  std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)> fused, reference;
  bool bitwise_with_libtorch;  // NOTE [Fused step arithmetic]: SGD yes; Adam's sqrt is ATen's vectorized one
};

std::vector<OptimizerCase> optimizer_cases() {
  using namespace torch::optim;
  using amp::optim::FusedAdam;
  using amp::optim::FusedAdamW;
  using amp::optim::FusedSGD;
  std::vector<OptimizerCase> cases;
  auto add = [&](std::string name, auto make_fused, auto make_reference) {
    const bool sgd = name.rfind("sgd", 0) == 0;
    cases.push_back({std::move(name), make_fused, make_reference, sgd});
  };
  for (const auto& [label, options] : std::vector<std::pair<std::string, SGDOptions>>{
           {"sgd", SGDOptions(0.1)},
           {"sgd_momentum", SGDOptions(0.1).momentum(0.9)},
           {"sgd_dampening_wd", SGDOptions(0.05).momentum(0.8).dampening(0.3).weight_decay(0.01)},
           {"sgd_nesterov", SGDOptions(0.1).momentum(0.9).nesterov(true).weight_decay(1e-4)}}) {
    add(label, [o = options](std::vector<torch::Tensor> p) { return std::make_unique<FusedSGD>(p, o); },
        [o = options](std::vector<torch::Tensor> p) { return std::make_unique<SGD>(p, o); });
  }
  for (const auto& [label, options] : std::vector<std::pair<std::string, AdamOptions>>{
           {"adam", AdamOptions(1e-2)},
           {"adam_wd", AdamOptions(1e-2).weight_decay(0.1)},
           {"adam_amsgrad", AdamOptions(1e-2).amsgrad(true).betas({0.8, 0.99})}}) {
    add(label, [o = options](std::vector<torch::Tensor> p) { return std::make_unique<FusedAdam>(p, o); },
        [o = options](std::vector<torch::Tensor> p) { return std::make_unique<Adam>(p, o); });
  }
  for (const auto& [label, options] : std::vector<std::pair<std::string, AdamWOptions>>{
           {"adamw", AdamWOptions(1e-2)},
           {"adamw_amsgrad", AdamWOptions(1e-2).weight_decay(0.05).amsgrad(true)}}) {
    add(label, [o = options](std::vector<torch::Tensor> p) { return std::make_unique<FusedAdamW>(p, o); },
        [o = options](std::vector<torch::Tensor> p) { return std::make_unique<AdamW>(p, o); });
  }
  return cases;
}

// A fused optimizer and LibTorch's on equal copies of make_params(dtype).
struct Pair {
  std::vector<torch::Tensor> a, b;
  std::unique_ptr<torch::optim::Optimizer> fused, reference;
  Pair(const OptimizerCase& c, c10::ScalarType dtype = torch::kFloat)
      : a(make_params(dtype)), b(clone_params(a)), fused(c.fused(a)), reference(c.reference(b)) {}
  void step(int s) {
    set_grads(s, a, b);
    fused->step();
    reference->step();
  }
};

// Runs `steps` steps of the fused optimizer and LibTorch's on the same gradients; returns the largest
// relative difference of any parameter after any step.
double max_trajectory_error(const OptimizerCase& c, c10::ScalarType dtype, int steps, bool expect_bitwise) {
  Pair pair(c, dtype);
  auto& [a, b, fused, reference] = pair;
  double worst = 0;
  for (int s = 0; s < steps; ++s) {
    pair.step(s);
    for (size_t i = 0; i < a.size(); ++i) {
      if (expect_bitwise) EXPECT_TRUE(amp_test::bitwise_equal(a[i], b[i])) << c.name << " step " << s << " param " << i;
      worst = std::max(worst, relative_error(a[i], b[i]));
    }
  }
  return worst;
}

}  // namespace

// amp's CPU loop against LibTorch's op-by-op step (NOTE [Fused step arithmetic]): SGD bit for bit; Adam and
// AdamW differ only through ATen's vectorized sqrt, which is not IEEE's correctly rounded one, so they stay
// within a few float32 ulps over 20 steps.
TEST(FusedOptimizersTest, MatchLibTorchsOptimizers) {
  for (const auto& c : optimizer_cases()) {
    const double error = max_trajectory_error(c, torch::kFloat, 20, c.bitwise_with_libtorch);
    EXPECT_LE(error, 1e-5) << c.name;
    std::printf("%-18s amp's CPU loop vs LibTorch: largest relative difference over 20 steps %.3g\n", c.name.c_str(),
                error);
  }
}

// Adam's moments do not go through sqrt: without L2 weight decay (which reads the parameter) they are
// LibTorch's bit for bit, step after step.
TEST(FusedOptimizersTest, AdamMomentsAreLibTorchsBitForBit) {
  auto moments = [](torch::optim::Optimizer& opt, const torch::Tensor& p) -> std::pair<torch::Tensor, torch::Tensor> {
    auto& state = *opt.state().at(amp::detail::state_key(opt.state(), p));
    if (auto* adam = dynamic_cast<torch::optim::AdamParamState*>(&state)) return {adam->exp_avg(), adam->exp_avg_sq()};
    auto& adamw = dynamic_cast<torch::optim::AdamWParamState&>(state);
    return {adamw.exp_avg(), adamw.exp_avg_sq()};
  };
  for (const auto& c : optimizer_cases()) {
    if (c.bitwise_with_libtorch || c.name == "adam_wd") continue;
    Pair pair(c);
    for (int s = 0; s < 10; ++s) {
      pair.step(s);
      for (size_t i = 0; i < pair.a.size(); ++i) {
        const auto [m_fused, v_fused] = moments(*pair.fused, pair.a[i]);
        const auto [m_ref, v_ref] = moments(*pair.reference, pair.b[i]);
        ASSERT_TRUE(amp_test::bitwise_equal(m_fused, m_ref)) << c.name << " exp_avg, step " << s << " param " << i;
        ASSERT_TRUE(amp_test::bitwise_equal(v_fused, v_ref)) << c.name << " exp_avg_sq, step " << s << " param " << i;
      }
    }
  }
}

// The per-op route is LibTorch's algorithm itself: bitwise, in fp32 and in the low precision O3 keeps
// parameters in (where amp's loop does not apply).
TEST(FusedOptimizersTest, PerOpRouteIsBitwiseLibTorch) {
  for (const auto& c : optimizer_cases()) {
    {
      RouteGuard route(FusedRoute::kPerOp);
      max_trajectory_error(c, torch::kFloat, 5, /*expect_bitwise=*/true);
    }
    max_trajectory_error(c, torch::kBFloat16, 5, /*expect_bitwise=*/true);  // the default route for bf16 params
  }
}

// ATen's fused kernels (what CUDA parameters take) through the same code path, run here on their CPU
// implementations (LibTorch >= 2.4). PyTorch tests them against its for-loop with float32 tolerances.
TEST(FusedOptimizersTest, AtenRouteMatchesLibTorch) {
  if (!amp::optim::detail::has_aten_fused_optimizers()) {
    GTEST_SKIP() << "this LibTorch (" << TORCH_VERSION << ") has no ATen fused optimizer kernels (LibTorch >= 2.4)";
  }
  RouteGuard route(FusedRoute::kAten);
  for (const auto& c : optimizer_cases()) {
    Pair pair(c);
    auto& [a, b, fused, reference] = pair;
    for (int s = 0; s < 20; ++s) pair.step(s);
    for (size_t i = 0; i < a.size(); ++i) {  // PyTorch's float32 assertEqual tolerances
      EXPECT_TRUE(torch::allclose(a[i], b[i], 1.3e-6, 1e-5)) << c.name << " parameter " << i;
    }
  }
}

// torch::save of a fused optimizer loads into LibTorch's and back: the archives are LibTorch's own.
TEST(FusedOptimizersTest, CheckpointsAreInterchangeableWithLibTorchs) {
  for (const auto& c : optimizer_cases()) {
    Pair pair(c);
    auto& [a, b, fused, reference] = pair;
    for (int s = 0; s < 3; ++s) pair.step(s);
    const auto path = std::filesystem::temp_directory_path() / ("amp_fused_" + c.name + ".pt");
    torch::save(*fused, path.string());
    auto b2 = clone_params(a);
    auto reference_from_fused = c.reference(b2);
    torch::load(*reference_from_fused, path.string());
    torch::save(*reference, path.string());
    auto a2 = clone_params(b);
    auto fused_from_reference = c.fused(a2);
    torch::load(*fused_from_reference, path.string());
    std::filesystem::remove(path);
    for (int s = 3; s < 6; ++s) {
      set_grads(s, a2, b2);
      fused_from_reference->step();
      reference_from_fused->step();
      pair.step(s);
    }
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_LE(relative_error(a2[i], b[i]), 1e-5) << c.name << ": fused resumed from LibTorch's checkpoint";
      EXPECT_TRUE(amp_test::bitwise_equal(b2[i], b[i]) || relative_error(b2[i], b[i]) <= 1e-5)
          << c.name << ": LibTorch's resumed from the fused checkpoint";
      EXPECT_TRUE(amp_test::bitwise_equal(a2[i], a[i]) || relative_error(a2[i], a[i]) <= 1e-5) << c.name;
    }
  }
}

// Param groups with their own options, a group added later, and an LR scheduler: all read per step.
TEST(FusedOptimizersTest, ParamGroupsAndSchedulersWork) {
  auto a = make_params();
  auto b = clone_params(a);
  using torch::optim::AdamW;
  using torch::optim::AdamWOptions;
  std::vector<torch::optim::OptimizerParamGroup> groups_a, groups_b;
  auto group = [](const std::vector<torch::Tensor>& p, size_t begin, size_t end, AdamWOptions options) {
    return torch::optim::OptimizerParamGroup(std::vector<torch::Tensor>(p.begin() + begin, p.begin() + end),
                                             std::make_unique<AdamWOptions>(options));
  };
  groups_a.push_back(group(a, 0, 3, AdamWOptions(0.05)));
  groups_b.push_back(group(b, 0, 3, AdamWOptions(0.05)));
  amp::optim::FusedAdamW fused(groups_a, AdamWOptions(1e-2).weight_decay(0.1));
  AdamW reference(groups_b, AdamWOptions(1e-2).weight_decay(0.1));
  torch::optim::StepLR fused_schedule(fused, 2, 0.5), reference_schedule(reference, 2, 0.5);
  for (int s = 0; s < 8; ++s) {
    if (s == 3) {  // progressive unfreezing: the rest of the parameters join with their own options
      fused.add_param_group(group(a, 3, a.size(), AdamWOptions(0.02).amsgrad(true)));
      reference.add_param_group(group(b, 3, b.size(), AdamWOptions(0.02).amsgrad(true)));
    }
    set_grads(s, a, b);
    fused.step();
    reference.step();
    fused_schedule.step();
    reference_schedule.step();
  }
  for (size_t g = 0; g < 2; ++g) {
    EXPECT_EQ(fused.param_groups()[g].options().get_lr(), reference.param_groups()[g].options().get_lr());
  }
  EXPECT_EQ(fused.param_groups()[0].options().get_lr(), 0.05 * 0.5 * 0.5 * 0.5);  // StepLR decayed it 3 times
  for (size_t i = 0; i < a.size(); ++i) EXPECT_LE(relative_error(a[i], b[i]), 1e-5) << "parameter " << i;
}

TEST(FusedOptimizersTest, BadGradientsAndOptionsAreClearErrors) {
  auto embedding = torch::nn::Embedding(torch::nn::EmbeddingOptions(10, 4).sparse(true));
  amp::optim::FusedAdam adam(embedding->parameters(), torch::optim::AdamOptions(1e-3));
  embedding(torch::tensor({1, 2}, torch::kLong)).sum().backward();
  ASSERT_THROWS_WITH(adam.step(),
                     "amp::optim::FusedAdam does not support sparse gradients (parameter 0 of param group 0)");

  // LibTorch checks the constructor's defaults; a group added later is checked at its first step.
  auto p = make_params();
  amp::optim::FusedSGD sgd(std::vector<torch::Tensor>{p[0]}, torch::optim::SGDOptions(0.1));
  sgd.add_param_group({{p[1]}, std::make_unique<torch::optim::SGDOptions>(torch::optim::SGDOptions(-0.5))});
  p[0].mutable_grad() = torch::ones_like(p[0]);
  p[1].mutable_grad() = torch::ones_like(p[1]);
  const auto p0_before = p[0].detach().clone();
  ASSERT_THROWS_WITH(sgd.step(), "amp::optim::FusedSGD: invalid learning rate -0.5 in param group 1; use lr >= 0.");
  EXPECT_TRUE(amp_test::bitwise_equal(p[0], p0_before));  // checked before group 0 was stepped
  static_cast<torch::optim::SGDOptions&>(sgd.param_groups()[1].options()).lr(0.1).nesterov(true);
  ASSERT_THROWS_WITH(sgd.step(), "param group 1 has nesterov(true) with momentum 0 and dampening 0; Nesterov momentum "
                                 "requires a momentum and zero dampening.");
  amp::optim::FusedAdamW adamw(std::vector<torch::Tensor>{p[2]}, torch::optim::AdamWOptions(1e-3));
  static_cast<torch::optim::AdamWOptions&>(adamw.param_groups()[0].options()).betas({0.9, 1.0});
  p[2].mutable_grad() = torch::ones_like(p[2]);
  ASSERT_THROWS_WITH(adamw.step(), "amp::optim::FusedAdamW: invalid beta parameter at index 1: 1 in param group 0; "
                                   "betas must be in [0, 1).");
  EXPECT_TRUE(torch::equal(p[2].grad(), torch::ones_like(p[2])));  // nothing stepped
}

// ---- inside amp ----------------------------------------------------------------------------------------

namespace {

struct LevelCase {
  const char* level;
  c10::ScalarType dtype;
};

std::string level_name(const ::testing::TestParamInfo<LevelCase>& info) {
  return std::string(info.param.level) + "_" + amp_test::dtype_label(info.param.dtype);
}

class FusedAtLevelTest : public ::testing::TestWithParam<LevelCase> {
 protected:
  void SetUp() override { SKIP_WITHOUT_CPU_KERNELS(GetParam().dtype); }
  amp::Options options() const {
    return amp::Options(GetParam().level).low_precision_dtype(GetParam().dtype).verbosity(0);
  }
};

std::vector<torch::Tensor> float_copies(const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> out;
  for (const auto& t : tensors) out.push_back(t.detach().to(torch::kFloat).clone());
  return out;
}

template <class Fused, class Plain, class Options>
void run_level_case(const amp::Options& amp_options, const Options& optimizer_options, bool bitwise,
                    const std::string& what) {
  torch::manual_seed(3);
  amp_test::ConvBnNet net_fused, net_plain;
  {
    torch::NoGradGuard no_grad;
    auto dst = net_plain->parameters();
    auto src = net_fused->parameters();
    for (size_t i = 0; i < dst.size(); ++i) dst[i].copy_(src[i]);
  }
  auto [x, y] = amp_test::quadrant_images(64, 7);
  auto [model_f, opt_f] = amp::initialize(net_fused, Fused(net_fused->parameters(), optimizer_options), amp_options);
  auto [model_p, opt_p] = amp::initialize(net_plain, Plain(net_plain->parameters(), optimizer_options), amp_options);
  for (int s = 0; s < 6; ++s) {
    opt_f.zero_grad();
    opt_p.zero_grad();
    {
      auto scaled = amp::scale_loss(torch::nn::functional::cross_entropy(model_f(x), y), opt_f);
      scaled.backward();
    }
    {
      auto scaled = amp::scale_loss(torch::nn::functional::cross_entropy(model_p(x), y), opt_p);
      scaled.backward();
    }
    opt_f.step();
    opt_p.step();
  }
  const auto pf = net_fused->parameters(), pp = net_plain->parameters();
  const auto mf = amp::master_params(opt_f), mp = amp::master_params(opt_p);
  for (size_t i = 0; i < pf.size(); ++i) {
    if (bitwise) {
      EXPECT_TRUE(amp_test::bitwise_equal(pf[i], pp[i])) << what << ": model parameter " << i;
    } else {
      // amp's loop and LibTorch's round differently by an ulp, which the low-precision model copy can show as one
      // ulp of its dtype; the fp32 masters agree to float32 rounding.
      const auto dtype = pf[i].scalar_type();
      const double ulp = dtype == torch::kBFloat16 ? 0.0079 : dtype == torch::kHalf ? 0.001 : 1e-5;
      EXPECT_LE(relative_error(pf[i], pp[i]), ulp) << what << ": model parameter " << i;
    }
  }
  for (size_t i = 0; i < mf.size(); ++i) {
    EXPECT_EQ(mf[i].scalar_type(), mp[i].scalar_type());
    if (!bitwise) EXPECT_LE(relative_error(mf[i], mp[i]), 1e-4) << what << ": master " << i;
  }
  EXPECT_EQ(amp::loss_scale(opt_f), amp::loss_scale(opt_p)) << what;
}

}  // namespace

// Every level and dtype: amp with a fused optimizer trains as amp with LibTorch's (bitwise at O3, where the
// low-precision parameters take LibTorch's own per-op route).
TEST_P(FusedAtLevelTest, TrainsAsWithLibTorchsOptimizer) {
  const bool o3 = std::string(GetParam().level) == "O3";
  using namespace torch::optim;
  run_level_case<amp::optim::FusedSGD, SGD>(options(), SGDOptions(0.05).momentum(0.9), o3, "SGD");
  run_level_case<amp::optim::FusedAdam, Adam>(options(), AdamOptions(1e-3).eps(1e-3), o3, "Adam");
  run_level_case<amp::optim::FusedAdamW, AdamW>(options(), AdamWOptions(1e-3).eps(1e-3), o3, "AdamW");
}

INSTANTIATE_TEST_SUITE_P(Levels, FusedAtLevelTest,
                         ::testing::Values(LevelCase{"O0", torch::kBFloat16}, LevelCase{"O1", torch::kBFloat16},
                                           LevelCase{"O1", torch::kHalf}, LevelCase{"O2", torch::kBFloat16},
                                           LevelCase{"O2", torch::kHalf}, LevelCase{"O3", torch::kBFloat16},
                                           LevelCase{"O3", torch::kHalf}),
                         level_name);

// O2: the step that also writes the model's low-precision copy equals, bit for bit, a plain fp32 step of
// the same fused optimizer on the masters followed by rounding them into the model (the unfused path).
TEST(FusedO2Test, ModelCopyWrittenByTheStepEqualsTheUnfusedPath) {
  for (const auto dtype : amp_test::low_precision_dtypes()) {
    if (!amp_test::cpu_computes(dtype)) continue;
    torch::manual_seed(4);
    amp_test::ConvBnNet net;
    auto [x, y] = amp_test::quadrant_images(32, 8);
    const auto adam = torch::optim::AdamOptions(1e-2).amsgrad(true);
    auto [model, opt] = amp::initialize(net, amp::optim::FusedAdam(net->parameters(), adam),
                                        amp::Options("O2").low_precision_dtype(dtype).verbosity(0));
    auto masters = amp::master_params(opt);
    auto shadow = clone_params(masters);  // the unfused path: an fp32 FusedAdam of its own
    amp::optim::FusedAdam shadow_opt(shadow, adam);
    for (int s = 0; s < 5; ++s) {
      opt.zero_grad();
      {
        auto scaled = amp::scale_loss(torch::nn::functional::cross_entropy(model(x), y), opt);
        scaled.backward();
      }
      for (size_t i = 0; i < masters.size(); ++i) shadow[i].mutable_grad() = masters[i].grad().clone();
      const bool skipped = opt.step_will_be_skipped();  // float16's first steps overflow at 65536
      opt.step();
      if (!skipped) shadow_opt.step();
      const auto params = net->parameters();
      for (size_t i = 0; i < masters.size(); ++i) {
        ASSERT_TRUE(amp_test::bitwise_equal(masters[i], shadow[i])) << "step " << s << " master " << i;
      }
      for (size_t i = 0; i < params.size(); ++i) {  // BatchNorm's fp32 parameters are stepped in place
        ASSERT_TRUE(amp_test::bitwise_equal(params[i], shadow[i].to(params[i].scalar_type())))
            << "step " << s << " model parameter " << i;
      }
    }
  }
}

// An overflowing backward skips the step: no parameter, master, model copy or optimizer state changes a bit.
TEST(FusedO2Test, SkippedStepChangesNothing) {
  torch::manual_seed(5);
  amp_test::ConvBnNet net;
  auto [x, y] = amp_test::quadrant_images(32, 9);
  auto [model, opt] = amp::initialize(net, amp::optim::FusedAdamW(net->parameters(), torch::optim::AdamWOptions(1e-2)),
                                      amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0));
  auto train_step = [&, &model = model, &opt = opt](bool poison) {
    opt.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(model(x), y);
    if (poison) loss = loss + (net->fc->weight.to(torch::kFloat) * INFINITY).sum() * 0;  // NaN gradients in fc
    auto scaled = amp::scale_loss(loss, opt);
    scaled.backward();
  };
  {
    train_step(false);
  }
  opt.step();
  const auto params = float_copies(net->parameters());
  const auto masters = float_copies(amp::master_params(opt));
  std::vector<torch::Tensor> state;
  for (const auto& [key, s] : opt.state()) {
    const auto& adam = static_cast<const torch::optim::AdamWParamState&>(*s);
    state.push_back(adam.exp_avg().clone());
    state.push_back(adam.exp_avg_sq().clone());
  }
  {
    train_step(true);
  }
  EXPECT_TRUE(opt.step_will_be_skipped());
  opt.step();
  const auto params_after = net->parameters();
  const auto masters_after = amp::master_params(opt);
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(torch::equal(params[i], params_after[i].to(torch::kFloat))) << i;
  }
  for (size_t i = 0; i < masters.size(); ++i) EXPECT_TRUE(amp_test::bitwise_equal(masters[i], masters_after[i])) << i;
  size_t k = 0;
  for (const auto& [key, s] : opt.state()) {
    const auto& adam = static_cast<const torch::optim::AdamWParamState&>(*s);
    EXPECT_TRUE(amp_test::bitwise_equal(adam.exp_avg(), state[k++]));
    EXPECT_TRUE(amp_test::bitwise_equal(adam.exp_avg_sq(), state[k++]));
    EXPECT_EQ(adam.step(), 1);
  }
  EXPECT_EQ(opt.skipped_steps(), 1);
  EXPECT_EQ(amp::loss_scale(opt), 32768.0);
}

// torch::save / torch::load of the amp optimizer mid-run, then training on: bitwise the run that never stopped.
TEST(FusedO2Test, ResumeIsBitwiseIdenticalToNotStopping) {
  auto [x, y] = amp_test::quadrant_images(32, 10);
  auto make = [](amp_test::ConvBnNet& net) {
    torch::manual_seed(6);
    net = amp_test::ConvBnNet();
    return amp::initialize(net, amp::optim::FusedSGD(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9)),
                           amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0));
  };
  auto train = [&x = x, &y = y](auto& model, auto& opt, int steps) {
    for (int s = 0; s < steps; ++s) {
      opt.zero_grad();
      {
        auto scaled = amp::scale_loss(torch::nn::functional::cross_entropy(model(x), y), opt);
        scaled.backward();
      }
      opt.step();
    }
  };
  amp_test::ConvBnNet straight_net, first_net, resumed_net;
  auto [straight_model, straight_opt] = make(straight_net);
  train(straight_model, straight_opt, 6);

  auto [first_model, first_opt] = make(first_net);
  train(first_model, first_opt, 3);
  const auto dir = std::filesystem::temp_directory_path();
  const auto model_path = (dir / "amp_fused_resume_model.pt").string();
  const auto opt_path = (dir / "amp_fused_resume_opt.pt").string();
  torch::save(first_net, model_path);
  torch::save(first_opt, opt_path);

  auto [resumed_model, resumed_opt] = make(resumed_net);
  amp::load_weights(*resumed_net, model_path);
  torch::load(resumed_opt, opt_path);
  std::filesystem::remove(model_path);
  std::filesystem::remove(opt_path);
  train(resumed_model, resumed_opt, 3);
  const auto a = straight_net->parameters(), b = resumed_net->parameters();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(amp_test::bitwise_equal(a[i], b[i])) << "parameter " << i;
  const auto ma = amp::master_params(straight_opt), mb = amp::master_params(resumed_opt);
  for (size_t i = 0; i < ma.size(); ++i) EXPECT_TRUE(amp_test::bitwise_equal(ma[i], mb[i])) << "master " << i;
}

// The fused step's raw writes bump version counters, so weights edited after a fused step still reach the
// masters (NOTE [Masters follow the model]) and the next step starts from them.
TEST(FusedO2Test, WeightsWrittenAfterAFusedStepReachTheMasters) {
  torch::manual_seed(7);
  amp_test::ConvBnNet net;
  auto [x, y] = amp_test::quadrant_images(32, 11);
  auto [model, opt] = amp::initialize(net, amp::optim::FusedSGD(net->parameters(), torch::optim::SGDOptions(0.1)),
                                      amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0));
  const int64_t version = net->fc->weight._version();
  {
    auto scaled = amp::scale_loss(torch::nn::functional::cross_entropy(model(x), y), opt);
    scaled.backward();
  }
  opt.step();
  EXPECT_GT(net->fc->weight._version(), version);
  {
    torch::NoGradGuard no_grad;
    net->fc->weight.fill_(0.25);
  }
  const auto masters = amp::master_params(opt);
  const auto params = net->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].unsafeGetTensorImpl() == net->fc->weight.unsafeGetTensorImpl()) {
      EXPECT_TRUE(torch::all(masters[i] == 0.25).item<bool>());
    }
  }
}

// ---- with amp::GradScaler ------------------------------------------------------------------------------

// torch's test_grad_scaling_autocast_fused_optimizers: a fused optimizer stepped by GradScaler without
// unscale_ (the scale goes into the step) equals the same optimizer after an explicit unscale_ bit for bit,
// and LibTorch's optimizer within float32 rounding; an inf skips all three alike; the scale sequence is
// torch's; the gradients stay scaled after the fused step, as in torch.
TEST(FusedGradScalerTest, ScaleInsideTheStepEqualsUnscaleThenStep) {
  for (const bool amsgrad : {false, true}) {
    for (const bool adamw : {false, true}) {
      torch::manual_seed(8);
      std::vector<torch::nn::Sequential> models;
      for (int m = 0; m < 3; ++m) {
        models.emplace_back(torch::nn::Linear(8, 8), torch::nn::ReLU(), torch::nn::Linear(8, 4));
      }
      for (int m = 1; m < 3; ++m) {
        torch::NoGradGuard no_grad;
        const auto src = models[0]->parameters(), dst = models[m]->parameters();
        for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
      }
      auto make = [&](int m, bool fused) -> std::unique_ptr<torch::optim::Optimizer> {
        const auto params = models[m]->parameters();
        if (adamw) {
          const auto o = torch::optim::AdamWOptions(1e-2).amsgrad(amsgrad).weight_decay(0.01);
          if (fused) return std::make_unique<amp::optim::FusedAdamW>(params, o);
          return std::make_unique<torch::optim::AdamW>(params, o);
        }
        const auto o = torch::optim::AdamOptions(1e-2).amsgrad(amsgrad);
        if (fused) return std::make_unique<amp::optim::FusedAdam>(params, o);
        return std::make_unique<torch::optim::Adam>(params, o);
      };
      std::vector<std::unique_ptr<torch::optim::Optimizer>> opts;
      opts.push_back(make(0, true));   // scale inside the step
      opts.push_back(make(1, true));   // unscale_ first
      opts.push_back(make(2, false));  // LibTorch's optimizer
      std::vector<amp::GradScaler> scalers;
      for (int m = 0; m < 3; ++m) scalers.emplace_back(amp::GradScalerOptions().init_scale(128.0).growth_interval(1));
      const std::string what = std::string(adamw ? "AdamW" : "Adam") + (amsgrad ? " amsgrad" : "");
      for (int s = 0; s < 5; ++s) {
        torch::manual_seed(20 + s);
        const auto x = torch::randn({16, 8}), y = torch::randn({16, 4});
        std::vector<std::optional<torch::Tensor>> stepped;
        for (int m = 0; m < 3; ++m) {
          opts[m]->zero_grad();
          torch::Tensor loss;
          {
            amp::AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
            loss = torch::mse_loss(models[m]->forward(x).to(torch::kFloat), y);
          }
          scalers[m].scale(loss).backward();
          if (s == 2) models[m]->parameters()[0].mutable_grad()[0][0] = INFINITY;
          if (m == 1) scalers[m].unscale_(*opts[m]);
          const auto scaled_grad = models[m]->parameters()[2].grad().clone();
          stepped.push_back(scalers[m].step(*opts[m]));
          if (m == 0 && s != 2) {
            EXPECT_TRUE(amp_test::bitwise_equal(models[m]->parameters()[2].grad(), scaled_grad)) << what;
          }
          scalers[m].update();
        }
        for (int m = 0; m < 3; ++m) EXPECT_EQ(stepped[m].has_value(), s != 2) << what << " step " << s;
      }
      for (int m = 0; m < 3; ++m) EXPECT_EQ(scalers[m].get_scale(), 128.0 * 16 * 0.5) << what;  // 4 clean, 1 inf
      const auto a = models[0]->parameters(), b = models[1]->parameters(), c = models[2]->parameters();
      for (size_t i = 0; i < a.size(); ++i) {
        EXPECT_TRUE(amp_test::bitwise_equal(a[i], b[i])) << what << " parameter " << i;
        EXPECT_TRUE(torch::allclose(a[i], c[i], 1.3e-6, 1e-5)) << what << " parameter " << i;
      }
    }
  }
}
