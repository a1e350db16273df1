// The precision policy (amp/precision_policy.h): fp32 islands by module name and type, at every level.

#include <ATen/record_function.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "amp/amp.h"
#include "interception/interception.h"
#include "options/format.h"
#include "support/models.h"
#include "support/support.h"

namespace {

// stem -> two blocks (fc, norm, relu) -> head: the shape of a transformer's residual-free skeleton.
struct PolicyBlockImpl : torch::nn::Module {
  PolicyBlockImpl()
      : fc(register_module("fc", torch::nn::Linear(16, 16))),
        norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({16})))) {}
  torch::Tensor forward(const torch::Tensor& x) { return torch::relu(norm(fc(x))); }
  torch::nn::Linear fc;
  torch::nn::LayerNorm norm;
};
TORCH_MODULE(PolicyBlock);

struct PolicyNetImpl : torch::nn::Module {
  PolicyNetImpl()
      : stem(register_module("stem", torch::nn::Linear(8, 16))),
        blocks(register_module("blocks", torch::nn::Sequential(PolicyBlock(), PolicyBlock()))),
        head(register_module("head", torch::nn::Linear(16, 4))) {}
  torch::Tensor forward(const torch::Tensor& x) { return head(blocks->forward(stem(x))); }
  torch::nn::Linear stem;
  torch::nn::Sequential blocks;
  torch::nn::Linear head;
};
TORCH_MODULE(PolicyNet);

PolicyNet policy_net(c10::DeviceType device) {
  torch::manual_seed(7);
  PolicyNet net;
  net->to(device);
  return net;
}

// The net's forward written by hand with the policy's casts: GEMMs of ordinary layers in `lp` (the weights as
// the level holds them: cast copies of the fp32 values), the kept LayerNorms and head in fp32 on fp32 inputs.
torch::Tensor policy_reference(const std::map<std::string, torch::Tensor>& w, const torch::Tensor& x,
                               c10::ScalarType lp) {
  auto low = [&](const std::string& name, const torch::Tensor& h) {
    return torch::nn::functional::linear(h.to(lp), w.at(name + ".weight"), w.at(name + ".bias"));
  };
  torch::Tensor h = low("stem", x);
  for (const char* block : {"blocks.0", "blocks.1"}) {
    h = low(std::string(block) + ".fc", h);
    h = torch::layer_norm(h.to(torch::kFloat), {16}, w.at(std::string(block) + ".norm.weight"),
                          w.at(std::string(block) + ".norm.bias"));
    h = torch::relu(h);
  }
  return torch::nn::functional::linear(h.to(torch::kFloat), w.at("head.weight"), w.at("head.bias"));
}

bool policy_kept(const std::string& name) { return name.rfind("head", 0) == 0 || name.find("norm") != std::string::npos; }

// Leaves of the reference: kept weights fp32, the others as the level holds them (lp at O2/O3; at O1 fp32
// leaves, cast where used, as autocast does).
std::map<std::string, torch::Tensor> policy_leaves(const PolicyNet& fp32_net, const char* level, c10::ScalarType lp) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& item : fp32_net->named_parameters()) {
    torch::Tensor t = item.value().detach().clone();
    if (!policy_kept(item.key()) && std::string(level) != "O1") t = t.to(lp);
    if (!policy_kept(item.key()) && std::string(level) == "O1") {
      out[item.key()] = t.requires_grad_();  // cast below, inside the graph
      continue;
    }
    out[item.key()] = t.requires_grad_();
  }
  return out;
}

// Records the output dtype of each aten::addmm (LibTorch's Linear on 2-d inputs) and aten::layer_norm call (RecordFunction sees the op as called,
// before any dispatch key).
class PolicyOpRecorder {
 public:
  PolicyOpRecorder() {
    // Outermost calls only: O1's autocast kernel calls the op again after casting.
    handle_ = at::addThreadLocalCallback(
        at::RecordFunctionCallback(
            [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
              if (recorded(fn.name())) ++depth();
              return nullptr;
            },
            [](const at::RecordFunction& fn, at::ObserverContext*) {
              if (!recorded(fn.name()) || --depth() > 0) return;
              const auto outputs = fn.outputs();
              if (!outputs.empty() && outputs[0].isTensor()) {
                records().push_back({fn.name(), outputs[0].toTensor().scalar_type()});
              }
            })
            .needsOutputs(true)
            .scopes({at::RecordScope::FUNCTION}));
    records().clear();
    depth() = 0;
  }
  ~PolicyOpRecorder() { at::removeCallback(handle_); }
  static std::vector<std::pair<std::string, c10::ScalarType>>& records() {
    static thread_local std::vector<std::pair<std::string, c10::ScalarType>> r;
    return r;
  }

 private:
  static bool recorded(const std::string& name) { return name == "aten::addmm" || name == "aten::layer_norm"; }
  static int& depth() {
    static thread_local int d = 0;
    return d;
  }
  at::CallbackHandle handle_;
};

class PrecisionPolicyLevelTest : public amp_test::LevelTest {};

