// Features compose: every opt level and dtype x every pair of features, each cell either works (the same
// behavioural check for all: it trains, an overflowing step is skipped as the level's scaler says, and a resume from
// a checkpoint after step 3 continues bit for bit) or is refused at initialize with a message. The matrix this test
// computes is docs/composition.md's; on the primary build (LibTorch 2.13, CPU) the test fails if the page differs,
// and prints the page it found.
#include <filesystem>
#include <cctype>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <limits>
#include <sstream>
#include <unistd.h>

#include "support.h"

namespace {

namespace fs = std::filesystem;
using amp::MasterWeights;

const char* const kCompositionPage = AMP_SOURCE_DIR "/docs/composition.md";

// A block with a LayerNorm ("norm", the island keep_fp32 names) and Linear layers whose dimensions FP8 can run.
struct ComposeNetImpl : torch::nn::Module {
  explicit ComposeNetImpl(bool checkpointed)
      : checkpointed(checkpointed),
        fc1(register_module("fc1", torch::nn::Linear(16, 32))),
        norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({32})))),
        fc2(register_module("fc2", torch::nn::Linear(32, 16))) {}
  torch::Tensor block(const torch::Tensor& x) { return torch::relu(norm(fc1(x))); }
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor h = checkpointed ? amp::checkpoint([this](const torch::Tensor& in) { return block(in); }, x) : block(x);
    return fc2(h);
  }
  bool checkpointed;
  torch::nn::Linear fc1;
  torch::nn::LayerNorm norm;
  torch::nn::Linear fc2;
};
TORCH_MODULE(ComposeNet);

// kFusedMuon: Muon's recipe, FusedMuon on the two weight matrices and FusedAdamW on the rest, on one loss.
enum class ComposeOptimizer { kSgd, kFusedSgd, kFusedAdamW, kFusedLamb, kFusedMuon };

// What a cell runs: options, the optimizer, and the step's extras.
struct ComposeSetup {
  amp::Options options;
  ComposeOptimizer optimizer = ComposeOptimizer::kSgd;
  bool explicit_optimizer = false;
  bool clip = false;
  bool activation_checkpoint = false;
  bool python_checkpoint = false;
};

struct ComposeFeature {
  std::string name;
  std::function<void(ComposeSetup&)> apply;
};

std::vector<ComposeFeature> compose_features() {
  auto lean = [](MasterWeights format) {
    return [format](ComposeSetup& s) {
      s.options.master_weights_format(format);
      // The lean formats rebuild the fp32 value inside a fused step: a fused optimizer unless the pair names one.
      if (!s.explicit_optimizer) s.optimizer = ComposeOptimizer::kFusedAdamW;
    };
  };
  // bf16 moments (optimizer_state_format bf16): an Adam-family fused optimizer unless the pair names another.
  auto bf16_states = [](ComposeSetup& s) {
    s.options.optimizer_state_format(amp::OptimizerStateFormat::kBf16);
    if (!s.explicit_optimizer) s.optimizer = ComposeOptimizer::kFusedAdamW;
  };
  auto optimizer = [](ComposeOptimizer o) {
    return [o](ComposeSetup& s) {
      s.optimizer = o;
      s.explicit_optimizer = true;
    };
  };
  return {
      {"keep_fp32", [](ComposeSetup& s) { s.options.keep_fp32({"norm"}); }},
      {"auto_fp32", [](ComposeSetup& s) { s.options.auto_fp32(8); }},
      {"master split", lean(MasterWeights::kSplit)},
      {"master kahan", lean(MasterWeights::kKahan)},
      {"master stochastic", lean(MasterWeights::kStochasticRounding)},
      {"master residual8", lean(MasterWeights::kResidual8)},
      {"bf16 states", bf16_states},
      {"fp8", [](ComposeSetup& s) { s.options.fp8(); }},
      {"clip_grad_norm_", [](ComposeSetup& s) { s.clip = true; }},
      {"FusedSGD", optimizer(ComposeOptimizer::kFusedSgd)},
      {"FusedAdamW", optimizer(ComposeOptimizer::kFusedAdamW)},
      {"FusedLAMB", optimizer(ComposeOptimizer::kFusedLamb)},
      {"FusedMuon", optimizer(ComposeOptimizer::kFusedMuon)},
      {"amp::checkpoint", [](ComposeSetup& s) { s.activation_checkpoint = true; }},
      {"Python checkpoint", [](ComposeSetup& s) { s.python_checkpoint = true; }},
  };
}

