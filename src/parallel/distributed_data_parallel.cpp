#include "amp/parallel/distributed_data_parallel.h"

#include <ATen/Functions.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/version.h>
// LibTorch 1.13 as Debian ships it lacks a header reducer.hpp includes (torch/csrc/distributed/autograd/context/
// context.h), so there the gradients are reduced after backward (delay_allreduce's path), which computes the same
// averages bit for bit (tests/parallel/ checks delay_allreduce against the overlapped path on 2.x).
#if TORCH_VERSION_MAJOR >= 2
#define AMP_HAS_C10D_REDUCER 1
#include <torch/csrc/distributed/c10d/reducer.hpp>
#else
#define AMP_HAS_C10D_REDUCER 0
#endif

#include <algorithm>
#include <atomic>
#include <functional>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "amp/optimizer.h"
#include "core/host_sync.h"
#include "casting/precision_policy.h"
#include "collectives.h"
#include "optim/feature.h"
#include "optim/master_weights.h"

// NOTE [How gradients are reduced]
// The reduction hangs off each trainable parameter's gradient accumulator (the AccumulateGrad node), as
// torch's DDP does: c10d::Reducer registers a post hook there that copies the gradient into its bucket and
// starts the bucket's all-reduce as soon as the bucket is full, while backward goes on; a callback queued on
// the autograd engine waits for every bucket and copies the averages back into .grad before backward()
// returns. amp::scale_loss unscales only after backward() returns, so it always sees reduced (still scaled)
// gradients, identical on every rank: every rank finds the same inf/NaN, skips the same steps and moves its
// loss scale the same way. Buckets hold one dtype, so at O2 the bf16/fp16 gradients travel in bf16/fp16.
//
// Torch's DDP arms the Reducer in forward (prepare_for_backward) for exactly one backward. amp's scripts run
// several backward passes per forward (one scale_loss per loss), so our own post hook, registered before the
// Reducer's and so run before it, arms the Reducer at the first gradient of every backward instead. With
// delay_allreduce, the same hook only records which parameters received a gradient, and the end-of-backward
// callback reduces them (Apex's delay_allreduce), which also allows a backward that reaches only some of them.
//
// NOTE [Parameters only some ranks reach]
// With delay_allreduce, ranks may reach different parameters (a mixture-of-experts routing, a branch taken on
// some batches only). Every rank must still reduce the same buckets, in the same order, or gradients of
// different parameters get averaged together (same sizes) or Gloo aborts (different sizes). So the delayed
// reduction follows torch's DDP with find_unused_parameters=True: the ranks first all-reduce (MAX) one int32
// flag per parameter, "this rank accumulated a gradient for it since the last synchronized backward" (no_sync
// backward passes included: torch's local_used_map); then every parameter flagged on some rank is reduced on
// every rank, in the fixed bucket layout built at wrap time; a rank without a gradient for it contributes
// zeros (its .grad becomes a zero tensor before the sum, so the result is the mean over ranks with a missing
// gradient counted as zero: what one process computes on the whole batch). A parameter no rank reached is
// not reduced and its .grad is left untouched (undefined after zero_grad), as torch's reducer does for
// globally unused parameters. The flags cost one extra tiny collective per synchronized backward (not counted
// in CommunicationStats, which counts gradients). Zeros stay zero through gradient_predivide_factor, the fp32
// wire dtype and amp's unscale, and add no inf/NaN, so overflow decisions stay those of the ranks' gradients.

// NOTE [fp32 reductions reach the masters]
// With allreduce_always_fp32, a bf16/fp16 gradient is averaged in fp32 and written back into .grad rounded to its
// dtype, as Apex's DDP does; FSDP2's reduce_dtype=float32 hands the fp32 sums to the optimizer instead. amp does
// both: .grad holds the rounding (what scripts and the overflow report read) and a parameter with an fp32 master
// leaves the fp32 average beside it (MasterWeights::reduced_grad), which the unscale takes in place of .grad, so
// the master's gradient is the fp32 average unscaled, rounded once. ZeRO stage 2 keeps its reduce-scattered slices of
// mastered parameters in fp32 for the same reason, so every stage sees the same sums.

namespace amp::parallel::detail {
namespace {

// The fp32 averages of `params` (each at its offset in `wide`) for their masters; parameters without one skip.
std::function<void(const at::Tensor&)> fp32_sums_to_masters(std::vector<std::pair<at::Tensor, int64_t>> params) {
  return [params = std::move(params)](const at::Tensor& wide) {
    for (const auto& [p, offset] : params) {
      if (auto master = amp::detail::find_master(p)) {
        master->first->reduced_grad(master->second) = wide.narrow(0, offset, p.numel()).view(p.sizes());
      }
    }
  };
}

using Accumulator = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

class ReadyHook final : public torch::autograd::FunctionPostHook {
 public:
  explicit ReadyHook(std::function<void()> on_ready) : on_ready_(std::move(on_ready)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    on_ready_();
    return outputs;
  }

