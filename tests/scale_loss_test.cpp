// The ScaledLoss handle: RAII, overflow handling, skipped steps, accumulation and delay_unscale.
#include "optim/optimizer_access.h"
#include "support/models.h"
#include "support/support.h"

using amp_test::Mlp;

namespace {

amp::Options quiet_bf16(const char* level) { return amp::Options(level).low_precision_dtype(torch::kBFloat16).verbosity(0); }

template <class Model, class Optimizer>
bool train_step(Model& model, Optimizer& optimizer, const torch::Tensor& x, double input_scale = 1.0) {
  optimizer.zero_grad();
  auto loss = model(x * input_scale).pow(2).mean();
  auto scaled = amp::scale_loss(loss, optimizer);
  scaled.backward();
  const bool overflow = scaled.overflow();
  optimizer.step();
  return overflow;
}

// On CUDA, unscaling and the inf/NaN check run in ATen's _amp_foreach_non_finite_check_and_unscale_ (amp's own
// loop on the CPU); the scale decisions and every expectation below are the same on both.
class ScaleLossTest : public amp_test::DeviceTest {
 protected:
  Mlp make_net() const {
    Mlp net;
    net->to(device());
    return net;
  }
  torch::Tensor randn(at::IntArrayRef sizes) const { return torch::randn(sizes).to(device()); }
};

}  // namespace

TEST_P(ScaleLossTest, ScaledLossIsLossTimesScaleInFp32) {
  Mlp net = make_net();
  torch::optim::SGD sgd(net->parameters(), 0.1);
  auto [model, optimizer] = amp::initialize(net, std::move(sgd), quiet_bf16("O2"));
  auto loss = model(randn({4, 8})).sum().to(torch::kBFloat16);
  auto scaled = amp::scale_loss(loss, optimizer);
  EXPECT_EQ(scaled.tensor().scalar_type(), torch::kFloat);
  EXPECT_EQ(scaled.tensor().item<float>(), loss.to(torch::kFloat).item<float>() * 65536.0f);
  scaled.backward();
  EXPECT_FALSE(scaled.overflow());
}

TEST_P(ScaleLossTest, O0AndO3HandBackTheLossUnscaled) {
  for (const char* level : {"O0", "O3"}) {
    Mlp net = make_net();
    torch::optim::SGD sgd(net->parameters(), 0.1);
    auto [model, optimizer] = amp::initialize(net, std::move(sgd), quiet_bf16(level));
    auto loss = model(randn({4, 8})).sum();
    auto scaled = amp::scale_loss(loss, optimizer);
    EXPECT_TRUE(torch::equal(scaled.tensor(), loss.to(torch::kFloat))) << level;
  }
}

TEST_P(ScaleLossTest, OverflowSkipsTheStepAndChangesNothing) {
  // Momentum SGD and Adam: a skipped step leaves parameters and every optimizer state untouched.
  for (const char* level : {"O1", "O2"}) {
    Mlp net = make_net();
    torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-2));
    auto [model, optimizer] = amp::initialize(net, std::move(adam), quiet_bf16(level));
    const auto x = randn({4, 8});
    ASSERT_FALSE(train_step(model, optimizer, x));
    std::vector<torch::Tensor> params, masters;
    for (auto& p : net->parameters()) params.push_back(p.detach().clone());
    for (auto& p : amp::master_params(optimizer)) masters.push_back(p.detach().clone());

    EXPECT_TRUE(train_step(model, optimizer, x, std::numeric_limits<float>::infinity()));
    EXPECT_EQ(amp::loss_scale(optimizer), 32768.0) << level;
    EXPECT_EQ(optimizer.skipped_steps(), 1);
    for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(torch::equal(net->parameters()[i], params[i])) << level;
    for (size_t i = 0; i < masters.size(); ++i) EXPECT_TRUE(torch::equal(amp::master_params(optimizer)[i], masters[i]));
    for (auto& p : amp::master_params(optimizer)) EXPECT_FALSE(p.grad().defined());  // overflowed grads dropped
    for (const auto& [key, state] : optimizer.state()) {
      EXPECT_EQ(static_cast<torch::optim::AdamParamState&>(*state).step(), 1) << level;
    }
    // The next clean step applies normally.
    EXPECT_FALSE(train_step(model, optimizer, x));
    for (const auto& [key, state] : optimizer.state()) {
      EXPECT_EQ(static_cast<torch::optim::AdamParamState&>(*state).step(), 2);
    }
  }
}

