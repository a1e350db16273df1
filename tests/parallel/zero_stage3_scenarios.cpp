// What only ZeRO stage 3 has, on 2 ranks, each against the unsharded run doing the same (bitwise): units (each direct
// child, patterns, nested modules), prefetch, a tied weight read outside its unit, a unit called twice, a parameter of
// the root, fp32 islands, evaluation, writes under GatheredParametersGuard, the all-gathered bytes against stage 2,
// and misuse (zero_scenarios.cpp runs the stage 1 and 2 side-by-side runs, archives and accumulation at stage 3).

#include <torch/nn/functional/linear.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <functional>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "amp/amp.h"
#include "scenarios.h"
#include "worker_support.h"

namespace amp_worker {
namespace {

// enc's weight is read again, transposed, by the root's own forward (a tied decoder), mid runs twice (its second run
// under activation checkpointing when `checkpointed`: recomputed in backward), and the decoder's bias belongs to the root.
struct TiedNetImpl : torch::nn::Module {
  explicit TiedNetImpl(uint64_t seed, bool checkpointed = false) : checkpointed(checkpointed) {
    torch::manual_seed(seed);
    enc = register_module("enc", torch::nn::Linear(12, 32));
    mid = register_module("mid", torch::nn::Sequential(torch::nn::Linear(32, 32), torch::nn::Tanh()));
    head = register_module("head", torch::nn::Linear(12, 5));
    dec_bias = register_parameter("dec_bias", torch::zeros({12}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor h = torch::relu(enc(x));
    h = mid->forward(h);
    h = checkpointed ? amp::checkpoint(mid, h) : mid->forward(h);
    const torch::Tensor r = torch::nn::functional::linear(h, enc->weight.t(), dec_bias);
    return head(torch::relu(r));
  }
  torch::nn::Linear enc{nullptr}, head{nullptr};
  torch::nn::Sequential mid{nullptr};
  torch::Tensor dec_bias;
  bool checkpointed = false;
};
TORCH_MODULE(TiedNet);

std::vector<torch::Tensor> params_of(TiedNet& net) { return clones(net->parameters()); }

template <class Ddp>
std::vector<torch::Tensor> whole_params(Ddp& ddp, TiedNet& net) {
  amp::parallel::GatheredParametersGuard whole(ddp);
  return params_of(net);
}

// The archive torch::save(net) writes, read back: collective, the parameters whole under the guard (an archive refers
// to the tensors until it is written).
template <class Ddp>
torch::serialize::InputArchive saved_whole(Ddp& ddp, torch::nn::Module& net) {
  std::ostringstream bytes;
  {
    amp::parallel::GatheredParametersGuard whole(ddp);
    torch::serialize::OutputArchive out;
    net.save(out);
    out.save_to(bytes);
  }
  std::istringstream in_bytes(bytes.str());
  torch::serialize::InputArchive in;
  in.load_from(in_bytes);
  return in;
}

amp::optim::FusedAdamW adamw_of(TiedNet& net) {
  return amp::optim::FusedAdamW(net->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
}

struct Variant {
  std::string label;
  amp::Options options;
  amp::parallel::ZeroOptions zero;
  bool overflow = true;  // an inf on one rank's batch at step 2 (a dynamic loss scale skips it)
  bool checkpointed = false;
};

// Trains the tied net sharded and unsharded side by side; bitwise after every step, also the losses, the loss scale
// and the evaluation outputs; the parameters hold no memory between steps.
void side_by_side(const ProcessGroup& group, const Variant& v) {
  const int64_t local_rows = kGlobal / group.world_size();
  TiedNet ref_net(7, v.checkpointed), net(7, v.checkpointed);
  auto [ref_model, ref_optimizer] = amp::initialize(ref_net, adamw_of(ref_net), v.options);
  auto [model, optimizer] = amp::initialize(net, adamw_of(net), v.options);
  auto ref_ddp = amp::parallel::make_distributed(ref_model, group);
  auto ddp = amp::parallel::make_distributed(model, group);
  amp::parallel::shard_optimizer(ddp, optimizer, v.zero);
  bool same = true, same_losses = true, same_scale = true, released = true;
  for (int step = 0; step < 5; ++step) {
    const Batch local = rows(global_batch(step, kGlobal), group.rank() * local_rows, local_rows);
    const int64_t inf_at = v.overflow && step == 2 && group.rank() == 1 ? 1 : -1;  // on one rank: every rank skips
    double losses[2];
    int k = 0;
    for (auto* run : {&ref_ddp, &ddp}) {
      auto& o = run == &ref_ddp ? ref_optimizer : optimizer;
      o.zero_grad();
      const torch::Tensor loss = loss_of((*run)(local.x), local.y, inf_at);
      losses[k++] = loss.item<double>();
      amp::scale_loss(loss, o).backward();
      (void)amp::clip_grad_norm_(o, 1.0);
      o.step();
    }
    for (const auto& p : net->parameters()) released = released && p.storage().nbytes() == 0;
    same = same && equal_bits(whole_params(ddp, net), params_of(ref_net));
    same_losses = same_losses && (losses[0] == losses[1] || (std::isnan(losses[0]) && std::isnan(losses[1])));
    same_scale = same_scale && optimizer.loss_scaler().loss_scale() == ref_optimizer.loss_scaler().loss_scale();
  }
  report(same, v.label + ": the parameters equal the unsharded run's bit for bit after every step");
  report(same_losses && same_scale && optimizer.skipped_steps() == ref_optimizer.skipped_steps(),
         v.label + ": the same losses, loss scale and skipped steps",
         "skipped " + std::to_string(optimizer.skipped_steps()) + " vs " + std::to_string(ref_optimizer.skipped_steps()));
  report(released, v.label + ": between steps the model's parameters hold no memory");
  {
    torch::NoGradGuard no_grad;
    ref_ddp.eval();
    ddp.eval();
    const Batch batch = global_batch(9, kGlobal);
    report(torch::equal(ddp(batch.x), ref_ddp(batch.x)), v.label + ": evaluation without gradients gives the same outputs");
    ddp.train();
    ref_ddp.train();
  }
  report(same_on_all_ranks(group, whole_params(ddp, net)), v.label + ": every rank's replica is identical");
}

// Writes under GatheredParametersGuard reach the shards: the masters follow the written weights, as unsharded.
void guarded_writes(const ProcessGroup& group) {
  const amp::Options options = amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0);
  const int64_t local_rows = kGlobal / group.world_size();
  TiedNet ref_net(8), net(8);
  auto [ref_model, ref_optimizer] = amp::initialize(ref_net, adamw_of(ref_net), options);
  auto [model, optimizer] = amp::initialize(net, adamw_of(net), options);
  auto ref_ddp = amp::parallel::make_distributed(ref_model, group);
  auto ddp = amp::parallel::make_distributed(model, group);
  amp::parallel::shard_optimizer(ddp, optimizer, amp::parallel::ZeroOptions().stage(3));
  auto step = [&](auto& d, auto& o, int i) {
    const Batch local = rows(global_batch(i, kGlobal), group.rank() * local_rows, local_rows);
    o.zero_grad();
    amp::scale_loss(loss_of(d(local.x), local.y), o).backward();
    o.step();
  };
  step(ref_ddp, ref_optimizer, 0);
  step(ddp, optimizer, 0);
  {
    torch::NoGradGuard no_grad;
    ref_net->head->weight.mul_(0.5);
    amp::parallel::GatheredParametersGuard whole(ddp);
    net->head->weight.mul_(0.5);
  }
  step(ref_ddp, ref_optimizer, 1);
  step(ddp, optimizer, 1);
  report(equal_bits(whole_params(ddp, net), params_of(ref_net)),
         "stage 3: a weight written under GatheredParametersGuard trains on as the unsharded run's");

  // Data replaced under the guard (set_data, as loaders that swap in loaded tensors do): each parameter is gathered
  // into and freed from its new storage from then on. Here the unsharded run's weights, edited.
  {
    torch::NoGradGuard no_grad;
    ref_net->enc->weight.mul_(0.25);
    amp::parallel::GatheredParametersGuard whole(ddp);
    net->enc->weight.set_data(ref_net->enc->weight.detach().clone());
  }
  const bool freed = net->enc->weight.storage().nbytes() == 0;
  step(ref_ddp, ref_optimizer, 2);
  step(ddp, optimizer, 2);
  report(freed && equal_bits(whole_params(ddp, net), params_of(ref_net)),
         "stage 3: a parameter whose data was replaced under GatheredParametersGuard is freed after it and trains on as "
         "the unsharded run's");
  // A view of a larger buffer can't be freed alone: refused at the next forward, named.
  {
    amp::parallel::GatheredParametersGuard whole(ddp);
    const int64_t n = net->head->weight.numel();
    net->head->weight.set_data(torch::zeros({2 * n}, torch::kBFloat16).narrow(0, n, n).view(net->head->weight.sizes()));
  }
  const std::string m = message_of([&] { step(ddp, optimizer, 3); });
  report(m.find("parameter 'head.weight' now holds 240 bytes at offset 60 for 120 bytes of values") != std::string::npos &&
             m.find("amp::load_weights") != std::string::npos,
         "stage 3: a parameter replaced by a view of a larger buffer is refused at the next forward, naming it and the fix", m);
}

// During backward, a unit whose gradients are on their way holds neither its parameters nor their full gradients:
// seen from a hook on the input's gradient, which runs after every unit's backward but enc's.
void backward_frees(const ProcessGroup& group) {
  const int64_t local_rows = kGlobal / group.world_size();
  TiedNet net(10);
  auto [model, optimizer] =
      amp::initialize(net, adamw_of(net), amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0));
  auto ddp = amp::parallel::make_distributed(model, group);
  amp::parallel::shard_optimizer(ddp, optimizer, amp::parallel::ZeroOptions().stage(3));
  const Batch local = rows(global_batch(0, kGlobal), group.rank() * local_rows, local_rows);
  const torch::Tensor x = local.x.clone().requires_grad_(true);
  int whole = -1, with_grad = -1;
  x.register_hook([&](const torch::Tensor&) {
    whole = with_grad = 0;
    for (const auto& item : net->named_parameters()) {
      if (item.key().rfind("enc.", 0) == 0) continue;
      whole += item.value().storage().nbytes() > 0 ? 1 : 0;
      with_grad += item.value().grad().defined() ? 1 : 0;
    }
  });
  optimizer.zero_grad();
  amp::scale_loss(loss_of(ddp(x), local.y), optimizer).backward();
  optimizer.step();
  report(whole == 0 && with_grad == 0, "stage 3: during backward, the units whose gradients are on their way hold "
         "neither parameters nor full gradients", std::to_string(whole) + " whole, " + std::to_string(with_grad) +
         " with a gradient, of mid's, head's and the root's parameters");
}

// A Linear that notes the all-gathered bytes so far when its forward starts (before its own op gathers it).
struct ProbedLinearImpl : torch::nn::Module {
  explicit ProbedLinearImpl(int64_t in, int64_t out) : linear(register_module("linear", torch::nn::Linear(in, out))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    if (seen) noted.push_back(seen());
    return linear(x);
  }
  torch::nn::Linear linear;
  std::function<int64_t()> seen;
  std::vector<int64_t> noted;
};
TORCH_MODULE(ProbedLinear);

// Prefetch: when a unit's forward starts, the units after it (in the last forward's order) are on their way already:
// with prefetch 0 only the units before it have been all-gathered, with 1 it too, with 2 the next one as well.
void prefetch_ahead(const ProcessGroup& group) {
  const amp::Options options = amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0);
  const int64_t local_rows = kGlobal / group.world_size();
  std::vector<int64_t> noted[3];  // per prefetch: the bytes all-gathered in the forward when each unit's forward starts
  for (int prefetch : {0, 1, 2}) {
    torch::manual_seed(4);
    torch::nn::Sequential net(ProbedLinear(12, 32), ProbedLinear(32, 32), ProbedLinear(32, 5));
    auto [model, optimizer] = amp::initialize(
        net, amp::optim::FusedAdamW(net->parameters(), torch::optim::AdamWOptions(1e-3)), options);
    auto ddp = amp::parallel::make_distributed(model, group);
    amp::parallel::shard_optimizer(ddp, optimizer, amp::parallel::ZeroOptions().stage(3).prefetch(prefetch));
    int64_t start = 0;
    for (size_t k = 0; k < 3; ++k) net[k]->as<ProbedLinearImpl>()->seen = [&] { return ddp.communication_stats().allgather_bytes - start; };
    for (int step = 0; step < 2; ++step) {  // the second forward prefetches in the first one's order
      const Batch local = rows(global_batch(step, kGlobal), group.rank() * local_rows, local_rows);
      for (size_t k = 0; k < 3; ++k) net[k]->as<ProbedLinearImpl>()->noted.clear();
      start = ddp.communication_stats().allgather_bytes;
      optimizer.zero_grad();
      amp::scale_loss(loss_of(ddp(local.x), local.y), optimizer).backward();
      optimizer.step();
    }
    for (size_t k = 0; k < 3; ++k) noted[prefetch].push_back(net[k]->as<ProbedLinearImpl>()->noted.at(0));
  }
  // Each unit's bytes: what prefetch 0 saw grow between two units' starts (the last one's, what prefetch 1 adds).
  const int64_t a = noted[0][1], b = noted[0][2] - a, c = noted[1][2] - a - b;
  auto text = [](const std::vector<int64_t>& v) { return std::to_string(v[0]) + ", " + std::to_string(v[1]) + ", " + std::to_string(v[2]); };
  report(a > 0 && b > 0 && c > 0 && noted[0] == std::vector<int64_t>{0, a, a + b} &&
             noted[1] == std::vector<int64_t>{0, a + b, a + b + c} && noted[2] == std::vector<int64_t>{0, a + b + c, a + b + c},
         "stage 3: when a unit's forward starts, the units before it are all-gathered (prefetch 0), and it too (1), and "
         "the next one as well (2)", "all-gathered bytes at each unit's start: prefetch 0 [" + text(noted[0]) + "], 1 [" +
                                         text(noted[1]) + "], 2 [" + text(noted[2]) + "]");
}

// The bytes all-gathered per step: stage 3 gathers each unit before its forward and again before its backward,
// stage 2 the updated parameters once (ZeRO's paper: stage 3 communicates 1.5x stage 2, all-gathers twice).
void communication(const ProcessGroup& group) {
  const amp::Options options = amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0);
  const int64_t local_rows = kGlobal / group.world_size();
  int64_t gathered[2] = {0, 0}, scattered[2] = {0, 0};
  for (int stage : {2, 3}) {
    TiedNet net(9);
    auto [model, optimizer] = amp::initialize(net, adamw_of(net), options);
    auto ddp = amp::parallel::make_distributed(model, group);
    amp::parallel::shard_optimizer(ddp, optimizer, amp::parallel::ZeroOptions().stage(stage));
    const auto before = ddp.communication_stats();
    const Batch local = rows(global_batch(0, kGlobal), group.rank() * local_rows, local_rows);
    optimizer.zero_grad();
    amp::scale_loss(loss_of(ddp(local.x), local.y), optimizer).backward();
    optimizer.step();
    const auto after = ddp.communication_stats();
    gathered[stage - 2] = after.allgather_bytes - before.allgather_bytes;
    scattered[stage - 2] = after.reduce_scatter_bytes - before.reduce_scatter_bytes;
  }
  const double ratio = static_cast<double>(gathered[1] + scattered[1]) / static_cast<double>(gathered[0] + scattered[0]);
  std::cout << "[ measured ] one step's all-gather + reduce-scatter bytes, stage 3 / stage 2: " << ratio << " ("
            << gathered[1] << " + " << scattered[1] << " vs " << gathered[0] << " + " << scattered[0] << ")" << std::endl;
  report(scattered[1] == scattered[0] && gathered[1] >= 2 * gathered[0] - 64 && gathered[1] <= 2 * gathered[0] + 4096,
         "stage 3: a step all-gathers each unit twice (forward, backward) where stage 2 gathers once, and reduce-scatters "
         "as much");
}

// Two heads; each rank routes its batch to another one. Stage 3 refuses this on both ranks, naming the units.
struct TwoHeadsImpl : torch::nn::Module {
  TwoHeadsImpl() {
    torch::manual_seed(3);
    a = register_module("a", torch::nn::Linear(12, 5));
    b = register_module("b", torch::nn::Linear(12, 5));
  }
  torch::Tensor forward(const torch::Tensor& x, bool use_a) { return use_a ? a(x) : b(x); }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(TwoHeads);

void misuse(const ProcessGroup& group) {
  const amp::Options options = amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0);
  auto fresh = [&](const amp::Options& o) {
    TiedNet net(1);
    auto [model, optimizer] = amp::initialize(net, adamw_of(net), o);
    auto ddp = amp::parallel::make_distributed(model, group);
    return std::make_tuple(net, std::move(optimizer), ddp);
  };
  {
    auto [net, optimizer, ddp] = fresh(options);
    std::string m = message_of([&] {
      amp::parallel::shard_optimizer(ddp, optimizer, amp::parallel::ZeroOptions().stage(3).units({"enc", "decoder"}));
    });
    report(m.find("the stage-3 unit pattern 'decoder' (ZeroOptions::units) matches no module") != std::string::npos &&
               m.find("closest:") != std::string::npos,
           "stage 3: a unit pattern matching no module is refused, naming it and the closest names", m);
    m = message_of([&] { amp::parallel::shard_optimizer(ddp, optimizer, amp::parallel::ZeroOptions().stage(2).units({"enc"})); });
    report(m.find("ZeroOptions::units applies to stage 3 only") != std::string::npos,
           "stage 2 with units is refused (they apply to stage 3 only)", m);
    m = message_of([&] { amp::parallel::shard_optimizer(ddp, optimizer, amp::parallel::ZeroOptions().stage(3).prefetch(-1)); });
    report(m.find("ZeroOptions::prefetch must be 0") != std::string::npos && m.find("got -1") != std::string::npos,
           "a negative prefetch is refused, naming it", m);
    m = message_of([&] { amp::parallel::shard_optimizer(ddp, optimizer, amp::parallel::ZeroOptions().stage(4)); });
    report(m.find("stage must be 1") != std::string::npos && m.find("or 3 (and the parameters), got 4") != std::string::npos,
           "stage 4 is refused, naming the stages", m);
  }
  {  // torch::load(net) after make_distributed (under the guard at stage 3) replaces what the wrapper hooked.
    auto [net, optimizer, ddp] = fresh(options);
    amp::parallel::shard_optimizer(ddp, optimizer, amp::parallel::ZeroOptions().stage(3));
    torch::serialize::InputArchive in = saved_whole(ddp, *net);
    {
      amp::parallel::GatheredParametersGuard whole(ddp);
      net->load(in);
    }
    const std::string m = message_of([&] { (void)ddp(global_batch(0, 4).x); });
    report(m.find("was replaced or changed dtype or device after make_distributed") != std::string::npos &&
               m.find("amp::load_weights") != std::string::npos,
           "torch::load(net) after make_distributed is refused at the next forward, naming amp::load_weights", m);
  }
  {  // Each rank routes its batch to another head: both ranks fail at the same gather, naming both units.
    TwoHeads net;
    auto [model, optimizer] = amp::initialize(
        net, amp::optim::FusedAdamW(net->parameters(), torch::optim::AdamWOptions(1e-2)), options);
    auto ddp = amp::parallel::make_distributed(model, group, amp::parallel::DistributedDataParallelOptions().delay_allreduce(true));
    amp::parallel::shard_optimizer(ddp, optimizer, amp::parallel::ZeroOptions().stage(3));
    const Batch local = rows(global_batch(0, kGlobal), group.rank() * 8, 8);
    std::string m = message_of([&] { (void)ddp(local.x, group.rank() == 0); });
    report(m.find("rank " + std::to_string(group.rank()) + " gathers unit '" + (group.rank() == 0 ? "a" : "b") +
                  "' while rank " + std::to_string(1 - group.rank()) + " gathers unit '" + (group.rank() == 0 ? "b" : "a")) !=
                   std::string::npos &&
               m.find("route batches to different branches only at stage 1 or 2") != std::string::npos,
           "stage 3: ranks whose forwards read different units fail on both, naming the units", m);
    // Weights loaded into a stage-3 O2 model go into the masters' slices (no guard needed); the next gather brings them.
    torch::serialize::InputArchive in = saved_whole(ddp, *net);
    torch::Tensor saved;
    torch::serialize::InputArchive a_archive;
    in.read("a", a_archive);
    a_archive.read("weight", saved);
    {
      torch::NoGradGuard no_grad;
      amp::parallel::GatheredParametersGuard whole(ddp);
      net->a->weight.mul_(2);
    }
    amp::load_weights(*net, in);
    m = message_of([&] { amp::PythonCheckpoint().put_model("model", *net); });
    report(m.empty(), "PythonCheckpoint::put_model of a stage-3 O2 model needs no guard (it gathers the masters)", m);
    amp::parallel::GatheredParametersGuard whole(ddp);
    report(torch::equal(net->a->weight, saved), "amp::load_weights into a stage-3 O2 model reaches the masters' slices");
  }
  {  // O0: the parameters are stepped themselves, so between uses nothing can take a loaded value.
    TwoHeads net;
    auto [model, optimizer] = amp::initialize(
        net, amp::optim::FusedAdamW(net->parameters(), torch::optim::AdamWOptions(1e-2)), amp::Options("O0").verbosity(0));
    auto ddp = amp::parallel::make_distributed(model, group);
    torch::serialize::OutputArchive out;
    net->save(out);  // before sharding: whole
    std::ostringstream bytes;
    out.save_to(bytes);
    amp::parallel::shard_optimizer(ddp, optimizer, amp::parallel::ZeroOptions().stage(3));
    std::istringstream in_bytes(bytes.str());
    torch::serialize::InputArchive in;
    in.load_from(in_bytes);
    std::string m = message_of([&] { amp::load_weights(*net, in); });
    report(m.find("amp::load_weights: parameter 'a.weight' holds no values on this rank") != std::string::npos &&
               m.find("GatheredParametersGuard") != std::string::npos,
           "O0 stage 3: amp::load_weights outside GatheredParametersGuard is refused, naming the parameter and the guard", m);
    m = message_of([&] { (void)model(global_batch(0, 4).x, true); });
    report(m.find("amp::Model::forward: parameter 'a.weight' holds no values on this rank") != std::string::npos &&
               m.find("Run it through the DistributedDataParallel") != std::string::npos,
           "stage 3: the model's own forward, which gathers nothing, is refused, naming the parameter and the wrapper", m);
    m = message_of([&] {
      amp::parallel::GatheredParametersGuard whole(ddp);
      amp::load_weights(*net, in);
    });
    report(m.empty(), "O0 stage 3: under GatheredParametersGuard amp::load_weights works", m);
    // put_model is collective: it makes the parameters whole itself and writes them.
    amp::PythonCheckpoint checkpoint;
    m = message_of([&] { checkpoint.put_model("model", *net); });
    const bool released_again = net->a->weight.storage().nbytes() == 0;
    const auto written = checkpoint.get("model").toGenericDict();
    amp::parallel::GatheredParametersGuard whole(ddp);
    report(m.empty() && released_again && torch::equal(written.at("a.weight").toTensor(), net->a->weight),
           "O0 stage 3: PythonCheckpoint::put_model gathers the parameters itself, writes them whole and frees them", m);
    // The model's own forward, not the wrapper's, gathers nothing: refused (under the guard it runs).
    const Batch batch = global_batch(0, 4);
    const torch::Tensor under_guard = model(batch.x, true);
    report(torch::equal(under_guard, ddp(batch.x, true)), "O0 stage 3: the model's own forward runs under the guard");
  }
}

}  // namespace

