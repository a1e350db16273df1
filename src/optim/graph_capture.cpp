#include "amp/graph_capture.h"

// amp::GraphCaptureGuard: checks that the optimizers' steps can run without the host, then switches them to record
// nothing for it (NOTE [A step that never waits] in src/scaling/device_scale.h).

#include <ATen/Functions.h>

#include <torch/version.h>

#include <string>

#include "amp/fused_optimizers.h"
#include "optim/fused_route.h"
#include "optim/optimizer_access.h"
#include "optim/optimizer_kinds.h"
#include "scaling/device_scale.h"

namespace amp {

GraphCaptureGuard::GraphCaptureGuard(OptimizerBase& optimizer) : GraphCaptureGuard(std::vector<OptimizerBase*>{&optimizer}) {}

GraphCaptureGuard::GraphCaptureGuard(std::vector<OptimizerBase*> optimizers) : optimizers_(std::move(optimizers)) {
  const char* where = "amp::GraphCaptureGuard";
  TORCH_CHECK(!optimizers_.empty(), where, ": the list of optimizers is empty; pass the amp optimizers the captured "
              "step steps.");
  std::vector<c10::Device> devices;  // each one's loss scale's
  for (size_t i = 0; i < optimizers_.size(); ++i) {
    OptimizerBase* o = optimizers_[i];
    TORCH_CHECK(o != nullptr, where, ": optimizer ", i, " of the list is null.");
    TORCH_CHECK(!detail::OptimizerAccess::graph_mode(*o), where, ": optimizer ", i, " is already under a GraphCaptureGuard.");
    const Properties& p = o->properties();
    TORCH_CHECK(p.enabled, where, ": optimizer ", i, " was initialized with enabled = false; amp does nothing a "
                "capture needs to know of. Capture without the guard.");
    const auto* fused = dynamic_cast<const optim::FusedOptimizer*>(&detail::OptimizerAccess::torch_optimizer(*o));
    TORCH_CHECK(fused != nullptr, where, ": optimizer ", i, " is a LibTorch optimizer, whose step can't skip on the "
                "device (its skip is decided on the host, which a replayed graph never asks). Use amp::optim::FusedSGD, "
                "FusedAdam, FusedAdamW, FusedLAMB or FusedMuon.");
    // NOTE [Optimizer kinds]
    const detail::OptimizerKind* kind = detail::kind_of(detail::OptimizerAccess::torch_optimizer(*o));
    TORCH_CHECK(detail::OptimizerAccess::skips_on_device(*o), where, ": optimizer ", i, " must see each overflow on the host (fp8 or "
                "auto_fp32 is on). Capture without them.");
    // Its step skips on the device too, but amp has not made its collectives and gathers capturable.
    TORCH_CHECK(detail::OptimizerAccess::sharding(*o) == nullptr, where, ": optimizer ", i, " is sharded by "
                "amp::parallel::shard_optimizer (ZeRO), whose step's reduce-scatters and all-gathers amp does not capture. "
                "Capture an unsharded optimizer, or step the sharded one eagerly (its skips never wait for the device).");
    TORCH_CHECK((kind != nullptr && kind->skips_without_fused_kernels) || optim::detail::has_aten_fused_optimizers(), where, ": this LibTorch (", TORCH_VERSION, ") has no ATen "
                "fused optimizer kernels (they arrived in LibTorch 2.4), so a fused step runs per op and reads the overflow "
                "flag on the host, which a replayed graph never does. Capture with LibTorch 2.4 or later.");
    // Whatever the host has not seen yet it learns now, before the capture (reads during one are errors).
    const detail::HostSyncScope syncs({o});
    const detail::DeviceScale* scale = detail::OptimizerAccess::settled_device_scale(*o);
    TORCH_CHECK(scale != nullptr, where, ": optimizer ", i, " has not taken a step with amp::scale_loss yet, so its "
                "loss scale and optimizer state do not exist on the device, and a capture can't create them. Run the "
                "recipe's warm-up steps first (docs/cuda.md, \"Capturing the whole step\").");
    devices.push_back(scale->device());
  }
  for (size_t i = 0; i < optimizers_.size(); ++i) detail::OptimizerAccess::enter_graph_mode(*optimizers_[i], devices[i]);
}

GraphCaptureGuard::~GraphCaptureGuard() {
  for (OptimizerBase* o : optimizers_) detail::OptimizerAccess::leave_graph_mode(*o);
}

}  // namespace amp