 private:
  std::function<void()> on_ready_;
};

struct Counters {
  std::atomic<int64_t> allreduce_calls{0};
  std::atomic<int64_t> allreduce_bytes{0};
  std::atomic<int64_t> broadcast_bytes{0};
  std::atomic<int64_t> synced_backwards{0};
  std::atomic<int64_t> reduce_scatter_bytes{0};
  std::atomic<int64_t> allgather_bytes{0};
  std::atomic<int64_t> overlapped_reduce_scatter_bytes{0};
};

#if AMP_HAS_C10D_REDUCER
// The Reducer's communication: amp's average (predivide, fp32 on request, sum, divide) instead of c10d's
// divide-then-sum, so the overlapped and the delayed paths compute bit for bit the same thing.
class AverageHook final : public c10d::CppCommHookInterface<c10::intrusive_ptr<c10d::ProcessGroup>> {
 public:
  AverageHook(const GroupState& group, AverageSettings settings, Counters& counters)
      : CppCommHookInterface(group.group), group_(group), settings_(settings), counters_(counters) {}

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    at::Tensor& buffer = bucket.getBufferRef();
    counters_.allreduce_calls.fetch_add(1);
    counters_.allreduce_bytes.fetch_add(buffer.numel() *
                                        static_cast<int64_t>(c10::elementSize(wire_dtype(buffer.scalar_type(), settings_))));
    std::vector<std::pair<at::Tensor, int64_t>> placed;
    if (settings_.always_fp32) {
      const auto params = bucket.getParameters();
      const auto grads = bucket.getGradients();
      for (size_t i = 0; i < params.size() && i < grads.size(); ++i) {
        placed.emplace_back(params[i], grads[i].storage_offset() - buffer.storage_offset());
      }
    }
    return average_async(group_, buffer, settings_, fp32_sums_to_masters(std::move(placed)));
  }

 private:
  const GroupState& group_;
  AverageSettings settings_;
  Counters& counters_;
};
#endif

std::string list_names(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < 4; ++i) out += (i ? ", '" : "'") + names[i] + "'";
  if (names.size() > 4) out += " and " + std::to_string(names.size() - 4) + " more";
  return out;
}

constexpr const char* kWhere = "amp::parallel::DistributedDataParallel";

// What the wrapper lends the training features of its model (NOTE [Training features] in src/optim/feature.h).
class Link final : public amp::detail::RankLink {
 public:
  explicit Link(const GroupState& state) : state_(state) {}
  int rank() const override { return state_.rank; }
  int world_size() const override { return state_.world_size; }
  void broadcast_from_rank0(std::vector<at::Tensor> tensors, std::function<void()> then) override {
    outgoing.insert(outgoing.end(), tensors.begin(), tensors.end());
    thens.push_back(std::move(then));
  }
  void max_over_ranks(at::Tensor& t) override {
    if (state_.world_size == 1) return;
    std::vector<at::Tensor> tensors{t};
    c10d::AllreduceOptions max;
    max.reduceOp = c10d::ReduceOp::MAX;
    wait(state_.group->allreduce(tensors, max), state_, "amp (a training feature agreeing over the ranks)");
  }

  std::vector<at::Tensor> outgoing;  // added to make_distributed's broadcast of rank 0's state
  std::vector<std::function<void()>> thens;

 private:
  GroupState state_;
};

}  // namespace

struct DistributedCore::Impl {
  Impl(std::shared_ptr<torch::nn::Module> m, ProcessGroup g, DistributedDataParallelOptions o)
      : module(std::move(m)), group(std::move(g)), state(state_of(group)), options(o) {}

  std::shared_ptr<torch::nn::Module> module;
  ProcessGroup group;
  const GroupState& state;
  std::shared_ptr<Link> link;
  amp::detail::Features features;  // the model's training features, joined to the ranks while we live
  DistributedDataParallelOptions options;
  AverageSettings average;
  int64_t bucket_bytes = 0;

