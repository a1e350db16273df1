// TorchScript models (amp/torchscript.h): networks Python scripted or traced, fine-tuned in C++ at every level and
// compared with Python's eager steps on the same network (tests/python/torchscript.py computes them at test time).

#include <torch/script.h>
#include <torch/version.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <unistd.h>
#include <vector>

#include "casting/model_casting.h"
#include "optim/fp32_values.h"
#include "support/support.h"

namespace fs = std::filesystem;

namespace {

const char* const kTorchScriptPy = AMP_SOURCE_DIR "/tests/python/torchscript.py";

// A directory removed when the process ends.
struct TsDirectory {
  fs::path path;
  ~TsDirectory() {
    std::error_code ignored;
    if (!path.empty()) fs::remove_all(path, ignored);
  }
};

// The models and references, made once per process; empty when Python with torch is missing or failed (its
// python.log is then kept).
const fs::path& ts_dir() {
  static const TsDirectory dir{[] {
    if (!amp_test::python_has_torch()) return fs::path();
    const fs::path d = amp_test::run_python_reference(kTorchScriptPy, "torchscript");
    if (d.empty()) return fs::path();
    return d;
  }()};
  return dir.path;
}

#define SKIP_WITHOUT_MODELS()                                                                            \
  do {                                                                                                   \
    if (ts_dir().empty()) GTEST_SKIP() << "these tests need Python with the torch wheel (set AMP_PYTHON)"; \
  } while (0)

std::string ts_model_path(const std::string& name) { return (ts_dir() / name).string(); }

const amp::PythonCheckpoint& ts_data() {
  static const amp::PythonCheckpoint d = amp::PythonCheckpoint::load(ts_model_path("data.pt"));
  return d;
}
const amp::PythonCheckpoint& ts_reference() {
  static const amp::PythonCheckpoint r = amp::PythonCheckpoint::load(ts_model_path("reference.pt"));
  return r;
}
torch::Tensor ts_x() { return ts_data().get("x").toTensor(); }
torch::Tensor ts_y() { return ts_data().get("y").toTensor(); }

// Python's wheel is the LibTorch this test runs on: the same kernels, so the same bits.
bool ts_same_kernels() {
  const std::string python_torch = ts_reference().get("torch_version").toStringRef();
  return python_torch.substr(0, python_torch.find('+')) == TORCH_VERSION;
}

struct TsRun {
  std::vector<double> losses;
  std::map<std::string, torch::Tensor> state;  // fp32 values (masters at O2), by qualified name
};

constexpr int kTsSteps = 4;  // tests/python/torchscript.py's STEPS

// Fine-tunes `file` with frozen BatchNorm as Python's reference does: SGD(lr 0.05, momentum 0.9), cross entropy.
TsRun ts_train(const std::string& file, const amp::Options& options, int steps = kTsSteps) {
  torch::jit::Module net = torch::jit::load(ts_model_path(file));
  amp::freeze_batchnorm(net);
  torch::optim::SGD sgd(amp::parameters(net), torch::optim::SGDOptions(0.05).momentum(0.9));
  auto [model, optimizer] = amp::initialize(net, std::move(sgd), options);
  model.train();
  TsRun run;
  for (int i = 0; i < steps; ++i) {
    optimizer.zero_grad();
    const torch::Tensor logits = model({ts_x()}).toTensor();
    EXPECT_EQ(logits.scalar_type(), torch::kFloat);
    const torch::Tensor loss = torch::nn::functional::cross_entropy(logits, ts_y());
    run.losses.push_back(loss.item<double>());
    {
      auto scaled = amp::scale_loss(loss, optimizer);
      scaled.backward();
    }
    optimizer.step();
  }
  for (const auto& [name, value] : amp::detail::fp32_state(*amp::detail::jit_mirror(net))) {
    run.state[name] = value.detach().clone();
  }
  return run;
}

// The level in bfloat16 (every build computes it on the CPU), quietly.
amp::Options ts_bf16(const std::string& level) {
  return amp::Options(level).low_precision_dtype(torch::kBFloat16).verbosity(0);
}

struct TsCase {
  std::string name;  // reference.pt's key
  amp::Options options;
  c10::ScalarType dtype;
};

std::vector<TsCase> ts_cases() {
  std::vector<TsCase> cases = {{"O0", amp::Options("O0").verbosity(0), torch::kFloat}};
  for (const char* level : {"O1", "O2", "O3"}) {
    for (const auto dtype : amp_test::low_precision_dtypes()) {
      if (!amp_test::cpu_computes(dtype)) continue;
      if (std::string(level) == "O1" && dtype == torch::kHalf && TORCH_VERSION_MAJOR < 2) continue;  // bf16-only autocast
      amp::Options options = amp::Options(level).low_precision_dtype(dtype).verbosity(0);
      if (std::string(level) == "O1") options.cast_lists(amp::CastLists::kNative);  // torch.autocast's lists
      cases.push_back({std::string(level) + "_" + amp_test::dtype_label(dtype), options, dtype});
    }
  }
  return cases;
}

double ts_max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>();
}