TEST_P(ScaleLossTest, NanLossAlsoOverflows) {
  Mlp net = make_net();
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  auto [model, optimizer] = amp::initialize(net, std::move(sgd), quiet_bf16("O2"));
  EXPECT_TRUE(train_step(model, optimizer, torch::full({4, 8}, std::nan("")).to(device())));
  for (auto& p : net->parameters()) EXPECT_TRUE(torch::isfinite(p).all().item<bool>());
}

// The parameter list comes from the device's gradients (record_overflow reads each one there).
TEST_P(ScaleLossTest, PrintsApexsOverflowLine) {
  Mlp net = make_net();
  torch::optim::SGD sgd(net->parameters(), 0.1);
  auto [model, optimizer] =
      amp::initialize(net, std::move(sgd), amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0));
  Mlp net2 = make_net();
  torch::optim::SGD sgd2(net2->parameters(), 0.1);
  testing::internal::CaptureStdout();
  auto [model2, optimizer2] = amp::initialize(net2, std::move(sgd2), amp::Options("O2").low_precision_dtype(torch::kBFloat16));
  train_step(model2, optimizer2, randn({4, 8}), std::numeric_limits<float>::infinity());
  const std::string out = testing::internal::GetCapturedStdout();
  // Apex's line, then the parameters whose gradients were non-finite (the inf scaled the whole loss).
  EXPECT_NE(out.find("Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0 (non-finite "
                     "gradients: fc1.weight, fc1.bias, fc2.weight and 1 more)\n"),
            std::string::npos) << out;
  testing::internal::CaptureStdout();
  train_step(model, optimizer, randn({4, 8}), std::numeric_limits<float>::infinity());
  EXPECT_EQ(testing::internal::GetCapturedStdout(), "");  // verbosity 0 is silent
}

TEST_P(ScaleLossTest, DestructorWithoutBackwardRestoresGradients) {
  Mlp net = make_net();
  torch::optim::SGD sgd(net->parameters(), 0.1);
  auto [model, optimizer] = amp::initialize(net, std::move(sgd), quiet_bf16("O1"));
  {
    auto scaled = amp::scale_loss(model(randn({4, 8})).sum(), optimizer);
    scaled.backward();
  }
  const auto grad = net->fc1->weight.grad().clone();
  {
    auto scaled = amp::scale_loss(model(randn({4, 8})).sum(), optimizer);
    // early exit: no backward
  }
  EXPECT_TRUE(torch::equal(net->fc1->weight.grad(), grad));
  try {
    auto scaled = amp::scale_loss(model(randn({4, 8})).sum(), optimizer);
    throw std::runtime_error("user code failed between scale_loss and backward");
  } catch (const std::runtime_error&) {
  }
  EXPECT_TRUE(torch::equal(net->fc1->weight.grad(), grad));
  EXPECT_FALSE(optimizer.step_will_be_skipped());
}

TEST_P(ScaleLossTest, BackwardThatThrowsLeavesGradientsAsTheyWere) {
  Mlp net = make_net();
  torch::optim::SGD sgd(net->parameters(), 0.1);
  auto [model, optimizer] = amp::initialize(net, std::move(sgd), quiet_bf16("O1"));
  {
    auto scaled = amp::scale_loss(model(randn({4, 8})).sum(), optimizer);
    scaled.backward();
  }
  const auto grad = net->fc1->weight.grad().clone();
  auto no_graph = torch::ones({}, torch::TensorOptions(device()).dtype(torch::kFloat));  // does not require grad: backward throws
  EXPECT_THROW(
      {
        auto scaled = amp::scale_loss(no_graph, optimizer);
        scaled.backward();
      },
      std::exception);
  EXPECT_TRUE(torch::equal(net->fc1->weight.grad(), grad));
}

