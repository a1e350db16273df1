// Activation checkpointing: the first run records fn's graph only long enough to learn which leaves
// (parameters) it reads, then drops it; a CheckpointBackward node stands in for the whole graph and, on
// backward, recomputes fn under the forward's autocast and RNG state and differentiates the recomputed graph.
//
// NOTE [Why a node of our own, with the parameters as its inputs]
// torch.utils.checkpoint (use_reentrant=False) drops activations through saved-tensor hooks, which LibTorch
// exposes to Python only. The reentrant recipe (backward inside backward, accumulating into .grad directly)
// would bypass the parameters' AccumulateGrad nodes, where amp::parallel hangs its reduction and scale_loss
// finds the leaves it unscales, and would give nothing when no input requires grad. So the node's next edges
// are the inputs and every leaf fn read: the outer engine accumulates their gradients as without
// checkpointing. Casts of parameters inside fn are made with the weight-cast cache off, so each is a node
// of fn's own graph (a cast cached before fn would be a node outside it, and lead nowhere on recompute).
//
// NOTE [A recompute writes nothing that outlives it]
// fn's first run has its side effects (a training-mode BatchNorm moves its running statistics and counts the
// batch); the recompute must not repeat them, whatever fn is: a module, a lambda over modules or over
// F::batch_norm. fn's state is not known from outside, but every write reaches the dispatcher: while fn is
// recomputed, a thread-local RecordFunction observer sees each op's arguments before it runs, and takes a copy of
// each tensor the op writes (an argument its schema marks written, or batch norm's running_mean / running_var,
// which older schemas leave unmarked) unless autograd tracks it (an activation) or an op of the recompute made
// it. The copies go back after the gradients are computed: an eval-mode batch norm saved its statistics for its
// backward.

#include "amp/checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/SequenceNumber.h>
#include <ATen/core/Generator.h>
#include <ATen/core/function_schema.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

#include "interception/interception.h"

#include "amp/autocast_guard.h"
#include "amp/precision_policy.h"
#include "casting/autocast_adapter.h"

namespace amp::detail {
namespace {

constexpr const char* kCheckpoint = "amp::checkpoint: ";
using torch::autograd::Node;

// Everything that decides how the ops of a region cast: both devices' autocast switch and dtype, and amp's rules.
struct CastState {
  bool cpu_enabled = false;
  c10::ScalarType cpu_dtype = at::kBFloat16;
  bool cuda_enabled = false;
  c10::ScalarType cuda_dtype = at::kHalf;
  bool amp_casts = false;
  bool apex_rows = true;
  bool cache_enabled = true;
  std::shared_ptr<PrecisionPolicy> policy;  // the fp32 islands of the model being run, or null
  std::vector<ForwardContext> contexts;     // NOTE [One interception key]: ZeRO stage 3's gatherers, or none

  static CastState current() {
    CastState s;
    s.cpu_enabled = autocast::is_enabled(c10::DeviceType::CPU);
    s.cpu_dtype = autocast::get_dtype(c10::DeviceType::CPU);
    s.cuda_enabled = autocast::is_enabled(c10::DeviceType::CUDA);
    s.cuda_dtype = autocast::get_dtype(c10::DeviceType::CUDA);
    s.amp_casts = amp_casts_active();
    s.apex_rows = apex_rows_active();
    s.cache_enabled = autocast::is_cache_enabled();
    s.policy = current_precision_policy();
    s.contexts = capture_forward_contexts();
    return s;
  }

  void install(bool cache) const {
    autocast::set_dtype(c10::DeviceType::CPU, cpu_dtype);
    autocast::set_dtype(c10::DeviceType::CUDA, cuda_dtype);
    autocast::set_enabled(c10::DeviceType::CPU, cpu_enabled);
    autocast::set_enabled(c10::DeviceType::CUDA, cuda_enabled);
    autocast::set_cache_enabled(cache);
    set_amp_casts_active(amp_casts);
    set_apex_rows_active(apex_rows);
  }
};

// Runs its scope under `state` with the weight-cast cache off (see the NOTE), and restores the caller's state.
class CastStateGuard {
 public:
  explicit CastStateGuard(const CastState& state) : saved_(CastState::current()), policy_(state.policy) {
    state.install(false);
    for (const auto& context : state.contexts) entered_.push_back(context());
  }
  ~CastStateGuard() {
    try {
      saved_.install(saved_.cache_enabled);
    } catch (...) {
      // The saved state was read from ATen a moment ago, so installing it can't fail in practice.
    }
  }
  CastStateGuard(const CastStateGuard&) = delete;
  CastStateGuard& operator=(const CastStateGuard&) = delete;

