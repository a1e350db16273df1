#pragma once
// The scenarios amp_parallel_worker runs, one a command line (worker_main.cpp has what each checks).

#include "amp/parallel/process_group.h"

namespace amp_worker {

// training_scenarios.cpp
void scenario_train(const amp::parallel::ProcessGroup& group, bool quick);
void scenario_syncbn(const amp::parallel::ProcessGroup& group);
// routing_scenarios.cpp
void scenario_unused(const amp::parallel::ProcessGroup& group);
// feature_scenarios.cpp
void scenario_clip(const amp::parallel::ProcessGroup& group);
void scenario_checkpoint(const amp::parallel::ProcessGroup& group);
void scenario_lean(const amp::parallel::ProcessGroup& group);
void scenario_policy(const amp::parallel::ProcessGroup& group);
void scenario_fp8(const amp::parallel::ProcessGroup& group);
void scenario_torchscript(const amp::parallel::ProcessGroup& group);
void scenario_auto_fp32(const amp::parallel::ProcessGroup& group);
// zero_scenarios.cpp (2 or 4 ranks)
void scenario_zero(const amp::parallel::ProcessGroup& group);
void scenario_zero_sync_free(const amp::parallel::ProcessGroup& group);
void scenario_zero_stage3(const amp::parallel::ProcessGroup& group);
// zero_stage3_scenarios.cpp (2 ranks)
void scenario_zero_stage3_units(const amp::parallel::ProcessGroup& group);
void scenario_zero_bench(const amp::parallel::ProcessGroup& group);
void scenario_zero_python(const amp::parallel::ProcessGroup& group);
void scenario_zero_fsdp2(const amp::parallel::ProcessGroup& group);
void scenario_zero_dies(const amp::parallel::ProcessGroup& group);
// zero_script_scenarios.cpp (2 ranks)
void scenario_zero_scripts(const amp::parallel::ProcessGroup& group);
// failure_scenarios.cpp
void scenario_mismatch(const amp::parallel::ProcessGroup& group);
void scenario_dies(const amp::parallel::ProcessGroup& group);

}  // namespace amp_worker
