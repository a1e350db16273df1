// amp::optim::FusedSGD / FusedAdam / FusedAdamW: the same trajectories as LibTorch's SGD / Adam / AdamW
// on each route (amp's CPU loop, ATen's fused kernels, per-op), interchangeable checkpoints, schedulers and
// param groups, errors; and inside amp at every level: the O2 step that also writes the model's copy equals
// the unfused step bitwise, a skipped step changes nothing, resume is bitwise. On every device: CPU fp32
// parameters take amp's loop, CUDA ones ATen's _fused_sgd_/_fused_adam_/_fused_adamw_. Ports the idea of
// PyTorch's test_optim fused-vs-for-loop comparisons (TestOptimRenewed.test_fused_matches_forloop) and Apex's
// tests/L0/run_optimizers/test_adam.py (FusedAdam against torch.optim.Adam, many shapes, then a step).
#include <cstdio>
#include <filesystem>
#include <functional>

#include "amp/fused_optimizers.h"
#include "optim/fused_route.h"
#include "optim/fused_step_context.h"
#include "optim/optimizer_state_key.h"
#include "support/data.h"
#include "support/models.h"
#include "support/support.h"
#include "support/training.h"

namespace {

using amp::optim::detail::FusedRoute;

using amp::optim::detail::FusedRouteGuard;

// Sizes around the loops' vector widths and the 4096-element chunk of the O2 model copy. Drawn on the CPU
// (as on every device), then moved.
std::vector<torch::Tensor> make_params(c10::ScalarType dtype = torch::kFloat, torch::Device device = torch::kCPU) {
  torch::manual_seed(0);
  std::vector<torch::Tensor> params;
  for (int64_t n : {1, 7, 33, 4095, 4097, 10000}) {
    params.push_back(torch::randn({n}).to(device, dtype).requires_grad_(true));
  }
  params.push_back(torch::randn({17, 9}).to(device, dtype).requires_grad_(true));
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
    a[i].mutable_grad() = g.to(a[i].device(), a[i].scalar_type());
    b[i].mutable_grad() = g.to(b[i].device(), b[i].scalar_type());
  }
}

// The largest difference between two tensors in units of the reference's magnitude (|x| + 1e-3).
double relative_error(const torch::Tensor& a, const torch::Tensor& b) {
  const auto x = a.to(torch::kDouble), y = b.to(torch::kDouble);
  return ((x - y).abs() / (y.abs() + 1e-3)).max().item<double>();
}

// A closeness |a - b| <= atol + rtol |b| (b the reference).
struct Tolerance {
  double rtol, atol;
};

// The largest |a - b| / (atol + rtol |b|): at most 1 where a is within `tolerance` of b.
double tolerance_used(const torch::Tensor& a, const torch::Tensor& b, Tolerance tolerance) {
  const auto x = a.to(torch::kDouble), y = b.to(torch::kDouble);
  return ((x - y).abs() / (y.abs() * tolerance.rtol + tolerance.atol)).max().item<double>();
}