TEST_P(PrecisionPolicyLevelTest, KeptModulesComputeInFp32AndTheRestAsTheLevelSays) {
  const auto [level, lp, device] = GetParam();
  const bool o0 = std::string(level) == "O0";
  PolicyNet net = policy_net(device);
  PolicyNet fp32_net = policy_net(device);  // same seed: the same initial values
  auto model = amp::initialize(net, options().keep_fp32({"head", "*.norm"}));

  // Parameters: kept ones stay fp32 at every level; the rest follow the level.
  for (const auto& item : net->named_parameters()) {
    const bool low = !o0 && std::string(level) != "O1" && !policy_kept(item.key());
    EXPECT_EQ(item.value().scalar_type(), low ? lp : torch::kFloat) << item.key();
  }

  torch::manual_seed(3);
  const torch::Tensor x = torch::randn({5, 8}, torch::TensorOptions().device(device));
  const torch::Tensor upstream = torch::randn({5, 4}, torch::TensorOptions().device(device));
  torch::Tensor y;
  {
    PolicyOpRecorder recorder;
    y = model(x);
    if (!o0) {
      // stem, fc, norm, fc, norm, head: each op's output dtype (a linear in lp, the kept ones fp32).
      const std::vector<std::pair<std::string, c10::ScalarType>> expected = {
          {"aten::addmm", lp}, {"aten::addmm", lp}, {"aten::layer_norm", torch::kFloat},
          {"aten::addmm", lp}, {"aten::layer_norm", torch::kFloat}, {"aten::addmm", torch::kFloat}};
      EXPECT_EQ(PolicyOpRecorder::records(), expected);
    }
  }
  y.backward(upstream);

  if (o0) {  // bitwise LibTorch
    const torch::Tensor plain = fp32_net->forward(x);
    plain.backward(upstream);
    EXPECT_TRUE(amp_test::bitwise_equal(y, plain));
    for (const auto& item : net->named_parameters()) {
      EXPECT_TRUE(amp_test::bitwise_equal(item.value().grad(), fp32_net->named_parameters()[item.key()].grad())) << item.key();
    }
    return;
  }

  auto leaves = policy_leaves(fp32_net, level, lp);
  std::map<std::string, torch::Tensor> used = leaves;
  if (std::string(level) == "O1") {
    for (auto& [name, t] : used) {
      if (!policy_kept(name)) t = t.to(lp);
    }
  }
  const torch::Tensor x_in = std::string(level) == "O1" ? x : x.to(lp);
  const torch::Tensor ref = policy_reference(used, x_in, lp).to(torch::kFloat);
  ref.backward(upstream);
  EXPECT_TRUE(amp_test::bitwise_equal(y, ref)) << (y - ref).abs().max();
  for (const auto& item : net->named_parameters()) {
    ASSERT_TRUE(item.value().grad().defined()) << item.key();
    EXPECT_TRUE(amp_test::bitwise_equal(item.value().grad(), leaves.at(item.key()).grad())) << item.key();
  }
}

TEST_P(PrecisionPolicyLevelTest, TypesKeepLikePatterns) {
  const auto [level, lp, device] = GetParam();
  PolicyNet by_name = policy_net(device);
  PolicyNet by_type = policy_net(device);
  auto a = amp::initialize(by_name, options().keep_fp32({"*.norm"}));
  auto b = amp::initialize(by_type, options().keep_fp32_type<torch::nn::LayerNormImpl>());
  torch::manual_seed(3);
  const torch::Tensor x = torch::randn({5, 8}, torch::TensorOptions().device(device));
  EXPECT_TRUE(amp_test::bitwise_equal(a(x), b(x)));
  for (const auto& item : by_type->named_parameters()) {
    EXPECT_EQ(item.value().scalar_type(), by_name->named_parameters()[item.key()].scalar_type()) << item.key();
  }
}

TEST_P(PrecisionPolicyLevelTest, TrainsAndResumesBitwise) {
  const auto [level, lp, device] = GetParam();
  const auto run = [&, level = level](int steps, const std::string& load_from, const std::string& save_to) {
    PolicyNet net = policy_net(device);
    torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-2).eps(1e-4));  // eps above fp16's floor (O3)
    auto [model, optimizer] = amp::initialize(net, std::move(adam), options().keep_fp32({"head", "*.norm"}));
    if (!load_from.empty()) {  // the model's weights, then the optimizer's state (its masters)
      torch::serialize::InputArchive archive;
      archive.load_from(load_from + ".model");
      net->load(archive);
      torch::load(optimizer, load_from);
    }
    for (int i = 0; i < steps; ++i) {
      torch::manual_seed(100 + i + (load_from.empty() ? 0 : 2));
      const torch::Tensor x = torch::randn({6, 8}, torch::TensorOptions().device(device));
      optimizer.zero_grad();
      const torch::Tensor loss = model(x).pow(2).mean();
      amp::scale_loss(loss, optimizer).backward();
      optimizer.step();
    }
    if (!save_to.empty()) {
      torch::save(optimizer, save_to);
      torch::serialize::OutputArchive archive;
      net->save(archive);
      archive.save_to(save_to + ".model");
    }
    for (const auto& item : net->named_parameters()) {
      if (policy_kept(item.key())) EXPECT_EQ(item.value().scalar_type(), torch::kFloat) << level << " " << item.key();
    }
    return net;
  };
  const std::string path = (std::filesystem::temp_directory_path() / ("amp_policy_resume_" + std::string(level) +
                                                                       amp_test::dtype_label(lp) + ".pt")).string();
  PolicyNet straight = run(4, "", "");
  run(2, "", path);
  PolicyNet resumed = run(2, path, "");
  for (const auto& item : straight->named_parameters()) {
    EXPECT_TRUE(amp_test::bitwise_equal(item.value(), resumed->named_parameters()[item.key()])) << item.key();
  }
  PolicyNet untrained = policy_net(device);
  EXPECT_FALSE(amp_test::bitwise_equal(straight->head->weight.to(torch::kFloat), untrained->head->weight));
  std::filesystem::remove(path);
  std::filesystem::remove(path + ".model");
}

