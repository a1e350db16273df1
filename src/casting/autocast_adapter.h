#pragma once
// The one place that touches ATen's version-dependent autocast API (ATen/autocast_mode.h):
// LibTorch 1.13 has set_enabled / set_cpu_enabled and per-device dtype setters; 2.4+ has
// set_autocast_enabled(DeviceType, bool) and set_autocast_dtype(DeviceType, ScalarType).
// Everything else in amp calls these functions.

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

namespace amp::detail::autocast {

bool is_enabled(c10::DeviceType device);
void set_enabled(c10::DeviceType device, bool enabled);
c10::ScalarType get_dtype(c10::DeviceType device);
/// Throws std::invalid_argument where the build's autocast can't use `dtype` on `device`
/// (LibTorch 1.13 CPU autocast computes bfloat16 only).
void set_dtype(c10::DeviceType device, c10::ScalarType dtype);
bool is_cache_enabled();
void set_cache_enabled(bool enabled);
int increment_nesting();
int decrement_nesting();
void clear_cache();
/// Casts `t` to `dtype` through autocast's weight-cast cache (fp32 leaf parameters are cast once per region).
at::Tensor cached_cast(c10::ScalarType dtype, const at::Tensor& t, c10::DeviceType device);

/// torch.autocast's region (its __enter__ / __exit__) against ATen alone: the build's own lists, no amp guard.
/// The reference the tests and benchmarks hold amp's O1 to.
class NativeAutocastGuard {
 public:
  NativeAutocastGuard(c10::DeviceType device, c10::ScalarType dtype)
      : device_(device), was_enabled_(is_enabled(device)), was_dtype_(get_dtype(device)) {
    set_dtype(device, dtype);
    set_enabled(device, true);
    increment_nesting();
  }
  ~NativeAutocastGuard() {
    if (decrement_nesting() == 0) clear_cache();
    set_enabled(device_, was_enabled_);
    set_dtype(device_, was_dtype_);
  }
  NativeAutocastGuard(const NativeAutocastGuard&) = delete;
  NativeAutocastGuard& operator=(const NativeAutocastGuard&) = delete;

 private:
  c10::DeviceType device_;
  bool was_enabled_;
  c10::ScalarType was_dtype_;
};

}  // namespace amp::detail::autocast
