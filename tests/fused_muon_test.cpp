// amp::optim::FusedMuon: torch.optim.Muon's single-tensor step bit for bit (tests/python/muon.py, run at test time),
// its state_dict both ways through PythonCheckpoint, its options and errors (torch's messages), flatten, and Muon under
// amp: the usual Muon + AdamW pair over one loss at every level, skipped steps, resume, O2's model copies,
// GradScaler's in-step unscale, the bf16 / 8-bit momentum formats, the sync-free step and ZeRO's refusal.
// Ported from PyTorch's test/optim (test_optim.py's OptimizerInfo for Muon: the error inputs of
// optim_error_inputs_func_muon, and the 2-D-only constraint); the numerics are compared with torch.optim.Muon itself.

#include <ATen/Parallel.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/modules/linear.h>
#include <torch/serialize.h>
#include <torch/version.h>

#include <cstdlib>
#include <filesystem>
#include <limits>
#include <optional>
#include <sstream>

#include "amp/amp.h"
#include "optim/fused_step_context.h"
#include "optim/optimizer_state_key.h"
#include "optim/state_format.h"
#include "scaling/device_scale.h"
#include "support/support.h"
#include "support/training.h"

namespace {

namespace fs = std::filesystem;
using amp::optim::FusedMuon;
using amp::optim::FusedMuonOptions;
using amp::optim::FusedMuonParamState;

const std::vector<std::vector<int64_t>> kMuonShapes = {{64, 32}, {32, 96}, {48, 48}};  // tests/python/muon.py's

const amp::PythonCheckpoint* muon_reference() {
  static const std::optional<amp::PythonCheckpoint> reference = []() -> std::optional<amp::PythonCheckpoint> {
    if (!amp_test::python_has_torch()) return std::nullopt;
    const auto dir = amp_test::run_python_reference(AMP_SOURCE_DIR "/tests/python/muon.py", "muon");
    if (dir.empty()) return std::nullopt;
    return amp::PythonCheckpoint::load((dir / "muon.pt").string());
  }();
  return reference ? &*reference : nullptr;
}

std::vector<torch::Tensor> muon_params(c10::ScalarType dtype) {
  torch::manual_seed(0);
  std::vector<torch::Tensor> params;
  for (const auto& shape : kMuonShapes) params.push_back(torch::randn(shape).to(dtype).requires_grad_());
  return params;
}

FusedMuon muon_for(const std::string& name, const std::vector<torch::Tensor>& params) {
  using torch::optim::OptimizerParamGroup;
  if (name == "default" || name == "holes") return FusedMuon(params, FusedMuonOptions(0.02));
  if (name == "plain_momentum") return FusedMuon(params, FusedMuonOptions(0.02).nesterov(false));
  if (name == "match_rms_adamw") {
    return FusedMuon(params, FusedMuonOptions(0.02).weight_decay(0.01).adjust_lr_fn("match_rms_adamw"));
  }
  if (name == "custom") {
    return FusedMuon(params, FusedMuonOptions(0.05).momentum(0.9).ns_coefficients({2.0, -1.5, 0.5}).ns_steps(3)
                                 .eps(1e-3).weight_decay(0.0));
  }
  // "groups"
  return FusedMuon({OptimizerParamGroup({params[0]}),
                    OptimizerParamGroup({params[1], params[2]}, std::make_unique<FusedMuonOptions>(
                                                                    FusedMuonOptions(0.05).adjust_lr_fn("match_rms_adamw")))},
                   FusedMuonOptions(0.02));
}

// Step k's gradients, as muon.py makes them.
void set_muon_grads(const std::string& name, std::vector<torch::Tensor>& params, int k, c10::ScalarType dtype) {
  torch::manual_seed(100 + k);
  for (auto& p : params) p.mutable_grad() = (torch::randn(p.sizes()) * 0.01).to(dtype);
  if (name == "holes" && k == 0) params[2].mutable_grad() = torch::zeros_like(params[2]);
  if (name == "holes" && k == 1) params[1].mutable_grad() = torch::Tensor();
}

const torch::Tensor& momentum_of(FusedMuon& muon, const torch::Tensor& p) {
  return static_cast<FusedMuonParamState&>(*muon.state().at(amp::detail::state_key(muon.state(), p))).momentum_buffer();
}

// muon.py runs on one thread; the C++ side does too while alive (and gives the others theirs back).
class OneThreadGuard {
 public:
  OneThreadGuard() : before_(at::get_num_threads()) { at::set_num_threads(1); }
  ~OneThreadGuard() { at::set_num_threads(before_); }
  OneThreadGuard(const OneThreadGuard&) = delete;
  OneThreadGuard& operator=(const OneThreadGuard&) = delete;