// How close fp32 parameters stepped by a fused optimizer stay to LibTorch's, on the route parameters on `device`
// take:
//  - the CPU, amp's loop: LibTorch's arithmetic but for ATen's vectorized sqrt (NOTE [Fused step arithmetic]),
//    a relative error of 1e-5 (rtol 1e-5, atol 1e-8: relative_error's floor of 1e-3);
//  - CUDA, ATen's fused kernels: they compute a step in fp32 (SGD's in double) and round each result once,
//    LibTorch rounds after every op, so the two part by a few float32 ulps each step, which momentum and the
//    moments carry on: torch's float32 tolerances (rtol 1.3e-6, atol 1e-5), those PyTorch's
//    test_fused_matches_forloop holds these kernels to against its for-loop.
Tolerance fused_tolerance(c10::DeviceType device) {
  return device == torch::kCUDA ? Tolerance{1.3e-6, 1e-5} : Tolerance{1e-5, 1e-8};
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

// A fused optimizer and LibTorch's on equal copies of make_params(dtype, device).
// Steps LibTorch's optimizer as amp::Optimizer does: Python's arithmetic on bf16 / fp16 parameters (NOTE [LibTorch's
// optimizers on low-precision parameters] in src/optim/python_steps.cpp), LibTorch's own step on fp32.
void step_as_amp_does(torch::optim::Optimizer& o) {
  if (dynamic_cast<torch::optim::SGD*>(&o) != nullptr && amp::detail::step_sgd_as_python(o)) return;
  if (dynamic_cast<torch::optim::AdamW*>(&o) != nullptr && amp::detail::step_adam_as_python(o, true)) return;
  if (dynamic_cast<torch::optim::Adam*>(&o) != nullptr && amp::detail::step_adam_as_python(o, false)) return;
  o.step();
}

struct Pair {
  std::vector<torch::Tensor> a, b;
  std::unique_ptr<torch::optim::Optimizer> fused, reference;
  Pair(const OptimizerCase& c, c10::ScalarType dtype = torch::kFloat, torch::Device device = torch::kCPU)
      : a(make_params(dtype, device)), b(clone_params(a)), fused(c.fused(a)), reference(c.reference(b)) {}
  void step(int s) {
    set_grads(s, a, b);
    fused->step();
    step_as_amp_does(*reference);
  }
};

struct TrajectoryError {
  double relative = 0;        // the largest relative_error
  double tolerance_used = 0;  // the largest tolerance_used
};

// Runs `steps` steps of the fused optimizer and LibTorch's on the same gradients on `device`; returns the
// largest differences of any parameter after any step.
TrajectoryError max_trajectory_error(const OptimizerCase& c, c10::ScalarType dtype, int steps, bool expect_bitwise,
                                     torch::Device device = torch::kCPU,
                                     Tolerance tolerance = fused_tolerance(torch::kCPU)) {
  Pair pair(c, dtype, device);
  auto& [a, b, fused, reference] = pair;
  TrajectoryError worst;
  for (int s = 0; s < steps; ++s) {
    pair.step(s);
    for (size_t i = 0; i < a.size(); ++i) {
      if (expect_bitwise) {
        EXPECT_TRUE(amp_test::bitwise_equal(a[i].cpu(), b[i].cpu())) << c.name << " step " << s << " param " << i;
      }
      worst.relative = std::max(worst.relative, relative_error(a[i], b[i]));
      worst.tolerance_used = std::max(worst.tolerance_used, tolerance_used(a[i], b[i], tolerance));
    }
  }
  return worst;
}

class FusedOptimizersTest : public amp_test::DeviceTest {};

}  // namespace

// The default route against LibTorch's op-by-op step. amp's CPU loop (NOTE [Fused step arithmetic]): SGD bit for
// bit; Adam and AdamW differ only through ATen's vectorized sqrt, which is not IEEE's correctly rounded one, so
// they stay within a few float32 ulps over 20 steps. ATen's CUDA kernels: within fused_tolerance(kCUDA).
TEST_P(FusedOptimizersTest, MatchLibTorchsOptimizers) {
  const char* route = on_cuda() ? "ATen's CUDA kernels" : "amp's CPU loop";
  for (const auto& c : optimizer_cases()) {
    const auto error = max_trajectory_error(c, torch::kFloat, 20, !on_cuda() && c.bitwise_with_libtorch, device(),
                                            fused_tolerance(device().type()));
    EXPECT_LE(error.tolerance_used, 1.0) << c.name << " (" << route << "): largest relative difference "
                                         << error.relative;
    std::printf("%-18s %s vs LibTorch: largest relative difference over 20 steps %.3g (%.2g of the tolerance)\n",
                c.name.c_str(), route, error.relative, error.tolerance_used);
  }
}