AMP_INSTANTIATE_FOR_LEVELS(PrecisionPolicyLevelTest, amp_test::level_cases({"O0", "O1", "O2", "O3"}, /*o0_once=*/true));

// On [batch, sequence, features] inputs LibTorch's Linear computes input.matmul(weight.t()): the GEMM reads a view of
// the weight, and follows the weight's policy all the same (at O2 a low-precision Linear after an fp32 island casts
// its input down, it does not promote its weight to fp32; at O1 a kept Linear's GEMM stays fp32, out of autocast).
TEST(PrecisionPolicyTest, LinearOnSequenceInputsFollowsItsWeightsPolicy) {
  struct SeqNetImpl : torch::nn::Module {
    torch::nn::LayerNorm norm{register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})))};
    torch::nn::Linear body{register_module("body", torch::nn::Linear(8, 16))};
    torch::nn::Linear head{register_module("head", torch::nn::Linear(16, 4))};
    torch::Tensor forward(const torch::Tensor& x) { return head(body(norm(x))); }
  };
  static thread_local std::vector<c10::ScalarType> gemms;
  static thread_local int depth = 0;
  for (const char* level : {"O1", "O2"}) {
    torch::manual_seed(7);
    auto net = std::make_shared<SeqNetImpl>();
    const auto norm_w = net->norm->weight.detach().clone(), norm_b = net->norm->bias.detach().clone();
    const auto body_w = net->body->weight.detach().clone(), body_b = net->body->bias.detach().clone();
    const auto head_w = net->head->weight.detach().clone(), head_b = net->head->bias.detach().clone();
    auto model = amp::initialize(net, amp::Options(level).low_precision_dtype(torch::kBFloat16).keep_fp32({"norm", "head"}).verbosity(0));
    const auto x = torch::randn({2, 5, 8});
    gemms.clear();
    depth = 0;
    const auto handle = at::addThreadLocalCallback(
        at::RecordFunctionCallback(
            [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
              if (std::string(fn.name()) == "aten::matmul") ++depth;
              return nullptr;
            },
            [](const at::RecordFunction& fn, at::ObserverContext*) {
              if (std::string(fn.name()) != "aten::matmul" || --depth > 0) return;
              gemms.push_back(fn.outputs()[0].toTensor().scalar_type());
            })
            .needsOutputs(true)
            .scopes({at::RecordScope::FUNCTION}));
    const torch::Tensor out = model(x);
    at::removeCallback(handle);
    EXPECT_EQ(gemms, (std::vector<c10::ScalarType>{torch::kBFloat16, torch::kFloat})) << level;
    // By hand: the norm and the head in fp32, the body's GEMM in bf16 (O2: bf16 weights; O1: autocast's casts).
    const bool o2 = std::string(level) == "O2";
    const auto input = o2 ? x.to(torch::kBFloat16).to(torch::kFloat) : x;
    const auto normed = torch::layer_norm(input, {8}, norm_w, norm_b);
    auto hidden = normed.to(torch::kBFloat16).matmul(body_w.to(torch::kBFloat16).t());
    hidden += o2 ? body_b.to(torch::kBFloat16) : body_b;
    auto expected = hidden.to(torch::kFloat).matmul(head_w.t());
    expected += head_b;
    EXPECT_TRUE(amp_test::bitwise_equal(out, expected)) << level << ": max diff " << (out - expected).abs().max().item<double>();
  }
}

TEST(PrecisionPolicyTest, PatternsFollowFnmatchOverTheWholeName) {
  using amp::detail::glob_match;
  EXPECT_TRUE(glob_match("*.norm", "blocks.0.norm"));
  EXPECT_FALSE(glob_match("*.norm", "norm"));
  EXPECT_FALSE(glob_match("*.norm", "blocks.0.norm.x"));
  EXPECT_TRUE(glob_match("blocks.?.fc", "blocks.1.fc"));
  EXPECT_FALSE(glob_match("blocks.?.fc", "blocks.10.fc"));
  EXPECT_TRUE(glob_match("blocks.*.fc", "blocks.10.fc"));
  EXPECT_TRUE(glob_match("head", "head"));
  EXPECT_FALSE(glob_match("head", "head.0"));
  EXPECT_TRUE(glob_match("*", "a.b.c"));
  EXPECT_TRUE(glob_match("a*b*c", "aXbYbZc"));
}

TEST(PrecisionPolicyTest, ReportsKeptModulesWithTheirReasonInModelOrder) {
  PolicyNet net = policy_net(torch::kCPU);
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  auto [model, optimizer] = amp::initialize(
      net, std::move(sgd),
      amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0).keep_fp32({"head", "blocks.1.*"})
          .keep_fp32_type<torch::nn::LayerNormImpl>());
  const std::vector<std::string> expected = {"blocks.0.norm (keep_fp32_type)", "blocks.1.fc (keep_fp32)",
                                             "blocks.1.norm (keep_fp32)", "head (keep_fp32)"};
  EXPECT_EQ(amp::fp32_modules(optimizer), expected);
  EXPECT_EQ(net->blocks[1]->as<PolicyBlockImpl>()->fc->weight.scalar_type(), torch::kFloat);
  EXPECT_EQ(net->blocks[0]->as<PolicyBlockImpl>()->fc->weight.scalar_type(), torch::kBFloat16);
}