 private:
  int before_;
};

bool muon_reference_usable(const amp::PythonCheckpoint& reference) {
  const std::string version = reference.get("torch_version").toStringRef();
  return version.substr(0, version.find('+')) == TORCH_VERSION;
}

}  // namespace

TEST(FusedMuonPythonTest, EveryOptionIsTorchOptimMuonBitwise) {
  const amp::PythonCheckpoint* reference = muon_reference();
  if (reference == nullptr) GTEST_SKIP() << "needs Python with the torch wheel (AMP_PYTHON)";
  if (!muon_reference_usable(*reference)) GTEST_SKIP() << "Python's torch is not this build's";
  const OneThreadGuard one_thread;
  for (const auto dtype : {torch::kFloat, torch::kBFloat16}) {
    for (const std::string name : {"default", "plain_momentum", "match_rms_adamw", "custom", "holes", "groups"}) {
      // torch divides a bf16 parameter's buffer in place without nesterov (BufferOfBf16ParametersWithoutNesterov).
      if (dtype == torch::kBFloat16 && name == "plain_momentum") continue;
      const std::string key = name + (dtype == torch::kFloat ? "_float32" : "_bfloat16");
      SCOPED_TRACE(key);
      auto params = muon_params(dtype);
      FusedMuon muon = muon_for(name, params);
      for (int k = 0; k < 5; ++k) {
        set_muon_grads(name, params, k, dtype);
        muon.step();
      }
      for (size_t i = 0; i < params.size(); ++i) {
        EXPECT_TRUE(amp_test::bitwise_equal(params[i].detach(), reference->get(key + "_p" + std::to_string(i)).toTensor()))
            << "parameter " << i;
        EXPECT_TRUE(amp_test::bitwise_equal(momentum_of(muon, params[i]), reference->get(key + "_buf" + std::to_string(i)).toTensor()))
            << "momentum buffer " << i;
      }
    }
  }
}

TEST(FusedMuonTest, BufferOfBf16ParametersWithoutNesterov) {
  // torch.optim.Muon's `grad.bfloat16()` is the buffer itself for a bf16 parameter, and its `div_` then normalizes
  // the momentum buffer in place (nesterov=False only). amp orthogonalizes a copy: the buffer is momentum's lerp.
  auto params = muon_params(torch::kBFloat16);
  FusedMuon muon(params, FusedMuonOptions(0.02).nesterov(false));
  set_muon_grads("plain_momentum", params, 0, torch::kBFloat16);
  muon.step();
  for (const auto& p : params) {
    EXPECT_TRUE(amp_test::bitwise_equal(momentum_of(muon, p), torch::zeros_like(p).lerp(p.grad(), 1 - 0.95)));
  }
}

