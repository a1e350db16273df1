// ZeRO (amp::parallel::shard_optimizer) on 2 or 4 ranks: a sharded replica and an unsharded one train side by side
// on the same batches, and every step compares them (bitwise on 2 ranks; the 4-rank reduce-scatter sums in another
// order than the all-reduce, so there within a few ulps), plus the loss scale, skipped steps, clipping, state_bytes,
// the per-rank and consolidated archives, and misuse.

#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>
#include <torch/script.h>
#include <torch/serialize.h>
#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iomanip>
#include <functional>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "amp/amp.h"
#include "casting/fp8.h"
#include "scaling/device_scale.h"
#include "optim/fp32_values.h"
#include "optim/fused_route.h"
#include "optim/lean_masters.h"
#include "optim/optimizer_state_key.h"
#include "optim/optimizer_kinds.h"
#include "options/exception_message.h"
#include "scenarios.h"
#include "worker_support.h"

namespace amp_worker {
namespace {

using Factory = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::optim::OptimizerParamGroup>)>;

// Two param groups (weights; biases at `bias_lr`) in model order, as real scripts build them.
template <class Options>
std::vector<torch::optim::OptimizerParamGroup> groups_of(torch::nn::Sequential& net, const Options& defaults, float bias_lr) {
  std::vector<torch::Tensor> weights, biases;
  for (const auto& item : net->named_parameters()) {
    (item.key().find("bias") != std::string::npos ? biases : weights).push_back(item.value());
  }
  auto o = defaults;
  o.lr(bias_lr);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(weights);
  groups.emplace_back(biases, std::make_unique<Options>(o));
  return groups;
}

struct Config {
  std::string label;
  amp::Options options;
  int optimizer;  // 0 FusedAdamW, 1 FusedSGD momentum, 2 LibTorch's Adam, 3 FusedAdam, 4 FusedLAMB
  bool freeze_first_bias = false;
};

template <class Opt, class Options>
auto build(torch::nn::Sequential& net, Options defaults, float bias_lr) {
  return Opt(groups_of(net, defaults, bias_lr), defaults);
}

// Runs `body` with the config's optimizer type.
template <class Body>
void with_optimizer(int kind, torch::nn::Sequential& net, Body body) {
  switch (kind) {
    case 0:
      return body(build<amp::optim::FusedAdamW>(net, torch::optim::AdamWOptions(1e-2).weight_decay(0.01), 5e-3f));
    case 1:
      return body(build<amp::optim::FusedSGD>(net, torch::optim::SGDOptions(0.05).momentum(0.9), 0.02f));
    case 2:
      return body(build<torch::optim::Adam>(net, torch::optim::AdamOptions(1e-2), 5e-3f));
    case 4:
      return body(build<amp::optim::FusedLAMB>(net, amp::optim::FusedLAMBOptions(1e-2).max_grad_norm(0.5), 5e-3f));
    default:
      return body(build<amp::optim::FusedAdam>(net, torch::optim::AdamOptions(1e-2).amsgrad(true), 5e-3f));
  }
}

// The config's optimizer for `net` as the type `Opt` with_optimizer gives for `kind`: a second optimizer of a body's
// type without nesting with_optimizer once more (each level multiplies the body's instantiations by five).
template <class Opt>
Opt optimizer_like(int kind, torch::nn::Sequential& net) {
  std::optional<Opt> out;
  with_optimizer(kind, net, [&](auto o) {
    if constexpr (std::is_same_v<decltype(o), Opt>) out.emplace(std::move(o));
  });
  TORCH_INTERNAL_ASSERT(out, "optimizer_like: kind ", kind, " is another type");
  return std::move(*out);
}

std::vector<torch::Tensor> params_of(torch::nn::Sequential& net) { return clones(net->parameters()); }

// The parameters of ddp's model, whole: collective at stage 3 (GatheredParametersGuard), whole anyway at 0-2.
template <class Ddp>
std::vector<torch::Tensor> whole_params(Ddp& ddp, torch::nn::Sequential& net) {
  amp::parallel::GatheredParametersGuard whole(ddp);
  return params_of(net);
}

// Largest difference in units of the tensors' own magnitude (relative to max |b| per tensor).
double relative_diff(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double scale = std::max(1e-12, b[i].abs().max().item<double>());
    worst = std::max(worst, (a[i].to(torch::kDouble) - b[i].to(torch::kDouble)).abs().max().item<double>() / scale);
  }
  return worst;
}

// How the ranks' gradients are summed. On 2 ranks (a + b in either order) the default low-precision sums are the same
// whatever the collective. With more, Gloo's all-reduce and its reduce-scatter add a bf16 gradient's terms in other
// orders (a third of the sums of 4 ranks differ, some by many ulps where terms cancel), which Adam's normalized update
// carries up to a learning rate's step into a weight (5% of the largest weight of this net after 6 steps with bf16 sums:
// that is reordering, not sharding). Summed in fp32 (allreduce_always_fp32) every order rounds to the same bf16
// gradient, so there the sharded run must equal the unsharded one bit for bit on 4 ranks too.
amp::parallel::DistributedDataParallelOptions wire_for(int world_size) {
  return amp::parallel::DistributedDataParallelOptions().allreduce_always_fp32(world_size > 2);
}

void train_side_by_side(const ProcessGroup& group, const Config& config, int stage) {
  const int n = group.world_size();
  const int64_t local_rows = kGlobal / n;
  const std::string label = config.label + " stage " + std::to_string(stage);
  auto ref_net = make_mlp(11);
  auto net = make_mlp(11);
  auto reordered_net = make_mlp(11);
  if (config.freeze_first_bias) {
    for (auto* m : {&ref_net, &net, &reordered_net}) (*m)[0]->named_parameters()["bias"].set_requires_grad(false);
  }
  with_optimizer(config.optimizer, ref_net, [&](auto ref_opt) {
   with_optimizer(config.optimizer, reordered_net, [&](auto reordered_opt) {
    with_optimizer(config.optimizer, net, [&](auto opt) {
      auto [ref_model, ref_optimizer] = amp::initialize(ref_net, std::move(ref_opt), config.options);
      auto [model, optimizer] = amp::initialize(net, std::move(opt), config.options);
      // The unsharded run again with another reduction order (one all-reduce per tensor instead of one for all):
      // how far reordering fp32 sums alone moves it (the bound of more than 2 ranks below).
      auto [reordered_model, reordered_optimizer] = amp::initialize(reordered_net, std::move(reordered_opt), config.options);
      auto ref_ddp = amp::parallel::make_distributed(ref_model, group, wire_for(n));
      auto reordered_ddp =
          amp::parallel::make_distributed(reordered_model, group, wire_for(n).bucket_cap_mb(0.0005).delay_allreduce(true));
      auto ddp = amp::parallel::make_distributed(model, group, wire_for(n));
      amp::parallel::shard_optimizer(ddp, optimizer, amp::parallel::ZeroOptions().stage(stage).bucket_cap_mb(0.001));
      auto whole_params = [&] {  // stage 3: collective, the parameters live in the shards; else nothing to do
        amp::parallel::GatheredParametersGuard whole(ddp);
        return params_of(net);
      };
      bool same = true, same_scale = true, same_skips = true, norms_close = true;
      double worst = 0, spread = 0;
      amp::StateBytes sharded{}, unsharded{};
      for (int step = 0; step < 6; ++step) {
        const Batch batch = global_batch(step, kGlobal);
        const Batch local = rows(batch, group.rank() * local_rows, local_rows);
        // Step 3: an inf on rank 1's batch only; every rank skips (dynamic loss scale).
        const bool dynamic = config.label.rfind("O1", 0) == 0 || config.label.rfind("O2", 0) == 0;
        const int64_t inf_at = step == 3 && group.rank() == 1 && dynamic ? 2 : -1;
        float norms[2];
        int k = 0;
        {
          ref_optimizer.zero_grad();
          {
            auto scaled = amp::scale_loss(loss_of(ref_ddp(local.x), local.y, inf_at), ref_optimizer);
            scaled.backward();
          }
          norms[k++] = amp::clip_grad_norm_(ref_optimizer, 5.0).template item<float>();
          ref_optimizer.step();
        }
        {
          reordered_optimizer.zero_grad();
          {
            auto scaled = amp::scale_loss(loss_of(reordered_ddp(local.x), local.y, inf_at), reordered_optimizer);
            scaled.backward();
          }
          (void)amp::clip_grad_norm_(reordered_optimizer, 5.0);
          reordered_optimizer.step();
        }
        {
          optimizer.zero_grad();
          {
            auto scaled = amp::scale_loss(loss_of(ddp(local.x), local.y, inf_at), optimizer);
            scaled.backward();
          }
          if (!optimizer.step_will_be_skipped()) {  // an overflow drops the gradients
            sharded = amp::state_bytes(optimizer);
            unsharded = amp::state_bytes(ref_optimizer);
          }
          norms[k++] = amp::clip_grad_norm_(optimizer, 5.0).template item<float>();
          optimizer.step();
        }
        const auto a = whole_params(), b = params_of(ref_net);
        same = same && equal_bits(a, b);
        worst = std::max(worst, relative_diff(a, b));
        spread = std::max(spread, relative_diff(params_of(reordered_net), b));
        same_scale = same_scale && optimizer.loss_scaler().loss_scale() == ref_optimizer.loss_scaler().loss_scale();
        same_skips = same_skips && optimizer.skipped_steps() == ref_optimizer.skipped_steps();
        const bool finite = std::isfinite(norms[1]);
        // More than 2 ranks at stage 2, and O3 (below): the gradients themselves differ in the last bits.
        const double norm_bound = (n > 2 && stage >= 2) || config.label.rfind("O3", 0) == 0 ? 1e-2 : 1e-6;
        norms_close = norms_close && (finite ? std::abs(norms[0] - norms[1]) <= norm_bound * std::abs(norms[1]) + 1e-30
                                             : !std::isfinite(norms[0]));
      }
      // O3 steps bf16 parameters with per-op arithmetic (Python's: src/optim/python_steps.cpp), and ATen's
      // p.add_(buf, alpha) fuses the multiply-add in its vector body but not in its scalar tail: where a slice ends
      // decides which elements round which way, by a bf16 ulp, which relative to a tensor's largest value (what
      // relative_diff measures) is at most 2^-7.
      const bool o3 = config.label.rfind("O3", 0) == 0;
      // FusedLAMB's norms are sums over the ranks' pieces in double (NOTE [Sharded LAMB]): equal to 1e-6, not bitwise.
      const bool lamb = config.optimizer == 4;
      // Low-precision gradients (O2, O3) are order-free on 2 ranks and in fp32 sums (wire_for): bit for bit, LAMB
      // included (its double sums round to the same floats). fp32 gradients (O0, O1) reorder on more than 2 ranks:
      // bounded by what reordering alone does to the unsharded run (twice it: the sharded run is one more order), with
      // fp32's rounding of six updates as the floor where the reordered run happens to agree.
      const bool fp32_grads = config.label.rfind("O0", 0) == 0 || config.label.rfind("O1", 0) == 0;
      if (!o3 && (n == 2 || !fp32_grads)) {
        report(same, label + ": the sharded replica equals the unsharded one bit for bit after every step");
      }
      const double bound = o3 ? 1.0 / 128 : n == 2 || !fp32_grads ? 0.0 : std::max(2.0 * spread, 1e-6);
      report(worst <= bound, label + ": parameters against the unsharded run",
             "worst relative " + str(worst) + ", the unsharded run reordered " + str(spread));
      report(same_scale && same_skips, label + ": the same loss scale and skipped steps",
             "skipped " + std::to_string(optimizer.skipped_steps()) + " vs " + std::to_string(ref_optimizer.skipped_steps()));
      report(norms_close, label + ": clip_grad_norm_ gives the unsharded global norm (1e-6 relative on 2 ranks)");
      report(same_on_all_ranks(group, whole_params()), label + ": every rank's replica is identical");
      report(sharded.optimizer_state < unsharded.optimizer_state, label + ": optimizer state is divided",
             std::to_string(sharded.optimizer_state) + " vs " + std::to_string(unsharded.optimizer_state) + " bytes");
      if (stage == 3) {
        report(sharded.params < unsharded.params, label + ": parameters are divided",
               std::to_string(sharded.params) + " vs " + std::to_string(unsharded.params) + " bytes");
      }
      if (stage >= 2) {
        report(sharded.grads + sharded.master_grads < unsharded.grads + unsharded.master_grads,
               label + ": gradients are divided",
               std::to_string(sharded.grads + sharded.master_grads) + " vs " +
                   std::to_string(unsharded.grads + unsharded.master_grads) + " bytes");
      }
    });
   });
  });
}

