// What real scripts do to a ZeRO-sharded optimizer after shard_optimizer, on 2 ranks, each against the unsharded run
// doing the same (bitwise): a param group appended for progressive unfreezing, learning rates changed between
// steps, and micro-batches accumulated under no_sync() with delay_unscale (summed in fp32, as unsharded); and the
// changes a fixed layout can't follow (a group removed, a group's tensors replaced), refused on every rank.

#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/adam.h>

#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "amp/amp.h"
#include "scenarios.h"
#include "worker_support.h"

namespace amp_worker {
namespace {

std::vector<torch::Tensor> parameters_of(torch::nn::Sequential& net) { return clones(net->parameters()); }

// The same through ddp: collective at ZeRO stage 3 (the parameters live in the shards between uses).
template <class Ddp>
std::vector<torch::Tensor> whole_parameters_of(Ddp& ddp, torch::nn::Sequential& net) {
  amp::parallel::GatheredParametersGuard whole(ddp);
  return parameters_of(net);
}

// The first two Linear layers' parameters: what the optimizer trains before the last layer is unfrozen.
std::vector<torch::Tensor> first_layers(torch::nn::Sequential& net) {
  std::vector<torch::Tensor> out;
  for (const auto& item : net->named_parameters()) {
    if (item.key()[0] != '4') out.push_back(item.value());
  }
  return out;
}

std::vector<torch::Tensor> last_layer(torch::nn::Sequential& net) { return net[4]->parameters(); }

// One data-parallel step on this rank's rows.
template <class Ddp, class Optimizer>
void train_step(Ddp& ddp, Optimizer& optimizer, const Batch& local) {
  optimizer.zero_grad();
  {
    auto scaled = amp::scale_loss(loss_of(ddp(local.x), local.y), optimizer);
    scaled.backward();
  }
  optimizer.step();
}

struct UnfreezeCase {
  std::string label;
  amp::Options options;
  int optimizer;  // 0 FusedAdam, 1 FusedAdamW, 2 FusedSGD momentum, 3 LibTorch's Adam
};

template <class Body>
void with_unfreeze_optimizer(int kind, torch::nn::Sequential& net, Body body) {
  switch (kind) {
    case 0: return body(amp::optim::FusedAdam(first_layers(net), torch::optim::AdamOptions(1e-2)));
    case 1: return body(amp::optim::FusedAdamW(first_layers(net), torch::optim::AdamWOptions(1e-2).weight_decay(0.01)));
    case 2: return body(amp::optim::FusedSGD(first_layers(net), torch::optim::SGDOptions(0.05).momentum(0.9)));
    default: return body(torch::optim::Adam(first_layers(net), torch::optim::AdamOptions(1e-2)));
  }
}

// The group added later gets options of its own (a smaller lr), as progressive unfreezing does.
std::unique_ptr<torch::optim::OptimizerOptions> added_options(int kind) {
  switch (kind) {
    case 0:
    case 3: return std::make_unique<torch::optim::AdamOptions>(torch::optim::AdamOptions(3e-3));
    case 1: return std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(3e-3).weight_decay(0.01));
    default: return std::make_unique<torch::optim::SGDOptions>(torch::optim::SGDOptions(0.02).momentum(0.9));
  }
}

// Progressive unfreezing under ZeRO: 3 steps on the first two layers, then add_param_group(last layer) and 4 more
// steps, the first group's lr halved after step 5 (a schedule). The appended group is sharded and stepped from its
// first step, bitwise the unsharded run's (it used to keep an empty list of pieces: never stepped, no error).
void unfreeze(const ProcessGroup& group, const UnfreezeCase& c, int stage, const std::string& dir) {
  const int n = group.world_size();
  const int64_t local_rows = kGlobal / n;
  const std::string label = c.label + " stage " + std::to_string(stage);
  auto ref_net = make_mlp(61), net = make_mlp(61);
  with_unfreeze_optimizer(c.optimizer, ref_net, [&](auto ref_opt) {
    with_unfreeze_optimizer(c.optimizer, net, [&](auto opt) {
      torch::manual_seed(71);  // stochastic rounding's seed: the two runs round alike
      auto [ref_model, ref_optimizer] = amp::initialize(ref_net, std::move(ref_opt), c.options);
      torch::manual_seed(71);
      auto [model, optimizer] = amp::initialize(net, std::move(opt), c.options);
      auto ref_ddp = amp::parallel::make_distributed(ref_model, group);
      auto ddp = amp::parallel::make_distributed(model, group);
      amp::parallel::shard_optimizer(ddp, optimizer, amp::parallel::ZeroOptions().stage(stage).bucket_cap_mb(0.001));
      bool same = true;
      std::vector<torch::Tensor> last_before;
      for (int step = 0; step < 7; ++step) {
        if (step == 3) {
          last_before = clones(last_layer(net));  // (not in the optimizer yet: whole at every stage)
          ref_optimizer.add_param_group(torch::optim::OptimizerParamGroup(last_layer(ref_net), added_options(c.optimizer)));
          optimizer.add_param_group(torch::optim::OptimizerParamGroup(last_layer(net), added_options(c.optimizer)));
        }
        if (step == 5) {
          for (auto* o : {static_cast<torch::optim::Optimizer*>(&ref_optimizer), static_cast<torch::optim::Optimizer*>(&optimizer)}) {
            auto& options = o->param_groups()[0].options();
            options.set_lr(options.get_lr() / 2);
          }
        }
        const Batch local = rows(global_batch(step, kGlobal), group.rank() * local_rows, local_rows);
        train_step(ref_ddp, ref_optimizer, local);
        train_step(ddp, optimizer, local);
        same = same && equal_bits(whole_parameters_of(ddp, net), parameters_of(ref_net));
      }
      report(same, label + ": a group added after shard_optimizer, and an lr changed, step as the unsharded run's, "
             "bit for bit after every step");
      std::vector<torch::Tensor> last_after;
      {
        amp::parallel::GatheredParametersGuard whole(ddp);
        last_after = clones(last_layer(net));
      }
      bool moved = true;
      for (size_t i = 0; i < last_after.size(); ++i) moved = moved && !torch::equal(last_after[i], last_before[i]);
      report(moved, label + ": the added group's parameters changed");
      report(same_on_all_ranks(group, whole_parameters_of(ddp, net)), label + ": every rank's replica is identical");
      // Resume after the unfreezing: the consolidated archive loads into a fresh unsharded optimizer with the same
      // groups (added before loading, as a resumed script adds them) and continues as the run that did not stop.
      const std::string path = dir + "/unfreeze_" + std::to_string(c.optimizer) + "_s" + std::to_string(stage) + ".pt";
      amp::parallel::save_consolidated(optimizer, path);
      {
        amp::parallel::GatheredParametersGuard whole(ddp);
        torch::save(net, path + ".model." + std::to_string(group.rank()));
      }
      auto resumed_net = make_mlp(62);
      with_unfreeze_optimizer(c.optimizer, resumed_net, [&](auto resumed_opt) {
        auto [resumed_model, resumed] = amp::initialize(resumed_net, std::move(resumed_opt), c.options);
        resumed.add_param_group(torch::optim::OptimizerParamGroup(last_layer(resumed_net), added_options(c.optimizer)));
        resumed.param_groups()[0].options().set_lr(ref_optimizer.param_groups()[0].options().get_lr());  // the schedule's
        torch::load(resumed_net, path + ".model." + std::to_string(group.rank()));
        torch::load(resumed, path);
        auto resumed_ddp = amp::parallel::make_distributed(resumed_model, group);
        bool continues = true;
        for (int step = 7; step < 9; ++step) {
          const Batch local = rows(global_batch(step, kGlobal), group.rank() * local_rows, local_rows);
          train_step(ref_ddp, ref_optimizer, local);
          train_step(resumed_ddp, resumed, local);
          continues = continues && equal_bits(parameters_of(resumed_net), parameters_of(ref_net));
        }
        report(continues, label + ": the consolidated archive after unfreezing resumes unsharded as the run that did "
               "not stop");
      });
    });
  });
}

// The changes a fixed layout can't follow are refused on every rank, before anything changes, naming the group and
// the fix; the optimizer keeps training afterwards once the change is undone.
void refused_changes(const ProcessGroup& group) {
  const amp::Options options = amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0);
  for (int stage : {1, 2}) {
    const std::string label = "stage " + std::to_string(stage);
    auto net = make_mlp(63);
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(std::vector<torch::Tensor>{net[0]->parameters()});
    groups.emplace_back(std::vector<torch::Tensor>{net[2]->parameters()});
    groups.emplace_back(std::vector<torch::Tensor>{net[4]->parameters()});
    auto [model, optimizer] = amp::initialize(net, amp::optim::FusedAdam(std::move(groups), torch::optim::AdamOptions(1e-2)),
                                              options);
    auto ddp = amp::parallel::make_distributed(model, group);
    amp::parallel::shard_optimizer(ddp, optimizer, amp::parallel::ZeroOptions().stage(stage));
    const Batch local = rows(global_batch(0, kGlobal), group.rank() * 8, 8);
    auto step = [&] {
      optimizer.zero_grad();
      {
        auto scaled = amp::scale_loss(loss_of(ddp(local.x), local.y), optimizer);
        scaled.backward();
      }
      optimizer.step();
    };
    step();
    // A group removed.
    auto removed = std::move(optimizer.param_groups().back());
    optimizer.param_groups().pop_back();
    std::string m = message_of(step);
    report(m.find("had 3 param groups when it was sharded and now has 2") != std::string::npos &&
               m.find("can't be removed") != std::string::npos,
           label + ": a param group removed after shard_optimizer is refused, naming the counts", m.substr(0, 300));
    optimizer.param_groups().push_back(std::move(removed));
    // A group's tensors replaced (one dropped).
    auto& params = optimizer.param_groups()[1].params();
    const torch::Tensor dropped = params.back();
    params.pop_back();
    m = message_of(step);
    report(m.find("param group 1 held 2 tensors when it was laid out and now holds 1") != std::string::npos &&
               m.find("add_param_group") != std::string::npos,
           label + ": a group's tensors changed after shard_optimizer are refused, naming the group", m.substr(0, 300));
    params.push_back(dropped);
    const auto before = parameters_of(net);
    step();  // undone: training goes on
    report(!equal_bits(before, parameters_of(net)), label + ": the optimizer steps again once the change is undone");
    report(same_on_all_ranks(group, parameters_of(net)), label + ": every rank's replica is identical after the refusals");
  }
}

