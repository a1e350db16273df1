#pragma once
// Capturing amp's whole training step (forward, scale_loss's backward, step) in one CUDA graph.

#include <vector>

#include "amp/optimizer.h"

namespace amp {

/// While alive, the backwards and steps of `optimizers` record nothing for the host: the loss scale, the overflow
/// flag, the skip, the Adam and LAMB step counts, the stochastic-rounding draw counters and a count of skipped steps
/// stay on the device, so a CUDA graph captured around them (at::cuda::CUDAGraph) replays the whole step without the
/// host (docs/cuda.md, "Capturing the whole step"). From its construction on, the device holds these optimizers'
/// truth: loss_scale(), skipped_steps() and torch::save read it there, each read waiting once (counted:
/// amp::host_sync_count).
///
/// It needs what capture needs, and throws naming what is missing: amp's fused optimizers (FusedSGD, FusedAdam,
/// FusedAdamW, FusedLAMB, FusedMuon) with any state and master format, no feature that must see each overflow on the
/// host (fp8, auto_fp32), no ZeRO sharding (amp does not capture its collectives), and one eager step already taken
/// (the warm-up creates the optimizer state and the loss scale on the device).
///
/// Example:
///   for (int i = 0; i < 3; ++i) train_step();                   // warm-up, on a side stream
///   at::cuda::CUDAGraph graph;
///   {
///     amp::GraphCaptureGuard capture(optimizer);
///     graph.capture_begin();
///     train_step();                                            // zero_grad, forward, scale_loss(...).backward(), step
///     graph.capture_end();
///   }
///   for (...) { static_x.copy_(x); static_y.copy_(y); graph.replay(); }
class GraphCaptureGuard {
 public:
  explicit GraphCaptureGuard(std::vector<OptimizerBase*> optimizers);
  explicit GraphCaptureGuard(OptimizerBase& optimizer);
  ~GraphCaptureGuard();
  GraphCaptureGuard(const GraphCaptureGuard&) = delete;
  GraphCaptureGuard& operator=(const GraphCaptureGuard&) = delete;

 private:
  std::vector<OptimizerBase*> optimizers_;
};

}  // namespace amp
