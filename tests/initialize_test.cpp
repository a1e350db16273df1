// amp::initialize: what each level does to parameters, buffers and the optimizer, and every
// mistake it refuses (reference §1.1-§1.3, §5).
#include "support/models.h"
#include "support/support.h"

using amp_test::ConvBnNet;
using amp_test::Mlp;

namespace {

amp::Options quiet(const char* level, c10::ScalarType lp = torch::kBFloat16) {
  return amp::Options(level).low_precision_dtype(lp).verbosity(0);
}

// Runs on every device: the model is moved there before amp::initialize, as scripts do.
class InitializeTest : public amp_test::DeviceTest {};

}  // namespace

TEST_P(InitializeTest, ParameterAndBufferDtypesPerLevel) {
  struct Case { const char* level; c10::ScalarType conv; c10::ScalarType bn; };
  const auto bf = torch::kBFloat16;
  for (const Case& c : {Case{"O0", torch::kFloat, torch::kFloat}, Case{"O1", torch::kFloat, torch::kFloat},
                        Case{"O2", bf, torch::kFloat}, Case{"O3", bf, bf}}) {
    ConvBnNet net;
    net->to(device());
    torch::optim::SGD sgd(net->parameters(), 0.1);
    auto [model, optimizer] = amp::initialize(net, std::move(sgd), quiet(c.level));
    EXPECT_EQ(net->conv->weight.device().type(), device().type()) << c.level;  // type(): cuda:0 vs cuda
    EXPECT_EQ(net->conv->weight.scalar_type(), c.conv) << c.level;
    EXPECT_EQ(net->fc->bias.scalar_type(), c.conv) << c.level;
    EXPECT_EQ(net->bn->weight.scalar_type(), c.bn) << c.level;
    EXPECT_EQ(net->bn->bias.scalar_type(), c.bn) << c.level;
    EXPECT_EQ(net->bn->running_mean.scalar_type(), c.bn) << c.level;
    EXPECT_EQ(net->bn->running_var.scalar_type(), c.bn) << c.level;
    EXPECT_EQ(net->bn->num_batches_tracked.scalar_type(), torch::kLong) << c.level;
  }
  ConvBnNet net;
  net->to(device());
  torch::optim::SGD sgd(net->parameters(), 0.1);
  auto [model, optimizer] = amp::initialize(net, std::move(sgd), quiet("O3").keep_batchnorm_fp32(true));
  EXPECT_EQ(net->bn->weight.scalar_type(), torch::kFloat);
  EXPECT_EQ(net->bn->running_var.scalar_type(), torch::kFloat);
  EXPECT_EQ(net->conv->weight.scalar_type(), torch::kBFloat16);
}

TEST_P(InitializeTest, O2MastersAreFp32CopiesOfTheOriginalsInParamGroups) {
  ConvBnNet net;
  net->to(device());
  std::vector<torch::Tensor> originals;
  for (auto& p : net->parameters()) originals.push_back(p.detach().clone());
  torch::optim::SGD sgd(net->parameters(), 0.1);
  auto [model, optimizer] = amp::initialize(net, std::move(sgd), quiet("O2"));
  const auto masters = amp::master_params(optimizer);
  const auto params = net->parameters();
  ASSERT_EQ(masters.size(), params.size());
  for (size_t i = 0; i < masters.size(); ++i) {
    EXPECT_EQ(masters[i].scalar_type(), torch::kFloat);
    EXPECT_EQ(masters[i].device().type(), device().type()) << i;  // beside the weight: no host copy per step
    EXPECT_TRUE(masters[i].requires_grad());
    EXPECT_TRUE(torch::equal(masters[i], originals[i])) << i;  // not rounded through bf16
    const bool is_bn = i == 2 || i == 3;                        // conv.w, conv.b, bn.w, bn.b, fc.w, fc.b
    EXPECT_EQ(masters[i].is_same(params[i]), is_bn) << i;       // BN stays fp32: no master needed
  }
  EXPECT_EQ(optimizer.param_groups()[0].params()[0].scalar_type(), torch::kFloat);
}

