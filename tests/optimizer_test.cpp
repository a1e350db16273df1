// The patched optimizer against an unscaled fp32 control. Ports PyTorch's _run_scaling_case family
// (test_grad_scaling_autocast with SGD/Adam/AdamW, _clipping, _accumulation, _multiple) in Apex's terms
// (init 2^16, halve on overflow) and Apex's test_multiple_models_optimizers_losses for one model,
// two losses and one optimizer.
#include "optim/optimizer_state_key.h"
#include "support/models.h"
#include "support/support.h"

namespace {

// _create_scaling_case: Sequential(Linear(8,8), Linear(8,8)), 4 batches of (8,8), MSELoss.
struct ScalingCase {
  torch::nn::Sequential control{torch::nn::Linear(8, 8), torch::nn::Linear(8, 8)};
  torch::nn::Sequential scaled{torch::nn::Linear(8, 8), torch::nn::Linear(8, 8)};
  std::vector<std::pair<torch::Tensor, torch::Tensor>> data;
  explicit ScalingCase(torch::Device device) {
    torch::manual_seed(0);
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < control->parameters().size(); ++i) scaled->parameters()[i].copy_(control->parameters()[i]);
    for (int i = 0; i < 4; ++i) data.emplace_back(torch::randn({8, 8}).to(device), torch::randn({8, 8}).to(device));
    control->to(device);
    scaled->to(device);
  }
};

// Bitwise on CUDA too: control and scaled run the same kernels on the same device (CUDA unscales with
// ATen's _amp_foreach_non_finite_check_and_unscale_, exact for a power-of-two scale).
template <class MakeOpt>
void run_scaling_case(torch::Device device, MakeOpt make_optimizer, bool clip, const char* name) {
  constexpr int kSkipIter = 2;
  ScalingCase c(device);
  auto control_opt = make_optimizer(c.control->parameters());
  // O0 with a dynamic scale: fp32 math, so the scaled run must match the control exactly apart from
  // the injected overflow (power-of-two scales are exact).
  auto [model, optimizer] = amp::initialize(c.scaled, make_optimizer(c.scaled->parameters()),
                                            amp::Options("O0").loss_scale(amp::LossScale::dynamic()).verbosity(0));
  for (int i = 0; i < 4; ++i) {
    const auto& [input, target] = c.data[static_cast<size_t>(i)];
    optimizer.zero_grad();
    auto loss = torch::mse_loss(model(input), target);
    if (i == kSkipIter) loss = loss * INFINITY;  // the overflow PyTorch injects at skip_iter
    {
      auto scaled = amp::scale_loss(loss, optimizer);
      scaled.backward();
    }
    if (clip) torch::nn::utils::clip_grad_norm_(amp::master_params(optimizer), 0.5);
    optimizer.step();

    if (i != kSkipIter) {
      control_opt.zero_grad();
      torch::mse_loss(c.control->forward(input), target).backward();
      if (clip) torch::nn::utils::clip_grad_norm_(c.control->parameters(), 0.5);
      control_opt.step();
    }
  }
  EXPECT_EQ(amp::loss_scale(optimizer), 65536.0 * 0.5) << name;  // 2^16 * backoff^skipped
  EXPECT_EQ(optimizer.skipped_steps(), 1) << name;
  for (size_t i = 0; i < c.control->parameters().size(); ++i) {
    EXPECT_TRUE(amp_test::bitwise_equal(c.scaled->parameters()[i].cpu(), c.control->parameters()[i].cpu()))
        << name << " " << i;
  }
}

class OptimizerTest : public amp_test::DeviceTest {};

}  // namespace

TEST_P(OptimizerTest, ScalingCaseMatchesControlSGD) {
  run_scaling_case(device(),
                   [](std::vector<torch::Tensor> p) { return torch::optim::SGD(p, torch::optim::SGDOptions(1.0)); },
                   false, "SGD");
  run_scaling_case(
      device(),
      [](std::vector<torch::Tensor> p) { return torch::optim::SGD(p, torch::optim::SGDOptions(0.5).momentum(0.9)); },
      false, "SGD momentum");
}

