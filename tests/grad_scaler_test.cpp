// amp::GradScaler against torch.amp.GradScaler's own tests (test/test_cuda.py, later test_torch.py):
// test_grad_scaling_unscale, _update_scale, _state_dict, _run_scaling_case (autocast with SGD, Adam,
// AdamW, enabled and disabled), _clipping, _clipping_separate_unscale, _penalty, _accumulation,
// _multiple and test_grad_scale_will_not_overflow, with their expected values. Those that touch gradients run on
// every device: on CUDA the unscale and inf/NaN check are ATen's _amp_foreach_non_finite_check_and_unscale_, and
// control and scaled runs do the same ops on the same device, so the expectations are the same.
#include "core/host_sync.h"
#include "scaling/multi_tensor.h"
#include "support/data.h"
#include "support/models.h"
#include "support/support.h"

namespace {

using amp::GradScaler;
using amp::GradScalerOptions;

// _create_scaling_models_optimizers: Sequential(Linear(8, 8), Linear(8, 8)) twice, same weights, on `device`
// (before any optimizer is made); the data is drawn on the CPU and moved.
struct ScalingModels {
  torch::nn::Sequential control{torch::nn::Linear(8, 8), torch::nn::Linear(8, 8)};
  torch::nn::Sequential scaling{torch::nn::Linear(8, 8), torch::nn::Linear(8, 8)};
  std::vector<std::pair<torch::Tensor, torch::Tensor>> data;
  explicit ScalingModels(torch::Device device) {
    torch::manual_seed(0);
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < control->parameters().size(); ++i) scaling->parameters()[i].copy_(control->parameters()[i]);
    control->to(device);
    scaling->to(device);
    for (int i = 0; i < 4; ++i) data.emplace_back(torch::randn({8, 8}).to(device), torch::randn({8, 8}).to(device));
  }
};

// _run_scaling_case: init_scale 128, growth 2, growth_interval 1; an inf is injected at iteration 2 of 4.
// The final scale is 128 * 2^unskipped * 0.5^skipped (1.0 disabled) and the parameters equal the control's:
// bitwise where no rounding differs, else within torch's own tolerance for the case (rtol 1e-5, its atol).
// Bitwise holds on every device: scaling by a power of two and unscaling are exact, so both runs round alike.
constexpr double kBitwise = 0.0;
template <class MakeOpt, class Run>
void run_scaling_case(torch::Device device, MakeOpt make_optimizer, Run run, bool enabled, int unskipped, int skipped,
                      double atol, const std::string& what) {
  ScalingModels m(device);
  auto control_opt = make_optimizer(m.control->parameters());
  auto scaling_opt = make_optimizer(m.scaling->parameters());
  GradScaler scaler(GradScalerOptions().init_scale(128.0).growth_factor(2.0).enabled(enabled).growth_interval(1));
  run(m.data, m.control, control_opt, &scaler, /*try_scaling_api=*/false);
  run(m.data, m.scaling, scaling_opt, &scaler, /*try_scaling_api=*/true);
  EXPECT_EQ(scaler.get_scale(), enabled ? 128.0 * std::pow(2.0, unskipped) * std::pow(0.5, skipped) : 1.0) << what;
  for (size_t i = 0; i < m.control->parameters().size(); ++i) {
    const auto c = m.control->parameters()[i];
    const auto s = m.scaling->parameters()[i];
    if (atol == kBitwise) {
      EXPECT_TRUE(amp_test::bitwise_equal(c.cpu(), s.cpu())) << what << " parameter " << i;
    } else {
      EXPECT_TRUE(torch::allclose(c, s, 1e-5, atol))
          << what << " parameter " << i << ": max difference " << (c - s).abs().max().item<double>();
    }
  }
}

template <class Opt>
void autocast_run(const std::vector<std::pair<torch::Tensor, torch::Tensor>>& data, torch::nn::Sequential& model,
                  Opt& optimizer, GradScaler* scaler, bool try_scaling_api) {
  for (size_t i = 0; i < data.size(); ++i) {
    const auto& [input, target] = data[i];
    optimizer.zero_grad();
    auto loss = torch::mse_loss(model->forward(input), target);
    if (try_scaling_api) {
      scaler->scale(loss).backward();
      if (i == 2 && scaler->is_enabled()) {  // skip_iter: inject an inf into model[1].weight's gradient
        torch::NoGradGuard no_grad;
        model->parameters()[2].mutable_grad().fill_(INFINITY);
      }
      scaler->step(optimizer);
      scaler->update();
    } else {
      loss.backward();
      if (!scaler->is_enabled() || i != 2) optimizer.step();
    }
  }
}

