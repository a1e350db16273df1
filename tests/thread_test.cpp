// Threads. LibTorch's autocast state is thread local, so O1 casts belong to the thread running
// model(...): several threads may call one O1 model at once and each gets exactly the single-threaded
// result, while threads outside a model keep plain fp32 math. (Training one model from several threads
// at once is not supported, as in LibTorch: optimizers and BatchNorm statistics are not synchronized.)
#include <thread>

#include "support/models.h"
#include "support/support.h"

TEST(ThreadTest, ConcurrentO1ForwardsMatchTheSingleThreadedResult) {
  amp_test::ConvBnNet net;
  torch::optim::SGD sgd(net->parameters(), 0.1);
  auto [model, optimizer] = amp::initialize(net, std::move(sgd), amp::Options("O1").low_precision_dtype(torch::kBFloat16).verbosity(0));
  model.eval();
  std::vector<torch::Tensor> inputs, expected;
  for (int i = 0; i < 8; ++i) {
    inputs.push_back(torch::randn({4, 1, 8, 8}));
    torch::NoGradGuard no_grad;
    expected.push_back(model(inputs.back()));
  }
  std::atomic<int> mismatches{0}, plain_dtype_errors{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      torch::NoGradGuard no_grad;
      for (int round = 0; round < 50; ++round) {
        const size_t i = static_cast<size_t>((t + round) % 8);
        if (!torch::equal(model(inputs[i]), expected[i])) ++mismatches;
      }
    });
  }
  // Meanwhile, a thread outside any model must not see another thread's casts.
  threads.emplace_back([&] {
    for (int round = 0; round < 200; ++round) {
      auto y = torch::mm(torch::randn({8, 8}), torch::randn({8, 8}));
      if (y.scalar_type() != torch::kFloat) ++plain_dtype_errors;
    }
  });
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches.load(), 0);
  EXPECT_EQ(plain_dtype_errors.load(), 0);
}

TEST(ThreadTest, GuardsRestoreStateOnTheirOwnThreadOnly) {
  std::atomic<bool> inner_saw_casts{false};
  {
    amp::AutocastGuard casts(torch::kCPU, torch::kBFloat16);
    std::thread other([&] { inner_saw_casts = torch::mm(torch::randn({2, 2}), torch::randn({2, 2})).scalar_type() != torch::kFloat; });
    other.join();
    EXPECT_EQ(torch::mm(torch::randn({2, 2}), torch::randn({2, 2})).scalar_type(), torch::kBFloat16);
  }
  EXPECT_FALSE(inner_saw_casts.load());
  EXPECT_EQ(torch::mm(torch::randn({2, 2}), torch::randn({2, 2})).scalar_type(), torch::kFloat);
}

TEST(ThreadTest, ModelsInitializedAndFrozenFromSeveralThreads) {
  // The registries behind initialize-once and freeze_batchnorm are shared: exercise them concurrently.
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 10; ++i) {
        try {
          amp_test::ConvBnNet net;
          amp::freeze_batchnorm(*net);
          torch::optim::SGD sgd(net->fc->parameters(), 0.1);
          auto [model, optimizer] = amp::initialize(net, std::move(sgd), amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0));
          if (!amp::is_frozen(*net->bn) || net->bn->weight.scalar_type() != torch::kFloat) ++failures;
        } catch (...) {
          ++failures;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
}