TEST(FusedMuonPythonTest, StateDictLoadsIntoTorchOptimMuonAndBack) {
  if (!amp_test::python_has_torch()) GTEST_SKIP() << "needs Python with the torch wheel (AMP_PYTHON)";
  const amp::PythonCheckpoint* reference = muon_reference();
  ASSERT_NE(reference, nullptr);
  if (!muon_reference_usable(*reference)) GTEST_SKIP() << "Python's torch is not this build's";
  const OneThreadGuard one_thread;
  // C++ takes 2 steps of the two-group case and writes torch.optim.Muon's state_dict; Python loads it and takes
  // steps 2-4; C++ reads Python's state_dict back. Every value equals the C++ run that never stopped.
  auto params = muon_params(torch::kFloat);
  FusedMuon muon = muon_for("groups", params);
  for (int k = 0; k < 2; ++k) {
    set_muon_grads("groups", params, k, torch::kFloat);
    muon.step();
  }
  const fs::path dir = fs::path(::testing::TempDir()) / ("amp_muon_ckpt_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  amp::PythonCheckpoint out;
  out.put_optimizer("optimizer", muon);
  for (size_t i = 0; i < params.size(); ++i) out.put("p" + std::to_string(i), params[i].detach().clone());
  out.save((dir / "cpp.pt").string());
  const std::string command = amp_test::python_interpreter() + " '" AMP_SOURCE_DIR "/tests/python/muon.py' resume '" +
                              dir.string() + "' > '" + (dir / "python.log").string() + "' 2>&1";
  ASSERT_EQ(std::system(command.c_str()), 0) << command << "; see " << (dir / "python.log");
  for (int k = 2; k < 5; ++k) {
    set_muon_grads("groups", params, k, torch::kFloat);
    muon.step();
  }
  const auto resumed = amp::PythonCheckpoint::load((dir / "resumed.pt").string());
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(amp_test::bitwise_equal(params[i].detach(), resumed.get("p" + std::to_string(i)).toTensor())) << i;
  }
  // Python's own state_dict into a fresh C++ optimizer built with other options: Python's hyperparameters and buffers.
  auto fresh_params = muon_params(torch::kFloat);
  FusedMuon fresh(fresh_params, FusedMuonOptions(0.5).ns_steps(2));
  fresh.add_param_group(torch::optim::OptimizerParamGroup({}));
  fresh.param_groups()[0].params() = {fresh_params[0]};
  fresh.param_groups()[1].params() = {fresh_params[1], fresh_params[2]};
  resumed.load_optimizer(fresh);
  const auto& o1 = static_cast<const FusedMuonOptions&>(fresh.param_groups()[1].options());
  EXPECT_EQ(o1.lr(), 0.05);
  EXPECT_EQ(o1.ns_steps(), 5);
  EXPECT_EQ(o1.adjust_lr_fn(), "match_rms_adamw");
  EXPECT_EQ(o1.ns_coefficients(), (std::vector<double>{3.4445, -4.7750, 2.0315}));
  EXPECT_EQ(static_cast<const FusedMuonOptions&>(fresh.param_groups()[0].options()).adjust_lr_fn(), "original");
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(amp_test::bitwise_equal(momentum_of(fresh, fresh_params[i]), momentum_of(muon, params[i]))) << i;
  }
  fs::remove_all(dir);
}

TEST(FusedMuonTest, DefaultsAreTorchsAndBadInputNamesTheFix) {
  const FusedMuonOptions o;
  EXPECT_EQ(o.lr(), 1e-3);
  EXPECT_EQ(o.weight_decay(), 0.1);
  EXPECT_EQ(o.momentum(), 0.95);
  EXPECT_TRUE(o.nesterov());
  EXPECT_EQ(o.ns_coefficients(), (std::vector<double>{3.4445, -4.7750, 2.0315}));
  EXPECT_EQ(o.eps(), 1e-7);
  EXPECT_EQ(o.ns_steps(), 5);
  EXPECT_EQ(o.adjust_lr_fn(), "original");
  EXPECT_FALSE(o.flatten());

  const std::vector<torch::Tensor> w = {torch::randn({4, 3}, torch::requires_grad())};
  ASSERT_THROWS_WITH(FusedMuon(w, FusedMuonOptions(-1.0)), "Learning rate should be >= 0 but is: -1");
  ASSERT_THROWS_WITH(FusedMuon(w, FusedMuonOptions().momentum(-0.5)), "momentum should be >= 0 but is: -0.5");
  ASSERT_THROWS_WITH(FusedMuon(w, FusedMuonOptions().weight_decay(-0.1)), "weight decay should be >= 0 but is: -0.1");
  ASSERT_THROWS_WITH(FusedMuon(w, FusedMuonOptions().adjust_lr_fn("rms")),
                     "Adjust learning rate function rms is not supported (param group 0). Use adjust_lr_fn \"original\"");
  ASSERT_THROWS_WITH(FusedMuon(w, FusedMuonOptions().ns_steps(100)), "Number of steps must be less than 100");
  ASSERT_THROWS_WITH(FusedMuon(w, FusedMuonOptions().ns_steps(-1)), "ns_steps is -1 in param group 0; use ns_steps >= 0");
  ASSERT_THROWS_WITH(FusedMuon(w, FusedMuonOptions().ns_coefficients({1.0, 2.0})),
                     "Coefficients must be a tuple of exactly 3 values; ns_coefficients has 2");
  ASSERT_THROWS_WITH(FusedMuon(w, FusedMuonOptions().eps(-1.0)), "eps is -1 in param group 0; use eps >= 0");
  ASSERT_THROWS_WITH(FusedMuon(std::vector<torch::Tensor>{torch::randn({3}, torch::requires_grad())}),
                     "Muon only supports 2D parameters whereas we found a parameter with size: [3] (parameter 0 of "
                     "param group 0). Give biases");
  ASSERT_THROWS_WITH(FusedMuon(std::vector<torch::Tensor>{torch::randn({8, 3, 3, 3}, torch::requires_grad())}),
                     "size: [8, 3, 3, 3] (parameter 0 of param group 0). Set FusedMuonOptions::flatten(true)");
  ASSERT_THROWS_WITH(FusedMuon(std::vector<torch::Tensor>{torch::randn({2, 2}, torch::kComplexFloat).requires_grad_()}),
                     "Muon does not support complex parameters");
  // A group added later is checked with its own options.
  FusedMuon muon(w);
  ASSERT_THROWS_WITH(muon.add_param_group(torch::optim::OptimizerParamGroup({torch::randn({5}, torch::requires_grad())})),
                     "size: [5] (parameter 0 of param group 1)");
  // Options broken after construction, or a sparse gradient: the step throws before it writes anything.
  w[0].mutable_grad() = torch::randn({4, 3});
  const auto before = w[0].detach().clone();
  static_cast<FusedMuonOptions&>(muon.param_groups()[0].options()).ns_steps(200);
  ASSERT_THROWS_WITH(muon.step(), "ns_steps is 200 in param group 0");
  static_cast<FusedMuonOptions&>(muon.param_groups()[0].options()).ns_steps(5);
  w[0].mutable_grad() = torch::randn({4, 3}).to_sparse();
  ASSERT_THROWS_WITH(muon.step(), "amp::optim::FusedMuon does not support sparse gradients");
  EXPECT_TRUE(amp_test::bitwise_equal(w[0].detach(), before));
  EXPECT_TRUE(muon.state().empty());
}