TEST(PrecisionPolicyTest, BatchNormKeptByTheLevelIsListed) {
  SKIP_WITHOUT_CPU_KERNELS(torch::kBFloat16);
  amp_test::ConvBnNet net;
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  auto [model, optimizer] = amp::initialize(
      net, std::move(sgd), amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0).keep_fp32({"fc"}));
  const std::vector<std::string> expected = {"bn (keep_batchnorm_fp32)", "fc (keep_fp32)"};
  EXPECT_EQ(amp::fp32_modules(optimizer), expected);
  // The BatchNorm takes bf16 activations as before (its own rule); the fc island computes in fp32.
  const torch::Tensor x = torch::randn({2, 1, 8, 8});
  const torch::Tensor y = model(x);
  EXPECT_EQ(y.scalar_type(), torch::kFloat);
  amp::scale_loss(y.sum(), optimizer).backward();
  optimizer.step();
  EXPECT_EQ(net->fc->weight.scalar_type(), torch::kFloat);
  EXPECT_EQ(net->fc->weight.grad().scalar_type(), torch::kFloat);
}

TEST(PrecisionPolicyTest, BannerListsTheIslands) {
  PolicyNet net = policy_net(torch::kCPU);
  testing::internal::CaptureStdout();
  auto model = amp::initialize(net, amp::Options("O2").low_precision_dtype(torch::kBFloat16).keep_fp32({"head"}));
  const std::string out = testing::internal::GetCapturedStdout();
  EXPECT_NE(out.find("keep_fp32              : ['head']"), std::string::npos) << out;
  EXPECT_NE(out.find("Kept in fp32 (fp32 islands): head (keep_fp32)"), std::string::npos) << out;
}

namespace {

// A handler of the interception room (a sixth feature would be one): records the dtypes of the ops it sees, on the
// thread that asked, where the island casts (order 30) have already run and the diagnosis (40) not yet. Handlers
// stay for the process; this one does nothing while no test asks it to record.
class RecordingHandler final : public amp::detail::InterceptionHandler {
 public:
  static thread_local std::vector<std::pair<std::string, c10::ScalarType>>* seen;
  void handle(amp::detail::InterceptedOp& op, const amp::detail::InterceptNext& next) override {
    if (seen && op.op.schema().name() == "aten::layer_norm") {
      seen->emplace_back(op.op.schema().name(), op.arguments()[0].toTensor().scalar_type());
    }
    next(op);
  }
};
thread_local std::vector<std::pair<std::string, c10::ScalarType>>* RecordingHandler::seen = nullptr;

}  // namespace

TEST(InterceptionTest, AHandlerRegisteredAtItsOrderSeesEachOpOfTheForwardAfterTheHandlersBeforeIt) {
  static const bool registered = [] {
    amp::detail::register_interception_handler(35, std::make_shared<RecordingHandler>());
    return true;
  }();
  (void)registered;
  PolicyNet net = policy_net(torch::kCPU);
  auto model = amp::initialize(net, amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0)
                                        .keep_fp32({"blocks.0.norm"}));
  std::vector<std::pair<std::string, c10::ScalarType>> seen;
  RecordingHandler::seen = &seen;
  const auto out = model(torch::randn({4, 8}));
  RecordingHandler::seen = nullptr;
  // blocks.0.norm is an island: its layer_norm reaches the handler with the input the island cast made fp32;
  // blocks.1.norm's stays bf16.
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_EQ(seen[0].second, torch::kFloat);
  EXPECT_EQ(seen[1].second, torch::kBFloat16);
  EXPECT_EQ(out.scalar_type(), torch::kFloat);
}

TEST(PrecisionPolicyTest, KeepFp32AtO0SaysItHasNoEffect) {
  PolicyNet net = policy_net(torch::kCPU);
  const auto options = amp::Options("O0").keep_fp32({"head"}).keep_fp32_type<torch::nn::LayerNormImpl>();
  testing::internal::CaptureStdout();
  std::string error;
  try {
    auto model = amp::initialize(net, options);
  } catch (const std::exception& e) {
    error = amp_test::message(e);
  }
  const std::string out = testing::internal::GetCapturedStdout();
  ASSERT_EQ(error, "");
  EXPECT_NE(out.find("Note: keep_fp32 has no effect at opt_level O0, where every module computes in fp32 already "
                     "(matched: "), std::string::npos) << out;
  EXPECT_NE(out.find("head (keep_fp32)"), std::string::npos) << out;
  EXPECT_EQ(out.find("Kept in fp32 (fp32 islands)"), std::string::npos) << out;
  PolicyNet quiet_net = policy_net(torch::kCPU);
  testing::internal::CaptureStdout();
  try {
    auto quiet = amp::initialize(quiet_net, amp::Options("O0").keep_fp32({"head"}).verbosity(0));
  } catch (const std::exception& e) {
    error = amp_test::message(e);
  }
  EXPECT_EQ(testing::internal::GetCapturedStdout(), "");
  EXPECT_EQ(error, "");
}

TEST(PrecisionPolicyTest, PatternMatchingNothingThrowsWithTheClosestNames) {
  PolicyNet net = policy_net(torch::kCPU);
  ASSERT_THROWS_WITH(amp::initialize(net, amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0).keep_fp32({"haed"})),
                     "keep_fp32 pattern 'haed' matches no module of the model. Closest module names: 'head'");
  ASSERT_THROWS_WITH(amp::initialize(net, amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0).keep_fp32({"norm"})),
                     "'*' matches any characters, dots included");
  // Nothing was changed by the refused calls: the model is still fp32 and can be initialized.
  for (const auto& p : net->parameters()) EXPECT_EQ(p.scalar_type(), torch::kFloat);
  ASSERT_THROWS_WITH(amp::initialize(net, amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0).keep_fp32_type<torch::nn::Conv2dImpl>()),
                     "keep_fp32_types names Conv2d, but the model holds no module of that type");
  ASSERT_THROWS_WITH(amp::Options("O2").keep_fp32({""}).resolve(), "keep_fp32 got an empty module pattern");
  EXPECT_NO_THROW(amp::initialize(net, amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0).keep_fp32({"head"})));
}

