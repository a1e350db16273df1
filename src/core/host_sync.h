// The host-sync counter (NOTE [Counting host syncs] in src/optim/optimizer.cpp). It sits below every layer, since
// casting (FP8 auto_fallback, auto_fp32's diagnosis), scaling (the overflow flag) and the optimizer all count.
#pragma once

#include <cstdint>
#include <vector>

namespace amp::detail {

/// Counts one read of a device value on the host: for the process (host_sync_count) and for each counter this
/// thread has in place (exchange_host_sync_counters).
void count_host_sync();

/// Returns how many host syncs amp made in this process (the benchmarks count host syncs per step with it).
int64_t host_sync_count();

/// Makes `counters` the ones count_host_sync adds to on this thread and returns the ones it replaces (an optimizer's
/// own count while it steps or backs a scaled loss: detail::HostSyncScope, include/amp/optimizer.h).
std::vector<int64_t*> exchange_host_sync_counters(std::vector<int64_t*> counters);

}  // namespace amp::detail