// The archive tests' optimizer: FusedAdamW over two param groups.
amp::optim::FusedAdamW adamw_of(torch::nn::Sequential& net) {
  return build<amp::optim::FusedAdamW>(net, torch::optim::AdamWOptions(1e-2).weight_decay(0.01), 5e-3f);
}

// Steps [from, to) of the worker's batches, each rank its rows.
template <class Ddp, class Optimizer>
void train_steps(const ProcessGroup& group, Ddp& ddp, Optimizer& optimizer, int from, int to) {
  const int64_t local_rows = kGlobal / group.world_size();
  for (int step = from; step < to; ++step) {
    const Batch local = rows(global_batch(step, kGlobal), group.rank() * local_rows, local_rows);
    optimizer.zero_grad();
    {
      auto scaled = amp::scale_loss(loss_of(ddp(local.x), local.y), optimizer);
      scaled.backward();
    }
    optimizer.step();
  }
}

// The per-rank archive resumes bitwise; the consolidated one is what the unsharded run's torch::save writes and loads
// into a sharded optimizer too.
void checkpoints(const ProcessGroup& group, int stage, const std::string& dir) {
  const int n = group.world_size();
  const std::string label = "checkpoint stage " + std::to_string(stage);
  const amp::Options options = amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0);
  auto make = [](torch::nn::Sequential& net) { return adamw_of(net); };
  auto train = [&](auto& ddp, auto& optimizer, int from, int to) { train_steps(group, ddp, optimizer, from, to); };
  auto ref_net = make_mlp(5);
  auto [ref_model, ref_optimizer] = amp::initialize(ref_net, make(ref_net), options);
  auto ref_ddp = amp::parallel::make_distributed(ref_model, group);
  auto net = make_mlp(5);
  auto [model, optimizer] = amp::initialize(net, make(net), options);
  auto ddp = amp::parallel::make_distributed(model, group);
  amp::parallel::shard_optimizer(ddp, optimizer, amp::parallel::ZeroOptions().stage(stage));
  train(ref_ddp, ref_optimizer, 0, 3);
  train(ddp, optimizer, 0, 3);
  const std::string shard_path = dir + "/zero_s" + std::to_string(stage) + "_w" + std::to_string(n) + "_r" +
                                 std::to_string(group.rank()) + ".pt";
  const std::string consolidated = dir + "/zero_s" + std::to_string(stage) + "_w" + std::to_string(n) + "_full.pt";
  const std::string unsharded = dir + "/zero_s" + std::to_string(stage) + "_w" + std::to_string(n) + "_plain.pt";
  torch::save(optimizer, shard_path);
  amp::parallel::save_consolidated(optimizer, consolidated);
  if (group.rank() == 0) torch::save(ref_optimizer, unsharded);
  group.barrier();
  {
    amp::parallel::GatheredParametersGuard whole(ddp);  // stage 3: the model is whole only under the guard
    torch::save(net, shard_path + ".model");
  }
  if (n == 2) {  // another rank's shard, and a shard into an unsharded optimizer: refused, named
    const std::string other = dir + "/zero_s" + std::to_string(stage) + "_w2_r" + std::to_string(1 - group.rank()) + ".pt";
    auto net6 = make_mlp(5);
    auto [model6, optimizer6] = amp::initialize(net6, make(net6), options);
    auto ddp6 = amp::parallel::make_distributed(model6, group);
    amp::parallel::shard_optimizer(ddp6, optimizer6, amp::parallel::ZeroOptions().stage(stage));
    std::string message = message_of([&] { torch::load(optimizer6, other); });
    report(message.find("is rank " + std::to_string(1 - group.rank()) + "'s shard, this is rank " +
                        std::to_string(group.rank())) != std::string::npos,
           label + ": another rank's shard is refused, naming both ranks", message.substr(0, 200));
    auto net7 = make_mlp(5);
    auto [model7, optimizer7] = amp::initialize(net7, make(net7), options);
    message = message_of([&] { torch::load(optimizer7, shard_path); });
    report(message.find("holds rank " + std::to_string(group.rank()) + "'s shard of a ZeRO world of 2 ranks") !=
                   std::string::npos &&
               message.find("this optimizer is not sharded") != std::string::npos,
           label + ": a shard into an unsharded optimizer is refused, naming its rank and world size", message.substr(0, 200));
    // A shard of other param groups (one group instead of two): refused, naming both layouts.
    auto net8 = make_mlp(5);
    auto [model8, optimizer8] = amp::initialize(
        net8, amp::optim::FusedAdamW(net8->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.01)), options);
    auto ddp8 = amp::parallel::make_distributed(model8, group);
    amp::parallel::shard_optimizer(ddp8, optimizer8, amp::parallel::ZeroOptions().stage(stage));
    message = message_of([&] { torch::load(optimizer8, shard_path); });
    report(message.find("the checkpoint's param groups hold (tensors, elements) [3, ") != std::string::npos &&
               message.find("this optimizer's [6, ") != std::string::npos &&
               message.find("Resume with the same model and param groups") != std::string::npos,
           label + ": a shard of other param groups is refused, naming both layouts", message.substr(0, 240));
  }

  // Resume from this rank's shard in a fresh sharded optimizer: bitwise the run that did not stop, whichever is loaded
  // first. Loaded after the optimizer (after make_distributed the weights are written in place: amp::load_weights, or
  // copy_), the model's bf16 weights are its restored masters rounded, so the masters keep their low bits (NOTE
  // [Masters follow the model]).
  train(ddp, optimizer, 3, 6);
  const std::vector<torch::Tensor> uninterrupted = whole_params(ddp, net);
  for (const int how : {0, 1, 2}) {
    const bool model_first = how == 0;
    const std::string order = model_first ? "model first" : how == 1 ? "optimizer first" : "optimizer first, copy_";
    auto net2 = make_mlp(99);
    auto [model2, optimizer2] = amp::initialize(net2, make(net2), options);
    if (model_first) torch::load(net2, shard_path + ".model");  // Apex's order: initialize, then load
    auto ddp2 = amp::parallel::make_distributed(model2, group);
    amp::parallel::shard_optimizer(ddp2, optimizer2, amp::parallel::ZeroOptions().stage(stage));
    torch::load(optimizer2, shard_path);
    if (!model_first) {
      amp::parallel::GatheredParametersGuard whole(ddp2);  // stage 3: written whole, the pieces follow
      if (how == 1) {
        amp::load_weights(*net2, shard_path + ".model");
      } else {  // in place, as a script's own loader would: the pieces see it at the next step (Zero::refresh)
        auto loaded = make_mlp(1);
        amp::initialize(loaded, options);  // bf16, as the file's weights
        torch::load(loaded, shard_path + ".model");
        torch::NoGradGuard no_grad;
        for (size_t i = 0; i < net2->parameters().size(); ++i) net2->parameters()[i].copy_(loaded->parameters()[i]);
      }
    }
    train(ddp2, optimizer2, 3, 6);
    // More than 2 ranks: a fresh DistributedDataParallel buckets the gradients as the model orders them, the running
    // one as backward produced them (c10d's rebuilt buckets), and Gloo sums each bucket's elements in an order that
    // depends on its size: stage 1's all-reduce differs in the last bit there. Stage 2's lanes are fixed.
    const double d = relative_diff(whole_params(ddp2, net2), uninterrupted);
    report(n == 2 || stage >= 2 ? d == 0 : d <= 1e-2, label + ", " + order + ": resuming from this rank's shard is the "
           "run that did not stop (bitwise where the reduction order is fixed)", "relative " + str(d));
  }
  // The consolidated archive loads into a sharded optimizer (this world, another stage) and into an unsharded one; both
  // continue as the unsharded reference does.
  {
    const int other_stage = stage == 3 ? 1 : stage + 1;
    auto net3 = make_mlp(98);
    auto [model3, optimizer3] = amp::initialize(net3, make(net3), options);
    auto ddp3 = amp::parallel::make_distributed(model3, group);
    amp::parallel::shard_optimizer(ddp3, optimizer3, amp::parallel::ZeroOptions().stage(other_stage));
    torch::load(optimizer3, consolidated);  // masters and state; the model follows the masters
    auto net4 = make_mlp(97);
    auto [model4, optimizer4] = amp::initialize(net4, make(net4), options);
    auto ddp4 = amp::parallel::make_distributed(model4, group);
    torch::load(optimizer4, consolidated);
    train(ref_ddp, ref_optimizer, 3, 6);
    train(ddp3, optimizer3, 3, 6);
    train(ddp4, optimizer4, 3, 6);
    const double d3 = relative_diff(whole_params(ddp3, net3), params_of(ref_net));
    const double d4 = relative_diff(params_of(net4), params_of(ref_net));
    report(n == 2 ? d3 == 0 && d4 == 0 : d3 <= 1e-2 && d4 <= 1e-2,
           label + ": the consolidated archive resumes sharded (at stage " + std::to_string(other_stage) + ") and "
           "unsharded like the unsharded run",
           "relative " + str(d3) + ", " + str(d4));
  }
  // Rank 0's consolidated file holds what the unsharded run's torch::save holds (2 ranks: same trajectory, bitwise).
  if (n == 2 && group.rank() == 0) {
    torch::serialize::InputArchive a, b;
    a.load_from(consolidated);
    b.load_from(unsharded);
    bool equal = true;
    torch::serialize::InputArchive a_amp, b_amp;
    a.read("amp", a_amp);
    b.read("amp", b_amp);
    for (int i = 0; i < 6; ++i) {
      torch::Tensor x, y;
      a_amp.read("master/" + std::to_string(i), x);
      b_amp.read("master/" + std::to_string(i), y);
      equal = equal && torch::equal(x, y);
    }
    report(equal, label + ": the consolidated archive's masters equal the unsharded run's");
  }
  // A stage-1 or 2 shard at stage 3 and the reverse: refused, naming both stages (stage 3's slices are per unit).
  {
    auto net9 = make_mlp(5);
    auto [model9, optimizer9] = amp::initialize(net9, make(net9), options);
    auto ddp9 = amp::parallel::make_distributed(model9, group);
    amp::parallel::shard_optimizer(ddp9, optimizer9, amp::parallel::ZeroOptions().stage(stage == 3 ? 2 : 3));
    const std::string message = message_of([&] { torch::load(optimizer9, shard_path); });
    report(message.find("the checkpoint is a shard of ZeRO stage " + std::to_string(stage) + ", this optimizer is "
                        "sharded at stage " + std::to_string(stage == 3 ? 2 : 3)) != std::string::npos,
           label + ": a rank's shard at another side of stage 3 is refused, naming both stages", message.substr(0, 200));
  }
  // A shard from another world size (the 2-rank run's, read by the 4-rank run) is refused naming both sizes.
  if (n == 4) {
    const std::string other = dir + "/zero_s" + std::to_string(stage) + "_w2_r" + std::to_string(group.rank() % 2) + ".pt";
    auto net5 = make_mlp(5);
    auto [model5, optimizer5] = amp::initialize(net5, make(net5), options);
    auto ddp5 = amp::parallel::make_distributed(model5, group);
    amp::parallel::shard_optimizer(ddp5, optimizer5, amp::parallel::ZeroOptions().stage(stage));
    const std::string message = message_of([&] { torch::load(optimizer5, other); });
    report(message.find("world of 2 ranks, this run has 4") != std::string::npos,
           label + ": a shard of a 2-rank world is refused at 4 ranks", message.substr(0, 200));
  }
}

