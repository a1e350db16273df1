// amp::clip_grad_norm_ and amp::GradScaler::clip_grad_norm_: the gradients the step uses, after unscaling, equal
// to torch.nn.utils.clip_grad_norm_ (computed by Python at test time), untouched after an overflow.
// Ported from PyTorch's test/nn/test_clip_grad.py (test_clip_grad_norm: the norm returned and the clipped
// gradients for norm types 2, 1 and inf, with and without clipping; the empty case) and from torch.amp's
// recipe tests in test/test_cuda.py (test_grad_scaling_clipping: unscale_ then clip, skipped steps).

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <limits>

#include "amp/clip_grad.h"
#include "core/host_sync.h"
#include "optim/optimizer_access.h"
#include "scaling/multi_tensor.h"
#include "support/models.h"
#include "support/support.h"

namespace {

namespace fs = std::filesystem;
using amp_test::Mlp;

constexpr double kClipInf = std::numeric_limits<double>::infinity();

std::vector<torch::Tensor> clip_clones(const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> out;
  for (const auto& t : tensors) out.push_back(t.clone());
  return out;
}

float clip_value(const torch::Tensor& t) { return t.item<float>(); }

// An initialized run that has done one scaled backward on an Mlp (plus a BatchNorm at O2/O3: fp32 at O2).
struct ClipRun {
  explicit ClipRun(amp::Options options, uint64_t seed = 0, double loss_factor = 1.0) {
    torch::manual_seed(seed);
    net = Mlp(8, 16, 4);
    auto initialized = amp::initialize(net, torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(0.1)),
                                       options.verbosity(0));
    model.emplace(std::move(initialized.model));
    optimizer.emplace(std::move(initialized.optimizer));
    backward(loss_factor);
  }
  void backward(double loss_factor) {
    torch::manual_seed(1);
    const auto x = torch::randn({32, 8}), y = torch::randint(0, 4, {32});
    auto loss = torch::nn::functional::cross_entropy((*model)(x), y) * loss_factor;
    auto scaled = amp::scale_loss(loss, *optimizer);
    scaled.backward();
  }
  Mlp net{nullptr};
  std::optional<amp::Model<Mlp>> model;
  std::optional<amp::Optimizer<torch::optim::SGD>> optimizer;
};

// Python torch.nn.utils.clip_grad_norm_ on the same gradients, for every level x dtype and norm type.
const char* const kClipScript = AMP_SOURCE_DIR "/tests/python/clip_grad.py";

double clip_rel_diff(const torch::Tensor& a, const torch::Tensor& b) {
  const auto x = a.to(torch::kDouble), y = b.to(torch::kDouble);
  return ((x - y).abs() / y.abs().clamp_min(1e-30)).max().item<double>();
}

}  // namespace