// Argument and protocol checks, made before anything runs on a device: CPU only.
TEST(ScaleLossTestCpu, MisuseErrors) {
  Mlp net;
  torch::optim::SGD sgd(net->parameters(), 0.1);
  auto [model, optimizer] = amp::initialize(net, std::move(sgd), quiet_bf16("O2"));
  auto out = model(torch::randn({4, 8}));
  ASSERT_THROWS_WITH(amp::scale_loss(out, optimizer), "must be a single-element tensor, got shape [4, 4]");
  ASSERT_THROWS_WITH(amp::scale_loss(torch::Tensor(), optimizer), "undefined tensor");
  ASSERT_THROWS_WITH(amp::scale_loss(torch::ones({}, torch::kLong), optimizer), "must be a floating tensor");
  ASSERT_THROWS_WITH(amp::scale_loss(out.sum(), optimizer, amp::ScaleLossOptions().loss_id(1)),
                     "loss_id 1 is out of range: this optimizer was initialized with num_losses=1");
  ASSERT_THROWS_WITH(amp::loss_scale(optimizer, -1), "loss_id -1 is out of range");
  auto scaled = amp::scale_loss(out.sum(), optimizer);
  ASSERT_THROWS_WITH(scaled.overflow(), "call backward() first");
  scaled.backward();
  ASSERT_THROWS_WITH(scaled.backward(), "backward() was already called");
}

// Gradient accumulation (apex #286): plain repeated scale_loss calls sum the unscaled gradients
// exactly, even when the two backward passes use different scales (Apex's stash + axpby).
// Bitwise on CUDA too: both sides run the same fp32 kernels on the same device, and power-of-two scales
// are exact through them.
TEST_P(ScaleLossTest, AccumulationIsExactAcrossScaleChanges) {
  torch::manual_seed(3);
  Mlp net;
  Mlp reference;
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < net->parameters().size(); ++i) reference->parameters()[i].copy_(net->parameters()[i]);
  }
  net->to(device());
  reference->to(device());
  torch::optim::SGD sgd(net->parameters(), 0.1);
  auto [model, optimizer] = amp::initialize(net, std::move(sgd), quiet_bf16("O1").num_losses(2));
  {  // scaler 1 overflows once: 65536 -> 32768, while scaler 0 stays at 65536
    auto scaled = amp::scale_loss(model->forward(torch::full({4, 8}, INFINITY).to(device())).sum(), optimizer,
                                  amp::ScaleLossOptions().loss_id(1));
    scaled.backward();
  }
  optimizer.zero_grad();
  ASSERT_EQ(amp::loss_scale(optimizer, 0), 65536.0);
  ASSERT_EQ(amp::loss_scale(optimizer, 1), 32768.0);
  const auto x1 = randn({4, 8}), x2 = randn({4, 8});
  int loss_id = 0;
  for (const auto& x : {x1, x2}) {
    // model-> runs the module without casts, so the reference is the same fp32 math.
    auto scaled = amp::scale_loss(model->forward(x).sum(), optimizer, amp::ScaleLossOptions().loss_id(loss_id++));
    scaled.backward();
  }
  reference->forward(x1).sum().backward();
  reference->forward(x2).sum().backward();
  for (size_t i = 0; i < net->parameters().size(); ++i) {
    EXPECT_TRUE(amp_test::bitwise_equal(net->parameters()[i].grad().cpu(), reference->parameters()[i].grad().cpu())) << i;
  }
}

TEST_P(ScaleLossTest, AccumulationWithAnOverflowInBetweenUsesBothScales) {
  Mlp net = make_net();
  torch::optim::SGD sgd(net->parameters(), 0.1);
  auto [model, optimizer] = amp::initialize(net, std::move(sgd), quiet_bf16("O2"));
  optimizer.zero_grad();
  auto x = randn({4, 8});
  {
    auto scaled = amp::scale_loss(model(x).sum(), optimizer);
    scaled.backward();
  }
  const auto first = amp::master_params(optimizer)[0].grad().clone();
  {
    auto scaled = amp::scale_loss(model(x * std::numeric_limits<float>::infinity()).sum(), optimizer);
    scaled.backward();
    EXPECT_TRUE(scaled.overflow());
  }
  EXPECT_EQ(amp::loss_scale(optimizer), 32768.0);
  EXPECT_TRUE(optimizer.step_will_be_skipped());
  optimizer.step();  // skipped, grads dropped
  {
    auto scaled = amp::scale_loss(model(x).sum(), optimizer);  // now at 32768
    scaled.backward();
  }
  EXPECT_TRUE(torch::equal(amp::master_params(optimizer)[0].grad(), first));  // same unscaled grads
}

