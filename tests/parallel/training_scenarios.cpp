// The training scenarios: "train" (and its quick subset for the torchrun launch) and "syncbn".

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <torch/version.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "amp/amp.h"
#include "options/exception_message.h"
#include "scenarios.h"
#include "step_loop.h"
#include "support/training.h"
#include "worker_support.h"

namespace amp_worker {
namespace {

struct Setup {
  std::string label;
  amp::Options options{"O2"};
  amp::parallel::DistributedDataParallelOptions ddp;
  bool freeze_first = false;
  bool two_losses = false;
  bool accumulate = false;  // two micro-batches per step, the first under no_sync
};

struct Trajectory {
  std::vector<torch::Tensor> params, masters, momentum;
  double scale = 0;
  int64_t skipped = 0;
  amp::parallel::CommunicationStats stats;
  double seconds_per_step = 0;
};

constexpr int kSteps = 8;
constexpr int kOverflowStep = 3;

// Trains `setup` for kSteps. With `group`, through make_distributed on this rank's half of each global batch;
// without, one process on the whole batch (the reference). Checks cross-rank equality after every step.
Trajectory train(const Setup& setup, const ProcessGroup* group) {
  const int rank = group ? group->rank() : 0;
  auto net = make_mlp(group ? 100 + rank : 100);  // different weights per rank: make_distributed broadcasts rank 0's
  if (setup.freeze_first) {
    for (auto& p : net[0]->parameters()) p.set_requires_grad(false);
  }
  std::vector<torch::Tensor> trainable;
  for (auto& p : net->parameters()) {
    if (p.requires_grad()) trainable.push_back(p);
  }
  torch::optim::SGD sgd(trainable, torch::optim::SGDOptions(0.1).momentum(0.9));
  auto [model, optimizer] = amp::initialize(net, std::move(sgd), setup.options);
  std::optional<amp::parallel::DistributedDataParallel<torch::nn::Sequential>> ddp;
  if (group) {
    ddp.emplace(amp::parallel::make_distributed(model, *group, setup.ddp));
    if (rank != 0 && setup.label == "O2 bf16") {
      // Rank 1 started from other weights: now the model and the fp32 masters hold rank 0's, bit for bit.
      auto reference = make_mlp(100);
      std::vector<torch::Tensor> want;
      for (auto& p : reference->parameters()) want.push_back(p.detach());
      auto masters = amp::master_params(optimizer);
      report(max_abs_diff(masters, want) == 0, "make_distributed broadcasts rank 0's weights into the fp32 masters",
             "max |master - rank 0's fp32 weight| = " + str(max_abs_diff(masters, want)));
    }
  }
  StepLoop loop;
  loop.steps = kSteps;
  loop.accumulate = setup.accumulate;
  loop.two_losses = setup.two_losses;
  loop.batch = [](int step) { return global_batch(step, kGlobal); };
  // An inf in one sample of rank 1's half (dynamic loss scales only: a fixed scale has no overflow check).
  loop.inf_row = [&setup](int step) {
    const bool dynamic = setup.options.resolve().loss_scale.is_dynamic();
    return step == kOverflowStep && dynamic ? kGlobal - 3 : int64_t{-1};
  };
  loop.state = [&setup, &model = model, &optimizer = optimizer] {
    std::vector<torch::Tensor> state = clones(model->parameters());
    for (auto& t : amp::master_params(optimizer)) state.push_back(t.detach());
    for (auto& t : momentum_of(optimizer)) state.push_back(t);
    state.push_back(torch::tensor({amp::loss_scale(optimizer), amp::loss_scale(optimizer, setup.two_losses ? 1 : 0),
                                   static_cast<double>(optimizer.skipped_steps())}, torch::kDouble));
    return state;
  };
  const auto start = std::chrono::steady_clock::now();
  const bool equal_every_step = run_steps(loop, model, optimizer, ddp, group);
  Trajectory t;
  t.seconds_per_step = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / kSteps;
  if (group) {
    report(equal_every_step, setup.label + ": parameters, masters, momentum, loss scale and skipped steps bit-identical on all ranks after every step");
    t.stats = ddp->communication_stats();
  }
  t.params = clones(model->parameters());
  t.masters = clones(amp::master_params(optimizer));
  t.momentum = clones(momentum_of(optimizer));
  t.scale = amp::loss_scale(optimizer);
  t.skipped = optimizer.skipped_steps();
  return t;
}

// 2 ranks x half batch against 1 process x full batch: same loss scale and skipped steps exactly, weights within
// `tolerance` (see tests/parallel_test.cpp for why these tolerances).
Trajectory compare_with_single_process(const Setup& setup, const ProcessGroup& group, double tolerance) {
  Trajectory ddp = train(setup, &group);
  Trajectory single = train(setup, nullptr);
  const double d = max_abs_diff(ddp.masters, single.masters);
  report(ddp.scale == single.scale && ddp.skipped == single.skipped,
         setup.label + ": loss scale and skipped steps equal 1 process x full batch",
         "2 ranks: scale " + str(ddp.scale) + ", skipped " + std::to_string(ddp.skipped) + "; 1 process: scale " +
             str(single.scale) + ", skipped " + std::to_string(single.skipped));
  report(!setup.options.resolve().loss_scale.is_dynamic() || (ddp.skipped == 1 && single.skipped == 1 && ddp.scale == 32768.0),
         setup.label + ": the inf on rank 1's batch only skipped the step on every rank and halved the scale");
  report(d <= tolerance, setup.label + ": weights match 1 process x full batch",
         "max |2 ranks - 1 process| = " + str(d) + " (tolerance " + str(tolerance) + "), " +
             str(ddp.seconds_per_step * 1e3) + " ms/step vs " + str(single.seconds_per_step * 1e3) + " ms/step");
  return ddp;
}

// NOTE [fp32 reductions reach the masters]: with allreduce_always_fp32 at O2, after a backward each fp32 master's
// gradient is the fp32 average of the ranks' low-precision gradients, unscaled, bit for bit: (a + b rounded to fp32)
// / 2 times 1/scale, with a and b each rank's local gradient (torch::autograd::grad on the same forward: nothing
// accumulates, so nothing is reduced) summed exactly in double (2 ranks: one rounding to fp32, as Gloo's sum). Apex rounded the average back to the gradient's dtype first;
// the check counts how many elements that rounding would have changed, so it can tell the two apart.
void check_fp32_sums_reach_masters(const ProcessGroup& group) {
  std::vector<std::pair<std::string, torch::Dtype>> dtypes = {{"bf16", torch::kBFloat16}};
#if TORCH_VERSION_MAJOR >= 2
  dtypes.emplace_back("fp16", torch::kHalf);
#endif
  for (const auto& [dtype_name, dtype] : dtypes) {
    for (const bool delay : {false, true}) {
      const std::string label = "allreduce_always_fp32 O2 " + dtype_name + (delay ? " delay_allreduce" : "");
      auto net = make_mlp(100);
      torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
      auto [model, optimizer] =
          amp::initialize(net, std::move(sgd), amp::Options("O2").low_precision_dtype(dtype).verbosity(0));
      auto ddp = amp::parallel::make_distributed(
          model, group, amp::parallel::DistributedDataParallelOptions().allreduce_always_fp32(true).delay_allreduce(delay));
      const Batch mine = rows(global_batch(0, kGlobal), group.rank() * (kGlobal / 2), kGlobal / 2);
      const double scale = amp::loss_scale(optimizer);
      std::vector<torch::Tensor> params = model->parameters();
      const auto local = torch::autograd::grad({loss_of(ddp(mine.x), mine.y).to(torch::kFloat) * scale}, params);
      std::vector<torch::Tensor> flat;
      for (const auto& g : local) flat.push_back(g.to(torch::kDouble).reshape({-1}));
      std::vector<torch::Tensor> sum{torch::cat(flat)};
      group.c10d()->allreduce(sum)->wait();
      optimizer.zero_grad();
      amp::scale_loss(loss_of(ddp(mine.x), mine.y), optimizer).backward();
      const float inv = static_cast<float>(1.0 / scale);
      const auto average = sum[0].to(torch::kFloat) / static_cast<float>(group.world_size());
      const auto expected = average * inv;
      const auto rounded = average.to(dtype).to(torch::kFloat) * inv;  // Apex's: the average rounded into .grad first
      std::vector<torch::Tensor> got;
      for (const auto& m : amp::master_params(optimizer)) got.push_back(m.grad().reshape({-1}));
      const auto master_grads = torch::cat(got);
      const int64_t differ = master_grads.ne(expected).sum().item<int64_t>();
      const int64_t apex_differ = rounded.ne(expected).sum().item<int64_t>();
      report(differ == 0 && apex_differ > 0, label + ": the masters' gradients are the fp32 average, unscaled, bit for bit",
             std::to_string(differ) + " of " + std::to_string(expected.numel()) + " differ; rounding the average to " +
                 dtype_name + " first (Apex) would change " + std::to_string(apex_differ));
    }
  }
}

int64_t trainable_numel(bool freeze_first) {
  auto net = make_mlp(1);
  int64_t n = 0;
  for (size_t i = 0; i < net->size(); ++i) {
    for (auto& p : net[i]->parameters()) n += (freeze_first && i == 0) ? 0 : p.numel();
  }
  return n;
}

}  // namespace

void scenario_train(const ProcessGroup& group, bool quick) {
  const auto bf16 = amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0);
  // O2 bf16: each rank's gradients are rounded to bf16 before the sum (1 process rounds the full-batch sum once),
  // so a step's update can differ by a few bf16 ulps of the gradient (2^-8 relative): |dw| <= lr * 3 * 2^-8 * |g|
  // per step. With |g| < 1, lr 0.1 and momentum 0.9 (an error is carried ~1/(1-0.9) = 10 steps), 8 steps stay
  // below 8 * 10 * 0.1 * 3 * 2^-8 ~ 0.1; we require 2e-2 and measure ~1e-3.
  Setup o2;
  o2.label = "O2 bf16";
  o2.options = bf16;
  const Trajectory base = compare_with_single_process(o2, group, 2e-2);
  const int64_t numel = trainable_numel(false);
  // LibTorch 1.13's Gloo can't sum bfloat16: there bf16 gradients travel as fp32 (docs/distributed.md).
  const int64_t bf16_bytes = TORCH_VERSION_MAJOR >= 2 ? 2 : 4;
  report(base.stats.allreduce_bytes == base.stats.synced_backwards * numel * bf16_bytes,
         std::string("O2 bf16: gradients travel in ") + (bf16_bytes == 2 ? "bf16 (2 bytes each)" : "fp32 on LibTorch 1.13 (4 bytes each)"),
         std::to_string(base.stats.allreduce_bytes) + " bytes over " + std::to_string(base.stats.synced_backwards) +
             " backward passes, " + std::to_string(numel) + " gradients");
  if (quick) return;