class GradScalerTest : public amp_test::DeviceTest {};

}  // namespace

// Host-side state, the same on every device.
TEST(GradScalerTestCpu, DefaultsAreTorchs) {
  GradScaler scaler;
  EXPECT_EQ(scaler.get_scale(), 65536.0);
  EXPECT_EQ(scaler.get_growth_factor(), 2.0);
  EXPECT_EQ(scaler.get_backoff_factor(), 0.5);
  EXPECT_EQ(scaler.get_growth_interval(), 2000);
  EXPECT_TRUE(scaler.is_enabled());
}

// test_grad_scaling_unscale: grads of 4.0 with scale 4 become 1.0; an inf or NaN anywhere (contiguous,
// transposed, sliced gradients) is found.
TEST_P(GradScalerTest, UnscaleDividesAndFindsInfAndNan) {
  for (const float bad : {INFINITY, NAN}) {
    for (const char* layout : {"contiguous", "transposed", "sliced"}) {
      auto a = torch::zeros({4, 4}, torch::TensorOptions(device()).requires_grad(true));
      auto b = torch::zeros({4, 2}, torch::TensorOptions(device()).requires_grad(true));
      torch::optim::SGD sgd({a, b}, 0.1);
      GradScaler scaler(GradScalerOptions().init_scale(4.0));
      (void)scaler.scale(torch::ones({1}, device()));  // creates the scale, as torch's lazy _scale
      a.mutable_grad() = torch::full({4, 4}, 4.0f, device());
      torch::Tensor gb = torch::full({4, 4}, 4.0f, device());
      if (std::string(layout) == "transposed") gb = gb.t().contiguous().t();
      b.mutable_grad() =
          std::string(layout) == "sliced" ? torch::full({4, 4}, 4.0f, device()).slice(1, 0, 2) : gb.slice(1, 0, 2);
      scaler.unscale_(sgd);
      EXPECT_TRUE(torch::all(a.grad() == 1.0).item<bool>()) << layout;
      EXPECT_TRUE(torch::all(b.grad() == 1.0).item<bool>()) << layout;
      EXPECT_TRUE(scaler.step(sgd).has_value()) << "clean gradients step";
      scaler.update();
      a.mutable_grad() = torch::full({4, 4}, 4.0f, device());
      b.mutable_grad() = torch::full({4, 4}, 4.0f, device()).slice(1, 0, 2);
      b.mutable_grad().select(0, 3).select(0, 1).fill_(bad);
      const auto before = a.detach().cpu();
      EXPECT_FALSE(scaler.step(sgd).has_value()) << layout << " " << bad;
      EXPECT_TRUE(amp_test::bitwise_equal(a.detach().cpu(), before)) << "a skipped step changes nothing";
    }
  }
}

// test_grad_scaling_update_scale: growth 2, backoff 0.25, interval 2, scale 4.
TEST_P(GradScalerTest, UpdateScaleSequence) {
  auto w = torch::zeros({2}, torch::TensorOptions(device()).requires_grad(true));
  torch::optim::SGD sgd({w}, 0.0);
  GradScaler scaler(GradScalerOptions().init_scale(4.0).growth_factor(2.0).backoff_factor(0.25).growth_interval(2));
  auto iteration = [&](bool inf) {
    sgd.zero_grad();
    scaler.scale(w.sum()).backward();
    if (inf) w.mutable_grad().fill_(INFINITY);
    scaler.step(sgd);
    scaler.update();
  };
  iteration(false);
  EXPECT_EQ(scaler.get_scale(), 4.0);
  EXPECT_EQ(scaler.state_dict().at("_growth_tracker").toInt(), 1);
  iteration(false);
  EXPECT_EQ(scaler.get_scale(), 8.0);
  EXPECT_EQ(scaler.state_dict().at("_growth_tracker").toInt(), 0);
  iteration(true);
  EXPECT_EQ(scaler.get_scale(), 2.0);
  EXPECT_EQ(scaler.state_dict().at("_growth_tracker").toInt(), 0);
  scaler.scale(w.sum());
  scaler.update(1024.0);  // an explicit new scale
  EXPECT_EQ(scaler.get_scale(), 1024.0);
}

