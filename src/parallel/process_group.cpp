#include "amp/parallel/process_group.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/version.h>
#ifdef AMP_WITH_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#include <torch/cuda.h>
#endif

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>

#include "group_state.h"

namespace amp::parallel {
namespace {

constexpr const char* kWhere = "amp::parallel::init_process_group: ";
constexpr const char* kLaunchHint =
    "Launch the program with torchrun (torchrun --standalone --nproc-per-node 2 --no-python ./program ARGS), "
    "or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in every process by hand (for 2 processes on one "
    "machine: RANK=0 and RANK=1, WORLD_SIZE=2, MASTER_ADDR=127.0.0.1, MASTER_PORT=a free port such as 29500).";

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) return std::nullopt;
  return std::string(v);
}

std::string required_env(const char* name) {
  auto v = env(name);
  TORCH_CHECK(v.has_value(), kWhere, "environment variable ", name, " is not set. ", kLaunchHint);
  TORCH_CHECK(!v->empty(), kWhere, "environment variable ", name, " is empty. ", kLaunchHint);
  return *v;
}

long long parse_integer(const char* name, const std::string& text, long long min, long long max,
                        const std::string& range) {
  size_t used = 0;
  long long value = 0;
  bool ok = !text.empty() && (std::isdigit(static_cast<unsigned char>(text[0])) || text[0] == '-');
  if (ok) {
    try {
      value = std::stoll(text, &used);
    } catch (const std::exception&) {
      ok = false;
    }
  }
  TORCH_CHECK(ok && used == text.size(), kWhere, "environment variable ", name, "='", text,
              "' is not an integer; it must be ", range, ". ", kLaunchHint);
  TORCH_CHECK(value >= min && value <= max, kWhere, "environment variable ", name, "=", value, " is out of range; it "
              "must be ", range, ". ", kLaunchHint);
  return value;
}

std::string first_line(const std::exception& e) {
  std::string m;
  if (const auto* c10 = dynamic_cast<const c10::Error*>(&e)) {
    m = c10->what_without_backtrace();
  } else {
    m = e.what();
  }
  const auto nl = m.find('\n');
  return nl == std::string::npos ? m : m.substr(0, nl);
}

bool contains(std::string text, std::string_view word) {
  std::transform(text.begin(), text.end(), text.begin(), [](unsigned char c) { return std::tolower(c); });
  return text.find(word) != std::string::npos;
}

std::string endpoint(const std::string& addr, int port) { return addr + ":" + std::to_string(port); }

// Process-wide count of groups made here: the first uses Python's store prefix "default_pg".
std::atomic<int> groups_made{0};

}  // namespace

namespace detail {

const GroupState& state_of(const ProcessGroup& group) { return *group.state_; }

[[noreturn]] void rethrow_collective_failure(std::exception_ptr error, const GroupState& group, const std::string& what) {
  std::string cause;
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    cause = first_line(e);
  } catch (...) {
    cause = "unknown error";
  }
  if (cause.rfind("amp::parallel", 0) == 0) TORCH_CHECK(false, cause);  // already ours
  TORCH_CHECK(false, "amp::parallel: ", what, " failed on rank ", group.rank, " of ", group.world_size,
              ": another rank failed, exited or stopped taking part, or did not answer within the timeout (",
              std::chrono::duration<double>(group.timeout).count(), " s). Look for the first error among the ranks' "
              "outputs; every rank must run the same sequence of forward/backward passes. (c10d: ", cause, ")");
}

void wait(const c10::intrusive_ptr<c10d::Work>& work, const GroupState& group, const std::string& what) {
  try {
    work->wait();
  } catch (...) {
    rethrow_collective_failure(std::current_exception(), group, what);
  }
}

}  // namespace detail

ProcessGroup::ProcessGroup(std::shared_ptr<detail::GroupState> state) : state_(std::move(state)) {}

ProcessGroup::ProcessGroup(c10::intrusive_ptr<c10d::ProcessGroup> group, std::chrono::milliseconds timeout) {
  TORCH_CHECK(group, "amp::parallel::ProcessGroup: the c10d process group is null.");
  auto state = std::make_shared<detail::GroupState>();
  state->rank = group->getRank();
  state->world_size = group->getSize();
  state->backend = group->getBackendName();
  state->timeout = timeout;
  state->group = std::move(group);
  state_ = std::move(state);
}