  // O0: fp32 everywhere; the sum over 2 ranks differs from the full-batch sum only in summation order (~1e-7
  // relative per step), well inside 1e-5.
  Setup o0;
  o0.label = "O0";
  o0.options = amp::Options("O0").verbosity(0);
  const Trajectory o0_run = compare_with_single_process(o0, group, 1e-5);
  report(o0_run.stats.allreduce_bytes == o0_run.stats.synced_backwards * numel * 4, "O0: gradients travel in fp32");

  // O1: fp32 weights, bf16 GEMMs inside; the weight-gradient GEMM sums over the batch and rounds its result to
  // bf16, once for the full batch and once per half here: the same bf16-ulp argument as O2, so O2's 2e-2
  // (measured 2.8e-4 on LibTorch 2.13, 2.0e-3 on 1.13, whose bf16 GEMM rounds partial sums more often).
  Setup o1;
  o1.label = "O1 bf16";
  o1.options = amp::Options("O1").low_precision_dtype(torch::kBFloat16).verbosity(0);
  compare_with_single_process(o1, group, 2e-2);

#if TORCH_VERSION_MAJOR >= 2
  Setup fp16;
  fp16.label = "O2 fp16";
  fp16.options = amp::Options("O2").low_precision_dtype(torch::kHalf).verbosity(0);
  compare_with_single_process(fp16, group, 5e-3);
#endif

