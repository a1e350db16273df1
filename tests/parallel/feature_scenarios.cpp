// The feature scenarios: amp::clip_grad_norm_, amp::checkpoint, lean masters, the precision policy, FP8 and
// TorchScript models under amp::parallel.

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>
#include <torch/script.h>

#include <iostream>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "amp/amp.h"
#include "casting/fp8.h"
#include "casting/precision_policy.h"
#include "optim/lean_masters.h"
#include "optim/optimizer_access.h"
#include "scenarios.h"
#include "support/training.h"
#include "worker_support.h"

namespace amp_worker {
namespace {

// train_step with the worker's loss.
const amp_test::StepOptions kLossOf =
    amp_test::StepOptions().loss([](const torch::Tensor& logits, const torch::Tensor& y) { return loss_of(logits, y); });

}  // namespace

// amp::clip_grad_norm_ after DDP's all-reduce: each rank's norm equals the single process's on the whole batch
// (to the reduction's rounding), and the ranks print their norms bit for bit (parallel_test.cpp compares them).
void scenario_clip(const ProcessGroup& group) {
  struct Level {
    const char* label;
    amp::Options options;
    double tolerance;  // relative: O0 summation order; O2 bf16 gradients rounded to bf16 before the sum
  };
  for (const Level& level : {Level{"O0", amp::Options("O0").verbosity(0), 1e-5},
                             Level{"O2 bf16", amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0), 2e-2}}) {
    auto net = make_mlp(7);
    auto [model, optimizer] = amp::initialize(net, torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(0.1)),
                                              level.options);
    auto ddp = amp::parallel::make_distributed(model, group);
    auto ref_net = make_mlp(7);
    auto [ref_model, ref_optimizer] = amp::initialize(
        ref_net, torch::optim::SGD(ref_net->parameters(), torch::optim::SGDOptions(0.1)), level.options);
    std::ostringstream norms;
    bool close = true;
    for (int step = 0; step < 4; ++step) {
      const Batch batch = global_batch(step, 16);
      const Batch local = rows(batch, group.rank() * 8, 8);
      optimizer.zero_grad();
      {
        auto scaled = amp::scale_loss(loss_of(ddp(local.x), local.y), optimizer);
        scaled.backward();
      }
      const float norm = amp::clip_grad_norm_(optimizer, 0.5).item<float>();
      optimizer.step();
      ref_optimizer.zero_grad();
      {
        auto scaled = amp::scale_loss(loss_of(ref_model(batch.x), batch.y), ref_optimizer);
        scaled.backward();
      }
      const float ref_norm = amp::clip_grad_norm_(ref_optimizer, 0.5).item<float>();
      ref_optimizer.step();
      close = close && std::abs(norm - ref_norm) <= level.tolerance * ref_norm;
      norms << std::hexfloat << norm << " ";
    }
    report(close, std::string(level.label) + ": clip_grad_norm_ after the all-reduce equals the single process's norm");
    std::cout << "[rank " << group.rank() << "] clip norms " << level.label << ": " << norms.str() << std::endl;
  }
}