TEST_P(OptimizerTest, ScalingCaseMatchesControlAdamAndAdamW) {
  run_scaling_case(device(),
                   [](std::vector<torch::Tensor> p) { return torch::optim::Adam(p, torch::optim::AdamOptions(1e-2)); },
                   false, "Adam");
  run_scaling_case(
      device(),
      [](std::vector<torch::Tensor> p) { return torch::optim::AdamW(p, torch::optim::AdamWOptions(1e-2).amsgrad(true)); },
      false, "AdamW amsgrad");
}

TEST_P(OptimizerTest, ClippingMasterParamsAfterBackwardMatchesControl) {
  run_scaling_case(device(),
                   [](std::vector<torch::Tensor> p) { return torch::optim::SGD(p, torch::optim::SGDOptions(1.0)); },
                   true, "SGD clipped");
}

TEST_P(OptimizerTest, MultipleLossesHaveTheirOwnScalers) {
  // _multiple / Apex's num_losses: an overflow in loss 1 halves scaler 1 only.
  amp_test::Mlp net;
  net->to(device());
  torch::optim::SGD sgd(net->parameters(), 0.1);
  auto [model, optimizer] =
      amp::initialize(net, std::move(sgd), amp::Options("O1").num_losses(2).low_precision_dtype(torch::kBFloat16).verbosity(0));
  for (int iteration = 0; iteration < 3; ++iteration) {
    optimizer.zero_grad();
    auto x = torch::randn({4, 8}).to(device());
    auto out = model(x);
    {
      auto scaled = amp::scale_loss(out.pow(2).mean(), optimizer, amp::ScaleLossOptions().loss_id(0));
      scaled.backward();
    }
    auto out2 = model(iteration == 1 ? x * INFINITY : x);
    {
      auto scaled = amp::scale_loss(out2.abs().mean(), optimizer, amp::ScaleLossOptions().loss_id(1));
      scaled.backward();
    }
    optimizer.step();
  }
  EXPECT_EQ(amp::loss_scale(optimizer, 0), 65536.0);
  EXPECT_EQ(amp::loss_scale(optimizer, 1), 32768.0);
  EXPECT_EQ(optimizer.loss_scaler(0).unskipped(), 3);
  EXPECT_EQ(optimizer.loss_scaler(1).unskipped(), 1);
  EXPECT_EQ(optimizer.skipped_steps(), 1);
}