TEST_P(InitializeTest, O2MovesExistingOptimizerStateToTheMasters) {
  Mlp net;
  net->to(device());
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-3));
  net->forward(torch::randn({4, 8}).to(device())).sum().backward();
  adam.step();  // creates fp32 Adam state keyed by the fp32 params
  ASSERT_EQ(adam.state().size(), 4u);
  auto [model, optimizer] = amp::initialize(net, std::move(adam), quiet("O2"));
  EXPECT_EQ(optimizer.state().size(), 4u);
  optimizer.zero_grad();
  auto loss = model(torch::randn({4, 8}).to(device())).sum();
  {
    auto scaled = amp::scale_loss(loss, optimizer);
    scaled.backward();
  }
  optimizer.step();
  EXPECT_EQ(optimizer.state().size(), 4u);  // same entries, now keyed by the masters: none orphaned
  for (const auto& p : amp::master_params(optimizer)) {
    auto& state = static_cast<torch::optim::AdamParamState&>(*optimizer.state().at(
#if TORCH_VERSION_MAJOR >= 2
        p.unsafeGetTensorImpl()
#else
        c10::guts::to_string(p.unsafeGetTensorImpl())
#endif
            ));
    EXPECT_EQ(state.step(), 2);
  }
}

TEST_P(InitializeTest, ModelCastsInputsAndOutputs) {
  Mlp net;
  net->to(device());
  torch::optim::SGD sgd(net->parameters(), 0.1);
  auto [model, optimizer] = amp::initialize(net, std::move(sgd), quiet("O2"));
  auto y = model(torch::randn({2, 8}, torch::kDouble).to(device()));  // doubles are cast too (Apex casts every float)
  EXPECT_EQ(y.scalar_type(), torch::kFloat);
  EXPECT_EQ(y.device().type(), device().type());
  EXPECT_EQ(model.forward(torch::randn({2, 8}).to(device())).scalar_type(), torch::kFloat);
  EXPECT_EQ(model->forward(torch::randn({2, 8}).to(device(), torch::kBFloat16)).scalar_type(), torch::kBFloat16);  // no casts
  EXPECT_EQ((*model).fc1->weight.scalar_type(), torch::kBFloat16);
}

namespace {
struct TwoHeadsImpl : torch::nn::Module {
  TwoHeadsImpl() : fc(register_module("fc", torch::nn::Linear(4, 4))) {}
  std::tuple<torch::Tensor, std::vector<torch::Tensor>, int64_t> forward(const torch::Tensor& x, int64_t tag) {
    auto y = fc(x);
    return {y, {y * 2, y.argmax(1)}, tag};
  }
  torch::nn::Linear fc;
};
TORCH_MODULE(TwoHeads);
}  // namespace

TEST_P(InitializeTest, NestedOutputsAreCastAndNonTensorsPassThrough) {
  TwoHeads net;
  net->to(device());
  torch::optim::SGD sgd(net->parameters(), 0.1);
  auto [model, optimizer] = amp::initialize(net, std::move(sgd), quiet("O3").cast_model_outputs(torch::kDouble));
  auto [a, list, tag] = model(torch::randn({3, 4}).to(device()), int64_t{7});
  EXPECT_EQ(a.scalar_type(), torch::kDouble);
  EXPECT_EQ(list[0].scalar_type(), torch::kDouble);
  EXPECT_EQ(list[1].scalar_type(), torch::kLong);  // integer outputs untouched
  EXPECT_EQ(tag, 7);
}