// Compares a run with Python's: bitwise where the kernels are the wheel's, else within rounding.
void ts_expect_matches(const TsRun& run, const std::string& key) {
  const auto ref = ts_reference().get(key).toGenericDict();
  const auto ref_losses = ref.at("losses").toList();
  const auto ref_state = ref.at("state").toGenericDict();
  const bool fp32 = key == "O0";
  ASSERT_EQ(run.losses.size(), ref_losses.size());
  for (size_t i = 0; i < run.losses.size(); ++i) {
    const double expected = ref_losses.get(i).toDouble();
    if (ts_same_kernels()) {
      EXPECT_EQ(run.losses[i], expected) << "loss of step " << i;
    } else {
      EXPECT_NEAR(run.losses[i], expected, (fp32 ? 1e-5 : 1e-2) * std::abs(expected)) << "loss of step " << i;
    }
  }
  EXPECT_EQ(run.state.size(), ref_state.size());
  double worst = 0.0;
  for (const auto& item : ref_state) {
    const std::string name = item.key().toStringRef();
    const torch::Tensor expected = item.value().toTensor();
    ASSERT_TRUE(run.state.count(name)) << name;
    const torch::Tensor ours = run.state.at(name).to(expected.scalar_type());  // O3: fp32 upcast of bf16, exact back
    if (ts_same_kernels()) {
      EXPECT_TRUE(amp_test::bitwise_equal(ours, expected)) << name << " differs by " << ts_max_abs_diff(ours, expected);
    } else if (expected.is_floating_point()) {
      worst = std::max(worst, ts_max_abs_diff(ours, expected));
    }
  }
  if (!ts_same_kernels()) {
    std::cout << "[ measured ] " << key << ": LibTorch " << TORCH_VERSION << " against Python's wheel, largest parameter "
              << "difference " << worst << std::endl;
    EXPECT_LE(worst, fp32 ? 1e-4 : 5e-2) << "LibTorch " << TORCH_VERSION << " against Python's wheel";
  }
}

// The frozen layers' statistics, as Python pretrained them.
void ts_expect_statistics_unchanged(const TsRun& run) {
  const auto pretrained = ts_data().get("state").toGenericDict();
  int checked = 0;
  for (const auto& item : pretrained) {
    const std::string name = item.key().toStringRef();
    if (name.find("running_") == std::string::npos && name.find("num_batches") == std::string::npos) continue;
    EXPECT_TRUE(amp_test::bitwise_equal(run.state.at(name), item.value().toTensor())) << name;
    ++checked;
  }
  EXPECT_EQ(checked, 6 * 3);  // six BatchNorm layers: running_mean, running_var, num_batches_tracked
}

}  // namespace

TEST(TorchScriptTest, ScriptedModelTrainsAsPythonAtEveryLevelWithFrozenBatchNorm) {
  SKIP_WITHOUT_MODELS();
  for (const auto& c : ts_cases()) {
    SCOPED_TRACE(c.name);
    const TsRun run = ts_train("resnet_scripted.pt", c.options);
    ts_expect_matches(run, c.name);
    ts_expect_statistics_unchanged(run);
  }
}

