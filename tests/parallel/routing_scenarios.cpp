// The routing scenario, "unused": delay_allreduce with parameters only some ranks reach.

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>
#include <torch/version.h>

#include <optional>
#include <string>
#include <vector>

#include "amp/amp.h"
#include "scenarios.h"
#include "step_loop.h"
#include "worker_support.h"

namespace amp_worker {
namespace {

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
  const bool dynamic = setup.options.resolve().loss_scale.is_dynamic();
  RouterRun run;
  StepLoop loop;
  loop.steps = setup.steps;
  loop.accumulate = setup.routing == "accumulate";
  loop.batch = [&setup](int step) { return routed_batch(setup.routing, step); };
  // An inf in one sample of rank 1's batch at step 4 (dynamic loss scales): routed to b, which rank 0 didn't reach.
  loop.inf_row = [&setup, dynamic](int step) {
    return setup.routing == "mixed" && step == 4 && dynamic ? kRouterInfRow : int64_t{-1};
  };
  loop.after_backward = [&](int step) {
    if (setup.routing == "mixed" && step % 4 == 3 && net->b->weight.grad().defined()) run.b_grad_when_unused = true;
    if (net->c->weight.grad().defined() || net->c->bias.grad().defined()) run.c_grad_ever = true;
  };
  loop.state = [&model = model, &optimizer = optimizer] {
    std::vector<torch::Tensor> state = clones(model->parameters());
    for (auto& t : amp::master_params(optimizer)) state.push_back(t.detach());
    // Zeros where a parameter has none (yet): the same length on every rank.
    for (auto& t : momentum_of(optimizer, /*zeros_where_none=*/true)) state.push_back(t);
    state.push_back(torch::tensor({amp::loss_scale(optimizer), static_cast<double>(optimizer.skipped_steps())},
                                  torch::kDouble));
    return state;
  };
  run.equal_every_step = run_steps(loop, model, optimizer, ddp, group);
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

}  // namespace

void scenario_unused(const ProcessGroup& group) {
  const auto bf16 = amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0);
  const auto o0 = amp::Options("O0").verbosity(0);
  // Each routing at O0 and at O2 bf16. Tolerances as in scenario_train: O0 summation order only, O2 bf16 a few bf16
  // ulps of each rank's gradient.
  struct Routing {
    const char* routing;
    int steps;
    const char* label;  // after "delay_allreduce O0" or "delay_allreduce O2 bf16"
  };
  RouterSetup mixed, mixed2;
  for (const Routing& r : {Routing{"ab", 3, ", rank 0 routes to a, rank 1 to b"},
                           Routing{"accumulate", 4, " no_sync accumulation, a reached on one rank inside no_sync only"},
                           Routing{"mixed", 8, ", heads unused on one rank or on all"}}) {
    for (const bool low_precision : {false, true}) {
      RouterSetup setup;
      setup.label = std::string("delay_allreduce ") + (low_precision ? "O2 bf16" : "O0") + r.label;
      setup.options = low_precision ? bf16 : o0;
      setup.routing = r.routing;
      setup.steps = r.steps;
      compare_router(setup, group, low_precision ? 2e-2 : 1e-5);
      if (setup.routing == "mixed") (low_precision ? mixed2 : mixed) = setup;
    }
  }
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

}  // namespace amp_worker