void scenario_zero_stage3_units(const ProcessGroup& group) {
  const amp::Options o2 = amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0);
  const std::vector<Variant> variants = {
      {"O2 bf16, each child a unit, prefetch 1", o2, amp::parallel::ZeroOptions().stage(3)},
      {"O2 bf16, units enc and mid.* (the rest the root's), prefetch 0", o2,
       amp::parallel::ZeroOptions().stage(3).units({"enc", "mid.*"}).prefetch(0)},
      {"O2 bf16, units * (the outermost modules), prefetch 3", o2,
       amp::parallel::ZeroOptions().stage(3).units({"*"}).prefetch(3)},
      {"O2 bf16, overlap off", o2, amp::parallel::ZeroOptions().stage(3).overlap(false)},
      {"O1 bf16 with head kept in fp32", amp::Options("O1").low_precision_dtype(torch::kBFloat16).keep_fp32({"head"}).verbosity(0),
       amp::parallel::ZeroOptions().stage(3)},
      {"O0", amp::Options("O0").verbosity(0), amp::parallel::ZeroOptions().stage(3), /*overflow=*/false},
      {"O2 bf16, mid's second run checkpointed (recomputed in backward)", o2, amp::parallel::ZeroOptions().stage(3),
       true, /*checkpointed=*/true},
      {"O2 bf16, units * with mid.0 checkpointed, prefetch 0", o2,
       amp::parallel::ZeroOptions().stage(3).units({"*"}).prefetch(0), true, true},
      {"O2 bf16, 8-bit optimizer state", amp::Options(o2).optimizer_state_format(amp::OptimizerStateFormat::k8Bit),
       amp::parallel::ZeroOptions().stage(3)},
  };
  for (const auto& v : variants) side_by_side(group, v);
  guarded_writes(group);
  prefetch_ahead(group);
  backward_frees(group);
  communication(group);
  misuse(group);
}

}  // namespace amp_worker