TEST(ClipGradPythonTest, EqualsTorchClipGradNormAtEveryLevelAndDtype) {
  if (!amp_test::python_has_torch()) GTEST_SKIP() << "these checks need Python with the torch wheel (set AMP_PYTHON)";
  struct Case {
    std::string name;
    amp::Options options;
    double max_norm;
  };
  std::vector<Case> cases = {{"O0", amp::Options("O0"), 0.05}, {"O0_unclipped", amp::Options("O0"), 1e6}};
  for (const char* level : {"O1", "O2", "O3"}) {
    for (const auto dtype : amp_test::low_precision_dtypes()) {
      if (!amp_test::cpu_computes(dtype)) continue;
      cases.push_back({std::string(level) + "_" + amp_test::dtype_label(dtype),
                       amp::Options(level).low_precision_dtype(dtype), 0.05});
    }
  }
  // The gradients each case's step would use, before clipping, and amp's answer per norm type.
  c10::impl::GenericDict grads_of(c10::StringType::get(), c10::AnyType::get());
  c10::impl::GenericDict max_norm_of(c10::StringType::get(), c10::AnyType::get());
  std::map<std::string, std::pair<torch::Tensor, std::vector<torch::Tensor>>> amp_result;
  for (const auto& c : cases) {
    for (const auto& [label, norm_type] : std::vector<std::pair<std::string, double>>{{"2", 2.0}, {"1", 1.0}, {"inf", kClipInf}}) {
      ClipRun run(c.options);
      const auto before = clip_clones(amp::detail::OptimizerAccess::grads_for_step(*run.optimizer, "test"));
      ASSERT_FALSE(before.empty());
      if (label == "2") {
        c10::List<torch::Tensor> list;
        for (const auto& g : before) list.push_back(g);
        grads_of.insert(c.name, list);
        max_norm_of.insert(c.name, c.max_norm);
      }
      const torch::Tensor norm = amp::clip_grad_norm_(*run.optimizer, c.max_norm, norm_type);
      EXPECT_EQ(norm.dim(), 0);
      EXPECT_EQ(norm.scalar_type(), torch::kFloat);
      amp_result[c.name + "/" + label] = {norm, clip_clones(amp::detail::OptimizerAccess::grads_for_step(*run.optimizer, "test"))};
    }
  }
  const fs::path dir = fs::path(::testing::TempDir()) / ("amp_clip_grad_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  amp::PythonCheckpoint out;
  out.put("cases", grads_of);
  out.put("max_norm", max_norm_of);
  out.save((dir / "cases.pt").string());
  const std::string command = amp_test::python_interpreter() + " '" + kClipScript + "' '" + dir.string() + "' 2>&1";
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  const auto reference = amp::PythonCheckpoint::load((dir / "reference.pt").string());

  for (const auto& [key, result] : amp_result) {
    SCOPED_TRACE(key);
    const auto ref = reference.get(key).toGenericDict();
    const auto& [norm, clipped] = result;
    const bool fp32_grads = clipped.front().scalar_type() == torch::kFloat;
    // fp32 gradients: torch's own arithmetic (fp32 per-tensor norms, then the norm of the norms) against amp's one
    // pass accumulated in double. bf16/fp16 gradients: against torch on fp32 copies, because torch rounds each
    // tensor's norm to bf16/fp16 (kept as a looser check of the same-dtype call).
    const auto ref_norm = ref.at(fp32_grads ? "norm" : "norm_fp32").toTensor();
    const double norm_diff = clip_rel_diff(norm, ref_norm);
    std::cout << "[ measured ] " << key << ": norm " << clip_value(norm) << ", relative difference to torch " << norm_diff;
    EXPECT_LT(norm_diff, 1e-6);
    EXPECT_LT(clip_rel_diff(norm, ref.at("norm").toTensor()), fp32_grads ? 1e-6 : 1e-2);
    const auto ref_clipped = ref.at(fp32_grads ? "clipped" : "clipped_fp32").toTensorList();
    ASSERT_EQ(ref_clipped.size(), clipped.size());
    double worst = 0.0;
    for (size_t i = 0; i < clipped.size(); ++i) {
      const torch::Tensor expected = ref_clipped.get(i);
      ASSERT_EQ(expected.scalar_type(), clipped[i].scalar_type());
      // The coefficients differ as the norms do (torch's fp32 sums against amp's double ones: up to 1e-6), plus a
      // rounding of the product: 2 ulps of fp32, or 1 of the gradient's own dtype.
      const double ulp = fp32_grads ? 2 * std::ldexp(1.0, -23) : clipped[i].scalar_type() == torch::kBFloat16 ? std::ldexp(1.0, -8)
                                                                                                            : std::ldexp(1.0, -11);
      const auto diff = (clipped[i].to(torch::kDouble) - expected.to(torch::kDouble)).abs();
      const auto bound = expected.to(torch::kDouble).abs() * (1e-6 + 2 * ulp) + 1e-30;
      EXPECT_TRUE((diff <= bound).all().item<bool>()) << "tensor " << i << ": max diff " << diff.max().item<double>();
      worst = std::max(worst, clip_rel_diff(clipped[i], expected));
    }
    std::cout << ", clipped gradients' largest relative difference " << worst << std::endl;
  }
  fs::remove_all(dir);
}

TEST(ClipGradTest, NormTypesOnKnownValues) {
  // torch's test_clip_grad_norm shape: the norm returned is the norm before clipping.
  auto a = torch::tensor({3.0f, -4.0f}), b = torch::tensor({0.0f});
  EXPECT_FLOAT_EQ(clip_value(amp::detail::total_norm({a, b}, 2.0)), 5.0f);
  EXPECT_FLOAT_EQ(clip_value(amp::detail::total_norm({a, b}, 1.0)), 7.0f);
  EXPECT_FLOAT_EQ(clip_value(amp::detail::total_norm({a, b}, kClipInf)), 4.0f);
  EXPECT_FLOAT_EQ(clip_value(amp::detail::total_norm({}, 2.0)), 0.0f);
  // The same in bf16 and fp16 (exact values): fp32 accumulation, fp32 result.
  for (const auto dtype : amp_test::low_precision_dtypes()) {
    EXPECT_FLOAT_EQ(clip_value(amp::detail::total_norm({a.to(dtype)}, 2.0)), 5.0f);
    EXPECT_EQ(amp::detail::total_norm({a.to(dtype)}, 2.0).scalar_type(), torch::kFloat);
  }
  // Clipping to 1: the coefficient is 1 / (5 + 1e-6), computed as torch does.
  std::vector<torch::Tensor> grads = {a.clone()};
  const auto norm = amp::detail::clip_grads(grads, 1.0, 2.0, torch::Tensor());
  EXPECT_FLOAT_EQ(clip_value(norm), 5.0f);
  const auto coefficient = torch::tensor(5.0f).add(1e-6).reciprocal().mul(1.0).clamp_max(1.0);
  EXPECT_TRUE(amp_test::bitwise_equal(grads[0], a * coefficient));
  // No clipping below max_norm: multiplied by exactly 1.
  std::vector<torch::Tensor> small = {a.clone()};
  amp::detail::clip_grads(small, 100.0, 2.0, torch::Tensor());
  EXPECT_TRUE(amp_test::bitwise_equal(small[0], a));
}

TEST(ClipGradTest, LargeTensorsMatchADoubleReferenceForAnyThreadCount) {
  // Several chunks of amp's pass and a tail: against the norm in double precision, and bitwise the same
  // value with 1 and 2 threads (fixed chunks, combined in order).
  torch::manual_seed(3);
  std::vector<torch::Tensor> grads = {torch::randn({1 << 20}), torch::randn({1000}) * 1e-3, torch::randn({77, 13})};
  double sum = 0.0;
  for (const auto& g : grads) sum += g.to(torch::kDouble).pow(2).sum().item<double>();
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  const auto one = amp::detail::total_norm(grads, 2.0);
  at::set_num_threads(2);
  const auto two = amp::detail::total_norm(grads, 2.0);
  at::set_num_threads(threads);
  EXPECT_TRUE(amp_test::bitwise_equal(one, two));
  EXPECT_NEAR(clip_value(one), std::sqrt(sum), std::sqrt(sum) * 1e-7);
  // bf16 gradients: converted exactly, so the same double reference applies to their values.
  std::vector<torch::Tensor> bf16;
  double bf16_sum = 0.0;
  for (const auto& g : grads) {
    bf16.push_back(g.to(torch::kBFloat16));
    bf16_sum += bf16.back().to(torch::kDouble).pow(2).sum().item<double>();
  }
  EXPECT_NEAR(clip_value(amp::detail::total_norm(bf16, 2.0)), std::sqrt(bf16_sum), std::sqrt(bf16_sum) * 1e-7);
  EXPECT_FLOAT_EQ(clip_value(amp::detail::total_norm(grads, kClipInf)), torch::cat({grads[0], grads[1], grads[2].flatten()}).abs().max().item<float>());
}

TEST(ClipGradTest, ClipsTheMastersAtO2AndTheStepUsesThem) {
  for (const auto dtype : amp_test::low_precision_dtypes()) {
    if (!amp_test::cpu_computes(dtype)) continue;
    SCOPED_TRACE(amp_test::dtype_label(dtype));
    ClipRun run(amp::Options("O2").low_precision_dtype(dtype));
    const auto masters = run.optimizer->master_params();
    ASSERT_EQ(masters.front().scalar_type(), torch::kFloat);
    const auto model_grads_before = clip_clones([&] {
      std::vector<torch::Tensor> g;
      for (const auto& p : run.net->parameters()) if (p.grad().defined()) g.push_back(p.grad());
      return g;
    }());
    const auto norm = amp::clip_grad_norm_(*run.optimizer, 0.01);
    EXPECT_GT(clip_value(norm), 0.01f);
    // The fp32 masters' gradients now have norm 0.01 (to rounding); the model's low-precision ones are untouched.
    EXPECT_NEAR(clip_value(amp::detail::total_norm(amp::detail::OptimizerAccess::grads_for_step(*run.optimizer, "test"), 2.0)), 0.01, 1e-6);
    size_t i = 0;
    for (const auto& p : run.net->parameters()) {
      if (!p.grad().defined()) continue;
      EXPECT_TRUE(amp_test::bitwise_equal(p.grad(), model_grads_before[i++]));
    }
    // The step reads the clipped masters: the same update as SGD by hand on them (lr 0.1).
    std::vector<torch::Tensor> expected;
    for (const auto& m : masters) expected.push_back(m.detach() - 0.1 * m.grad());
    run.optimizer->step();
    for (size_t k = 0; k < masters.size(); ++k) EXPECT_TRUE(torch::allclose(masters[k], expected[k], 1e-6, 1e-9));
  }
}

TEST(ClipGradTest, OverflowReturnsInfLeavesGradientsAndSkipsTheStep) {
  ClipRun run(amp::Options("O2").low_precision_dtype(torch::kBFloat16));
  // A second backward that overflows (loss * inf), accumulated onto the first.
  const auto masters_before = clip_clones(run.optimizer->master_params());
  run.backward(kClipInf);
  ASSERT_TRUE(run.optimizer->step_will_be_skipped());
  std::vector<torch::Tensor> grads_before;
  for (const auto& m : run.optimizer->master_params()) grads_before.push_back(m.grad().defined() ? m.grad().clone() : m.grad());
  const int64_t syncs = amp::detail::host_sync_count();
  const auto norm = amp::clip_grad_norm_(*run.optimizer, 1.0);
  EXPECT_EQ(amp::detail::host_sync_count(), syncs) << "clipping must not read anything back to the host";
  EXPECT_TRUE(std::isinf(clip_value(norm)));
  const auto after = run.optimizer->master_params();
  for (size_t i = 0; i < after.size(); ++i) {
    ASSERT_EQ(after[i].grad().defined(), grads_before[i].defined());
    if (grads_before[i].defined()) EXPECT_TRUE(amp_test::bitwise_equal(after[i].grad(), grads_before[i]));
  }
  run.optimizer->step();
  EXPECT_EQ(run.optimizer->skipped_steps(), 1);
  for (size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(amp_test::bitwise_equal(after[i], masters_before[i]));
}

TEST(ClipGradTest, ParamGroupsAddedAfterInitializeAreClipped) {
  torch::manual_seed(0);
  Mlp net(8, 16, 4);
  auto extra = torch::nn::Linear(4, 2);
  std::vector<torch::Tensor> first = net->fc1->parameters();
  auto [model, optimizer] = amp::initialize(net, torch::optim::SGD(first, torch::optim::SGDOptions(0.1)),
                                            amp::Options("O0").verbosity(0));
  optimizer.add_param_group(torch::optim::OptimizerParamGroup(net->fc2->parameters()));
  const auto loss = model(torch::randn({4, 8})).pow(2).sum();
  {
    auto scaled = amp::scale_loss(loss, optimizer);
    scaled.backward();
  }
  std::vector<torch::Tensor> all;
  for (const auto& p : net->parameters()) all.push_back(p.grad());
  const auto expected = amp::detail::total_norm(all, 2.0);
  EXPECT_TRUE(amp_test::bitwise_equal(amp::clip_grad_norm_(optimizer, 1e-3), expected));
  EXPECT_NEAR(clip_value(amp::detail::total_norm(all, 2.0)), 1e-3, 1e-8);
}

TEST(ClipGradTest, RefusesGradientsThatAreStillScaled) {
  torch::manual_seed(0);
  Mlp net(8, 16, 4);
  auto [model, optimizer] = amp::initialize(net, torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(0.1)),
                                            amp::Options("O1").low_precision_dtype(torch::kBFloat16).verbosity(0));
  const auto x = torch::randn({4, 8});
  {
    auto scaled = amp::scale_loss(model(x).sum(), optimizer, amp::ScaleLossOptions().delay_unscale(true));
    scaled.backward();
  }
  ASSERT_THROWS_WITH(amp::clip_grad_norm_(optimizer, 1.0),
                     "amp::clip_grad_norm_: the gradients are still multiplied by the loss scale, because the last "
                     "scale_loss used delay_unscale(true)");
  {
    auto scaled = amp::scale_loss(model(x).sum(), optimizer);
    ASSERT_THROWS_WITH(amp::clip_grad_norm_(optimizer, 1.0),
                       "amp::clip_grad_norm_: an amp::scale_loss handle of this optimizer is still open");
    scaled.backward();
  }
  EXPECT_NO_THROW(amp::clip_grad_norm_(optimizer, 1.0));
}

TEST(ClipGradTest, BadArgumentsNameTheValue) {
  ClipRun run(amp::Options("O0"));
  ASSERT_THROWS_WITH(amp::clip_grad_norm_(*run.optimizer, 0.0),
                     "amp::clip_grad_norm_: max_norm must be positive and finite, got 0.0.");
  ASSERT_THROWS_WITH(amp::clip_grad_norm_(*run.optimizer, -1.0), "max_norm must be positive and finite, got -1.0.");
  ASSERT_THROWS_WITH(amp::clip_grad_norm_(*run.optimizer, std::nan("")), "max_norm must be positive and finite, got nan.");
  ASSERT_THROWS_WITH(amp::clip_grad_norm_(*run.optimizer, kClipInf), "max_norm must be positive and finite, got inf.");
  ASSERT_THROWS_WITH(amp::clip_grad_norm_(*run.optimizer, 1.0, 3.0),
                     "amp::clip_grad_norm_: norm_type must be 2 (the default), 1 or INFINITY (the largest absolute "
                     "value), got 3.0.");
  amp::GradScaler scaler;
  torch::optim::SGD sgd(run.net->parameters(), torch::optim::SGDOptions(0.1));
  ASSERT_THROWS_WITH(scaler.clip_grad_norm_(sgd, 1.0, 0.5), "amp::GradScaler::clip_grad_norm_: norm_type must be");
}

TEST(ClipGradTest, GradScalerUnscalesOnceThenClipsAsTorchAmpRecipe) {
  // torch.amp's recipe: scaler.scale(loss).backward(); scaler.unscale_(opt); clip_grad_norm_(...); scaler.step(opt).
  auto make = [](uint64_t seed) {
    torch::manual_seed(seed);
    return Mlp(8, 16, 4);
  };
  auto run = [&](bool explicit_unscale, double loss_factor) {
    auto net = make(0);
    torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-2));
    amp::GradScaler scaler(amp::GradScalerOptions().init_scale(1024.0));
    torch::manual_seed(1);
    const auto x = torch::randn({16, 8});
    torch::Tensor loss;
    {
      amp::AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
      loss = net->forward(x).pow(2).mean() * loss_factor;
    }
    scaler.scale(loss).backward();
    if (explicit_unscale) scaler.unscale_(adam);
    const auto norm = scaler.clip_grad_norm_(adam, 1e-3);
    std::vector<torch::Tensor> grads;
    for (const auto& p : net->parameters()) grads.push_back(p.grad().clone());
    const bool stepped = scaler.step(adam).has_value();
    scaler.update();
    return std::make_tuple(norm, grads, stepped, scaler.get_scale());
  };
  const auto [norm_a, grads_a, stepped_a, scale_a] = run(false, 1.0);
  const auto [norm_b, grads_b, stepped_b, scale_b] = run(true, 1.0);
  EXPECT_TRUE(amp_test::bitwise_equal(norm_a, norm_b)) << "clip_grad_norm_ must not unscale twice";
  for (size_t i = 0; i < grads_a.size(); ++i) EXPECT_TRUE(amp_test::bitwise_equal(grads_a[i], grads_b[i]));
  EXPECT_TRUE(stepped_a);
  EXPECT_EQ(scale_a, 1024.0);
  // The same gradients unscaled and clipped by hand, as torch's recipe with LibTorch's clip_grad_norm_.
  EXPECT_NEAR(clip_value(amp::detail::total_norm(grads_a, 2.0)), 1e-3, 1e-8);  // 1e-3 * norm / (norm + 1e-6)

  // inf/NaN gradients: inf returned, gradients left as unscale_ made them, step skipped, scale backed off.
  const auto [norm_c, grads_c, stepped_c, scale_c] = run(true, kClipInf);
  EXPECT_TRUE(std::isinf(clip_value(norm_c)));
  EXPECT_FALSE(stepped_c);
  EXPECT_EQ(scale_c, 512.0);
  bool any_non_finite = false;
  for (const auto& g : grads_c) any_non_finite = any_non_finite || !torch::isfinite(g).all().item<bool>();
  EXPECT_TRUE(any_non_finite) << "the gradients keep their inf/NaN (multiplied by 1), not zeros";

  // After step(): too late.
  auto net = make(0);
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  amp::GradScaler scaler;
  scaler.scale(net->forward(torch::randn({2, 8})).sum()).backward();
  scaler.step(sgd);
  ASSERT_THROWS_WITH(scaler.clip_grad_norm_(sgd, 1.0), "amp::GradScaler::clip_grad_norm_ is being called after step()");
}

TEST(ClipGradTest, DisabledGradScalerStillClips) {
  torch::manual_seed(0);
  Mlp net(8, 16, 4);
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  amp::GradScaler scaler(amp::GradScalerOptions().enabled(false));
  scaler.scale(net->forward(torch::randn({4, 8})).pow(2).sum()).backward();
  const auto norm = scaler.clip_grad_norm_(sgd, 1e-3);
  EXPECT_GT(clip_value(norm), 1e-3f);
  std::vector<torch::Tensor> grads;
  for (const auto& p : net->parameters()) grads.push_back(p.grad());
  EXPECT_NEAR(clip_value(amp::detail::total_norm(grads, 2.0)), 1e-3, 1e-9);
}
