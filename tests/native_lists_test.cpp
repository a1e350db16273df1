// cast_lists native against torch.autocast itself: every loss and normalization of torch::nn::functional (the entry
// points C++ users call, which are not always the aten ops the lists name: F::nll_loss is aten::nll_loss_nd) returns
// what Python's torch.autocast("cpu") returns on the same call, dtype and bits, computed at test time by
// tests/python/autocast_lists.py. The same holds for a plain at::autocast region in a process where amp registered
// its kernels: amp changes nothing outside its own regions.
#include <filesystem>
#include <functional>
#include <map>
#include <unistd.h>

#include "casting/autocast_adapter.h"
#include "support/models.h"
#include "support/support.h"

namespace {

namespace F = torch::nn::functional;
namespace fs = std::filesystem;

const char* const kNativeListsScript = AMP_SOURCE_DIR "/tests/python/autocast_lists.py";

// The tensors the calls take (tests/python/autocast_lists.py's inputs.pt).
std::map<std::string, torch::Tensor> native_lists_inputs() {
  torch::manual_seed(11);
  std::map<std::string, torch::Tensor> t;
  t["x"] = torch::randn({8, 6});
  t["x4"] = torch::randn({4, 3, 5, 5});
  t["p"] = torch::rand({8, 6}) * 0.9 + 0.05;
  t["prob"] = torch::softmax(torch::randn({8, 6}), 1);
  t["target"] = torch::randn({8, 6});
  t["other"] = torch::randn({8, 6});
  t["count"] = torch::randint(0, 5, {8, 6}).to(torch::kFloat);
  t["sign"] = torch::randint(0, 2, {8, 6}).to(torch::kFloat) * 2 - 1;
  t["labels"] = torch::randint(0, 6, {8});
  t["labels4"] = torch::randint(0, 3, {4, 5, 5});
  t["multilabels"] = torch::randint(-1, 6, {8, 6});
  t["logp"] = torch::log_softmax(torch::randn({7, 2, 5}), 2);
  t["ctc_targets"] = torch::randint(1, 5, {2, 3});
  t["ctc_input_lengths"] = torch::full({2}, 7, torch::kLong);
  t["ctc_target_lengths"] = torch::tensor({3, 2}, torch::kLong);
  t["w6"] = torch::randn({6});
  t["b6"] = torch::randn({6});
  t["w3"] = torch::randn({3});
  t["b3"] = torch::randn({3});
  t["mean3"] = torch::randn({3});
  t["var3"] = torch::rand({3}) + 0.5;
  return t;
}

using NativeCall = std::function<torch::Tensor(const torch::Tensor&)>;

// The calls of autocast_lists.py, through torch::nn::functional: name -> (input key, call).
std::map<std::string, std::pair<std::string, NativeCall>> native_lists_calls(std::map<std::string, torch::Tensor>& t) {
  const auto sign0 = t["sign"].select(1, 0);
  return {
      {"nll_loss", {"x", [&](const torch::Tensor& x) { return F::nll_loss(x, t["labels"]); }}},
      {"nll_loss_4d", {"x4", [&](const torch::Tensor& x) { return F::nll_loss(x, t["labels4"]); }}},
      {"cross_entropy", {"x", [&](const torch::Tensor& x) { return F::cross_entropy(x, t["labels"]); }}},
      {"cross_entropy_4d", {"x4", [&](const torch::Tensor& x) { return F::cross_entropy(x, t["labels4"]); }}},
      {"cross_entropy_probabilities", {"x", [&](const torch::Tensor& x) { return F::cross_entropy(x, t["prob"]); }}},
      {"mse_loss", {"x", [&](const torch::Tensor& x) { return F::mse_loss(x, t["target"]); }}},
      {"l1_loss", {"x", [&](const torch::Tensor& x) { return F::l1_loss(x, t["target"]); }}},
      {"smooth_l1_loss", {"x", [&](const torch::Tensor& x) { return F::smooth_l1_loss(x, t["target"]); }}},
      {"huber_loss", {"x", [&](const torch::Tensor& x) { return F::huber_loss(x, t["target"]); }}},
      {"kl_div", {"x", [&](const torch::Tensor& x) {
                    return F::kl_div(x, t["prob"], F::KLDivFuncOptions().reduction(torch::kBatchMean));
                  }}},
      {"binary_cross_entropy", {"p", [&](const torch::Tensor& x) { return F::binary_cross_entropy(x, t["prob"]); }}},
      {"binary_cross_entropy_with_logits",
       {"x", [&](const torch::Tensor& x) { return F::binary_cross_entropy_with_logits(x, t["prob"]); }}},
      {"poisson_nll_loss", {"x", [&](const torch::Tensor& x) { return F::poisson_nll_loss(x, t["count"]); }}},
      {"soft_margin_loss", {"x", [&](const torch::Tensor& x) { return F::soft_margin_loss(x, t["sign"]); }}},
      {"margin_ranking_loss",
       {"x", [&, sign0](const torch::Tensor& x) { return F::margin_ranking_loss(x.select(1, 0), x.select(1, 1), sign0); }}},
      {"hinge_embedding_loss", {"x", [&](const torch::Tensor& x) { return F::hinge_embedding_loss(x, t["sign"]); }}},
      {"multilabel_margin_loss",
       {"x", [&](const torch::Tensor& x) { return F::multilabel_margin_loss(x, t["multilabels"]); }}},
      {"multilabel_soft_margin_loss",
       {"x", [&](const torch::Tensor& x) { return F::multilabel_soft_margin_loss(x, t["prob"]); }}},
      {"multi_margin_loss", {"x", [&](const torch::Tensor& x) { return F::multi_margin_loss(x, t["labels"]); }}},
      {"cosine_embedding_loss",
       {"x", [&, sign0](const torch::Tensor& x) { return F::cosine_embedding_loss(x, t["target"], sign0); }}},
      {"triplet_margin_loss",
       {"x", [&](const torch::Tensor& x) { return F::triplet_margin_loss(x, t["target"], t["other"]); }}},
      {"ctc_loss", {"logp", [&](const torch::Tensor& x) {
                      return F::ctc_loss(x, t["ctc_targets"], t["ctc_input_lengths"], t["ctc_target_lengths"]);
                    }}},
      {"layer_norm", {"x", [&](const torch::Tensor& x) {
                        return F::layer_norm(x, F::LayerNormFuncOptions({6}).weight(t["w6"]).bias(t["b6"]));
                      }}},
      {"group_norm", {"x4", [&](const torch::Tensor& x) {
                        return F::group_norm(x, F::GroupNormFuncOptions(3).weight(t["w3"]).bias(t["b3"]));
                      }}},
      {"batch_norm_training", {"x4", [&](const torch::Tensor& x) {
                                 return F::batch_norm(x, t["mean3"].clone(), t["var3"].clone(),
                                                      F::BatchNormFuncOptions().weight(t["w3"]).bias(t["b3"]).training(true));
                               }}},
      {"batch_norm_eval", {"x4", [&](const torch::Tensor& x) {
                             return F::batch_norm(x, t["mean3"], t["var3"],
                                                  F::BatchNormFuncOptions().weight(t["w3"]).bias(t["b3"]));
                           }}},
      {"instance_norm", {"x4", [](const torch::Tensor& x) { return F::instance_norm(x); }}},
      {"local_response_norm",
       {"x4", [](const torch::Tensor& x) { return F::local_response_norm(x, F::LocalResponseNormFuncOptions(2)); }}},
      {"normalize", {"x", [](const torch::Tensor& x) { return F::normalize(x, F::NormalizeFuncOptions()); }}},
      {"softmax", {"x", [](const torch::Tensor& x) { return F::softmax(x, F::SoftmaxFuncOptions(1)); }}},
      {"log_softmax", {"x", [](const torch::Tensor& x) { return F::log_softmax(x, F::LogSoftmaxFuncOptions(1)); }}},
      {"softmin", {"x", [](const torch::Tensor& x) { return F::softmin(x, F::SoftminFuncOptions(1)); }}},
  };
}

// What a region gives: the result, or the first line of the error.
c10::IValue native_lists_run(const std::function<torch::Tensor()>& region) {
  try {
    return region();
  } catch (const std::exception& e) {
    const std::string what = amp_test::message(e);
    return what.substr(0, what.find('\n'));
  }
}

TEST(NativeListsTest, LossesAndNormalizationsCastAsTorchAutocastInsideAndOutsideAmp) {
  if (!amp_test::python_has_torch()) GTEST_SKIP() << "needs Python with the torch wheel (set AMP_PYTHON)";
  auto inputs = native_lists_inputs();
  const auto calls = native_lists_calls(inputs);
  const fs::path dir = fs::path(::testing::TempDir()) / ("amp_native_lists_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  amp::PythonCheckpoint out;
  for (const auto& [key, tensor] : inputs) out.put(key, tensor);
  out.save((dir / "inputs.pt").string());
  const std::string command = amp_test::python_interpreter() + " '" + kNativeListsScript + "' '" + dir.string() + "' 2>&1";
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  const auto reference = amp::PythonCheckpoint::load((dir / "reference.pt").string());
  fs::remove_all(dir);
  const std::string python_version = reference.get("torch_version").toStringRef();
  if (python_version.substr(0, python_version.find('+')) != TORCH_VERSION) {
    GTEST_SKIP() << "Python's torch " << python_version << " is not this build's LibTorch " << TORCH_VERSION
                 << ": their autocast lists differ";
  }

  // A model at O1 with the native lists registers amp's kernels for the process first, as a training program does.
  auto net = amp_test::Mlp();
  auto model = amp::initialize(net, amp::Options("O1").low_precision_dtype(torch::kBFloat16)
                                        .cast_lists(amp::CastLists::kNative).verbosity(0));
  (void)model(torch::randn({2, 8}));

  int compared = 0;
  for (const auto lp : {torch::kBFloat16, torch::kHalf}) {
    for (const auto& [name, entry] : calls) {
      const auto& [input, call] = entry;
      for (const auto in_dtype : {torch::kFloat, lp}) {
        const std::string key = name + "/" + amp_test::dtype_label(lp) + "/" +
                                (in_dtype == torch::kFloat ? "fp32" : amp_test::dtype_label(lp));
        SCOPED_TRACE(key);
        const c10::IValue expected = reference.get(key);
        const torch::Tensor x = inputs.at(input).to(in_dtype);
        const c10::IValue in_amp = native_lists_run([&, &call = call] {
          amp::AutocastGuard casts(torch::kCPU, lp, amp::CastLists::kNative);
          return call(x);
        });
        const c10::IValue plain = native_lists_run([&, &call = call] {
          amp::detail::autocast::NativeAutocastGuard region(torch::kCPU, lp);
          return call(x);
        });
        for (const auto& [where, got] : {std::make_pair("amp's O1 native lists", in_amp),
                                         std::make_pair("plain at::autocast", plain)}) {
          if (expected.isString()) {
            EXPECT_TRUE(got.isString()) << where << ": Python raised '" << expected.toStringRef() << "'";
            continue;
          }
          ASSERT_TRUE(got.isTensor()) << where << " raised '" << got.toStringRef() << "'";
          EXPECT_EQ(got.toTensor().scalar_type(), expected.toTensor().scalar_type()) << where;
          EXPECT_TRUE(amp_test::bitwise_equal(got.toTensor(), expected.toTensor())) << where;
          ++compared;
        }
      }
    }
  }
  EXPECT_GT(compared, 200);
}

}  // namespace