struct ComposeBase {
  std::string name;
  const char* level;
  c10::ScalarType dtype;
};

std::vector<ComposeBase> compose_bases() {
  return {{"O0", "O0", torch::kBFloat16},      {"O1 bf16", "O1", torch::kBFloat16}, {"O1 fp16", "O1", torch::kHalf},
          {"O2 bf16", "O2", torch::kBFloat16}, {"O2 fp16", "O2", torch::kHalf},     {"O3 bf16", "O3", torch::kBFloat16}};
}

// One training run of a cell: the net, the amp pair, and its step.
class ComposeRun {
 public:
  explicit ComposeRun(const ComposeSetup& setup) : setup_(setup) {
    torch::manual_seed(3);
    net_ = ComposeNet(setup.activation_checkpoint);
    const auto params = net_->parameters();
    switch (setup.optimizer) {
      case ComposeOptimizer::kSgd:
        init(torch::optim::SGD(params, torch::optim::SGDOptions(0.05).momentum(0.9)));
        break;
      case ComposeOptimizer::kFusedSgd:
        init(amp::optim::FusedSGD(params, torch::optim::SGDOptions(0.05).momentum(0.9)));
        break;
      case ComposeOptimizer::kFusedAdamW:
        init(amp::optim::FusedAdamW(params, torch::optim::AdamWOptions(1e-2).eps(1e-4)));
        break;
      case ComposeOptimizer::kFusedLamb:
        init(amp::optim::FusedLAMB(params, amp::optim::FusedLAMBOptions(1e-2).eps(1e-4)));
        break;
      case ComposeOptimizer::kFusedMuon: {
        std::vector<torch::Tensor> matrices, rest;
        for (const auto& p : params) (p.dim() == 2 ? matrices : rest).push_back(p);
        init(amp::optim::FusedMuon(matrices, amp::optim::FusedMuonOptions(0.02)),
             amp::optim::FusedAdamW(rest, torch::optim::AdamWOptions(1e-2).eps(1e-4)));
        break;
      }
    }
  }

  /// One step on batch `i`; `overflow` multiplies the loss by inf. Returns the loss.
  torch::Tensor step(int i, bool overflow = false) {
    torch::manual_seed(100 + i);
    const auto x = torch::randn({8, 16}), target = torch::randn({8, 16});
    zero_grad_();
    torch::Tensor loss = (forward_(x).to(torch::kFloat) - target).pow(2).mean();
    const torch::Tensor reported = loss.detach().clone();
    if (overflow) loss = loss * std::numeric_limits<float>::infinity();
    amp::scale_loss(loss, all_).backward();
    if (setup_.clip) {
      for (auto* o : all_) amp::clip_grad_norm_(*o, 1.0);
    }
    step_();
    return reported;
  }

  void save(std::stringstream& model_bytes, std::stringstream& optimizer_bytes, const fs::path& python_file) {
    if (setup_.python_checkpoint) {
      amp::PythonCheckpoint out;
      out.put_model("model", *net_);
      for (size_t i = 0; i < all_.size(); ++i) out.put_optimizer("optimizer" + std::to_string(i), *all_[i]);
      out.put_amp("amp", *base_);
      out.save(python_file.string());
      return;
    }
    torch::save(net_, model_bytes);
    save_(optimizer_bytes);
  }

