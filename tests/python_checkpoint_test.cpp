// Checkpoints shared with Python (issue #12): a run started in Python (torch.autocast + GradScaler at O1,
// Apex's O2 layout at O2) continues in C++ and goes back to Python, with SGD(momentum) and Adam, bf16 and
// fp16. tests/python/python_checkpoint.py is the Python side; both sides draw the same batches from the
// same file, so their continuations can be compared number by number. Then every kind of bad file: each
// a clear error naming the key, with the model, the optimizer and the loss scale unchanged.
#include <caffe2/serialize/inline_container.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>
#include <sstream>

#include <unistd.h>

#include "support/support.h"
#include "support/training.h"

namespace {

namespace fs = std::filesystem;
using amp_test::dtype_label;

const char* const kScript = AMP_SOURCE_DIR "/tests/python/python_checkpoint.py";

// Returns why Python with torch cannot run here, or an empty string.
const std::string& python_missing() {
  static const std::string why = [] {
    if (amp_test::python_has_torch()) return std::string();
    return "'" + amp_test::python_interpreter() + " -c \"import torch\"' failed: these tests need Python with the torch wheel "
           "(set AMP_PYTHON to its interpreter)";
  }();
  return why;
}

#define SKIP_WITHOUT_PYTHON_TORCH()                          \
  do {                                                       \
    if (!python_missing().empty()) GTEST_SKIP() << python_missing(); \
  } while (0)

// Runs the Python side; fails the test with its output if it fails.
::testing::AssertionResult run_python(const std::string& args) {
  const std::string command = amp_test::python_interpreter() + " '" + kScript + "' " + args + " 2>&1";
  FILE* pipe = popen(command.c_str(), "r");
  if (!pipe) return ::testing::AssertionFailure() << "cannot run " << command;
  std::string output;
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof buffer, pipe)) > 0) output.append(buffer, n);
  const int status = pclose(pipe);
  if (status != 0) return ::testing::AssertionFailure() << command << " failed:\n" << output;
  return ::testing::AssertionSuccess();
}

fs::path fresh_dir(const std::string& name) {
  const fs::path dir = fs::path(::testing::TempDir()) / ("amp_python_checkpoint_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// The Python script's Net, same names: fc1 -> bn -> relu -> fc2.
struct PyNetImpl : torch::nn::Module {
  PyNetImpl()
      : fc1(register_module("fc1", torch::nn::Linear(torch::nn::LinearOptions(8, 16).bias(false)))),
        bn(register_module("bn", torch::nn::BatchNorm1d(16))),
        fc2(register_module("fc2", torch::nn::Linear(16, 4))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(bn(fc1(x)))); }
  torch::nn::Linear fc1;
  torch::nn::BatchNorm1d bn;
  torch::nn::Linear fc2;
};
TORCH_MODULE(PyNet);

constexpr int kN = 4, kM = 4, kK = 3;  // as in python_checkpoint.py
constexpr int kGrowthInterval = 3;

// The fp32 state_dict amp writes for `module` (masters where there are masters).
c10::impl::GenericDict fp32_state(torch::nn::Module& module) {
  amp::PythonCheckpoint tmp;
  tmp.put_model("m", module);
  return tmp.get("m").toGenericDict();
}

// The largest |a - b| over the floating tensors of two state_dicts with the same keys.
// Integer tensors (BatchNorm's num_batches_tracked) must be equal unless `moved_only`.
double max_abs_diff(const c10::impl::GenericDict& a, const c10::impl::GenericDict& b, std::string* worst = nullptr,
                    bool moved_only = false) {
  EXPECT_EQ(a.size(), b.size());
  double out = 0.0;
  for (const auto& item : a) {
    if (!b.contains(item.key())) {
      ADD_FAILURE() << "missing " << item.key().toStringRef();
      continue;
    }
    const auto x = item.value().toTensor(), y = b.at(item.key()).toTensor();
    EXPECT_EQ(x.sizes(), y.sizes()) << item.key().toStringRef();
    if (!x.is_floating_point()) {
      if (!moved_only) EXPECT_TRUE(torch::equal(x, y)) << item.key().toStringRef();
      continue;
    }
    const double d = (x.to(torch::kDouble) - y.to(torch::kDouble)).abs().max().item<double>();
    if (d > out) {
      out = d;
      if (worst) *worst = item.key().toStringRef();
    }
  }
  return out;
}

struct Case {
  const char* optimizer;  // "sgd" | "adam"
  const char* level;      // "O1" | "O2"
  c10::ScalarType dtype;
};

std::string case_id(const Case& c) { return std::string(c.optimizer) + "-" + c.level + "-" + dtype_label(c.dtype); }

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  std::string s = case_id(info.param);
  for (auto& ch : s) {
    if (ch == '-') ch = '_';
  }
  return s;
}

// NOTE [Tolerance of the Python/C++ continuations]
// Both sides start from the same file and see the same batches in the same order. With the LibTorch
// of the torch wheel Python runs (same version), they also run the same ATen kernels: SGD continues
// bitwise, and Adam differs only where LibTorch updates exp_avg with mul_+add_ and Python with lerp_,
// one fp32 rounding per step (measured: at most 6e-8 after 4 steps); kSameKernels bounds that with
// room for a few more roundings. With another LibTorch (Debian's 1.13 beside the 2.13 wheel: other GEMM
// and reduction kernels, other accumulation orders), a low-precision activation can round the other
// way (2^-8 relative in bf16) in any step, and lr (0.05 SGD, 0.01 Adam) times the resulting gradient
// difference enters the weights each step: kOtherKernels. Both are far below what a real mismatch
// does (a lost momentum buffer, a wrong Adam step count, another loss scale or learning rate moves
// the weights by 1e-2 or more; the continuation itself moves them by ~0.2, checked below).
constexpr double kSameKernels = 1e-6;
constexpr double kOtherKernels = 2e-3;