namespace {

// make_mlp's layers, the hidden ones run through amp::checkpoint (or not).
struct CheckpointedMlpImpl : torch::nn::Module {
  CheckpointedMlpImpl(uint64_t seed, bool checkpointed) : checkpointed(checkpointed) {
    torch::manual_seed(seed);  // make_mlp's layers in make_mlp's order: the same initial values
    body = register_module("body", torch::nn::Sequential(torch::nn::Linear(12, 32), torch::nn::ReLU(),
                                                         torch::nn::Linear(32, 32), torch::nn::ReLU()));
    head = register_module("head", torch::nn::Linear(32, 5));
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(checkpointed ? amp::checkpoint(body, x) : body->forward(x)); }
  bool checkpointed;
  torch::nn::Sequential body{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(CheckpointedMlp);

}  // namespace

// amp::checkpoint under amp::parallel: the checkpointed replicas' parameters equal the plain replicas' bit for bit
// (the recomputed gradients reach the same reduction hooks), and every rank ends identical.
void scenario_checkpoint(const ProcessGroup& group) {
  for (const auto& [label, options] : {std::make_pair(std::string("O0"), amp::Options("O0").verbosity(0)),
                                       std::make_pair(std::string("O2 bf16"),
                                                      amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0))}) {
    std::vector<torch::Tensor> finals[2];
    for (bool checkpointed : {false, true}) {
      CheckpointedMlp net(7, checkpointed);
      auto [model, optimizer] = amp::initialize(
          net, torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9)), options);
      auto ddp = amp::parallel::make_distributed(model, group);
      for (int step = 0; step < 3; ++step) {
        const Batch local = rows(global_batch(step, 16), group.rank() * 8, 8);
        amp_test::train_step(ddp, optimizer, local.x, local.y, kLossOf);
      }
      for (const auto& p : net->parameters()) finals[checkpointed].push_back(p.detach().to(torch::kFloat));
    }
    bool same = true;
    double sum = 0;
    for (size_t i = 0; i < finals[0].size(); ++i) {
      same = same && torch::equal(finals[0][i], finals[1][i]);
      sum += finals[1][i].sum().item<double>();
    }
    report(same, label + ": checkpointed replicas equal the plain replicas bit for bit");
    std::cout << "[rank " << group.rank() << "] checkpoint params " << label << ": " << std::hexfloat << sum
              << std::defaultfloat << std::endl;
  }
}

// Lean masters under amp::parallel: each rank's stochastic rounding generator is seeded differently, and rank 1's
// weights differ before make_distributed; rank 0's weights, low bits / compensation and generator reach every rank,
// so the replicas stay bit-identical.
void scenario_lean(const ProcessGroup& group) {
  for (const auto format : {amp::MasterWeights::kSplit, amp::MasterWeights::kStochasticRounding, amp::MasterWeights::kKahan}) {
    torch::manual_seed(1);
    auto net = torch::nn::Sequential(torch::nn::Linear(12, 16), torch::nn::ReLU(), torch::nn::Linear(16, 5));
    if (group.rank() == 1) {
      torch::NoGradGuard no_grad;
      for (auto& p : net->parameters()) p.mul_(1.001);
    }
    torch::manual_seed(100 + group.rank());  // the generator's seed is drawn here at initialize
    auto [model, optimizer] = amp::initialize(
        net, amp::optim::FusedAdam(net->parameters(), torch::optim::AdamOptions(1e-2)),
        amp::Options("O2").low_precision_dtype(torch::kBFloat16).master_weights_format(format).verbosity(0));
    auto ddp = amp::parallel::make_distributed(model, group);
    for (int step = 0; step < 4; ++step) {
      const Batch local = rows(global_batch(step, 16), group.rank() * 8, 8);
      amp_test::train_step(ddp, optimizer, local.x, local.y, kLossOf);
    }
    double sum = 0;
    for (const auto& p : net->parameters()) {
      const auto lean = amp::detail::find_lean(p);
      sum += (lean ? lean->first->value(lean->second) : p.detach().to(torch::kFloat)).sum().item<double>();
    }
    std::cout << "[rank " << group.rank() << "] lean params " << amp::to_string(format) << ": " << std::hexfloat << sum
              << std::defaultfloat << std::endl;
  }
}