// Adam's moments do not go through sqrt: without L2 weight decay (which reads the parameter) amp's CPU loop keeps
// them LibTorch's bit for bit, step after step. (CPU only: ATen's CUDA kernel rounds each moment once.)
TEST(FusedOptimizersCpuTest, AdamMomentsAreLibTorchsBitForBit) {
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

// The per-op route is LibTorch's algorithm itself in fp32 and, in the low precision O3 keeps parameters in (where
// amp's loop does not apply), the Python arithmetic amp::Optimizer steps LibTorch's optimizers with: bitwise both.
TEST_P(FusedOptimizersTest, PerOpRouteIsBitwiseLibTorch) {
  for (const auto& c : optimizer_cases()) {
    {
      FusedRouteGuard route(FusedRoute::kPerOp);
      max_trajectory_error(c, torch::kFloat, 5, /*expect_bitwise=*/true, device());
    }
    // The default route for bf16 parameters on the CPU; CUDA's default is ATen's kernels (FusedAtLevelTest's O3).
    FusedRouteGuard route(on_cuda() ? FusedRoute::kPerOp : FusedRoute::kAuto);
    max_trajectory_error(c, torch::kBFloat16, 5, /*expect_bitwise=*/true, device());
  }
}

// ATen's fused kernels (what CUDA parameters take: MatchLibTorchsOptimizers/cuda) through the same code path, run
// here on their CPU implementations (LibTorch >= 2.4). PyTorch tests them against its for-loop with float32
// tolerances.
// A moved optimizer takes its step context along (the model copies, formats and flags amp wired in) and the one
// moved from gets a fresh one, so neither reads the other's nor a null one.
TEST(FusedOptimizersCpuTest, MovingAnOptimizerMovesItsStepContext) {
  auto w = torch::ones({4}, torch::requires_grad());
  amp::optim::FusedAdamW a({w}, torch::optim::AdamWOptions(0.1));
  a.step_context().set_grad_scale(std::optional<double>(8.0));
  amp::optim::FusedAdamW b(std::move(a));
  EXPECT_EQ(b.step_context().grad_scale(), std::optional<double>(8.0));
  EXPECT_EQ(a.step_context().grad_scale(), std::nullopt);  // NOLINT(bugprone-use-after-move): what this tests
  b.step_context().set_grad_scale(std::nullopt);
  w.mutable_grad() = torch::ones({4});
  b.step();
  EXPECT_TRUE(torch::allclose(w.detach(), torch::full({4}, 1.0f - 0.1f * (1.0f + 0.01f)), 1e-5, 1e-6));
  EXPECT_EQ(b.param_groups().size(), 1u);
}

TEST(FusedOptimizersCpuTest, AtenRouteMatchesLibTorch) {
  if (!amp::optim::detail::has_aten_fused_optimizers()) {
    GTEST_SKIP() << "this LibTorch (" << TORCH_VERSION << ") has no ATen fused optimizer kernels (LibTorch >= 2.4)";
  }
  FusedRouteGuard route(FusedRoute::kAten);
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
TEST_P(FusedOptimizersTest, CheckpointsAreInterchangeableWithLibTorchs) {
  const auto tolerance = fused_tolerance(device().type());
  for (const auto& c : optimizer_cases()) {
    Pair pair(c, torch::kFloat, device());
    auto& [a, b, fused, reference] = pair;
    for (int s = 0; s < 3; ++s) pair.step(s);
    // One file per device: ctest runs the cpu and cuda variants at once.
    const auto path = std::filesystem::temp_directory_path() /
                      ("amp_fused_" + c.name + (on_cuda() ? "_cuda" : "_cpu") + ".pt");
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
      EXPECT_LE(tolerance_used(a2[i], b[i], tolerance), 1.0) << c.name << ": fused resumed from LibTorch's checkpoint";
      EXPECT_TRUE(amp_test::bitwise_equal(b2[i].cpu(), b[i].cpu()) || tolerance_used(b2[i], b[i], tolerance) <= 1.0)
          << c.name << ": LibTorch's resumed from the fused checkpoint";
      EXPECT_TRUE(amp_test::bitwise_equal(a2[i].cpu(), a[i].cpu()) || tolerance_used(a2[i], a[i], tolerance) <= 1.0)
          << c.name;
    }
  }
}

// Param groups with their own options, a group added later, and an LR scheduler: all read per step.
TEST_P(FusedOptimizersTest, ParamGroupsAndSchedulersWork) {
  auto a = make_params(torch::kFloat, device());
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
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_LE(tolerance_used(a[i], b[i], fused_tolerance(device().type())), 1.0) << "parameter " << i;
  }
}

