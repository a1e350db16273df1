#include "casting/autocast_adapter.h"

#include <ATen/autocast_mode.h>
#include <torch/version.h>

#include <stdexcept>
#include <string>

#define AMP_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace amp::detail::autocast {
namespace {

void check_device(c10::DeviceType device) {
  if (device != c10::DeviceType::CPU && device != c10::DeviceType::CUDA) {
    throw std::invalid_argument(std::string("amp: per-op casts (O1) support cpu and cuda devices, got ") +
                                c10::DeviceTypeName(device, /*lower_case=*/true));
  }
}

}  // namespace

#if AMP_TORCH_AT_LEAST(2, 4)

bool is_enabled(c10::DeviceType device) { return at::autocast::is_autocast_enabled(device); }
void set_enabled(c10::DeviceType device, bool enabled) {
  check_device(device);
  at::autocast::set_autocast_enabled(device, enabled);
}
c10::ScalarType get_dtype(c10::DeviceType device) { return at::autocast::get_autocast_dtype(device); }
void set_dtype(c10::DeviceType device, c10::ScalarType dtype) {
  check_device(device);
  at::autocast::set_autocast_dtype(device, dtype);
}

#else  // LibTorch 1.13 .. 2.3

bool is_enabled(c10::DeviceType device) {
  return device == c10::DeviceType::CPU ? at::autocast::is_cpu_enabled() : at::autocast::is_enabled();
}
void set_enabled(c10::DeviceType device, bool enabled) {
  check_device(device);
  if (device == c10::DeviceType::CPU) at::autocast::set_cpu_enabled(enabled);
  else at::autocast::set_enabled(enabled);
}
c10::ScalarType get_dtype(c10::DeviceType device) {
  return device == c10::DeviceType::CPU ? at::autocast::get_autocast_cpu_dtype()
                                        : at::autocast::get_autocast_gpu_dtype();
}
void set_dtype(c10::DeviceType device, c10::ScalarType dtype) {
  check_device(device);
  if (device == c10::DeviceType::CPU) {
    if (dtype != c10::ScalarType::BFloat16) {
      throw std::invalid_argument(
          std::string("amp: CPU autocast in LibTorch ") + TORCH_VERSION +
          " computes only bfloat16, so O1 cannot use low_precision_dtype " + c10::toString(dtype) +
          " on the CPU. Use low_precision_dtype(torch::kBFloat16) (config: low_precision_dtype = bfloat16), "
          "run on CUDA, or build against LibTorch >= 2.4.");
    }
    at::autocast::set_autocast_cpu_dtype(dtype);
  } else {
    at::autocast::set_autocast_gpu_dtype(dtype);
  }
}

#endif

bool is_cache_enabled() { return at::autocast::is_autocast_cache_enabled(); }
void set_cache_enabled(bool enabled) { at::autocast::set_autocast_cache_enabled(enabled); }
int increment_nesting() { return at::autocast::increment_nesting(); }
int decrement_nesting() { return at::autocast::decrement_nesting(); }
void clear_cache() { at::autocast::clear_cache(); }

at::Tensor cached_cast(c10::ScalarType dtype, const at::Tensor& t, c10::DeviceType device) {
  return at::autocast::cached_cast(dtype, t, device);
}

}  // namespace amp::detail::autocast