// test_grad_scaling_state_dict: loading into a scaler, lazily initialized or not. amp's scale is a host float
// whatever the device of the scaled tensor.
TEST(GradScalerTestCpu, StateDictRoundTrip) {
  for (const bool lazy_init_scale : {true, false}) {
    GradScaler s0(GradScalerOptions().init_scale(3.0).growth_factor(4.0).backoff_factor(0.5).growth_interval(2));
    GradScaler s1(GradScalerOptions().init_scale(6.0).growth_factor(7.0).backoff_factor(0.8).growth_interval(1));
    if (lazy_init_scale) (void)s1.scale(torch::full({1}, 4.0f));
    s1.load_state_dict(s0.state_dict());
    EXPECT_EQ(s1.get_scale(), 3.0);
    EXPECT_EQ(s1.get_growth_factor(), 4.0);
    EXPECT_EQ(s1.get_backoff_factor(), 0.5);
    EXPECT_EQ(s1.get_growth_interval(), 2);
    EXPECT_EQ(s1.state_dict().at("_growth_tracker").toInt(), 0);
    const auto keys = s0.state_dict();
    for (const char* key : {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}) {
      EXPECT_TRUE(keys.contains(key)) << key;
    }
  }
}

TEST_P(GradScalerTest, ScalingCaseMatchesControl) {
  using Params = std::vector<torch::Tensor>;
  for (const bool enabled : {true, false}) {
    const std::string e = enabled ? " enabled" : " disabled";
    run_scaling_case(
        device(), [](Params p) { return torch::optim::SGD(p, torch::optim::SGDOptions(1.0)); },
        autocast_run<torch::optim::SGD>, enabled, 3, 1, kBitwise, "SGD" + e);
    run_scaling_case(
        device(), [](Params p) { return torch::optim::SGD(p, torch::optim::SGDOptions(1.0).momentum(0.9)); },
        autocast_run<torch::optim::SGD>, enabled, 3, 1, kBitwise, "SGD momentum" + e);
    run_scaling_case(
        device(), [](Params p) { return torch::optim::Adam(p, torch::optim::AdamOptions(1.0)); },
        autocast_run<torch::optim::Adam>, enabled, 3, 1, kBitwise, "Adam" + e);
    run_scaling_case(
        device(), [](Params p) { return torch::optim::AdamW(p, torch::optim::AdamWOptions(1.0).amsgrad(true)); },
        autocast_run<torch::optim::AdamW>, enabled, 3, 1, kBitwise, "AdamW amsgrad" + e);
  }
}

// _clipping: clip the still-scaled gradients at max_norm * scale (close to the control, not bitwise: the
// clip coefficient is computed from scaled norms).
TEST_P(GradScalerTest, ClippingScaledGradients) {
  constexpr double kMaxNorm = 0.2;
  auto run = [](const auto& data, torch::nn::Sequential& model, torch::optim::SGD& optimizer, GradScaler* scaler,
                bool try_scaling_api) {
    for (size_t i = 0; i < data.size(); ++i) {
      const auto& [input, target] = data[i];
      optimizer.zero_grad();
      auto loss = torch::mse_loss(model->forward(input), target);
      if (try_scaling_api) {
        scaler->scale(loss).backward();
        torch::nn::utils::clip_grad_norm_(model->parameters(), kMaxNorm * scaler->get_scale());
        if (i == 2 && scaler->is_enabled()) model->parameters()[2].mutable_grad().fill_(INFINITY);
        scaler->step(optimizer);
        scaler->update();
      } else {
        loss.backward();
        torch::nn::utils::clip_grad_norm_(model->parameters(), kMaxNorm);
        if (!scaler->is_enabled() || i != 2) optimizer.step();
      }
    }
  };
  run_scaling_case(device(), [](std::vector<torch::Tensor> p) { return torch::optim::SGD(p, 1.0); }, run, true, 3, 1,
                   /*atol=*/1e-5, "clipping");  // torch's test_grad_scaling_clipping uses atol 1e-5 too
}