// Gradient accumulation under no_sync() (two micro-batches kept scaled with delay_unscale, then a synchronized one) at
// O2 bf16 with a loss scale large enough that bf16 sums of the micro-batches would round: every stage sums them in
// fp32 (NOTE [fp32 accumulation under no_sync]) and gives the unsharded run's parameters bit for bit. Stage 2 used to
// sum them in the model's bf16 .grad.
void accumulate_in_fp32(const ProcessGroup& group) {
  const int n = group.world_size();
  const int64_t local_rows = kGlobal / n;
  for (int optimizer_kind : {0, 2}) {
    for (int stage : {1, 2}) {
      const std::string label = std::string(optimizer_kind == 0 ? "FusedAdam" : "FusedSGD") + " stage " + std::to_string(stage);
      const amp::Options options = amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0);
      auto ref_net = make_mlp(64), net = make_mlp(64);
      auto run = [&](torch::nn::Sequential& m, bool shard) {
        auto body = [&](auto opt) {
          auto [model, optimizer] = amp::initialize(m, std::move(opt), options);
          auto ddp = amp::parallel::make_distributed(model, group);
          if (shard) amp::parallel::shard_optimizer(ddp, optimizer, amp::parallel::ZeroOptions().stage(stage));
          for (int step = 0; step < 6; ++step) {
            optimizer.zero_grad();
            for (int micro = 0; micro < 3; ++micro) {
              const Batch local = rows(global_batch(step * 3 + micro, kGlobal), group.rank() * local_rows, local_rows);
              if (micro < 2) {
                auto guard = ddp.no_sync();
                auto scaled = amp::scale_loss(loss_of(ddp(local.x), local.y), optimizer,
                                              amp::ScaleLossOptions().delay_unscale(true));
                scaled.backward();
              } else {
                auto scaled = amp::scale_loss(loss_of(ddp(local.x), local.y), optimizer);
                scaled.backward();
              }
            }
            optimizer.step();
          }
          return amp::state_bytes(optimizer);
        };
        if (optimizer_kind == 0) return body(amp::optim::FusedAdam(m->parameters(), torch::optim::AdamOptions(1e-2)));
        return body(amp::optim::FusedSGD(m->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9)));
      };
      run(ref_net, false);
      run(net, true);
      report(equal_bits(parameters_of(net), parameters_of(ref_net)),
             label + ": no_sync() + delay_unscale micro-batches sum in fp32, bit for bit the unsharded run");
      report(same_on_all_ranks(group, parameters_of(net)), label + ": every rank's replica is identical");
    }
  }
}

}  // namespace