double tolerance(const std::string& python_torch_version) {
  const std::string python_version = python_torch_version.substr(0, python_torch_version.find('+'));
  return python_version == TORCH_VERSION ? kSameKernels : kOtherKernels;
}

// `make_optimizer` builds the C++ optimizer with placeholder hyperparameters: the file's must win.
template <class MakeOptimizer>
void resume_python_run(const Case& c, MakeOptimizer make_optimizer) {
  const std::string id = case_id(c);
  const fs::path dir = fresh_dir(id);
  ASSERT_TRUE(run_python("train --case " + id + " --dir '" + dir.string() + "'"));
  const auto data = amp::PythonCheckpoint::load((dir / "data.pt").string());
  const auto xs = data.get("x").toTensor(), ys = data.get("y").toTensor();

  PyNet net;
  const bool o1 = std::string(c.level) == "O1";
  auto [model, optimizer] = amp::initialize(net, make_optimizer(net->parameters()),
                                            amp::Options(c.level).low_precision_dtype(c.dtype)
                                                .growth_interval(kGrowthInterval).verbosity(0));
  auto train = [&, &model = model, &optimizer = optimizer](int from, int to) {
    model.train();
    for (int i = from; i < to; ++i) amp_test::train_step(model, optimizer, xs[i], ys[i]);
  };

  // Python -> C++: the standard calls' files, read with the standard names.
  const auto ck = amp::PythonCheckpoint::load((dir / "python.pt").string());
  EXPECT_EQ(ck.get("step").toInt(), kN);
  ASSERT_THROWS_WITH(ck.get("args"), "holds a Python object of type argparse.Namespace");
  ck.load_model(*model);
  ck.load_optimizer(optimizer);
  const char* amp_key = o1 ? "scaler" : "amp";
  ck.load_amp(optimizer, amp_key);
  // The loss scale and its counter are the file's: an overflow at step 1 halved it, 2 clean steps since.
  const auto scaler_state = ck.get(amp_key).toGenericDict();
  const double file_scale = o1 ? scaler_state.at("scale").toDouble()
                               : scaler_state.at("loss_scaler0").toGenericDict().at("loss_scale").toDouble();
  const int64_t file_unskipped = o1 ? scaler_state.at("_growth_tracker").toInt()
                                    : scaler_state.at("loss_scaler0").toGenericDict().at("unskipped").toInt();
  EXPECT_EQ(file_scale, 32768.0);
  EXPECT_EQ(file_unskipped, 2);
  EXPECT_EQ(amp::loss_scale(optimizer), file_scale);
  EXPECT_EQ(optimizer.loss_scaler().unskipped(), file_unskipped);
  // The file's hyperparameters won over the placeholder ones.
  EXPECT_DOUBLE_EQ(optimizer.param_groups()[0].options().get_lr(), std::string(c.optimizer) == "sgd" ? 0.05 : 0.01);

  const auto loaded = fp32_state(*model);
  train(kN, kN + kM);
  const auto python_continued = amp::PythonCheckpoint::load((dir / "python_continued.pt").string());
  const double tol = tolerance(python_continued.get("torch_version").toStringRef());
  const double moved = max_abs_diff(loaded, fp32_state(*model), nullptr, /*moved_only=*/true);
  EXPECT_GT(moved, 50 * tol) << "the continuation must move the weights far more than the tolerance";
  std::string worst;
  const double diff = max_abs_diff(fp32_state(*model), python_continued.get("params").toGenericDict(), &worst);
  std::cout << "[ measured ] " << id << ": Python -> C++, " << kM << " steps (weights moved up to " << moved
            << "): max |C++ - Python| = " << diff << (worst.empty() ? "" : " (" + worst + ")") << ", tolerance " << tol
            << std::endl;
  ::testing::Test::RecordProperty("python_to_cpp_max_abs_diff", std::to_string(diff));
  EXPECT_LT(diff, tol);
  EXPECT_EQ(amp::loss_scale(optimizer), python_continued.get("scale").toDouble());
  EXPECT_EQ(optimizer.loss_scaler().unskipped(), python_continued.get("unskipped").toInt());

  // C++ -> Python: C++ saves, goes on K steps; Python loads with load_state_dict and does the same K.
  amp::PythonCheckpoint out;
  out.put_model("model", *model);
  out.put_optimizer("optimizer", optimizer);
  if (o1) {
    out.put_grad_scaler("scaler", optimizer);
  } else {
    out.put_amp("amp", optimizer);
  }
  out.put("step", int64_t{kN + kM});
  out.save((dir / "cpp.pt").string());
  train(kN + kM, kN + kM + kK);
  ASSERT_TRUE(run_python("resume --case " + id + " --dir '" + dir.string() + "'"));
  const auto python_from_cpp = amp::PythonCheckpoint::load((dir / "python_from_cpp.pt").string());
  worst.clear();
  const double back = max_abs_diff(fp32_state(*model), python_from_cpp.get("params").toGenericDict(), &worst);
  std::cout << "[ measured ] " << id << ": C++ -> Python, " << kK << " steps: max |C++ - Python| = " << back
            << (worst.empty() ? "" : " (" + worst + ")") << std::endl;
  ::testing::Test::RecordProperty("cpp_to_python_max_abs_diff", std::to_string(back));
  EXPECT_LT(back, tol);
  EXPECT_EQ(amp::loss_scale(optimizer), python_from_cpp.get("scale").toDouble());
  EXPECT_EQ(optimizer.loss_scaler().unskipped(), python_from_cpp.get("unskipped").toInt());
  fs::remove_all(dir);
}