TEST_P(ScaleLossTest, DelayUnscaleAccumulatesScaledThenUnscalesOnce) {
  Mlp net = make_net();
  torch::optim::SGD sgd(net->parameters(), 0.1);
  auto [model, optimizer] = amp::initialize(net, std::move(sgd), quiet_bf16("O1"));
  const auto x1 = randn({4, 8}), x2 = randn({4, 8});
  optimizer.zero_grad();
  {
    auto scaled = amp::scale_loss(model(x1).sum(), optimizer, amp::ScaleLossOptions().delay_unscale(true));
    scaled.backward();
  }
  ASSERT_THROWS_WITH(optimizer.step(), "the gradients are still scaled");
  {
    auto scaled = amp::scale_loss(model(x2).sum(), optimizer);
    scaled.backward();
  }
  const auto delayed = net->fc1->weight.grad().clone();
  optimizer.zero_grad();
  for (const auto& x : {x1, x2}) {
    auto scaled = amp::scale_loss(model(x).sum(), optimizer);
    scaled.backward();
  }
  EXPECT_TRUE(torch::allclose(delayed, net->fc1->weight.grad(), 1e-6, 1e-6));
  optimizer.step();
}

TEST_P(ScaleLossTest, ZeroGradClearsModelAndMasterGradients) {
  Mlp net = make_net();
  torch::optim::SGD sgd(net->parameters(), 0.1);
  auto [model, optimizer] = amp::initialize(net, std::move(sgd), quiet_bf16("O2"));
  {
    auto scaled = amp::scale_loss(model(randn({4, 8})).sum(), optimizer);
    scaled.backward();
  }
  for (auto& p : amp::master_params(optimizer)) EXPECT_TRUE(p.grad().defined());
  for (auto& p : net->parameters()) EXPECT_FALSE(p.grad().defined());  // consumed into the masters
  optimizer.zero_grad();
  for (auto& p : amp::master_params(optimizer)) EXPECT_FALSE(p.grad().defined());
  optimizer.zero_grad(/*set_to_none=*/false);
}

// A protocol refusal from host-side state: CPU only.
TEST(ScaleLossTestCpu, DelayUnscaleThenAnotherLossIdIsRefused) {
  Mlp net;
  torch::optim::SGD sgd(net->parameters(), 0.1);
  auto [model, optimizer] = amp::initialize(net, std::move(sgd), quiet_bf16("O1").num_losses(2));
  {
    auto scaled = amp::scale_loss(model(torch::randn({4, 8})).sum(), optimizer, amp::ScaleLossOptions().delay_unscale(true));
    scaled.backward();
  }
  ASSERT_THROWS_WITH(amp::scale_loss(model(torch::randn({4, 8})).sum(), optimizer, amp::ScaleLossOptions().loss_id(1)),
                     "the gradients hold values scaled by loss scaler 0 (delay_unscale), so the next scale_loss must "
                     "use the same loss_id, got 1");
}

AMP_INSTANTIATE_FOR_DEVICES(ScaleLossTest);

