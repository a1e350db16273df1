#pragma once
// NOTE [Step ledger]
// Everything an optimizer knows about its steps' outcomes, in one place: how many steps ran and how many were
// skipped, the skip the host decided, and for a step that never waits (NOTE [A step that never waits] in
// src/scaling/device_scale.h) what the device did that the host has not seen yet: the outcomes in order, the next
// step's overflow flag, the gradients' generation, graph mode (amp::GraphCaptureGuard) and the skips counted on the
// device, plus the host syncs all of it cost (NOTE [Counting host syncs]). OptimizerBase holds one; scale_loss, the
// fused steps (through the flag it hands them) and GraphCaptureGuard (through OptimizerAccess) read and write it.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <deque>
#include <memory>

namespace amp::detail {

struct BackwardOutcomeView;
struct OverflowReportView;  // an overflow report whose checks run on the device (src/optim/optimizer.cpp)

struct StepLedger {
  /// What happened on the device that the host has not seen yet.
  struct Pending {
    enum class Kind { kBackward, kReport, kStep, kZeroGrad } kind;
    std::shared_ptr<BackwardOutcomeView> outcome;  // kBackward
    uint64_t grads_generation = 0;                 // the gradients when it happened
    uint64_t step_id = 0;                          // kStep
    std::shared_ptr<OverflowReportView> report;    // kReport
  };

  int64_t steps = 0;          // step() calls, taken or skipped
  int64_t skipped_steps = 0;
  int64_t host_syncs = 0;     // NOTE [Counting host syncs]
  bool skip_next_step = false;  // a backward since the last step overflowed (as far as the host knows)
  int skip_loss_id = 0;
  std::deque<Pending> pending;   // in order
  at::Tensor step_found_inf;     // the next step's overflow flag on the device (the backwards' since the last step)
  uint64_t grads_generation = 0;  // a new one after every backward and zero_grad
  // amp::GraphCaptureGuard: while it lives nothing is recorded for the host; once one lived, the device holds the
  // truth (loss scale, skips, step counts) and the host reads it there.
  bool graph_mode = false;
  bool device_truth = false;
  bool set_found_inf = false;       // the fused step holds a flag this optimizer gave it (not amp::GradScaler's)
  uint64_t settle_after_step = 0;   // the id of a step run with a flag whose outcome the host knew (settled after it)
  at::Tensor device_skips;          // steps skipped on the device since the first guard (fp32, on the loss's device)
};

}  // namespace amp::detail