class PythonRoundTripTest : public ::testing::TestWithParam<Case> {};

}  // namespace

TEST_P(PythonRoundTripTest, ContinuesPythonRunAndHandsItBack) {
  const Case c = GetParam();
  SKIP_WITHOUT_CPU_KERNELS(c.dtype);
  SKIP_WITHOUT_PYTHON_TORCH();
  if (std::string(c.optimizer) == "sgd") {
    resume_python_run(c, [](std::vector<torch::Tensor> params) {
      return torch::optim::SGD(std::move(params), torch::optim::SGDOptions(1.0).momentum(0.5));
    });
  } else {
    resume_python_run(c, [](std::vector<torch::Tensor> params) {
      return torch::optim::Adam(std::move(params), torch::optim::AdamOptions(1.0));
    });
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, PythonRoundTripTest,
                         ::testing::Values(Case{"sgd", "O1", torch::kBFloat16}, Case{"adam", "O1", torch::kBFloat16},
                                           Case{"sgd", "O2", torch::kBFloat16}, Case{"adam", "O2", torch::kBFloat16},
                                           Case{"sgd", "O1", torch::kHalf}, Case{"adam", "O1", torch::kHalf},
                                           Case{"sgd", "O2", torch::kHalf}, Case{"adam", "O2", torch::kHalf}),
                         case_name);

namespace {

struct Snapshot {
  std::vector<torch::Tensor> tensors;
  size_t state_entries;
  double scale;
  int64_t unskipped;
  double lr;
};

template <class Opt>
Snapshot snapshot(PyNet& net, amp::Optimizer<Opt>& optimizer) {
  Snapshot s;
  for (const auto& t : net->parameters()) s.tensors.push_back(t.detach().clone());
  for (const auto& t : net->buffers()) s.tensors.push_back(t.detach().clone());
  for (const auto& t : amp::master_params(optimizer)) s.tensors.push_back(t.detach().clone());
  s.state_entries = optimizer.state().size();
  s.scale = amp::loss_scale(optimizer);
  s.unskipped = optimizer.loss_scaler().unskipped();
  s.lr = optimizer.param_groups()[0].options().get_lr();
  return s;
}

template <class Opt>
void expect_unchanged(const Snapshot& before, PyNet& net, amp::Optimizer<Opt>& optimizer) {
  const Snapshot after = snapshot(net, optimizer);
  ASSERT_EQ(before.tensors.size(), after.tensors.size());
  for (size_t i = 0; i < before.tensors.size(); ++i) {
    EXPECT_TRUE(amp_test::bitwise_equal(before.tensors[i], after.tensors[i])) << "tensor " << i << " changed";
  }
  EXPECT_EQ(before.state_entries, after.state_entries);
  EXPECT_EQ(before.scale, after.scale);
  EXPECT_EQ(before.unskipped, after.unskipped);
  EXPECT_EQ(before.lr, after.lr);
}

void write_file(const fs::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

}  // namespace

TEST(PythonCheckpointTest, BadFilesAreClearErrorsAndChangeNothing) {
  SKIP_WITHOUT_PYTHON_TORCH();
  const fs::path dir = fresh_dir("bad");
  ASSERT_TRUE(run_python("bad --dir '" + dir.string() + "'"));
  auto path = [&](const char* name) { return (dir / name).string(); };

  PyNet net;
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  auto [model, optimizer] = amp::initialize(net, std::move(sgd), amp::Options("O2").low_precision_dtype(torch::kBFloat16)
                                                                     .verbosity(0));
  {  // a step, so that there is optimizer state to keep
    optimizer.zero_grad();
    auto loss = model(torch::randn({4, 8})).pow(2).mean();
    auto scaled = amp::scale_loss(loss, optimizer);
    scaled.backward();
  }
  optimizer.step();
  const Snapshot before = snapshot(net, optimizer);

  // A tensor instead of a dict: the file, then the entry.
  ASSERT_THROWS_WITH(amp::PythonCheckpoint::load(path("tensor.pt")), "holds a tensor, not a dict");
  ASSERT_THROWS_WITH(amp::PythonCheckpoint::load(path("model_is_tensor.pt")).load_model(*model),
                     "entry 'model' of '" + path("model_is_tensor.pt") + "' is a tensor, not a state_dict");
  // A missing entry, a missing key, a wrong shape (on the last layer: nothing before it may be written).
  const auto missing = amp::PythonCheckpoint::load(path("missing_key.pt"));
  ASSERT_THROWS_WITH(missing.load_model(*model, "state_dict"), "has no entry 'state_dict' (it has 'model')");
  ASSERT_THROWS_WITH(missing.load_model(*model), "Missing key(s) in the checkpoint: 'fc2.bias'");
  ASSERT_THROWS_WITH(amp::PythonCheckpoint::load(path("wrong_shape.pt")).load_model(*model),
                     "'fc2.weight' has shape [4, 5] in the checkpoint and [4, 16] in the model");
  // DDP's "module." prefix: the error says how to map it.
  const auto ddp = amp::PythonCheckpoint::load(path("ddp.pt"));
  ASSERT_THROWS_WITH(ddp.load_model(*model), "pass amp::PythonCheckpointLoadOptions().strip_prefix(\"module.\")");
  // A bare state_dict: the error says to use the empty key.
  const auto bare = amp::PythonCheckpoint::load(path("bare_state_dict.pt"));
  ASSERT_THROWS_WITH(bare.load_model(*model), "Load it with an empty key: load_model(module, \"\")");
  // Another optimizer type; a state tensor of the wrong shape (parameter 3, after three good ones).
  ASSERT_THROWS_WITH(amp::PythonCheckpoint::load(path("adam.pt")).load_optimizer(optimizer),
                     "was saved from torch.optim.Adam");
  ASSERT_THROWS_WITH(amp::PythonCheckpoint::load(path("sgd_wrong_shape.pt")).load_optimizer(optimizer),
                     "'momentum_buffer' of param group 0, parameter 3 ('fc2.weight') has shape [7]");
  // GradScaler dicts: a missing field, another growth_interval.
  ASSERT_THROWS_WITH(amp::PythonCheckpoint::load(path("scaler_missing_field.pt")).load_amp(optimizer, "scaler"),
                     "entry 'scaler' has no '_growth_tracker'");
  ASSERT_THROWS_WITH(amp::PythonCheckpoint::load(path("scaler_bad_backoff.pt")).load_amp(optimizer, "scaler"),
                     "entry 'scaler'['backoff_factor'] is 2.0; a GradScaler's backoff_factor is in (0, 1)");
  ASSERT_THROWS_WITH(amp::PythonCheckpoint::load(path("sgd.pt")).load_amp(optimizer, "optimizer"),
                     "is neither Apex's amp.state_dict()");
  expect_unchanged(before, net, optimizer);

  // The same files, used right, load.
  ddp.load_model(*model, "model", amp::PythonCheckpointLoadOptions().strip_prefix("module."));
  const auto loaded = fp32_state(*model);
  const auto expected = bare.get("fc1.weight").toTensor();
  EXPECT_TRUE(torch::equal(loaded.at("fc1.weight").toTensor(), expected));
  bare.load_model(*model, "");
  amp::PythonCheckpoint::load(path("protocol4.pt")).load_model(*model);
  amp::PythonCheckpoint::load(path("sgd.pt")).load_optimizer(optimizer);
  EXPECT_EQ(optimizer.state().size(), 5u);
  missing.load_model(*model, "model", amp::PythonCheckpointLoadOptions().strict(false));
  // A GradScaler state brings its schedule, as torch's GradScaler.load_state_dict (issue 19: was refused).
  EXPECT_EQ(optimizer.loss_scaler().growth_interval(), 2000);
  amp::PythonCheckpoint::load(path("scaler_interval.pt")).load_amp(optimizer, "scaler");
  EXPECT_EQ(optimizer.loss_scaler().growth_interval(), 100);
  EXPECT_EQ(optimizer.properties().growth_interval, 100);
  EXPECT_EQ(optimizer.loss_scaler().unskipped(), 0);
  // torch::save records the schedule the scaler runs, so a resume must ask for the same one.
  std::stringstream archive;
  torch::save(optimizer, archive);
  PyNet net2;
  torch::optim::SGD sgd2(net2->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  auto [model2, optimizer2] = amp::initialize(net2, std::move(sgd2), amp::Options("O2").low_precision_dtype(torch::kBFloat16)
                                                                         .verbosity(0));
  ASSERT_THROWS_WITH(torch::load(optimizer2, archive), "saved with growth_interval = 100.0");
  fs::remove_all(dir);
}

TEST(PythonCheckpointTest, FilesThatAreNotPythonCheckpointsAreClearErrors) {
  const fs::path dir = fresh_dir("not_python");
  auto path = [&](const char* name) { return (dir / name).string(); };
  // Not a pickle, not a zip, not torch.save's zip.
  write_file(dir / "text.pt", "hello, not a checkpoint\n");
  ASSERT_THROWS_WITH(amp::PythonCheckpoint::load(path("text.pt")), "is not a file written by Python's torch.save");
  ASSERT_THROWS_WITH(amp::PythonCheckpoint::load(path("nonexistent.pt")), "cannot open");
  {
    std::ofstream file(dir / "garbage_pickle.pt", std::ios::binary);
    caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, size_t size) -> size_t {
      file.write(static_cast<const char*>(data), static_cast<std::streamsize>(size));
      return size;
    });
    const std::string junk = "\x80\x02}q\x00(X\x05\x00\x00\x00modelq\x01\xff";
    writer.writeRecord("data.pkl", junk.data(), junk.size());
    writer.writeEndOfFile();
  }
  ASSERT_THROWS_WITH(amp::PythonCheckpoint::load(path("garbage_pickle.pt")), "is not a valid torch.save checkpoint");
  PyNet net;
  torch::save(net, path("cpp_archive.pt"));
  ASSERT_THROWS_WITH(amp::PythonCheckpoint::load(path("cpp_archive.pt")), "is a TorchScript module or a C++ torch::save archive");
  fs::remove_all(dir);
}

TEST(PythonCheckpointTest, PutSaveLoadRoundTripsPlainValues) {
  const fs::path dir = fresh_dir("values");
  amp::PythonCheckpoint out;
  c10::impl::GenericDict nested(c10::StringType::get(), c10::AnyType::get());
  nested.insert("a", int64_t{-5});
  nested.insert("b", std::vector<int64_t>{1, 2, 3000000000});
  out.put("epoch", int64_t{12});
  out.put("best_acc", 0.9375);
  out.put("arch", std::string("resnet50"));
  out.put("done", true);
  out.put("nothing", c10::IValue());
  out.put("nested", nested);
  out.put("pair", c10::ivalue::Tuple::create(std::vector<c10::IValue>{1.5, std::string("x")}));
  const auto weights = torch::randn({3, 4});
  out.put("transposed", weights.t());  // not contiguous
  out.put("bf16", weights.to(torch::kBFloat16));
  out.put("scalar", torch::tensor(7, torch::kLong).reshape({}));
  out.put("epoch", int64_t{13});  // replaces in place
  out.save((dir / "values.pt").string());

  const auto in = amp::PythonCheckpoint::load((dir / "values.pt").string());
  EXPECT_EQ(in.keys(), (std::vector<std::string>{"epoch", "best_acc", "arch", "done", "nothing", "nested", "pair",
                                                 "transposed", "bf16", "scalar"}));
  EXPECT_EQ(in.get("epoch").toInt(), 13);
  EXPECT_EQ(in.get("best_acc").toDouble(), 0.9375);
  EXPECT_EQ(in.get("arch").toStringRef(), "resnet50");
  EXPECT_TRUE(in.get("done").toBool());
  EXPECT_TRUE(in.get("nothing").isNone());
  const auto n = in.get("nested").toGenericDict();
  EXPECT_EQ(n.at("a").toInt(), -5);
  EXPECT_EQ(n.at("b").toIntVector(), (std::vector<int64_t>{1, 2, 3000000000}));
  EXPECT_EQ(in.get("pair").toTupleRef().elements()[1].toStringRef(), "x");
  EXPECT_TRUE(torch::equal(in.get("transposed").toTensor(), weights.t()));
  EXPECT_TRUE(amp_test::bitwise_equal(in.get("bf16").toTensor(), weights.to(torch::kBFloat16)));
  EXPECT_EQ(in.get("scalar").toTensor().dim(), 0);
  EXPECT_EQ(in.get("scalar").toTensor().item<int64_t>(), 7);
  EXPECT_FALSE(in.contains("missing"));
  ASSERT_THROWS_WITH(in.get("missing"), "has no entry 'missing'");
  ASSERT_THROWS_WITH(out.save((dir / "no_such_dir" / "x.pt").string()), "cannot write");
  fs::remove_all(dir);
}

TEST(PythonCheckpointTest, ModelAndOptimizerRoundTripExactlyAtO2) {
  // C++ -> file -> C++: the fp32 masters, the optimizer state and the loss scale come back bitwise.
  const fs::path dir = fresh_dir("o2");
  struct Run {
    PyNet net;
    std::unique_ptr<amp::Initialized<PyNet, torch::optim::Adam>> amp;
    explicit Run(uint64_t seed) {
      torch::manual_seed(seed);
      net = PyNet();
      torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(0.01));
      amp = std::make_unique<amp::Initialized<PyNet, torch::optim::Adam>>(
          amp::initialize(net, std::move(adam), amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0)));
    }
  };
  Run run_a(1), run_b(2);
  auto& a = *run_a.amp;
  auto& b = *run_b.amp;
  PyNet& net_a = run_a.net;
  PyNet& net_b = run_b.net;
  for (int i = 0; i < 3; ++i) {
    a.optimizer.zero_grad();
    auto loss = a.model(torch::randn({8, 8})).pow(2).mean();
    {
      auto scaled = amp::scale_loss(loss, a.optimizer);
      scaled.backward();
    }
    a.optimizer.step();
  }
  amp::PythonCheckpoint out;
  out.put_model("model", *a.model);
  out.put_optimizer("optimizer", a.optimizer);
  out.put_amp("amp", a.optimizer);
  out.save((dir / "a.pt").string());

  const auto in = amp::PythonCheckpoint::load((dir / "a.pt").string());
  in.load_model(*b.model);
  in.load_optimizer(b.optimizer);
  in.load_amp(b.optimizer);
  const auto ma = amp::master_params(a.optimizer), mb = amp::master_params(b.optimizer);
  ASSERT_EQ(ma.size(), mb.size());
  for (size_t i = 0; i < ma.size(); ++i) EXPECT_TRUE(amp_test::bitwise_equal(ma[i], mb[i])) << i;
  const auto pa = net_a->parameters(), pb = net_b->parameters();
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(amp_test::bitwise_equal(pa[i], pb[i])) << i;
  EXPECT_EQ(amp::loss_scale(b.optimizer), amp::loss_scale(a.optimizer));
  // The same next step on both gives the same weights.
  torch::manual_seed(5);
  const auto x = torch::randn({8, 8});
  for (auto* run : {&a, &b}) {
    run->optimizer.zero_grad();
    auto loss = run->model(x).pow(2).mean();
    {
      auto scaled = amp::scale_loss(loss, run->optimizer);
      scaled.backward();
    }
    run->optimizer.step();
  }
  const auto na = amp::master_params(a.optimizer), nb = amp::master_params(b.optimizer);
  for (size_t i = 0; i < na.size(); ++i) EXPECT_TRUE(amp_test::bitwise_equal(na[i], nb[i])) << i;
  fs::remove_all(dir);
}

