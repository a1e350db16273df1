// What real training scripts do after amp::initialize, at O1/O2/O3 x fp16/bf16, each against a plain
// fp32 LibTorch reference doing the same thing: one loss over two optimizers (backbone + head),
// progressive unfreezing with add_param_group, model checkpoints and pretrained weights loaded after
// initialize, in-place weight edits, Adagrad. Ports Apex's test_add_param_group (L0/run_amp) and
// test_multiple_models_optimizers_losses' two-optimizer cases in spirit: exact expected updates.
#include <cstdio>
#include <filesystem>

#include "support/models.h"
#include "support/support.h"
#include "support/training.h"

namespace {

using amp_test::dtype_label;

// A backbone (two Linear layers) and a head: the shape of fine-tuning scripts.
struct BackboneHeadImpl : torch::nn::Module {
  BackboneHeadImpl()
      : backbone(register_module("backbone", torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::ReLU(),
                                                                   torch::nn::Linear(16, 16)))),
        head(register_module("head", torch::nn::Linear(16, 4))) {}
  torch::Tensor forward(const torch::Tensor& x) { return head(torch::relu(backbone->forward(x))); }
  torch::nn::Sequential backbone;
  torch::nn::Linear head;
};
TORCH_MODULE(BackboneHead);

struct RnnNetImpl : torch::nn::Module {
  RnnNetImpl() : rnn(register_module("rnn", torch::nn::LSTM(torch::nn::LSTMOptions(8, 8)))) {}
  torch::Tensor forward(const torch::Tensor& x) { return std::get<0>(rnn->forward(x)); }
  torch::nn::LSTM rnn;
};
TORCH_MODULE(RnnNet);

std::vector<torch::Tensor> params_of(torch::nn::Module& m) { return m.parameters(); }

void copy_weights(torch::nn::Module& to, torch::nn::Module& from) {
  torch::NoGradGuard no_grad;
  auto dst = to.parameters();
  auto src = from.parameters();
  for (size_t i = 0; i < dst.size(); ++i) dst[i].copy_(src[i]);
}

std::vector<torch::Tensor> snapshot(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> out;
  for (const auto& p : params) out.push_back(p.detach().to(torch::kFloat).clone());
  return out;
}

float eps_of(c10::ScalarType dtype) { return dtype == torch::kBFloat16 ? 0.0078125f : 0.0009765625f; }

// Expects the amp update (after - before) to match the fp32 reference update within what rounding
// weights and activations to `dtype` allows; a scaled-gradient step is off by orders of magnitude.
void expect_same_update(const std::vector<torch::Tensor>& before, const std::vector<torch::Tensor>& after,
                        const std::vector<torch::Tensor>& ref_before, const std::vector<torch::Tensor>& ref_after,
                        c10::ScalarType dtype, const std::string& what) {
  ASSERT_EQ(before.size(), ref_before.size());
  for (size_t i = 0; i < before.size(); ++i) {
    const auto update = after[i].to(torch::kFloat) - before[i];
    const auto ref_update = ref_after[i] - ref_before[i];
    const double ref_size = ref_update.abs().max().item<double>();
    ASSERT_GT(ref_size, 0.0) << what << ": the reference did not move parameter " << i;
    const double weight_size = ref_after[i].abs().max().item<double>();
    const double tolerance = 0.1 * ref_size + 2.0 * eps_of(dtype) * weight_size;
    const double error = (update - ref_update).abs().max().item<double>();
    EXPECT_LE(error, tolerance) << what << ", parameter " << i << ": update off by " << error
                                << " (reference update " << ref_size << ")";
  }
}

class RealScriptsTest : public amp_test::LevelTest {
 protected:
  BackboneHead make_net() const {
    BackboneHead net;
    net->to(device());
    return net;
  }
  bool scales() const { return std::string(GetParam().level) != "O3"; }
};

