#pragma once
// FP8's accuracy figure: the bench transformer trained a fixed number of steps on a learnable task, its held-out
// loss compared across recipes (amp_bench --section fp8, amp_gpu_bench --section fp8, and
// Fp8Test.BenchTransformerLossStaysNearBf16, which states the tolerance).

#include <amp/amp.h>
#include <torch/torch.h>

#include "models.h"
#include "training_steps.h"

namespace bench {

// A batch of the task: each sequence is noise tokens around a per-sequence centre; the label is the argmax of a
// fixed projection of the centre.
inline std::pair<torch::Tensor, torch::Tensor> transformer_task_batch(int64_t seed, int64_t batch, int64_t seq,
                                                                      int64_t width, torch::Device device) {
  torch::manual_seed(424242);
  const torch::Tensor projection = torch::randn({width, 10});
  torch::manual_seed(seed);
  const torch::Tensor centre = torch::randn({batch, 1, width});
  const torch::Tensor x = centre + torch::randn({batch, seq, width});
  const torch::Tensor y = centre.squeeze(1).matmul(projection).argmax(1);
  return {x.to(device), y.to(device)};
}

struct TaskResult {
  double held_out_loss = 0.0;
  std::vector<double> losses;  // per step
};

// Trains `net` `steps` steps at `options` with SGD (lr 0.01, momentum 0.9); returns the held-out loss.
template <class Net>
TaskResult train_transformer_task(Net net, const amp::Options& options, int steps, torch::Device device = torch::kCPU,
                                  int64_t batch = 16, int64_t seq = 64) {
  net->to(device);
  const int64_t width = net->head->weight.size(1);
  auto [model, optimizer] = amp::initialize(
      net, torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9)), options);
  TaskResult result;
  for (int step = 0; step < steps; ++step) {
    const auto [x, y] = transformer_task_batch(step, batch, seq, width, device);
    result.losses.push_back(amp_step(model, optimizer, x, y).template item<double>());
  }
  const auto [x, y] = transformer_task_batch(1000000, 4 * batch, seq, width, device);
  torch::NoGradGuard no_grad;
  model.eval();
  result.held_out_loss = torch::nn::functional::cross_entropy(model(x), y).template item<double>();
  return result;
}

}  // namespace bench
