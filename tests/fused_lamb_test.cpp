// amp::optim::FusedLAMB: Apex's FusedLAMB (options, defaults, update rule) against a Python reference written
// from the paper and Apex's kernel (tests/python/lamb.py, run at test time), both routes, every level, skipped
// steps, torch::save resume, param groups and schedulers, GradScaler's in-step unscale, and its errors.
// Ported from Apex's tests/L0/run_optimizers/test_lamb.py (RefLAMB against FusedLAMB over several steps with
// weight decay and gradient clipping; the fp16/bf16 variants become amp's levels) and from the fused optimizer
// tests of tests/fused_optimizers_test.cpp (routes, O2 model copies, skipped steps, resume).

#include <torch/optim/schedulers/step_lr.h>
#include <torch/version.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <limits>

#include "amp/fused_optimizers.h"
#include "optim/fused_route.h"
#include "optim/optimizer_state_key.h"
#include "support/data.h"
#include "support/models.h"
#include "support/support.h"
#include "support/training.h"

namespace {

namespace fs = std::filesystem;
using amp::optim::FusedLAMB;
using amp::optim::FusedLAMBOptions;


// Largest difference in fp32 ulps of the tensor's largest magnitude (elements near 0 would make a relative
// measure meaningless).
double lamb_ulps(const torch::Tensor& actual, const torch::Tensor& expected) {
  const auto a = actual.to(torch::kDouble), e = expected.to(torch::kDouble);
  const double ulp = std::max(e.abs().max().item<double>(), 1e-30) * std::ldexp(1.0, -23);
  return (a - e).abs().max().item<double>() / ulp;
}

struct LambCase {
  std::vector<torch::Tensor> params;
  std::vector<std::vector<torch::Tensor>> grads;  // per step
};

LambCase lamb_case(int steps) {
  torch::manual_seed(11);
  LambCase c;
  c.params = {torch::randn({64, 32}), torch::randn({32}) * 0.1, torch::zeros({16}), torch::randn({70000}) * 0.02,
              torch::randn({8, 8})};
  for (int s = 0; s < steps; ++s) {
    std::vector<torch::Tensor> g;
    // Large enough that the global norm exceeds max_grad_norm 1.0 in some steps and not in others.
    for (const auto& p : c.params) g.push_back(torch::randn(p.sizes()) * (s % 2 == 0 ? 0.5 : 0.002));
    c.grads.push_back(g);
  }
  return c;
}

}  // namespace