AMP_INSTANTIATE_FOR_DEVICES(FusedOptimizersTest);

// Checked before any route is taken: the same on every device.
TEST(FusedOptimizersCpuTest, BadGradientsAndOptionsAreClearErrors) {
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

class FusedAtLevelTest : public amp_test::LevelTest {};

class FusedO2Test : public amp_test::DeviceTest {};
class FusedGradScalerTest : public amp_test::DeviceTest {};

std::vector<torch::Tensor> float_copies(const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> out;
  for (const auto& t : tensors) out.push_back(t.detach().to(torch::kFloat).clone());
  return out;
}

// One ulp of `dtype` relative to the value: its machine epsilon (bf16 2^-7, fp16 2^-10), rounded up.
double lp_ulp(c10::ScalarType dtype) { return dtype == torch::kBFloat16 ? 0.0079 : 0.001; }

// How close amp with a fused optimizer ends to amp with LibTorch's after run_level_case's steps: bit for bit;
// or float16/bfloat16 parameters within one ulp of their dtype (relative_error), fp32 model parameters within
// `fp32` and fp32 masters within `masters`; or, `update` > 0, only the whole update (from the start, all
// parameters together): |fused's - LibTorch's| <= update |LibTorch's|.
struct LevelTolerance {
  bool bitwise = false;
  Tolerance fp32{}, masters{};
  double update = 0;
  static LevelTolerance exact() { return {true}; }
  static LevelTolerance close(Tolerance fp32, Tolerance masters) { return {false, fp32, masters}; }
  static LevelTolerance update_within(double update) { return {false, {}, {}, update}; }
};

template <class Fused, class Plain, class Options>
void run_level_case(const amp::Options& amp_options, const Options& optimizer_options, torch::Device device,
                    LevelTolerance tolerance, const std::string& what) {
  torch::manual_seed(3);
  amp_test::ConvBnNet net_fused, net_plain;
  {
    torch::NoGradGuard no_grad;
    auto dst = net_plain->parameters();
    auto src = net_fused->parameters();
    for (size_t i = 0; i < dst.size(); ++i) dst[i].copy_(src[i]);
  }
  net_fused->to(device);
  net_plain->to(device);
  const auto start = float_copies(net_fused->parameters());
  auto [x_cpu, y_cpu] = amp_test::quadrant_images(64, 7);
  const auto x = x_cpu.to(device), y = y_cpu.to(device);
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
  EXPECT_EQ(amp::loss_scale(opt_f), amp::loss_scale(opt_p)) << what;
  const auto pf = net_fused->parameters(), pp = net_plain->parameters();
  if (tolerance.update > 0) {
    std::vector<torch::Tensor> fused_update, plain_update;
    for (size_t i = 0; i < pf.size(); ++i) {
      fused_update.push_back((pf[i].to(torch::kFloat) - start[i]).flatten());
      plain_update.push_back((pp[i].to(torch::kFloat) - start[i]).flatten());
    }
    const auto f = torch::cat(fused_update), p = torch::cat(plain_update);
    ASSERT_GT(p.norm().item<double>(), 0.0) << what;
    EXPECT_LE(((f - p).norm() / p.norm()).item<double>(), tolerance.update) << what;
    return;
  }
  auto expect_close = [&](const torch::Tensor& a, const torch::Tensor& b, Tolerance fp32, const std::string& which) {
    if (tolerance.bitwise) {
      EXPECT_TRUE(amp_test::bitwise_equal(a.cpu(), b.cpu())) << what << ": " << which;
    } else if (a.scalar_type() == torch::kFloat) {
      EXPECT_LE(tolerance_used(a, b, fp32), 1.0) << what << ": " << which;
    } else {
      EXPECT_LE(relative_error(a, b), lp_ulp(a.scalar_type())) << what << ": " << which;
    }
  };
  for (size_t i = 0; i < pf.size(); ++i) {
    expect_close(pf[i], pp[i], tolerance.fp32, "model parameter " + std::to_string(i));
  }
  const auto mf = amp::master_params(opt_f), mp = amp::master_params(opt_p);
  for (size_t i = 0; i < mf.size(); ++i) {
    EXPECT_EQ(mf[i].scalar_type(), mp[i].scalar_type());
    expect_close(mf[i], mp[i], tolerance.masters, "master " + std::to_string(i));
  }
}

}  // namespace