// Gradient accumulation under no_sync: two micro-batches kept scaled (delay_unscale), then a synchronized one.
void accumulation(const ProcessGroup& group, int stage) {
  const int n = group.world_size();
  const int64_t local_rows = kGlobal / n;
  const amp::Options options = amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0);
  auto ref_net = make_mlp(21), net = make_mlp(21);
  auto [ref_model, ref_optimizer] = amp::initialize(ref_net, amp::optim::FusedSGD(ref_net->parameters(), torch::optim::SGDOptions(0.1)), options);
  auto [model, optimizer] = amp::initialize(net, amp::optim::FusedSGD(net->parameters(), torch::optim::SGDOptions(0.1)), options);
  auto ref_ddp = amp::parallel::make_distributed(ref_model, group, wire_for(n));
  auto ddp = amp::parallel::make_distributed(model, group, wire_for(n));
  amp::parallel::shard_optimizer(ddp, optimizer, amp::parallel::ZeroOptions().stage(stage));
  auto run = [&](auto& d, auto& o) {
    for (int step = 0; step < 3; ++step) {
      o.zero_grad();
      for (int micro = 0; micro < 3; ++micro) {
        const Batch local = rows(global_batch(step * 3 + micro, kGlobal), group.rank() * local_rows, local_rows);
        if (micro < 2) {
          auto guard = d.no_sync();
          auto scaled = amp::scale_loss(loss_of(d(local.x), local.y), o, amp::ScaleLossOptions().delay_unscale(true));
          scaled.backward();
        } else {
          auto scaled = amp::scale_loss(loss_of(d(local.x), local.y), o);
          scaled.backward();
        }
      }
      o.step();
    }
  };
  run(ref_ddp, ref_optimizer);
  run(ddp, optimizer);
  const double d = relative_diff(whole_params(ddp, net), params_of(ref_net));
  // Every stage sums the micro-batches in fp32 as the unsharded run (NOTE [fp32 accumulation under no_sync]); more
  // than 2 ranks add those fp32 sums in other orders (wire_for): a float's rounding per step.
  report(n == 2 ? d == 0 : d <= 1e-5, "no_sync accumulation stage " + std::to_string(stage) +
         " against the unsharded run", "relative " + str(d));
  report(same_on_all_ranks(group, whole_params(ddp, net)), "no_sync accumulation stage " + std::to_string(stage) +
         ": every rank's replica is identical");
}

// NOTE [Overlapped reduce-scatter]: stage 2 reduce-scatters each lane while backward runs; the parameters equal the
// reduction after backward (overlap(false)) and the unsharded run bit for bit on 2 ranks, over plain steps, an
// overflow on one rank, no_sync() accumulation windows (whose fp32 sums are reduce-scattered after backward) and two
// losses before one step, with lanes that start during backward (the overlapped bytes counted), a frozen parameter's
// among them; a DistributedDataParallel made
// with delay_allreduce reduces after backward (ranks may reach different parameters), and with overlap a backward
// that misses a parameter is refused by name.
void overlap(const ProcessGroup& group) {
  const int n = group.world_size();
  const int64_t local_rows = kGlobal / n;
  const amp::Options options = amp::Options("O2").low_precision_dtype(torch::kBFloat16).growth_interval(2).verbosity(0);
  struct Run {
    std::vector<torch::Tensor> params;
    amp::parallel::CommunicationStats stats;
  };
  // mode 0: unsharded; 1: stage 2 without overlap; 2: with; 3: with, the DistributedDataParallel delay_allreduce;
  // frozen: the middle layer's bias frozen (no gradient to wait for).
  auto train = [&](int mode, bool frozen) {
    auto net = make_mlp(31);
    if (frozen) net[2]->named_parameters()["bias"].set_requires_grad(false);
    auto [model, optimizer] = amp::initialize(net, adamw_of(net), options);
    auto ddp = amp::parallel::make_distributed(model, group, wire_for(n).delay_allreduce(mode == 3));
    if (mode > 0) {
      amp::parallel::shard_optimizer(ddp, optimizer,
                                     amp::parallel::ZeroOptions().stage(2).bucket_cap_mb(0.002).overlap(mode != 1));
    }
    for (int step = 0; step < 5; ++step) {
      optimizer.zero_grad();
      if (step == 2) {  // an accumulation window: one no_sync() micro-batch, then a synchronized one
        const Batch first = rows(global_batch(100 + step, kGlobal), group.rank() * local_rows, local_rows);
        auto guard = ddp.no_sync();
        amp::scale_loss(loss_of(ddp(first.x), first.y), optimizer, amp::ScaleLossOptions().delay_unscale(true)).backward();
      }
      const Batch local = rows(global_batch(step, kGlobal), group.rank() * local_rows, local_rows);
      const bool inf = step == 3 && group.rank() == 1;
      if (step == 4) {  // two losses before one step
        amp::scale_loss(loss_of(ddp(local.x), local.y), optimizer, amp::ScaleLossOptions().delay_unscale(true)).backward();
      }
      amp::scale_loss(loss_of(ddp(local.x), local.y, inf ? 0 : -1), optimizer).backward();
      optimizer.step();
    }
    return Run{params_of(net), ddp.communication_stats()};
  };
  for (const bool frozen : {false, true}) {
    const std::string label = std::string("overlapped reduce-scatter") + (frozen ? ", a frozen bias" : "");
    const Run unsharded = train(0, frozen), after = train(1, frozen), during = train(2, frozen), delayed = train(3, frozen);
    report(equal_bits(during.params, after.params) && equal_bits(during.params, unsharded.params),
           label + ": the parameters of the reduction after backward and of the unsharded run, bit for bit");
    report(equal_bits(delayed.params, after.params), label + ": delay_allreduce reduces after backward, the same bits");
    report(during.stats.overlapped_reduce_scatter_bytes > 0 &&
               during.stats.overlapped_reduce_scatter_bytes <= during.stats.reduce_scatter_bytes,
           label + ": lanes start during backward",
           std::to_string(during.stats.overlapped_reduce_scatter_bytes) + " of " +
               std::to_string(during.stats.reduce_scatter_bytes) + " bytes");
    report(after.stats.overlapped_reduce_scatter_bytes == 0 && delayed.stats.overlapped_reduce_scatter_bytes == 0,
           label + ": overlap(false) and delay_allreduce start none during backward");
    report(after.stats.reduce_scatter_bytes == during.stats.reduce_scatter_bytes, label + ": the same bytes reduce-scattered");
  }
  // A backward that reaches only some parameters (every rank alike) is refused with overlap, by name.
  auto net = make_mlp(31);
  auto [model, optimizer] = amp::initialize(net, adamw_of(net), options);
  auto ddp = amp::parallel::make_distributed(model, group, wire_for(n));
  amp::parallel::shard_optimizer(ddp, optimizer, amp::parallel::ZeroOptions().stage(2));
  const Batch local = rows(global_batch(0, kGlobal), group.rank() * local_rows, local_rows);
  const std::string missing = message_of([&] {
    auto hidden = net[1]->as<torch::nn::ReLU>()->forward(net[0]->as<torch::nn::Linear>()->forward(local.x.to(torch::kBFloat16)));
    amp::scale_loss(hidden.sum(), optimizer).backward();  // the last two Linear layers get no gradient
  });
  report(missing.find("this backward produced no gradient for 4 trainable parameter(s)") != std::string::npos &&
             missing.find("ZeRO's reduce-scatter") != std::string::npos,
         "overlapped reduce-scatter: a backward that misses parameters is refused by name", missing);
}

// Two optimizers for one loss (first layer with FusedSGD, the rest with FusedAdamW), both sharded on one wrapper.
void two_optimizers(const ProcessGroup& group, int stage) {
  const int n = group.world_size();
  const int64_t local_rows = kGlobal / n;
  const amp::Options options = amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0);
  auto make = [&](torch::nn::Sequential& net) {
    std::vector<torch::Tensor> first, rest;
    for (const auto& item : net->named_parameters()) (item.key()[0] == '0' ? first : rest).push_back(item.value());
    return std::make_tuple(amp::optim::FusedSGD(first, torch::optim::SGDOptions(0.05).momentum(0.9)),
                           amp::optim::FusedAdamW(rest, torch::optim::AdamWOptions(1e-2)));
  };
  auto run = [&](torch::nn::Sequential& net, bool shard) {
    auto [a, b] = make(net);
    auto [models, optimizers] = amp::initialize(std::tuple(net), std::tuple(std::move(a), std::move(b)), options);
    auto& [model] = models;
    auto& [oa, ob] = optimizers;
    auto ddp = amp::parallel::make_distributed(model, group, wire_for(n));
    if (shard) {
      amp::parallel::shard_optimizer(ddp, oa, amp::parallel::ZeroOptions().stage(stage));
      amp::parallel::shard_optimizer(ddp, ob, amp::parallel::ZeroOptions().stage(stage));
    }
    for (int step = 0; step < 4; ++step) {
      const Batch local = rows(global_batch(step, kGlobal), group.rank() * local_rows, local_rows);
      oa.zero_grad();
      ob.zero_grad();
      {
        auto scaled = amp::scale_loss(loss_of(ddp(local.x), local.y), {&oa, &ob});
        scaled.backward();
      }
      oa.step();
      ob.step();
    }
    return whole_params(ddp, net);  // (stage 3: while its optimizers live, which hold the values)
  };
  auto ref_net = make_mlp(31), net = make_mlp(31);
  const auto expected = run(ref_net, false);
  const double d = relative_diff(run(net, true), expected);
  report(d == 0, "two optimizers for one loss, both sharded at stage " + std::to_string(stage),
         "relative " + str(d));
}

// Muon's recipe sharded: FusedMuon on the weight matrices, FusedAdamW on the biases, one loss. ZeRO gives each rank
// whole matrices of Muon's (NOTE [ZeRO layout]); both sharded, against the unsharded pair: bitwise, with fp32 and with
// bf16 momentum (whose stochastic draws are numbered as the whole tensors'), and a consolidated archive resumes it.
void muon(const ProcessGroup& group, int stage, const std::string& dir) {
  const int n = group.world_size();
  const int64_t local_rows = kGlobal / n;
  for (const auto format : {amp::OptimizerStateFormat::kFp32, amp::OptimizerStateFormat::kBf16}) {
    const amp::Options options =
        amp::Options("O2").low_precision_dtype(torch::kBFloat16).optimizer_state_format(format).verbosity(0);
    const std::string label = std::string("FusedMuon + FusedAdamW, ") + amp::to_string(format) + " states, stage " +
                              std::to_string(stage);
    auto run = [&](torch::nn::Sequential& net, bool shard, int from, int to, const std::string& save,
                   const std::string& load) {
      std::vector<torch::Tensor> matrices, biases;
      for (const auto& p : net->parameters()) (p.dim() == 2 ? matrices : biases).push_back(p);
      torch::manual_seed(7);  // the bf16 format's seeds come from the default generator at initialize
      auto [models, optimizers] = amp::initialize(
          std::tuple(net), std::tuple(amp::optim::FusedMuon(matrices, amp::optim::FusedMuonOptions(0.02)),
                                      amp::optim::FusedAdamW(biases, torch::optim::AdamWOptions(1e-2))),
          options);
      auto& [model] = models;
      auto& [om, oa] = optimizers;
      auto ddp = amp::parallel::make_distributed(model, group, wire_for(n));
      if (shard) {
        amp::parallel::shard_optimizer(ddp, om, amp::parallel::ZeroOptions().stage(stage));
        amp::parallel::shard_optimizer(ddp, oa, amp::parallel::ZeroOptions().stage(stage));
      }
      if (!load.empty()) {  // masters and state; the model follows the masters
        torch::load(om, load + ".muon");
        torch::load(oa, load + ".adamw");
      }
      for (int step = from; step < to; ++step) {
        const Batch local = rows(global_batch(step, kGlobal), group.rank() * local_rows, local_rows);
        om.zero_grad();
        oa.zero_grad();
        {
          auto scaled = amp::scale_loss(loss_of(ddp(local.x), local.y), {&om, &oa});
          scaled.backward();
        }
        om.step();
        oa.step();
      }
      if (!save.empty()) {
        amp::parallel::save_consolidated(om, save + ".muon");
        amp::parallel::save_consolidated(oa, save + ".adamw");
      }
      return whole_params(ddp, net);  // (stage 3: while the optimizers live, which hold the values)
    };
    auto ref_net = make_mlp(41), net = make_mlp(41), resumed = make_mlp(42);
    const auto expected = run(ref_net, false, 0, 6, "", "");
    const double d = relative_diff(run(net, true, 0, 6, "", ""), expected);
    report(d == 0, label + ": 6 steps against unsharded (each rank steps whole matrices)", "relative " + str(d));
    const std::string path = dir + "/amp_zero_muon_s" + std::to_string(stage) + "_w" + std::to_string(n) + "_" +
                             amp::to_string(format);
    auto first_half = make_mlp(41);
    run(first_half, true, 0, 3, path, "");
    group.barrier();
    const double r = relative_diff(run(resumed, true, 3, 6, "", path), expected);
    report(r == 0, label + ": 3 steps, the consolidated archive, 3 more sharded, against unsharded", "relative " + str(r));
  }
}