// fp32 gradient accumulation (issue: O2's micro-batch gradients summed in the model's bf16 .grad lose small terms).
// delay_unscale moves each micro-batch's gradient into an fp32 sum beside its master.
TEST(Fp32AccumulationTest, MicroBatchesSumInFp32WhereBf16WouldLoseTheSmallTerms) {
  auto net = torch::nn::Linear(torch::nn::LinearOptions(1, 1).bias(false));
  {
    torch::NoGradGuard no_grad;
    net->weight.fill_(1.0);
  }
  auto [model, optimizer] = amp::initialize(net, torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(1.0)),
                                            amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0));
  const std::vector<double> c = {256, 1, 1, 1, 1, 1, 1, -256};  // gradient of micro-batch i: c[i]
  const torch::Tensor x = torch::ones({1, 1});
  optimizer.zero_grad();
  for (size_t i = 0; i < c.size(); ++i) {
    auto scaled = amp::scale_loss(model(x).sum() * c[i], optimizer,
                                  amp::ScaleLossOptions().delay_unscale(i + 1 < c.size()));
    scaled.backward();
  }
  const double accumulated = amp::detail::OptimizerAccess::grads_for_step(optimizer, "test").at(0).item<double>();

  // What summing the scaled gradients in bf16 gives (amp's accumulation before fp32 sums): 2^24 + 2^16 rounds
  // back to 2^24, so every 1 is lost.
  const double scale = amp::detail::OptimizerAccess::loss_scalers(optimizer).at(0).loss_scale();
  torch::Tensor bf16_sum = torch::zeros({}, torch::kBFloat16);
  for (double ci : c) bf16_sum = bf16_sum + torch::tensor(ci * scale).to(torch::kBFloat16);
  const double bf16_accumulated = bf16_sum.item<double>() / scale;
  std::cout << "8 micro-batches: fp32 accumulation " << accumulated << ", bf16 accumulation " << bf16_accumulated
            << ", one 8x batch 6" << std::endl;
  EXPECT_EQ(accumulated, 6.0);
  EXPECT_EQ(bf16_accumulated, 0.0);  // the test's premise: bf16 sums do lose them

  // One 8x batch: the same gradient.
  optimizer.zero_grad();
  torch::Tensor big = torch::zeros({});
  for (double ci : c) big = big + model(x).sum() * ci;
  amp::scale_loss(big, optimizer).backward();
  EXPECT_EQ(amp::detail::OptimizerAccess::grads_for_step(optimizer, "test").at(0).item<double>(), accumulated);
  optimizer.step();
  EXPECT_EQ(net->weight.item<double>(), -5.0);
}

TEST(Fp32AccumulationTest, EqualsTheFp32SumOfEachMicroBatchsGradient) {
  torch::manual_seed(0);
  amp_test::Mlp net(8, 32, 4);
  auto [model, optimizer] = amp::initialize(net, torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(0.1)),
                                            amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0));
  std::vector<torch::Tensor> xs;
  for (int i = 0; i < 8; ++i) xs.push_back(torch::randn({4, 8}));
  // Each micro-batch alone: its bf16 gradient, unscaled into fp32 (exactly: the scale is a power of two).
  std::vector<torch::Tensor> sum;
  for (const auto& x : xs) {
    optimizer.zero_grad();
    amp::scale_loss(model(x).pow(2).mean(), optimizer).backward();
    const auto grads = amp::detail::OptimizerAccess::grads_for_step(optimizer, "test");
    if (sum.empty()) {
      for (const auto& g : grads) sum.push_back(g.clone());
    } else {
      for (size_t k = 0; k < grads.size(); ++k) sum[k] += grads[k];
    }
  }
  optimizer.zero_grad();
  for (size_t i = 0; i < xs.size(); ++i) {
    auto scaled = amp::scale_loss(model(xs[i]).pow(2).mean(), optimizer,
                                  amp::ScaleLossOptions().delay_unscale(i + 1 < xs.size()));
    scaled.backward();
  }
  const auto accumulated = amp::detail::OptimizerAccess::grads_for_step(optimizer, "test");
  ASSERT_EQ(accumulated.size(), sum.size());
  for (size_t k = 0; k < sum.size(); ++k) EXPECT_TRUE(amp_test::bitwise_equal(accumulated[k], sum[k])) << k;
}

TEST(Fp32AccumulationTest, ZeroGradDropsAPendingSum) {
  amp_test::Mlp net;
  auto [model, optimizer] = amp::initialize(net, torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(0.1)),
                                            amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0));
  const torch::Tensor x = torch::randn({4, 8});
  amp::scale_loss(model(x).sum(), optimizer, amp::ScaleLossOptions().delay_unscale(true)).backward();
  optimizer.zero_grad();
  amp::scale_loss(model(x).sum(), optimizer).backward();
  const auto once = amp::detail::OptimizerAccess::grads_for_step(optimizer, "test");
  optimizer.zero_grad();
  amp::scale_loss(model(x).sum(), optimizer).backward();
  const auto again = amp::detail::OptimizerAccess::grads_for_step(optimizer, "test");
  for (size_t k = 0; k < once.size(); ++k) EXPECT_TRUE(amp_test::bitwise_equal(once[k], again[k])) << k;
}