TEST(TorchScriptTest, ApexListsAtO1TrainCloseToTorchAutocast) {
  SKIP_WITHOUT_MODELS();
  // Apex's lists (the default) and torch.autocast's cast this network's ops alike: the steps must stay within bf16
  // rounding of the native lists' reference (on the 2.13 wheel they are equal).
  const TsRun run = ts_train("resnet_scripted.pt", ts_bf16("O1"));
  const auto ref = ts_reference().get("O1_bf16").toGenericDict();
  const auto ref_losses = ref.at("losses").toList();
  for (size_t i = 0; i < run.losses.size(); ++i) {
    EXPECT_NEAR(run.losses[i], ref_losses.get(i).toDouble(), 1e-2 * ref_losses.get(i).toDouble()) << "step " << i;
  }
  double worst = 0.0;
  for (const auto& item : ref.at("state").toGenericDict()) {
    worst = std::max(worst, ts_max_abs_diff(run.state.at(item.key().toStringRef()), item.value().toTensor()));
  }
  std::cout << "[ measured ] O1 bf16, Apex's lists against torch.autocast's: largest parameter difference " << worst
            << std::endl;
  EXPECT_LE(worst, 5e-2);
  ts_expect_statistics_unchanged(run);
}

TEST(TorchScriptTest, TracedModelTrainsAsPython) {
  SKIP_WITHOUT_MODELS();
  // O1 is left out: a traced graph calls aten::_convolution, which the CPU's autocast lists don't hold (its own test
  // below).
  for (const auto& c : ts_cases()) {
    if (c.name.rfind("O1", 0) == 0 || c.dtype == torch::kHalf) continue;
    SCOPED_TRACE(c.name);
    const TsRun run = ts_train("resnet_traced.pt", c.options);
    ts_expect_matches(run, c.name);
    ts_expect_statistics_unchanged(run);
  }
}

TEST(TorchScriptTest, TracedModelAtO1RunsItsConvolutionsAsTracedUnderTorchAutocast) {
  SKIP_WITHOUT_MODELS();
  const TsRun run = ts_train("resnet_traced.pt", ts_bf16("O1").cast_lists(amp::CastLists::kNative));
  ts_expect_matches(run, "traced/O1_bf16");
}

TEST(TorchScriptTest, WarmJitExecutorCannotMistypeTheBackward) {
  SKIP_WITHOUT_MODELS();
  // The module runs optimized first, as plain TorchScript (profiled, differentiable graphs built, the JIT's autocast
  // pass on); amp's O1 steps afterwards still equal Python's eager autocast steps.
  torch::jit::Module warm = torch::jit::load(ts_model_path("resnet_scripted.pt"));
  for (int i = 0; i < 3; ++i) warm.forward({ts_x()}).toTensor().sum().backward();
  const TsRun run = ts_train("resnet_scripted.pt", ts_bf16("O1").cast_lists(amp::CastLists::kNative));
  ts_expect_matches(run, "O1_bf16");
}