  // delay_allreduce: one reduction after backward computes exactly what the overlapped buckets compute.
  Setup delay = o2;
  delay.label = "O2 bf16 delay_allreduce";
  delay.ddp.delay_allreduce(true);
  const Trajectory delayed = compare_with_single_process(delay, group, 2e-2);
  report(max_abs_diff(delayed.masters, base.masters) == 0 && max_abs_diff(delayed.params, base.params) == 0,
         "delay_allreduce is bit-identical to the overlapped all-reduce",
         "max |delayed - overlapped| = " + str(max_abs_diff(delayed.masters, base.masters)));
  report(delayed.stats.allreduce_calls == delayed.stats.synced_backwards,
         "delay_allreduce: one all-reduce per backward", std::to_string(delayed.stats.allreduce_calls) + " calls");

  // allreduce_always_fp32: bf16 gradients summed in fp32 (4 bytes each); for 2 ranks the fp32 sum of two bf16
  // values is exact, so the result rounds like bf16's own sum: within O2's tolerance of the bf16 reduction.
  Setup fp32_reduce = o2;
  fp32_reduce.label = "O2 bf16 allreduce_always_fp32";
  fp32_reduce.ddp.allreduce_always_fp32(true);
  const Trajectory wide = compare_with_single_process(fp32_reduce, group, 2e-2);
  report(wide.stats.allreduce_bytes == wide.stats.synced_backwards * numel * 4,
         "allreduce_always_fp32: bf16 gradients travel in fp32 (4 bytes each)",
         std::to_string(wide.stats.allreduce_bytes) + " bytes");
  check_fp32_sums_reach_masters(group);