 private:
  CastState saved_;
  PrecisionPolicyGuard policy_;
  std::vector<std::shared_ptr<void>> entered_;  // the forward's contexts, re-entered for the recompute
};

// The states of the generators fn may draw from: the CPU's, and those of the devices of the inputs (as torch's
// preserve_rng_state).
struct RngState {
  std::vector<std::pair<at::Generator, at::Tensor>> states;

  static RngState capture(const std::vector<at::Tensor>& inputs) {
    RngState s;
    s.add(at::detail::getDefaultCPUGenerator());
    for (const auto& x : inputs) {
      if (!x.defined() || !x.device().is_cuda() || !at::hasCUDA()) continue;
      s.add(at::globalContext().defaultGenerator(x.device()));
    }
    return s;
  }

  void install() const {
    for (const auto& [generator, state] : states) {
      at::Generator g = generator;
      std::lock_guard<std::mutex> lock(g.mutex());
      g.set_state(state);
    }
  }

 private:
  void add(at::Generator g) {
    for (const auto& entry : states)
      if (entry.first == g) return;
    std::lock_guard<std::mutex> lock(g.mutex());
    at::Tensor state = g.get_state();
    states.emplace_back(std::move(g), std::move(state));
  }
};

// Records, while it lives on this thread, the value each tensor from outside the recompute had before an op wrote
// it (NOTE [A recompute writes nothing that outlives it]); restore() writes those values back.
class RecomputeWritesGuard {
 public:
  RecomputeWritesGuard() : previous_(active_) {
    active_ = this;
    handle_ = at::addThreadLocalCallback(
        at::RecordFunctionCallback(&RecomputeWritesGuard::before_op, &RecomputeWritesGuard::after_op)
            .needsInputs(true)
            .needsOutputs(true)
            .scopes({at::RecordScope::FUNCTION}));
  }
  ~RecomputeWritesGuard() { stop(); }
  RecomputeWritesGuard(const RecomputeWritesGuard&) = delete;
  RecomputeWritesGuard& operator=(const RecomputeWritesGuard&) = delete;

  /// Ends the observation (before the recomputed graph is differentiated: backward's in-place accumulation into
  /// the incoming gradients is no write of fn's). restore() still has what was seen.
  void stop() {
    if (stopped_) return;
    stopped_ = true;
    at::removeCallback(handle_);
    active_ = previous_;
  }

  /// Writes back what the recompute overwrote, in reverse order of the first writes.
  void restore() {
    at::NoGradGuard no_grad;
    Pause pause;
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) it->first.copy_(it->second);
  }

 private:
  // No observation while the guard itself copies (its clones and copy_ are ops too).
  struct Pause {
    Pause() : guard(std::exchange(active_, nullptr)) {}
    ~Pause() { active_ = guard; }
    RecomputeWritesGuard* guard;
  };

  static bool written(const c10::Argument& argument) {
    const auto* alias = argument.alias_info();
    return (alias && alias->isWrite()) || argument.name() == "running_mean" || argument.name() == "running_var";
  }

  static std::unique_ptr<at::ObserverContext> before_op(const at::RecordFunction& fn) {
    RecomputeWritesGuard* self = active_;
    if (!self) return nullptr;
    const auto schema = fn.operator_schema();
    if (!schema) return nullptr;
    const auto& arguments = schema->arguments();
    const auto inputs = fn.inputs();
    for (size_t i = 0; i < inputs.size() && i < arguments.size(); ++i) {
      if (!inputs[i].isTensor() || !written(arguments[i])) continue;
      const at::Tensor& t = inputs[i].toTensor();
      if (!t.defined() || t.requires_grad() || self->made_.count(t.unsafeGetTensorImpl()) ||
          !self->seen_.insert(t.unsafeGetTensorImpl()).second)
        continue;
      Pause pause;
      at::NoGradGuard no_grad;
      self->saved_.emplace_back(t, t.clone());
    }
    return nullptr;
  }

  static void after_op(const at::RecordFunction& fn, at::ObserverContext*) {
    RecomputeWritesGuard* self = active_;
    if (!self) return;
    for (const auto& output : fn.outputs()) {
      if (output.isTensor()) self->made_.insert(output.toTensor().unsafeGetTensorImpl());
    }
  }