TEST(TorchScriptTest, FrozenBatchNormStaysFrozenThroughTrainAndEval) {
  SKIP_WITHOUT_MODELS();
  torch::jit::Module net = torch::jit::load(ts_model_path("resnet_scripted.pt"));
  amp::freeze_batchnorm(net);
  for (const auto& p : net.named_parameters()) {
    EXPECT_EQ(p.value.requires_grad(), p.name.find("bn") == std::string::npos && p.name.find("down.1") == std::string::npos)
        << p.name;
  }
  torch::optim::SGD sgd(amp::parameters(net), torch::optim::SGDOptions(0.05));
  auto [model, optimizer] = amp::initialize(net, std::move(sgd), ts_bf16("O2"));
  auto training_of = [&](const std::string& path) {
    torch::jit::Module m = net;
    for (size_t start = 0, dot = 0; dot != std::string::npos; start = dot + 1) {
      dot = path.find('.', start);
      m = m.attr(path.substr(start, dot - start)).toModule();
    }
    return m.is_training();
  };
  model.train();
  EXPECT_TRUE(model.is_training());
  EXPECT_TRUE(training_of("layer1.conv1"));
  EXPECT_FALSE(training_of("bn"));
  EXPECT_FALSE(training_of("layer2.down.1"));
  model.eval();
  EXPECT_FALSE(training_of("layer1.conv1"));
  model.train();
  EXPECT_FALSE(training_of("layer2.bn2"));
  // BatchNorm kept fp32 (frozen, and O2's keep_batchnorm_fp32); everything else bf16/fp16.
  EXPECT_EQ(net.attr("bn").toModule().attr("running_var").toTensor().scalar_type(), torch::kFloat);
  EXPECT_EQ(net.attr("fc").toModule().attr("weight").toTensor().scalar_type(), torch::kBFloat16);
  EXPECT_EQ(amp::fp32_modules(optimizer),
            (std::vector<std::string>{"bn (keep_batchnorm_fp32)", "layer1.bn1 (keep_batchnorm_fp32)",
                                      "layer1.bn2 (keep_batchnorm_fp32)", "layer2.bn1 (keep_batchnorm_fp32)",
                                      "layer2.bn2 (keep_batchnorm_fp32)", "layer2.down.1 (keep_batchnorm_fp32)"}));
}

TEST(TorchScriptTest, FreezingALayerTracedInTrainingModeThrows) {
  SKIP_WITHOUT_MODELS();
  torch::jit::Module net = torch::jit::load(ts_model_path("resnet_traced_train.pt"));
  ASSERT_THROWS_WITH(amp::freeze_batchnorm(net), "BatchNorm layer 'bn' was traced in training mode");
  ASSERT_THROWS_WITH(amp::freeze_batchnorm(net), "model.eval() before torch.jit.trace");
  // Nothing was changed: every layer still trains.
  for (const auto& m : net.named_modules()) EXPECT_TRUE(m.value.is_training()) << m.name;
  for (const auto& p : net.parameters()) EXPECT_TRUE(p.requires_grad());
}

namespace {
// Collects TORCH_WARN messages while it lives.
class TsWarnings : public c10::WarningHandler {
 public:
  TsWarnings() : guard_(this) {}
#if TORCH_VERSION_MAJOR >= 2
  void process(const c10::Warning& warning) override { messages.push_back(warning.msg()); }
#else
  void process(const c10::SourceLocation&, const std::string& msg, const bool) override { messages.push_back(msg); }
#endif
  std::vector<std::string> messages;

 private:
#if TORCH_VERSION_MAJOR >= 2
  c10::WarningUtils::WarningHandlerGuard guard_;
#else
  c10::Warning::WarningHandlerGuard guard_;
#endif
};
}  // namespace

TEST(TorchScriptTest, EvalWarnsOnceAboutLayersTracedInTrainingMode) {
  SKIP_WITHOUT_MODELS();
  auto model = amp::initialize(torch::jit::load(ts_model_path("resnet_traced_train.pt")), amp::Options("O0").verbosity(0));
  TsWarnings warnings;
  model.eval();
  model.train();
  model.eval();
  ASSERT_EQ(warnings.messages.size(), 1u);
  EXPECT_NE(warnings.messages[0].find("BatchNorm layer(s) 'bn', 'layer1.bn1', 'layer1.bn2', 'layer2.bn1', 'layer2.bn2', "
                                      "'layer2.down.1' of this TorchScript module were traced in training mode"),
            std::string::npos)
      << warnings.messages[0];
  // A module traced in eval mode: nothing to warn about.
  auto eval_traced = amp::initialize(torch::jit::load(ts_model_path("resnet_traced.pt")), amp::Options("O0").verbosity(0));
  eval_traced.eval();
  EXPECT_EQ(warnings.messages.size(), 1u);
}