TEST_P(RealScriptsTest, OneLossTwoOptimizersMatchesReference) {
  torch::manual_seed(1);
  BackboneHead reference = make_net(), net = make_net();
  copy_weights(*net, *reference);
  auto x = torch::randn({32, 8}, device()), y = torch::randint(0, 4, {32}, torch::TensorOptions(device()).dtype(torch::kLong));

  torch::optim::SGD ref_backbone(params_of(*reference->backbone), torch::optim::SGDOptions(0.1));
  // eps 1: Adam's first step is then linear in the gradient, so rounding shows as rounding (with a tiny
  // eps it is lr * sign(g), and near-zero gradients flip sign or underflow g^2 in float16 state at O3).
  torch::optim::Adam ref_head(params_of(*reference->head), torch::optim::AdamOptions(0.01).eps(1.0));
  auto ref_before = snapshot(reference->parameters());
  torch::nn::functional::cross_entropy(reference->forward(x), y).backward();
  ref_backbone.step();
  ref_head.step();

  torch::optim::SGD backbone_opt(params_of(*net->backbone), torch::optim::SGDOptions(0.1));
  torch::optim::Adam head_opt(params_of(*net->head), torch::optim::AdamOptions(0.01).eps(1.0));
  auto [models, optimizers] =
      amp::initialize(std::tuple(net), std::tuple(std::move(backbone_opt), std::move(head_opt)), options());
  auto& [model] = models;
  auto& [ob, oh] = optimizers;
  auto before = snapshot(net->parameters());
  {
    auto scaled = amp::scale_loss(torch::nn::functional::cross_entropy(model(x), y), {&ob, &oh});
    scaled.backward();
  }
  ob.step();
  oh.step();
  expect_same_update(before, snapshot(net->parameters()), ref_before, snapshot(reference->parameters()),
                     GetParam().dtype, "backbone + head");
  if (scales()) EXPECT_EQ(amp::loss_scale(ob), 65536.0);  // one update of the shared scaler, not two
}

TEST_P(RealScriptsTest, StepOnGradientsOfAnotherOptimizersScaledLossThrows) {
  torch::manual_seed(2);
  BackboneHead net = make_net();
  torch::optim::SGD backbone_opt(params_of(*net->backbone), torch::optim::SGDOptions(0.1));
  torch::optim::SGD head_opt(params_of(*net->head), torch::optim::SGDOptions(0.1));
  auto [models, optimizers] =
      amp::initialize(std::tuple(net), std::tuple(std::move(backbone_opt), std::move(head_opt)), options());
  auto& [model] = models;
  auto& [ob, oh] = optimizers;
  auto x = torch::randn({16, 8}, device());
  {
    auto scaled = amp::scale_loss(model(x).sum(), ob);  // forgot the head's optimizer
    scaled.backward();
  }
  ob.step();
  const auto head_before = snapshot(net->head->parameters());
  if (!scales()) {  // O3: a loss scale of 1 leaves nothing scaled, so the head's step is right
    oh.step();
    return;
  }
  ASSERT_THROWS_WITH(oh.step(), "is still multiplied by loss scale 65536.0");
  ASSERT_THROWS_WITH(oh.step(), "amp::scale_loss(loss, {&optimizer_a, &optimizer_b})");
  const auto head_after = snapshot(net->head->parameters());
  for (size_t i = 0; i < head_before.size(); ++i) EXPECT_TRUE(amp_test::bitwise_equal(head_before[i], head_after[i]));
  // Clearing the gradients retires them; the next iteration trains normally.
  oh.zero_grad();
  ob.zero_grad();
  {
    auto scaled = amp::scale_loss(model(x).sum(), {&ob, &oh});
    scaled.backward();
  }
  ob.step();
  oh.step();
}