TEST(FusedMuonTest, FlattenOrthogonalizesAConvKernelAsOutByRest) {
  // With flatten, an [8, 3, 3, 3] kernel steps exactly as the [8, 27] matrix of its values (the lr adjusted for
  // [8, 27]: sqrt(max(1, 8 / 27)) = 1).
  torch::manual_seed(3);
  auto kernel = torch::randn({8, 3, 3, 3}).requires_grad_();
  auto matrix = kernel.detach().reshape({8, 27}).clone().requires_grad_();
  FusedMuon a(std::vector<torch::Tensor>{kernel}, FusedMuonOptions(0.02).flatten(true));
  FusedMuon b(std::vector<torch::Tensor>{matrix}, FusedMuonOptions(0.02).adjust_lr_fn("match_rms_adamw"));
  static_cast<FusedMuonOptions&>(b.param_groups()[0].options()).adjust_lr_fn("original");
  for (int k = 0; k < 3; ++k) {
    const auto g = torch::randn({8, 3, 3, 3}) * 0.01;
    kernel.mutable_grad() = g;
    matrix.mutable_grad() = g.reshape({8, 27});
    a.step();
    b.step();
  }
  EXPECT_TRUE(amp_test::bitwise_equal(kernel.detach().reshape({8, 27}), matrix.detach()));
  EXPECT_EQ(momentum_of(a, kernel).sizes(), kernel.sizes());
}

