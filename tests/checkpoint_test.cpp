// Checkpoints. Ports Apex's test_checkpointing.py: test_restoring (every level x num_losses 1..2,
// checkpoint at step 5 of 10, restore into fresh objects in either load order, bitwise-equal continuation) and
// test_loss_scale_decrease (forced overflows per scaler survive a save/load).
#include "support/models.h"
#include "support/support.h"

namespace {

struct CheckpointNetImpl : torch::nn::Module {  // Apex's test model: conv + BN + a scalar parameter
  CheckpointNetImpl()
      : conv(register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3).padding(1)))),
        bn(register_module("bn", torch::nn::BatchNorm2d(4))),
        param(register_parameter("param", torch::full({1}, 1.0))) {}
  torch::Tensor forward(const torch::Tensor& x) { return bn(conv(x)) * param.to(x.scalar_type()); }
  torch::nn::Conv2d conv;
  torch::nn::BatchNorm2d bn;
  torch::Tensor param;
};
TORCH_MODULE(CheckpointNet);

struct TrainingRun {
  CheckpointNet net;
  std::unique_ptr<amp::Initialized<CheckpointNet, torch::optim::SGD>> amp;
  torch::Device device;
  TrainingRun(const amp::Options& options, uint64_t seed, torch::Device device_) : device(device_) {
    torch::manual_seed(seed);
    net = CheckpointNet();
    net->to(device);
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
    amp = std::make_unique<amp::Initialized<CheckpointNet, torch::optim::SGD>>(
        amp::initialize(net, std::move(sgd), options));
  }
  torch::Tensor step(int iteration, int num_losses) {
    auto& [model, optimizer] = *amp;
    torch::manual_seed(1000 + iteration);
    auto x = torch::randn({2, 1, 6, 6}).to(device);
    optimizer.zero_grad();
    torch::Tensor out;
    for (int loss_id = 0; loss_id < num_losses; ++loss_id) {
      out = model(x);  // one forward per loss: each backward frees its graph
      auto loss = (loss_id == 0 ? out.pow(2) : out.abs()).mean();
      // An overflow in the backward of step 3 (levels with a dynamic scale check for it), so the
      // checkpoint at step 4 holds a reduced scale.
      if (iteration == 3 && loss_id == num_losses - 1 && optimizer.properties().loss_scale.is_dynamic()) {
        loss = loss * INFINITY;
      }
      auto scaled = amp::scale_loss(loss, optimizer, amp::ScaleLossOptions().loss_id(loss_id));
      scaled.backward();
    }
    optimizer.step();
    return out.detach();
  }
};

// Host copies, for amp_test::bitwise_equal.
std::vector<torch::Tensor> state_of(TrainingRun& run) {
  std::vector<torch::Tensor> out;
  for (auto& t : run.net->parameters()) out.push_back(t.detach().clone().cpu());
  for (auto& t : run.net->buffers()) out.push_back(t.detach().clone().cpu());
  for (auto& t : amp::master_params(run.amp->optimizer)) out.push_back(t.detach().clone().cpu());
  return out;
}

// (level, low-precision dtype, num_losses, device). Bitwise on CUDA too: both runs take the same kernels on
// the same device, with deterministic cuDNN (amp_test::use_deterministic_fp32).
class RestoringTest : public ::testing::TestWithParam<std::tuple<const char*, c10::ScalarType, int, c10::DeviceType>> {
 protected:
  void SetUp() override {
    const c10::DeviceType device = std::get<3>(GetParam());
    SKIP_WITHOUT_DEVICE(device);
    if (device == torch::kCPU) SKIP_WITHOUT_CPU_KERNELS(std::get<1>(GetParam()));
    amp_test::use_deterministic_fp32(device);
  }
};

}  // namespace