TEST_P(RealScriptsTest, AddParamGroupAfterInitializeIsAdopted) {
  // Progressive unfreezing: train the head, then unfreeze the backbone into a new param group.
  torch::manual_seed(3);
  BackboneHead reference = make_net(), net = make_net();
  copy_weights(*net, *reference);
  for (auto* m : {&reference, &net}) {
    for (auto& p : (*m)->backbone->parameters()) p.set_requires_grad(false);
  }
  auto x = torch::randn({32, 8}, device()), y = torch::randint(0, 4, {32}, torch::TensorOptions(device()).dtype(torch::kLong));

  torch::optim::SGD ref_opt(params_of(*reference->head), torch::optim::SGDOptions(0.05).momentum(0.9));
  auto [model, optimizer] = amp::initialize(
      net, torch::optim::SGD(params_of(*net->head), torch::optim::SGDOptions(0.05).momentum(0.9)), options());

  auto ref_step = [&] {
    ref_opt.zero_grad();
    torch::nn::functional::cross_entropy(reference->forward(x), y).backward();
    ref_opt.step();
  };
  auto amp_step = [&, &model = model, &optimizer = optimizer] {
    optimizer.zero_grad();
    auto scaled = amp::scale_loss(torch::nn::functional::cross_entropy(model(x), y), optimizer);
    scaled.backward();
    optimizer.step();
  };
  ref_step();
  amp_step();
  // Unfreeze the backbone, as fine-tuning recipes do after a few epochs.
  for (auto* m : {&reference, &net}) {
    for (auto& p : (*m)->backbone->parameters()) p.set_requires_grad(true);
  }
  ref_opt.add_param_group(torch::optim::OptimizerParamGroup(params_of(*reference->backbone),
                                                            std::make_unique<torch::optim::SGDOptions>(0.01)));
  optimizer.add_param_group(torch::optim::OptimizerParamGroup(params_of(*net->backbone),
                                                              std::make_unique<torch::optim::SGDOptions>(0.01)));
  const auto ref_before = snapshot(reference->backbone->parameters());
  const auto before = snapshot(net->backbone->parameters());
  ref_step();
  amp_step();
  expect_same_update(before, snapshot(net->backbone->parameters()), ref_before,
                     snapshot(reference->backbone->parameters()), GetParam().dtype, "unfrozen backbone");
  // The new group got what initialize gives: low precision where the level casts, masters at O2.
  const auto backbone_weight = net->backbone->parameters()[0];
  EXPECT_EQ(backbone_weight.scalar_type(), std::string(GetParam().level) == "O1" ? torch::kFloat : GetParam().dtype);
  const auto masters = amp::master_params(optimizer);
  ASSERT_EQ(masters.size(), net->parameters().size());
  if (std::string(GetParam().level) == "O2") {
    EXPECT_EQ(masters.back().scalar_type(), torch::kFloat);
  }
}

TEST_P(RealScriptsTest, ModelCheckpointLoadedAfterInitializeContinuesFromIt) {
  // Apex's documented order: initialize, then load. A checkpoint of the amp model itself (same dtypes).
  const std::string path = ::testing::TempDir() + "amp_model_ckpt_" + GetParam().level + dtype_label(GetParam().dtype) +
                           amp_test::device_suffix(GetParam().device) + ".pt";
  torch::manual_seed(4);
  auto x = torch::randn({32, 8}, device()), y = torch::randint(0, 4, {32}, torch::TensorOptions(device()).dtype(torch::kLong));
  {
    BackboneHead net = make_net();
    auto [model, optimizer] = amp::initialize(net, torch::optim::SGD(net->parameters(), 0.1), options());
    for (int i = 0; i < 3; ++i) amp_test::train_step(model, optimizer, x, y);
    torch::save(net, path);
  }
  BackboneHead fresh = make_net();
  auto [model, optimizer] = amp::initialize(fresh, torch::optim::SGD(fresh->parameters(), 0.0), options());
  torch::load(fresh, path);
  BackboneHead saved = make_net();
  amp::initialize(saved, options());
  torch::load(saved, path);
  // lr = 0: the step must leave the loaded weights exactly as loaded (it used to write the old masters back).
  amp_test::train_step(model, optimizer, x, y);
  for (size_t i = 0; i < fresh->parameters().size(); ++i) {
    EXPECT_TRUE(amp_test::bitwise_equal(fresh->parameters()[i], saved->parameters()[i])) << "parameter " << i;
  }
  std::remove(path.c_str());
}

// Weights swapped in with set_data after initialize, as loaders do where a checkpoint's tensor is on another device
// (LibTorch's InputArchive calls set_data there, set_ otherwise): set_data replaces the storage and leaves the
// version counter as it was, so the masters must notice the new storage, not only a new version.
TEST_P(RealScriptsTest, WeightsSwappedInWithSetDataAfterInitializeReachTheMasters) {
  torch::manual_seed(4);
  auto x = torch::randn({32, 8}, device()), y = torch::randint(0, 4, {32}, torch::TensorOptions(device()).dtype(torch::kLong));
  BackboneHead net = make_net();
  auto [model, optimizer] = amp::initialize(net, torch::optim::SGD(net->parameters(), 0.0), options());
  BackboneHead other = make_net();
  amp::initialize(other, options());
  std::vector<torch::Tensor> swapped;
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < net->parameters().size(); ++i) {
      torch::Tensor p = net->parameters()[i];
      const int64_t version = p._version();
      swapped.push_back(other->parameters()[i].detach().clone());
      p.set_data(swapped.back().clone());
      ASSERT_EQ(p._version(), version) << "the premise: set_data keeps the version";
    }
  }
  amp_test::train_step(model, optimizer, x, y);  // lr 0: the weights stay what was swapped in
  for (size_t i = 0; i < net->parameters().size(); ++i) {
    EXPECT_TRUE(amp_test::bitwise_equal(net->parameters()[i], swapped[i])) << "parameter " << i;
  }
}

