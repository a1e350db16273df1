#pragma once
// What an amp::parallel::ProcessGroup shares, and the waiting/error helpers every collective uses.

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <exception>
#include <string>

#include "amp/parallel/process_group.h"

namespace amp::parallel::detail {

struct GroupState {
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  c10::intrusive_ptr<c10d::Store> store;  // keeps the rendezvous store alive as long as the group
  int rank = 0;
  int world_size = 1;
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  std::string backend;
};

/// Returns the state behind a ProcessGroup.
const GroupState& state_of(const ProcessGroup& group);

/// Rethrows `error` (from a collective) as a c10::Error saying what amp was doing, on which rank, and the
/// likely cause (another rank failed or left; the timeout), keeping c10d's own message at the end.
[[noreturn]] void rethrow_collective_failure(std::exception_ptr error, const GroupState& group, const std::string& what);

/// Waits for `work`, turning a failure into rethrow_collective_failure's error.
void wait(const c10::intrusive_ptr<c10d::Work>& work, const GroupState& group, const std::string& what);

}  // namespace amp::parallel::detail