// PythonCheckpoint on a sharded optimizer is collective: every rank puts the model's fp32 masters and the optimizer
// state whole; load_optimizer scatters (each rank keeps its slices); amp::load_weights writes the fp32 values into
// the masters' slices. Each against the unsharded run doing the same.
void python_checkpoints(const ProcessGroup& group, int stage, const std::string& dir) {
  const int n = group.world_size();
  const std::string label = "PythonCheckpoint stage " + std::to_string(stage);
  const amp::Options options = amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0);
  auto make = [](torch::nn::Sequential& net) { return adamw_of(net); };
  auto train = [&](auto& ddp, auto& optimizer, int from, int to) { train_steps(group, ddp, optimizer, from, to); };
  const std::string base = dir + "/py_s" + std::to_string(stage) + "_w" + std::to_string(n) + "_r" + std::to_string(group.rank());
  std::vector<torch::Tensor> finals[2];
  for (int sharded = 0; sharded < 2; ++sharded) {
    auto net = make_mlp(41);
    auto [model, optimizer] = amp::initialize(net, make(net), options);
    auto ddp = amp::parallel::make_distributed(model, group);
    if (sharded) amp::parallel::shard_optimizer(ddp, optimizer, amp::parallel::ZeroOptions().stage(stage));
    // fp32 weights written after initialize: into the masters (the sharded run: into its slices).
    auto fp32_net = make_mlp(42);
    torch::save(fp32_net, base + ".weights");
    amp::load_weights(*net, base + ".weights");
    train(ddp, optimizer, 0, 3);
    amp::PythonCheckpoint checkpoint;  // every rank: collective when sharded
    checkpoint.put_model("model", *net);
    checkpoint.put_optimizer("optimizer", optimizer);
    checkpoint.save(base + (sharded ? ".sharded.pt" : ".plain.pt"));
    // Continue in a fresh run from the file: unsharded for the plain file, sharded for the sharded one.
    auto net2 = make_mlp(43);
    auto [model2, optimizer2] = amp::initialize(net2, make(net2), options);
    auto ddp2 = amp::parallel::make_distributed(model2, group);
    if (sharded) amp::parallel::shard_optimizer(ddp2, optimizer2, amp::parallel::ZeroOptions().stage(stage));
    const auto loaded = amp::PythonCheckpoint::load(base + (sharded ? ".sharded.pt" : ".plain.pt"));
    loaded.load_model(*net2, "model");
    loaded.load_optimizer(optimizer2, "optimizer");
    train(ddp2, optimizer2, 3, 5);
    train(ddp, optimizer, 3, 5);
    const double d = relative_diff(whole_params(ddp2, net2), whole_params(ddp, net));
    // More than 2 ranks: a fresh wrapper's all-reduce buckets differ from the running one's (see checkpoints()).
    const bool fixed_order = n == 2 || (sharded && stage >= 2);
    report(fixed_order ? d == 0 : d <= 1e-2, label + (sharded ? " sharded" : " plain") + ": a run continued from the file "
           "equals the one that did not stop", "relative " + str(d));
    finals[sharded] = whole_params(ddp, net);
  }
  if (n == 2) {  // more ranks: train_side_by_side bounds the sharded run against the unsharded one
    const double d = relative_diff(finals[1], finals[0]);
    report(d == 0, label + ": load_weights, put_model / put_optimizer and the reload sharded equal the unsharded run",
           "relative " + str(d));
    // The files themselves: the sharded run's holds what the unsharded run's holds.
    const auto a = amp::PythonCheckpoint::load(base + ".sharded.pt"), b = amp::PythonCheckpoint::load(base + ".plain.pt");
    auto model_a = make_mlp(1), model_b = make_mlp(1);
    a.load_model(*model_a, "model");
    b.load_model(*model_b, "model");
    report(equal_bits(params_of(model_a), params_of(model_b)), label + ": put_model writes the unsharded run's fp32 masters");
  }
}

// A TorchScript model (its torch::nn mirror under the wrapper), sharded against unsharded.
void torchscript(const ProcessGroup& group, int stage) {
  const int n = group.world_size();
  const amp::Options options = amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0);
  std::vector<torch::Tensor> results[2];
  for (int sharded = 0; sharded < 2; ++sharded) {
    auto module = scripted_mlp(51);
    auto [model, optimizer] = amp::initialize(
        module, amp::optim::FusedAdamW(amp::parameters(module), torch::optim::AdamWOptions(1e-2)), options);
    auto ddp = amp::parallel::make_distributed(model, group, wire_for(n));
    if (sharded) amp::parallel::shard_optimizer(ddp, optimizer, amp::parallel::ZeroOptions().stage(stage));
    const int64_t local_rows = kGlobal / n;
    for (int step = 0; step < 4; ++step) {
      const Batch local = rows(global_batch(step, kGlobal), group.rank() * local_rows, local_rows);
      optimizer.zero_grad();
      {
        auto scaled = amp::scale_loss(loss_of(ddp(local.x).toTensor(), local.y), optimizer);
        scaled.backward();
      }
      optimizer.step();
    }
    amp::parallel::GatheredParametersGuard whole(ddp);  // stage 3: collective
    results[sharded] = clones(amp::parameters(module));
  }
  const double d = relative_diff(results[1], results[0]);
  report(d == 0, "TorchScript model, stage " + std::to_string(stage) + ", against unsharded",
         "relative " + str(d));
}

void misuse(const ProcessGroup& group) {
  const amp::Options options = amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0);
  auto net = make_mlp(3);
  auto [model, optimizer] = amp::initialize(net, amp::optim::FusedAdam(net->parameters()), options);
  auto ddp = amp::parallel::make_distributed(model, group);
  std::string m = message_of([&] { amp::parallel::shard_optimizer(ddp, optimizer, amp::parallel::ZeroOptions().stage(4)); });
  report(m.find("stage must be 1") != std::string::npos && m.find("got 4") != std::string::npos, "stage 4 is refused", m);
  amp::parallel::shard_optimizer(ddp, optimizer);
  m = message_of([&] { amp::parallel::shard_optimizer(ddp, optimizer); });
  report(m.find("sharded already") != std::string::npos, "sharding twice is refused", m);

  auto net2 = make_mlp(3);
  auto [model2, optimizer2] = amp::initialize(net2, amp::optim::FusedAdam(net2->parameters()), options);
  auto ddp2 = amp::parallel::make_distributed(model2, group);
  const Batch local = rows(global_batch(0, kGlobal), 0, 4);
  {
    auto scaled = amp::scale_loss(loss_of(ddp2(local.x), local.y), optimizer2);
    scaled.backward();
  }
  optimizer2.step();
  m = message_of([&] { amp::parallel::shard_optimizer(ddp2, optimizer2); });
  report(m.find("stepped 1 time") != std::string::npos, "sharding after the first step is refused", m);

  auto net3 = make_mlp(3);
  auto [model3, optimizer3] = amp::initialize(
      net3, torch::optim::RMSprop(net3->parameters(), torch::optim::RMSpropOptions(1e-3)), options);
  auto ddp3 = amp::parallel::make_distributed(model3, group);
  m = message_of([&] { amp::parallel::shard_optimizer(ddp3, optimizer3); });
  report(m.find("can't be sharded") != std::string::npos, "an optimizer type amp can't slice is refused", m);

  // An optimizer that trains another model than the wrapper's.
  auto net4 = make_mlp(3);
  auto [model4, optimizer4] = amp::initialize(net4, amp::optim::FusedAdam(net4->parameters()), options);
  m = message_of([&] { amp::parallel::shard_optimizer(ddp3, optimizer4); });
  report(m.find("does not reduce") != std::string::npos, "an optimizer of another model is refused", m);

  // A lean weight whose data is replaced by another size after sharding: its slices can't alias it.
  auto net5 = make_mlp(3);
  auto [model5, optimizer5] = amp::initialize(
      net5, amp::optim::FusedAdam(net5->parameters()),
      amp::Options("O2").low_precision_dtype(torch::kBFloat16).master_weights_format(amp::MasterWeights::kSplit).verbosity(0));
  auto ddp5 = amp::parallel::make_distributed(model5, group);
  amp::parallel::shard_optimizer(ddp5, optimizer5, amp::parallel::ZeroOptions().stage(2));
  {
    auto scaled = amp::scale_loss(loss_of(ddp5(local.x), local.y), optimizer5);
    scaled.backward();
  }
  net5[0]->named_parameters()["weight"].set_data(torch::zeros({3, 3}, torch::kBFloat16));
  m = message_of([&] { optimizer5.step(); });
  report(m.find("parameter '0.weight' is of another size") != std::string::npos &&
             m.find("amp::load_weights") != std::string::npos,
         "a sharded lean weight replaced by another size is refused, named, with the fix", m);
}

// Optimizer states in 8 bits and bf16 under ZeRO (NOTE [ZeRO layout]): a net whose two weights quantize (6144 and
// 8192 values), sharded and unsharded side by side, bit for bit on 2 ranks with Adam (bf16's rounding draws are the
// unsharded step's for each element, 8-bit blocks never straddle a slice), within 1e-5 with LAMB (its norms are sums
// over the ranks' pieces); the consolidated archive holds the unsharded run's codes and scales; the state divides.
void state_formats(const ProcessGroup& group, int stage, const std::string& dir) {
  const int n = group.world_size();
  const int64_t local_rows = kGlobal / n;
  auto make_net = [] {
    torch::manual_seed(21);
    return torch::nn::Sequential(torch::nn::Linear(12, 512), torch::nn::ReLU(), torch::nn::Linear(512, 16),
                                 torch::nn::ReLU(), torch::nn::Linear(16, 5));
  };
  struct Case {
    const char* label;
    amp::OptimizerStateFormat format;
    int optimizer;
  };
  for (const Case& c : {Case{"8bit FusedAdamW", amp::OptimizerStateFormat::k8Bit, 0},
                        Case{"bf16 FusedAdamW", amp::OptimizerStateFormat::kBf16, 0},
                        Case{"8bit FusedAdam amsgrad", amp::OptimizerStateFormat::k8Bit, 3},
                        Case{"8bit FusedLAMB", amp::OptimizerStateFormat::k8Bit, 4}}) {
    const std::string label = std::string("O2 bf16 ") + c.label + " stage " + std::to_string(stage);
    const amp::Options options =
        amp::Options("O2").low_precision_dtype(torch::kBFloat16).optimizer_state_format(c.format).verbosity(0);
    auto ref_net = make_net(), net = make_net();
    with_optimizer(c.optimizer, ref_net, [&](auto ref_opt) {
      with_optimizer(c.optimizer, net, [&](auto opt) {
        // Each rank seeds bf16's rounding differently: make_distributed hands every rank rank 0's generator.
        torch::manual_seed(8 + group.rank());
        auto [ref_model, ref_optimizer] = amp::initialize(ref_net, std::move(ref_opt), options);
        torch::manual_seed(8 + group.rank());
        auto [model, optimizer] = amp::initialize(net, std::move(opt), options);
        auto ref_ddp = amp::parallel::make_distributed(ref_model, group, wire_for(n));
        auto ddp = amp::parallel::make_distributed(model, group, wire_for(n));
        amp::parallel::shard_optimizer(ddp, optimizer, amp::parallel::ZeroOptions().stage(stage).bucket_cap_mb(0.01));
        bool same = true;
        double worst = 0;
        for (int step = 0; step < 5; ++step) {
          const Batch batch = global_batch(step, kGlobal);
          const Batch local = rows(batch, group.rank() * local_rows, local_rows);
          auto train = [&](auto& o, auto& d) {
            o.zero_grad();
            {
              auto scaled = amp::scale_loss(loss_of(d(local.x), local.y), o);
              scaled.backward();
            }
            o.step();
          };
          train(ref_optimizer, ref_ddp);
          train(optimizer, ddp);
          const auto a = whole_params(ddp, net), b = params_of(ref_net);
          same = same && equal_bits(a, b);
          worst = std::max(worst, relative_diff(a, b));
        }
        report(same, label + ": the sharded replica equals the unsharded one bit for bit", "worst relative " + str(worst));
        report(same_on_all_ranks(group, whole_params(ddp, net)), label + ": every rank's replica is identical");
        report(same_on_all_ranks(group, params_of(ref_net)), label + ": every rank's unsharded replica is identical");
        const auto sharded = amp::state_bytes(optimizer), unsharded = amp::state_bytes(ref_optimizer);
        report(sharded.optimizer_state < unsharded.optimizer_state, label + ": the quantized state divides",
               std::to_string(sharded.optimizer_state) + " vs " + std::to_string(unsharded.optimizer_state) + " bytes");
        // The consolidated archive is the unsharded run's: every moment (codes and scales, or bf16) bit for bit (2 ranks).
        const std::string consolidated = dir + "/zero_states_" + std::to_string(stage) + ".pt";
        amp::parallel::save_consolidated(optimizer, consolidated);
        if (group.rank() == 0) {
          auto check_net = make_net();
          with_optimizer(c.optimizer, check_net, [&](auto check_opt) {
            auto [check_model, check_optimizer] = amp::initialize(check_net, std::move(check_opt), options);
            torch::load(check_optimizer, consolidated);
            bool moments_equal = true, packed = false;
            std::string differs;
            auto& mine = check_optimizer.state();
            auto& theirs = ref_optimizer.state();
            const auto& groups = check_optimizer.param_groups();
            const auto& ref_groups = ref_optimizer.param_groups();
            for (size_t g = 0; g < groups.size(); ++g) {
              for (size_t i = 0; i < groups[g].params().size(); ++i) {
                auto* a = mine.at(amp::detail::state_key(mine, groups[g].params()[i])).get();
                auto* b = theirs.at(amp::detail::state_key(theirs, ref_groups[g].params()[i])).get();
                const auto fa = amp::detail::state_fields(*a).tensors, fb = amp::detail::state_fields(*b).tensors;
                for (size_t f = 0; f < fa.size(); ++f) {
                  if (!fa[f]->defined() && !fb[f]->defined()) continue;
                  const bool equal = fa[f]->defined() && fb[f]->defined() &&
                                     fa[f]->scalar_type() == fb[f]->scalar_type() && torch::equal(*fa[f], *fb[f]);
                  if (!equal && moments_equal) {
                    differs = "group " + std::to_string(g) + " parameter " + std::to_string(i) + " field " + std::to_string(f);
                  }
                  moments_equal = moments_equal && equal;
                  packed = packed || fa[f]->scalar_type() == torch::kUInt8;
                }
              }
            }
            report(moments_equal, label + ": the consolidated archive holds the unsharded run's moments bit for bit", differs);
            if (c.format == amp::OptimizerStateFormat::k8Bit) report(packed, label + ": ... in 8 bits");
          });
        }
      });
    });
  }
}

