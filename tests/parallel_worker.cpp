// One rank of the multi-process amp::parallel tests (tests/parallel_test.cpp launches two of these, by hand
// and through torchrun). Usage: amp_parallel_worker SCENARIO. Every check prints one line
// "[rank R] ok|FAIL <name>: <details>"; the exit code is 0 when every check passed on this rank.
//
// Scenarios:
//   train    O0/O1/O2 training on 2 ranks x half batch against 1 process x full batch (computed on each rank),
//            parameters/masters/momentum/loss scale bit-identical across ranks after every step, an inf on one
//            rank's batch skipping the step everywhere, delay_allreduce, allreduce_always_fp32,
//            gradient_predivide_factor, frozen parameters, two losses, no_sync accumulation and its misuse.
//   quick    O2 bf16 only (the torchrun launch).
//   syncbn   SyncBatchNorm against BatchNorm on the whole batch (fp32, bf16, uneven batches), convert_syncbn_model
//            + O2 training, buffers broadcast before each forward.
//   mismatch rank 1 builds a different model: make_distributed throws on both ranks, naming the parameter.
//   dies     rank 1 exits after joining; rank 0's next backward fails with amp's error within the timeout.
//   unused   delay_allreduce with parameters only some ranks reach (MoE-style routing to head a or b, head c never
//            used): O0/O2 against 1 process x full batch, ranks bit-identical, no_sync accumulation, an inf routed
//            to a head only one rank reached, heads no rank reached keep no gradient (torch's find_unused_parameters).
#include <torch/script.h>
#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/version.h>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <sstream>
#include <string>
#include <type_traits>

#include "amp/amp.h"
#include "options/exception_message.h"
#include "casting/fp8.h"
#include "casting/precision_policy.h"
#include "optim/lean_masters.h"
#include "optim/optimizer_access.h"
#include "optim/optimizer_state_key.h"

namespace {

using amp::parallel::ProcessGroup;
using amp::detail::message_of;

int g_rank = 0;
int g_failures = 0;

void report(bool ok, const std::string& name, const std::string& details = "") {
  if (!ok) ++g_failures;
  std::cout << "[rank " << g_rank << "] " << (ok ? "ok   " : "FAIL ") << name << (details.empty() ? "" : ": " + details)
            << std::endl;
}

std::string str(double v) {
  std::ostringstream s;
  s.precision(6);
  s << v;
  return s.str();
}

// Returns whether `tensors` hold the same bits on every rank (rank 0's copy is broadcast and compared).
bool same_on_all_ranks(const ProcessGroup& group, const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> flat;
  for (const auto& t : tensors) flat.push_back(t.detach().to(torch::kDouble).reshape({-1}));
  auto mine = torch::cat(flat);
  std::vector<torch::Tensor> theirs{mine.clone()};
  c10d::BroadcastOptions from0;
  from0.rootRank = 0;
  group.c10d()->broadcast(theirs, from0)->wait();
  std::vector<torch::Tensor> flag{torch::full({1}, torch::equal(mine, theirs[0]) ? 1.0 : 0.0)};
  c10d::AllreduceOptions min;
  min.reduceOp = c10d::ReduceOp::MIN;
  group.c10d()->allreduce(flag, min)->wait();
  return flag[0].item<double>() == 1.0;
}

double max_abs_diff(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double d = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    d = std::max(d, (a[i].detach().to(torch::kDouble) - b[i].detach().to(torch::kDouble)).abs().max().item<double>());
  }
  return d;
}

std::vector<torch::Tensor> clones(const std::vector<torch::Tensor>& ts) {
  std::vector<torch::Tensor> out;
  for (const auto& t : ts) out.push_back(t.detach().clone());
  return out;
}

using amp::detail::state_key;

// SGD momentum buffers, in parameter order (empty where a parameter has none yet).
std::vector<torch::Tensor> momentum_of(torch::optim::SGD& sgd) {
  std::vector<torch::Tensor> out;
  auto& state = sgd.state();
  for (auto& group : sgd.param_groups()) {
    for (auto& p : group.params()) {
      auto it = state.find(state_key(state, p));
      if (it != state.end()) out.push_back(static_cast<torch::optim::SGDParamState&>(*it->second).momentum_buffer());
    }
  }
  return out;
}