TEST_P(InitializeTest, SequentialAndSharedPtrModels) {
  torch::nn::Sequential seq(torch::nn::Linear(4, 4), torch::nn::ReLU(), torch::nn::Linear(4, 2));
  seq->to(device());
  torch::optim::SGD sgd(seq->parameters(), 0.1);
  auto [model, optimizer] = amp::initialize(seq, std::move(sgd), quiet("O2"));
  EXPECT_EQ(model(torch::randn({3, 4}).to(device())).scalar_type(), torch::kFloat);

  auto impl = std::make_shared<amp_test::MlpImpl>();
  impl->to(device());
  torch::optim::SGD sgd2(impl->parameters(), 0.1);
  auto [model2, optimizer2] = amp::initialize(impl, std::move(sgd2), amp::OptLevel::O0);
  EXPECT_EQ(model2(torch::randn({3, 8}).to(device())).sizes(), (std::vector<int64_t>{3, 4}));
}

TEST_P(InitializeTest, DisabledChangesNothing) {
  Mlp net;
  net->to(device());
  auto before = net->fc1->weight.detach().clone();
  torch::optim::SGD sgd(net->parameters(), 0.1);
  auto [model, optimizer] = amp::initialize(net, std::move(sgd), quiet("O2").enabled(false));
  EXPECT_EQ(net->fc1->weight.scalar_type(), torch::kFloat);
  EXPECT_TRUE(optimizer.param_groups()[0].params()[0].is_same(net->fc1->weight));
  auto x = torch::randn({2, 8}, torch::kDouble).to(device());
  EXPECT_THROW(model(x), std::exception);  // no input casts when disabled: plain LibTorch behaviour
  auto loss = model(torch::randn({2, 8}).to(device())).sum();
  auto scaled = amp::scale_loss(loss, optimizer);
  EXPECT_TRUE(scaled.tensor().is_same(loss));
  EXPECT_TRUE(torch::equal(net->fc1->weight, before));
}

// The banner is text from the options alone, the same on every device.
TEST(InitializeTestCpu, PrintsApexsBannerAtVerbosity1) {
  Mlp net;
  torch::optim::SGD sgd(net->parameters(), 0.1);
  testing::internal::CaptureStdout();
  auto [model, optimizer] = amp::initialize(net, std::move(sgd), amp::Options("O2").low_precision_dtype(torch::kBFloat16));
  const std::string out = testing::internal::GetCapturedStdout();
  EXPECT_NE(out.find("Selected optimization level O2:  FP16 training with FP32 batchnorm and FP32 master weights."),
            std::string::npos) << out;
  EXPECT_NE(out.find("Defaults for this optimization level are:"), std::string::npos);
  EXPECT_NE(out.find("Processing user overrides (additional kwargs that are not None)...\nlow_precision_dtype    : torch.bfloat16"),
            std::string::npos) << out;
  EXPECT_NE(out.find("After processing overrides, optimization options are:"), std::string::npos);
  EXPECT_NE(out.find("cast_model_type        : torch.bfloat16"), std::string::npos);
}

// InitializeErrorsTest stays on the CPU: each refusal comes from the options, the optimizer or the model's
// structure before anything runs on a device, or (DtypeTheBuildCannotCompute..., LayerTheBuildCannotRun...)
// from what this LibTorch's CPU kernels can do.
TEST(InitializeErrorsTest, OptimizerParameterNotInTheModel) {
  Mlp net, other;
  torch::optim::SGD sgd(other->parameters(), 0.1);
  ASSERT_THROWS_WITH(amp::initialize(net, std::move(sgd), quiet("O2")),
                     "the optimizer's parameter 0 of group 0 (shape [16, 8]) is not a parameter of the model");
  EXPECT_EQ(net->fc1->weight.scalar_type(), torch::kFloat);  // nothing was cast
}