  std::vector<at::Tensor> params;  // trainable (requires_grad at construction), model order, no duplicates
  std::vector<std::string> names;
  std::vector<at::Tensor> frozen;  // the others, watched so that unfreezing later is caught
  std::vector<std::string> frozen_names;
  std::vector<at::Tensor> buffers;
  std::vector<Accumulator> accumulators;
  std::vector<uintptr_t> hook_keys;
  std::vector<c10::ScalarType> dtypes;  // of params when hooked
#if AMP_HAS_C10D_REDUCER
  std::unique_ptr<c10d::Reducer> reducer;  // overlapped mode
#else
  std::unique_ptr<int> reducer;  // never set: 1.13 always reduces after backward
#endif
  std::vector<std::vector<size_t>> delay_buckets;  // delay_allreduce: indices into params, one dtype each
  Counters counters;

  std::mutex mutex;
  bool sync = true;
  bool in_backward = false;
  bool backward_synced = false;
  std::vector<bool> fired;
  struct GradSnapshot {
    bool defined = false;
    const c10::TensorImpl* impl = nullptr;
    int64_t version = 0;  // _version(): uint32_t in LibTorch 1.13, int64_t in 2.x
  };
  std::vector<GradSnapshot> unsynced;  // gradients a no_sync() backward left, awaiting a synchronized backward
  bool window_unsynced = false;        // a no_sync() backward ran since the last synchronized one
  std::vector<std::string> last_missing;
  // Parameters this rank accumulated a gradient for since the last synchronized backward (no_sync ones included).
  std::vector<bool> used;
  std::vector<DistributedCore::Reduction> zero_reductions;  // ZeRO stage 2's reduce-scatters instead of the all-reduce
  bool reaches_every_param = true;  // the options did not ask for delay_allreduce (add_reduction turns it on)
  std::vector<DistributedCore::ReadyListener> ready_listeners;
  std::vector<std::weak_ptr<DistributedCore::ShardedParameters>> sharded_parameters;  // ZeRO stage 3, per optimizer

  using Masters = std::vector<std::pair<std::shared_ptr<amp::detail::MasterWeights>, size_t>>;
  void broadcast_rank0_state(std::vector<at::Tensor> outgoing, const Masters& masters, const std::string& where);
  void hook_gradients(const std::string& where);
  void unhook_gradients();
  bool rehook_moved_to_fp32();
  void on_ready(size_t i);
  void end_of_backward();
  void reduce_delayed(const std::vector<bool>& used_here, bool closes_window);
  void reduce_unreduced_masters(const std::vector<bool>& skip);
  void check_unsynced() const;
};

void DistributedCore::Impl::on_ready(size_t i) {
  bool synced = false;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (!in_backward) {
      in_backward = true;
      backward_synced = sync;
      fired.assign(params.size(), false);
#if AMP_HAS_C10D_REDUCER
      if (backward_synced && reducer) reducer->prepare_for_backward({});
#endif
      torch::autograd::Engine::get_default_engine().queue_callback([this] { end_of_backward(); });
    }
    fired[i] = true;
    synced = backward_synced;
  }
  if (synced && params[i].grad().defined()) {
    for (const auto& listener : ready_listeners) listener(i);  // NOTE [Overlapped reduce-scatter] in zero.cpp
  }
}

void DistributedCore::Impl::end_of_backward() {
  std::vector<bool> reached;
  bool synced = false;
  {
    std::lock_guard<std::mutex> lock(mutex);
    in_backward = false;
    synced = backward_synced;
    reached = fired;
  }
  // Only a gradient that exists counts (a hook may run without one), as in torch's local_used_map.
  if (used.size() != params.size()) used.assign(params.size(), false);
  for (size_t i = 0; i < params.size(); ++i) {
    if (reached[i] && params[i].grad().defined()) used[i] = true;
  }
  if (!synced) {
    // Remember the accumulated gradients: the next forward checks that amp left them scaled (see NoSyncGuard).
    unsynced.assign(params.size(), GradSnapshot{});
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& g = params[i].grad();
      if (!g.defined()) continue;
      unsynced[i] = {true, g.unsafeGetTensorImpl(), static_cast<int64_t>(g._version())};
      // delay_unscale moves an O2 gradient into an fp32 sum beside its master: that sum is this rank's own.
      if (const auto master = amp::detail::find_master(params[i])) master->first->mark_unreduced(master->second);
    }
    window_unsynced = true;
    return;
  }
  counters.synced_backwards.fetch_add(1);
  unsynced.clear();
  // ZeRO stage 2 reduce-scatters its own parameters' no_sync() sums (reduce_delayed); the rest are all-reduced here.
  const bool closes_window = std::exchange(window_unsynced, false);
  if (closes_window && zero_reductions.empty()) reduce_unreduced_masters({});
  std::vector<std::string> missing;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!reached[i]) missing.push_back(names[i]);
  }
  last_missing = missing;
  std::vector<bool> used_here(params.size(), false);
  used_here.swap(used);  // the next accumulation window starts empty
  if (reducer || !ready_listeners.empty()) {
    // The Reducer's own callback, queued after this one, waits for the buckets and writes .grad; ZeRO's overlapped
    // reduce-scatters have started for what this rank reached, in the order every rank does.
    TORCH_CHECK(missing.empty(), kWhere, ": this backward produced no gradient for ", missing.size(),
                " trainable parameter(s) (", list_names(missing), "), so their buckets were never reduced. The "
                "overlapped all-reduce (ZeRO's reduce-scatter) needs every backward to reach every trainable parameter "
                "(as torch's DDP without find_unused_parameters). Freeze unused parameters before make_distributed (requires_grad false), "
                "sum the losses into one backward, or use DistributedDataParallelOptions().delay_allreduce(true), "
                "which reduces whatever each backward reached.");
    if (reducer) return;
  }
  reduce_delayed(used_here, closes_window);
}