torch::nn::Sequential make_mlp(uint64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(12, 32), torch::nn::ReLU(), torch::nn::Linear(32, 32),
                               torch::nn::ReLU(), torch::nn::Linear(32, 5));
}

struct Batch {
  torch::Tensor x, y;
};

// The global batch of `step` (every rank draws the same one) and this rank's rows of it.
Batch global_batch(int step, int64_t size) {
  torch::manual_seed(5000 + step);
  return {torch::randn({size, 12}), torch::randint(5, {size}, torch::kLong)};
}

Batch rows(const Batch& b, int64_t start, int64_t count) { return {b.x.narrow(0, start, count), b.y.narrow(0, start, count)}; }

// Per-sample weights of the loss: 1, or inf for the sample `inf_at` (an overflow that starts on one rank only).
torch::Tensor loss_of(const torch::Tensor& logits, const torch::Tensor& y, int64_t inf_at = -1) {
  auto per_sample = torch::nn::functional::cross_entropy(
      logits, y, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
  if (inf_at >= 0) {
    auto w = torch::ones_like(per_sample);
    w[inf_at] = std::numeric_limits<float>::infinity();
    per_sample = per_sample * w;
  }
  return per_sample.mean();
}

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
constexpr int64_t kGlobal = 16;  // global batch; each of 2 ranks gets 8

// Trains `setup` for kSteps. With `group`, through make_distributed on this rank's half of each global batch;
// without, one process on the whole batch (the reference). Checks cross-rank equality after every step.
Trajectory train(const Setup& setup, const ProcessGroup* group) {
  const int world = group ? group->world_size() : 1;
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
  auto forward = [&](const torch::Tensor& x) { return ddp ? (*ddp)(x) : model(x); };
  const int64_t local = kGlobal / world;
  bool equal_every_step = true;
  const auto start = std::chrono::steady_clock::now();
  for (int step = 0; step < kSteps; ++step) {
    const Batch global = global_batch(step, kGlobal);
    // An inf in one sample of rank 1's half (dynamic loss scales only: a fixed scale has no overflow check).
    const bool dynamic = setup.options.resolve().loss_scale.is_dynamic();
    const int64_t inf_global = step == kOverflowStep && dynamic ? kGlobal - 3 : -1;
    const int64_t inf_local = inf_global - rank * local;
    const int64_t inf_here = inf_global >= 0 && inf_local >= 0 && inf_local < local ? inf_local : -1;
    optimizer.zero_grad();
    if (setup.accumulate) {
      // Micro-batch A = the first half of each rank's rows, B = the second half; the reference runs the same
      // two micro-batches over the whole batch (A = first halves of both ranks' rows).
      for (int micro = 0; micro < 2; ++micro) {
        Batch mine;
        int64_t inf_micro = -1;
        if (group) {
          mine = rows(global, rank * local + micro * local / 2, local / 2);
          if (inf_here >= 0 && inf_here / (local / 2) == micro) inf_micro = inf_here % (local / 2);
        } else {
          const int64_t half = kGlobal / 2, quarter = kGlobal / 4;  // the 2-rank run's shard and micro-batch
          auto a = rows(global, micro * quarter, quarter), b = rows(global, half + micro * quarter, quarter);
          mine = {torch::cat({a.x, b.x}), torch::cat({a.y, b.y})};
          if (inf_global >= 0 && (inf_global % half) / quarter == micro) {
            inf_micro = (inf_global / half) * quarter + inf_global % quarter;
          }
        }
        if (micro == 0 && ddp) {
          auto no_sync = ddp->no_sync();
          auto loss = loss_of(forward(mine.x), mine.y, inf_micro);
          auto scaled = amp::scale_loss(loss, optimizer, amp::ScaleLossOptions().delay_unscale(true));
          scaled.backward();
        } else {
          auto loss = loss_of(forward(mine.x), mine.y, inf_micro);
          auto scaled = amp::scale_loss(loss, optimizer, amp::ScaleLossOptions().delay_unscale(micro == 0));
          scaled.backward();
        }
      }
    } else {
      const Batch mine = group ? rows(global, rank * local, local) : global;
      auto loss = loss_of(forward(mine.x), mine.y, group ? inf_here : inf_global);
      {
        auto scaled = amp::scale_loss(loss, optimizer);
        scaled.backward();
      }
      if (setup.two_losses) {
        auto second = forward(mine.x).pow(2).mean() * 0.1;
        auto scaled = amp::scale_loss(second, optimizer, amp::ScaleLossOptions().loss_id(1));
        scaled.backward();
      }
    }
    optimizer.step();
    if (group) {
      std::vector<torch::Tensor> state = clones(model->parameters());
      for (auto& t : amp::master_params(optimizer)) state.push_back(t.detach());
      for (auto& t : momentum_of(optimizer)) state.push_back(t);
      state.push_back(torch::tensor({amp::loss_scale(optimizer), amp::loss_scale(optimizer, setup.two_losses ? 1 : 0),
                                     static_cast<double>(optimizer.skipped_steps())}, torch::kDouble));
      equal_every_step = same_on_all_ranks(*group, state) && equal_every_step;
    }
  }
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

int64_t trainable_numel(bool freeze_first) {
  auto net = make_mlp(1);
  int64_t n = 0;
  for (size_t i = 0; i < net->size(); ++i) {
    for (auto& p : net[i]->parameters()) n += (freeze_first && i == 0) ? 0 : p.numel();
  }
  return n;
}

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
      error = message_of(e);
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
    for (int step = 0; step < 5; ++step) {
      torch::manual_seed(900 + step);
      auto x = torch::randn({16, 1, 8, 8});
      auto y = torch::randint(4, {16}, torch::kLong);
      if (distributed) {
        x = x.narrow(0, rank * 8, 8);
        y = y.narrow(0, rank * 8, 8);
      }
      optimizer.zero_grad();
      auto loss = torch::nn::functional::cross_entropy(ddp ? (*ddp)(x) : model(x), y);
      {
        auto scaled = amp::scale_loss(loss, optimizer);
        scaled.backward();
      }
      optimizer.step();
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

// ---- Parameters only some ranks reach (delay_allreduce) -------------------------------------------------------

// A trunk and three heads: a sample goes to head `a` when its first feature is positive, to `b` otherwise (MoE-style
// routing: a head that none of a rank's samples is routed to gets no gradient on that rank); `c` is never used.
struct RouterImpl : torch::nn::Module {
  torch::nn::Linear trunk{register_module("trunk", torch::nn::Linear(12, 16))};
  torch::nn::Linear a{register_module("a", torch::nn::Linear(16, 5))};
  torch::nn::Linear b{register_module("b", torch::nn::Linear(16, 5))};
  torch::nn::Linear c{register_module("c", torch::nn::Linear(16, 5))};
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::relu(trunk(x));
    auto to_a = x.select(1, 0) > 0;
    auto ia = to_a.nonzero().select(1, 0), ib = to_a.logical_not().nonzero().select(1, 0);
    auto out = torch::zeros({x.size(0), 5}, h.options());
    if (ia.numel() > 0) out = out.index_copy(0, ia, a(h.index_select(0, ia)));
    if (ib.numel() > 0) out = out.index_copy(0, ib, b(h.index_select(0, ib)));
    return out;
  }
};
TORCH_MODULE(Router);

// Whether row `row` of the global batch (rank row / 8, local row row % 8) goes to head a at `step`.
//   "ab":    rank 0's samples all go to a, rank 1's all to b (same shapes, different parameters per rank).
//   "mixed": by step % 4: rank 0 -> a, rank 1 -> b; rank 0 both, rank 1 only b (a unused on rank 1 only); rank 0
//            only a, rank 1 both (b unused on rank 0 only); everything to a (b unused on every rank).
//   "accumulate": micro-batch 0 (local rows 0-3, under no_sync) sends rank (step % 2)'s samples to a, the
//            other's to b; micro-batch 1 (the synchronized one) sends all to b: a is reached by one rank and only
//            inside no_sync().
bool routes_to_a(const std::string& routing, int step, int64_t row) {
  const int64_t rank = row / 8, local = row % 8;
  if (routing == "ab") return rank == 0;
  if (routing == "accumulate") return local < 4 && rank == step % 2;
  switch (step % 4) {
    case 0: return rank == 0;
    case 1: return rank == 0 && local % 2 == 0;
    case 2: return rank == 0 || local % 2 == 0;
    default: return true;
  }
}

Batch routed_batch(const std::string& routing, int step) {
  Batch b = global_batch(step, kGlobal);
  auto sign = torch::empty({kGlobal});
  for (int64_t row = 0; row < kGlobal; ++row) sign[row] = routes_to_a(routing, step, row) ? 1.0 : -1.0;
  auto first = b.x.select(1, 0);
  first.copy_(first.abs().clamp_min(0.1) * sign);
  return b;
}

// SGD momentum buffers in parameter order, zeros where a parameter has none (yet): same length on every rank.
std::vector<torch::Tensor> momentum_or_zeros(torch::optim::SGD& sgd) {
  std::vector<torch::Tensor> out;
  auto& state = sgd.state();
  for (auto& group : sgd.param_groups()) {
    for (auto& p : group.params()) {
      auto it = state.find(state_key(state, p));
      out.push_back(it != state.end() ? static_cast<torch::optim::SGDParamState&>(*it->second).momentum_buffer().clone()
                                      : torch::zeros_like(p));
    }
  }
  return out;
}

struct RouterSetup {
  std::string label;
  amp::Options options{"O2"};
  amp::parallel::DistributedDataParallelOptions ddp = amp::parallel::DistributedDataParallelOptions().delay_allreduce(true);
  std::string routing = "mixed";
  int steps = 8;
};

struct RouterRun {
  std::vector<torch::Tensor> masters;
  std::vector<torch::Tensor> c_weights;  // the model's head c after training
  double a_bias = 0;                     // master of a.bias[0] after training
  double scale = 0;
  int64_t skipped = 0;
  bool b_grad_when_unused = false;       // b had a gradient after a backward where no rank reached it
  bool c_grad_ever = false;              // c had a gradient after some backward
  bool equal_every_step = true;
  amp::parallel::CommunicationStats stats;
};

constexpr int64_t kRouterInfRow = 13;  // rank 1's local row 5, routed to b in the "mixed" pattern's step 0

RouterRun train_router(const RouterSetup& setup, const ProcessGroup* group) {
  const int rank = group ? group->rank() : 0;
  torch::manual_seed(group ? 200 + rank : 200);  // rank 1 starts from other weights: make_distributed broadcasts rank 0's
  Router net;
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  auto [model, optimizer] = amp::initialize(net, std::move(sgd), setup.options);
  std::optional<amp::parallel::DistributedDataParallel<Router>> ddp;
  if (group) ddp.emplace(amp::parallel::make_distributed(model, *group, setup.ddp));
  auto forward = [&](const torch::Tensor& x) { return ddp ? (*ddp)(x) : model(x); };
  const bool dynamic = setup.options.resolve().loss_scale.is_dynamic();
  RouterRun run;
  auto watch = [&](int step) {
    if (setup.routing == "mixed" && step % 4 == 3 && net->b->weight.grad().defined()) run.b_grad_when_unused = true;
    if (net->c->weight.grad().defined() || net->c->bias.grad().defined()) run.c_grad_ever = true;
  };
  for (int step = 0; step < setup.steps; ++step) {
    const Batch global = routed_batch(setup.routing, step);
    optimizer.zero_grad();
    if (setup.routing == "accumulate") {
      for (int micro = 0; micro < 2; ++micro) {
        Batch mine;
        if (group) {
          mine = rows(global, rank * 8 + micro * 4, 4);
        } else {
          auto r0 = rows(global, micro * 4, 4), r1 = rows(global, 8 + micro * 4, 4);
          mine = {torch::cat({r0.x, r1.x}), torch::cat({r0.y, r1.y})};
        }
        if (micro == 0 && ddp) {
          auto no_sync = ddp->no_sync();
          auto scaled = amp::scale_loss(loss_of(forward(mine.x), mine.y), optimizer, amp::ScaleLossOptions().delay_unscale(true));
          scaled.backward();
        } else {
          auto scaled = amp::scale_loss(loss_of(forward(mine.x), mine.y), optimizer,
                                        amp::ScaleLossOptions().delay_unscale(micro == 0));
          scaled.backward();
          watch(step);
        }
      }
    } else {
      // An inf in one sample of rank 1's batch at step 4 (dynamic loss scales): routed to b, which rank 0 didn't reach.
      const int64_t inf_global = setup.routing == "mixed" && step == 4 && dynamic ? kRouterInfRow : -1;
      const Batch mine = group ? rows(global, rank * 8, 8) : global;
      const int64_t inf_local = inf_global - rank * 8;
      const int64_t inf_at = group ? (inf_global >= 0 && inf_local >= 0 && inf_local < 8 ? inf_local : -1) : inf_global;
      auto scaled = amp::scale_loss(loss_of(forward(mine.x), mine.y, inf_at), optimizer);
      scaled.backward();
      watch(step);
    }
    optimizer.step();
    if (group) {
      std::vector<torch::Tensor> state = clones(model->parameters());
      for (auto& t : amp::master_params(optimizer)) state.push_back(t.detach());
      for (auto& t : momentum_or_zeros(optimizer)) state.push_back(t);
      state.push_back(torch::tensor({amp::loss_scale(optimizer), static_cast<double>(optimizer.skipped_steps())},
                                    torch::kDouble));
      run.equal_every_step = same_on_all_ranks(*group, state) && run.equal_every_step;
    }
  }
  run.masters = clones(amp::master_params(optimizer));
  run.a_bias = run.masters[3][0].item<double>();  // trunk.weight, trunk.bias, a.weight, a.bias, ...
  run.c_weights = clones(net->c->parameters());
  run.scale = amp::loss_scale(optimizer);
  run.skipped = optimizer.skipped_steps();
  if (ddp) run.stats = ddp->communication_stats();
  return run;
}

void compare_router(const RouterSetup& setup, const ProcessGroup& group, double tolerance, int64_t expected_calls = -1) {
  const RouterRun ddp = train_router(setup, &group);
  const RouterRun single = train_router(setup, nullptr);
  const double d = max_abs_diff(ddp.masters, single.masters);
  report(ddp.equal_every_step, setup.label + ": parameters, masters, momentum and loss scale bit-identical on all "
                               "ranks after every step");
  report(d <= tolerance, setup.label + ": weights match 1 process x full batch",
         "max |2 ranks - 1 process| = " + str(d) + " (tolerance " + str(tolerance) + "); a.bias[0]: " +
             str(ddp.a_bias) + " on rank " + std::to_string(group.rank()) + ", " + str(single.a_bias) + " in 1 process");
  report(ddp.scale == single.scale && ddp.skipped == single.skipped,
         setup.label + ": loss scale and skipped steps equal 1 process x full batch",
         "2 ranks: scale " + str(ddp.scale) + ", skipped " + std::to_string(ddp.skipped) + "; 1 process: scale " +
             str(single.scale) + ", skipped " + std::to_string(single.skipped));
  if (setup.routing == "mixed" && setup.options.resolve().loss_scale.is_dynamic()) {
    report(ddp.skipped == 1, setup.label + ": an inf routed to a head only rank 1 reached skipped the step on every rank");
  }
  if (setup.routing == "mixed") {
    report(!ddp.b_grad_when_unused && !single.b_grad_when_unused,
           setup.label + ": a head no rank reached in a backward keeps no gradient (torch's find_unused_parameters)");
  }
  torch::manual_seed(200);
  Router initial;
  std::vector<torch::Tensor> c0 = {initial->c->weight.to(ddp.c_weights[0].scalar_type()),
                                   initial->c->bias.to(ddp.c_weights[1].scalar_type())};
  report(!ddp.c_grad_ever && max_abs_diff(ddp.c_weights, c0) == 0,
         setup.label + ": a head no rank ever reaches keeps no gradient and rank 0's initial weights");
  report(ddp.stats.synced_backwards == setup.steps && ddp.stats.allreduce_calls >= setup.steps,
         setup.label + ": every synchronized backward reduced",
         std::to_string(ddp.stats.allreduce_calls) + " all-reduces over " + std::to_string(ddp.stats.synced_backwards) +
             " backward passes");
  if (expected_calls >= 0) {
    report(ddp.stats.allreduce_calls == expected_calls, setup.label + ": the same buckets on every rank; a bucket no "
           "rank reached is skipped everywhere", std::to_string(ddp.stats.allreduce_calls) + " all-reduces, expected " +
           std::to_string(expected_calls));
  }
}

void scenario_unused(const ProcessGroup& group) {
  const auto bf16 = amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0);
  const auto o0 = amp::Options("O0").verbosity(0);
  // Tolerances as in scenario_train: O0 summation order only, O2 bf16 a few bf16 ulps of each rank's gradient.
  RouterSetup ab;
  ab.label = "delay_allreduce O0, rank 0 routes to a, rank 1 to b";
  ab.options = o0;
  ab.routing = "ab";
  ab.steps = 3;
  compare_router(ab, group, 1e-5);
  RouterSetup ab2 = ab;
  ab2.label = "delay_allreduce O2 bf16, rank 0 routes to a, rank 1 to b";
  ab2.options = bf16;
  compare_router(ab2, group, 2e-2);
  RouterSetup acc;
  acc.label = "delay_allreduce O0 no_sync accumulation, a reached on one rank inside no_sync only";
  acc.options = o0;
  acc.routing = "accumulate";
  acc.steps = 4;
  compare_router(acc, group, 1e-5);
  RouterSetup acc2 = acc;
  acc2.label = "delay_allreduce O2 bf16 no_sync accumulation, a reached on one rank inside no_sync only";
  acc2.options = bf16;
  compare_router(acc2, group, 2e-2);
  RouterSetup mixed;
  mixed.label = "delay_allreduce O0, heads unused on one rank or on all";
  mixed.options = o0;
  compare_router(mixed, group, 1e-5);
  RouterSetup mixed2 = mixed;
  mixed2.label = "delay_allreduce O2 bf16, heads unused on one rank or on all";
  mixed2.options = bf16;
  compare_router(mixed2, group, 2e-2);
  // bucket_cap_mb 0.0001 (104 bytes): buckets trunk.weight | the four biases | a.weight | b.weight | c.weight, so
  // 4 all-reduces per step, 3 where no rank reaches b (step % 4 == 3), none ever for c.weight: 2 * (4+4+4+3) = 30.
  // (In fp32, O0, c.bias no longer fits with the other biases: its own bucket, never reduced either.)
  RouterSetup knobs = mixed2;
  knobs.label = "delay_allreduce O2 bf16 allreduce_always_fp32 + gradient_predivide_factor 3 + bucket_cap_mb 0.0001, "
                "heads unused on one rank or on all";
  knobs.ddp.allreduce_always_fp32(true).gradient_predivide_factor(3.0).bucket_cap_mb(0.0001);
  compare_router(knobs, group, 2e-2, 30);
  RouterSetup knobs0 = mixed;
  knobs0.label = "delay_allreduce O0 gradient_predivide_factor 3 + bucket_cap_mb 0.0001, heads unused on one rank or on all";
  knobs0.ddp.gradient_predivide_factor(3.0).bucket_cap_mb(0.0001);
  compare_router(knobs0, group, 1e-5, 30);
#if TORCH_VERSION_MAJOR >= 2
  RouterSetup fp16 = mixed;
  fp16.label = "delay_allreduce O2 fp16, heads unused on one rank or on all";
  fp16.options = amp::Options("O2").low_precision_dtype(torch::kHalf).verbosity(0);
  compare_router(fp16, group, 5e-3);
#endif
}

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
        optimizer.zero_grad();
        {
          auto scaled = amp::scale_loss(loss_of(ddp(local.x), local.y), optimizer);
          scaled.backward();
        }
        optimizer.step();
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
      optimizer.zero_grad();
      {
        auto scaled = amp::scale_loss(loss_of(ddp(local.x), local.y), optimizer);
        scaled.backward();
      }
      optimizer.step();
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
      optimizer.zero_grad();
      {
        auto scaled = amp::scale_loss(loss_of(ddp(local.x), local.y), optimizer);
        scaled.backward();
      }
      optimizer.step();
    }
    report(net[3]->as<torch::nn::LinearImpl>()->weight.scalar_type() == torch::kFloat, "the kept head stays fp32");
    double sum = 0;
    for (const auto& p : net->parameters()) sum += p.detach().to(torch::kFloat).sum().item<double>();
    std::cout << "[rank " << group.rank() << "] policy params O2 bf16: " << std::hexfloat << sum << std::defaultfloat << std::endl;
  }
}

