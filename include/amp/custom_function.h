#pragma once
// torch.amp.custom_fwd / custom_bwd for LibTorch's custom autograd functions (torch::autograd::Function<T>):
// guards that give a function's backward the autocast state its forward ran under (amp's O1 casts included), and
// optionally run the forward in one dtype with autocast off.

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <torch/csrc/autograd/custom_function.h>

#include <memory>
#include <optional>
#include <vector>

namespace amp {
namespace detail {
class PrecisionPolicyGuard;
}  // namespace detail

/// A RAII, thread local (!) guard for the forward of a torch::autograd::Function<T>, torch.amp.custom_fwd's
/// counterpart: construct it first thing in forward, with the forward's ctx, and a CustomBwdGuard first thing
/// in backward.
///
///  - Without `cast_inputs`, it records the caller's cast state in `ctx` and changes nothing: the forward runs
///    under the caller's autocast (its ops cast as they would outside the function), and backward re-enters
///    that state through CustomBwdGuard, although the autograd engine runs backward where it was called,
///    usually outside any autocast region.
///  - With `cast_inputs`, when autocast was on at the call, it turns autocast (and amp's O1 casts) off for its
///    lifetime, cast() converts the floating-point inputs to `cast_inputs`, and backward runs with autocast off.
///    When autocast was off at the call, cast() returns its input as it is and nothing is turned off.
///
/// NOTE [Which device]
/// torch's decorators take a device_type and look at that device's autocast only. These guards take no
/// device: they record and re-enter the whole cast state, as amp::checkpoint does (CPU and CUDA autocast, each
/// with its enabled flag and dtype, plus whether amp's own O1 casts and Apex's rows were active), so one
/// function works unchanged under CPU or CUDA autocast, or under both. cast() converts a tensor when autocast
/// of that tensor's device type (CPU or CUDA) was on at the call, and only then.
///
/// The state is kept in `ctx->saved_data` under keys beginning with "amp." (leave them alone).
///
/// Example:
///   struct MatMul : torch::autograd::Function<MatMul> {
///     static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor a, torch::Tensor b) {
///       amp::CustomFwdGuard guard(ctx, torch::kFloat);   // or amp::CustomFwdGuard guard(ctx);
///       a = guard.cast(a), b = guard.cast(b);             // fp32 under autocast
///       ctx->save_for_backward({a, b});
///       return a.mm(b);
///     }
///     static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
///                                                    torch::autograd::variable_list grads) {
///       amp::CustomBwdGuard guard(ctx);                   // the forward's autocast state
///       const auto saved = ctx->get_saved_variables();
///       return {grads[0].mm(saved[1].t()), saved[0].t().mm(grads[0])};
///     }
///   };
class CustomFwdGuard {
 public:
  /// Records the caller's cast state in `ctx`; with `cast_inputs` (a floating-point dtype), turns autocast off
  /// for the guard's lifetime where it was on. Throws when `ctx` is null or `cast_inputs` is not floating-point.
  explicit CustomFwdGuard(torch::autograd::AutogradContext* ctx,
                          std::optional<c10::ScalarType> cast_inputs = std::nullopt);
  /// Restores the autocast state the guard turned off.
  ~CustomFwdGuard();
  CustomFwdGuard(const CustomFwdGuard&) = delete;
  CustomFwdGuard& operator=(const CustomFwdGuard&) = delete;
  CustomFwdGuard(CustomFwdGuard&&) = delete;
  CustomFwdGuard& operator=(CustomFwdGuard&&) = delete;

  /// Returns `input` converted to `cast_inputs` where it is a floating-point tensor other than float64 on a
  /// device whose autocast was on at the call (torch's _cast rule); otherwise returns `input` itself. The
  /// identity without `cast_inputs`.
  at::Tensor cast(const at::Tensor& input) const;
  /// Returns cast() of each tensor (torch's custom_fwd casts tensors inside containers too).
  std::vector<at::Tensor> cast(std::vector<at::Tensor> inputs) const;

 private:
  std::optional<c10::ScalarType> cast_inputs_;
  bool cast_cpu_ = false;    // cast() converts CPU tensors: CPU autocast was on at the call
  bool cast_cuda_ = false;   // cast() converts CUDA tensors: CUDA autocast was on at the call
  bool turned_off_ = false;  // the destructor gives back the state below
  bool prev_cpu_ = false;
  bool prev_cuda_ = false;
  bool prev_amp_casts_ = false;
};

/// A RAII, thread local (!) guard for the backward of a torch::autograd::Function<T>, torch.amp.custom_bwd's
/// counterpart: runs its scope under the cast state the CustomFwdGuard of the same `ctx` recorded (autocast
/// on or off per device, with the forward's dtypes, amp's O1 casts if the forward ran under an
/// amp::AutocastGuard, and the model's fp32 islands if it ran inside an amp::Model's forward: ops reading an
/// island's tensors run in fp32 as they did in the forward), and restores the previous state on destruction; as torch's autocast region, the
/// outermost one drops the weight-cast cache. Throws when `ctx` is null or its forward built no
/// CustomFwdGuard.
class CustomBwdGuard {
 public:
  explicit CustomBwdGuard(torch::autograd::AutogradContext* ctx);
  ~CustomBwdGuard();
  CustomBwdGuard(const CustomBwdGuard&) = delete;
  CustomBwdGuard& operator=(const CustomBwdGuard&) = delete;
  CustomBwdGuard(CustomBwdGuard&&) = delete;
  CustomBwdGuard& operator=(CustomBwdGuard&&) = delete;

 private:
  bool prev_cpu_;
  c10::ScalarType prev_cpu_dtype_;
  bool prev_cuda_;
  c10::ScalarType prev_cuda_dtype_;
  bool prev_amp_casts_;
  bool prev_apex_rows_;
  std::unique_ptr<detail::PrecisionPolicyGuard> policy_;  // the forward's fp32 islands, where it had some
};

}  // namespace amp