void DistributedCore::Impl::reduce_delayed(const std::vector<bool>& used_here, bool closes_window) {
  c10::NoGradGuard no_grad;
  // NOTE [Parameters only some ranks reach]: agree on what any rank reached; reduce that everywhere.
  std::vector<bool> used_anywhere = used_here;
  if (state.world_size > 1) {
    at::Tensor flags = at::zeros({static_cast<int64_t>(params.size())}, at::TensorOptions().dtype(at::kInt));
    int32_t* f = flags.data_ptr<int32_t>();
    for (size_t i = 0; i < params.size(); ++i) f[i] = used_here[i] ? 1 : 0;
    std::vector<at::Tensor> tensors{flags};
    c10d::AllreduceOptions max;
    max.reduceOp = c10d::ReduceOp::MAX;
    wait(state.group->allreduce(tensors, max), state,
         "the gradient all-reduce (agreeing on which parameters some rank has a gradient for)");
    for (size_t i = 0; i < params.size(); ++i) used_anywhere[i] = f[i] != 0;
  }
  std::vector<bool> zero_handled(params.size(), false);
  for (const auto& reduce : zero_reductions) {
    const std::vector<bool> handled = reduce(params, used_anywhere, closes_window);
    for (size_t i = 0; i < params.size(); ++i) {
      used_anywhere[i] = used_anywhere[i] && !handled[i];
      zero_handled[i] = zero_handled[i] || handled[i];
    }
  }
  if (closes_window && !zero_reductions.empty()) reduce_unreduced_masters(zero_handled);
  struct Pending {
    c10::intrusive_ptr<c10::ivalue::Future> future;
    at::Tensor flat;
    std::vector<at::Tensor> grads;
    std::vector<std::pair<at::Tensor, int64_t>> placed;  // each parameter and its offset in flat
    int64_t flat_numel = 0;
  };
  std::vector<Pending> pending;
  for (const auto& bucket : delay_buckets) {
    Pending p;
    std::vector<at::Tensor> pieces;
    for (size_t i : bucket) {
      if (!used_anywhere[i]) continue;
      at::Tensor& grad = params[i].mutable_grad();
      if (!grad.defined()) grad = at::zeros_like(params[i]);  // reached on another rank: this rank adds zeros
      p.placed.emplace_back(params[i], p.flat_numel);
      p.flat_numel += grad.numel();
      p.grads.push_back(grad);
      pieces.push_back(grad.reshape({-1}));
    }
    if (pieces.empty()) continue;
    p.flat = at::cat(pieces);
    counters.allreduce_calls.fetch_add(1);
    counters.allreduce_bytes.fetch_add(p.flat.numel() *
                                       static_cast<int64_t>(c10::elementSize(wire_dtype(p.flat.scalar_type(), average))));
    p.future = average_async(state, p.flat, average, fp32_sums_to_masters(std::move(p.placed)));
    pending.push_back(std::move(p));
  }
  for (auto& p : pending) {
    p.future->wait();
    if (p.future->hasError()) std::rethrow_exception(p.future->exception_ptr());
    int64_t offset = 0;
    for (auto& g : p.grads) {
      g.copy_(p.flat.narrow(0, offset, g.numel()).view(g.sizes()));
      offset += g.numel();
    }
  }
}