// Every level and dtype: amp with a fused optimizer trains as amp with LibTorch's.
//  - The CPU: amp's loop and LibTorch's round differently by an ulp (NOTE [Fused step arithmetic]), which a
//    low-precision model copy can show as one ulp of its dtype; fp32 parameters stay within 1e-5 relative, fp32
//    masters within 1e-4. At O3 bit for bit: the low-precision parameters take the per-op route, which steps them
//    with Python's arithmetic as amp steps LibTorch's optimizers there (src/optim/python_steps.cpp).
//  - CUDA: ATen's kernels, fp32 within fused_tolerance(kCUDA), a low-precision model copy within one ulp. At O3
//    the low-precision parameters take ATen's kernels too, which compute a step in fp32 where LibTorch's per-op
//    algorithm rounds every intermediate to float16/bfloat16 (float16 Adam's 0.001 g^2 underflows to 0 for
//    |g| < 5e-3, leaving the denominator eps alone), so the two part by up to a whole update per step. So: bit
//    for bit with the per-op route forced, and with ATen's kernels the whole update within 50% of LibTorch's
//    (Adam in float16 with ATen's CPU kernels, which compute the same way: 16%).
TEST_P(FusedAtLevelTest, TrainsAsWithLibTorchsOptimizer) {
  const bool o3 = std::string(GetParam().level) == "O3";
  const bool cuda = GetParam().device == torch::kCUDA;
  const torch::Device device = GetParam().device;
  auto run = [&](LevelTolerance tolerance) {
    using namespace torch::optim;
    run_level_case<amp::optim::FusedSGD, SGD>(options(), SGDOptions(0.05).momentum(0.9), device, tolerance, "SGD");
    run_level_case<amp::optim::FusedAdam, Adam>(options(), AdamOptions(1e-3).eps(1e-3), device, tolerance, "Adam");
    run_level_case<amp::optim::FusedAdamW, AdamW>(options(), AdamWOptions(1e-3).eps(1e-3), device, tolerance, "AdamW");
  };
  if (!o3) {
    if (cuda) run(LevelTolerance::close(fused_tolerance(torch::kCUDA), fused_tolerance(torch::kCUDA)));
    else run(LevelTolerance::close(fused_tolerance(torch::kCPU), Tolerance{1e-4, 1e-7}));
    return;
  }
  {
    FusedRouteGuard per_op(cuda ? FusedRoute::kPerOp : FusedRoute::kAuto);
    run(LevelTolerance::exact());
  }
  if (cuda) run(LevelTolerance::update_within(0.5));
}

AMP_INSTANTIATE_FOR_LEVELS(FusedAtLevelTest, amp_test::level_cases({"O0", "O1", "O2", "O3"}, /*o0_once=*/true));

