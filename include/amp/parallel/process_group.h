#pragma once
// A c10d process group built from torchrun's environment (Apex's torch.distributed.init_process_group).

#include <c10/util/intrusive_ptr.h>
#include <torch/arg.h>

#include <chrono>
#include <memory>
#include <string>

namespace c10d {
class ProcessGroup;
}

namespace amp::parallel {

/// Options of init_process_group.
///
/// Example:
///   auto group = amp::parallel::init_process_group(
///       amp::parallel::InitOptions().backend("gloo").timeout(std::chrono::seconds(60)));
struct InitOptions {
  /// The backend: "gloo" (CPU tensors) or "nccl" (CUDA tensors; only in a CUDA build of amp).
  /// Empty (the default): gloo for CPU tensors, plus nccl for CUDA tensors where amp was built with NCCL and
  /// a GPU is present (Python's default "cpu:gloo,cuda:nccl").
  TORCH_ARG(std::string, backend);
  /// How long joining the group and each collective may wait for the other ranks before failing
  /// (torch.distributed's default, 30 minutes).
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(30);
};

class ProcessGroup;
namespace detail {
struct GroupState;
const GroupState& state_of(const ProcessGroup& group);
}  // namespace detail

/// A process group: this process's rank among world_size ranks and the c10d group they share.
/// Copies share the group. Built by init_process_group, or from a c10d group you made yourself.
class ProcessGroup {
 public:
  /// Wraps an existing c10d process group (a null pointer throws).
  explicit ProcessGroup(c10::intrusive_ptr<c10d::ProcessGroup> group,
                        std::chrono::milliseconds timeout = std::chrono::minutes(30));

  /// Returns this process's rank, in [0, world_size).
  int rank() const;
  /// Returns the number of ranks.
  int world_size() const;
  /// Returns the c10d process group (include <torch/csrc/distributed/c10d/ProcessGroup.hpp> to use it).
  c10::intrusive_ptr<c10d::ProcessGroup> c10d() const;
  /// Returns the backend's name ("gloo", "nccl").
  std::string backend() const;
  /// Returns the timeout collectives were given.
  std::chrono::milliseconds timeout() const;
  /// Waits until every rank has called barrier() (a small all-reduce; errors name a missing rank).
  void barrier() const;

 private:
  friend ProcessGroup init_process_group(const InitOptions& options);
  friend const detail::GroupState& detail::state_of(const ProcessGroup& group);
  explicit ProcessGroup(std::shared_ptr<detail::GroupState> state);
  std::shared_ptr<detail::GroupState> state_;
};

/// Joins the process group described by the environment, as torchrun sets it or as set by hand:
/// RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (LOCAL_RANK and TORCHELASTIC_* when present). Under
/// torchrun the launcher's store is used; by hand, rank 0 serves it on MASTER_ADDR:MASTER_PORT. A missing
/// or malformed variable, a port already in use or a rank that never shows up throws an error naming it,
/// within options.timeout().
///
/// Example (2 ranks on one machine):
///   torchrun --standalone --nproc-per-node 2 --no-python ./trainer --config O2_bf16.ini
///   auto group = amp::parallel::init_process_group();
ProcessGroup init_process_group(const InitOptions& options = {});

}  // namespace amp::parallel
