// The failure scenarios: "mismatch" (different models on the ranks) and "dies" (a rank exits mid-run).

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <string>

#include "amp/amp.h"
#include "options/exception_message.h"
#include "scenarios.h"
#include "worker_support.h"

namespace amp_worker {

void scenario_mismatch(const ProcessGroup& group) {
  torch::manual_seed(1);
  auto net = torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::ReLU(),
                                   torch::nn::Linear(16, group.rank() == 1 ? 5 : 4));
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  auto [model, optimizer] = amp::initialize(net, std::move(sgd), amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0));
  std::string error;
  try {
    auto ddp = amp::parallel::make_distributed(model, group);
  } catch (const std::exception& e) {
    error = amp::detail::message_of(e);
  }
  report(error.find("the models differ across ranks: parameter '2.weight' is [4, 16] (BFloat16) on rank 0 but [5, 16] "
                    "(BFloat16) on rank 1") != std::string::npos,
         "make_distributed refuses different models on every rank, naming the parameter", error.substr(0, 200));

  // At O1 the islands change no dtype, so only the islands' own check sees ranks that keep different modules in
  // fp32 (their replicas would compute in different dtypes).
  torch::manual_seed(1);
  auto same = torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::ReLU(), torch::nn::Linear(16, 4));
  auto options = amp::Options("O1").low_precision_dtype(torch::kBFloat16).verbosity(0);
  if (group.rank() == 1) options.keep_fp32({"2"});
  auto [model1, optimizer1] = amp::initialize(same, torch::optim::SGD(same->parameters(), torch::optim::SGDOptions(0.1)),
                                              options);
  error.clear();
  try {
    auto ddp = amp::parallel::make_distributed(model1, group);
  } catch (const std::exception& e) {
    error = amp::detail::message_of(e);
  }
  report(error.find("rank " + std::to_string(group.rank()) + " keeps other modules in fp32 than another rank (this "
                    "rank: " + (group.rank() == 1 ? "2 (keep_fp32))" : "none)")) != std::string::npos,
         "make_distributed refuses ranks that keep different fp32 islands, on every rank", error.substr(0, 200));
}

void scenario_dies(const ProcessGroup& group) {
  auto net = make_mlp(3);
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  auto [model, optimizer] = amp::initialize(net, std::move(sgd), amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0));
  auto ddp = amp::parallel::make_distributed(model, group);
  if (group.rank() == 1) {
    std::cout << "[rank 1] exiting on purpose before the first backward" << std::endl;
    std::exit(3);
  }
  const Batch b = rows(global_batch(0, kGlobal), 0, 8);
  const auto start = std::chrono::steady_clock::now();
  std::string error;
  try {
    for (int step = 0; step < 3; ++step) {  // the first may still find rank 1's socket open
      auto scaled = amp::scale_loss(loss_of(ddp(b.x), b.y), optimizer);
      scaled.backward();
    }
  } catch (const std::exception& e) {
    error = amp::detail::message_of(e);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  report(error.find("amp::parallel") != std::string::npos && error.find("another rank failed") != std::string::npos &&
             seconds < std::chrono::duration<double>(group.timeout()).count() + 5,
         "a rank that died: the other's backward fails with amp's error within the timeout",
         "after " + str(seconds) + " s: " + error.substr(0, 240));
}

}  // namespace amp_worker