// _clipping_separate_unscale: unscale_, then clip at max_norm: the same gradients as the control, bitwise.
TEST_P(GradScalerTest, ClippingAfterSeparateUnscale) {
  constexpr double kMaxNorm = 0.2;
  auto run = [](const auto& data, torch::nn::Sequential& model, torch::optim::SGD& optimizer, GradScaler* scaler,
                bool try_scaling_api) {
    for (size_t i = 0; i < data.size(); ++i) {
      const auto& [input, target] = data[i];
      optimizer.zero_grad();
      auto loss = torch::mse_loss(model->forward(input), target);
      if (try_scaling_api) {
        scaler->scale(loss).backward();
        if (i == 2 && scaler->is_enabled()) model->parameters()[2].mutable_grad().fill_(INFINITY);
        scaler->unscale_(optimizer);
        torch::nn::utils::clip_grad_norm_(model->parameters(), kMaxNorm, 2.0, /*error_if_nonfinite=*/false);
        scaler->step(optimizer);
        scaler->update();
      } else {
        loss.backward();
        torch::nn::utils::clip_grad_norm_(model->parameters(), kMaxNorm);
        if (!scaler->is_enabled() || i != 2) optimizer.step();
      }
    }
  };
  run_scaling_case(device(), [](std::vector<torch::Tensor> p) { return torch::optim::SGD(p, 1.0); }, run, true, 3, 1,
                   kBitwise, "clipping after unscale_");
}

// _penalty: a gradient penalty from autograd::grad of the scaled loss, unscaled by hand.
TEST_P(GradScalerTest, GradientPenalty) {
  auto run = [](const auto& data, torch::nn::Sequential& model, torch::optim::SGD& optimizer, GradScaler* scaler,
                bool try_scaling_api) {
    for (size_t i = 0; i < data.size(); ++i) {
      const auto& [input, target] = data[i];
      optimizer.zero_grad();
      auto loss = torch::mse_loss(model->forward(input), target);
      std::vector<torch::Tensor> grads;
      if (try_scaling_api) {
        grads = torch::autograd::grad({scaler->scale(loss)}, model->parameters(), {}, true, true);
        const double inv_scale = 1.0 / scaler->get_scale();
        for (auto& g : grads) g = g * inv_scale;
      } else {
        grads = torch::autograd::grad({loss}, model->parameters(), {}, true, true);
      }
      torch::Tensor norm = torch::zeros({1}, input.options());
      for (const auto& g : grads) norm = norm + g.pow(2).sum();
      loss = loss + norm.sqrt().squeeze();
      if (try_scaling_api) {
        scaler->scale(loss).backward();
        if (i == 2 && scaler->is_enabled()) model->parameters()[2].mutable_grad().fill_(INFINITY);
        scaler->step(optimizer);
        scaler->update();
      } else {
        loss.backward();
        if (!scaler->is_enabled() || i != 2) optimizer.step();
      }
    }
  };
  run_scaling_case(device(), [](std::vector<torch::Tensor> p) { return torch::optim::SGD(p, 1.0); }, run, true, 3, 1,
                   /*atol=*/1e-7, "penalty");
}

// _accumulation: two micro-batches per step, no overflow: unskipped 2, skipped 0.
TEST_P(GradScalerTest, Accumulation) {
  auto run = [](const auto& data, torch::nn::Sequential& model, torch::optim::SGD& optimizer, GradScaler* scaler,
                bool try_scaling_api) {
    constexpr int kIters = 2;
    for (int i = 0; i < kIters; ++i) {
      optimizer.zero_grad();
      for (int k = 0; k < 2; ++k) {
        const auto& [input, target] = data[static_cast<size_t>(2 * i + k)];
        auto loss = torch::mse_loss(model->forward(input), target) / 2.0;
        if (try_scaling_api) scaler->scale(loss).backward();
        else loss.backward();
      }
      if (try_scaling_api) {
        scaler->step(optimizer);
        scaler->update();
      } else {
        optimizer.step();
      }
    }
  };
  run_scaling_case(device(), [](std::vector<torch::Tensor> p) { return torch::optim::SGD(p, 1.0); }, run, true, 2, 0,
                   kBitwise, "accumulation");
}

