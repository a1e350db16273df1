#include "amp/autocast_guard.h"

#include "casting/autocast_adapter.h"

namespace amp {
namespace {
thread_local bool amp_casts = false;
thread_local bool apex_rows = true;
}  // namespace

bool detail::amp_casts_active() noexcept { return amp_casts; }
void detail::set_amp_casts_active(bool active) noexcept { amp_casts = active; }
bool detail::apex_rows_active() noexcept { return apex_rows; }
void detail::set_apex_rows_active(bool active) noexcept { apex_rows = active; }

AutocastGuard::AutocastGuard(c10::DeviceType device, c10::ScalarType dtype) : AutocastGuard(device, dtype, true, true) {}

AutocastGuard::AutocastGuard(c10::DeviceType device, c10::ScalarType dtype, bool enabled, bool cache_enabled)
    : device_(device),
      prev_enabled_(detail::autocast::is_enabled(device)),
      prev_dtype_(detail::autocast::get_dtype(device)),
      prev_amp_casts_(amp_casts),
      prev_cache_enabled_(detail::autocast::is_cache_enabled()),
      prev_apex_rows_(apex_rows) {
  detail::register_cast_kernels();
  if (enabled) detail::autocast::set_dtype(device, dtype);  // throws before any state changed
  detail::autocast::set_enabled(device, enabled);
  detail::autocast::set_cache_enabled(cache_enabled);
  detail::autocast::increment_nesting();
  amp_casts = enabled;
  apex_rows = true;
}

AutocastGuard::AutocastGuard(c10::DeviceType device, c10::ScalarType dtype, CastLists lists)
    : AutocastGuard(device, dtype, true, true) {
  apex_rows = lists == CastLists::kApex;
}

AutocastGuard::~AutocastGuard() {
  // Mirrors Python's autocast.__exit__: the outermost region drops the cast cache.
  if (detail::autocast::decrement_nesting() == 0) detail::autocast::clear_cache();
  detail::autocast::set_enabled(device_, prev_enabled_);
  try {
    detail::autocast::set_dtype(device_, prev_dtype_);
  } catch (...) {
    // prev_dtype_ was valid when read; a failure here can't leave a worse state than keeping ours.
  }
  detail::autocast::set_cache_enabled(prev_cache_enabled_);
  amp_casts = prev_amp_casts_;
  apex_rows = prev_apex_rows_;
}

DisableCastsGuard::DisableCastsGuard()
    : prev_cpu_(detail::autocast::is_enabled(c10::DeviceType::CPU)),
      prev_cuda_(detail::autocast::is_enabled(c10::DeviceType::CUDA)),
      prev_amp_casts_(amp_casts) {
  detail::autocast::set_enabled(c10::DeviceType::CPU, false);
  detail::autocast::set_enabled(c10::DeviceType::CUDA, false);
  amp_casts = false;
}

DisableCastsGuard::~DisableCastsGuard() {
  detail::autocast::set_enabled(c10::DeviceType::CPU, prev_cpu_);
  detail::autocast::set_enabled(c10::DeviceType::CUDA, prev_cuda_);
  amp_casts = prev_amp_casts_;
}

}  // namespace amp