int ProcessGroup::rank() const { return state_->rank; }
int ProcessGroup::world_size() const { return state_->world_size; }
c10::intrusive_ptr<c10d::ProcessGroup> ProcessGroup::c10d() const { return state_->group; }
std::string ProcessGroup::backend() const { return state_->backend; }
std::chrono::milliseconds ProcessGroup::timeout() const { return state_->timeout; }

void ProcessGroup::barrier() const {
  // A one-element all-reduce rather than c10d's barrier: the same code path as the gradients on every backend.
  std::vector<at::Tensor> flag{at::zeros({1})};
  detail::wait(state_->group->allreduce(flag), *state_, "barrier");
}

ProcessGroup init_process_group(const InitOptions& options) {
  TORCH_CHECK(options.timeout().count() > 0, kWhere, "the timeout must be positive, got ", options.timeout().count(),
              " ms.");
  std::string backend = options.backend();
  TORCH_CHECK(backend.empty() || backend == "gloo" || backend == "nccl", kWhere, "unknown backend '", backend,
              "'; use \"gloo\" (CPU tensors) or \"nccl\" (CUDA tensors), or leave it empty for gloo on CPU plus nccl "
              "on CUDA where available.");
#ifndef AMP_WITH_NCCL
  TORCH_CHECK(backend != "nccl", kWhere, "backend \"nccl\" needs amp built against a CUDA LibTorch with NCCL "
              "(this build uses a CPU LibTorch ", TORCH_VERSION, "). Use backend \"gloo\" for CPU models, or rebuild "
              "amp with Torch_DIR pointing at a CUDA LibTorch.");
#endif

  const std::string rank_text = required_env("RANK");
  const std::string world_text = required_env("WORLD_SIZE");
  const std::string addr = required_env("MASTER_ADDR");
  const std::string port_text = required_env("MASTER_PORT");
  const int world = static_cast<int>(parse_integer("WORLD_SIZE", world_text, 1, 1 << 20, "a positive integer"));
  const int rank = static_cast<int>(
      parse_integer("RANK", rank_text, 0, world - 1, "in [0, WORLD_SIZE-1] = [0, " + std::to_string(world - 1) + "]"));
  const int port = static_cast<int>(parse_integer("MASTER_PORT", port_text, 1, 65535, "a TCP port in [1, 65535]"));
  if (const auto local = env("LOCAL_RANK")) parse_integer("LOCAL_RANK", *local, 0, 1 << 20, "a non-negative integer");
  const bool agent_store = env("TORCHELASTIC_USE_AGENT_STORE").value_or("") == "True";
  const std::string restart = env("TORCHELASTIC_RESTART_COUNT").value_or("0");
  const auto timeout = options.timeout();
  const double timeout_s = std::chrono::duration<double>(timeout).count();

  // The rendezvous store. torchrun's agent already serves one on MASTER_ADDR:MASTER_PORT, and every rank is
  // its client (Python's env://); by hand, rank 0 serves it and waits for the others.
  c10::intrusive_ptr<c10d::Store> base;
#if TORCH_VERSION_MAJOR < 2
  if (agent_store) {
    // LibTorch 1.13's TCPStore client can't talk to torchrun 2.x's agent store (the wire protocol changed:
    // "Broken pipe"), so under torchrun the ranks meet in a file named after the run instead.
    const std::string run_id = required_env("TORCHELASTIC_RUN_ID");
    const auto path = std::filesystem::temp_directory_path() / ("amp_store_" + run_id + "_" + restart);
    base = c10::make_intrusive<c10d::FileStore>(path.string(), world);
    base->setTimeout(timeout);
  }
#endif
  if (!base) {
    c10d::TCPStoreOptions store_options;
    store_options.port = static_cast<std::uint16_t>(port);
    store_options.isServer = rank == 0 && !agent_store;
    store_options.numWorkers = static_cast<size_t>(world);
    store_options.waitWorkers = !agent_store;
    store_options.timeout = timeout;
    try {
      base = c10::make_intrusive<c10d::TCPStore>(addr, store_options);
    } catch (const std::exception& e) {
      const std::string cause = first_line(e);
      if (store_options.isServer) {
        TORCH_CHECK(!(contains(cause, "in use") || contains(cause, "listen") || contains(cause, "bind")), kWhere,
                    "rank 0 could not serve the rendezvous store on MASTER_PORT ", port,
                    " (MASTER_ADDR=", addr, "): the port is in use, by another job or a previous run still exiting. "
                    "Pick a free port (MASTER_PORT), or let torchrun pick one (--standalone). (c10d: ", cause, ")");
        TORCH_CHECK(false, kWhere, "rank 0 served the rendezvous store on ", endpoint(addr, port), " but not every "
                    "rank joined within the timeout (", timeout_s, " s): WORLD_SIZE=", world, " ranks were expected. "
                    "Start all ranks with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE. (c10d: ", cause, ")");
      }
      TORCH_CHECK(false, kWhere, "rank ", rank, " could not reach the rendezvous store at MASTER_ADDR:MASTER_PORT = ",
                  endpoint(addr, port), " within the timeout (", timeout_s, " s). Is rank 0 (or torchrun) running, "
                  "with the same MASTER_ADDR and MASTER_PORT, and is that address reachable from this machine? "
                  "(c10d: ", cause, ")");
    }
  }
  auto store = c10::make_intrusive<c10d::PrefixStore>("/worker/attempt_" + restart, base);
  const int index = groups_made.fetch_add(1);
  auto group_store = c10::make_intrusive<c10d::PrefixStore>(index == 0 ? "default_pg" : "amp_pg_" + std::to_string(index),
                                                           store);

  c10::intrusive_ptr<c10d::ProcessGroup> group;
  std::string backend_name = backend.empty() ? "gloo" : backend;
  try {
    c10::intrusive_ptr<c10d::ProcessGroupGloo> gloo;
    if (backend != "nccl") {
      auto gloo_options = c10d::ProcessGroupGloo::Options::create(timeout);
      if (const auto ifname = env("GLOO_SOCKET_IFNAME"); ifname && !ifname->empty()) {
        gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(*ifname));
      } else {
        gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(addr));
      }
      gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(group_store, rank, world, gloo_options);
    }