// A resume in the two orders real scripts use: torch::load(model) then torch::load(optimizer), or the optimizer
// first. Loaded after the optimizer, the model's low-precision weights are its restored masters rounded, so the
// masters keep their low bits and the next steps equal the uninterrupted run's, bit for bit (Adam, as the report
// that found the optimizer-first order losing them). A weight that really differs from its master's rounding is a
// new value: the master takes it, element by element.
TEST_P(RealScriptsTest, ResumeContinuesBitwiseWhicheverIsLoadedFirst) {
  torch::manual_seed(6);
  const auto x = torch::randn({32, 8}, device());
  const auto y = torch::randint(0, 4, {32}, torch::TensorOptions(device()).dtype(torch::kLong));
  auto train = [&](auto& model, auto& optimizer, int steps) {
    std::vector<torch::Tensor> losses;
    for (int i = 0; i < steps; ++i) losses.push_back(amp_test::train_step(model, optimizer, x * (1 + 0.1 * i), y).detach().cpu());
    return losses;
  };
  // eps 1e-4: O3 fp16 refuses 1e-8, which rounds to 0 in fp16.
  auto adam = [](BackboneHead& net) { return torch::optim::Adam(net->parameters(), torch::optim::AdamOptions(1e-2).eps(1e-4)); };
  std::stringstream model_bytes, optimizer_bytes;
  BackboneHead net = make_net();
  auto [model, optimizer] = amp::initialize(net, adam(net), options());
  train(model, optimizer, 6);
  torch::save(net, model_bytes);
  torch::save(optimizer, optimizer_bytes);
  const auto expected = train(model, optimizer, 6);
  // The model by torch::load, or by amp::load_weights (the way that works under ZeRO): a checkpoint in the model's
  // dtype keeps the masters' low bits there too.
  for (const int order : {0, 1, 2}) {
    const bool model_first = order == 0;
    SCOPED_TRACE(order == 0 ? "model loaded first" : order == 1 ? "optimizer loaded first" : "optimizer, then load_weights");
    BackboneHead fresh = make_net();
    auto [fresh_model, fresh_optimizer] = amp::initialize(fresh, adam(fresh), options());
    model_bytes.seekg(0), optimizer_bytes.seekg(0);
    if (model_first) torch::load(fresh, model_bytes);
    torch::load(fresh_optimizer, optimizer_bytes);
    if (order == 1) torch::load(fresh, model_bytes);
    if (order == 2) {
      torch::serialize::InputArchive archive;
      archive.load_from(model_bytes);
      amp::load_weights(*fresh, archive);
    }
    const auto losses = train(fresh_model, fresh_optimizer, 6);
    for (size_t i = 0; i < losses.size(); ++i) EXPECT_TRUE(amp_test::bitwise_equal(losses[i], expected[i])) << "step " << i;
    const auto a = net->parameters(), b = fresh->parameters();
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(amp_test::bitwise_equal(a[i], b[i])) << "parameter " << i;
    const auto ma = amp::master_params(optimizer), mb = amp::master_params(fresh_optimizer);
    for (size_t i = 0; i < ma.size(); ++i) EXPECT_TRUE(amp_test::bitwise_equal(ma[i], mb[i])) << "master " << i;
  }
  if (!optimizer.properties().master_weights) return;
  // One changed element of a weight: its master takes the written value, the others keep their fp32 values.
  const auto master_before = amp::master_params(optimizer).front().detach().clone();
  const auto weight = net->parameters().front();
  {
    torch::NoGradGuard no_grad;
    weight.view(-1)[0].fill_(3.0);
  }
  const auto master_after = amp::master_params(optimizer).front().detach();
  EXPECT_EQ(master_after.view(-1)[0].item<float>(), 3.0f);
  EXPECT_TRUE(amp_test::bitwise_equal(master_after.view(-1).slice(0, 1), master_before.view(-1).slice(0, 1)));
  EXPECT_FALSE(amp_test::bitwise_equal(master_after.view(-1).slice(0, 1).to(weight.scalar_type()).to(torch::kFloat),
                                       master_after.view(-1).slice(0, 1)))
      << "the premise: the masters hold bits their rounded weights lack";
}