// The lean master formats under ZeRO (NOTE [ZeRO layout]): each rank steps its pieces of the bf16 weights through
// slices of the lean table, so weights, aux and the stochastic rounding generator must equal the unsharded run's bit for
// bit after every step (an overflow skipped on rank 1's batch, clipping), with fp32 and 8-bit moments, Adam and SGD;
// then a consolidated archive resumes a sharded and an unsharded run alike, and load_weights writes fp32 values. At
// stage 3 the pieces hold the weights too: load_weights writes them without a guard, the archives carry them.
void lean_masters(const ProcessGroup& group, int stage, const std::string& dir) {
  const int n = group.world_size();
  const int64_t local_rows = kGlobal / n;
  auto make_net = [] {
    torch::manual_seed(23);
    return torch::nn::Sequential(torch::nn::Linear(12, 512), torch::nn::ReLU(), torch::nn::Linear(512, 16),
                                 torch::nn::ReLU(), torch::nn::Linear(16, 5));
  };
  // Every weight's fp32 value (a lean one's from the bf16 weight and its aux; collective when sharded) and bf16
  // weight, and the generator's counter; `core`: the sharded net's (stage 3: whole under its guard, collective).
  auto lean_state = [](torch::nn::Sequential& net, const std::shared_ptr<amp::parallel::detail::DistributedCore>& core = nullptr) {
    amp::parallel::GatheredParametersGuard whole(core);
    std::vector<torch::Tensor> out;
    for (const auto& item : amp::detail::fp32_state(*net)) out.push_back(item.second.clone());
    uint64_t counter = 0;
    for (const auto& p : net->parameters()) {
      out.push_back(p.detach().clone());
      if (const auto found = amp::detail::find_lean(p)) counter = found->first->counter();
    }
    return std::make_pair(out, counter);
  };
  struct Case {
    amp::MasterWeights masters;
    amp::OptimizerStateFormat moments;
    int optimizer;
  };
  std::vector<Case> cases = {
      {amp::MasterWeights::kSplit, amp::OptimizerStateFormat::k8Bit, 0},
      {amp::MasterWeights::kStochasticRounding, amp::OptimizerStateFormat::kBf16, 0},
      {amp::MasterWeights::kResidual8, amp::OptimizerStateFormat::k8Bit, 0},
      {amp::MasterWeights::kStochasticRounding, amp::OptimizerStateFormat::kFp32, 1},
      {amp::MasterWeights::kKahan, amp::OptimizerStateFormat::kFp32, 4},
  };
  if (stage != 3) {  // (stage 3: the formats above cover every master format, moment format and kind of step)
    cases.push_back({amp::MasterWeights::kSplit, amp::OptimizerStateFormat::kFp32, 0});
    cases.push_back({amp::MasterWeights::kKahan, amp::OptimizerStateFormat::kFp32, 0});
  }
  if (n > 2) cases = {cases[0], cases[3]};  // more ranks: other slice ends for the 8-bit blocks and the draws' places
  for (const Case& c : cases) {
    const std::string label = std::string("O2 bf16 ") + amp::to_string(c.masters) + " masters, " +
                              amp::to_string(c.moments) + " moments, optimizer " + std::to_string(c.optimizer) +
                              ", stage " + std::to_string(stage);
    const amp::Options options = amp::Options("O2")
                                     .low_precision_dtype(torch::kBFloat16)
                                     .master_weights_format(c.masters)
                                     .optimizer_state_format(c.moments)
                                     .verbosity(0);
    auto ref_net = make_net(), net = make_net();
    with_optimizer(c.optimizer, net, [&](auto opt) {
      auto ref_opt = optimizer_like<decltype(opt)>(c.optimizer, ref_net);
      {
        // Each rank seeds the rounding differently: make_distributed hands every rank rank 0's generator.
        torch::manual_seed(5 + group.rank());
        auto [ref_model, ref_optimizer] = amp::initialize(ref_net, std::move(ref_opt), options);
        torch::manual_seed(5 + group.rank());
        auto [model, optimizer] = amp::initialize(net, std::move(opt), options);
        auto ref_ddp = amp::parallel::make_distributed(ref_model, group, wire_for(n));
        auto ddp = amp::parallel::make_distributed(model, group, wire_for(n));
        amp::parallel::shard_optimizer(ddp, optimizer, amp::parallel::ZeroOptions().stage(stage).bucket_cap_mb(0.01));
        auto train = [&](auto& o, auto& d, int step) {
          const Batch local = rows(global_batch(step, kGlobal), group.rank() * local_rows, local_rows);
          const int64_t inf_at = step == 3 && group.rank() == 1 ? 2 : -1;  // every rank skips
          o.zero_grad();
          {
            auto scaled = amp::scale_loss(loss_of(d(local.x), local.y, inf_at), o);
            scaled.backward();
          }
          (void)amp::clip_grad_norm_(o, 5.0);
          o.step();
        };
        bool same = true;
        double worst = 0;
        for (int step = 0; step < 6; ++step) {
          train(ref_optimizer, ref_ddp, step);
          train(optimizer, ddp, step);
          const auto a = lean_state(net, ddp.core()), b = lean_state(ref_net);
          same = same && equal_bits(a.first, b.first) && a.second == b.second;
          worst = std::max(worst, relative_diff(a.first, b.first));
        }
        report(same, label + ": weights, aux and generator equal the unsharded run's bit for bit after every step",
               "worst relative " + str(worst));
        report(optimizer.skipped_steps() == 1 && ref_optimizer.skipped_steps() == 1, label + ": the overflow is skipped");
        report(same_on_all_ranks(group, lean_state(net, ddp.core()).first), label + ": every rank keeps the same weights and aux");
        const auto sharded = amp::state_bytes(optimizer), unsharded = amp::state_bytes(ref_optimizer);
        report(sharded.optimizer_state < unsharded.optimizer_state, label + ": the optimizer state divides",
               std::to_string(sharded.optimizer_state) + " vs " + std::to_string(unsharded.optimizer_state) + " bytes");
        if (c.masters != amp::MasterWeights::kStochasticRounding) {  // each rank keeps its slices of the aux alone
          report(sharded.masters * (n - 1) < unsharded.masters, label + ": the aux divide",
                 std::to_string(sharded.masters) + " vs " + std::to_string(unsharded.masters) + " bytes");
        }
        if (stage == 3) {  // and its slices of the bf16 weights
          report(sharded.params * (n - 1) < unsharded.params, label + ": the weights divide",
                 std::to_string(sharded.params) + " vs " + std::to_string(unsharded.params) + " bytes");
        }

        // The consolidated archive resumes an unsharded and a sharded run where these two are, a rank's own archive a
        // sharded run.
        const std::string path = dir + "/zero_lean_" + std::to_string(stage) + ".pt";
        const std::string own = dir + "/zero_lean_" + std::to_string(stage) + "_rank" + std::to_string(group.rank()) + ".pt";
        amp::parallel::save_consolidated(optimizer, path);
        torch::save(optimizer, own);
        auto resumed_net = make_net(), sharded_net = make_net(), own_net = make_net();
        {
          using Opt = decltype(opt);
          auto resumed_opt = optimizer_like<Opt>(c.optimizer, resumed_net);
          auto sharded_opt = optimizer_like<Opt>(c.optimizer, sharded_net);
          auto own_opt = optimizer_like<Opt>(c.optimizer, own_net);
            auto [resumed_model, resumed] = amp::initialize(resumed_net, std::move(resumed_opt), options);
            auto [sharded_model, resharded] = amp::initialize(sharded_net, std::move(sharded_opt), options);
            auto [own_model, own_optimizer] = amp::initialize(own_net, std::move(own_opt), options);
            auto resumed_ddp = amp::parallel::make_distributed(resumed_model, group, wire_for(n));
            auto sharded_ddp = amp::parallel::make_distributed(sharded_model, group, wire_for(n));
            auto own_ddp = amp::parallel::make_distributed(own_model, group, wire_for(n));
            amp::parallel::shard_optimizer(sharded_ddp, resharded, amp::parallel::ZeroOptions().stage(stage));
            amp::parallel::shard_optimizer(own_ddp, own_optimizer,
                                           amp::parallel::ZeroOptions().stage(stage).bucket_cap_mb(0.01));
            torch::load(resumed, path);  // the lean archive restores the weights with their aux
            torch::load(resharded, path);
            torch::load(own_optimizer, own);
            bool resumed_same = true;
            std::string differs;
            for (int step = 6; step < 9; ++step) {
              train(ref_optimizer, ref_ddp, step);
              train(optimizer, ddp, step);
              train(resumed, resumed_ddp, step);
              train(resharded, sharded_ddp, step);
              train(own_optimizer, own_ddp, step);
              const auto b = lean_state(ref_net);
              int which = 0;
              const std::vector<std::pair<torch::nn::Sequential*, std::shared_ptr<amp::parallel::detail::DistributedCore>>> runs{
                  {&net, ddp.core()}, {&resumed_net, nullptr}, {&sharded_net, sharded_ddp.core()}, {&own_net, own_ddp.core()}};
              for (const auto& [other, core] : runs) {
                const auto a = lean_state(*other, core);
                const bool equal = equal_bits(a.first, b.first) && a.second == b.second;
                if (!equal && differs.empty()) differs = "run " + std::to_string(which) + " at step " + std::to_string(step);
                resumed_same = resumed_same && equal;
                ++which;
              }
            }
            report(resumed_same, label + ": the consolidated archive resumes sharded and unsharded runs, a rank's own "
                   "archive a sharded one, bit for bit", differs);
        }

        // load_weights: fp32 values written whole on every rank, the pieces follow.
        const std::string weights = dir + "/zero_lean_weights_" + std::to_string(stage) + ".pt";
        if (group.rank() == 0) {
          auto source = make_net();
          torch::save(source, weights);
        }
        group.barrier();
        // Both runs take the step on batch `step`; the sharded one's weights and aux must be the unsharded one's.
        auto steps_as_unsharded = [&](int step, const std::string& after) {
          train(ref_optimizer, ref_ddp, step);
          train(optimizer, ddp, step);
          const auto a = lean_state(net, ddp.core()), b = lean_state(ref_net);
          report(equal_bits(a.first, b.first) && a.second == b.second,
                 label + ": after " + after + " the sharded run steps as the unsharded one");
        };
        amp::load_weights(*ref_net, weights);
        amp::load_weights(*net, weights);
        steps_as_unsharded(9, "load_weights");
        // The same under GatheredParametersGuard (stage 3: the whole weights take the values, the slices too).
        amp::load_weights(*ref_net, weights);
        {
          amp::parallel::GatheredParametersGuard whole(ddp);
          amp::load_weights(*net, weights);
        }
        steps_as_unsharded(9, "load_weights under GatheredParametersGuard");
        // A weight edited in place: its low bits go, on every rank's slices as unsharded (NOTE [Lean masters]).
        {
          amp::parallel::GatheredParametersGuard whole(ddp);  // stage 3: the edit reaches the slices when it ends
          torch::NoGradGuard no_grad;
          ref_net[2]->named_parameters()["weight"].mul_(0.5);
          net[2]->named_parameters()["weight"].mul_(0.5);
        }
        steps_as_unsharded(10, "a weight edited in place");
      }
    });
  }
}