TEST(PrecisionPolicyTest, ConfigKeys) {
  const auto path = std::filesystem::temp_directory_path() / "amp_policy_config.cfg";
  {
    std::ofstream(path) << "opt_level = O2\nlow_precision_dtype = bfloat16\nkeep_fp32 = head, *.norm\n"
                           "keep_fp32_types = LayerNorm, BatchNorm*\nverbosity = 0\n";
  }
  const amp::Properties p = amp::load_options(path.string()).resolve();
  EXPECT_EQ(p.keep_fp32, (std::vector<std::string>{"head", "*.norm"}));
  std::vector<std::string> types;
  for (const auto& t : p.keep_fp32_types) types.push_back(t.name);
  EXPECT_EQ(types, (std::vector<std::string>{"LayerNorm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d"}));
  {
    std::ofstream(path) << "opt_level = O2\nkeep_fp32_types = Layernorm\n";
  }
  ASSERT_THROWS_WITH(amp::load_options(path.string()), "'Layernorm' is not a LibTorch module type (did you mean 'LayerNorm'?)");
  {
    std::ofstream(path) << "opt_level = O2\nkeep_fp32 = head,,norm\n";
  }
  ASSERT_THROWS_WITH(amp::load_options(path.string()), "no empty item");
  std::filesystem::remove(path);

  // A config's type names find LibTorch's modules at initialize.
  PolicyNet net = policy_net(torch::kCPU);
  amp::Options options("O2");
  options.low_precision_dtype(torch::kBFloat16).verbosity(0).keep_fp32_types({{"LayerNorm"}});
  auto model = amp::initialize(net, options);
  EXPECT_EQ(net->blocks[0]->as<PolicyBlockImpl>()->norm->weight.scalar_type(), torch::kFloat);
  EXPECT_EQ(net->head->weight.scalar_type(), torch::kBFloat16);
}

TEST(PrecisionPolicyTest, AutoFp32NeedsLowPrecision) {
  ASSERT_THROWS_WITH(amp::Options("O0").auto_fp32(8).resolve(), "auto_fp32 moves modules that keep overflowing in low "
                     "precision to fp32, so it needs a level with low precision; got opt_level O0");
  ASSERT_THROWS_WITH(amp::Options("O2").enabled(false).auto_fp32(8).resolve(), "got opt_level O2 with enabled false");
  ASSERT_THROWS_WITH(amp::Options("O2").auto_fp32(-1).resolve(), "got -1");
  // What it needed before: a dynamic scale, master weights in the copy format, no FP8.
  EXPECT_EQ(amp::Options("O3").auto_fp32(8).resolve().auto_fp32, 8);
  EXPECT_EQ(amp::Options("O2").low_precision_dtype(torch::kBFloat16).master_weights_format(amp::MasterWeights::kSplit)
                .auto_fp32(8).resolve().auto_fp32, 8);
  EXPECT_EQ(amp::Options("O2").auto_fp32(8).resolve().auto_fp32, 8);
  EXPECT_EQ(amp::Options("O1").auto_fp32(3).resolve().auto_fp32, 3);
}

// A module that mixes an island's fp32 output with a low-precision activation in an op that refuses mixed
// dtypes (matmul) and one that promotes (add): at O2 both run in fp32.
struct PolicyMixImpl : torch::nn::Module {
  PolicyMixImpl()
      : q(register_module("q", torch::nn::Linear(8, 8))), k(register_module("k", torch::nn::Linear(8, 8))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    const torch::Tensor a = q(x), b = k(x);
    return torch::matmul(a, b.transpose(0, 1)) + a.sum();
  }
  torch::nn::Linear q, k;
};
TORCH_MODULE(PolicyMix);

TEST(PrecisionPolicyTest, OpsMixingAnIslandsOutputWithLowPrecisionRunInFp32) {
  torch::manual_seed(1);
  PolicyMix net;
  torch::manual_seed(1);
  PolicyMix ref_net;
  auto model = amp::initialize(net, amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0).keep_fp32({"k"}));
  const torch::Tensor x = torch::randn({3, 8});
  const torch::Tensor y = model(x);
  const torch::Tensor xl = x.to(torch::kBFloat16);
  const torch::Tensor a = torch::linear(xl, ref_net->q->weight.to(torch::kBFloat16), ref_net->q->bias.to(torch::kBFloat16));
  const torch::Tensor b = torch::linear(xl.to(torch::kFloat), ref_net->k->weight, ref_net->k->bias);
  const torch::Tensor expected = torch::matmul(a.to(torch::kFloat), b.transpose(0, 1)) + a.sum();
  EXPECT_TRUE(amp_test::bitwise_equal(y, expected));
}

TEST(PrecisionPolicyTest, EmbeddingIslandFeedsLowPrecisionLayers) {
  struct EmbedNetImpl : torch::nn::Module {
    EmbedNetImpl()
        : embed(register_module("embed", torch::nn::Embedding(10, 8))), fc(register_module("fc", torch::nn::Linear(8, 3))) {}
    torch::Tensor forward(const torch::Tensor& ids) { return fc(embed(ids)); }
    torch::nn::Embedding embed;
    torch::nn::Linear fc;
  };
  auto net = std::make_shared<EmbedNetImpl>();
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  auto [model, optimizer] = amp::initialize(
      net, std::move(sgd),
      amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0).keep_fp32_type<torch::nn::EmbeddingImpl>());
  EXPECT_EQ(net->embed->weight.scalar_type(), torch::kFloat);
  const torch::Tensor ids = torch::tensor({1, 4, 7}, torch::kLong);
  const torch::Tensor y = model(ids);
  const torch::Tensor expected = torch::linear(torch::embedding(net->embed->weight, ids).to(torch::kBFloat16),
                                               net->fc->weight, net->fc->bias).to(torch::kFloat);
  EXPECT_TRUE(amp_test::bitwise_equal(y, expected));
  amp::scale_loss(y.sum(), optimizer).backward();
  const torch::Tensor before = net->embed->weight.detach().clone();
  optimizer.step();
  EXPECT_EQ(net->embed->weight.scalar_type(), torch::kFloat);
  EXPECT_FALSE(amp_test::bitwise_equal(before, net->embed->weight));  // an fp32 parameter, its own master
}