  // gradient_predivide_factor 3: g/3 summed, times 3/2: the same average up to bf16 rounding of the thirds.
  Setup predivide = o2;
  predivide.label = "O2 bf16 gradient_predivide_factor 3";
  predivide.ddp.gradient_predivide_factor(3.0);
  const Trajectory pre = compare_with_single_process(predivide, group, 2e-2);
  Setup o0_pre = o0;
  o0_pre.label = "O0 gradient_predivide_factor 3";
  o0_pre.ddp.gradient_predivide_factor(3.0);
  compare_with_single_process(o0_pre, group, 1e-5);

  // A small bucket cap: many buckets, same result.
  Setup small = o2;
  small.label = "O2 bf16 bucket_cap_mb 0.0005";
  small.ddp.bucket_cap_mb(0.0005);
  const Trajectory many = compare_with_single_process(small, group, 2e-2);
  report(many.stats.allreduce_calls > 2 * many.stats.synced_backwards && max_abs_diff(many.masters, base.masters) == 0,
         "bucket_cap_mb: several buckets per backward, bit-identical result",
         std::to_string(many.stats.allreduce_calls) + " all-reduces over " + std::to_string(many.stats.synced_backwards) +
             " backward passes");

  // Frozen first layer: not reduced, unchanged, equal everywhere.
  Setup frozen = o2;
  frozen.label = "O2 bf16 frozen first layer";
  frozen.freeze_first = true;
  const Trajectory fr = compare_with_single_process(frozen, group, 2e-2);
  auto initial = make_mlp(100);
  report(torch::equal(fr.params[0], initial[0]->parameters()[0].to(torch::kBFloat16)),
         "frozen parameters stay rank 0's initial weights");
  report(fr.stats.allreduce_bytes == fr.stats.synced_backwards * trainable_numel(true) * bf16_bytes,
         "frozen parameters are not reduced");