// auto_fp32 under ZeRO (scenario_auto_fp32's model): three ordinary steps give every parameter Adam state, then layer
// "1" gets huge weights and only rank 1's batches overflow it; the ranks agree on it, and the sharded optimizer moves
// it to fp32 whole (its masters' values, its state, the lean aux gathered, then every group laid out again); then the
// weights are ordinary again. Against the unsharded run doing the same: bit for bit after every step on 2 ranks, with
// fp32 and split masters, and a consolidated archive (which holds the decision) resumes a sharded run bit for bit. On
// more ranks the moved module's fp32 gradients are summed in another order by the reduce-scatter: there within twice
// what reordering alone does to the unsharded run (train_side_by_side's bound).
void auto_fp32(const ProcessGroup& group, int stage, const std::string& dir) {
  auto make_net = [] {
    torch::manual_seed(5);
    auto net = torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::Linear(8, 1));
    torch::NoGradGuard no_grad;
    net[0]->as<torch::nn::LinearImpl>()->weight.fill_(1.0);
    net[0]->as<torch::nn::LinearImpl>()->bias.zero_();
    net[1]->as<torch::nn::LinearImpl>()->weight.fill_(0.5);
    return net;
  };
  // `core`: the sharded net's (stage 3: whole under its guard, collective).
  auto state_of = [](torch::nn::Sequential& net, const std::shared_ptr<amp::parallel::detail::DistributedCore>& core = nullptr) {
    amp::parallel::GatheredParametersGuard whole(core);
    std::vector<torch::Tensor> out;
    for (const auto& item : amp::detail::fp32_state(*net)) out.push_back(item.second.clone());  // collective if sharded
    for (const auto& p : net->parameters()) out.push_back(p.detach().clone());
    return out;
  };
  for (const auto masters : {amp::MasterWeights::kCopy, amp::MasterWeights::kSplit}) {
    const std::string label = std::string("auto_fp32 O2 bf16 ") + amp::to_string(masters) + " masters, stage " +
                              std::to_string(stage);
    const amp::Options options = amp::Options("O2")
                                     .low_precision_dtype(torch::kBFloat16)
                                     .init_scale(1.0)
                                     .auto_fp32(2)
                                     .master_weights_format(masters)
                                     .verbosity(0);
    auto adamw = [](torch::nn::Sequential& net) {
      return amp::optim::FusedAdamW(net->parameters(), torch::optim::AdamWOptions(1e-3));
    };
    const int n = group.world_size();
    auto ref_net = make_net(), net = make_net(), reordered_net = make_net();
    auto [ref_model, ref_optimizer] = amp::initialize(ref_net, adamw(ref_net), options);
    auto [model, optimizer] = amp::initialize(net, adamw(net), options);
    auto [reordered_model, reordered_optimizer] = amp::initialize(reordered_net, adamw(reordered_net), options);
    auto ref_ddp = amp::parallel::make_distributed(ref_model, group, wire_for(n));
    auto ddp = amp::parallel::make_distributed(model, group, wire_for(n));
    auto reordered_ddp =
        amp::parallel::make_distributed(reordered_model, group, wire_for(n).bucket_cap_mb(0.0001).delay_allreduce(true));
    amp::parallel::shard_optimizer(ddp, optimizer, amp::parallel::ZeroOptions().stage(stage));
    auto train = [&](auto& o, auto& d, int step) {
      torch::manual_seed(9000 + step * 2 + group.rank());
      const bool huge = step >= 3 && step < 6;  // 40 x 3e38 overflows any dtype; 0 x 3e38 does not
      const torch::Tensor x = !huge ? torch::rand({8, 4}) : group.rank() == 1 ? torch::full({8, 4}, 10.0) + torch::rand({8, 4})
                                                                           : torch::zeros({8, 4});
      o.zero_grad();
      amp::scale_loss(d(x).pow(2).mean() * 1e-3, o).backward();
      o.step();
    };
    double worst = 0, spread = 0;
    for (int step = 0; step < 9; ++step) {
      if (step == 3 || step == 6) {
        amp::parallel::GatheredParametersGuard whole(ddp);  // stage 3: the writes reach the shards when it ends
        torch::NoGradGuard no_grad;  // in place, the same on every rank
        for (auto* m : {&ref_net, &net, &reordered_net}) (*m)[1]->as<torch::nn::LinearImpl>()->weight.fill_(step == 3 ? 3e38 : 0.5);
      }
      train(ref_optimizer, ref_ddp, step);
      train(optimizer, ddp, step);
      train(reordered_optimizer, reordered_ddp, step);
      const auto a = state_of(net, ddp.core()), b = state_of(ref_net);
      worst = std::max(worst, equal_bits(a, b) ? 0.0 : std::max(relative_diff(a, b), 1e-300));
      spread = std::max(spread, relative_diff(state_of(reordered_net), b));
    }
    const double bound = n == 2 ? 0.0 : std::max(2 * spread, 1e-6);
    const auto moved = amp::fp32_modules(optimizer);
    report(moved == std::vector<std::string>{"1 (auto_fp32)"} && amp::fp32_modules(ref_optimizer) == moved,
           label + ": the sharded optimizer moved the module rank 1 found", moved.empty() ? "none" : moved.front());
    report(optimizer.skipped_steps() == 3 && ref_optimizer.skipped_steps() == 3, label + ": 3 steps skipped",
           std::to_string(optimizer.skipped_steps()));
    report(worst <= bound, label + ": the sharded run equals the unsharded one after every step (bit for bit on 2 ranks)",
           "worst relative " + str(worst) + ", the unsharded run reordered " + str(spread));
    report(same_on_all_ranks(group, state_of(net, ddp.core())), label + ": every rank's replica is identical");
    if (stage == 3) {
      bool freed = true;
      for (const auto& p : net->parameters()) freed = freed && p.storage().nbytes() == 0;
      report(freed, label + ": between steps every parameter, the moved module's too, holds no memory");
    }

    // The archives hold the decision: a fresh sharded optimizer repeats the move while it loads the consolidated
    // archive or this rank's own.
    const std::string path = dir + "/zero_auto_fp32_" + std::to_string(stage) + ".pt";
    const std::string own = path + ".rank" + std::to_string(group.rank());
    amp::parallel::save_consolidated(optimizer, path);
    torch::save(optimizer, own);
    {
      amp::parallel::GatheredParametersGuard whole(ddp);  // stage 3: collective
      if (group.rank() == 0) torch::save(net, path + ".model");
    }
    group.barrier();
    auto resumed_net = make_net(), own_net = make_net();
    auto [resumed_model, resumed] = amp::initialize(resumed_net, adamw(resumed_net), options);
    auto [own_model, own_optimizer] = amp::initialize(own_net, adamw(own_net), options);
    auto resumed_ddp = amp::parallel::make_distributed(resumed_model, group, wire_for(n));
    auto own_ddp = amp::parallel::make_distributed(own_model, group, wire_for(n));
    amp::parallel::shard_optimizer(resumed_ddp, resumed, amp::parallel::ZeroOptions().stage(stage));
    amp::parallel::shard_optimizer(own_ddp, own_optimizer, amp::parallel::ZeroOptions().stage(stage));
    torch::load(resumed, path);
    torch::load(own_optimizer, own);
    {
      amp::parallel::GatheredParametersGuard whole_resumed(resumed_ddp), whole_own(own_ddp);  // stage 3: collective
      torch::load(resumed_net, path + ".model");
      torch::load(own_net, path + ".model");
    }
    const bool moved_again = amp::fp32_modules(resumed) == moved && amp::fp32_modules(own_optimizer) == moved;
    double resumed_worst = 0;
    for (int step = 9; step < 12; ++step) {
      train(optimizer, ddp, step);
      train(resumed, resumed_ddp, step);
      train(own_optimizer, own_ddp, step);
      const auto b = state_of(net, ddp.core());  // the sharded run that did not stop
      for (const auto& [other, core] : {std::make_pair(&resumed_net, resumed_ddp.core()), std::make_pair(&own_net, own_ddp.core())}) {
        const auto a = state_of(*other, core);
        resumed_worst = std::max(resumed_worst, equal_bits(a, b) ? 0.0 : std::max(relative_diff(a, b), 1e-300));
      }
    }
    report(moved_again && resumed_worst == 0, label + ": the consolidated archive and a rank's own resume a sharded run "
           "bit for bit (the module moved again)", "worst relative " + str(resumed_worst));
  }
}

