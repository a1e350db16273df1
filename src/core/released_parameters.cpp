#include "core/released_parameters.h"

#include <atomic>
#include <mutex>
#include <unordered_map>

namespace amp::detail {
namespace {
std::mutex whole_scopes_mutex;
std::unordered_map<const c10::StorageImpl*, WholeOwner> whole_scopes;  // a storage reused later is registered anew
std::atomic<int> stage3_shardings{0};
}  // namespace

void count_stage3_shardings(int delta) { stage3_shardings.fetch_add(delta); }

bool stage3_shardings_exist() { return stage3_shardings.load(std::memory_order_relaxed) > 0; }

int& gathering_forwards() {
  thread_local int depth = 0;
  return depth;
}

void register_whole_scope(const c10::StorageImpl* storage, WholeOwner owner) {
  std::lock_guard<std::mutex> lock(whole_scopes_mutex);
  whole_scopes[storage] = std::move(owner);
}

WholeOwner whole_owner_of(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return {};
  std::lock_guard<std::mutex> lock(whole_scopes_mutex);
  const auto it = whole_scopes.find(t.storage().unsafeGetStorageImpl());
  return it == whole_scopes.end() ? WholeOwner{} : it->second;
}

}  // namespace amp::detail