// FP8 with delayed scaling under amp::parallel: each rank sees other rows, but every rank commits the max over the
// ranks of each step's amaxes, so scales, histories and weights stay bit-identical; fc1's input history holds the
// global batch's amax.
void scenario_fp8(const ProcessGroup& group) {
  if (!amp::detail::fp8_supported_by_build()) {
    report(true, "fp8: skipped, this LibTorch build has no FP8");
    return;
  }
  torch::manual_seed(3);
  auto net = torch::nn::Sequential(torch::nn::Linear(16, 32), torch::nn::ReLU(), torch::nn::Linear(32, 32),
                                   torch::nn::ReLU(), torch::nn::Linear(32, 5));
  auto [model, optimizer] = amp::initialize(
      net, torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9)),
      amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0)
          .fp8(amp::Fp8Options().scaling(amp::Fp8Options::Scaling::kDelayed).amax_history_len(4)));
  auto ddp = amp::parallel::make_distributed(model, group);
  const auto fp8 = amp::detail::precision_policy_of(*net)->fp8();
  for (int step = 0; step < 4; ++step) {
    torch::manual_seed(7000 + step);
    torch::Tensor x = torch::randn({16, 16});
    x.narrow(0, 8, 8).mul_(3.0);  // rank 1's rows are wider
    const torch::Tensor y = torch::randint(5, {16}, torch::kLong);
    const int64_t start = group.rank() * 8;
    optimizer.zero_grad();
    {
      auto scaled = amp::scale_loss(loss_of(ddp(x.narrow(0, start, 8)), y.narrow(0, start, 8)), optimizer);
      scaled.backward();
    }
    optimizer.step();
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
}