// NOTE [A step that never waits] under ZeRO: the ranks agree on the overflow flag with a collective (stage 2's
// reduce-scatter leaves each rank its own slices to check; stage 1's all-reduced gradients are every rank's), and the
// sharded fused step takes the flag as an unsharded one does. A run whose host learns every outcome late
// (DeferredHostReadsGuard) on ATen's route (a device's) equals the run on the host's path bit for bit, skips, loss
// scale and the generators' counters included, and reads nothing on the host while it trains; with bf16 and 8-bit
// moments and the lean master formats too (NOTE [Stored moments on the device], NOTE [Lean masters on the device]).
void sync_free(const ProcessGroup& group, int stage) {
  const int n = group.world_size();
  const int64_t local_rows = kGlobal / n;
  struct Case {
    const char* label;
    amp::OptimizerStateFormat format;
    amp::MasterWeights master;
    bool sgd = false;  // FusedSGD with dampening, its first step overflowing (else FusedAdamW)
  };
  for (const Case& c : {Case{"fp32 moments", amp::OptimizerStateFormat::kFp32, amp::MasterWeights::kCopy},
                        Case{"bf16 moments, stochastic rounding masters", amp::OptimizerStateFormat::kBf16,
                             amp::MasterWeights::kStochasticRounding},
                        Case{"8bit moments, split masters", amp::OptimizerStateFormat::k8Bit, amp::MasterWeights::kSplit},
                        Case{"dampening, the first step overflowing", amp::OptimizerStateFormat::kFp32,
                             amp::MasterWeights::kCopy, true}}) {
    const std::string label =
        std::string(c.sgd ? "O2 bf16 FusedSGD, " : "O2 bf16 FusedAdamW, ") + c.label + ", stage " + std::to_string(stage);
    const int64_t skips = c.sgd ? 4 : 3;
    struct Outcome {
      std::vector<torch::Tensor> params;
      double loss_scale = 0;
      int64_t skipped = 0, syncs = -1;
      std::vector<torch::Tensor> resumed;  // two more steps after a torch::save / torch::load taken on that path
    };
    auto make_net = [] {
      torch::manual_seed(21);
      return torch::nn::Sequential(torch::nn::Linear(12, 512), torch::nn::ReLU(), torch::nn::Linear(512, 16),
                                   torch::nn::ReLU(), torch::nn::Linear(16, 5));  // 6144 and 8192: 8-bit blocks
    };
    const amp::Options options = amp::Options("O2").low_precision_dtype(torch::kBFloat16).optimizer_state_format(c.format)
                                     .master_weights_format(c.master).growth_interval(2).verbosity(0);
    const amp::parallel::ZeroOptions zero = amp::parallel::ZeroOptions().stage(stage).bucket_cap_mb(0.001);
    auto run = [&](bool device_path, auto optimizer_of) {
      const amp::optim::detail::FusedRouteGuard route(amp::optim::detail::FusedRoute::kAten);  // both: the same kernels
      auto net = make_net();
      auto [model, optimizer] = amp::initialize(net, optimizer_of(net), options);
      auto ddp = amp::parallel::make_distributed(model, group, wire_for(n));
      amp::parallel::shard_optimizer(ddp, optimizer, zero);
      std::optional<amp::detail::DeferredHostReadsGuard> deferred;
      if (device_path) deferred.emplace();
      for (int step = 0; step < 7; ++step) {
        const Batch local = rows(global_batch(step, kGlobal), group.rank() * local_rows, local_rows);
        // An inf on rank 1's batch alone at steps 2 and 3 (in a row), and rank 0's at step 5.
        const bool inf = (group.rank() == 1 && (step == 2 || step == 3 || (c.sgd && step == 0))) ||
                         (group.rank() == 0 && step == 5);
        optimizer.zero_grad();
        {
          auto scaled = amp::scale_loss(loss_of(ddp(local.x), local.y, inf ? 1 : -1), optimizer);
          scaled.backward();
        }
        optimizer.step();
      }
      if (device_path) {
        const std::string refused = message_of([&] { amp::GraphCaptureGuard capture(optimizer); });
        report(refused.find("is sharded by amp::parallel::shard_optimizer (ZeRO), whose step's reduce-scatters and "
                            "all-gathers amp does not capture") != std::string::npos,
               label + ": GraphCaptureGuard refuses it, naming the fix", refused);
      }
      Outcome out;
      out.syncs = amp::host_sync_count(optimizer);
      std::stringstream model_bytes, optimizer_bytes;  // what the device kept: step counts, generators
      {
        amp::parallel::GatheredParametersGuard whole(ddp);  // stage 3: collective
        torch::save(net, model_bytes);
      }
      torch::save(optimizer, optimizer_bytes);
      deferred.reset();
      out.params = whole_params(ddp, net);
      out.loss_scale = amp::loss_scale(optimizer);
      out.skipped = optimizer.skipped_steps();
      auto fresh = make_net();
      auto [fresh_model, fresh_optimizer] = amp::initialize(fresh, optimizer_of(fresh), options);
      torch::load(fresh, model_bytes);
      auto fresh_ddp = amp::parallel::make_distributed(fresh_model, group, wire_for(n));
      amp::parallel::shard_optimizer(fresh_ddp, fresh_optimizer, zero);
      torch::load(fresh_optimizer, optimizer_bytes);
      train_steps(group, fresh_ddp, fresh_optimizer, 7, 9);
      out.resumed = whole_params(fresh_ddp, fresh);
      return out;
    };
    // FusedSGD with dampening: NOTE [A first momentum buffer on the device] (the kernel runs both ways until the host
    // learns which step was a buffer's first).
    auto sgd_of = [](torch::nn::Sequential& net) {
      return amp::optim::FusedSGD(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9).dampening(0.25));
    };
    auto adamw = [](torch::nn::Sequential& net) { return adamw_of(net); };
    const Outcome host = c.sgd ? run(false, sgd_of) : run(false, adamw);
    const Outcome device = c.sgd ? run(true, sgd_of) : run(true, adamw);
    report(equal_bits(device.params, host.params), label + ": the device's path equals the host's bit for bit");
    report(device.skipped == skips && host.skipped == skips && device.loss_scale == host.loss_scale,
           label + ": the same " + std::to_string(skips) + " skips and loss scale",
           "skipped " + std::to_string(device.skipped) + " vs " + std::to_string(host.skipped) + ", scale " +
               str(device.loss_scale) + " vs " + str(host.loss_scale));
    report(device.syncs == 0, label + ": no host sync while training on the device's path",
           std::to_string(device.syncs) + " counted");
    report(equal_bits(device.resumed, host.resumed), label + ": resuming from a checkpoint taken on either path, bit for bit");
    report(same_on_all_ranks(group, device.params), label + ": every rank's replica is identical");
  }
}

}  // namespace

void scenario_zero(const ProcessGroup& group) {
  const char* dir_env = std::getenv("AMP_ZERO_DIR");
  const std::string dir = dir_env ? dir_env : "/tmp";
  std::vector<Config> configs = {
      {"O0 FusedAdam", amp::Options("O0").verbosity(0), 3},
      {"O1 LibTorch Adam", amp::Options("O1").low_precision_dtype(torch::kBFloat16).verbosity(0), 2},
      {"O2 bf16 FusedAdamW", amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0), 0, true},
      {"O3 bf16 FusedSGD", amp::Options("O3").low_precision_dtype(torch::kBFloat16).verbosity(0), 1},
      {"O2 bf16 FusedLAMB", amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0), 4},
      {"O0 FusedLAMB", amp::Options("O0").verbosity(0), 4},
  };
  if (amp::detail::fp8_supported_by_build()) {  // the 32 x 32 Linear in FP8, its amaxes agreed over the ranks
    configs.push_back({"O2 bf16 FP8 delayed FusedAdamW",
                       amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0).fp8(
                           amp::Fp8Options().scaling(amp::Fp8Options::Scaling::kDelayed).amax_history_len(4)),
                       0});
    // The recipes that scale slices and blocks (no amax history to agree on): the GEMMs change, the sharding doesn't.
    for (const auto scaling : {amp::Fp8Options::Scaling::kRowwise, amp::Fp8Options::Scaling::kMxfp8}) {
      configs.push_back({std::string("O2 bf16 FP8 ") + amp::to_string(scaling) + " FusedAdamW",
                         amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0).fp8(
                             amp::Fp8Options().scaling(scaling)),
                         0});
    }
  }
#if TORCH_VERSION_MAJOR >= 2  // LibTorch 1.13 has no fp16 GEMM on the CPU
  configs.push_back({"O2 fp16 FusedSGD", amp::Options("O2").low_precision_dtype(torch::kHalf).verbosity(0), 1});
#endif
  for (int stage : {1, 2}) {
    for (const auto& config : configs) train_side_by_side(group, config, stage);
    checkpoints(group, stage, dir);
    accumulation(group, stage);
    two_optimizers(group, stage);
    muon(group, stage, dir);
    python_checkpoints(group, stage, dir);
    torchscript(group, stage);
    state_formats(group, stage, dir);
    lean_masters(group, stage, dir);
    auto_fp32(group, stage, dir);
  }
  overlap(group);
  misuse(group);
}

// Stage 3 (NOTE [Stage 3 units]): the side-by-side runs of stage 1 and 2 with the parameters sharded too, then what
// only stage 3 has (zero_stage3_scenarios.cpp).
void scenario_zero_stage3(const ProcessGroup& group) {
  const std::vector<Config> configs = {
      {"O0 FusedAdam", amp::Options("O0").verbosity(0), 3},
      {"O1 LibTorch Adam", amp::Options("O1").low_precision_dtype(torch::kBFloat16).verbosity(0), 2},
      {"O2 bf16 FusedAdamW", amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0), 0, true},
      {"O3 bf16 FusedSGD", amp::Options("O3").low_precision_dtype(torch::kBFloat16).verbosity(0), 1},
      {"O2 bf16 FusedLAMB", amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0), 4},
  };
  std::vector<Config> all = configs;
  if (amp::detail::fp8_supported_by_build()) {  // FP8 GEMMs on gathered weights; delayed scaling's amaxes agreed
    all.push_back({"O2 bf16 FP8 delayed FusedAdamW",
                   amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0).fp8(
                       amp::Fp8Options().scaling(amp::Fp8Options::Scaling::kDelayed).amax_history_len(4)),
                   0});
    all.push_back({"O2 bf16 FP8 mxfp8 FusedAdamW",
                   amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0).fp8(
                       amp::Fp8Options().scaling(amp::Fp8Options::Scaling::kMxfp8)),
                   0});
  }
#if TORCH_VERSION_MAJOR >= 2  // LibTorch 1.13 has no fp16 GEMM on the CPU
  all.push_back({"O2 fp16 FusedSGD", amp::Options("O2").low_precision_dtype(torch::kHalf).verbosity(0), 1});
#endif
  for (const auto& config : all) train_side_by_side(group, config, 3);
  const char* dir_env = std::getenv("AMP_ZERO_DIR");
  const std::string dir = dir_env ? dir_env : "/tmp";
  checkpoints(group, 3, dir);
  accumulation(group, 3);
  two_optimizers(group, 3);
  torchscript(group, 3);
  python_checkpoints(group, 3, dir);
  state_formats(group, 3, dir);
  muon(group, 3, dir);
  if (group.world_size() == 2) lean_masters(group, 3, dir);  // (4 ranks: as 2, with what stage 2 checks on 4)
  auto_fp32(group, 3, dir);
}

void scenario_zero_sync_free(const ProcessGroup& group) {
  if (!amp::optim::detail::has_aten_fused_optimizers()) {  // per op, a fused step reads the flag (docs/cuda.md)
    std::cout << "[rank " << group.rank() << "] skipped: this LibTorch has no ATen fused optimizer kernels\n";
    return;
  }
  for (int stage : {1, 2, 3}) sync_free(group, stage);
}

}  // namespace amp_worker