TEST(PythonCheckpointTest, TruncatedOrCorruptedPicklesThrowAndNeverCrash) {
  // Every prefix of a real data.pkl, and random byte flips in it: an exception or a checkpoint, never a
  // crash, a hang or a read outside the buffers (scripts/test.sh runs this under ASan+UBSan too).
  const fs::path dir = fresh_dir("fuzz");
  amp::PythonCheckpoint out;
  PyNet net;
  out.put_model("model", *net);
  out.put("nested", c10::ivalue::Tuple::create(std::vector<c10::IValue>{int64_t{1} << 40, -2.5, std::string("s")}));
  out.put("view", torch::arange(12, torch::kFloat).reshape({3, 4}).t());
  const std::string good = (dir / "good.pt").string();
  out.save(good);
  caffe2::serialize::PyTorchStreamReader reader(good);
  auto [pkl, pkl_size] = reader.getRecord("data.pkl");
  const std::string pickle(static_cast<const char*>(pkl.get()), pkl_size);
  std::vector<std::string> storages;
  for (size_t i = 0; reader.hasRecord("data/" + std::to_string(i)); ++i) {
    auto [data, size] = reader.getRecord("data/" + std::to_string(i));
    storages.emplace_back(static_cast<const char*>(data.get()), size);
  }
  const std::string bad = (dir / "bad.pt").string();
  auto write = [&](const std::string& p) {
    std::ofstream file(bad, std::ios::binary | std::ios::trunc);
    caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, size_t size) -> size_t {
      file.write(static_cast<const char*>(data), static_cast<std::streamsize>(size));
      return size;
    });
    writer.writeRecord("data.pkl", p.data(), p.size());
    for (size_t i = 0; i < storages.size(); ++i) {
      writer.writeRecord("data/" + std::to_string(i), storages[i].data(), storages[i].size());
    }
    writer.writeEndOfFile();
  };
  for (size_t n = 0; n < pickle.size(); ++n) {
    write(pickle.substr(0, n));
    EXPECT_THROW(amp::PythonCheckpoint::load(bad), std::exception) << "prefix of " << n << " bytes";
  }
  std::mt19937 rng(12);
  int loaded = 0;
  for (int round = 0; round < 400; ++round) {
    std::string p = pickle;
    for (int k = 0; k < 1 + round % 3; ++k) p[rng() % p.size()] = static_cast<char>(rng() & 0xff);
    write(p);
    try {
      const auto ck = amp::PythonCheckpoint::load(bad);
      for (const auto& key : ck.keys()) {
        try {
          (void)ck.get(key);
        } catch (const std::exception&) {
        }
      }
      ++loaded;
    } catch (const std::exception&) {
    }
  }
  std::cout << "[ measured ] " << loaded << " of 400 corrupted pickles still loaded; the rest threw" << std::endl;
  fs::remove_all(dir);
}