// Apex's test_multiple_models_optimizers_losses, one model / two losses / one optimizer, at O2, with an
// inf injected into loss 1 at iteration k: master grads equal the fp32 reference on unskipped
// iterations, and at the end masters == reference and model params == master.to(model dtype).
// Exact on CUDA too: x is a multiple of 0.5 (exact in bf16), each gradient is one product, and the
// reference's SGD runs the same ops on the same device as the masters'.
TEST_P(OptimizerTest, TwoLossesOneOptimizerMatchesReferenceAtO2) {
  struct TwoWeights : torch::nn::Module {
    TwoWeights() {
      w0 = register_parameter("weight0", torch::full({4}, 1.0));
      w1 = register_parameter("weight1", torch::full({4}, 2.0));
    }
    torch::Tensor w0, w1;
  };
  for (int inject_at : {-1, 1, 2}) {
    auto module = std::make_shared<TwoWeights>();
    auto reference = std::make_shared<TwoWeights>();
    module->to(device());
    reference->to(device());
    torch::optim::SGD sgd(module->parameters(), torch::optim::SGDOptions(0.25).momentum(0.125));
    torch::optim::SGD ref_sgd(reference->parameters(), torch::optim::SGDOptions(0.25).momentum(0.125));
    // A module with two parameters; O2 casts both to bf16 and gives both fp32 masters.
    auto [model, optimizer] = amp::initialize(module, std::move(sgd),
                                              amp::Options("O2").num_losses(2).low_precision_dtype(torch::kBFloat16).verbosity(0));
    for (int iteration = 0; iteration < 4; ++iteration) {
      const auto x = torch::full({4}, 0.5 + iteration).to(device());
      optimizer.zero_grad();
      for (int loss_id = 0; loss_id < 2; ++loss_id) {
        auto y = x.to(torch::kBFloat16) * (loss_id == 0 ? module->w0 : module->w1);
        auto loss = y.to(torch::kFloat).sum() * (iteration == inject_at && loss_id == 1 ? INFINITY : 1.0);
        auto scaled = amp::scale_loss(loss, optimizer, amp::ScaleLossOptions().loss_id(loss_id));
        scaled.backward();
      }
      const bool skipped = optimizer.step_will_be_skipped();
      if (!skipped) {
        ref_sgd.zero_grad();
        (x * reference->w0).sum().backward();
        (x * reference->w1).sum().backward();
        const auto masters = amp::master_params(optimizer);
        EXPECT_TRUE(torch::equal(masters[0].grad(), reference->w0.grad())) << iteration;
        EXPECT_TRUE(torch::equal(masters[1].grad(), reference->w1.grad())) << iteration;
        ref_sgd.step();
      }
      optimizer.step();
    }
    const auto masters = amp::master_params(optimizer);
    EXPECT_TRUE(torch::equal(masters[0], reference->w0)) << inject_at;
    EXPECT_TRUE(torch::equal(masters[1], reference->w1)) << inject_at;
    EXPECT_TRUE(torch::equal(module->w0, masters[0].to(torch::kBFloat16)));
    EXPECT_TRUE(torch::equal(module->w1, masters[1].to(torch::kBFloat16)));
    EXPECT_EQ(optimizer.skipped_steps(), inject_at >= 0 ? 1 : 0);
  }
}

TEST_P(OptimizerTest, O2StepCopiesMastersIntoTheModel) {
  amp_test::ConvBnNet net;
  net->to(device());
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  auto [model, optimizer] =
      amp::initialize(net, std::move(sgd), amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0));
  for (int i = 0; i < 3; ++i) {
    optimizer.zero_grad();
    auto loss = model(torch::randn({4, 1, 8, 8}).to(device())).pow(2).mean();
    auto scaled = amp::scale_loss(loss, optimizer);
    scaled.backward();
    optimizer.step();
  }
  const auto masters = amp::master_params(optimizer);
  const auto params = net->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(torch::equal(params[i], masters[i].to(params[i].scalar_type()))) << i;
  }
}