  static thread_local RecomputeWritesGuard* active_;
  RecomputeWritesGuard* previous_;
  at::CallbackHandle handle_;
  bool stopped_ = false;
  std::vector<std::pair<at::Tensor, at::Tensor>> saved_;  // (tensor, its value before the recompute)
  std::unordered_set<const c10::TensorImpl*> seen_;        // saved already
  std::unordered_set<const c10::TensorImpl*> made_;        // results of the recompute's ops
};
thread_local RecomputeWritesGuard* RecomputeWritesGuard::active_ = nullptr;

// Replays the forward's random draws in its scope, and gives the caller's generators back their state after.
class RngForkGuard {
 public:
  explicit RngForkGuard(const RngState& forward) : saved_(current_of(forward)) { forward.install(); }
  ~RngForkGuard() { saved_.install(); }
  RngForkGuard(const RngForkGuard&) = delete;
  RngForkGuard& operator=(const RngForkGuard&) = delete;

 private:
  static RngState current_of(const RngState& forward) {
    RngState now;
    for (const auto& entry : forward.states) {
      at::Generator g = entry.first;
      std::lock_guard<std::mutex> lock(g.mutex());
      now.states.emplace_back(g, g.get_state());
    }
    return now;
  }
  RngState saved_;
};

std::vector<at::Tensor> detached(const std::vector<at::Tensor>& inputs, const std::vector<bool>& requires_grad) {
  std::vector<at::Tensor> out;
  out.reserve(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined()) {
      out.emplace_back();
      continue;
    }
    out.push_back(inputs[i].detach());
    if (requires_grad[i]) out.back().requires_grad_(true);
  }
  return out;
}

// The leaves fn's graph ends in, besides its own (detached) inputs. A node created before fn started can only
// be reached through a captured tensor that requires grad: refused, since recompute can't reach past it.
std::vector<at::Tensor> leaves_of(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs,
                                  uint64_t first_node) {
  std::unordered_set<const c10::TensorImpl*> own;
  for (const auto& x : inputs)
    if (x.defined()) own.insert(x.unsafeGetTensorImpl());
  std::unordered_set<const c10::TensorImpl*> seen_leaves;
  std::vector<at::Tensor> leaves;
  auto add_leaf = [&](const at::Tensor& leaf) {
    if (!own.count(leaf.unsafeGetTensorImpl()) && seen_leaves.insert(leaf.unsafeGetTensorImpl()).second)
      leaves.push_back(leaf);
  };
  std::unordered_set<const Node*> seen;
  std::vector<Node*> stack;
  for (const auto& out : outputs) {
    if (!out.defined() || !out.requires_grad()) continue;
    if (const auto& fn = out.grad_fn()) {
      if (seen.insert(fn.get()).second) stack.push_back(fn.get());
    } else {
      add_leaf(out);
    }
  }
  while (!stack.empty()) {
    Node* node = stack.back();
    stack.pop_back();
    if (auto* accumulate = dynamic_cast<torch::autograd::AccumulateGrad*>(node)) {
      if (accumulate->variable.defined()) add_leaf(accumulate->variable);
      continue;
    }
    TORCH_CHECK(node->sequence_nr() >= first_node, kCheckpoint,
                "fn reads a tensor that requires grad and was computed before the checkpoint (its grad_fn is ",
                node->name(), "), through a capture. Pass that tensor to amp::checkpoint as an input "
                "(amp::checkpoint(fn, x, captured)) so its gradient flows; parameters may be captured as they are");
    for (const auto& edge : node->next_edges()) {
      Node* next = edge.function.get();
      if (next && seen.insert(next).second) stack.push_back(next);
    }
  }
  return leaves;
}

class CheckpointBackward final : public Node {
 public:
  CheckpointBody body;
  std::vector<at::Tensor> inputs;  // detached: they share the caller's version counters
  std::vector<int64_t> input_versions;
  std::vector<bool> input_requires_grad;
  std::vector<at::Tensor> leaves;
  std::vector<int64_t> output_slot;  // per output of fn: its input number on this node, or -1 (no gradient)
  CastState casts;
  RngState rng;

  std::string name() const override { return "amp::CheckpointBackward"; }