// The precision policy under amp::parallel: (1) no_sync accumulation at O2 bf16 sums in fp32: rank 0's
// micro-batch gradients are 256, 1, 1 and 1, rank 1's 1, 1, -256 and 1, so the average is 3, where summing in
// bf16 (256 + 1 rounds to 256) would give 1.5; (2) a model with an fp32 island (buckets of two dtypes) trains
// bit-identically on both ranks.
void scenario_policy(const ProcessGroup& group) {
  {
    auto net = torch::nn::Linear(torch::nn::LinearOptions(1, 1).bias(false));
    {
      torch::NoGradGuard no_grad;
      net->weight.fill_(1.0);
    }
    auto [model, optimizer] = amp::initialize(net, torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(1.0)),
                                              amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0));
    auto ddp = amp::parallel::make_distributed(model, group);
    const std::vector<double> c = group.rank() == 0 ? std::vector<double>{256, 1, 1, 1} : std::vector<double>{1, 1, -256, 1};
    const torch::Tensor x = torch::ones({1, 1});
    optimizer.zero_grad();
    for (size_t i = 0; i + 1 < c.size(); ++i) {
      auto no_sync = ddp.no_sync();
      auto scaled = amp::scale_loss(ddp(x).sum() * c[i], optimizer, amp::ScaleLossOptions().delay_unscale(true));
      scaled.backward();
    }
    {
      auto scaled = amp::scale_loss(ddp(x).sum() * c.back(), optimizer);
      scaled.backward();
    }
    const auto grads = amp::detail::OptimizerAccess::grads_for_step(optimizer, "scenario_policy");
    const double g = grads.at(0).item<double>();
    report(g == 3.0, "no_sync accumulation at O2 bf16 sums in fp32: the averaged gradient is 3 (bf16 sums give 1.5)",
           "got " + std::to_string(g));
    optimizer.step();
    report(net->weight.item<double>() == -2.0, "the step applies it", std::to_string(net->weight.item<double>()));
  }
  {
    torch::manual_seed(1);
    auto net = torch::nn::Sequential(torch::nn::Linear(12, 16), torch::nn::LayerNorm(torch::nn::LayerNormOptions({16})),
                                     torch::nn::ReLU(), torch::nn::Linear(16, 5));
    auto [model, optimizer] = amp::initialize(
        net, torch::optim::Adam(net->parameters(), torch::optim::AdamOptions(1e-2)),
        amp::Options("O2").low_precision_dtype(torch::kBFloat16).keep_fp32({"1", "3"}).verbosity(0));
    auto ddp = amp::parallel::make_distributed(model, group);
    for (int step = 0; step < 4; ++step) {
      const Batch local = rows(global_batch(step, 16), group.rank() * 8, 8);
      amp_test::train_step(ddp, optimizer, local.x, local.y, kLossOf);
    }
    report(net[3]->as<torch::nn::LinearImpl>()->weight.scalar_type() == torch::kFloat, "the kept head stays fp32");
    double sum = 0;
    for (const auto& p : net->parameters()) sum += p.detach().to(torch::kFloat).sum().item<double>();
    std::cout << "[rank " << group.rank() << "] policy params O2 bf16: " << std::hexfloat << sum << std::defaultfloat << std::endl;
  }
}

// The FP8 scenarios' MLP (16 -> 32 -> 32 -> 5: two FP8 layers, "0" and "2"), seeded alike on every rank.
torch::nn::Sequential fp8_scenario_mlp() {
  torch::manual_seed(3);
  return torch::nn::Sequential(torch::nn::Linear(16, 32), torch::nn::ReLU(), torch::nn::Linear(32, 32),
                               torch::nn::ReLU(), torch::nn::Linear(32, 5));
}
torch::optim::SGD fp8_scenario_sgd(torch::nn::Sequential& net) {
  return torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
}