// O2: the step that also writes the model's low-precision copy equals, bit for bit, a plain fp32 step of
// the same fused optimizer on the masters followed by rounding them into the model (the unfused path).
TEST_P(FusedO2Test, ModelCopyWrittenByTheStepEqualsTheUnfusedPath) {
  for (const auto dtype : amp_test::low_precision_dtypes()) {
    if (!computes(dtype)) continue;
    torch::manual_seed(4);
    amp_test::ConvBnNet net;
    net->to(device());
    auto [x_cpu, y_cpu] = amp_test::quadrant_images(32, 8);
    const auto x = x_cpu.to(device()), y = y_cpu.to(device());
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
        ASSERT_TRUE(amp_test::bitwise_equal(masters[i].cpu(), shadow[i].cpu())) << "step " << s << " master " << i;
      }
      for (size_t i = 0; i < params.size(); ++i) {  // BatchNorm's fp32 parameters are stepped in place
        ASSERT_TRUE(amp_test::bitwise_equal(params[i].cpu(), shadow[i].to(params[i].scalar_type()).cpu()))
            << "step " << s << " model parameter " << i;
      }
    }
  }
}

// An overflowing backward skips the step: no parameter, master, model copy or optimizer state changes a bit.
TEST_P(FusedO2Test, SkippedStepChangesNothing) {
  torch::manual_seed(5);
  amp_test::ConvBnNet net;
  net->to(device());
  auto [x_cpu, y_cpu] = amp_test::quadrant_images(32, 9);
  const auto x = x_cpu.to(device()), y = y_cpu.to(device());
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
  for (size_t i = 0; i < masters.size(); ++i) {
    EXPECT_TRUE(amp_test::bitwise_equal(masters[i].cpu(), masters_after[i].cpu())) << i;
  }
  size_t k = 0;
  for (const auto& [key, s] : opt.state()) {
    const auto& adam = static_cast<const torch::optim::AdamWParamState&>(*s);
    EXPECT_TRUE(amp_test::bitwise_equal(adam.exp_avg().cpu(), state[k++].cpu()));
    EXPECT_TRUE(amp_test::bitwise_equal(adam.exp_avg_sq().cpu(), state[k++].cpu()));
    EXPECT_EQ(adam.step(), 1);
  }
  EXPECT_EQ(opt.skipped_steps(), 1);
  EXPECT_EQ(amp::loss_scale(opt), 32768.0);
}

// torch::save / torch::load of the amp optimizer mid-run, then training on: bitwise the run that never stopped.
TEST_P(FusedO2Test, ResumeIsBitwiseIdenticalToNotStopping) {
  auto [x_cpu, y_cpu] = amp_test::quadrant_images(32, 10);
  const auto x = x_cpu.to(device()), y = y_cpu.to(device());
  auto make = [this](amp_test::ConvBnNet& net) {
    torch::manual_seed(6);
    net = amp_test::ConvBnNet();
    net->to(device());
    return amp::initialize(net, amp::optim::FusedSGD(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9)),
                           amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0));
  };
  auto train = [&x, &y](auto& model, auto& opt, int steps) {
    for (int s = 0; s < steps; ++s) amp_test::train_step(model, opt, x, y);
  };
  amp_test::ConvBnNet straight_net, first_net, resumed_net;
  auto [straight_model, straight_opt] = make(straight_net);
  train(straight_model, straight_opt, 6);

  auto [first_model, first_opt] = make(first_net);
  train(first_model, first_opt, 3);
  const auto dir = std::filesystem::temp_directory_path();
  const std::string suffix = on_cuda() ? "_cuda.pt" : "_cpu.pt";  // ctest runs the cpu and cuda variants at once
  const auto model_path = (dir / ("amp_fused_resume_model" + suffix)).string();
  const auto opt_path = (dir / ("amp_fused_resume_opt" + suffix)).string();
  torch::save(first_net, model_path);
  torch::save(first_opt, opt_path);

  auto [resumed_model, resumed_opt] = make(resumed_net);
  amp::load_weights(*resumed_net, model_path);
  torch::load(resumed_opt, opt_path);
  std::filesystem::remove(model_path);
  std::filesystem::remove(opt_path);
  train(resumed_model, resumed_opt, 3);
  const auto a = straight_net->parameters(), b = resumed_net->parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(amp_test::bitwise_equal(a[i].cpu(), b[i].cpu())) << "parameter " << i;
  }
  const auto ma = amp::master_params(straight_opt), mb = amp::master_params(resumed_opt);
  for (size_t i = 0; i < ma.size(); ++i) {
    EXPECT_TRUE(amp_test::bitwise_equal(ma[i].cpu(), mb[i].cpu())) << "master " << i;
  }
}