TEST_P(RestoringTest, ResumingIsBitwiseIdenticalToNotStopping) {
  const auto [level, lp, num_losses, device] = GetParam();
  const auto options = amp::Options(level).low_precision_dtype(lp).num_losses(num_losses).verbosity(0);
  // Checkpoint right after the step whose backward overflowed (3), and one step later (4); load the model first
  // (Apex's order) or the optimizer first (its masters must survive the model's rounded copies written after).
  for (const auto& [k, model_first] : std::vector<std::pair<int, bool>>{{3, true}, {4, true}, {4, false}}) {
    SCOPED_TRACE("checkpoint after step " + std::to_string(k) + (model_first ? ", model loaded first" : ", optimizer loaded first"));
    TrainingRun uninterrupted(options, 7, device);
    std::vector<torch::Tensor> outputs;
    std::stringstream model_checkpoint, optimizer_checkpoint;
    for (int i = 0; i < 10; ++i) {
      outputs.push_back(uninterrupted.step(i, num_losses).cpu());
      if (i == k) {
        torch::save(uninterrupted.net, model_checkpoint);
        torch::save(uninterrupted.amp->optimizer, optimizer_checkpoint);
      }
    }
    TrainingRun resumed(options, 99, device);  // different initial weights: everything must come from the checkpoint
    if (model_first) torch::load(resumed.net, model_checkpoint);
    torch::load(resumed.amp->optimizer, optimizer_checkpoint);
    if (!model_first) torch::load(resumed.net, model_checkpoint);
    for (int i = k + 1; i < 10; ++i) {
      auto out = resumed.step(i, num_losses).cpu();
      EXPECT_TRUE(amp_test::bitwise_equal(out, outputs[static_cast<size_t>(i)])) << "step " << i;
    }
    const auto a = state_of(uninterrupted), b = state_of(resumed);
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(amp_test::bitwise_equal(a[i], b[i])) << "tensor " << i;
    for (int id = 0; id < num_losses; ++id) {
      EXPECT_EQ(amp::loss_scale(resumed.amp->optimizer, id), amp::loss_scale(uninterrupted.amp->optimizer, id));
      EXPECT_EQ(resumed.amp->optimizer.loss_scaler(id).unskipped(), uninterrupted.amp->optimizer.loss_scaler(id).unskipped());
      EXPECT_EQ(resumed.amp->optimizer.skipped_steps(), uninterrupted.amp->optimizer.skipped_steps());
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Levels, RestoringTest,
    ::testing::Combine(::testing::Values("O0", "O1", "O2", "O3"), ::testing::Values(torch::kBFloat16, torch::kHalf),
                       ::testing::Values(1, 2), ::testing::ValuesIn(amp_test::test_devices())),
    [](const auto& info) {
      return std::string(std::get<0>(info.param)) + "_" + amp_test::dtype_label(std::get<1>(info.param)) + "_losses" +
             std::to_string(std::get<2>(info.param)) + amp_test::device_suffix(std::get<3>(info.param));
    });

namespace {
// Saving and loading models and optimizers whose tensors (masters, momentum) live on the device.
class CheckpointTest : public amp_test::DeviceTest {};
}  // namespace

TEST_P(CheckpointTest, LossScaleDecreaseSurvivesSaveAndLoad) {
  amp_test::Mlp net;
  net->to(device());
  torch::optim::SGD sgd(net->parameters(), 0.1);
  const auto options = amp::Options("O2").num_losses(3).low_precision_dtype(torch::kBFloat16).verbosity(0);
  auto [model, optimizer] = amp::initialize(net, std::move(sgd), options);
  for (int loss_id = 0; loss_id < 3; ++loss_id) {
    for (int k = 0; k < loss_id; ++k) {  // loss i overflows i times (inputs * 2^17 * inf)
      optimizer.zero_grad();
      auto scaled = amp::scale_loss(model((torch::randn({2, 8}) * 131072.0 * INFINITY).to(device())).sum(), optimizer,
                                    amp::ScaleLossOptions().loss_id(loss_id));
      scaled.backward();
      optimizer.step();
    }
  }
  std::stringstream checkpoint;
  torch::save(optimizer, checkpoint);
  amp_test::Mlp fresh_net;
  fresh_net->to(device());
  torch::optim::SGD fresh_sgd(fresh_net->parameters(), 0.1);
  auto [fresh_model, fresh_optimizer] = amp::initialize(fresh_net, std::move(fresh_sgd), options);
  torch::load(fresh_optimizer, checkpoint);
  for (int loss_id = 0; loss_id < 3; ++loss_id) {
    EXPECT_EQ(amp::loss_scale(fresh_optimizer, loss_id), 65536.0 / (1 << loss_id));
    EXPECT_EQ(fresh_optimizer.loss_scaler(loss_id).unskipped(), 0);
  }
}

// CheckpointTestCpu: refusals and loss-scaler state from a checkpoint's metadata, the same whatever device its
// tensors are on.
TEST(CheckpointTestCpu, RefusesCheckpointsThatDoNotMatch) {
  auto make = [](const amp::Options& options) {
    amp_test::Mlp net;
    torch::optim::SGD sgd(net->parameters(), 0.1);
    return amp::initialize(net, std::move(sgd), options);
  };
  auto base = amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0);
  auto [model, optimizer] = make(base);
  std::stringstream checkpoint;
  torch::save(optimizer, checkpoint);
  const std::string bytes = checkpoint.str();

  auto [m1, other_level] = make(amp::Options(base).opt_level(amp::OptLevel::O1));
  std::stringstream c1(bytes);
  ASSERT_THROWS_WITH(torch::load(other_level, c1), "saved at opt_level O2, this optimizer runs at O1");

  auto [m2, other_count] = make(amp::Options(base).num_losses(2));
  std::stringstream c2(bytes);
  ASSERT_THROWS_WITH(torch::load(other_count, c2), "the checkpoint has 1 loss scalers, this optimizer has 2");

  amp_test::Mlp plain_net;
  torch::optim::SGD plain(plain_net->parameters(), 0.1);
  std::stringstream c3;
  torch::save(plain, c3);
  auto [m3, target] = make(base);
  ASSERT_THROWS_WITH(torch::load(target, c3), "the checkpoint has no amp state");
}

// Issue: with min_loss_scale above 2^16 the scaler started below its minimum and resuming threw.
TEST(CheckpointTestCpu, MinLossScaleAboveTheDefaultInitialScaleResumes) {
  const auto options = amp::Options("O2").low_precision_dtype(torch::kBFloat16).min_loss_scale(1e6)
                           .max_loss_scale(1e7).verbosity(0);
  amp_test::Mlp net, fresh_net;
  auto [model, optimizer] = amp::initialize(net, torch::optim::SGD(net->parameters(), 0.1), options);
  EXPECT_EQ(amp::loss_scale(optimizer), 1e6);
  std::stringstream checkpoint;
  torch::save(optimizer, checkpoint);
  auto [fresh_model, fresh_optimizer] = amp::initialize(fresh_net, torch::optim::SGD(fresh_net->parameters(), 0.1), options);
  EXPECT_NO_THROW(torch::load(fresh_optimizer, checkpoint));
  EXPECT_EQ(amp::loss_scale(fresh_optimizer), 1e6);
}

// The loss-scaler settings travel in the checkpoint: the hysteresis countdown resumes where it was, and
// resuming with other settings is refused rather than silently changing the schedule.
TEST(CheckpointTestCpu, LossScalerSettingsAndHysteresisStateRoundTrip) {
  const auto options = amp::Options("O2").low_precision_dtype(torch::kBFloat16).hysteresis(3).verbosity(0);
  amp_test::Mlp net;
  auto [model, optimizer] = amp::initialize(net, torch::optim::SGD(net->parameters(), 0.1), options);
  optimizer.zero_grad();
  {
    auto scaled = amp::scale_loss(model(torch::randn({2, 8}) * INFINITY).sum(), optimizer);
    scaled.backward();
  }
  optimizer.step();  // skipped, scale kept (1 of 3)
  EXPECT_EQ(amp::loss_scale(optimizer), 65536.0);
  EXPECT_EQ(optimizer.loss_scaler().hysteresis_left(), 2);
  std::stringstream checkpoint;
  torch::save(optimizer, checkpoint);
  const std::string bytes = checkpoint.str();

  amp_test::Mlp fresh_net;
  auto [fresh_model, fresh_optimizer] = amp::initialize(fresh_net, torch::optim::SGD(fresh_net->parameters(), 0.1), options);
  std::stringstream c1(bytes);
  torch::load(fresh_optimizer, c1);
  EXPECT_EQ(fresh_optimizer.loss_scaler().hysteresis_left(), 2);

  amp_test::Mlp other_net;
  auto [other_model, other_optimizer] =
      amp::initialize(other_net, torch::optim::SGD(other_net->parameters(), 0.1), amp::Options(options).hysteresis(2));
  std::stringstream c2(bytes);
  ASSERT_THROWS_WITH(torch::load(other_optimizer, c2), "the checkpoint was saved with hysteresis = 3.0, this optimizer has "
                                                       "hysteresis = 2.0. Resume with the loss-scaler settings");
}

// A checkpoint taken after loading new weights into an O2 model holds those weights, not the old masters.
TEST_P(CheckpointTest, SavingAfterLoadingWeightsSavesTheLoadedWeights) {
  const auto options = amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0);
  amp_test::Mlp net, fresh_net;
  net->to(device());
  fresh_net->to(device());
  auto [model, optimizer] = amp::initialize(net, torch::optim::SGD(net->parameters(), 0.1), options);
  {
    torch::NoGradGuard no_grad;
    for (auto& p : net->parameters()) p.fill_(0.25);
  }
  std::stringstream checkpoint;
  torch::save(optimizer, checkpoint);
  auto [fresh_model, fresh_optimizer] = amp::initialize(fresh_net, torch::optim::SGD(fresh_net->parameters(), 0.1), options);
  torch::load(fresh_optimizer, checkpoint);
  for (const auto& p : fresh_net->parameters()) EXPECT_TRUE(torch::all(p == 0.25).item<bool>());
}

AMP_INSTANTIATE_FOR_DEVICES(CheckpointTest);
