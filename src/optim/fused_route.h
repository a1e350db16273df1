#pragma once
// Which implementation a fused optimizer's step uses for a parameter, and a switch that forces one, so the
// tests can run every route on a CPU machine (ATen's fused kernels are what CUDA parameters use).

namespace amp::optim::detail {

enum class FusedRoute {
  kAuto,     // amp's CPU loop where it applies, ATen's fused kernels on other devices, else per-op
  kAten,     // ATen's _fused_sgd_ / _fused_adam_ / _fused_adamw_ (LibTorch >= 2.4), where it applies
  kPerOp,    // LibTorch's own algorithm, one ATen op after another
};

/// Forces a route for every later step in the process (kAuto restores the default). For tests.
void force_fused_route(FusedRoute route);
/// The route force_fused_route set (kAuto: none).
FusedRoute forced_fused_route();

/// Forces `route` for its lifetime and restores the default after (tests that run one route).
class FusedRouteGuard {
 public:
  explicit FusedRouteGuard(FusedRoute route) { force_fused_route(route); }
  ~FusedRouteGuard() { force_fused_route(FusedRoute::kAuto); }
  FusedRouteGuard(const FusedRouteGuard&) = delete;
  FusedRouteGuard& operator=(const FusedRouteGuard&) = delete;
};

/// Returns whether this build has ATen's fused optimizer kernels.
bool has_aten_fused_optimizers();

}  // namespace amp::optim::detail