  void load(std::stringstream& model_bytes, std::stringstream& optimizer_bytes, const fs::path& python_file) {
    if (setup_.python_checkpoint) {
      const auto in = amp::PythonCheckpoint::load(python_file.string());
      in.load_model(*net_);
      for (size_t i = 0; i < all_.size(); ++i) in.load_optimizer(*all_[i], "optimizer" + std::to_string(i));
      in.load_amp(*base_);
      return;
    }
    torch::load(net_, model_bytes);
    load_(optimizer_bytes);
  }

  std::vector<torch::Tensor> parameters() const {
    std::vector<torch::Tensor> out;
    for (const auto& p : net_->parameters()) out.push_back(p.detach().clone());
    return out;
  }
  amp::OptimizerBase& optimizer() { return *base_; }

 private:
  // One optimizer, or several on one loss (their archives side by side in one).
  template <class... Opts>
  void init(Opts... optimizers) {
    auto initialized = std::make_shared<decltype(amp::initialize(std::make_tuple(net_), std::make_tuple(std::move(optimizers)...),
                                                                 setup_.options))>(
        amp::initialize(std::make_tuple(net_), std::make_tuple(std::move(optimizers)...), setup_.options));
    holder_ = initialized;
    auto& models = initialized->models;
    auto& opts = initialized->optimizers;
    all_ = std::apply([](auto&... o) { return std::vector<amp::OptimizerBase*>{&o...}; }, opts);
    base_ = all_.front();
    forward_ = [&model = std::get<0>(models)](const torch::Tensor& x) { return model(x); };
    zero_grad_ = [&opts] { std::apply([](auto&... o) { (o.zero_grad(), ...); }, opts); };
    step_ = [&opts] { std::apply([](auto&... o) { (o.step(), ...); }, opts); };
    save_ = [&opts](std::stringstream& s) {
      torch::serialize::OutputArchive archive;
      size_t i = 0;
      auto save_one = [&](auto& o) {
        torch::serialize::OutputArchive one;
        o.save(one);
        archive.write("optimizer" + std::to_string(i++), one);
      };
      std::apply([&](auto&... o) { (save_one(o), ...); }, opts);
      archive.save_to(s);
    };
    load_ = [&opts](std::stringstream& s) {
      torch::serialize::InputArchive archive;
      archive.load_from(s);
      size_t i = 0;
      auto load_one = [&](auto& o) {
        torch::serialize::InputArchive one;
        archive.read("optimizer" + std::to_string(i++), one);
        o.load(one);
      };
      std::apply([&](auto&... o) { (load_one(o), ...); }, opts);
    };
  }

  ComposeSetup setup_;
  ComposeNet net_{nullptr};
  std::shared_ptr<void> holder_;
  amp::OptimizerBase* base_ = nullptr;
  std::vector<amp::OptimizerBase*> all_;
  std::function<torch::Tensor(const torch::Tensor&)> forward_;
  std::function<void()> zero_grad_, step_;
  std::function<void(std::stringstream&)> save_, load_;
};

// The first sentence of an initialize error, without the "amp::initialize: " / "amp::Options: " prefix.
std::string compose_reason(const std::string& message) {
  std::string m = message.substr(0, message.find('\n'));
  if (const auto colon = m.find(": "); colon != std::string::npos && colon < 24) m = m.substr(colon + 2);
  if (const auto stop = m.find(". "); stop != std::string::npos) m = m.substr(0, stop + 1);
  return m;
}