TEST(PrecisionPolicyTest, ActivationCheckpointRecomputesUnderThePolicy) {
  struct CkptNetImpl : torch::nn::Module {
    explicit CkptNetImpl(bool checkpointed) : checkpointed(checkpointed) {
      block = register_module("block", PolicyBlock());
      head = register_module("head", torch::nn::Linear(16, 2));
    }
    torch::Tensor forward(const torch::Tensor& x) {
      torch::Tensor h = checkpointed ? amp::checkpoint([this](const torch::Tensor& in) { return block->forward(in); }, x)
                                     : block->forward(x);
      return head(h);
    }
    bool checkpointed;
    PolicyBlock block{nullptr};
    torch::nn::Linear head{nullptr};
  };
  const auto run = [](bool checkpointed) {
    torch::manual_seed(5);
    auto net = std::make_shared<CkptNetImpl>(checkpointed);
    auto model = amp::initialize(net, amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0)
                                          .keep_fp32({"block.norm"}));
    torch::manual_seed(6);
    const torch::Tensor x = torch::randn({4, 16}, torch::requires_grad());
    model(x).sum().backward();
    return std::vector<torch::Tensor>{x.grad(), net->block->fc->weight.grad(), net->block->norm->weight.grad()};
  };
  const auto plain = run(false), ckpt = run(true);
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(amp_test::bitwise_equal(plain[i], ckpt[i])) << i;
  EXPECT_EQ(plain[2].scalar_type(), torch::kFloat);
}

TEST(PrecisionPolicyTest, FrozenBatchNormAndLoadWeightsKeepWorking) {
  SKIP_WITHOUT_CPU_KERNELS(torch::kBFloat16);
  amp_test::ConvBnNet net;
  amp::freeze_batchnorm(*net);
  const torch::Tensor mean_before = net->bn->running_mean.clone();
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  auto [model, optimizer] = amp::initialize(
      net, std::move(sgd), amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0).keep_fp32({"conv"}));
  model.train();
  const torch::Tensor y = model(torch::randn({2, 1, 8, 8}));
  amp::scale_loss(y.sum(), optimizer).backward();
  optimizer.step();
  EXPECT_TRUE(amp_test::bitwise_equal(net->bn->running_mean, mean_before));
  EXPECT_EQ(net->conv->weight.scalar_type(), torch::kFloat);

  // load_weights into the kept conv (fp32) and the cast fc (bf16) from an fp32 model's archive.
  amp_test::ConvBnNet source;
  const auto path = (std::filesystem::temp_directory_path() / "amp_policy_weights.pt").string();
  torch::save(source, path);
  amp::load_weights(*model, path);
  EXPECT_TRUE(amp_test::bitwise_equal(net->conv->weight, source->conv->weight));
  EXPECT_TRUE(amp_test::bitwise_equal(net->fc->weight, source->fc->weight.to(torch::kBFloat16)));
  std::filesystem::remove(path);
}

}  // namespace

namespace {

// Scales by b then by a (b = 1 / a): harmless in the forward, but its backward multiplies the incoming
// gradient by a = 10^4 before b brings it back, which overflows float16 inside the module.
struct AmplifyImpl : torch::nn::Module {
  AmplifyImpl()
      : a(register_parameter("a", torch::full({1}, 1e4))), b(register_parameter("b", torch::full({1}, 1e-4))) {}
  torch::Tensor forward(const torch::Tensor& x) { return (x * b) * a; }
  torch::Tensor a, b;
};
TORCH_MODULE(Amplify);

// in_forward: fc -> head whose 1e5 weights overflow float16 in the forward (fp32 holds it);
// otherwise: fc -> Amplify -> out, whose backward overflows inside Amplify.
torch::nn::Sequential overflowing_net(bool in_forward) {
  torch::manual_seed(4);
  if (!in_forward) return torch::nn::Sequential(torch::nn::Linear(4, 8), Amplify(), torch::nn::Linear(8, 1));
  auto net = torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::Linear(8, 1));
  torch::NoGradGuard no_grad;
  net[1]->as<torch::nn::LinearImpl>()->weight.fill_(1e5);
  return net;
}

torch::Tensor overflowing_loss(bool in_forward, amp::Model<torch::nn::Sequential>& model, const torch::Tensor& x) {
  return in_forward ? model(x).mean() * 1e-4 : model(x).sum() * 1e3;
}

amp::Options auto_fp32_options(const char* level) {
  return amp::Options(level).low_precision_dtype(torch::kHalf).init_scale(1.0).auto_fp32(2).verbosity(0);
}

}  // namespace

