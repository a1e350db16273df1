#include "parallel/zero_units.h"

// NOTE [Stage 3 units]
// ZeRO stage 3 (FSDP's full shard) keeps each parameter's values in the ranks' shards and makes a unit's parameters
// whole only while something computes with them. LibTorch's modules have no forward hooks (NOTE [Why no forward
// hooks] in src/casting/cast_kernels.cpp), so the trigger is the op: during a DistributedDataParallel's forward the
// interception key is on (NOTE [One interception key]) and this handler, first in the chain and the only one that
// also sees ops writing into an argument, looks each tensor argument's storage up: a parameter's, or a view's of one
// (t(), slicing), names its unit, which is all-gathered before the op runs. The outputs of such an op that need a
// gradient get a hook, which runs just before autograd runs the op's backward (a tensor hook is a pre-hook of its
// grad_fn), and gathers the unit again if it was freed meanwhile: the saved tensors are the parameters themselves,
// whose storage gets its memory back in place. An op that reads a unit with gradients off inside a forward that
// records them runs in a custom autograd function's forward (SyncBatchNorm's), whose backward reads the saved
// parameters with no op to hook: that unit stays whole until backward ends. A unit is freed when the forward ends
// and, in backward, once its
// gradients are on their way (NOTE [Overlapped reduce-scatter] in zero.cpp) or backward ends. A freed parameter keeps
// its shape and dtype and has no memory: anything that reads it outside the forward gets ATen's "data is not
// allocated" error rather than a wrong value (GatheredParametersGuard makes them whole for reading).

#include <ATen/core/ivalue.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "interception/interception.h"
#include "options/format.h"

namespace amp::parallel::detail {
namespace {

// The gatherers of this thread's forwards in flight (one per stage-3 optimizer of the model).
thread_local std::vector<std::pair<UnitGatherer*, std::weak_ptr<UnitGatherer>>> active_gatherers;

const c10::StorageImpl* storage_of(const at::Tensor& t) {
  return t.defined() && t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr;
}

// Finds the units an op's tensor arguments (lists included) belong to.
void units_read(const c10::IValue& v, const UnitGatherer& gatherer, std::vector<int>& out) {
  auto add = [&](const at::Tensor& t) {
    const int unit = storage_of(t) ? gatherer.unit_of(storage_of(t)) : -1;
    if (unit >= 0 && std::find(out.begin(), out.end(), unit) == out.end()) out.push_back(unit);
  };
  if (v.isTensor()) {
    add(v.toTensor());
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorVector()) add(t);
  } else if (v.isList()) {
    for (const c10::IValue& item : v.toListRef()) {
      if (item.isTensor()) add(item.toTensor());
    }
  }
}

void hook_outputs(const c10::IValue& v, const std::weak_ptr<UnitGatherer>& weak, const std::vector<int>& units) {
  auto hook = [&](const at::Tensor& t) {
    if (!t.defined() || !t.requires_grad() || !t.grad_fn()) return;
    at::Tensor(t).register_hook([weak, units](const at::Tensor&) {
      if (const auto gatherer = weak.lock()) {
        for (int unit : units) gatherer->gather(unit, /*backward=*/true);
      }
    });
  };
  if (v.isTensor()) {
    hook(v.toTensor());
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorVector()) hook(t);
  }
}

class ZeroGatherHandler final : public amp::detail::InterceptionHandler {
 public:
  void handle(amp::detail::InterceptedOp& op, const amp::detail::InterceptNext& next) override {
    if (active_gatherers.empty()) return next(op);
    std::vector<std::pair<std::weak_ptr<UnitGatherer>, std::vector<int>>> read;  // per gatherer, the units the op reads
    const c10::IValue* args = op.arguments();
    for (const auto& [gatherer, weak] : active_gatherers) {
      std::vector<int> units;
      for (size_t i = 0; i < op.num_arguments(); ++i) units_read(args[i], *gatherer, units);
      for (int unit : units) gatherer->gather(unit, /*backward=*/false);
      if (!c10::GradMode::is_enabled()) {
        for (int unit : units) gatherer->keep_for_backward(unit);
      }
      if (!units.empty()) read.emplace_back(weak, std::move(units));
    }
    next(op);
    if (read.empty() || !c10::GradMode::is_enabled()) return;
    const size_t n_returns = op.op.schema().returns().size();
    for (const auto& [weak, units] : read) {
      for (size_t i = op.stack->size() - n_returns; i < op.stack->size(); ++i) hook_outputs((*op.stack)[i], weak, units);
    }
  }
  bool sees_writes() const override { return true; }
};