// Runs one cell: "works"; "refused: <reason>" when initialize (or the checkpoint format) refuses the combination
// with a message; "FAILS" with a test failure naming what broke.
std::string compose_cell(const ComposeBase& base, const std::vector<const ComposeFeature*>& features, const fs::path& dir) {
  ComposeSetup setup{amp::Options(base.level).low_precision_dtype(base.dtype).verbosity(0)};
  for (const auto* f : features) f->apply(setup);
  std::string where = base.name;
  for (const auto* f : features) where += " + " + f->name;
  std::string failure;
  auto check = [&](bool ok, const std::string& what) {
    if (!ok && failure.empty()) failure = what;
  };
  std::unique_ptr<ComposeRun> run;
  try {
    run = std::make_unique<ComposeRun>(setup);
  } catch (const std::exception& e) {
    return "refused: " + compose_reason(amp_test::message(e));
  }
  try {
    const auto initial = run->parameters();
    const bool dynamic = run->optimizer().properties().loss_scale.is_dynamic();
    std::vector<torch::Tensor> losses;
    for (int i = 0; i < 4; ++i) losses.push_back(run->step(i, /*overflow=*/i == 1 && dynamic));
    for (int i : {0, 2, 3}) check(std::isfinite(losses[i].item<double>()), "step " + std::to_string(i) + "'s loss is not finite");
    check(run->optimizer().skipped_steps() == (dynamic ? 1 : 0), "skipped " + std::to_string(run->optimizer().skipped_steps()) + " steps");
    const auto trained = run->parameters();
    bool moved = false;
    for (size_t i = 0; i < trained.size(); ++i) moved = moved || !amp_test::bitwise_equal(initial[i], trained[i]);
    check(moved, "training changed no parameter");

    std::stringstream model_bytes, optimizer_bytes;
    const fs::path python_file = dir / "composition.pt";
    try {
      run->save(model_bytes, optimizer_bytes, python_file);
    } catch (const std::exception& e) {
      return "refused: " + compose_reason(amp_test::message(e));
    }
    std::vector<torch::Tensor> expected;
    for (int i = 4; i < 6; ++i) expected.push_back(run->step(i));
    ComposeRun resumed(setup);
    resumed.load(model_bytes, optimizer_bytes, python_file);
    // A Python checkpoint holds each parameter's fp32 value (what torch.load gives Python); Kahan's and residual8's bf16
    // weights are rounded again from it (a value halfway between two weights may take the other one), and stochastic
    // rounding's generator starts afresh: close, not bitwise.
    const MasterWeights format = run->optimizer().properties().master_weights_format;
    const bool bitwise = !setup.python_checkpoint ||
                         (format != MasterWeights::kKahan && format != MasterWeights::kStochasticRounding &&
                          format != MasterWeights::kResidual8);
    auto same = [&](const torch::Tensor& a, const torch::Tensor& b) {
      if (bitwise) return amp_test::bitwise_equal(a, b);
      // Each element within 4 bf16 ulps of its own magnitude (two steps, each rounded either way), or 1e-3.
      const auto x = a.to(torch::kDouble), y = b.to(torch::kDouble);
      return a.sizes() == b.sizes() && ((x - y).abs() <= y.abs() * std::ldexp(1.0, -6) + 1e-3).all().item<bool>();
    };
    for (int i = 4; i < 6; ++i) check(same(resumed.step(i), expected[i - 4]), "resumed step " + std::to_string(i) + " differs");
    const auto a = run->parameters(), b = resumed.parameters();
    for (size_t i = 0; i < a.size(); ++i) {
      check(same(a[i], b[i]), "resumed parameter " + std::to_string(i) + " differs by up to " +
                                  std::to_string((a[i].to(torch::kDouble) - b[i].to(torch::kDouble)).abs().max().item<double>()));
    }
    if (failure.empty() && !bitwise) return "works (resumes within bf16 rounding)";
  } catch (const std::exception& e) {
    failure = "threw: " + amp_test::message(e).substr(0, 300);
  }
  if (failure.empty()) return "works";
  ADD_FAILURE() << where << ": " << failure;
  return "FAILS";
}