TEST(TorchScriptTest, LoopOfSubmodulesKeepsFp32IslandsByQualifiedNameAndType) {
  SKIP_WITHOUT_MODELS();
  for (const bool by_type : {false, true}) {
    SCOPED_TRACE(by_type ? "keep_fp32_types LayerNorm" : "keep_fp32 blocks.*.norm");
    torch::jit::Module net = torch::jit::load(ts_model_path("loop.pt"));
    torch::optim::Adam adam(amp::parameters(net), torch::optim::AdamOptions(1e-3));
    amp::Options options = ts_bf16("O2");
    if (by_type) {
      options.keep_fp32_types({amp::ModuleType{"LayerNorm"}});
    } else {
      options.keep_fp32({"blocks.*.norm"});
    }
    auto [model, optimizer] = amp::initialize(net, std::move(adam), options);
    const std::string reason = by_type ? " (keep_fp32_type)" : " (keep_fp32)";
    EXPECT_EQ(amp::fp32_modules(optimizer), (std::vector<std::string>{"blocks.0.norm" + reason, "blocks.1.norm" + reason,
                                                                      "blocks.2.norm" + reason}));
    for (const auto& p : net.named_parameters()) {
      EXPECT_EQ(p.value.scalar_type(), p.name.find(".norm.") != std::string::npos ? torch::kFloat : torch::kBFloat16)
          << p.name;
    }
    torch::manual_seed(1);
    const torch::Tensor x = torch::randn({8, 16}), y = torch::randint(0, 4, {8});
    double first = 0.0, last = 0.0;
    for (int i = 0; i < 5; ++i) {
      optimizer.zero_grad();
      const torch::Tensor loss = torch::nn::functional::cross_entropy(model(x).toTensor(), y);
      (i == 0 ? first : last) = loss.item<double>();
      {
        auto scaled = amp::scale_loss(loss, optimizer);
        scaled.backward();
      }
      optimizer.step();
    }
    EXPECT_LT(last, first);
  }
  torch::jit::Module net = torch::jit::load(ts_model_path("loop.pt"));
  ASSERT_THROWS_WITH(amp::initialize(net, ts_bf16("O2").keep_fp32({"block.*.norm"})),
                     "keep_fp32 pattern 'block.*.norm' matches no module");
  ASSERT_THROWS_WITH(amp::initialize(net, ts_bf16("O2").keep_fp32_types({amp::ModuleType{"GroupNorm"}})),
                     "keep_fp32_types names GroupNorm, but the model holds no module of that type");
}

TEST(TorchScriptTest, OutputsInsideDictsTuplesAndListsAreCast) {
  SKIP_WITHOUT_MODELS();
  for (const char* level : {"O1", "O2", "O3"}) {
    SCOPED_TRACE(level);
    auto model = amp::initialize(torch::jit::load(ts_model_path("dict.pt")), ts_bf16(level));
    const auto out = model(torch::randn({2, 16})).toGenericDict();
    EXPECT_EQ(out.at("logits").toTensor().scalar_type(), torch::kFloat);
    EXPECT_EQ(out.at("features").toTensor().scalar_type(), torch::kFloat);
  }
  // The OptLevel overloads reach the TorchScript ones too.
  auto o0 = amp::initialize(torch::jit::load(ts_model_path("dict.pt")), amp::OptLevel::O0);
  EXPECT_EQ(o0(torch::randn({2, 16})).toGenericDict().at("logits").toTensor().scalar_type(), torch::kFloat);
  torch::jit::Module trained = torch::jit::load(ts_model_path("dict.pt"));
  torch::optim::SGD sgd(amp::parameters(trained), torch::optim::SGDOptions(0.1));
  auto [model, optimizer] = amp::initialize(trained, std::move(sgd), amp::OptLevel::O0);
  EXPECT_EQ(optimizer.properties().opt_level, amp::OptLevel::O0);
  // The cast itself, on every container an IValue output can be.
  c10::impl::GenericDict dict(c10::StringType::get(), c10::TensorType::get());
  dict.insert("a", torch::ones({2}, torch::kBFloat16));
  c10::List<torch::Tensor> list({torch::ones({1}, torch::kBFloat16), torch::ones({1}, torch::kLong)});
  const c10::IValue nested = c10::ivalue::Tuple::create({c10::IValue(dict), c10::IValue(list), c10::IValue(3)});
  const auto cast = amp::detail::cast_ivalue(nested, torch::kFloat).toTuple();
  EXPECT_EQ(cast->elements()[0].toGenericDict().at("a").toTensor().scalar_type(), torch::kFloat);
  EXPECT_EQ(cast->elements()[1].toTensorList().get(0).scalar_type(), torch::kFloat);
  EXPECT_EQ(cast->elements()[1].toTensorList().get(1).scalar_type(), torch::kLong);
  EXPECT_EQ(cast->elements()[2].toInt(), 3);
}