namespace amp_worker {

// The byte table and step times of docs/distributed.md (bench/zero.sh runs it on 4 ranks): O2 bf16 FusedAdam on a
// 1.6M-parameter MLP, what each rank holds after backward (amp::state_bytes), the median step time and the bytes each
// step communicates, unsharded and at stages 1 and 2, side by side in one run.
void scenario_zero_bench(const ProcessGroup& group) {
  const int n = group.world_size();
  const int64_t rows_per_rank = 32;
  auto make_net = [] {
    torch::manual_seed(3);
    return torch::nn::Sequential(torch::nn::Linear(512, 1024), torch::nn::ReLU(), torch::nn::Linear(1024, 1024),
                                 torch::nn::ReLU(), torch::nn::Linear(1024, 10));
  };
  struct Row {
    std::string label;
    amp::StateBytes bytes;
    double ms = 0;
    int64_t comm = 0;
  };
  std::vector<Row> rows_out;
  int64_t num_params = 0;
  // Rows 4 and 5 keep Adam's moments in 8 bits (optimizer_state_format 8bit), unsharded and at stage 2; rows 6 and 7
  // also keep no fp32 masters (master_weights_format split: the bf16 weight and its low 16 bits); row 8 is row 3
  // reduce-scattering after backward instead of during it (ZeroOptions::overlap(false)); rows 9-12 are stage 3 (the
  // parameters sharded too: each Linear a unit), with fp32 and 8-bit moments, after backward, and without prefetch;
  // row 13 is stage 3 with 8-bit moments and split masters (the leanest: 2 + 2 + 2 bytes a parameter, all sharded).
  struct Run {
    int stage;
    amp::OptimizerStateFormat format;
    amp::MasterWeights masters;
    bool overlap = true;
    int prefetch = 1;
  };
  const std::vector<Run> runs = {{0, amp::OptimizerStateFormat::kFp32, amp::MasterWeights::kCopy},
                                 {1, amp::OptimizerStateFormat::kFp32, amp::MasterWeights::kCopy},
                                 {2, amp::OptimizerStateFormat::kFp32, amp::MasterWeights::kCopy},
                                 {0, amp::OptimizerStateFormat::k8Bit, amp::MasterWeights::kCopy},
                                 {2, amp::OptimizerStateFormat::k8Bit, amp::MasterWeights::kCopy},
                                 {0, amp::OptimizerStateFormat::k8Bit, amp::MasterWeights::kSplit},
                                 {2, amp::OptimizerStateFormat::k8Bit, amp::MasterWeights::kSplit},
                                 {2, amp::OptimizerStateFormat::kFp32, amp::MasterWeights::kCopy, false},
                                 {3, amp::OptimizerStateFormat::kFp32, amp::MasterWeights::kCopy},
                                 {3, amp::OptimizerStateFormat::k8Bit, amp::MasterWeights::kCopy},
                                 {3, amp::OptimizerStateFormat::kFp32, amp::MasterWeights::kCopy, false},
                                 {3, amp::OptimizerStateFormat::kFp32, amp::MasterWeights::kCopy, true, 0},
                                 {3, amp::OptimizerStateFormat::k8Bit, amp::MasterWeights::kSplit}};
  for (const auto& [stage, format, masters, overlap, prefetch] : runs) {
    auto net = make_net();
    num_params = 0;
    for (const auto& p : net->parameters()) num_params += p.numel();
    auto [model, optimizer] = amp::initialize(
        net, amp::optim::FusedAdam(net->parameters(), torch::optim::AdamOptions(1e-4)),
        amp::Options("O2")
            .low_precision_dtype(torch::kBFloat16)
            .optimizer_state_format(format)
            .master_weights_format(masters)
            .verbosity(0));
    auto ddp = amp::parallel::make_distributed(model, group);
    amp::parallel::ZeroOptions zero = amp::parallel::ZeroOptions().stage(stage).overlap(overlap);
    if (stage == 3) zero.prefetch(prefetch);
    if (stage > 0) amp::parallel::shard_optimizer(ddp, optimizer, zero);
    Row row{(stage == 0 ? std::string("unsharded") : "stage " + std::to_string(stage)) +
            (format == amp::OptimizerStateFormat::k8Bit ? ", 8-bit moments" : "") +
            (masters == amp::MasterWeights::kSplit ? ", split masters" : "") +
            (stage >= 2 && !overlap ? ", reduce-scatter after backward" : "") +
            (stage == 3 && prefetch == 0 ? ", no prefetch" : "")};
    std::vector<double> times;
    amp::parallel::CommunicationStats before{};
    for (int step = 0; step < 9; ++step) {
      torch::manual_seed(100 + step * n + group.rank());
      const torch::Tensor x = torch::randn({rows_per_rank, 512});
      const torch::Tensor y = torch::randint(0, 10, {rows_per_rank});
      if (step == 3) before = ddp.communication_stats();
      const auto start = std::chrono::steady_clock::now();
      optimizer.zero_grad();
      {
        auto scaled = amp::scale_loss(torch::nn::functional::cross_entropy(ddp(x), y), optimizer);
        scaled.backward();
      }
      if (step == 2) row.bytes = amp::state_bytes(optimizer);
      optimizer.step();
      times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
    }
    const auto after = ddp.communication_stats();
    row.comm = (after.allreduce_bytes - before.allreduce_bytes) * 2 + (after.reduce_scatter_bytes - before.reduce_scatter_bytes) +
               (after.allgather_bytes - before.allgather_bytes);
    row.comm /= 6;  // per step, counted as a ring moves it: an all-reduce twice its size (reduce-scatter + all-gather)
    std::sort(times.begin() + 1, times.end());
    row.ms = times[1 + (times.size() - 1) / 2];
    rows_out.push_back(row);
  }
  if (group.rank() != 0) return;
  auto per = [&](int64_t b) { return static_cast<double>(b) / static_cast<double>(num_params); };
  std::cout << "ZeRO bench: " << n << " Gloo ranks, O2 bf16 FusedAdam, " << num_params << " parameters, "
            << rows_per_rank << " rows per rank, bytes per parameter on rank 0 after backward (amp::state_bytes)\n";
  std::cout << "| run | params | grads | masters | master grads | optimizer state | total B/param | step ms (median of 8) | "
               "step time vs unsharded | bytes/step on the wire (x (N-1)/N per rank) |\n|---|---|---|---|---|---|---|---|---|---|\n";
  for (const auto& r : rows_out) {
    std::ostringstream line;
    line << std::fixed << std::setprecision(2) << "| " << r.label << " | " << per(r.bytes.params) << " | "
         << per(r.bytes.grads) << " | " << per(r.bytes.masters) << " | " << per(r.bytes.master_grads) << " | "
         << per(r.bytes.optimizer_state) << " | " << per(r.bytes.total()) << " | " << r.ms << " | "
         << r.ms / rows_out.front().ms << " | " << r.comm << " |";
    std::cout << line.str() << "\n";
  }
  std::cout << std::flush;
  report(rows_out[1].bytes.total() < rows_out[0].bytes.total() && rows_out[2].bytes.total() < rows_out[1].bytes.total(),
         "each ZeRO stage holds less than the one before");
  report(rows_out[4].bytes.total() < rows_out[2].bytes.total() && rows_out[3].bytes.total() < rows_out[0].bytes.total(),
         "8-bit moments hold less than fp32 ones, sharded or not");
  report(rows_out[6].bytes.total() < rows_out[5].bytes.total() && rows_out[6].bytes.total() < rows_out[4].bytes.total(),
         "split masters with 8-bit moments at stage 2 hold less than unsharded and than fp32 masters at stage 2");
  report(rows_out[8].bytes.total() < rows_out[2].bytes.total() && rows_out[9].bytes.total() < rows_out[4].bytes.total(),
         "stage 3 holds less than stage 2, with fp32 and with 8-bit moments");
  report(rows_out[12].bytes.total() < rows_out[9].bytes.total() && rows_out[12].bytes.total() < rows_out[6].bytes.total(),
         "split masters with 8-bit moments at stage 3 hold less than fp32 masters at stage 3 and than stage 2");
}

}  // namespace amp_worker

namespace amp_worker {

// amp's ZeRO at O0 against torch's DDP + ZeroRedundancyOptimizer(Adam) on Gloo, computed at test time by
// tests/python/zero.py (AMP_ZERO_DIR/reference.pt: initial weights, batches, torch's final weights).
void scenario_zero_python(const ProcessGroup& group) {
  const char* dir = std::getenv("AMP_ZERO_DIR");
  report(dir != nullptr, "AMP_ZERO_DIR names the Python reference's directory");
  if (!dir) return;
  const auto reference = amp::PythonCheckpoint::load(std::string(dir) + "/reference.pt");
  const auto xs = reference.get("x").toTensorVector(), ys = reference.get("y").toTensorVector();
  const double lr = reference.get("lr").toDouble();
  const int n = group.world_size();
  const int64_t rows_per_rank = xs.front().size(0) / n;
  auto torch_net = make_mlp(0);
  reference.load_model(*torch_net, "final");
  for (int stage : {1, 2}) {
    auto net = make_mlp(0);
    reference.load_model(*net, "model");
    auto [model, optimizer] = amp::initialize(net, torch::optim::Adam(net->parameters(), torch::optim::AdamOptions(lr)),
                                              amp::Options("O0").verbosity(0));
    auto ddp = amp::parallel::make_distributed(model, group);
    amp::parallel::shard_optimizer(ddp, optimizer, amp::parallel::ZeroOptions().stage(stage));
    for (size_t step = 0; step < xs.size(); ++step) {
      optimizer.zero_grad();
      const auto x = xs[step].narrow(0, group.rank() * rows_per_rank, rows_per_rank);
      const auto y = ys[step].narrow(0, group.rank() * rows_per_rank, rows_per_rank);
      {
        auto scaled = amp::scale_loss(torch::nn::functional::cross_entropy(ddp(x), y), optimizer);
        scaled.backward();
      }
      optimizer.step();
    }
    // torch's DDP divides before it sums, amp after: the gradients differ in the last bits, which Adam's normalized
    // update carries into the weights.
    const double d = relative_diff(params_of(net), params_of(torch_net));
    report(d <= 1e-6, "O0 stage " + std::to_string(stage) + ": the weights equal torch's DDP + ZeroRedundancyOptimizer's",
           "worst relative " + str(d));
  }
}

// amp's ZeRO at O2 bf16 with fp32 reductions against PyTorch's FSDP2 (MixedPrecisionPolicy param_dtype bf16,
// reduce_dtype fp32) on Gloo, computed at test time by tests/python/fsdp2.py (AMP_ZERO_DIR/fsdp2.pt). The same
// numerics: bf16 weights rounded from fp32 masters, bf16 gradients averaged in fp32, Adam on the fp32 shards.
// With LibTorch's Adam on both sides the masters equal FSDP2's bit for bit at stages 0 (no sharding), 1 and 2, and
// so do the losses; torch.optim.Adam lerps its first moment, which is what separates it (reported). ZeroTest runs it
// where Python's torch is this build's LibTorch.
void scenario_zero_fsdp2(const ProcessGroup& group) {
  const char* dir = std::getenv("AMP_ZERO_DIR");
  report(dir != nullptr, "AMP_ZERO_DIR names the Python reference's directory");
  if (!dir) return;
  const auto reference = amp::PythonCheckpoint::load(std::string(dir) + "/fsdp2.pt");
  const auto xs = reference.get("x").toTensorVector(), ys = reference.get("y").toTensorVector();
  const double lr = reference.get("lr").toDouble();
  const int64_t rows_per_rank = xs.front().size(0) / group.world_size();
  auto expected = [&](const std::string& optimizer) {
    auto net = make_mlp(0);
    reference.load_model(*net, optimizer + "_final");
    return params_of(net);
  };
  const auto fsdp2 = expected("libtorch_adam"), fsdp2_torch_adam = expected("torch_adam");
  std::vector<double> losses;
  const auto every_rank = reference.get("libtorch_adam_losses").toList();
  for (const auto& loss : every_rank.get(static_cast<size_t>(group.rank())).toList()) losses.push_back(loss.get().toDouble());
  for (int stage : {0, 1, 2, 3}) {
    auto net = make_mlp(0);
    reference.load_model(*net, "model");
    auto [model, optimizer] = amp::initialize(net, torch::optim::Adam(net->parameters(), torch::optim::AdamOptions(lr)),
                                              amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0));
    auto ddp = amp::parallel::make_distributed(
        model, group, amp::parallel::DistributedDataParallelOptions().allreduce_always_fp32(true));
    if (stage > 0) amp::parallel::shard_optimizer(ddp, optimizer, amp::parallel::ZeroOptions().stage(stage));
    bool same_losses = true;
    for (size_t step = 0; step < xs.size(); ++step) {
      optimizer.zero_grad();
      const auto x = xs[step].narrow(0, group.rank() * rows_per_rank, rows_per_rank);
      const auto y = ys[step].narrow(0, group.rank() * rows_per_rank, rows_per_rank);
      const torch::Tensor loss = torch::nn::functional::cross_entropy(ddp(x), y);
      const double l = loss.item<double>();
      same_losses = same_losses && l == losses[step];
      amp::scale_loss(loss, optimizer).backward();
      optimizer.step();
    }
    std::vector<torch::Tensor> masters;  // collective when sharded
    for (const auto& item : amp::detail::fp32_state(*net)) masters.push_back(item.second.clone());
    const std::string at = "O2 bf16 stage " + std::to_string(stage);
    report(same_losses, at + ": every loss is FSDP2's bit for bit");
    report(equal_bits(masters, fsdp2), at + ": the fp32 masters equal FSDP2's (LibTorch's Adam on both sides) bit for bit");
    std::cout << "[ measured ] " << at << ": against FSDP2 with torch.optim.Adam, worst relative "
              << relative_diff(masters, fsdp2_torch_adam) << std::endl;
  }
}

}  // namespace amp_worker

namespace amp_worker {

// A rank that dies mid-step under ZeRO stage 2: rank 1 exits after its backward (the reduce-scatter done), before the
// step's all-gather; rank 0's step fails with amp's error within the timeout.
void scenario_zero_dies(const ProcessGroup& group) {
  auto net = make_mlp(3);
  auto [model, optimizer] = amp::initialize(net, amp::optim::FusedAdam(net->parameters()),
                                            amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0));
  auto ddp = amp::parallel::make_distributed(model, group);
  amp::parallel::shard_optimizer(ddp, optimizer, amp::parallel::ZeroOptions().stage(2));
  const Batch b = rows(global_batch(0, kGlobal), group.rank() * 8, 8);
  std::string error;
  auto start = std::chrono::steady_clock::now();
  try {
    for (int step = 0; step < 3; ++step) {
      optimizer.zero_grad();
      {
        auto scaled = amp::scale_loss(loss_of(ddp(b.x), b.y), optimizer);
        scaled.backward();
      }
      if (step == 1 && group.rank() == 1) {
        std::cout << "[rank 1] exiting on purpose before the second step's all-gather" << std::endl;
        std::exit(3);
      }
      start = std::chrono::steady_clock::now();
      optimizer.step();
    }
  } catch (const std::exception& e) {
    error = amp::detail::message_of(e);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  report(error.find("amp::parallel::shard_optimizer") != std::string::npos &&
             error.find("another rank failed") != std::string::npos &&
             seconds < std::chrono::duration<double>(group.timeout()).count() + 5,
         "ZeRO: a rank that died mid-step fails the other's step with amp's error within the timeout",
         "after " + str(seconds) + " s: " + error.substr(0, 240));
}

}  // namespace amp_worker