TEST(InitializeErrorsTest, IncomingParametersMustBeFp32) {
  Mlp net;
  net->to(torch::kHalf);
  torch::optim::SGD sgd(net->parameters(), 0.1);
  ASSERT_THROWS_WITH(amp::initialize(net, std::move(sgd), quiet("O2")),
                     "found parameter 'fc1.weight' with dtype torch.float16, expected torch.float32");
  Mlp doubled;
  doubled->to(torch::kDouble);
  torch::optim::SGD sgd2(doubled->parameters(), 0.1);
  ASSERT_THROWS_WITH(amp::initialize(doubled, std::move(sgd2), quiet("O1")), "with dtype torch.float64");
}

TEST(InitializeErrorsTest, SameModelTwice) {
  Mlp net;
  torch::optim::SGD sgd(net->parameters(), 0.1);
  auto first = amp::initialize(net, std::move(sgd), quiet("O1"));
  torch::optim::SGD sgd2(net->parameters(), 0.1);
  ASSERT_THROWS_WITH(amp::initialize(net, std::move(sgd2), quiet("O1")),
                     "has already been passed through amp::initialize");
}

TEST(InitializeErrorsTest, SameOptimizerTwice) {
  Mlp net, net2;
  torch::optim::SGD sgd(net->parameters(), 0.1);
  auto first = amp::initialize(net, std::move(sgd), quiet("O2"));
  // `sgd` was moved into the first call: passing it again is the C++ form of Apex's
  // "A given optimizer should only be passed through amp.initialize once."
  ASSERT_THROWS_WITH(amp::initialize(net2, std::move(sgd), quiet("O2")), "the optimizer holds no parameters");
}

TEST(InitializeErrorsTest, ClosureOptimizers) {
  Mlp net;
  torch::optim::LBFGS lbfgs(net->parameters(), torch::optim::LBFGSOptions(1));
  ASSERT_THROWS_WITH(amp::initialize(net, std::move(lbfgs), quiet("O1")), "LBFGS needs a closure");
  Mlp net2;
  torch::optim::SGD sgd(net2->parameters(), 0.1);
  auto [model, optimizer] = amp::initialize(net2, std::move(sgd), quiet("O1"));
  ASSERT_THROWS_WITH(optimizer.step([] { return torch::zeros({}); }), "amp does not support closure use");
}

TEST(InitializeErrorsTest, StateThatWouldNotMatchTheCastParameters) {
  Mlp net;
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  net->forward(torch::randn({2, 8})).sum().backward();
  sgd.step();
  ASSERT_THROWS_WITH(amp::initialize(net, std::move(sgd), quiet("O3")),
                     "already has state for parameter 'fc1.weight'");
}

TEST(InitializeErrorsTest, DtypeTheBuildCannotComputeIsReportedAtInitialize) {
  if (amp_test::cpu_computes(torch::kHalf) && TORCH_VERSION_MAJOR >= 2) {
    Mlp net;
    torch::optim::SGD sgd(net->parameters(), 0.1);
    EXPECT_NO_THROW(amp::initialize(net, std::move(sgd), quiet("O2", torch::kHalf)));
    GTEST_SKIP() << "this LibTorch computes float16 on the CPU; the refusal is exercised on LibTorch 1.13";
  }
  for (const char* level : {"O1", "O2", "O3"}) {
    Mlp net;
    torch::optim::SGD sgd(net->parameters(), 0.1);
    ASSERT_THROWS_WITH(amp::initialize(net, std::move(sgd), quiet(level, torch::kHalf)),
                       "computes in torch.float16 on cpu, but this LibTorch build");
    ASSERT_THROWS_WITH(amp::initialize(net, std::move(sgd), quiet(level, torch::kHalf)), "low_precision_dtype(torch::kBFloat16)");
  }
}

// Frozen layers' statistics must survive each device's BatchNorm kernels.
class FrozenBatchNormTest : public amp_test::DeviceTest {};