// NOTE [fp32 accumulation under no_sync]: at O2, scale_loss with delay_unscale moves each micro-batch's
// low-precision gradient into an fp32 sum beside its master (summing in bf16 would lose small terms). The
// no_sync() micro-batches' sums are this rank's own: the synchronized backward that closes the window
// all-reduces them once, in fp32, beside the reduction of its own gradients, and adds them to what the
// unscale consumes. Every rank sends every master parameter (zeros where it has none), so the message is the
// same size everywhere. ZeRO stage 2 keeps its parameters' sums itself and reduce-scatters them (`skip`).
void DistributedCore::Impl::reduce_unreduced_masters(const std::vector<bool>& skip) {
  c10::NoGradGuard no_grad;
  std::vector<std::pair<std::shared_ptr<amp::detail::MasterWeights>, size_t>> entries;
  int64_t total = 0;
  for (size_t k = 0; k < params.size(); ++k) {
    const at::Tensor& p = params[k];
    if (k < skip.size() && skip[k]) continue;
    if (auto master = amp::detail::find_master(p)) {
      total += p.numel();
      entries.push_back(std::move(*master));
    }
  }
  if (entries.empty()) return;
  at::Tensor flat = at::zeros({total}, params.front().options().dtype(at::kFloat));
  int64_t offset = 0;
  for (auto& [table, i] : entries) {
    const at::Tensor& local = table->unreduced_grad(i);
    const int64_t n = table->master()[i].numel();
    if (local.defined()) flat.narrow(0, offset, n).copy_(local.reshape({-1}));
    offset += n;
  }
  if (state.world_size > 1) {
    counters.allreduce_calls.fetch_add(1);
    counters.allreduce_bytes.fetch_add(flat.numel() * static_cast<int64_t>(c10::elementSize(wire_dtype(at::kFloat, average))));
    auto future = average_async(state, flat, average);
    future->wait();
    if (future->hasError()) std::rethrow_exception(future->exception_ptr());
  }
  offset = 0;
  for (auto& [table, i] : entries) {
    const at::Tensor& master = table->master()[i];
    const at::Tensor reduced = flat.narrow(0, offset, master.numel()).view(master.sizes());
    offset += master.numel();
    table->unreduced_grad(i) = at::Tensor();
    at::Tensor& pending = table->pending_grad(i);
    if (pending.defined()) pending.add_(reduced);
    else pending = reduced.clone();
  }
}

void DistributedCore::Impl::check_unsynced() const {
  std::vector<std::string> unscaled;
  for (size_t i = 0; i < unsynced.size(); ++i) {
    if (!unsynced[i].defined) continue;
    const at::Tensor& g = params[i].grad();
    if (const auto master = amp::detail::find_master(params[i])) {
      // O2: amp moved the gradient into the fp32 master (unscaled) and cleared the model's.
      if (!g.defined() && master->first->master()[master->second].grad().defined()) unscaled.push_back(names[i]);
      continue;
    }
    if (!g.defined()) continue;
    if (g.unsafeGetTensorImpl() == unsynced[i].impl && static_cast<int64_t>(g._version()) == unsynced[i].version) continue;
    amp::detail::count_host_sync();
    if (g.count_nonzero().item<int64_t>() > 0) unscaled.push_back(names[i]);  // changed, and not by zero_grad
  }
  TORCH_CHECK(unscaled.empty(), kWhere, ": the gradients accumulated under no_sync() were unscaled by amp::scale_loss "
              "(", list_names(unscaled), "), so they could no longer be all-reduced with the next micro-batch's: every "
              "rank would keep its own gradients and take its own overflow decision. Inside no_sync(), keep them scaled: "
              "amp::scale_loss(loss, optimizer, amp::ScaleLossOptions().delay_unscale(true)); the last micro-batch, "
              "outside no_sync(), uses a plain scale_loss, which reduces and then unscales the sum (Apex's gradient "
              "accumulation).");
}

