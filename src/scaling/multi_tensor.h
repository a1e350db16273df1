#pragma once
// Fused passes over lists of tensors: the unscale + inf/NaN check of a backward and the
// masters -> model copy of an O2 step. Each function makes one pass over the data per
// (device, dtype) group and never syncs with the host; found_inf is read once by the caller.
//
// Where ATen has a kernel (_amp_foreach_non_finite_check_and_unscale_ on CUDA, and on CPU from
// LibTorch 2.3), it is used; otherwise amp's own CPU loop does the same single pass
// (mirroring aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp).

#include <ATen/core/Tensor.h>

#include <utility>
#include <vector>

namespace amp::detail {

/// A 1-element fp32 flag per device, set to 1 when a non-finite value was seen.
class FoundInf {
 public:
  /// Returns the flag for `device`, creating a zeroed one on first use.
  at::Tensor& on(const c10::Device& device);
  /// Returns whether any device saw a non-finite value: the one host sync of a backward.
  bool any() const;
  /// Returns the same answer as a 0-dim bool tensor on `device`, without a host sync.
  at::Tensor any_on(const c10::Device& device) const;

 private:
  std::vector<std::pair<c10::Device, at::Tensor>> flags_;
};

/// The factor gradients are unscaled by, 1/scale rounded to float: a host number, or a [1] fp32 tensor on the
/// loss's device for a backward that never waits (NOTE [A step that never waits] in src/scaling/device_scale.h).
class InvScale {
 public:
  InvScale(double inv_scale) : host_(static_cast<float>(inv_scale)) {}  // NOLINT(runtime/explicit): the host path
  explicit InvScale(at::Tensor factor) : tensor_(std::move(factor)) {}
  /// The factor as a float for amp's CPU loops: a CPU tensor's value is read (no device to wait for); a device
  /// tensor's is waited for and counted.
  float host() const;
  /// The factor as a [1] fp32 tensor on `options`' device.
  at::Tensor on(const at::TensorOptions& options) const;

 private:
  float host_ = 1.0f;
  at::Tensor tensor_;
};

/// Multiplies every tensor by inv_scale in place and records non-finite values in found_inf.
void unscale_(const std::vector<at::Tensor>& tensors, const InvScale& inv_scale, FoundInf& found_inf);

/// Records non-finite values of the tensors in found_inf without changing them (one read pass; on devices
/// without amp's loop, ATen's unscale kernel with a scale of 1, as torch's GradScaler does for fused optimizers).
void check_finite(const std::vector<at::Tensor>& tensors, FoundInf& found_inf);

/// Writes out[i] = in[i] * inv_scale, or adds it to out[i] when accumulate, converting dtypes
/// (fp16/bf16 model grads into fp32 master grads); records non-finite inputs in found_inf.
void unscale_into(const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& out, bool accumulate,
                  const InvScale& inv_scale, FoundInf& found_inf);

/// Copies src[i] into dst[i] (fp32 masters into fp16/bf16 model parameters) without autograd.
void copy_(const std::vector<at::Tensor>& dst, const std::vector<at::Tensor>& src);

/// Returns the norm of order `norm_type` (1, 2 or inf; the caller checks) of all `tensors` together, as a 0-dim
/// fp32 tensor on the first tensor's device, without a host sync; 0 for no tensors. On the CPU one pass per tensor
/// (amp's loop, accumulated in double, rounded once); elsewhere ATen's _foreach_norm per (device, dtype) group and
/// the norm of those norms, as torch.nn.utils.clip_grad_norm_ computes it.
at::Tensor total_norm(const std::vector<at::Tensor>& tensors, double norm_type);

/// Multiplies every tensor in place by the 0-dim fp32 `factor` (the product in fp32, rounded once into a bf16/fp16
/// tensor's dtype, as ATen's mul_), without a host sync.
void mul_(const std::vector<at::Tensor>& tensors, const at::Tensor& factor);

/// Returns whether the build has ATen's fused unscale kernel for `device`.
bool has_aten_unscale_kernel(c10::DeviceType device);

/// Returns whether ATen's fused unscale kernel takes `dtype` on `device` (CUDA has no BFloat16 kernel:
/// pytorch #127176; probed once per device type and dtype, so a build that gains it uses it).
bool aten_unscale_takes(const c10::Device& device, c10::ScalarType dtype);

/// Unscales and checks a group that ATen's kernel cannot take in its own dtype: chunk by chunk through
/// fp32 copies (the kernel's own arithmetic: the product in fp32, rounded once into the gradient's dtype).
void unscale_through_fp32_(const std::vector<at::Tensor>& group, const InvScale& inv_scale, at::Tensor& found_inf);

/// Sends every bfloat16 group through unscale_through_fp32_ while alive (this thread), so that the route
/// CUDA's bf16 gradients take can be tested on the CPU.
class Fp32UnscaleRouteGuard {
 public:
  Fp32UnscaleRouteGuard();
  ~Fp32UnscaleRouteGuard();
  Fp32UnscaleRouteGuard(const Fp32UnscaleRouteGuard&) = delete;
  Fp32UnscaleRouteGuard& operator=(const Fp32UnscaleRouteGuard&) = delete;
  /// How many groups took the route in this process.
  static int64_t groups_routed();

 private:
  bool previous_;
};

}  // namespace amp::detail