TEST_P(RealScriptsTest, InPlaceEditAfterInitializeIsKept) {
  torch::manual_seed(5);
  BackboneHead net = make_net();
  auto [model, optimizer] = amp::initialize(net, torch::optim::SGD(net->parameters(), 0.0), options());
  {
    torch::NoGradGuard no_grad;
    net->head->weight.mul_(0.5);
    net->backbone->parameters()[0].zero_();
  }
  const auto edited = snapshot(net->parameters());
  auto x = torch::randn({16, 8}, device());
  optimizer.zero_grad();
  {
    auto scaled = amp::scale_loss(model(x).pow(2).mean(), optimizer);
    scaled.backward();
  }
  optimizer.step();  // lr = 0
  const auto after = snapshot(net->parameters());
  for (size_t i = 0; i < edited.size(); ++i) EXPECT_TRUE(amp_test::bitwise_equal(edited[i], after[i])) << i;
}

TEST_P(RealScriptsTest, Fp32PretrainedWeightsLoadIntoCastModel) {
  const std::string path = ::testing::TempDir() + "amp_pretrained_" + GetParam().level + dtype_label(GetParam().dtype) +
                           amp_test::device_suffix(GetParam().device) + ".pt";
  torch::manual_seed(6);
  BackboneHead pretrained = make_net();
  torch::save(pretrained, path);
  auto x = torch::randn({32, 8}, device()), y = torch::randint(0, 4, {32}, torch::TensorOptions(device()).dtype(torch::kLong));

  BackboneHead reference = make_net();
  copy_weights(*reference, *pretrained);
  torch::optim::SGD ref_opt(reference->parameters(), 0.1);
  const auto ref_before = snapshot(reference->parameters());
  torch::nn::functional::cross_entropy(reference->forward(x), y).backward();
  ref_opt.step();

  BackboneHead net = make_net();
  auto [model, optimizer] = amp::initialize(net, torch::optim::SGD(net->parameters(), 0.1), options());
  amp::load_weights(*net, path);
  if (std::string(GetParam().level) == "O2") {  // the masters hold the fp32 checkpoint exactly
    const auto masters = amp::master_params(optimizer);
    const auto originals = pretrained->parameters();
    for (size_t i = 0; i < masters.size(); ++i) EXPECT_TRUE(amp_test::bitwise_equal(masters[i], originals[i])) << i;
  }
  const auto before = snapshot(net->parameters());
  {
    auto scaled = amp::scale_loss(torch::nn::functional::cross_entropy(model(x), y), optimizer);
    scaled.backward();
  }
  optimizer.step();
  expect_same_update(before, snapshot(net->parameters()), ref_before, snapshot(reference->parameters()),
                     GetParam().dtype, "pretrained");
  std::remove(path.c_str());
}

TEST_P(RealScriptsTest, TorchLoadOfFp32WeightsIntoCastModelFailsLoudly) {
  if (std::string(GetParam().level) == "O1") GTEST_SKIP() << "O1 keeps the model fp32: torch::load is right there";
  const std::string path = ::testing::TempDir() + "amp_fp32_" + GetParam().level + dtype_label(GetParam().dtype) +
                           amp_test::device_suffix(GetParam().device) + ".pt";
  torch::manual_seed(7);
  BackboneHead pretrained = make_net(), net = make_net();
  torch::save(pretrained, path);
  auto [model, optimizer] = amp::initialize(net, torch::optim::SGD(net->parameters(), 0.1), options());
  torch::load(net, path);  // reinterprets the fp32 bytes
  ASSERT_THROWS_WITH(model(torch::randn({4, 8}, device())), "holds the bytes of 128 float32 values");
  ASSERT_THROWS_WITH(model(torch::randn({4, 8}, device())), "amp::load_weights(*model, path)");
  ASSERT_THROWS_WITH(optimizer.step(), "an fp32 tensor was loaded into it with torch::load");
  amp::load_weights(*net, path);  // the right way repairs it
  EXPECT_NO_THROW(model(torch::randn({4, 8}, device())));
  std::remove(path.c_str());
}