// TorchScript models under amp::parallel: a scripted MLP (defined in C++ with torch::jit::Module::define, so no
// Python is needed) trains on 2 x 8 samples per step at O2 bf16; rank 1 starts from other weights, which the wrap
// replaces with rank 0's. The replicas end bit-identical, and within O2 bf16's tolerance (scenario_train) of the
// same module trained on all 16 samples in one process.
torch::jit::Module scripted_mlp(uint64_t seed) {
  auto eager = make_mlp(seed);
  torch::jit::Module m("ScriptedMlp");
  const char* names[] = {"w1", "b1", "w2", "b2", "w3", "b3"};
  size_t i = 0;
  for (const auto& p : eager->parameters()) m.register_parameter(names[i++], p.detach().clone().requires_grad_(true), false);
  m.define(R"JIT(
def forward(self, x):
    h = torch.relu(torch.linear(x, self.w1, self.b1))
    h = torch.relu(torch.linear(h, self.w2, self.b2))
    return torch.linear(h, self.w3, self.b3)
)JIT");
  return m;
}

void scenario_torchscript(const ProcessGroup& group) {
  const auto options = amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0);
  auto train = [&](bool distributed) {
    auto module = scripted_mlp(distributed && group.rank() == 1 ? 8 : 7);
    torch::optim::SGD sgd(amp::parameters(module), torch::optim::SGDOptions(0.1).momentum(0.9));
    auto [model, optimizer] = amp::initialize(module, std::move(sgd), options);
    std::optional<amp::parallel::DistributedDataParallel<torch::jit::Module>> ddp;
    if (distributed) ddp.emplace(amp::parallel::make_distributed(model, group));
    for (int step = 0; step < 4; ++step) {
      const Batch batch = distributed ? rows(global_batch(step, 16), group.rank() * 8, 8) : global_batch(step, 16);
      optimizer.zero_grad();
      const auto logits = (ddp ? (*ddp)(batch.x) : model(batch.x)).toTensor();
      {
        auto scaled = amp::scale_loss(loss_of(logits, batch.y), optimizer);
        scaled.backward();
      }
      optimizer.step();
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
    error = message_of(e);
  }
  report(error.find("the models differ across ranks: parameter '2.weight' is [4, 16] (BFloat16) on rank 0 but [5, 16] "
                    "(BFloat16) on rank 1") != std::string::npos,
         "make_distributed refuses different models on every rank, naming the parameter", error.substr(0, 200));
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
    error = message_of(e);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  report(error.find("amp::parallel") != std::string::npos && error.find("another rank failed") != std::string::npos &&
             seconds < std::chrono::duration<double>(group.timeout()).count() + 5,
         "a rank that died: the other's backward fails with amp's error within the timeout",
         "after " + str(seconds) + " s: " + error.substr(0, 240));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: amp_parallel_worker train|quick|syncbn|unused|mismatch|dies" << std::endl;
    return 2;
  }
  const std::string scenario = argv[1];
  torch::set_num_threads(1);
  try {
    const auto timeout = std::chrono::seconds(std::getenv("AMP_TEST_TIMEOUT_S") ? std::atoi(std::getenv("AMP_TEST_TIMEOUT_S")) : 60);
    const ProcessGroup group = amp::parallel::init_process_group(amp::parallel::InitOptions().timeout(timeout));
    g_rank = group.rank();
    report(group.world_size() == 2, "joined the group", "rank " + std::to_string(group.rank()) + " of " +
                                                            std::to_string(group.world_size()) + ", backend " + group.backend());
    if (scenario == "train" || scenario == "quick") {
      scenario_train(group, scenario == "quick");
    } else if (scenario == "syncbn") {
      scenario_syncbn(group);
    } else if (scenario == "unused") {
      scenario_unused(group);
    } else if (scenario == "checkpoint") {
      scenario_checkpoint(group);
    } else if (scenario == "lean") {
      scenario_lean(group);
    } else if (scenario == "fp8") {
      scenario_fp8(group);
    } else if (scenario == "policy") {
      scenario_policy(group);
    } else if (scenario == "clip") {
      scenario_clip(group);
    } else if (scenario == "torchscript") {
      scenario_torchscript(group);
    } else if (scenario == "mismatch") {
      scenario_mismatch(group);
    } else if (scenario == "dies") {
      scenario_dies(group);
      return g_failures == 0 ? 0 : 1;  // no barrier: the other rank is gone
    } else {
      std::cerr << "unknown scenario " << scenario << std::endl;
      return 2;
    }
    group.barrier();
  } catch (const std::exception& e) {
    std::cout << "[rank " << g_rank << "] FAIL uncaught exception: " << message_of(e) << std::endl;
    return 1;
  }
  std::cout << "[rank " << g_rank << "] " << (g_failures == 0 ? "ALL OK" : std::to_string(g_failures) + " FAILED") << std::endl;
  return g_failures == 0 ? 0 : 1;
}