TEST(TorchScriptTest, MisuseGetsClearErrors) {
  SKIP_WITHOUT_MODELS();
  {
    torch::jit::Module frozen = torch::jit::load(ts_model_path("frozen.pt"));
    ASSERT_THROWS_WITH(amp::initialize(frozen, ts_bf16("O2")), "has no parameters");
    ASSERT_THROWS_WITH(amp::initialize(frozen, ts_bf16("O2")), "torch.jit.freeze");
  }
  ASSERT_THROWS_WITH(amp::initialize(torch::jit::load(ts_model_path("dict.pt")), ts_bf16("O2").auto_fp32(8)),
                     "auto_fp32 (8) does not take TorchScript models yet");
  {
    torch::jit::Module half = torch::jit::load(ts_model_path("half.pt"));
    torch::optim::SGD sgd(amp::parameters(half), torch::optim::SGDOptions(0.1));
    ASSERT_THROWS_WITH(amp::initialize(half, std::move(sgd), ts_bf16("O2")),
                       "parameter 'body.weight' is torch.float16: the module was saved after .half()");
  }
  {
    torch::jit::Module no_grad = torch::jit::load(ts_model_path("no_grad.pt"));
    torch::optim::SGD sgd(amp::parameters(no_grad), torch::optim::SGDOptions(0.1));
    ASSERT_THROWS_WITH(amp::initialize(no_grad, std::move(sgd), ts_bf16("O2")),
                       "none of the optimizer's 4 parameters requires grad");
  }
  {
    torch::jit::Module net = torch::jit::load(ts_model_path("dict.pt"));
    torch::optim::SGD sgd(std::vector<torch::Tensor>{torch::zeros({4, 32}, torch::requires_grad())}, torch::optim::SGDOptions(0.1));
    ASSERT_THROWS_WITH(amp::initialize(net, std::move(sgd), ts_bf16("O2")),
                       "is not a parameter of the model");
  }
  {
    torch::jit::Module net = torch::jit::load(ts_model_path("dict.pt"));
    torch::optim::SGD sgd(amp::parameters(net), torch::optim::SGDOptions(0.1));
    auto [model, optimizer] = amp::initialize(net, std::move(sgd), ts_bf16("O2"));
    torch::optim::SGD again(amp::parameters(net), torch::optim::SGDOptions(0.1));
    ASSERT_THROWS_WITH(amp::initialize(net, std::move(again), ts_bf16("O2")),
                       "has already been passed through amp::initialize");
    // A tensor swapped in behind amp's back: the masters and casts no longer reach it.
    net.attr("head").toModule().setattr("weight", torch::zeros({4, 32}, torch::kHalf));
    ASSERT_THROWS_WITH(model(torch::randn({2, 16})), "'head.weight' of the TorchScript module was replaced");
  }
}