// FP8 rowwise with auto_fallback under amp::parallel: only rank 1's inputs hold an inf, so only rank 1's FP8 layers
// see a non-finite amax; the ranks' flags are reduced, so on the eighth such step both ranks move the same layers
// to bf16, and the replicas stay bit-identical after.
void scenario_fp8_fallback(const ProcessGroup& group) {
  auto net = fp8_scenario_mlp();
  auto [model, optimizer] = amp::initialize(net, fp8_scenario_sgd(net), amp::Options("O2").low_precision_dtype(torch::kBFloat16)
                                                                           .verbosity(0).fp8(amp::Fp8Options().scaling(amp::Fp8Options::Scaling::kRowwise).auto_fallback(true)));
  auto ddp = amp::parallel::make_distributed(model, group);
  for (int step = 0; step < 10; ++step) {
    torch::manual_seed(7100 + step);
    torch::Tensor x = torch::randn({8, 16});
    const torch::Tensor y = torch::randint(5, {8}, torch::kLong);
    if (group.rank() == 1 && step < 8) x[2][3] = std::numeric_limits<float>::infinity();
    amp_test::train_step(ddp, optimizer, x, y, kLossOf);
    const auto moved = amp::fp8_fallbacks(optimizer);
    report(moved.size() == (step < 7 ? 0u : 2u), "fp8 auto_fallback step " + std::to_string(step) + ": " +
           std::to_string(moved.size()) + " layers moved on rank " + std::to_string(group.rank()));
  }
  report(amp::fp8_layers(optimizer).empty(), "fp8 auto_fallback: no layer left in FP8 on either rank");
  report(same_on_all_ranks(group, net->parameters()), "fp8 auto_fallback: weights identical on both ranks");
}

// FP8 with delayed scaling under amp::parallel: each rank sees other rows, but every rank commits the max over the
// ranks of each step's amaxes, so scales, histories and weights stay bit-identical; fc1's input history holds the
// global batch's amax.
void scenario_fp8(const ProcessGroup& group) {
  if (!amp::detail::fp8_supported_by_build()) {
    report(true, "fp8: skipped, this LibTorch build has no FP8");
    return;
  }
  auto net = fp8_scenario_mlp();
  auto [model, optimizer] = amp::initialize(net, fp8_scenario_sgd(net), amp::Options("O2").low_precision_dtype(torch::kBFloat16)
                                                                           .verbosity(0).fp8(amp::Fp8Options().scaling(amp::Fp8Options::Scaling::kDelayed).amax_history_len(4)));
  auto ddp = amp::parallel::make_distributed(model, group);
  const auto fp8 = amp::detail::precision_policy_of(*net)->fp8();
  for (int step = 0; step < 4; ++step) {
    torch::manual_seed(7000 + step);
    torch::Tensor x = torch::randn({16, 16});
    x.narrow(0, 8, 8).mul_(3.0);  // rank 1's rows are wider
    const torch::Tensor y = torch::randint(5, {16}, torch::kLong);
    const int64_t start = group.rank() * 8;
    amp_test::train_step(ddp, optimizer, x.narrow(0, start, 8), y.narrow(0, start, 8), kLossOf);
    const auto state = fp8->state_tensors();
    std::vector<torch::Tensor> tensors;
    for (const auto& [name, t] : state) tensors.push_back(t);
    report(same_on_all_ranks(group, tensors), "fp8 step " + std::to_string(step) + ": scales and amax history identical");
    const float global = x.to(torch::kBFloat16).abs().max().to(torch::kFloat).item<float>();
    const float committed = state[1].second[0][step].item<float>();  // history[slot fc1 input][column step]
    report(committed == global, "fp8 step " + std::to_string(step) + ": fc1's input amax is the global batch's",
           "committed " + str(committed) + ", global " + str(global));
  }
  report(same_on_all_ranks(group, net->parameters()), "fp8: weights identical on both ranks");
  scenario_fp8_fallback(group);
}

// TorchScript models under amp::parallel: a scripted MLP (defined in C++ with torch::jit::Module::define, so no
// Python is needed) trains on 2 x 8 samples per step at O2 bf16; rank 1 starts from other weights, which the wrap
// replaces with rank 0's. The replicas end bit-identical, and within O2 bf16's tolerance (scenario_train) of the
// same module trained on all 16 samples in one process.