// amp::checkpoint recomputes a region in backward, after the forward's gathering ended: it re-enters this thread's
// gatherers for the recompute, whose ops then gather what they read (and hook their outputs) as the forward's did.
amp::detail::ForwardContext capture_gatherers() {
  if (active_gatherers.empty()) return nullptr;
  std::vector<std::weak_ptr<UnitGatherer>> captured;
  for (const auto& entry : active_gatherers) captured.push_back(entry.second);
  return [captured] {
    auto scopes = std::make_shared<std::vector<std::shared_ptr<void>>>();
    for (const auto& weak : captured) {
      if (const auto gatherer = weak.lock()) scopes->push_back(gather_in_forward(gatherer, nullptr));
    }
    return std::shared_ptr<void>(scopes);
  };
}

void register_gather_handler() {
  static std::once_flag once;
  std::call_once(once, [] {
    amp::detail::register_interception_fallback();
    amp::detail::register_interception_handler(amp::detail::kZeroGatherOrder, std::make_shared<ZeroGatherHandler>());
    amp::detail::register_forward_context(capture_gatherers);
  });
}

struct ForwardGathering {
  UnitGatherer* gatherer = nullptr;
  std::function<void()> on_end;
  std::optional<c10::impl::IncludeDispatchKeyGuard> key;

  ~ForwardGathering() {
    key.reset();
    --amp::detail::gathering_forwards();
    const auto it = std::find_if(active_gatherers.begin(), active_gatherers.end(),
                                 [this](const auto& entry) { return entry.first == gatherer; });
    if (it != active_gatherers.end()) active_gatherers.erase(it);
    try {
      if (on_end) on_end();
    } catch (...) {
      // Freeing gives memory back and waits for gathers every rank started; a failed one fails the next collective.
    }
  }
};

}  // namespace

std::vector<ZeroUnit> resolve_units(const torch::nn::Module& module, const std::vector<std::string>& patterns,
                                    const char* where) {
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> chosen;
  if (patterns.empty()) {
    for (const auto& item : module.named_children()) chosen.emplace_back(item.key(), item.value());
  } else {
    const auto modules = module.named_modules("", /*include_self=*/false);
    std::vector<bool> used(patterns.size(), false);
    std::vector<std::string> names;
    for (const auto& item : modules) {
      names.push_back(item.key());
      bool match = false;
      for (size_t i = 0; i < patterns.size(); ++i) {
        if (!amp::detail::glob_match(patterns[i], item.key())) continue;
        used[i] = true;
        match = true;
      }
      const bool inside = std::any_of(chosen.begin(), chosen.end(), [&](const auto& c) {
        return item.key().rfind(c.first + ".", 0) == 0;
      });
      if (match && !inside) chosen.emplace_back(item.key(), item.value());
    }
    for (size_t i = 0; i < patterns.size(); ++i) {
      if (used[i]) continue;
      const auto close = amp::detail::closest_names(patterns[i], names);
      std::string hint;
      for (const auto& n : close) hint += (hint.empty() ? "" : ", ") + ("'" + n + "'");
      TORCH_CHECK(false, where, ": the stage-3 unit pattern '", patterns[i], "' (ZeroOptions::units) matches no module "
                  "of the model", hint.empty() ? std::string(" (it has no submodules)") : "; closest: " + hint,
                  ". Units are qualified module names as named_modules() gives them ('*' matches any characters).");
    }
  }
  std::vector<ZeroUnit> units;
  std::unordered_set<const c10::TensorImpl*> taken;
  for (const auto& [name, child] : chosen) {
    ZeroUnit unit{name, {}};
    for (const auto& p : child->parameters(/*recurse=*/true)) {
      if (taken.insert(p.unsafeGetTensorImpl()).second) unit.params.push_back(p);
    }
    if (!unit.params.empty()) units.push_back(std::move(unit));
  }
  ZeroUnit root{"<root>", {}};
  for (const auto& p : module.parameters(/*recurse=*/true)) {
    if (taken.insert(p.unsafeGetTensorImpl()).second) root.params.push_back(p);
  }
  if (!root.params.empty()) units.push_back(std::move(root));
  return units;
}

void release_storage(const at::Tensor& t) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  storage->set_nbytes(0);
}

void materialize_storage(const at::Tensor& t, size_t nbytes) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  c10::Allocator* allocator = storage->allocator() ? storage->allocator() : c10::GetAllocator(t.device().type());
  storage->set_data_ptr_noswap(allocator->allocate(nbytes));
  storage->set_nbytes(nbytes);
}

std::shared_ptr<void> gather_in_forward(const std::shared_ptr<UnitGatherer>& gatherer, std::function<void()> on_end) {
  register_gather_handler();  // the key is never on without the handler
  auto scope = std::make_shared<ForwardGathering>();
  scope->gatherer = gatherer.get();
  scope->on_end = std::move(on_end);
  active_gatherers.emplace_back(gatherer.get(), gatherer);
  ++amp::detail::gathering_forwards();
  scope->key.emplace(amp::detail::kInterceptionKey);
  return scope;
}

}  // namespace amp::parallel::detail
