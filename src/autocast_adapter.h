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

}  // namespace amp::detail::autocast