  // Two losses (num_losses 2), one backward each, both reduced before their own unscale.
  Setup two = o2;
  two.label = "O2 bf16 two losses";
  two.options = amp::Options(bf16).num_losses(2);
  two.two_losses = true;
  const Trajectory tl = compare_with_single_process(two, group, 2e-2);
  report(tl.stats.synced_backwards == 2 * kSteps, "two losses: both backward passes reduced",
         std::to_string(tl.stats.synced_backwards) + " reduced backward passes");

  // Gradient accumulation: the first micro-batch under no_sync (delay_unscale), the second reduces the sum.
  Setup acc = o2;
  acc.label = "O2 bf16 no_sync accumulation";
  acc.accumulate = true;
  const Trajectory ac = compare_with_single_process(acc, group, 2e-2);
  report(ac.stats.synced_backwards == kSteps, "no_sync: only the last micro-batch's backward is reduced",
         std::to_string(ac.stats.synced_backwards) + " reduced backward passes in " + std::to_string(kSteps) + " steps");
  Setup acc0 = o0;
  acc0.label = "O0 no_sync accumulation";
  acc0.accumulate = true;
  compare_with_single_process(acc0, group, 1e-5);

  // no_sync misuse: a plain scale_loss inside no_sync() unscales the rank's own gradients.
  {
    auto net = make_mlp(7);
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
    auto [model, optimizer] = amp::initialize(net, std::move(sgd), bf16);
    auto ddp = amp::parallel::make_distributed(model, group);
    const Batch b = rows(global_batch(0, kGlobal), group.rank() * 8, 8);
    std::string error;
    try {
      {
        auto no_sync = ddp.no_sync();
        auto scaled = amp::scale_loss(loss_of(ddp(b.x), b.y), optimizer);
        scaled.backward();
      }
      (void)ddp(b.x);
    } catch (const std::exception& e) {
      error = amp::detail::message_of(e);
    }
    report(error.find("no_sync()") != std::string::npos && error.find("delay_unscale(true)") != std::string::npos,
           "no_sync with a plain scale_loss at O2 is refused at the next forward", error.substr(0, 160));
  }
  (void)pre;
}

// ---- SyncBatchNorm -------------------------------------------------------------------------------------------