// The page's matrix: one row per feature and pair, one column per base; refusals numbered below the table.
std::string compose_matrix(const std::vector<std::pair<std::string, std::vector<std::string>>>& rows,
                           const std::vector<ComposeBase>& bases) {
  std::map<std::string, int> reasons;
  std::vector<std::string> reason_list;
  std::ostringstream table;
  table << "| features |";
  for (const auto& b : bases) table << " " << b.name << " |";
  table << "\n|---|";
  for (size_t i = 0; i < bases.size(); ++i) table << "---|";
  table << "\n";
  for (const auto& [name, cells] : rows) {
    table << "| " << name << " |";
    for (const auto& cell : cells) {
      if (cell.rfind("refused: ", 0) == 0) {
        const std::string reason = cell.substr(9);
        auto it = reasons.find(reason);
        if (it == reasons.end()) {
          it = reasons.emplace(reason, static_cast<int>(reason_list.size()) + 1).first;
          reason_list.push_back(reason);
        }
        table << " refused (" << it->second << ") |";
      } else {
        table << " " << cell << " |";
      }
    }
    table << "\n";
  }
  table << "\nRefusals:\n\n";
  for (size_t i = 0; i < reason_list.size(); ++i) table << (i + 1) << ". " << reason_list[i] << "\n";
  return table.str();
}

// docs/reliability.md says how many mistakes docs/errors.md lists: the number of its rows.
TEST(DocsTest, ReliabilityPageCountsTheRowsOfErrorsMd) {
  std::ifstream errors(AMP_SOURCE_DIR "/docs/errors.md"), reliability(AMP_SOURCE_DIR "/docs/reliability.md");
  std::string line;
  int rows = 0;
  while (std::getline(errors, line)) {
    if (line.size() > 3 && line.rfind("| ", 0) == 0 && std::isdigit(static_cast<unsigned char>(line[2]))) ++rows;
  }
  std::stringstream text;
  text << reliability.rdbuf();
  EXPECT_NE(text.str().find("lists " + std::to_string(rows) + " mistakes"), std::string::npos)
      << "docs/errors.md has " << rows << " rows; docs/reliability.md should say so";
}


}  // namespace

TEST(CompositionTest, EveryLevelAndPairOfFeaturesWorksOrIsRefused) {
  SKIP_WITHOUT_CPU_KERNELS(torch::kHalf);
  const fs::path dir = fs::path(::testing::TempDir()) / ("amp_composition_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const auto features = compose_features();
  const auto bases = compose_bases();
  std::vector<std::vector<const ComposeFeature*>> combos = {{}};
  for (size_t i = 0; i < features.size(); ++i) combos.push_back({&features[i]});
  for (size_t i = 0; i < features.size(); ++i) {
    for (size_t j = i + 1; j < features.size(); ++j) {
      const bool two_optimizers = features[i].name.rfind("Fused", 0) == 0 && features[j].name.rfind("Fused", 0) == 0;
      if (!two_optimizers) combos.push_back({&features[i], &features[j]});
    }
  }
  std::vector<std::pair<std::string, std::vector<std::string>>> rows;
  int works = 0, refused = 0;
  for (const auto& combo : combos) {
    std::string name = combo.empty() ? "(the level alone)" : combo[0]->name;
    if (combo.size() > 1) name += " + " + combo[1]->name;
    std::vector<std::string> cells;
    for (const auto& base : bases) {
      cells.push_back(compose_cell(base, combo, dir));
      if (cells.back().rfind("works", 0) == 0) ++works;
      if (cells.back().rfind("refused", 0) == 0) ++refused;
    }
    rows.emplace_back(name, std::move(cells));
  }
  fs::remove_all(dir);
  std::cout << "[ measured ] " << works << " cells work, " << refused << " are refused" << std::endl;
  const std::string matrix = compose_matrix(rows, bases);

  if (std::string(TORCH_VERSION) != "2.13.0" || amp_test::built_with_cuda()) return;  // the page is the primary build's
  std::ifstream page(kCompositionPage);
  std::stringstream text;
  text << page.rdbuf();
  const std::string begin = "<!-- composition matrix: tests/composition_test.cpp -->\n", end = "<!-- end of matrix -->";
  const auto from = text.str().find(begin), to = text.str().find(end);
  ASSERT_TRUE(from != std::string::npos && to != std::string::npos) << kCompositionPage << " lacks the matrix markers";
  EXPECT_EQ(text.str().substr(from + begin.size(), to - from - begin.size()), matrix + "\n")
      << "docs/composition.md is out of date; the matrix is now:\n" << matrix;
}