DistributedCore::DistributedCore(std::shared_ptr<torch::nn::Module> module, ProcessGroup group,
                                 DistributedDataParallelOptions options)
    : impl_(std::make_unique<Impl>(std::move(module), std::move(group), options)) {
  Impl& d = *impl_;
  TORCH_CHECK(d.module, "amp::parallel::make_distributed: the model is empty.");
  TORCH_CHECK(options.bucket_cap_mb() > 0 && std::isfinite(options.bucket_cap_mb()),
              "amp::parallel::make_distributed: bucket_cap_mb must be positive, got ", options.bucket_cap_mb(), ".");
  TORCH_CHECK(options.gradient_predivide_factor() > 0 && std::isfinite(options.gradient_predivide_factor()),
              "amp::parallel::make_distributed: gradient_predivide_factor must be positive and finite, got ",
              options.gradient_predivide_factor(), ".");
  d.reaches_every_param = !options.delay_allreduce();
  d.average.always_fp32 = options.allreduce_always_fp32();
  d.average.predivide = options.gradient_predivide_factor();
  d.bucket_bytes = std::max<int64_t>(1, static_cast<int64_t>(options.bucket_cap_mb() * 1024 * 1024));
  const std::string where = "amp::parallel::make_distributed";

  // Every parameter and buffer, in model order, shared ones once.
  std::vector<at::Tensor> all;
  std::vector<std::string> all_names, kinds;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& item : d.module->named_parameters()) {
    const at::Tensor& p = item.value();
    if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
    all.push_back(p);
    all_names.push_back(item.key());
    kinds.emplace_back("parameter");
    if (p.requires_grad()) {
      d.params.push_back(p);
      d.names.push_back(item.key());
    } else {
      d.frozen.push_back(p);
      d.frozen_names.push_back(item.key());
    }
  }
  std::vector<at::Tensor> buffer_list;
  for (const auto& item : d.module->named_buffers()) {
    if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
    all.push_back(item.value());
    all_names.push_back(item.key());
    kinds.emplace_back("buffer");
    d.buffers.push_back(item.value());
  }
  TORCH_CHECK(!d.params.empty(), where, ": the model has no parameter that requires grad, so there is nothing to "
              "reduce.");
  for (const auto& p : all) {
    TORCH_CHECK(p.device().type() == all.front().device().type(), where, ": the model's tensors live on several "
                "device types (", all.front().device(), " and ", p.device(), "); one process trains one device.");
  }

  verify_same_shapes(d.state, all, all_names, kinds, where);
  std::vector<std::pair<std::shared_ptr<amp::detail::MasterWeights>, size_t>> masters;
  for (size_t i = 0; i < all.size(); ++i) {
    if (kinds[i] != "parameter") continue;
    if (auto m = amp::detail::find_master(all[i])) masters.push_back(std::move(*m));
  }
  d.broadcast_rank0_state(all, masters, where);
  d.hook_gradients(where);
}

// Same shapes everywhere, then rank 0's values everywhere: parameters, buffers and, at O2, the fp32 masters
// (broadcast too, so masters stay bit-identical; writes into the model alone would make the masters copy the
// rounded low-precision values), and whatever the model's training features add (the lean formats' low bits and
// generator); the features also take the link they agree through later (FP8's delayed amaxes, auto_fp32's module).
void DistributedCore::Impl::broadcast_rank0_state(std::vector<at::Tensor> outgoing, const Masters& masters,
                                                 const std::string& where) {
  if (state.rank == 0) {
    std::unordered_set<amp::detail::MasterWeights*> refreshed;
    for (auto& [table, index] : masters) {
      if (refreshed.insert(table.get()).second) table->refresh_changed();  // masters follow writes into the model
    }
  }
  for (auto& [table, index] : masters) outgoing.push_back(table->master()[index]);
  link = std::make_shared<Link>(state);
  features = amp::detail::features_of(*module);
  for (const auto& feature : features) feature->join_ranks(*module, link);
  outgoing.insert(outgoing.end(), link->outgoing.begin(), link->outgoing.end());
  counters.broadcast_bytes.fetch_add(
      broadcast_from_rank0(state, outgoing, int64_t{250} * 1024 * 1024, where + " (broadcasting rank 0's weights)"));
  for (auto& [table, index] : masters) table->mark_synced(index);
  for (const auto& then : link->thens) then();
  link->outgoing.clear();
  link->thens.clear();
}