TEST(TorchScriptTest, OptimizerCheckpointAndSavedModuleResumeBitwise) {
  SKIP_WITHOUT_MODELS();
  const fs::path dir = ts_dir() / "resume";
  fs::create_directories(dir);
  const amp::Options options = ts_bf16("O2");
  auto make = [&](const std::string& file) {
    torch::jit::Module net = torch::jit::load(file);
    amp::freeze_batchnorm(net);
    torch::optim::SGD sgd(amp::parameters(net), torch::optim::SGDOptions(0.05).momentum(0.9));
    auto init = amp::initialize(net, std::move(sgd), options);
    init.model.train();
    return init;
  };
  auto step = [&](auto& model, auto& optimizer) {
    optimizer.zero_grad();
    const torch::Tensor loss = torch::nn::functional::cross_entropy(model({ts_x()}).toTensor(), ts_y());
    {
      auto scaled = amp::scale_loss(loss, optimizer);
      scaled.backward();
    }
    optimizer.step();
    return loss.item<double>();
  };
  auto straight = make(ts_model_path("resnet_scripted.pt"));
  std::vector<double> straight_losses;
  for (int i = 0; i < 4; ++i) straight_losses.push_back(step(straight.model, straight.optimizer));

  auto first = make(ts_model_path("resnet_scripted.pt"));
  step(first.model, first.optimizer);
  step(first.model, first.optimizer);
  first.model.save((dir / "module.pt").string());
  torch::save(first.optimizer, (dir / "optimizer.pt").string());

  auto resumed = make((dir / "module.pt").string());  // fp32 masters' values: the masters resume exactly
  torch::load(resumed.optimizer, (dir / "optimizer.pt").string());
  for (int i = 2; i < 4; ++i) EXPECT_EQ(step(resumed.model, resumed.optimizer), straight_losses[i]) << "step " << i;
  const auto a = amp::master_params(straight.optimizer), b = amp::master_params(resumed.optimizer);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(amp_test::bitwise_equal(a[i], b[i])) << i;
}

TEST(TorchScriptTest, SavedModuleRunsInPythonWithFp32Weights) {
  SKIP_WITHOUT_MODELS();
  const fs::path dir = ts_dir() / "handback";
  fs::create_directories(dir);
  const TsRun run = [&] {
    torch::jit::Module net = torch::jit::load(ts_model_path("resnet_scripted.pt"));
    amp::freeze_batchnorm(net);
    torch::optim::SGD sgd(amp::parameters(net), torch::optim::SGDOptions(0.05).momentum(0.9));
    auto [model, optimizer] = amp::initialize(net, std::move(sgd), ts_bf16("O2"));
    for (int i = 0; i < 2; ++i) {
      optimizer.zero_grad();
      auto scaled = amp::scale_loss(torch::nn::functional::cross_entropy(model({ts_x()}).toTensor(), ts_y()), optimizer);
      scaled.backward();
      optimizer.step();
    }
    model.save((dir / "finetuned.pt").string());
    TsRun r;
    for (const auto& [name, value] : amp::detail::fp32_state(*amp::detail::jit_mirror(net))) r.state[name] = value.clone();
    return r;
  }();
  // C++ reads it back: fp32 weights equal to the masters, and its eval forward is what Python must compute.
  torch::jit::Module saved = torch::jit::load((dir / "finetuned.pt").string());
  for (const auto& p : saved.named_parameters()) {
    EXPECT_EQ(p.value.scalar_type(), torch::kFloat) << p.name;
    EXPECT_TRUE(amp_test::bitwise_equal(p.value, run.state.at(p.name))) << p.name;
  }
  saved.eval();
  const torch::Tensor logits = saved.forward({ts_x()}).toTensor();
  amp::PythonCheckpoint expected;
  expected.put("logits", logits);
  expected.save((dir / "cpp_logits.pt").string());
  const std::string script =
      "import sys, torch\n"
      "m = torch.jit.load(sys.argv[1]).eval()\n"
      "assert all(p.dtype == torch.float32 for p in m.parameters()), 'not fp32'\n"
      "x = torch.load(sys.argv[2])['x']\n"
      "with torch.no_grad():\n"
      "    out = m(x)\n"
      "ref = torch.load(sys.argv[3])['logits']\n"
      "print('max difference', (out - ref).abs().max().item())\n"
      "sys.exit(0 if torch.allclose(out, ref, rtol=0, atol=1e-5) else 1)\n";
  std::ofstream((dir / "check.py").string()) << script;
  const std::string command = amp_test::python_interpreter() + " '" + (dir / "check.py").string() + "' '" + (dir / "finetuned.pt").string() +
                              "' '" + ts_model_path("data.pt") + "' '" + (dir / "cpp_logits.pt").string() + "' 2>&1";
  EXPECT_EQ(std::system(command.c_str()), 0) << command;
}