TEST(AutoFp32Test, AModuleThatOverflowsInTheForwardMovesToFp32AndTrainingGoesOn) {
  SKIP_WITHOUT_CPU_KERNELS(torch::kHalf);
  for (const char* level : {"O1", "O2"}) {
    auto net = overflowing_net(true);
    auto [model, optimizer] = amp::initialize(net, torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(1e-6)),
                                              auto_fp32_options(level));
    std::vector<double> losses;
    for (int step = 0; step < 8; ++step) {
      torch::manual_seed(50 + step);
      const torch::Tensor x = torch::randn({16, 4});
      optimizer.zero_grad();
      const torch::Tensor loss = overflowing_loss(true, model, x);
      losses.push_back(loss.item<double>());
      amp::scale_loss(loss, optimizer).backward();
      optimizer.step();
    }
    // Overflows 1 and 2 count (patience 2), 3 is diagnosed and moves `1`; from step 4 on the steps are taken.
    EXPECT_EQ(optimizer.skipped_steps(), 3) << level;
    {  // Without auto_fp32 the same run skips every step at the floor and never gets a finite loss.
      auto stuck_net = overflowing_net(true);
      auto [stuck_model, stuck] = amp::initialize(
          stuck_net, torch::optim::SGD(stuck_net->parameters(), torch::optim::SGDOptions(1e-6)),
          amp::Options(auto_fp32_options(level)).auto_fp32(0));
      for (int step = 0; step < 8; ++step) {
        torch::manual_seed(50 + step);
        stuck.zero_grad();
        const torch::Tensor loss = overflowing_loss(true, stuck_model, torch::randn({16, 4}));
        EXPECT_FALSE(std::isfinite(loss.item<double>())) << level << " step " << step;
        amp::scale_loss(loss, stuck).backward();
        stuck.step();
      }
      EXPECT_EQ(stuck.skipped_steps(), 8) << level;
      EXPECT_TRUE(amp::fp32_modules(stuck).empty()) << level;
    }
    EXPECT_EQ(amp::fp32_modules(optimizer), std::vector<std::string>{"1 (auto_fp32)"}) << level;
    for (int step = 3; step < 8; ++step) EXPECT_TRUE(std::isfinite(losses[step])) << level << " step " << step;
    if (std::string(level) == "O2") {
      EXPECT_EQ(net[1]->as<torch::nn::LinearImpl>()->weight.scalar_type(), torch::kFloat);
      EXPECT_EQ(net[0]->as<torch::nn::LinearImpl>()->weight.scalar_type(), torch::kHalf);
    }
  }
}

TEST(AutoFp32Test, TheDiagnosisFindsAModuleWhoseBackwardOverflows) {
  SKIP_WITHOUT_CPU_KERNELS(torch::kHalf);
  auto net = overflowing_net(false);
  // A learning rate that keeps Amplify's b = 1 / a: its gradient, ~2e7, is large by construction.
  auto [model, optimizer] = amp::initialize(net, torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(1e-15)),
                                            auto_fp32_options("O2"));
  for (int step = 0; step < 5; ++step) {
    torch::manual_seed(50 + step);
    optimizer.zero_grad();
    const torch::Tensor loss = overflowing_loss(false, model, torch::randn({16, 4}));
    ASSERT_TRUE(std::isfinite(loss.item<double>())) << "the premise: a finite forward";
    amp::scale_loss(loss, optimizer).backward();
    optimizer.step();
  }
  EXPECT_EQ(amp::fp32_modules(optimizer), std::vector<std::string>{"1 (auto_fp32)"});
  EXPECT_EQ(optimizer.skipped_steps(), 3);  // 2 counted, 1 diagnosed; steps 3 and 4 are taken
}

// The same overflow in a module whose submodules are registered in the reverse of the order they run: the gradients
// of `amplify` and `stem` both turn non-finite, and `stem`, registered last, is where the report's fallback (the last
// non-finite gradient in model order) would point. The diagnosis's gradient hooks see where the inf starts.
struct ReverseRegisteredImpl : torch::nn::Module {
  ReverseRegisteredImpl()
      : head(register_module("head", torch::nn::Linear(8, 1))), amplify(register_module("amplify", Amplify())),
        stem(register_module("stem", torch::nn::Linear(4, 8))) {}
  torch::Tensor forward(const torch::Tensor& x) { return head(amplify(stem(x))); }
  torch::nn::Linear head;
  Amplify amplify;
  torch::nn::Linear stem;
};
TORCH_MODULE(ReverseRegistered);

TEST(AutoFp32Test, TheDiagnosisBlamesWhereTheBackwardsInfStartsNotTheLastModuleRegistered) {
  SKIP_WITHOUT_CPU_KERNELS(torch::kHalf);
  torch::manual_seed(4);
  ReverseRegistered net;
  auto [model, optimizer] = amp::initialize(net, torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(1e-15)),
                                            auto_fp32_options("O2"));
  for (int step = 0; step < 5; ++step) {
    torch::manual_seed(50 + step);
    optimizer.zero_grad();
    const torch::Tensor loss = model(torch::randn({16, 4})).sum() * 1e3;
    ASSERT_TRUE(std::isfinite(loss.item<double>())) << "the premise: a finite forward";
    amp::scale_loss(loss, optimizer).backward();
    if (step == 2) {  // the diagnosed step: the report's last non-finite gradient is stem's, not amplify's
      ASSERT_TRUE(optimizer.last_overflow().has_value());
      const auto& names = optimizer.last_overflow()->parameters;
      ASSERT_FALSE(names.empty());
      EXPECT_EQ(names.back().rfind("stem.", 0), 0u) << names.back();
      EXPECT_NE(std::find(names.begin(), names.end(), "amplify.b"), names.end());
    }
    optimizer.step();
  }
  EXPECT_EQ(amp::fp32_modules(optimizer), std::vector<std::string>{"amplify (auto_fp32)"});
  EXPECT_EQ(optimizer.skipped_steps(), 3);
}

