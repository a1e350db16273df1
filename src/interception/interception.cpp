#include "interception/interception.h"

#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <utility>
#include <vector>

namespace amp::detail {
namespace {

using Handlers = std::vector<std::shared_ptr<InterceptionHandler>>;

// The chain, copied on write: a registration (a handful per process, at initialize) publishes a new vector and
// keeps the old ones alive, so a forward in flight never sees one freed and each op reads the chain with one
// atomic load (no lock, no reference count on the hot path).
std::mutex registry_mutex;
std::vector<std::pair<int, std::shared_ptr<InterceptionHandler>>> registry;
std::vector<std::unique_ptr<const Handlers>> published;  // every chain ever published, for the process
std::atomic<const Handlers*> chain{nullptr};
std::atomic<const Handlers*> write_chain{nullptr};  // the handlers that see ops writing into an argument

void interception_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  c10::impl::ExcludeDispatchKeyGuard no_interception(kInterceptionKey);
  keys = keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kInterceptionKey);
  const Handlers* handlers = (op.schema().is_mutable() ? write_chain : chain).load(std::memory_order_acquire);
  if (!handlers) return op.redispatchBoxed(keys, stack);
  InterceptedOp call{op, keys, stack};
  InterceptNext(*handlers, 0)(call);
}

}  // namespace

void InterceptNext::operator()(InterceptedOp& op) const {
  if (index_ == handlers_.size()) return op.op.redispatchBoxed(op.keys, op.stack);
  handlers_[index_]->handle(op, InterceptNext(handlers_, index_ + 1));
}

void register_interception_handler(int order, std::shared_ptr<InterceptionHandler> handler) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry.emplace_back(order, std::move(handler));
  std::stable_sort(registry.begin(), registry.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  auto next = std::make_unique<Handlers>();
  auto writers = std::make_unique<Handlers>();
  for (const auto& entry : registry) {
    next->push_back(entry.second);
    if (entry.second->sees_writes()) writers->push_back(entry.second);
  }
  chain.store(next.get(), std::memory_order_release);
  write_chain.store(writers->empty() ? nullptr : writers.get(), std::memory_order_release);
  published.push_back(std::move(next));
  published.push_back(std::move(writers));
}

void register_interception_fallback() {
  static std::once_flag once;
  std::call_once(once, [] {
    auto& dispatcher = c10::Dispatcher::singleton();
    TORCH_CHECK(!dispatcher.hasBackendFallbackForDispatchKey(kInterceptionKey),
                "amp::initialize: keep_fp32 runs the ops of fp32 modules through the dispatcher's DeferredInit key, "
                "which another library in this process (torchdistx's deferred_init?) already uses. Load only one "
                "of them, or drop keep_fp32 / keep_fp32_types.");
    static torch::Library library(torch::Library::IMPL, "_", kInterceptionKey, __FILE__, __LINE__);
    library.fallback(torch::CppFunction::makeFromBoxedFunction<&interception_fallback>());
  });
}

namespace {
std::mutex contexts_mutex;
std::vector<ForwardContextCapture> context_captures;
}  // namespace

void register_forward_context(ForwardContextCapture capture) {
  std::lock_guard<std::mutex> lock(contexts_mutex);
  context_captures.push_back(std::move(capture));
}

std::vector<ForwardContext> capture_forward_contexts() {
  std::vector<ForwardContextCapture> captures;
  {
    std::lock_guard<std::mutex> lock(contexts_mutex);
    captures = context_captures;
  }
  std::vector<ForwardContext> out;
  for (const auto& capture : captures) {
    if (ForwardContext context = capture()) out.push_back(std::move(context));
  }
  return out;
}

}  // namespace amp::detail