namespace {

// The usual Muon recipe's network: hidden 2-D weights (fc2's 64 x 64 = 4096 values take 8-bit moments) for Muon,
// the first layer's bias and the head for AdamW.
struct MuonNetImpl : torch::nn::Module {
  MuonNetImpl()
      : fc1(register_module("fc1", torch::nn::Linear(8, 64))),
        fc2(register_module("fc2", torch::nn::Linear(torch::nn::LinearOptions(64, 64).bias(false)))),
        head(register_module("head", torch::nn::Linear(64, 4))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return head(torch::nn::functional::relu(fc2(torch::nn::functional::relu(fc1(x)))));
  }
  std::vector<torch::Tensor> hidden() const { return {fc1->weight, fc2->weight}; }
  std::vector<torch::Tensor> rest() const { return {fc1->bias, head->weight, head->bias}; }
  torch::nn::Linear fc1, fc2, head;
};
TORCH_MODULE(MuonNet);

struct MuonPair {
  MuonNet net;
  FusedMuon muon;
  amp::optim::FusedAdamW adamw;
};

MuonPair muon_pair(const torch::Device& device = torch::kCPU) {
  torch::manual_seed(0);
  MuonNet net;
  net->to(device);
  return {net, FusedMuon(net->hidden(), FusedMuonOptions(0.02)),
          amp::optim::FusedAdamW(net->rest(), torch::optim::AdamWOptions(3e-3).eps(1e-4))};  // eps: fp16 state at O3
}

// One step of the pair on one loss; returns the loss.
template <class Model, class Muon, class AdamW>
double pair_step(Model& model, Muon& muon, AdamW& adamw, const torch::Tensor& x, const torch::Tensor& y,
                 double loss_factor = 1.0) {
  muon.zero_grad();
  adamw.zero_grad();
  const auto loss = torch::nn::functional::cross_entropy(model(x), y);
  amp::scale_loss(loss * loss_factor, std::vector<amp::OptimizerBase*>{&muon, &adamw}).backward();
  muon.step();
  adamw.step();
  return loss.template item<double>();
}

}  // namespace

class FusedMuonLevelTest : public amp_test::LevelTest {};

TEST_P(FusedMuonLevelTest, MuonAndAdamWOnOneLossTrainSkipAndResumeBitwise) {
  const auto data = amp_test::blobs(64, 8, 4, 5);
  const torch::Tensor x = data.first.to(device()), y = data.second.to(device());
  auto pair = muon_pair(device());
  auto [models, optimizers] = amp::initialize(std::make_tuple(pair.net), std::make_tuple(std::move(pair.muon),
                                              std::move(pair.adamw)), options());
  auto& model = std::get<0>(models);
  auto& muon = std::get<0>(optimizers);
  auto& adamw = std::get<1>(optimizers);
  double first;
  {
    torch::NoGradGuard no_grad;
    first = torch::nn::functional::cross_entropy(model(x), y).item<double>();
  }
  double last = first;
  for (int s = 0; s < 30; ++s) last = pair_step(model, muon, adamw, x, y);
  EXPECT_LT(last, first * 0.5) << "Muon + AdamW must train at " << GetParam().level;

  if (muon.properties().loss_scale.is_dynamic()) {  // an overflow: both steps skipped, nothing changes
    std::vector<torch::Tensor> before;
    for (const auto& p : muon.master_params()) before.push_back(p.detach().clone());
    std::vector<torch::Tensor> buffers;
    for (const auto& p : muon.param_groups()[0].params()) {
      buffers.push_back(momentum_of(muon, p).clone());
    }
    pair_step(model, muon, adamw, x, y, std::numeric_limits<double>::infinity());
    EXPECT_EQ(muon.skipped_steps(), 1);
    EXPECT_EQ(adamw.skipped_steps(), 1);
    const auto after = muon.master_params();
    for (size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(amp_test::bitwise_equal(after[i].detach(), before[i])) << i;
    const auto& params = muon.param_groups()[0].params();
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(amp_test::bitwise_equal(momentum_of(muon, params[i]), buffers[i]));
    }
  }

  // torch::save after 3 steps, load into a fresh initialize, 3 more: bitwise the run that never stopped.
  auto run = [&](std::stringstream* save_model, std::stringstream* save_muon, std::stringstream* save_adamw,
                 bool load) {
    auto p = muon_pair(device());
    auto [ms, os] = amp::initialize(std::make_tuple(p.net), std::make_tuple(std::move(p.muon), std::move(p.adamw)),
                                    options());
    auto& m = std::get<0>(ms);
    auto& mu = std::get<0>(os);
    auto& ad = std::get<1>(os);
    if (load) {
      torch::load(p.net, *save_model);
      torch::load(mu, *save_muon);
      torch::load(ad, *save_adamw);
    } else {
      for (int s = 0; s < 3; ++s) pair_step(m, mu, ad, x, y);
      torch::save(p.net, *save_model);
      torch::save(mu, *save_muon);
      torch::save(ad, *save_adamw);
    }
    for (int s = 0; s < 3; ++s) pair_step(m, mu, ad, x, y);
    return p.net->parameters();
  };
  std::stringstream model_bytes, muon_bytes, adamw_bytes;
  const auto straight = run(&model_bytes, &muon_bytes, &adamw_bytes, false);
  const auto resumed = run(&model_bytes, &muon_bytes, &adamw_bytes, true);
  for (size_t i = 0; i < straight.size(); ++i) EXPECT_TRUE(amp_test::bitwise_equal(straight[i], resumed[i])) << i;
}