// _multiple: two models, two optimizers, two losses, unscale_ on one of them; scale 128 * 2^3 * 0.5.
TEST_P(GradScalerTest, MultipleModelsOptimizersAndLosses) {
  ScalingModels m0(device()), m1(device());
  torch::optim::SGD c0(m0.control->parameters(), 1.0), s0(m0.scaling->parameters(), 1.0);
  torch::optim::SGD c1(m1.control->parameters(), 1.0), s1(m1.scaling->parameters(), 1.0);
  GradScaler scaler(GradScalerOptions().init_scale(128.0).growth_factor(2.0).growth_interval(1));
  for (size_t i = 0; i < m0.data.size(); ++i) {
    const auto& [input, target] = m0.data[i];
    for (const bool scaled : {false, true}) {
      auto& model0 = scaled ? m0.scaling : m0.control;
      auto& model1 = scaled ? m1.scaling : m1.control;
      auto& o0 = scaled ? s0 : c0;
      auto& o1 = scaled ? s1 : c1;
      o0.zero_grad();
      o1.zero_grad();
      auto out0 = model0->forward(input), out1 = model1->forward(input);
      auto loss0 = torch::mse_loss(0.3 * out0 + 0.7 * out1, target);
      auto loss1 = torch::mse_loss(0.6 * out0 - 0.4 * out1, target);
      if (scaled) {
        scaler.scale(loss0).backward({}, /*retain_graph=*/true);
        scaler.scale(loss1).backward();
        if (i == 2) model1->parameters()[2].mutable_grad().fill_(INFINITY);
        scaler.unscale_(o0);  // as the torch test: unscale one optimizer separately
        scaler.step(o0);
        scaler.step(o1);
        scaler.update();
      } else {
        loss0.backward({}, true);
        loss1.backward();
        o0.step();  // optimizer0's gradients are finite: it steps, in torch's test too
        if (i != 2) o1.step();
      }
    }
  }
  EXPECT_EQ(scaler.get_scale(), 128.0 * 8.0 * 0.5);
  for (auto* m : {&m0, &m1}) {
    for (size_t i = 0; i < m->control->parameters().size(); ++i) {
      EXPECT_TRUE(amp_test::bitwise_equal(m->control->parameters()[i].cpu(), m->scaling->parameters()[i].cpu())) << i;
    }
  }
}

// test_grad_scale_will_not_overflow: growth stops where the grown scale would be inf.
TEST_P(GradScalerTest, ScaleWillNotOverflow) {
  auto w = torch::zeros({2}, torch::TensorOptions(device()).requires_grad(true));
  torch::optim::SGD sgd({w}, 0.0);
  GradScaler scaler(GradScalerOptions().init_scale(1e38).growth_factor(16.0).growth_interval(1));
  for (int i = 0; i < 3; ++i) {
    sgd.zero_grad();
    scaler.scale(w.sum()).backward();
    scaler.step(sgd);
    scaler.update();
    EXPECT_TRUE(std::isfinite(scaler.get_scale()));
  }
  EXPECT_EQ(scaler.get_scale(), static_cast<double>(1e38f));
}

// The AMP tutorials' loop: an fp32 model under AutocastGuard with GradScaler converges. CUDA autocasts to
// float16, as the tutorials' CUDA loop (the dtype the scaler exists for); the CPU to bfloat16.
TEST_P(GradScalerTest, AutocastTutorialLoopTrains) {
  const auto dtype = on_cuda() ? torch::kHalf : torch::kBFloat16;
  auto [x_cpu, y_cpu] = amp_test::blobs(256, 8, 4, 3);
  const auto x = x_cpu.to(device()), y = y_cpu.to(device());
  amp_test::Mlp model;
  model->to(device());
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  GradScaler scaler;
  const int64_t syncs_before = amp::detail::host_sync_count();
  constexpr int kSteps = 60;
  for (int step = 0; step < kSteps; ++step) {
    sgd.zero_grad();
    torch::Tensor loss;
    {
      amp::AutocastGuard autocast(device().type(), dtype);
      auto out = model(x);
      EXPECT_EQ(out.scalar_type(), dtype);
      loss = torch::nn::functional::cross_entropy(out, y);  // fp32 under autocast
    }
    scaler.scale(loss).backward();
    scaler.step(sgd);
    scaler.update();
  }
  EXPECT_EQ(amp::detail::host_sync_count() - syncs_before, kSteps) << "one host sync per step";
  torch::NoGradGuard no_grad;
  const auto accuracy = (model(x).argmax(1) == y).to(torch::kFloat).mean().item<double>();
  EXPECT_GT(accuracy, 0.9);
}