TEST(AutoFp32Test, TheDecisionIsSavedAndResumesBitwiseWhicheverIsLoadedFirst) {
  SKIP_WITHOUT_CPU_KERNELS(torch::kHalf);
  const auto dir = std::filesystem::temp_directory_path();
  const std::string opt_path = (dir / "amp_auto_fp32_opt.pt").string(), model_path = (dir / "amp_auto_fp32_model.pt").string();
  const auto train = [](torch::nn::Sequential& net, amp::Optimizer<torch::optim::Adam>& optimizer,
                        amp::Model<torch::nn::Sequential>& model, int from, int to) {
    for (int step = from; step < to; ++step) {
      torch::manual_seed(50 + step);
      optimizer.zero_grad();
      amp::scale_loss(overflowing_loss(true, model, torch::randn({16, 4})), optimizer).backward();
      optimizer.step();
    }
    (void)net;
  };
  const auto make = [] {
    auto net = overflowing_net(true);
    auto init = amp::initialize(net, torch::optim::Adam(net->parameters(), torch::optim::AdamOptions(1e-3)),
                                auto_fp32_options("O2"));
    return std::make_tuple(net, std::move(init.model), std::move(init.optimizer));
  };
  auto [net, model, optimizer] = make();
  train(net, optimizer, model, 0, 5);
  ASSERT_EQ(amp::fp32_modules(optimizer), std::vector<std::string>{"1 (auto_fp32)"});
  torch::save(optimizer, opt_path);
  torch::save(net, model_path);
  train(net, optimizer, model, 5, 9);

  for (bool model_first : {true, false}) {
    auto [net2, model2, optimizer2] = make();
    if (model_first) torch::load(net2, model_path);
    torch::load(optimizer2, opt_path);
    if (!model_first) torch::load(net2, model_path);
    EXPECT_EQ(amp::fp32_modules(optimizer2), std::vector<std::string>{"1 (auto_fp32)"}) << model_first;
    EXPECT_EQ(net2[1]->as<torch::nn::LinearImpl>()->weight.scalar_type(), torch::kFloat);
    train(net2, optimizer2, model2, 5, 9);
    // Bitwise, every parameter, in either order: the fp16 layer's weights loaded after the optimizer are its
    // masters rounded, so the masters keep their low bits (NOTE [Masters follow the model]).
    const auto a = net->parameters(), b = net2->parameters();
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_TRUE(amp_test::bitwise_equal(a[i], b[i])) << model_first << " " << i;
    }
    EXPECT_EQ(optimizer2.skipped_steps(), optimizer.skipped_steps());
  }
  std::filesystem::remove(opt_path);
  std::filesystem::remove(model_path);
}

// The same decision through a Python checkpoint: put_amp writes it beside Apex's loss scalers, load_amp moves the
// module back to fp32, and training continues bitwise for the moved module.
TEST(AutoFp32Test, TheDecisionTravelsInPythonCheckpoints) {
  SKIP_WITHOUT_CPU_KERNELS(torch::kHalf);
  const std::string path = (std::filesystem::temp_directory_path() / "amp_auto_fp32_python.pt").string();
  const auto make = [](int patience) {
    auto net = overflowing_net(true);
    auto init = amp::initialize(net, torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(1e-3)),
                                amp::Options(auto_fp32_options("O2")).auto_fp32(patience));
    return std::make_tuple(net, std::move(init.model), std::move(init.optimizer));
  };
  const auto train = [](amp::Optimizer<torch::optim::SGD>& optimizer, amp::Model<torch::nn::Sequential>& model, int from,
                        int to) {
    for (int step = from; step < to; ++step) {
      torch::manual_seed(50 + step);
      optimizer.zero_grad();
      amp::scale_loss(overflowing_loss(true, model, torch::randn({16, 4})), optimizer).backward();
      optimizer.step();
    }
  };
  auto [net, model, optimizer] = make(2);
  train(optimizer, model, 0, 5);
  ASSERT_EQ(amp::fp32_modules(optimizer), std::vector<std::string>{"1 (auto_fp32)"});
  {
    amp::PythonCheckpoint out;
    out.put_model("model", *net);
    out.put_optimizer("optimizer", optimizer);
    out.put_amp("amp", optimizer);
    out.save(path);
  }
  train(optimizer, model, 5, 9);

  const auto checkpoint = amp::PythonCheckpoint::load(path);
  auto [net2, model2, optimizer2] = make(2);
  checkpoint.load_model(*net2);
  checkpoint.load_optimizer(optimizer2);
  checkpoint.load_amp(optimizer2);
  EXPECT_EQ(amp::fp32_modules(optimizer2), std::vector<std::string>{"1 (auto_fp32)"});
  EXPECT_EQ(net2[1]->as<torch::nn::LinearImpl>()->weight.scalar_type(), torch::kFloat);
  train(optimizer2, model2, 5, 9);
  const auto a = net->parameters(), b = net2->parameters();
  for (size_t i = 2; i < a.size(); ++i) EXPECT_TRUE(amp_test::bitwise_equal(a[i], b[i])) << i;
  EXPECT_EQ(optimizer2.skipped_steps() + 3, optimizer.skipped_steps());  // the 3 skips before the save are not state

  auto [net3, model3, optimizer3] = make(0);
  ASSERT_THROWS_WITH(checkpoint.load_amp(optimizer3), "holds auto_fp32's decisions (1 module(s) moved to fp32, the "
                     "first '1'), but this optimizer runs without auto_fp32");
  std::filesystem::remove(path);
}