AMP_INSTANTIATE_FOR_LEVELS(FusedMuonLevelTest, amp_test::level_cases({"O0", "O1", "O2", "O3"}, /*o0_once=*/true));

TEST(FusedMuonTest, O2StepsTheMastersAndWritesTheModelCopy) {
  // At O2 Muon steps the fp32 masters: the same values as FusedMuon on fp32 copies with the masters' gradients, and
  // the model holds each master rounded.
  for (const auto dtype : amp_test::low_precision_dtypes()) {
    if (!amp_test::cpu_computes(dtype)) continue;
    auto pair = muon_pair();
    auto [models, optimizers] = amp::initialize(std::make_tuple(pair.net), std::make_tuple(std::move(pair.muon),
                                                std::move(pair.adamw)), amp::Options("O2").low_precision_dtype(dtype).verbosity(0));
    auto& muon = std::get<0>(optimizers);
    const auto [x, y] = amp_test::blobs(16, 8, 4, 1);
    std::vector<torch::Tensor> masters_before;
    for (const auto& m : muon.master_params()) masters_before.push_back(m.detach().clone().requires_grad_());
    auto& model = std::get<0>(models);
    muon.zero_grad();
    std::get<1>(optimizers).zero_grad();
    amp::scale_loss(torch::nn::functional::cross_entropy(model(x), y),
                    std::vector<amp::OptimizerBase*>{&muon, &std::get<1>(optimizers)}).backward();
    const auto masters = muon.master_params();
    for (size_t i = 0; i < masters.size(); ++i) masters_before[i].mutable_grad() = masters[i].grad().clone();
    muon.step();
    FusedMuon reference(masters_before, FusedMuonOptions(0.02));
    reference.step();
    for (size_t i = 0; i < masters.size(); ++i) {
      EXPECT_TRUE(amp_test::bitwise_equal(masters[i].detach(), masters_before[i].detach())) << i;
      EXPECT_EQ(pair.net->hidden()[i].scalar_type(), dtype);
      EXPECT_TRUE(amp_test::bitwise_equal(pair.net->hidden()[i].detach(), masters[i].detach().to(dtype)));
    }
  }
}

TEST(FusedMuonTest, GradScalerInStepUnscaleIsUnscaleThenStep) {
  auto run = [](bool unscale_first) {
    auto pair = muon_pair();
    amp::GradScaler scaler(amp::GradScalerOptions().init_scale(256.0));
    const auto [x, y] = amp_test::blobs(16, 8, 4, 2);
    for (int s = 0; s < 3; ++s) {
      pair.muon.zero_grad();
      torch::Tensor loss;
      {
        amp::AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
        loss = torch::nn::functional::cross_entropy(pair.net->forward(x), y);
      }
      scaler.scale(loss).backward();
      if (unscale_first) scaler.unscale_(pair.muon);
      scaler.step(pair.muon);
      scaler.update();
    }
    std::vector<torch::Tensor> out;
    for (const auto& p : pair.net->hidden()) {
      out.push_back(p.detach().clone());
      out.push_back(p.grad().clone());
    }
    return out;
  };
  const auto inside = run(false), outside = run(true);
  for (size_t i = 0; i < inside.size(); ++i) EXPECT_TRUE(amp_test::bitwise_equal(inside[i], outside[i])) << i;
}