// The fused step's raw writes bump version counters, so weights edited after a fused step still reach the
// masters (NOTE [Masters follow the model]) and the next step starts from them.
TEST_P(FusedO2Test, WeightsWrittenAfterAFusedStepReachTheMasters) {
  torch::manual_seed(7);
  amp_test::ConvBnNet net;
  net->to(device());
  auto [x_cpu, y_cpu] = amp_test::quadrant_images(32, 11);
  const auto x = x_cpu.to(device()), y = y_cpu.to(device());
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
// torch's. After the step the gradients are unscaled on every route (amp's CPU loop, LibTorch's per-op
// algorithm, ATen's kernels), as torch's fused kernels store them back; a skipped step leaves them scaled.
TEST_P(FusedGradScalerTest, ScaleInsideTheStepEqualsUnscaleThenStep) {
  std::vector<FusedRoute> routes = {FusedRoute::kAuto, FusedRoute::kPerOp};
  if (amp::optim::detail::has_aten_fused_optimizers()) routes.push_back(FusedRoute::kAten);
  for (const auto route : routes) {
    FusedRouteGuard forced(route);
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
        for (auto& model : models) model->to(device());
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
        const std::string what = std::string(adamw ? "AdamW" : "Adam") + (amsgrad ? " amsgrad" : "") + ", route " +
                               std::to_string(static_cast<int>(route));
        for (int s = 0; s < 5; ++s) {
          torch::manual_seed(20 + s);
          const auto x = torch::randn({16, 8}).to(device()), y = torch::randn({16, 4}).to(device());
          std::vector<std::optional<torch::Tensor>> stepped;
          for (int m = 0; m < 3; ++m) {
            opts[m]->zero_grad();
            torch::Tensor loss;
            {
              amp::AutocastGuard autocast(device().type(), torch::kBFloat16);
              loss = torch::mse_loss(models[m]->forward(x).to(torch::kFloat), y);
            }
            scalers[m].scale(loss).backward();
            if (s == 2) models[m]->parameters()[0].mutable_grad()[0][0] = INFINITY;
            if (m == 1) scalers[m].unscale_(*opts[m]);
            const auto scaled_grad = models[m]->parameters()[2].grad().clone();
            const double scale = scalers[m].get_scale();  // a power of two: unscaling is exact
            stepped.push_back(scalers[m].step(*opts[m]));
            if (m == 0) {
              const auto expected = s == 2 ? scaled_grad : scaled_grad / scale;
              EXPECT_TRUE(amp_test::bitwise_equal(models[m]->parameters()[2].grad().cpu(), expected.cpu()))
                  << what << " step " << s << ": the gradient after the step";
            }
            scalers[m].update();
          }
          // A fused step skips inside (its result either way, as torch's); LibTorch's is skipped by the scaler.
          for (int m = 0; m < 2; ++m) EXPECT_TRUE(stepped[m].has_value()) << what << " step " << s;
          EXPECT_EQ(stepped[2].has_value(), s != 2) << what << " step " << s;
        }
        for (int m = 0; m < 3; ++m) EXPECT_EQ(scalers[m].get_scale(), 128.0 * 16 * 0.5) << what;  // 4 clean, 1 inf
        const auto a = models[0]->parameters(), b = models[1]->parameters(), c = models[2]->parameters();
        for (size_t i = 0; i < a.size(); ++i) {
          EXPECT_TRUE(amp_test::bitwise_equal(a[i].cpu(), b[i].cpu())) << what << " parameter " << i;
          EXPECT_TRUE(torch::allclose(a[i], c[i], 1.3e-6, 1e-5)) << what << " parameter " << i;
        }
      }
    }
  }
}

AMP_INSTANTIATE_FOR_DEVICES(FusedO2Test);
AMP_INSTANTIATE_FOR_DEVICES(FusedGradScalerTest);