  void release_variables() override {
    body = nullptr;
    inputs.clear();
    leaves.clear();
    rng.states.clear();
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    TORCH_CHECK(body, kCheckpoint,
                "backward ran through a checkpoint a second time, but its saved inputs were freed after the first "
                "backward; pass retain_graph=true to the first one");
    TORCH_CHECK(!at::GradMode::is_enabled(), kCheckpoint,
                "double backward (create_graph=true) through a checkpoint is not supported; run that part without "
                "amp::checkpoint");
    for (size_t i = 0; i < inputs.size(); ++i) {
      TORCH_CHECK(!inputs[i].defined() || inputs[i]._version() == input_versions[i], kCheckpoint, "input ", i,
                  " was modified in place after the checkpointed forward (version ", input_versions[i], " -> ",
                  inputs[i]._version(), "); recompute would read the new values. Clone it before modifying it");
    }

    // Recompute under the forward's casts and random draws, writing nothing that outlives it (NOTE [A recompute
    // writes nothing that outlives it]).
    std::vector<at::Tensor> xs = detached(inputs, input_requires_grad);
    std::vector<at::Tensor> outs;
    RecomputeWritesGuard writes;
    {
      RngForkGuard replay(rng);
      CastStateGuard cast_state(casts);
      at::AutoGradMode grad_mode(true);
      outs = body(xs);
    }
    writes.stop();
    TORCH_CHECK(outs.size() == output_slot.size(), kCheckpoint, "fn returned ", outs.size(),
                " tensors when recomputed and ", output_slot.size(), " on the first run; fn must be deterministic "
                "in what it returns");

    std::vector<at::Tensor> roots, root_grads;
    for (size_t k = 0; k < outs.size(); ++k) {
      const int64_t slot = output_slot[k];
      if (slot < 0 || !grads[slot].defined() || !outs[k].requires_grad()) continue;
      roots.push_back(outs[k]);
      root_grads.push_back(grads[slot]);
    }
    std::vector<at::Tensor> targets;
    std::vector<size_t> target_edge;  // the next-edge number of each target
    for (size_t i = 0; i < xs.size(); ++i) {
      if (xs[i].defined() && xs[i].requires_grad()) targets.push_back(xs[i]), target_edge.push_back(i);
    }
    for (size_t j = 0; j < leaves.size(); ++j) {
      if (leaves[j].requires_grad()) targets.push_back(leaves[j]), target_edge.push_back(inputs.size() + j);
    }
    torch::autograd::variable_list result(num_outputs());
    if (!roots.empty() && !targets.empty()) {
      auto computed = torch::autograd::grad(roots, targets, root_grads, /*retain_graph=*/false,
                                            /*create_graph=*/false, /*allow_unused=*/true);
      for (size_t t = 0; t < computed.size(); ++t) result[target_edge[t]] = std::move(computed[t]);
    }
    writes.restore();
    return result;
  }
};

// Nodes are held by std::shared_ptr in LibTorch 1.13 and by c10::intrusive_ptr in 2.13.
using NodePtr = decltype(torch::autograd::Edge::function);
template <class T>
auto make_node() {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<Node>>) return std::make_shared<T>();
  else return c10::make_intrusive<T>();
}

}  // namespace

std::vector<at::Tensor> checkpoint(CheckpointBody body, const std::vector<at::Tensor>& inputs) {
  if (!at::GradMode::is_enabled()) return body(inputs);

  std::vector<bool> requires_grad;
  for (const auto& x : inputs) requires_grad.push_back(x.defined() && x.requires_grad());
  const CastState casts = CastState::current();
  RngState rng = RngState::capture(inputs);
  const uint64_t first_node = at::sequence_number::peek();
  std::vector<at::Tensor> xs = detached(inputs, requires_grad);
  std::vector<at::Tensor> outputs;
  {
    CastStateGuard cast_state(casts);
    outputs = body(xs);
  }
  std::vector<at::Tensor> leaves = leaves_of(outputs, xs, first_node);
  const bool any_grad = !leaves.empty() || std::any_of(requires_grad.begin(), requires_grad.end(), [](bool r) { return r; });
  if (!any_grad) return outputs;  // nothing to differentiate: fn's outputs carry no graph

  auto node = make_node<CheckpointBackward>();
  node->body = std::move(body);
  for (const auto& x : inputs) {
    node->inputs.push_back(x.defined() ? x.detach() : at::Tensor());
    node->input_versions.push_back(x.defined() ? x._version() : 0);
  }
  node->input_requires_grad = requires_grad;
  node->casts = casts;
  node->rng = std::move(rng);
  torch::autograd::edge_list edges;
  for (const auto& x : inputs) edges.push_back(x.defined() ? torch::autograd::impl::gradient_edge(x) : torch::autograd::Edge());
  for (const auto& leaf : leaves) edges.push_back(torch::autograd::impl::gradient_edge(leaf));
  node->set_next_edges(std::move(edges));
  node->leaves = std::move(leaves);

  // fn's own graph (and the activations it saved) dies with `outputs`; the results share their storage only.
  std::vector<at::Tensor> results;
  for (const auto& out : outputs) {
    if (!out.defined()) {
      results.emplace_back();
      node->output_slot.push_back(-1);
      continue;
    }
    at::Tensor result = out.variable_data();
    if (out.requires_grad()) {
      node->output_slot.push_back(static_cast<int64_t>(node->num_inputs()));
      torch::autograd::create_gradient_edge(result, node);
    } else {
      node->output_slot.push_back(-1);
    }
    results.push_back(std::move(result));
  }
  return results;
}

}  // namespace amp::detail