TEST(FusedMuonTest, Bf16And8BitMomentumStepFromTheDecodedBuffer) {
  // The step decodes the buffer to fp32, steps as fp32 and encodes it back: the parameter after a step equals an
  // fp32 FusedMuon's from the same parameter and the decoded buffer, bitwise; the buffer is stored in the format.
  for (const auto format : {amp::OptimizerStateFormat::kBf16, amp::OptimizerStateFormat::k8Bit}) {
    SCOPED_TRACE(static_cast<int>(format));
    torch::manual_seed(5);
    auto p = torch::randn({64, 64}).requires_grad_();
    FusedMuon stored(std::vector<torch::Tensor>{p}, FusedMuonOptions(0.02));
    stored.step_context().set_state_format(std::make_shared<amp::detail::StateFormat>(format, /*seed=*/7));
    for (int k = 0; k < 2; ++k) {
      p.mutable_grad() = torch::randn({64, 64}) * 0.01;
      stored.step();
    }
    const torch::Tensor& buffer = momentum_of(stored, p);
    EXPECT_EQ(buffer.scalar_type(), format == amp::OptimizerStateFormat::kBf16 ? torch::kBFloat16 : torch::kByte);
    auto q = p.detach().clone().requires_grad_();
    FusedMuon fp32(std::vector<torch::Tensor>{q}, FusedMuonOptions(0.02));
    p.mutable_grad() = torch::randn({64, 64}) * 0.01;
    q.mutable_grad() = p.grad().clone();
    fp32.step();  // creates a zero buffer; replace it by the decoded one and step again from the same start
    q.detach().copy_(p.detach());
    const_cast<torch::Tensor&>(momentum_of(fp32, q)) =
        amp::detail::decode_moment(buffer, p.sizes(), amp::detail::Moment::kSigned);
    stored.step();
    fp32.step();
    EXPECT_TRUE(amp_test::bitwise_equal(p.detach(), q.detach()));
  }
}

TEST(FusedMuonTest, ASkipOnlyTheDeviceKnowsChangesNothingAndWaitsForNothing) {
  // O2 bf16 with a dynamic scale, steps 0-4 with step 3 overflowing: no host sync in any step (Muon keeps no step
  // count), the same values whether the CPU behaves as a device that never finishes or as the host deciding; with
  // fp32, bf16 and 8-bit momentum (NOTE [Stored moments on the device]).
  auto run = [](bool deferred, amp::OptimizerStateFormat format) {
    auto pair = muon_pair();
    auto [models, optimizers] = amp::initialize(
        std::make_tuple(pair.net), std::make_tuple(std::move(pair.muon)),
        amp::Options("O2").low_precision_dtype(torch::kBFloat16).loss_scale(amp::LossScale::dynamic())
            .optimizer_state_format(format).verbosity(0));
    auto& model = std::get<0>(models);
    auto& muon = std::get<0>(optimizers);
    const auto [x, y] = amp_test::blobs(16, 8, 4, 3);
    std::optional<amp::detail::DeferredHostReadsGuard> guard;
    if (deferred) guard.emplace();
    std::vector<int64_t> syncs;
    for (int s = 0; s < 5; ++s) {
      const int64_t before = amp::host_sync_count(muon);
      amp_test::train_step(model, muon, x, y,
                           amp_test::StepOptions().loss_factor(s == 3 ? std::numeric_limits<double>::infinity() : 1.0));
      syncs.push_back(amp::host_sync_count(muon) - before);
    }
    guard.reset();
    EXPECT_EQ(muon.skipped_steps(), 1);
    EXPECT_EQ(syncs, (std::vector<int64_t>{0, 0, 0, 0, 0}));
    std::vector<torch::Tensor> out;
    for (const auto& m : muon.master_params()) out.push_back(m.detach().clone());
    return out;
  };
  for (const auto format : {amp::OptimizerStateFormat::kFp32, amp::OptimizerStateFormat::kBf16,
                            amp::OptimizerStateFormat::k8Bit}) {
    SCOPED_TRACE(std::string(amp::to_string(format)) + " momentum");
    const auto device_path = run(true, format), host_path = run(false, format);
    for (size_t i = 0; i < device_path.size(); ++i) {
      EXPECT_TRUE(amp_test::bitwise_equal(device_path[i], host_path[i])) << i;
    }
  }
}