TEST(FusedLAMBPythonTest, MatchesAReferenceFromThePaperAndApexsKernel) {
  if (!amp_test::python_has_torch()) {
    GTEST_SKIP() << "this check needs Python with the torch wheel (set AMP_PYTHON)";
  }
  constexpr int kSteps = 6;
  const LambCase c = lamb_case(kSteps);
  // Four groups covering Apex's switches: decoupled decay with clipping, L2 decay without bias correction or grad
  // averaging, no decay (plain lr: no trust ratio), and no decay with NVLAMB (trust ratio anyway).
  struct GroupSpec {
    std::vector<int64_t> indices;
    FusedLAMBOptions options;
  };
  const std::vector<GroupSpec> specs = {
      {{0, 1}, FusedLAMBOptions(2e-3)},
      {{2}, FusedLAMBOptions(1e-3).adam_w_mode(false).bias_correction(false).grad_averaging(false).weight_decay(0.1)},
      {{3}, FusedLAMBOptions(5e-3).weight_decay(0).betas(std::make_tuple(0.8, 0.99)).eps(1e-8)},
      {{4}, FusedLAMBOptions(1e-2).weight_decay(0).use_nvlamb(true)},
  };
  for (const auto route : {amp::optim::detail::FusedRoute::kAuto, amp::optim::detail::FusedRoute::kPerOp}) {
    SCOPED_TRACE(route == amp::optim::detail::FusedRoute::kAuto ? "amp's CPU loop" : "per-op route");
    amp::optim::detail::FusedRouteGuard guard(route);
    std::vector<torch::Tensor> params;
    for (const auto& p : c.params) params.push_back(p.clone());
    std::vector<torch::optim::OptimizerParamGroup> groups;
    for (const auto& spec : specs) {
      std::vector<torch::Tensor> ps;
      for (const int64_t i : spec.indices) ps.push_back(params[i]);
      groups.emplace_back(ps, std::make_unique<FusedLAMBOptions>(spec.options));
    }
    FusedLAMB lamb(groups, FusedLAMBOptions().max_grad_norm(1.0));
    for (int s = 0; s < kSteps; ++s) {
      for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = c.grads[s][i].clone();
      lamb.step();
    }
    for (const auto& group : lamb.param_groups()) {
      EXPECT_EQ(static_cast<const FusedLAMBOptions&>(group.options()).step(), kSteps);
    }
    const fs::path dir = fs::path(::testing::TempDir()) / ("amp_lamb_" + std::to_string(::getpid()));
    fs::create_directories(dir);
    amp::PythonCheckpoint out;
    c10::List<torch::Tensor> initial;
    for (const auto& p : c.params) initial.push_back(p);
    c10::impl::GenericList grads(c10::AnyType::get());
    for (const auto& step : c.grads) {
      c10::List<torch::Tensor> g;
      for (const auto& t : step) g.push_back(t);
      grads.push_back(g);
    }
    c10::impl::GenericList group_list(c10::AnyType::get());
    for (const auto& spec : specs) {
      const auto& o = spec.options;
      c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
      d.insert("params", c10::List<int64_t>(spec.indices));
      d.insert("lr", o.lr());
      d.insert("beta1", std::get<0>(o.betas()));
      d.insert("beta2", std::get<1>(o.betas()));
      d.insert("eps", o.eps());
      d.insert("weight_decay", o.weight_decay());
      d.insert("bias_correction", o.bias_correction());
      d.insert("adam_w_mode", o.adam_w_mode());
      d.insert("grad_averaging", o.grad_averaging());
      d.insert("use_nvlamb", o.use_nvlamb());
      group_list.push_back(d);
    }
    out.put("params", initial);
    out.put("grads", grads);
    out.put("groups", group_list);
    out.put("max_grad_norm", 1.0);
    out.save((dir / "lamb_cases.pt").string());
    const std::string command =
        amp_test::python_interpreter() + " '" AMP_SOURCE_DIR "/tests/python/lamb.py' '" + dir.string() + "' 2>&1";
    ASSERT_EQ(std::system(command.c_str()), 0) << command;
    const auto reference = amp::PythonCheckpoint::load((dir / "lamb_reference.pt").string());
    const auto ref_params = reference.get("params").toTensorList();
    const auto ref_m = reference.get("exp_avg").toTensorList();
    double worst = 0.0, worst_m = 0.0;
    bool bitwise = true;
    for (size_t i = 0; i < params.size(); ++i) {
      bitwise = bitwise && amp_test::bitwise_equal(params[i], ref_params.get(i));
      worst = std::max(worst, lamb_ulps(params[i], ref_params.get(i)));
      const auto& state = static_cast<const amp::optim::FusedLAMBParamState&>(
          *lamb.state().at(amp::detail::state_key(lamb.state(), params[i])));
      worst_m = std::max(worst_m, lamb_ulps(state.exp_avg(), ref_m.get(i)));
    }
    std::cout << "[ measured ] " << kSteps << " steps, 4 groups: largest difference to the Python reference: "
              << worst << " ulp of each tensor's largest value (parameters), " << worst_m << " (first moments)"
              << (bitwise ? ", bitwise equal" : "") << std::endl;
    const std::string python_torch = reference.get("torch_version").toStringRef();
    const bool same_kernels = python_torch.substr(0, python_torch.find('+')) == TORCH_VERSION;
    if (route == amp::optim::detail::FusedRoute::kPerOp && same_kernels) {
      // The same ATen ops in the same order as the reference (norms in double, rounded once, on both sides), on the
      // same ATen build.
      EXPECT_TRUE(bitwise) << "the per-op route must equal the reference bit for bit";
    } else {
      // amp's loop uses the correctly rounded sqrt, ATen's vectorized sqrt may differ by an ulp (as may another
      // LibTorch's kernels than the Python wheel's); the difference feeds back through the trust ratio and L2 decay.
      EXPECT_LE(worst, 16.0);
      EXPECT_LE(worst_m, 16.0);
    }
    fs::remove_all(dir);
  }
}