// A disabled scaler does nothing to tensors: device-independent.
TEST(GradScalerTestCpu, DisabledIsAPassThrough) {
  auto w = torch::ones({2}, torch::requires_grad());
  torch::optim::SGD sgd({w}, 0.5);
  GradScaler scaler(GradScalerOptions().enabled(false));
  const auto loss = w.sum();
  EXPECT_TRUE(scaler.scale(loss).is_same(loss));
  loss.backward();
  scaler.unscale_(sgd);
  EXPECT_TRUE(scaler.step(sgd).has_value());
  scaler.update();
  EXPECT_TRUE(torch::all(w == 0.5).item<bool>());
  EXPECT_EQ(scaler.get_scale(), 1.0);
  EXPECT_EQ(scaler.state_dict().size(), 0u);
}

TEST(GradScalerTestCpu, MisuseGetsTorchsErrors) {
  auto w = torch::ones({2}, torch::requires_grad());
  torch::optim::SGD sgd({w}, 0.1);
  GradScaler scaler;
  ASSERT_THROWS_WITH(scaler.unscale_(sgd), "Attempted unscale_ but _scale is None.");
  ASSERT_THROWS_WITH(scaler.update(), "Attempted update but _scale is None.");
  scaler.scale(w.sum()).backward();
  scaler.unscale_(sgd);
  ASSERT_THROWS_WITH(scaler.unscale_(sgd), "unscale_() has already been called on this optimizer since the last update().");
  scaler.step(sgd);
  ASSERT_THROWS_WITH(scaler.unscale_(sgd), "unscale_() is being called after step().");
  ASSERT_THROWS_WITH(scaler.step(sgd), "step() has already been called since the last update().");
  scaler.update();
  ASSERT_THROWS_WITH(scaler.update(), "No inf checks were recorded prior to update().");
  torch::optim::SGD empty({torch::zeros({1}, torch::requires_grad())}, 0.1);
  ASSERT_THROWS_WITH(scaler.step(empty), "No inf checks were recorded for this optimizer.");

  auto h = torch::ones({2}, torch::TensorOptions().dtype(torch::kHalf).requires_grad(true));
  torch::optim::SGD half({h}, 0.1);
  h.mutable_grad() = torch::ones({2}, torch::kHalf);
  ASSERT_THROWS_WITH(scaler.unscale_(half), "Attempting to unscale FP16 gradients.");

  ASSERT_THROWS_WITH(GradScaler(GradScalerOptions().growth_factor(1.0)), "The growth factor must be > 1.0.");
  ASSERT_THROWS_WITH(GradScaler(GradScalerOptions().backoff_factor(1.0)), "The backoff factor must be < 1.0");
  ASSERT_THROWS_WITH(GradScaler(GradScalerOptions().growth_interval(0)), "growth_interval must be at least 1");
  ASSERT_THROWS_WITH(GradScaler(GradScalerOptions().init_scale(0.0)), "init_scale must be a positive finite float, got 0.0");
  ASSERT_THROWS_WITH(scaler.update(-1.0), "new_scale must be a positive finite float, got -1.0");

  ASSERT_THROWS_WITH(scaler.load_state_dict(GradScaler(GradScalerOptions().enabled(false)).state_dict()),
                     "The source state dict is empty, possibly because it was saved from a disabled instance of GradScaler.");
  auto state = GradScaler().state_dict();
  (void)state.erase("_growth_tracker");
  const double before = scaler.get_scale();
  ASSERT_THROWS_WITH(scaler.load_state_dict(state), "the state dict has no '_growth_tracker'");
  EXPECT_EQ(scaler.get_scale(), before) << "a refused load changes nothing";
  auto wrong = GradScaler().state_dict();
  wrong.insert_or_assign("scale", c10::IValue(std::string("big")));
  ASSERT_THROWS_WITH(scaler.load_state_dict(wrong), "'scale' must be a number, got String");
}

AMP_INSTANTIATE_FOR_DEVICES(GradScalerTest);