// Our hook first, then the Reducer's on the same accumulators (post hooks run in registration order).
void DistributedCore::Impl::hook_gradients(const std::string& where) {
  dtypes.clear();
  for (size_t i = 0; i < params.size(); ++i) {
    auto accumulator = torch::autograd::impl::grad_accumulator(params[i]);
    TORCH_CHECK(accumulator, where, ": parameter '", names[i], "' has no gradient accumulator; it must be a leaf "
                "tensor that requires grad.");
    hook_keys.push_back(accumulator->add_post_hook(std::make_unique<ReadyHook>([this, i] { on_ready(i); })));
    accumulators.push_back(std::move(accumulator));
    dtypes.push_back(params[i].scalar_type());
  }

#if AMP_HAS_C10D_REDUCER
  const int64_t first_bucket = std::min<int64_t>(c10d::kDefaultFirstBucketBytes, bucket_bytes);
  if (!options.delay_allreduce()) {
    std::vector<bool> sparse(params.size(), false);
    auto assignment = c10d::compute_bucket_assignment_by_size(
        params, {static_cast<size_t>(first_bucket), static_cast<size_t>(bucket_bytes)}, sparse);
    auto buckets = std::get<0>(assignment);
    // Buckets come out in parameter order; gradients arrive in reverse order, so reduce the last layers'
    // bucket first (as Python's DDP does), or nothing would start until backward has ended.
    std::reverse(buckets.begin(), buckets.end());
    std::unordered_map<size_t, std::string> param_names;
    for (size_t i = 0; i < names.size(); ++i) param_names.emplace(i, names[i]);
    reducer = std::make_unique<c10d::Reducer>(params, buckets, state.group, sparse, bucket_bytes,
                                              /*find_unused_parameters=*/false, /*gradient_as_bucket_view=*/false,
                                              param_names, first_bucket, /*skip_all_reduce_unused_params=*/false,
                                              /*use_python_reducer=*/false, std::vector<int64_t>{});
    reducer->register_comm_hook(std::make_unique<AverageHook>(state, average, counters));
    return;
  }
#endif
  // One flat buffer per dtype and device, split at bucket_cap_mb.
  std::vector<std::pair<std::pair<c10::ScalarType, std::string>, std::vector<size_t>>> groups;
  std::vector<int64_t> filled;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto key = std::make_pair(params[i].scalar_type(), params[i].device().str());
    const int64_t bytes = params[i].numel() * static_cast<int64_t>(params[i].element_size());
    size_t g = 0;
    for (; g < groups.size(); ++g) {
      if (groups[g].first == key && filled[g] + bytes <= bucket_bytes) break;
    }
    if (g == groups.size()) {
      groups.push_back({key, {}});
      filled.push_back(0);
    }
    groups[g].second.push_back(i);
    filled[g] += bytes;
  }
  delay_buckets.clear();
  for (auto& g : groups) delay_buckets.push_back(std::move(g.second));
}

void DistributedCore::Impl::unhook_gradients() {
  reducer.reset();
  for (size_t i = 0; i < accumulators.size(); ++i) accumulators[i]->del_post_hook(hook_keys[i]);
  accumulators.clear();
  hook_keys.clear();
}

// auto_fp32 moved a module to fp32 (the same one on every rank: features/auto_fp32.cpp): its parameters have new
// gradient accumulators and another dtype, so the hooks and buckets are built again, on every rank alike.
bool DistributedCore::Impl::rehook_moved_to_fp32() {
  const auto policy = amp::detail::precision_policy_of(*module);
  bool moved = false;
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].scalar_type() == dtypes[i]) continue;
    if (!policy || params[i].scalar_type() != at::kFloat || !policy->in_island(params[i].unsafeGetTensorImpl())) return false;
    moved = true;
  }
  if (!moved) return false;
  unhook_gradients();
  hook_gradients(kWhere);
  return true;
}

DistributedCore::~DistributedCore() {
  if (!impl_) return;
  try {
    impl_->unhook_gradients();
    for (const auto& feature : impl_->features) feature->leave_ranks(*impl_->module);
  } catch (...) {
    // A destructor never throws; the hooks die with the accumulators anyway.
  }
}

void DistributedCore::before_forward() {
  Impl& d = *impl_;
  {
    std::lock_guard<std::mutex> lock(d.mutex);
    d.in_backward = false;  // a backward that threw before its end: start afresh
  }
  for (size_t i = 0; i < d.params.size(); ++i) {
    if (torch::autograd::impl::try_get_grad_accumulator(d.params[i]) != d.accumulators[i] && d.rehook_moved_to_fp32()) break;
    TORCH_CHECK(torch::autograd::impl::try_get_grad_accumulator(d.params[i]) == d.accumulators[i], kWhere,
                ": parameter '", d.names[i], "' was replaced or changed dtype or device after make_distributed (its "
                "gradients would no longer be reduced). Finish changing the model (amp::initialize, .to(), loading "
                "weights with amp::load_weights) before make_distributed.");
  }
  for (size_t i = 0; i < d.frozen.size(); ++i) {
    TORCH_CHECK(!d.frozen[i].requires_grad(), kWhere, ": parameter '", d.frozen_names[i], "' did not require grad "
                "when make_distributed ran, so its gradients are not reduced, but it requires grad now. Unfreeze "
                "parameters before make_distributed (and wrap the model again after changing which are frozen).");
  }
  if (!d.unsynced.empty()) d.check_unsynced();
  if (d.options.broadcast_buffers() && d.state.world_size > 1 && !d.buffers.empty()) {
    d.counters.broadcast_bytes.fetch_add(
        broadcast_from_rank0(d.state, d.buffers, int64_t{250} * 1024 * 1024, std::string(kWhere) + " (broadcasting buffers)"));
  }
#if AMP_HAS_C10D_REDUCER
  if (d.reducer && d.sync && c10::GradMode::is_enabled()) {
    try {
      d.reducer->rebuild_buckets();
    } catch (const c10::Error& e) {
      std::string cause = e.what_without_backtrace();
      cause = cause.substr(0, cause.find('\n'));
      TORCH_CHECK(false, kWhere, ": the previous backward left gradients unreduced",
                  d.last_missing.empty() ? std::string() : " (no gradient for " + list_names(d.last_missing) + ")",
                  ". Every backward must reach every trainable parameter, or use delay_allreduce(true). (c10d: ",
                  cause, ")");
    }
    d.reducer->prepare_for_forward();
  }
#endif
}