TEST_P(RealScriptsTest, AdagradMatchesReference) {
  // LibTorch's Adagrad builds its state in its constructor; at O3 that state follows the parameters' cast.
  torch::manual_seed(8);
  BackboneHead reference = make_net(), net = make_net();
  copy_weights(*net, *reference);
  auto x = torch::randn({32, 8}, device()), y = torch::randint(0, 4, {32}, torch::TensorOptions(device()).dtype(torch::kLong));
  if (GetParam().dtype == torch::kHalf && std::string(GetParam().level) == "O3") {
    // Adagrad's default eps (1e-10) is 0 in float16 without masters: refused with the reason.
    BackboneHead other = make_net();
    ASSERT_THROWS_WITH(amp::initialize(other, torch::optim::Adagrad(other->parameters(), 0.05), options()),
                       "eps=1e-10 rounds to 0");
  }
  // eps 1: the first Adagrad step is lr * g / (|g| + eps), linear in g, so low-precision rounding of g
  // shows as rounding (with a tiny eps it is lr * sign(g), and gradients near 0 flip sign in bf16).
  torch::optim::Adagrad ref_opt(reference->parameters(), torch::optim::AdagradOptions(0.05).eps(1.0));
  auto [model, optimizer] =
      amp::initialize(net, torch::optim::Adagrad(net->parameters(), torch::optim::AdagradOptions(0.05).eps(1.0)), options());
  const auto ref_before = snapshot(reference->parameters());
  const auto before = snapshot(net->parameters());
  torch::nn::functional::cross_entropy(reference->forward(x), y).backward();
  ref_opt.step();
  {
    auto scaled = amp::scale_loss(torch::nn::functional::cross_entropy(model(x), y), optimizer);
    scaled.backward();
  }
  optimizer.step();
  expect_same_update(before, snapshot(net->parameters()), ref_before, snapshot(reference->parameters()),
                     GetParam().dtype, "Adagrad");
}

AMP_INSTANTIATE_FOR_LEVELS(RealScriptsTest, amp_test::level_cases({"O1", "O2", "O3"}));

TEST(RealScriptsTest, AdagradAtO0IsBitwisePlainLibTorch) {
  torch::manual_seed(9);
  BackboneHead reference, net;
  copy_weights(*net, *reference);
  auto x = torch::randn({32, 8}), y = torch::randint(0, 4, {32});
  torch::optim::Adagrad ref_opt(reference->parameters(), 0.05);
  auto [model, optimizer] = amp::initialize(net, torch::optim::Adagrad(net->parameters(), 0.05), amp::Options("O0").verbosity(0));
  for (int i = 0; i < 3; ++i) {
    ref_opt.zero_grad();
    torch::nn::functional::cross_entropy(reference->forward(x), y).backward();
    ref_opt.step();
    amp_test::train_step(model, optimizer, x, y);
  }
  for (size_t i = 0; i < net->parameters().size(); ++i) {
    EXPECT_TRUE(amp_test::bitwise_equal(net->parameters()[i], reference->parameters()[i])) << i;
  }
}

TEST(RealScriptsTest, SeparatelyInitializedOptimizersCannotShareALoss) {
  BackboneHead a, b;
  const auto options = amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0);
  auto [model_a, opt_a] = amp::initialize(a, torch::optim::SGD(a->parameters(), 0.1), options);
  auto [model_b, opt_b] = amp::initialize(b, torch::optim::SGD(b->parameters(), 0.1), options);
  auto x = torch::randn({4, 8});
  auto loss = model_a(x).sum() + model_b(x).sum();
  ASSERT_THROWS_WITH(amp::scale_loss(loss, {&opt_a, &opt_b}), "optimizer 1 was initialized separately from optimizer 0");
  ASSERT_THROWS_WITH(amp::scale_loss(loss, {&opt_a, &opt_a}), "optimizer 1 appears twice");
  ASSERT_THROWS_WITH(amp::scale_loss(loss, std::vector<amp::OptimizerBase*>{}), "the list of optimizers is empty");
  ASSERT_THROWS_WITH(amp::scale_loss(loss, {&opt_a, nullptr}), "optimizer 1 of the list is null");
}

