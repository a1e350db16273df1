#include "core/host_sync.h"

#include <atomic>
#include <utility>

namespace amp::detail {
namespace {
std::atomic<int64_t> process_host_syncs{0};
thread_local std::vector<int64_t*> thread_counters;
}  // namespace

void count_host_sync() {
  process_host_syncs.fetch_add(1, std::memory_order_relaxed);
  for (int64_t* counter : thread_counters) ++*counter;
}

int64_t host_sync_count() { return process_host_syncs.load(); }

std::vector<int64_t*> exchange_host_sync_counters(std::vector<int64_t*> counters) {
  return std::exchange(thread_counters, std::move(counters));
}

}  // namespace amp::detail
