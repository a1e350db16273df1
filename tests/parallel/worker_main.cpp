// One rank of the multi-process amp::parallel tests (tests/parallel_test.cpp launches two of these, by hand
// and through torchrun). Usage: amp_parallel_worker SCENARIO. Every check prints one line
// "[rank R] ok|FAIL <name>: <details>"; the exit code is 0 when every check passed on this rank.
//
// Scenarios:
//   train    O0/O1/O2 training on 2 ranks x half batch against 1 process x full batch (computed on each rank),
//            parameters/masters/momentum/loss scale bit-identical across ranks after every step, an inf on one
//            rank's batch skipping the step everywhere, delay_allreduce, allreduce_always_fp32,
//            gradient_predivide_factor, frozen parameters, two losses, no_sync accumulation and its misuse.
//   quick    O2 bf16 only (the torchrun launch).
//   syncbn   SyncBatchNorm against BatchNorm on the whole batch (fp32, bf16, uneven batches), convert_syncbn_model
//            + O2 training, buffers broadcast before each forward.
//   mismatch rank 1 builds a different model: make_distributed throws on both ranks, naming the parameter.
//   dies     rank 1 exits after joining; rank 0's next backward fails with amp's error within the timeout.
//   unused   delay_allreduce with parameters only some ranks reach (MoE-style routing to head a or b, head c never
//            used): O0/O2 against 1 process x full batch, ranks bit-identical, no_sync accumulation, an inf routed
//            to a head only one rank reached, heads no rank reached keep no gradient (torch's find_unused_parameters).
//   clip, checkpoint, lean, policy, fp8, torchscript, auto_fp32: amp's features under amp::parallel (feature_scenarios.cpp).
//   zero     ZeRO stage 1 and 2 (2 or 4 ranks) against unsharded replicas, archives, misuse (zero_scenarios.cpp);
//            zero_python: O0 against torch's DDP + ZeroRedundancyOptimizer (tests/python/zero.py); zero_fsdp2: O2 bf16
//            against PyTorch's FSDP2 (tests/python/fsdp2.py); zero_dies: a rank exits mid-step under stage 2;
//            zero_bench: the byte table.
//   zero_scripts  what real scripts change under ZeRO: param groups added (progressive unfreezing), lr schedules,
//            no_sync() accumulation in fp32, and the changes refused (zero_script_scenarios.cpp).
//
// The scenarios live by concern: training_scenarios.cpp (train, quick, syncbn), routing_scenarios.cpp (unused),
// feature_scenarios.cpp, failure_scenarios.cpp (mismatch, dies); step_loop.h is the loop train and unused share.

#include <torch/utils.h>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <map>
#include <string>

#include "amp/parallel/process_group.h"
#include "options/exception_message.h"
#include "scenarios.h"
#include "worker_support.h"

namespace {

using amp_worker::ProcessGroup;

const std::map<std::string, std::function<void(const ProcessGroup&)>> kScenarios = {
    {"train", [](const ProcessGroup& group) { amp_worker::scenario_train(group, /*quick=*/false); }},
    {"quick", [](const ProcessGroup& group) { amp_worker::scenario_train(group, /*quick=*/true); }},
    {"syncbn", amp_worker::scenario_syncbn},
    {"unused", amp_worker::scenario_unused},
    {"clip", amp_worker::scenario_clip},
    {"checkpoint", amp_worker::scenario_checkpoint},
    {"lean", amp_worker::scenario_lean},
    {"policy", amp_worker::scenario_policy},
    {"fp8", amp_worker::scenario_fp8},
    {"torchscript", amp_worker::scenario_torchscript},
    {"auto_fp32", amp_worker::scenario_auto_fp32},
    {"mismatch", amp_worker::scenario_mismatch},
    {"dies", amp_worker::scenario_dies},
    {"zero", amp_worker::scenario_zero},
    {"zero_sync_free", amp_worker::scenario_zero_sync_free},
    {"zero_stage3", amp_worker::scenario_zero_stage3},
    {"zero_stage3_units", amp_worker::scenario_zero_stage3_units},
    {"zero_bench", amp_worker::scenario_zero_bench},
    {"zero_python", amp_worker::scenario_zero_python},
    {"zero_fsdp2", amp_worker::scenario_zero_fsdp2},
    {"zero_dies", amp_worker::scenario_zero_dies},
    {"zero_scripts", amp_worker::scenario_zero_scripts},
};

}  // namespace

int main(int argc, char** argv) {
  using namespace amp_worker;
  if (argc < 2) {
    std::cerr << "usage: amp_parallel_worker SCENARIO, one of:";
    for (const auto& [name, run] : kScenarios) std::cerr << " " << name;
    std::cerr << std::endl;
    return 2;
  }
  const std::string scenario = argv[1];
  torch::set_num_threads(1);
  int group_rank = 0;
  try {
    const auto timeout = std::chrono::seconds(std::getenv("AMP_TEST_TIMEOUT_S") ? std::atoi(std::getenv("AMP_TEST_TIMEOUT_S")) : 60);
    const ProcessGroup group = amp::parallel::init_process_group(amp::parallel::InitOptions().timeout(timeout));
    group_rank = group.rank();
    set_rank(group_rank);
    const char* expected = std::getenv("WORLD_SIZE");
    report(group.world_size() == (expected ? std::atoi(expected) : 2), "joined the group", "rank " + std::to_string(group.rank()) + " of " +
                                                            std::to_string(group.world_size()) + ", backend " + group.backend());
    const auto run = kScenarios.find(scenario);
    if (run == kScenarios.end()) {
      std::cerr << "unknown scenario " << scenario << std::endl;
      return 2;
    }
    run->second(group);
    if (scenario == "dies" || scenario == "zero_dies") return failures() == 0 ? 0 : 1;  // no barrier: the other rank is gone
    group.barrier();
  } catch (const std::exception& e) {
    report(false, "uncaught exception", amp::detail::message_of(e));
    return 1;
  }
  std::cout << "[rank " << group_rank << "] " << (failures() == 0 ? "ALL OK" : std::to_string(failures()) + " FAILED")
            << std::endl;
  return failures() == 0 ? 0 : 1;
}