TEST(TorchScriptTest, LeanMastersWithAFusedOptimizerSaveTheirFp32Values) {
  SKIP_WITHOUT_MODELS();
  torch::jit::Module net = torch::jit::load(ts_model_path("resnet_scripted.pt"));
  amp::freeze_batchnorm(net);
  amp::optim::FusedSGD sgd(amp::parameters(net), torch::optim::SGDOptions(0.05).momentum(0.9));
  auto [model, optimizer] =
      amp::initialize(net, std::move(sgd), ts_bf16("O2").master_weights_format(amp::MasterWeights::kSplit));
  model.train();
  std::vector<double> losses;
  for (int i = 0; i < 4; ++i) {
    optimizer.zero_grad();
    const torch::Tensor loss = torch::nn::functional::cross_entropy(model({ts_x()}).toTensor(), ts_y());
    losses.push_back(loss.item<double>());
    {
      auto scaled = amp::scale_loss(loss, optimizer);
      scaled.backward();
    }
    optimizer.step();
  }
  EXPECT_LT(losses.back(), losses.front());
  EXPECT_EQ(net.attr("fc").toModule().attr("weight").toTensor().scalar_type(), torch::kBFloat16);
  // The fp32 values the split format keeps (bf16 weight + low 16 bits), in the saved module and in put_model's dict.
  const auto values = amp::detail::fp32_state(*amp::detail::jit_mirror(net));
  const fs::path dir = ts_dir() / "lean";
  fs::create_directories(dir);
  model.save((dir / "module.pt").string());
  amp::PythonCheckpoint out;
  out.put_model("model", net);
  out.save((dir / "state.pt").string());
  const auto saved = torch::jit::load((dir / "module.pt").string());
  const auto state = amp::PythonCheckpoint::load((dir / "state.pt").string()).get("model").toGenericDict();
  const auto saved_state = [&] {
    std::map<std::string, torch::Tensor> m;
    for (const auto& p : saved.named_parameters()) m[p.name] = p.value;
    return m;
  }();
  int differs_from_bf16 = 0;
  for (const auto& [name, value] : values) {
    EXPECT_TRUE(amp_test::bitwise_equal(state.at(name).toTensor(), value)) << name;
    if (!saved_state.count(name)) continue;
    EXPECT_TRUE(amp_test::bitwise_equal(saved_state.at(name), value)) << name;
    differs_from_bf16 += !torch::equal(value, value.to(torch::kBFloat16).to(torch::kFloat));
  }
  EXPECT_GT(differs_from_bf16, 0) << "the saved values are the fp32 ones, not the bf16 weights";
}

TEST(TorchScriptTest, PythonStateDictLoadsIntoTheInitializedModule) {
  SKIP_WITHOUT_MODELS();
  torch::jit::Module net = torch::jit::load(ts_model_path("resnet_scripted.pt"));
  {
    torch::NoGradGuard no_grad;
    for (auto p : net.parameters()) p.zero_();  // not the pretrained values any more
  }
  torch::optim::SGD sgd(amp::parameters(net), torch::optim::SGDOptions(0.05));
  auto [model, optimizer] = amp::initialize(net, std::move(sgd), ts_bf16("O2"));
  ts_data().load_model(*model, "state");
  const auto pretrained = ts_data().get("state").toGenericDict();
  const auto masters = amp::detail::fp32_state(*amp::detail::jit_mirror(net));
  ASSERT_EQ(masters.size(), pretrained.size());
  for (const auto& [name, value] : masters) {
    EXPECT_TRUE(amp_test::bitwise_equal(value, pretrained.at(name).toTensor())) << name;  // masters: exactly
  }
  EXPECT_TRUE(amp_test::bitwise_equal(net.attr("fc").toModule().attr("weight").toTensor(),
                                      pretrained.at("fc.weight").toTensor().to(torch::kBFloat16)));
}