TEST(FusedLAMBTest, DefaultsAreApexsAndBadOptionsNameTheGroup) {
  const FusedLAMBOptions o;
  EXPECT_EQ(o.lr(), 1e-3);
  EXPECT_EQ(std::get<0>(o.betas()), 0.9);
  EXPECT_EQ(std::get<1>(o.betas()), 0.999);
  EXPECT_EQ(o.eps(), 1e-6);
  EXPECT_EQ(o.weight_decay(), 0.01);
  EXPECT_TRUE(o.bias_correction());
  EXPECT_TRUE(o.adam_w_mode());
  EXPECT_TRUE(o.grad_averaging());
  EXPECT_EQ(o.max_grad_norm(), 1.0);
  EXPECT_FALSE(o.use_nvlamb());
  auto p = torch::ones({4}, torch::requires_grad());
  ASSERT_THROWS_WITH(FusedLAMB(std::vector<torch::Tensor>{p}, FusedLAMBOptions(-1.0)),
                     "amp::optim::FusedLAMB: invalid learning rate -1 in param group 0; use lr >= 0.");
  ASSERT_THROWS_WITH(FusedLAMB(std::vector<torch::Tensor>{p}, FusedLAMBOptions().betas(std::make_tuple(1.0, 0.999))),
                     "invalid beta parameter at index 0: 1 in param group 0; betas must be in [0, 1).");
  ASSERT_THROWS_WITH(FusedLAMB(std::vector<torch::Tensor>{p}, FusedLAMBOptions().max_grad_norm(-1.0)),
                     "invalid max_grad_norm -1 in param group 0; use max_grad_norm >= 0 (0: no clipping");
  FusedLAMB lamb(std::vector<torch::Tensor>{p});
  lamb.add_param_group(torch::optim::OptimizerParamGroup({torch::ones({2}, torch::requires_grad())},
                                                         std::make_unique<FusedLAMBOptions>(FusedLAMBOptions().eps(-1))));
  p.mutable_grad() = torch::ones({4});
  const auto before = p.detach().clone();
  ASSERT_THROWS_WITH(lamb.step(), "amp::optim::FusedLAMB: invalid epsilon value -1 in param group 1");
  EXPECT_TRUE(amp_test::bitwise_equal(p.detach(), before)) << "a refused step must change nothing";
  auto sparse = torch::ones({4}, torch::requires_grad());
  FusedLAMB lamb_sparse(std::vector<torch::Tensor>{sparse});
  sparse.mutable_grad() = torch::ones({4}).to_sparse();
  ASSERT_THROWS_WITH(lamb_sparse.step(), "amp::optim::FusedLAMB does not support sparse gradients");
}

TEST(FusedLAMBTest, MaxGradNormZeroMeansNoClipping) {
  // Apex's kernel divides by norm / 0 = inf there and zeroes every gradient; amp reads 0 as "no clipping", which
  // equals clipping to a bound the norm never reaches.
  const LambCase c = lamb_case(2);
  auto run = [&](double max_grad_norm) {
    auto p = c.params[0].clone();
    FusedLAMB lamb(std::vector<torch::Tensor>{p}, FusedLAMBOptions().max_grad_norm(max_grad_norm));
    for (int s = 0; s < 2; ++s) {
      p.mutable_grad() = c.grads[s][0].clone();
      lamb.step();
    }
    return p;
  };
  EXPECT_TRUE(amp_test::bitwise_equal(run(0.0), run(1e30)));
  EXPECT_FALSE(amp_test::bitwise_equal(run(0.0), run(1e-3)));
}

class FusedLAMBLevelTest : public amp_test::LevelTest {};