void scenario_syncbn(const ProcessGroup& group) {
  const int rank = group.rank();
  // Uneven shards (3 and 5 samples) in fp32, even ones in bf16; statistics in fp32 either way.
  for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
    const int64_t channels = 4;
    const int64_t n0 = dtype == torch::kFloat ? 3 : 4, n1 = dtype == torch::kFloat ? 5 : 4;
    torch::manual_seed(11);
    auto x = (torch::randn({n0 + n1, channels, 5, 5}) * 3 + 1).to(dtype).to(torch::kFloat);
    auto dy = torch::randn({n0 + n1, channels, 5, 5}).to(dtype).to(torch::kFloat);
    auto weight = torch::rand({channels}) + 0.5, bias = torch::randn({channels});
    // Reference: BatchNorm2d on the whole batch.
    torch::nn::BatchNorm2d ref(channels);
    {
      torch::NoGradGuard no_grad;
      ref->weight.copy_(weight);
      ref->bias.copy_(bias);
    }
    auto xr = x.clone().requires_grad_(true);
    auto yr = ref(xr);
    yr.backward(dy);
    // SyncBatchNorm2d on this rank's shard, activations in `dtype`.
    const int64_t start = rank == 0 ? 0 : n0, count = rank == 0 ? n0 : n1;
    amp::parallel::SyncBatchNorm2d bn(torch::nn::BatchNormOptions(channels), group);
    {
      torch::NoGradGuard no_grad;
      bn->weight.copy_(weight);
      bn->bias.copy_(bias);
    }
    auto xl = x.narrow(0, start, count).to(dtype).requires_grad_(true);
    auto yl = bn(xl);
    yl.backward(dy.narrow(0, start, count).to(dtype));
    std::vector<torch::Tensor> param_grads{bn->weight.grad().clone(), bn->bias.grad().clone()};
    for (auto& g : param_grads) {
      std::vector<torch::Tensor> one{g};
      group.c10d()->allreduce(one)->wait();
    }
    auto diff = [](const torch::Tensor& a, const torch::Tensor& b) {
      return (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>();
    };
    // bf16: the output and dx are rounded to bf16 (|y| < 8: half an ulp is 2^-5); fp32: summation order only.
    const double tol = dtype == torch::kFloat ? 1e-5 : 3.2e-2;
    const double dyv = diff(yl, yr.narrow(0, start, count)), dxv = diff(xl.grad(), xr.grad().narrow(0, start, count));
    const double dw = diff(param_grads[0], ref->weight.grad()), db = diff(param_grads[1], ref->bias.grad());
    const double dm = diff(bn->running_mean, ref->running_mean), dv = diff(bn->running_var, ref->running_var);
    const std::string label = std::string("SyncBatchNorm2d ") + (dtype == torch::kFloat ? "fp32 3+5 samples" : "bf16 4+4 samples");
    report(dyv <= tol && dxv <= tol, label + ": output and input gradient equal BatchNorm2d on the whole batch",
           "max |dy| " + str(dyv) + ", |dx| " + str(dxv));
    report(dw <= 1e-3 && db <= 1e-3, label + ": weight and bias gradients (summed over ranks) equal the whole batch's",
           "|dw| " + str(dw) + ", |db| " + str(db));
    report(dm <= 1e-6 && dv <= 1e-6 && bn->num_batches_tracked.item<int64_t>() == 1,
           label + ": running statistics equal the whole batch's", "|mean| " + str(dm) + ", |var| " + str(dv));
    report(same_on_all_ranks(group, {bn->running_mean, bn->running_var}), label + ": running statistics bit-identical on all ranks");
  }

  // convert_syncbn_model + O2 bf16 + DDP on 2 x 8 samples against BatchNorm on 16 in one process.
  auto make_net = [](uint64_t seed) {
    torch::manual_seed(seed);
    return torch::nn::Sequential(torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 6, 3).padding(1)),
                                 torch::nn::BatchNorm2d(6), torch::nn::ReLU(), torch::nn::Flatten(),
                                 torch::nn::Linear(6 * 8 * 8, 4));
  };
  // Five O2 bf16 steps of `net` (its BatchNorms converted and the batch split over the ranks when distributed):
  // the fp32 masters and the buffers after them.
  auto train_syncbn = [&](auto net, bool distributed) {
    if (distributed) amp::parallel::convert_syncbn_model(*net, group);
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    auto [model, optimizer] = amp::initialize(net, std::move(sgd), amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0));
    std::optional<amp::parallel::DistributedDataParallel<decltype(net)>> ddp;
    if (distributed) ddp.emplace(amp::parallel::make_distributed(model, group));
    auto forward = [&, &model = model](const torch::Tensor& input) { return ddp ? (*ddp)(input) : model(input); };
    for (int step = 0; step < 5; ++step) {
      torch::manual_seed(900 + step);
      auto x = torch::randn({16, 1, 8, 8});
      auto y = torch::randint(4, {16}, torch::kLong);
      if (distributed) {
        x = x.narrow(0, rank * 8, 8);
        y = y.narrow(0, rank * 8, 8);
      }
      amp_test::train_step(forward, optimizer, x, y);
    }
    std::vector<torch::Tensor> out = clones(amp::master_params(optimizer));
    for (auto& b : net->buffers()) out.push_back(b.detach().clone());
    return out;
  };
  auto run = [&](bool distributed) {
    auto net = make_net(21);
    auto out = train_syncbn(net, distributed);
    const bool converted = amp::parallel::is_sync_batchnorm(*net[1]) && amp::is_batchnorm(*net[1]) &&
                           net[1]->parameters()[0].scalar_type() == torch::kFloat;
    return std::make_pair(out, converted);
  };
  auto [synced, converted] = run(true);
  auto [single, unused] = run(false);
  report(converted, "convert_syncbn_model: the Sequential's BatchNorm2d is a SyncBatchNorm2d, kept fp32 at O2");
  const double d = max_abs_diff(synced, single);
  report(d <= 2e-2, "convert_syncbn_model + O2 bf16 on 2 x 8 samples matches BatchNorm on 16 in one process (weights, running statistics)",
         "max diff " + str(d));
  report(same_on_all_ranks(group, synced), "SyncBatchNorm training: weights and statistics bit-identical on all ranks");

  // convert_syncbn_model on BatchNorm layers a custom module holds as members (as every ResNet block does): the
  // layers stay, their batch_norm runs synchronized; O2 bf16 + DDP on 2 x 8 samples against 16 in one process.
  struct MemberNetImpl : torch::nn::Module {
    MemberNetImpl()
        : conv(register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 6, 3).padding(1)))),
          bn(register_module("bn", torch::nn::BatchNorm2d(6))),
          fc(register_module("fc", torch::nn::Linear(6 * 8 * 8, 4))) {}
    torch::Tensor forward(const torch::Tensor& x) { return fc(torch::relu(bn(conv(x))).flatten(1)); }
    torch::nn::Conv2d conv;
    torch::nn::BatchNorm2d bn;
    torch::nn::Linear fc;
  };
  auto run_member = [&](bool distributed) {
    torch::manual_seed(21);
    return train_syncbn(std::make_shared<MemberNetImpl>(), distributed);
  };
  const auto member_synced = run_member(true), member_single = run_member(false);
  const double dm = max_abs_diff(member_synced, member_single);
  report(dm <= 2e-2, "convert_syncbn_model on a member BatchNorm2d + O2 bf16 on 2 x 8 samples matches BatchNorm on 16 "
         "in one process (weights, running statistics)", "max diff " + str(dm));
  report(same_on_all_ranks(group, member_synced), "member SyncBatchNorm training: bit-identical on all ranks");

  // broadcast_buffers: plain BatchNorm's statistics drift apart per rank; the next forward makes them rank 0's.
  for (bool broadcast : {true, false}) {
    auto net = make_net(31);
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.05));
    auto [model, optimizer] = amp::initialize(net, std::move(sgd), amp::Options("O0").verbosity(0));
    auto ddp = amp::parallel::make_distributed(model, group,
                                               amp::parallel::DistributedDataParallelOptions().broadcast_buffers(broadcast));
    torch::manual_seed(40 + rank);
    (void)ddp(torch::randn({8, 1, 8, 8}));  // training forward: local statistics
    const bool drifted = !same_on_all_ranks(group, net->buffers());
    ddp.eval();
    {
      torch::NoGradGuard no_grad;
      (void)ddp(torch::randn({2, 1, 8, 8}));  // eval forward: statistics unchanged, buffers broadcast before it
    }
    const bool equal = same_on_all_ranks(group, net->buffers());
    report(drifted && equal == broadcast,
           std::string("broadcast_buffers(") + (broadcast ? "true" : "false") + "): buffers " +
               (broadcast ? "are rank 0's after the next forward" : "stay per rank"));
  }
}

}  // namespace amp_worker