TEST(RealScriptsTest, OneParameterInTwoOptimizersWithMastersIsRefused) {
  BackboneHead net;
  torch::optim::SGD all(net->parameters(), 0.1);
  torch::optim::SGD head(params_of(*net->head), 0.1);
  ASSERT_THROWS_WITH(amp::initialize(std::tuple(net), std::tuple(std::move(all), std::move(head)),
                                     amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0)),
                     "parameter 'head.weight' is already stepped by another amp::Optimizer with fp32 master weights");
}

TEST(RealScriptsTest, SecondLiveScaleLossHandleThrowsAndLosesNothing) {
  torch::manual_seed(10);
  BackboneHead net;
  auto [model, optimizer] =
      amp::initialize(net, torch::optim::SGD(net->parameters(), 0.1), amp::Options("O1").low_precision_dtype(torch::kBFloat16).verbosity(0));
  auto x = torch::randn({4, 8});
  {
    auto first = amp::scale_loss(model(x).sum(), optimizer);
    first.backward();
  }
  const auto accumulated = net->head->weight.grad().clone();
  auto pending = amp::scale_loss(model(x).sum(), optimizer);
  ASSERT_THROWS_WITH(amp::scale_loss(model(x).sum(), optimizer), "another amp::scale_loss handle of this optimizer is still open");
  ASSERT_THROWS_WITH(optimizer.step(), "an amp::scale_loss handle of this optimizer is still open");
  pending.backward();
  // The earlier gradients were kept and the second backward added to them.
  EXPECT_TRUE(torch::allclose(net->head->weight.grad(), accumulated * 2, 1e-5, 1e-6));
}

TEST(RealScriptsTest, ModelOnlyInitializeForInference) {
  torch::manual_seed(11);
  BackboneHead net;
  auto model = amp::initialize(net, amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0));
  EXPECT_EQ(net->head->weight.scalar_type(), torch::kBFloat16);
  torch::NoGradGuard no_grad;
  auto out = model(torch::randn({4, 8}));
  EXPECT_EQ(out.scalar_type(), torch::kFloat);
  ASSERT_THROWS_WITH(amp::initialize(net, amp::Options("O2").verbosity(0)), "has already been passed through amp::initialize");
}

TEST(RealScriptsTest, LoadWeightsChecksKeysAndShapesBeforeWriting) {
  const std::string path = ::testing::TempDir() + "amp_mlp.pt";
  amp_test::Mlp other(8, 16, 3);
  torch::save(other, path);
  BackboneHead net;
  const auto before = snapshot(net->parameters());
  ASSERT_THROWS_WITH(amp::load_weights(*net, path), "the checkpoint has no submodule 'backbone'");
  amp_test::Mlp mlp(8, 16, 4);
  ASSERT_THROWS_WITH(amp::load_weights(*mlp, path), "'fc2.weight' has shape [3, 16] in the checkpoint and [4, 16] in the model");
  ASSERT_THROWS_WITH(amp::load_weights(*mlp, "/nonexistent/dir/x.pt"), "cannot read '/nonexistent/dir/x.pt'");
  const auto after = snapshot(net->parameters());
  for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(amp_test::bitwise_equal(before[i], after[i]));
  std::remove(path.c_str());
}

TEST(RealScriptsTest, RecurrentLayerWithoutKernelIsReportedAtInitialize) {
  // oneDNN's CPU LSTM has no float16 primitive on CPUs without native fp16; autocast (O1) sends it there.
  SKIP_WITHOUT_CPU_KERNELS(torch::kHalf);
  RnnNet net;
  torch::optim::SGD sgd(net->parameters(), 0.1);
  try {
    auto [model, optimizer] = amp::initialize(net, std::move(sgd), amp::Options("O1").verbosity(0));
    // Where initialize accepts it, the forward and backward must run.
    model(torch::randn({3, 2, 8})).sum().backward();
  } catch (const std::exception& e) {
    const std::string message = amp_test::message(e);
    EXPECT_NE(message.find("the model has a LSTM layer ('rnn')"), std::string::npos) << message;
    EXPECT_NE(message.find("low_precision_dtype(torch::kBFloat16)"), std::string::npos) << message;
  }
}

}  // namespace