// Apex's test_multiple_models_optimizers_losses "2models2losses2optimizers" and the DCGAN pattern:
// two models, two optimizers, one bank of scalers shared through loss_id.
TEST_P(OptimizerTest, SeveralModelsAndOptimizersShareTheLossScalers) {
  amp_test::Mlp net_a(8, 8, 4), net_b(4, 8, 8);
  net_a->to(device());
  net_b->to(device());
  torch::optim::SGD sgd_a(net_a->parameters(), 0.1);
  torch::optim::Adam adam_b(net_b->parameters(), 1e-3);
  auto [models, optimizers] =
      amp::initialize(std::tuple(net_a, net_b), std::tuple(std::move(sgd_a), std::move(adam_b)),
                      amp::Options("O2").num_losses(3).low_precision_dtype(torch::kBFloat16).verbosity(0));
  auto& [model_a, model_b] = models;
  auto& [optimizer_a, optimizer_b] = optimizers;
  EXPECT_EQ(net_a->fc1->weight.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(net_b->fc1->weight.scalar_type(), torch::kBFloat16);

  auto x = torch::randn({2, 8}).to(device());
  optimizer_a.zero_grad();
  optimizer_b.zero_grad();
  {
    auto scaled = amp::scale_loss(model_b(model_a(x)).sum() * INFINITY, optimizer_b, amp::ScaleLossOptions().loss_id(2));
    scaled.backward();
  }
  EXPECT_EQ(amp::loss_scale(optimizer_a, 2), 32768.0);  // the bank is shared
  EXPECT_EQ(amp::loss_scale(optimizer_b, 2), 32768.0);
  EXPECT_EQ(amp::loss_scale(optimizer_a, 0), 65536.0);
  EXPECT_TRUE(optimizer_b.step_will_be_skipped());
  EXPECT_FALSE(optimizer_a.step_will_be_skipped());  // a skip applies to the optimizer scale_loss was given
  optimizer_a.zero_grad();
  optimizer_b.zero_grad();
  {
    auto scaled = amp::scale_loss(model_b(model_a(x)).pow(2).mean(), optimizer_a, amp::ScaleLossOptions().loss_id(0));
    scaled.backward();
  }
  const auto before = net_a->fc1->weight.clone();
  optimizer_a.step();
  EXPECT_FALSE(torch::equal(net_a->fc1->weight, before));

  amp_test::Mlp stranger;
  stranger->to(device());
  torch::optim::SGD wrong(stranger->parameters(), 0.1);
  amp_test::Mlp c, d;
  c->to(device());
  d->to(device());
  torch::optim::SGD sgd_c(c->parameters(), 0.1);
  ASSERT_THROWS_WITH(amp::initialize(std::tuple(c, d), std::tuple(std::move(sgd_c), std::move(wrong)),
                                     amp::Options("O1").low_precision_dtype(torch::kBFloat16).verbosity(0)),
                     "is not a parameter of the models");
}

// Refused from the arguments alone, before anything runs on a device: CPU only.
TEST(OptimizerTestCpu, TheSameModelTwiceInOneInitializeIsRefused) {
  amp_test::Mlp net;
  torch::optim::SGD a(net->parameters(), 0.1), b(net->parameters(), 0.1);
  ASSERT_THROWS_WITH(amp::initialize(std::tuple(net, net), std::tuple(std::move(a), std::move(b)),
                                     amp::Options("O1").low_precision_dtype(torch::kBFloat16).verbosity(0)),
                     "the same model appears twice in the models tuple");
}

AMP_INSTANTIATE_FOR_DEVICES(OptimizerTest);

// ---- LibTorch's optimizers on bf16 / fp16 parameters step as Python's torch.optim ---------------------------
// NOTE [LibTorch's optimizers on low-precision parameters]: at O3 amp steps torch::optim::SGD / Adam / AdamW with
// Python's arithmetic (LibTorch's own would multiply the bf16 momentum by 0.8984375 and Adam's second moment by 1.0).
// tests/python/python_optimizers.py runs torch.optim on the same parameters and gradients at test time.
namespace {

const amp::PythonCheckpoint* python_optimizers_reference() {
  static const std::optional<amp::PythonCheckpoint> reference = []() -> std::optional<amp::PythonCheckpoint> {
    if (!amp_test::python_has_torch()) return std::nullopt;
    const auto dir = amp_test::run_python_reference(AMP_SOURCE_DIR "/tests/python/python_optimizers.py",
                                                    "python_optimizers");
    if (dir.empty()) return std::nullopt;
    return amp::PythonCheckpoint::load((dir / "python_optimizers.pt").string());
  }();
  return reference ? &*reference : nullptr;
}

struct TwoParameters : torch::nn::Module {
  TwoParameters() {
    torch::manual_seed(0);
    weight = register_parameter("weight", torch::randn({64, 32}));
    bias = register_parameter("bias", torch::randn({32}));
  }
  torch::Tensor weight, bias;
};

// Five steps of `optimizer` at O3 in `dtype` on tests/python/python_optimizers.py's parameters and gradients.
template <class Opt, class Options>
std::vector<torch::Tensor> five_o3_steps(c10::ScalarType dtype, const Options& options, torch::Tensor* state_out,
                                         const char* state_key) {
  auto net = std::make_shared<TwoParameters>();
  Opt raw(net->parameters(), options);
  auto [model, optimizer] =
      amp::initialize(net, std::move(raw), amp::Options("O3").low_precision_dtype(dtype).verbosity(0));
  for (int k = 0; k < 5; ++k) {
    torch::manual_seed(100 + k);
    for (auto& p : net->parameters()) p.mutable_grad() = (torch::randn(p.sizes()) * 0.01).to(dtype);
    optimizer.step();
  }
  const auto& state = optimizer.state().at(amp::detail::state_key(optimizer.state(), net->weight));
  if constexpr (std::is_same_v<Opt, torch::optim::SGD>) {
    *state_out = static_cast<torch::optim::SGDParamState&>(*state).momentum_buffer();
  } else {
    using State = std::conditional_t<std::is_same_v<Opt, torch::optim::Adam>, torch::optim::AdamParamState,
                                     torch::optim::AdamWParamState>;
    const auto& s = static_cast<State&>(*state);
    *state_out = std::string(state_key) == "exp_avg" ? s.exp_avg() : s.exp_avg_sq();
  }
  return {net->weight.detach(), net->bias.detach()};
}

}  // namespace

TEST(PythonOptimizersTest, LibTorchsOptimizersStepLowPrecisionParametersAsTorchOptim) {
  const amp::PythonCheckpoint* reference = python_optimizers_reference();
  if (reference == nullptr) GTEST_SKIP() << "needs Python with the torch wheel (AMP_PYTHON)";
  const std::string version = reference->get("torch_version").toStringRef();
  if (version.substr(0, version.find('+')) != TORCH_VERSION) GTEST_SKIP() << "Python's torch " << version << " is not this build's";
  using torch::optim::AdamOptions, torch::optim::AdamWOptions, torch::optim::SGDOptions;
  for (const auto dtype : amp_test::low_precision_dtypes()) {
    if (!amp_test::cpu_computes(dtype)) continue;
    const std::string d = dtype == torch::kBFloat16 ? "bfloat16" : "float16";
    auto check = [&](const std::string& name, const std::vector<torch::Tensor>& params, const torch::Tensor& state,
                     const std::string& state_key) {
      SCOPED_TRACE(name);
      EXPECT_TRUE(amp_test::bitwise_equal(params[0], reference->get(name + "_p0").toTensor()));
      EXPECT_TRUE(amp_test::bitwise_equal(params[1], reference->get(name + "_p1").toTensor()));
      EXPECT_TRUE(amp_test::bitwise_equal(state, reference->get(name + "_" + state_key).toTensor()));
    };
    torch::Tensor state;
    auto p = five_o3_steps<torch::optim::SGD>(dtype, SGDOptions(0.1).momentum(0.9), &state, "");
    check("sgd_" + d, p, state, "momentum_buffer");
    p = five_o3_steps<torch::optim::SGD>(dtype, SGDOptions(0.1).momentum(0.9).nesterov(true).weight_decay(0.01), &state, "");
    check("sgd_nesterov_decay_" + d, p, state, "momentum_buffer");
    p = five_o3_steps<torch::optim::SGD>(dtype, SGDOptions(0.1).momentum(0.9).dampening(0.1), &state, "");
    check("sgd_dampening_" + d, p, state, "momentum_buffer");
    for (const char* key : {"exp_avg", "exp_avg_sq"}) {
      p = five_o3_steps<torch::optim::Adam>(dtype, AdamOptions(0.01).eps(1e-3), &state, key);
      check("adam_" + d, p, state, key);
      p = five_o3_steps<torch::optim::Adam>(dtype, AdamOptions(0.01).eps(1e-3).weight_decay(0.01).amsgrad(true), &state, key);
      check("adam_decay_amsgrad_" + d, p, state, key);
      p = five_o3_steps<torch::optim::AdamW>(dtype, AdamWOptions(0.01).eps(1e-3), &state, key);
      check("adamw_" + d, p, state, key);
      p = five_o3_steps<torch::optim::AdamW>(dtype, AdamWOptions(0.01).eps(1e-3).amsgrad(true), &state, key);
      check("adamw_amsgrad_" + d, p, state, key);
    }
  }
}