// ---------------------------------------------------------------------------------------------------
// Real-script corners (issue 19): damaged zips, text that is not UTF-8, torch.Size, the torch.amp front door.

TEST(PythonCheckpointTest, DamagedRecordsAreErrorsNeverUninitializedNumbers) {
  SKIP_WITHOUT_PYTHON_TORCH();
  const fs::path dir = fresh_dir("damaged");
  ASSERT_TRUE(run_python("corners --dir '" + dir.string() + "'"));
  auto path = [&](const char* name) { return (dir / name).string(); };
  const auto clean = amp::PythonCheckpoint::load(path("clean.pt"));
  EXPECT_TRUE(torch::equal(clean.get("w").toTensor(), torch::tensor({-0.1f, 0.0f, 0.1f})));
  // Before: loaded as [-5.3e36, 4.6e-41, -5.3e36] (miniz extracts nothing and says nothing; Python's torch.load
  // returns such numbers too, the script prints them).
  ASSERT_THROWS_WITH(amp::PythonCheckpoint::load(path("directory_bit.pt")),
                     "the record 'data/0' is marked as a directory in the zip directory (external attributes 0x10)");
  // miniz itself refuses a compressed size of 0 when it opens the archive (amp checks it again per record).
  EXPECT_ANY_THROW(amp::PythonCheckpoint::load(path("compressed_size.pt")));
  ASSERT_THROWS_WITH(amp::PythonCheckpoint::load(path("crc.pt")), "the record 'data/0' does not match its CRC-32");
  ASSERT_THROWS_WITH(amp::PythonCheckpoint::load(path("crc.pt")), "the file is damaged, save it again");
  // A file cut short loses its zip directory.
  std::string bytes;
  {
    std::ifstream in(path("clean.pt"), std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  write_file(dir / "cut.pt", bytes.substr(0, bytes.size() - 30));
  EXPECT_ANY_THROW(amp::PythonCheckpoint::load(path("cut.pt")));
  fs::remove_all(dir);
}

TEST(PythonCheckpointTest, TextMustBeUtf8BothWays) {
  SKIP_WITHOUT_PYTHON_TORCH();
  const fs::path dir = fresh_dir("text");
  ASSERT_TRUE(run_python("corners --dir '" + dir.string() + "'"));
  auto path = [&](const char* name) { return (dir / name).string(); };
  // Python's torch.load raises UnicodeDecodeError on this file (the script checks); so does amp, naming the entry.
  ASSERT_THROWS_WITH(amp::PythonCheckpoint::load(path("latin1.pt")),
                     "entry 'path' is a str that is not valid UTF-8 (byte 9 of '/data/caf\\xe9.csv')");
  const auto text = amp::PythonCheckpoint::load(path("text.pt"));
  EXPECT_EQ(text.get("path").toStringRef(), "/data/cafe.csv");
  const auto unicode = amp::PythonCheckpoint::load(path("unicode.pt"));
  EXPECT_EQ(unicode.get("name").toStringRef(), "caf\xc3\xa9 \xe2\x9c\x93 \xf0\x9f\x98\x80");
  EXPECT_EQ(unicode.get("surrogate").toStringRef(), "a\xed\xb2\x80" "b");  // pickle's 'surrogatepass' bytes

  // Writing: refused at put(), naming the entry and the path inside it (before: Python could not open the file).
  amp::PythonCheckpoint out;
  ASSERT_THROWS_WITH(out.put("data", std::string("/data/caf\xe9.csv")),
                     "amp::PythonCheckpoint::put: entry 'data' is a string that is not valid UTF-8 (byte 9 of "
                     "'/data/caf\\xe9.csv')");
  c10::impl::GenericDict nested(c10::StringType::get(), c10::AnyType::get());
  nested.insert("files", std::vector<std::string>{"ok.csv", "\xff.csv"});
  ASSERT_THROWS_WITH(out.put("args", nested), "entry 'args'['files'][1] is a string that is not valid UTF-8");
  ASSERT_THROWS_WITH(out.put(std::string("caf\xe9"), int64_t{1}), "the entry name is a string that is not valid UTF-8");
  ASSERT_THROWS_WITH(out.put("overlong", std::string("\xc0\xaf")), "not valid UTF-8 (byte 0");
  ASSERT_THROWS_WITH(out.put("surrogate", std::string("\xed\xa0\x80")), "not valid UTF-8 (byte 0");
  ASSERT_THROWS_WITH(out.put("truncated", std::string("ok\xe2\x9c")), "not valid UTF-8 (byte 2");
  EXPECT_FALSE(out.contains("data"));
  // A dict filled after put() is checked again when saved.
  c10::impl::GenericDict late(c10::StringType::get(), c10::AnyType::get());
  out.put("late", late);
  late.insert("bad", std::string("\xe9"));
  ASSERT_THROWS_WITH(out.save(path("late.pt")), "amp::PythonCheckpoint::save: the checkpoint['late']['bad'] is a string");
  out.erase("late");
  out.put("name", std::string("caf\xc3\xa9 \xe2\x9c\x93"));
  out.save(path("cpp_text.pt"));
  ASSERT_TRUE(run_python("check_utf8 --dir '" + dir.string() + "'"));
  fs::remove_all(dir);
}

TEST(PythonCheckpointTest, TorchSizeReadsAsTupleOfInts) {
  SKIP_WITHOUT_PYTHON_TORCH();
  const fs::path dir = fresh_dir("size");
  ASSERT_TRUE(run_python("corners --dir '" + dir.string() + "'"));
  // Before: "holds a Python object of type torch.Size".
  const auto ck = amp::PythonCheckpoint::load((dir / "size.pt").string());
  const auto shape = ck.get("input_shape");
  ASSERT_TRUE(shape.isTuple());
  std::vector<int64_t> dims;
  for (const auto& d : shape.toTupleRef().elements()) dims.push_back(d.toInt());
  EXPECT_EQ(dims, (std::vector<int64_t>{2, 3, 4}));
  EXPECT_TRUE(ck.get("empty_shape").isTuple());
  EXPECT_EQ(ck.get("empty_shape").toTupleRef().elements().size(), 0u);
  const auto shapes = ck.get("shapes").toList();
  ASSERT_EQ(shapes.size(), 2u);
  EXPECT_EQ(shapes.get(1).toTupleRef().elements().size(), 2u);
  fs::remove_all(dir);
}

// A script ported as torch.autocast + GradScaler with a plain torch::optim optimizer (the tutorials' loop):
// it resumes Python's optimizer and scaler state and hands them back (before: load_optimizer/put_optimizer
// took amp's optimizers only, and a plain optimizer did not compile as an argument).
class PlainOptimizerRoundTripTest : public ::testing::TestWithParam<Case> {};

TEST_P(PlainOptimizerRoundTripTest, ContinuesPythonRunAndHandsItBack) {
  const Case c = GetParam();
  SKIP_WITHOUT_CPU_KERNELS(c.dtype);
  SKIP_WITHOUT_PYTHON_TORCH();
  const std::string id = case_id(c);
  const fs::path dir = fresh_dir("plain_" + id);
  ASSERT_TRUE(run_python("train --case " + id + " --dir '" + dir.string() + "'"));
  const auto data = amp::PythonCheckpoint::load((dir / "data.pt").string());
  const auto xs = data.get("x").toTensor(), ys = data.get("y").toTensor();

  PyNet net;
  const bool sgd = std::string(c.optimizer) == "sgd";
  // Placeholder hyperparameters and scaler schedule: the file's must win.
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  if (sgd) {
    optimizer = std::make_unique<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(1.0).momentum(0.5));
  } else {
    optimizer = std::make_unique<torch::optim::Adam>(net->parameters(), torch::optim::AdamOptions(1.0));
  }
  amp::GradScaler scaler;
  auto train = [&](int from, int to) {
    net->train();
    for (int i = from; i < to; ++i) {
      optimizer->zero_grad();
      torch::Tensor out;
      {
        amp::AutocastGuard autocast(torch::kCPU, c.dtype);
        out = net(xs[i]);
      }
      auto loss = torch::nn::functional::cross_entropy(out.to(torch::kFloat), ys[i]);
      scaler.scale(loss).backward();
      scaler.step(*optimizer);
      scaler.update();
    }
  };
  auto fp32_params = [&] {
    c10::impl::GenericDict d(c10::StringType::get(), c10::TensorType::get());
    for (const auto& item : net->named_parameters()) d.insert(item.key(), item.value().detach().clone());
    for (const auto& item : net->named_buffers()) d.insert(item.key(), item.value().detach().clone());
    return d;
  };

  const auto ck = amp::PythonCheckpoint::load((dir / "python.pt").string());
  ck.load_model(*net);
  ck.load_optimizer(*optimizer);
  ck.load_grad_scaler(scaler, "scaler");
  EXPECT_EQ(scaler.get_scale(), 32768.0);  // the overflow at step 1 halved it
  EXPECT_EQ(scaler.get_growth_interval(), kGrowthInterval);
  EXPECT_DOUBLE_EQ(optimizer->param_groups()[0].options().get_lr(), sgd ? 0.05 : 0.01);
  EXPECT_EQ(optimizer->state().size(), 5u);

  train(kN, kN + kM);
  const auto python_continued = amp::PythonCheckpoint::load((dir / "python_continued.pt").string());
  const double tol = tolerance(python_continued.get("torch_version").toStringRef());
  std::string worst;
  const double diff = max_abs_diff(fp32_params(), python_continued.get("params").toGenericDict(), &worst);
  std::cout << "[ measured ] plain " << id << ": Python -> C++, " << kM << " steps: max |C++ - Python| = " << diff
            << (worst.empty() ? "" : " (" + worst + ")") << ", tolerance " << tol << std::endl;
  EXPECT_LT(diff, tol);
  EXPECT_EQ(scaler.get_scale(), python_continued.get("scale").toDouble());
  EXPECT_EQ(scaler.state_dict().at("_growth_tracker").toInt(), python_continued.get("unskipped").toInt());

  amp::PythonCheckpoint out;
  out.put_model("model", *net);
  out.put_optimizer("optimizer", *optimizer);
  out.put_grad_scaler("scaler", scaler);
  out.put("step", int64_t{kN + kM});
  out.save((dir / "cpp.pt").string());
  train(kN + kM, kN + kM + kK);
  ASSERT_TRUE(run_python("resume --case " + id + " --dir '" + dir.string() + "'"));
  const auto python_from_cpp = amp::PythonCheckpoint::load((dir / "python_from_cpp.pt").string());
  worst.clear();
  const double back = max_abs_diff(fp32_params(), python_from_cpp.get("params").toGenericDict(), &worst);
  std::cout << "[ measured ] plain " << id << ": C++ -> Python, " << kK << " steps: max |C++ - Python| = " << back
            << (worst.empty() ? "" : " (" + worst + ")") << std::endl;
  EXPECT_LT(back, tol);
  EXPECT_EQ(scaler.get_scale(), python_from_cpp.get("scale").toDouble());
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Cases, PlainOptimizerRoundTripTest,
                         ::testing::Values(Case{"sgd", "O1", torch::kBFloat16}, Case{"adam", "O1", torch::kBFloat16},
                                           Case{"adam", "O1", torch::kHalf}),
                         case_name);

TEST(PythonCheckpointTest, PlainOptimizersOfEveryKindRoundTrip) {
  // put_optimizer / load_optimizer on every torch::optim type amp maps, and amp's fused ones, without amp::initialize.
  auto round_trip = [](auto make) {
    PyNet net;
    auto opt = make(net->parameters());
    net(torch::randn({4, 8})).pow(2).mean().backward();
    opt.step();
    amp::PythonCheckpoint out;
    out.put_optimizer("optimizer", opt);
    const fs::path dir = fresh_dir("plain_kinds");
    out.save((dir / "o.pt").string());
    PyNet other;
    auto fresh = make(other->parameters());
    amp::PythonCheckpoint::load((dir / "o.pt").string()).load_optimizer(fresh);
    EXPECT_EQ(fresh.state().size(), opt.state().size());
    amp::PythonCheckpoint again;
    again.put_optimizer("optimizer", fresh);
    const auto a = out.get("optimizer").toGenericDict().at("state").toGenericDict();
    const auto b = again.get("optimizer").toGenericDict().at("state").toGenericDict();
    ASSERT_EQ(a.size(), b.size());
    for (const auto& item : a) {
      for (const auto& field : item.value().toGenericDict()) {
        const auto other_value = b.at(item.key()).toGenericDict().at(field.key());
        EXPECT_TRUE(torch::equal(field.value().toTensor(), other_value.toTensor())) << field.key().toStringRef();
      }
    }
    fs::remove_all(dir);
  };
  using P = std::vector<torch::Tensor>;
  round_trip([](P p) { return torch::optim::SGD(p, torch::optim::SGDOptions(0.1).momentum(0.9)); });
  round_trip([](P p) { return torch::optim::Adam(p, torch::optim::AdamOptions(0.01)); });
  round_trip([](P p) { return torch::optim::AdamW(p, torch::optim::AdamWOptions(0.01)); });
  round_trip([](P p) { return torch::optim::RMSprop(p, torch::optim::RMSpropOptions(0.01).momentum(0.5).centered(true)); });
  round_trip([](P p) { return torch::optim::Adagrad(p, torch::optim::AdagradOptions(0.01)); });
  round_trip([](P p) { return amp::optim::FusedSGD(p, torch::optim::SGDOptions(0.1).momentum(0.9)); });
  round_trip([](P p) { return amp::optim::FusedAdamW(p, torch::optim::AdamWOptions(0.01)); });
  // An optimizer amp has no Python mapping for.
  PyNet net;
  torch::optim::LBFGS lbfgs(net->parameters());
  amp::PythonCheckpoint out;
  ASSERT_THROWS_WITH(out.put_optimizer("optimizer", lbfgs), "amp writes SGD, Adam, AdamW, RMSprop, Adagrad and Muon");
  // Apex's amp.state_dict() is not a GradScaler's.
  PyNet apex_net;
  auto [apex_model, apex_optimizer] = amp::initialize(
      apex_net, torch::optim::SGD(apex_net->parameters(), torch::optim::SGDOptions(0.1)), amp::Options("O1").low_precision_dtype(torch::kBFloat16).verbosity(0));  // bf16: LibTorch 1.13 has it on the CPU
  out.put_amp("amp", apex_optimizer);
  const fs::path dir = fresh_dir("apex_amp");
  out.erase("optimizer");
  out.save((dir / "amp.pt").string());
  amp::GradScaler scaler;
  ASSERT_THROWS_WITH(amp::PythonCheckpoint::load((dir / "amp.pt").string()).load_grad_scaler(scaler, "amp"),
                     "entry 'amp' is Apex's amp.state_dict(), not a GradScaler's; load it into an amp::Optimizer with load_amp");
  fs::remove_all(dir);
}