void scenario_zero_scripts(const ProcessGroup& group) {
  const char* dir_env = std::getenv("AMP_ZERO_DIR");
  const std::string dir = dir_env ? dir_env : "/tmp";
  const std::vector<UnfreezeCase> cases = {
      {"O0 FusedAdam", amp::Options("O0").verbosity(0), 0},
      {"O1 bf16 LibTorch Adam", amp::Options("O1").low_precision_dtype(torch::kBFloat16).verbosity(0), 3},
      {"O2 bf16 FusedAdamW", amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0), 1},
      {"O2 bf16 FusedSGD", amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0), 2},
      // The lean master formats: the re-indexed table's slices keep their aux, the added group's start from its own.
      {"O2 bf16 FusedAdamW split masters",
       amp::Options("O2").low_precision_dtype(torch::kBFloat16).master_weights_format(amp::MasterWeights::kSplit).verbosity(0), 1},
      {"O2 bf16 FusedSGD stochastic_rounding masters",
       amp::Options("O2").low_precision_dtype(torch::kBFloat16).master_weights_format(amp::MasterWeights::kStochasticRounding).verbosity(0),
       2},
  };
  accumulate_in_fp32(group);
  for (int stage : {1, 2, 3}) {
    for (const auto& c : cases) unfreeze(group, c, stage, dir);
  }
  refused_changes(group);
}

}  // namespace amp_worker