// auto_fp32 under amp::parallel (O2 bf16): only rank 1's batches overflow layer "1" in the forward (rank 0's inputs
// are zeros), so only rank 1's diagnosis finds the module; the gradients are reduced, so both ranks see the
// overflow. The ranks agree on rank 1's module, both move it to fp32 (the wrapper hooks and buckets it again), and
// the replicas stay bit-identical through the steps that follow.
void scenario_auto_fp32(const ProcessGroup& group) {
  torch::manual_seed(5);
  auto net = torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::Linear(8, 1));
  {
    torch::NoGradGuard no_grad;
    net[0]->as<torch::nn::LinearImpl>()->weight.fill_(1.0);
    net[0]->as<torch::nn::LinearImpl>()->bias.zero_();
    net[1]->as<torch::nn::LinearImpl>()->weight.fill_(3e38);  // 40 x 3e38 overflows any dtype; 0 x 3e38 does not
  }
  auto [model, optimizer] = amp::initialize(
      net, torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(1e-3)),
      amp::Options("O2").low_precision_dtype(torch::kBFloat16).init_scale(1.0).auto_fp32(2).verbosity(0));
  auto ddp = amp::parallel::make_distributed(model, group);
  for (int step = 0; step < 6; ++step) {
    if (step == 3) {
      torch::NoGradGuard no_grad;  // the same finite weights on both ranks once the module is fp32
      net[1]->as<torch::nn::LinearImpl>()->weight.fill_(0.5);
    }
    torch::manual_seed(9000 + step);
    const torch::Tensor x = group.rank() == 1 ? torch::full({8, 4}, 10.0) + torch::rand({8, 4}) : torch::zeros({8, 4});
    optimizer.zero_grad();
    amp::scale_loss(ddp(x).pow(2).mean() * 1e-3, optimizer).backward();
    optimizer.step();
  }
  const auto moved = amp::fp32_modules(optimizer);
  report(moved == std::vector<std::string>{"1 (auto_fp32)"}, "auto_fp32 moved the module rank 1 found",
         moved.empty() ? "none" : moved.front() + (moved.size() > 1 ? " and more" : ""));
  report(optimizer.skipped_steps() == 3, "auto_fp32 skipped 3 steps", std::to_string(optimizer.skipped_steps()));
  report(same_on_all_ranks(group, net->parameters()), "auto_fp32 replicas identical");
  double sum = 0;
  for (const auto& p : net->parameters()) sum += p.detach().to(torch::kFloat).sum().item<double>();
  std::cout << "[rank " << group.rank() << "] auto_fp32 params O2 bf16: " << std::hexfloat << sum << std::defaultfloat << std::endl;
}

void scenario_torchscript(const ProcessGroup& group) {
  const auto options = amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0);
  auto train = [&](bool distributed) {
    auto module = scripted_mlp(distributed && group.rank() == 1 ? 8 : 7);
    torch::optim::SGD sgd(amp::parameters(module), torch::optim::SGDOptions(0.1).momentum(0.9));
    auto [model, optimizer] = amp::initialize(module, std::move(sgd), options);
    std::optional<amp::parallel::DistributedDataParallel<torch::jit::Module>> ddp;
    if (distributed) ddp.emplace(amp::parallel::make_distributed(model, group));
    auto forward = [&, &model = model](const torch::Tensor& x) { return (ddp ? (*ddp)(x) : model(x)).toTensor(); };
    for (int step = 0; step < 4; ++step) {
      const Batch batch = distributed ? rows(global_batch(step, 16), group.rank() * 8, 8) : global_batch(step, 16);
      amp_test::train_step(forward, optimizer, batch.x, batch.y, kLossOf);
    }
    return clones(amp::master_params(optimizer));
  };
  const auto distributed = train(true), single = train(false);
  const double d = max_abs_diff(distributed, single);
  report(d <= 2e-2, "TorchScript O2 bf16 on 2 x 8 samples matches one process on 16", "max diff " + str(d));
  report(same_on_all_ranks(group, distributed), "TorchScript replicas bit-identical on all ranks");
  double sum = 0;
  for (const auto& t : distributed) sum += t.sum().item<double>();
  std::cout << "[rank " << group.rank() << "] torchscript params O2 bf16: " << std::hexfloat << sum << std::defaultfloat << std::endl;
}

}  // namespace amp_worker