TEST_P(FrozenBatchNormTest, TrainKeepsFrozenLayersFrozen) {
  ConvBnNet net;
  net->to(device());
  amp::freeze_batchnorm(*net);
  EXPECT_TRUE(amp::is_frozen(*net->bn));
  EXPECT_FALSE(net->bn->is_training());
  EXPECT_FALSE(net->bn->weight.requires_grad());
  torch::optim::SGD sgd(net->fc->parameters(), 0.1);
  auto [model, optimizer] = amp::initialize(net, std::move(sgd), quiet("O2"));
  model.train();
  EXPECT_TRUE(net->conv->is_training());
  EXPECT_FALSE(net->bn->is_training());
  const auto mean = net->bn->running_mean.clone(), var = net->bn->running_var.clone();
  for (int i = 0; i < 3; ++i) {
    optimizer.zero_grad();
    auto loss = model((torch::randn({4, 1, 8, 8}) * 3 + 1).to(device())).sum();
    auto scaled = amp::scale_loss(loss, optimizer);
    scaled.backward();
    optimizer.step();
  }
  EXPECT_TRUE(torch::equal(net->bn->running_mean, mean));
  EXPECT_TRUE(torch::equal(net->bn->running_var, var));
}

TEST(InitializeErrorsTest, Fp16OptimizerStateWithAnEpsThatRoundsToZero) {
  SKIP_WITHOUT_CPU_KERNELS(torch::kHalf);
  Mlp net;
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-3));  // eps 1e-8
  ASSERT_THROWS_WITH(amp::initialize(net, std::move(adam), quiet("O3", torch::kHalf)),
                     "the optimizer's eps=1e-08 rounds to 0");
  Mlp ok1, ok2, ok3;
  torch::optim::Adam large_eps(ok1->parameters(), torch::optim::AdamOptions(1e-3).eps(1e-4));
  EXPECT_NO_THROW(amp::initialize(ok1, std::move(large_eps), quiet("O3", torch::kHalf)));
  torch::optim::Adam with_masters(ok2->parameters(), torch::optim::AdamOptions(1e-3));
  EXPECT_NO_THROW(amp::initialize(ok2, std::move(with_masters), quiet("O2", torch::kHalf)));
  torch::optim::AdamW bf16(ok3->parameters(), torch::optim::AdamWOptions(1e-3));
  EXPECT_NO_THROW(amp::initialize(ok3, std::move(bf16), quiet("O3", torch::kBFloat16)));
}

TEST(InitializeErrorsTest, LayerTheBuildCannotRunInTheDtypeIsReportedAtInitialize) {
  // LibTorch 1.13's CPU bfloat16 transposed convolution treats its weight as a forward convolution's.
  bool build_runs_it = true;
  try {
    auto y = torch::conv_transpose2d(torch::ones({1, 4, 3, 3}, torch::kBFloat16), torch::ones({4, 2, 3, 3}, torch::kBFloat16),
                                     {}, 2, 1);
    build_runs_it = y.size(1) == 2;
  } catch (const std::exception&) {
    build_runs_it = false;
  }
  torch::nn::Sequential decoder(torch::nn::Conv2d(torch::nn::Conv2dOptions(2, 4, 3).padding(1)),
                                torch::nn::ConvTranspose2d(torch::nn::ConvTranspose2dOptions(4, 2, 3).stride(2).padding(1)));
  torch::optim::SGD sgd(decoder->parameters(), 0.1);
  if (build_runs_it) {
    auto [model, optimizer] = amp::initialize(decoder, std::move(sgd), quiet("O2"));
    EXPECT_EQ(model(torch::randn({1, 2, 5, 5})).size(1), 2);
  } else {
    ASSERT_THROWS_WITH(amp::initialize(decoder, std::move(sgd), quiet("O2")),
                       "the model has a ConvTranspose2d layer ('1'), which this LibTorch build");
  }
}

AMP_INSTANTIATE_FOR_DEVICES(InitializeTest);
AMP_INSTANTIATE_FOR_DEVICES(FrozenBatchNormTest);