TEST(FusedMuonTest, StepsUnderGraphCaptureGuardGiveTheHostPathsBits) {
  // Under the guard (without a capture: the host code a capture records) the flag and the scale stay on the device
  // and the host reads nothing; the result is the host path's, bit for bit (as GraphCaptureGuardTest for FusedAdamW),
  // with fp32, bf16 and 8-bit momentum.
  struct Outcome {
    std::vector<torch::Tensor> params;
    double loss_scale = 0;
    int64_t skipped = 0, syncs = -1;
  };
  auto run = [](bool guarded, amp::OptimizerStateFormat format) {
    auto pair = muon_pair();
    auto [models, optimizers] = amp::initialize(
        std::make_tuple(pair.net), std::make_tuple(std::move(pair.muon)),
        amp::Options("O2").low_precision_dtype(torch::kBFloat16).growth_interval(3).optimizer_state_format(format)
            .verbosity(0));
    auto& model = std::get<0>(models);
    auto& muon = std::get<0>(optimizers);
    const auto [x, y] = amp_test::blobs(32, 8, 4, 4);
    amp_test::train_step(model, muon, x, y);  // the warm-up
    Outcome out;
    {
      std::optional<amp::GraphCaptureGuard> capture;
      if (guarded) capture.emplace(muon);
      const int64_t before = amp::host_sync_count(muon);
      for (const double factor : {1.0, std::numeric_limits<double>::infinity(), 1.0, 1.0, 1.0,
                                  std::numeric_limits<double>::infinity(), 1.0}) {
        amp_test::train_step(model, muon, x, y, amp_test::StepOptions().loss_factor(factor));
      }
      out.syncs = amp::host_sync_count(muon) - before;
    }
    for (const auto& p : model->parameters()) out.params.push_back(p.detach().clone());
    out.loss_scale = amp::loss_scale(muon);
    out.skipped = muon.skipped_steps();
    return out;
  };
  for (const auto format : {amp::OptimizerStateFormat::kFp32, amp::OptimizerStateFormat::kBf16,
                            amp::OptimizerStateFormat::k8Bit}) {
    SCOPED_TRACE(std::string(amp::to_string(format)) + " momentum");
    const Outcome host = run(false, format), graph = run(true, format);
    EXPECT_EQ(graph.syncs, 0);
    EXPECT_EQ(host.skipped, 2);
    EXPECT_EQ(graph.skipped, host.skipped);
    EXPECT_EQ(graph.loss_scale, host.loss_scale);
    for (size_t i = 0; i < host.params.size(); ++i) {
      EXPECT_TRUE(amp_test::bitwise_equal(graph.params[i], host.params[i])) << i;
    }
  }
}

TEST(FusedMuonTest, MomentumFormatsTrainAndSkipAtO2AndO3) {
  // bf16 and 8-bit momentum through amp::initialize (fc2's 64 x 64 = 4096 values take 8-bit blocks; fc1's 64 x 8 stays
  // in fp32): the pair trains, the buffers have the format's representation, and an overflow leaves them as they were.
  const auto [x, y] = amp_test::blobs(64, 8, 4, 5);
  for (const char* level : {"O2", "O3"}) {
    for (const auto format : {amp::OptimizerStateFormat::kBf16, amp::OptimizerStateFormat::k8Bit}) {
      SCOPED_TRACE(std::string(level) + " " + amp::to_string(format));
      auto pair = muon_pair();
      auto [models, optimizers] = amp::initialize(
          std::make_tuple(pair.net), std::make_tuple(std::move(pair.muon), std::move(pair.adamw)),
          amp::Options(level).low_precision_dtype(torch::kBFloat16).loss_scale(amp::LossScale::dynamic())
              .optimizer_state_format(format).verbosity(0));
      auto& model = std::get<0>(models);
      auto& muon = std::get<0>(optimizers);
      auto& adamw = std::get<1>(optimizers);
      const double first = pair_step(model, muon, adamw, x, y);
      double last = first;
      for (int s = 0; s < 30; ++s) last = pair_step(model, muon, adamw, x, y);
      EXPECT_LT(last, first * 0.5);
      const auto& fc2_key = muon.param_groups()[0].params()[1];
      const torch::Tensor& stored = momentum_of(muon, fc2_key);
      EXPECT_EQ(stored.scalar_type(), format == amp::OptimizerStateFormat::kBf16 ? torch::kBFloat16 : torch::kByte);
      std::vector<torch::Tensor> buffers, weights;
      for (const auto& p : muon.param_groups()[0].params()) {
        buffers.push_back(momentum_of(muon, p).clone());
        weights.push_back(p.detach().clone());
      }
      pair_step(model, muon, adamw, x, y, std::numeric_limits<double>::infinity());
      EXPECT_EQ(muon.skipped_steps(), 1);
      const auto& params = muon.param_groups()[0].params();
      for (size_t i = 0; i < params.size(); ++i) {
        EXPECT_TRUE(amp_test::bitwise_equal(momentum_of(muon, params[i]), buffers[i])) << i;
        EXPECT_TRUE(amp_test::bitwise_equal(params[i].detach(), weights[i])) << i;
      }
    }
  }
}