#if TORCH_VERSION_MAJOR >= 2
    // 2.x: a backend per device type behind one ProcessGroup (what Python's _new_process_group_helper builds).
    group = c10::make_intrusive<c10d::ProcessGroup>(group_store, rank, world);
    if (gloo) {
      group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, gloo);
      group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
    }
#ifdef AMP_WITH_NCCL
    if (backend == "nccl" || (backend.empty() && torch::cuda::is_available())) {
      auto nccl_options = c10d::ProcessGroupNCCL::Options::create();
      nccl_options->timeout = timeout;
      auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(group_store, rank, world, nccl_options);
      group->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::NCCL, nccl);
      if (backend == "nccl") group->setDefaultBackend(c10d::ProcessGroup::BackendType::NCCL);
      backend_name = backend == "nccl" ? "nccl" : "gloo+nccl";
    }
#endif
    group->setGroupName(index == 0 ? "0" : std::to_string(index));
#else
    group = gloo;  // 1.13: ProcessGroupGloo is a ProcessGroup
#endif
  } catch (const std::exception& e) {
    TORCH_CHECK(false, kWhere, "rank ", rank, " of ", world, " could not connect to the other ranks through the store at ",
                endpoint(addr, port), " within the timeout (", timeout_s, " s): a rank did not start, failed before "
                "joining, or runs with another WORLD_SIZE. (c10d: ", first_line(e), ")");
  }

  auto state = std::make_shared<detail::GroupState>();
  state->group = std::move(group);
  state->store = base;
  state->rank = rank;
  state->world_size = world;
  state->timeout = timeout;
  state->backend = backend_name;
  return ProcessGroup(std::move(state));
}

}  // namespace amp::parallel