void DistributedCore::set_sync(bool sync) {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->sync = sync;
}

bool DistributedCore::sync() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->sync;
}

CommunicationStats DistributedCore::stats() const {
  CommunicationStats s;
  s.allreduce_calls = impl_->counters.allreduce_calls.load();
  s.allreduce_bytes = impl_->counters.allreduce_bytes.load();
  s.broadcast_bytes = impl_->counters.broadcast_bytes.load();
  s.synced_backwards = impl_->counters.synced_backwards.load();
  s.reduce_scatter_bytes = impl_->counters.reduce_scatter_bytes.load();
  s.overlapped_reduce_scatter_bytes = impl_->counters.overlapped_reduce_scatter_bytes.load();
  s.allgather_bytes = impl_->counters.allgather_bytes.load();
  return s;
}

const ProcessGroup& DistributedCore::group() const { return impl_->group; }

bool DistributedCore::add_ready_listener(ReadyListener listener) {
  Impl& d = *impl_;
  if (!d.reaches_every_param) return false;
  d.ready_listeners.push_back(std::move(listener));
  return true;
}

void DistributedCore::add_reduction(Reduction reduce) {
  Impl& d = *impl_;
  // The Reducer all-reduces bucket by bucket; ZeRO's reduction runs once after backward, on what any rank reached
  // (the delayed path's agreement, NOTE [Parameters only some ranks reach]).
  d.zero_reductions.push_back(std::move(reduce));
  if (d.options.delay_allreduce()) return;
  d.unhook_gradients();
  d.options.delay_allreduce(true);
  d.hook_gradients(kWhere);
}

const std::vector<at::Tensor>& DistributedCore::params() const { return impl_->params; }

void DistributedCore::count_zero_bytes(int64_t reduce_scatter_bytes, int64_t allgather_bytes, bool during_backward) {
  impl_->counters.reduce_scatter_bytes.fetch_add(reduce_scatter_bytes);
  if (during_backward) impl_->counters.overlapped_reduce_scatter_bytes.fetch_add(reduce_scatter_bytes);
  impl_->counters.allgather_bytes.fetch_add(allgather_bytes);
}

const DistributedDataParallelOptions& DistributedCore::options() const { return impl_->options; }

const std::shared_ptr<torch::nn::Module>& DistributedCore::module() const { return impl_->module; }

void DistributedCore::set_sharded_parameters(std::weak_ptr<ShardedParameters> parameters) {
  impl_->sharded_parameters.push_back(std::move(parameters));
}

namespace {
// Each stage-3 optimizer's `start` (forward or gather_all) in the order they were sharded; one object ends them all.
std::shared_ptr<void> for_each_sharding(const std::vector<std::weak_ptr<DistributedCore::ShardedParameters>>& all,
                                        const char* where,
                                        const std::function<std::shared_ptr<void>(DistributedCore::ShardedParameters&)>& start) {
  if (all.empty()) return nullptr;
  auto scopes = std::make_shared<std::vector<std::shared_ptr<void>>>();
  for (const auto& weak : all) {
    const auto parameters = weak.lock();
    TORCH_CHECK(parameters, where, ": the model's parameters were sharded (ZeRO stage 3) by an optimizer that no "
                "longer exists, so they can't be gathered. Keep the sharded optimizer alive as long as the model is used.");
    scopes->push_back(start(*parameters));
  }
  return scopes;
}
}  // namespace

std::shared_ptr<void> DistributedCore::begin_forward() {
  return for_each_sharding(impl_->sharded_parameters, kWhere, [](ShardedParameters& p) { return p.forward(); });
}

std::shared_ptr<void> DistributedCore::gather_parameters() {
  return for_each_sharding(impl_->sharded_parameters, "amp::parallel::GatheredParametersGuard",
                           [](ShardedParameters& p) { return p.gather_all(); });
}

}  // namespace amp::parallel::detail