TEST_P(FusedLAMBLevelTest, TrainsSkipsOverflowsAndResumesBitwise) {
  const auto data = amp_test::blobs(64, 8, 4, 5);
  const torch::Tensor x = data.first, y = data.second;
  auto make = [&] {
    torch::manual_seed(0);
    amp_test::Mlp net(8, 32, 4);
    net->to(device());
    auto lamb = FusedLAMB(net->parameters(), FusedLAMBOptions(2e-2));
    return std::make_pair(net, std::move(lamb));
  };
  auto train = [&](auto& model, auto& optimizer, int steps) {
    double last = 0;
    for (int s = 0; s < steps; ++s) last = amp_test::train_step(model, optimizer, x.to(device()), y.to(device())).template item<double>();
    return last;
  };
  auto [net, lamb] = make();
  auto [model, optimizer] = amp::initialize(net, std::move(lamb), options());
  double first;
  {
    torch::NoGradGuard no_grad;
    first = torch::nn::functional::cross_entropy(model(x.to(device())), y.to(device())).item<double>();
  }
  const double last = train(model, optimizer, 30);
  EXPECT_LT(last, first * 0.5) << "FusedLAMB must train at " << GetParam().level;

  // An overflowing backward: the step is skipped and nothing changes, the groups' step counts included.
  const bool dynamic = optimizer.properties().loss_scale.is_dynamic();
  if (dynamic) {
    std::vector<torch::Tensor> before;
    for (const auto& p : optimizer.master_params()) before.push_back(p.detach().clone());
    const int64_t step_before = static_cast<const FusedLAMBOptions&>(optimizer.param_groups()[0].options()).step();
    optimizer.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(model(x.to(device())), y.to(device())) *
                std::numeric_limits<float>::infinity();
    {
      auto scaled = amp::scale_loss(loss, optimizer);
      scaled.backward();
    }
    optimizer.step();
    EXPECT_EQ(optimizer.skipped_steps(), 1);
    const auto after = optimizer.master_params();
    for (size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(amp_test::bitwise_equal(after[i].detach(), before[i]));
    EXPECT_EQ(static_cast<const FusedLAMBOptions&>(optimizer.param_groups()[0].options()).step(), step_before);
  }

  // torch::save after 3 steps, load into a fresh initialize, 3 more: bitwise the run that never stopped.
  auto [net_a, lamb_a] = make();
  auto [model_a, opt_a] = amp::initialize(net_a, std::move(lamb_a), options());
  train(model_a, opt_a, 3);
  std::stringstream model_bytes, opt_bytes;
  torch::save(net_a, model_bytes);
  torch::save(opt_a, opt_bytes);
  train(model_a, opt_a, 3);
  auto [net_b, lamb_b] = make();
  auto [model_b, opt_b] = amp::initialize(net_b, std::move(lamb_b), options());
  torch::load(net_b, model_bytes);
  torch::load(opt_b, opt_bytes);
  train(model_b, opt_b, 3);
  const auto pa = net_a->parameters(), pb = net_b->parameters();
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(amp_test::bitwise_equal(pa[i], pb[i])) << "parameter " << i;
  EXPECT_EQ(static_cast<const FusedLAMBOptions&>(opt_b.param_groups()[0].options()).step(), 6);
}

AMP_INSTANTIATE_FOR_LEVELS(FusedLAMBLevelTest, amp_test::level_cases({"O0", "O1", "O2", "O3"}, /*o0_once=*/true));

TEST(FusedLAMBTest, O2WritesTheModelCopyInItsPass) {
  for (const auto dtype : amp_test::low_precision_dtypes()) {
    if (!amp_test::cpu_computes(dtype)) continue;
    torch::manual_seed(0);
    amp_test::Mlp net(8, 16, 4);
    auto [model, optimizer] = amp::initialize(net, FusedLAMB(net->parameters()),
                                              amp::Options("O2").low_precision_dtype(dtype).verbosity(0));
    const auto [x, y] = amp_test::blobs(16, 8, 4, 1);
    amp_test::train_step(model, optimizer, x, y);
    const auto masters = optimizer.master_params();
    const auto params = net->parameters();
    ASSERT_EQ(masters.size(), params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_EQ(params[i].scalar_type(), dtype);
      EXPECT_TRUE(amp_test::bitwise_equal(params[i].detach(), masters[i].detach().to(dtype)))
          << "the model holds its master rounded, written by the step";
    }
  }
}

TEST(FusedLAMBTest, GroupsSchedulersAndGradScalerInStepUnscale) {
  // A StepLR halves each group's lr through FusedLAMBOptions::set_lr.
  auto a = torch::randn({8}, torch::requires_grad()), b = torch::randn({8}, torch::requires_grad());
  FusedLAMB lamb({torch::optim::OptimizerParamGroup({a}),
                  torch::optim::OptimizerParamGroup({b}, std::make_unique<FusedLAMBOptions>(FusedLAMBOptions(4e-3)))},
                 FusedLAMBOptions(1e-3));
  torch::optim::StepLR scheduler(lamb, /*step_size=*/1, /*gamma=*/0.5);
  a.mutable_grad() = torch::ones({8});
  b.mutable_grad() = torch::ones({8});
  EXPECT_DOUBLE_EQ(static_cast<const FusedLAMBOptions&>(lamb.param_groups()[1].options()).lr(), 4e-3)
      << "a group's own options are kept";
  for (int epoch = 0; epoch < 2; ++epoch) {  // LibTorch's StepLR decays on its second step() with step_size 1
    lamb.step();
    scheduler.step();
  }
  EXPECT_DOUBLE_EQ(static_cast<const FusedLAMBOptions&>(lamb.param_groups()[0].options()).lr(), 5e-4);
  EXPECT_DOUBLE_EQ(static_cast<const FusedLAMBOptions&>(lamb.param_groups()[1].options()).lr(), 2e-3);

  // amp::GradScaler::step without unscale_ hands FusedLAMB the scale (torch's grad_scale): the same result as
  // unscale_ then step, and the gradients are unscaled afterwards either way.
  auto run = [](bool unscale_first) {
    torch::manual_seed(4);
    amp_test::Mlp net(8, 16, 4);
    FusedLAMB lamb(net->parameters());
    amp::GradScaler scaler(amp::GradScalerOptions().init_scale(256.0));
    const auto [x, y] = amp_test::blobs(16, 8, 4, 2);
    for (int s = 0; s < 3; ++s) {
      lamb.zero_grad();
      torch::Tensor loss;
      {
        amp::AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
        loss = torch::nn::functional::cross_entropy(net->forward(x), y);
      }
      scaler.scale(loss).backward();
      if (unscale_first) scaler.unscale_(lamb);
      scaler.step(lamb);
      scaler.update();
    }
    std::vector<torch::Tensor> out;
    for (const auto& p : net->parameters()) {
      out.push_back(p.detach().clone());
      out.push_back(p.grad().clone());
    }
    return out;
  };
  const auto inside = run(false), outside = run(true);
  for (size_t i = 0; i < inside.size(); ++i) EXPECT_TRUE(amp_test::bitwise_equal(inside[i], outside[i])) << i;
}

TEST(FusedLAMBPythonTest, PythonCheckpointsHaveApexsStateDictLayout) {
  if (!amp_test::python_has_torch()) {
    GTEST_SKIP() << "this check needs Python with the torch wheel (set AMP_PYTHON)";
  }
  torch::manual_seed(2);
  auto a = torch::randn({4, 3}, torch::requires_grad()), b = torch::randn({3}, torch::requires_grad());
  auto c = torch::randn({5}, torch::requires_grad());
  FusedLAMB lamb({torch::optim::OptimizerParamGroup({a, b}),
                  torch::optim::OptimizerParamGroup({c}, std::make_unique<FusedLAMBOptions>(FusedLAMBOptions(2e-3)))});
  for (int s = 0; s < 3; ++s) {  // c never has a gradient: no state for it (its group's step count still grows)
    a.mutable_grad() = torch::randn({4, 3});
    b.mutable_grad() = torch::randn({3});
    lamb.step();
  }
  EXPECT_EQ(static_cast<const FusedLAMBOptions&>(lamb.param_groups()[1].options()).step(), 3) << "as Apex";
  // A group whose count is 0 is written without 'step', as a never-stepped Apex optimizer's.
  static_cast<FusedLAMBOptions&>(lamb.param_groups()[1].options()).step(0);
  const fs::path dir = fs::path(::testing::TempDir()) / ("amp_lamb_ckpt_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  amp::PythonCheckpoint out;
  out.put_optimizer("optimizer", lamb);
  out.save((dir / "lamb_cpp.pt").string());
  const std::string command =
      amp_test::python_interpreter() + " '" AMP_SOURCE_DIR "/tests/python/lamb.py' roundtrip '" + dir.string() + "' 2>&1";
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  const auto& state_a = static_cast<const amp::optim::FusedLAMBParamState&>(
      *lamb.state().at(amp::detail::state_key(lamb.state(), a)));
  const auto exp_avg_a = state_a.exp_avg().clone();
  amp::PythonCheckpoint::load((dir / "lamb_python.pt").string()).load_optimizer(lamb);
  const auto& o0 = static_cast<const FusedLAMBOptions&>(lamb.param_groups()[0].options());
  const auto& o1 = static_cast<const FusedLAMBOptions&>(lamb.param_groups()[1].options());
  EXPECT_EQ(o0.step(), 4);
  EXPECT_EQ(o0.lr(), 0.25);
  EXPECT_EQ(o1.step(), 7);
  EXPECT_EQ(o1.lr(), 2e-3);
  const auto& loaded_a = static_cast<const amp::optim::FusedLAMBParamState&>(
      *lamb.state().at(amp::detail::state_key(lamb.state(), a)));
  EXPECT_TRUE(amp_test::bitwise_equal(loaded_a.exp_avg(), exp_avg_a * 2));
  fs::remove_all(dir);
}
