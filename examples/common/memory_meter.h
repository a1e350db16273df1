#pragma once
// Counts the bytes of every CPU tensor allocation (model state, gradients, optimizer state and
// activations alike): peak and current, measured from allocations rather than from RSS.
//
//   MemoryMeter& meter = MemoryMeter::install();
//   meter.reset_peak();  ... one training step ...  meter.peak_bytes();

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <torch/version.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <mutex>
#include <unordered_map>

class MemoryMeter final : public c10::Allocator {
 public:
  /// Installs the meter as LibTorch's CPU allocator (once) and returns it.
  static MemoryMeter& install() {
    static MemoryMeter* meter = [] {
      auto* m = new MemoryMeter(c10::GetCPUAllocator());  // lives for the process, like LibTorch's own
      c10::SetCPUAllocator(m, /*priority=*/100);
      return m;
    }();
    return *meter;
  }

  size_t current_bytes() const { return current_.load(); }
  size_t peak_bytes() const { return peak_.load(); }
  void reset_peak() { peak_.store(current_.load()); }

#if TORCH_VERSION_MAJOR >= 2
  c10::DataPtr allocate(size_t n) override { return wrap(n); }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
#else
  c10::DataPtr allocate(size_t n) const override { return const_cast<MemoryMeter*>(this)->wrap(n); }
#endif

 private:
  explicit MemoryMeter(c10::Allocator* base) : base_(base) {}

  // The data pointer doubles as the context (LibTorch's raw_allocate / raw_deleter users need that),
  // so sizes are remembered on the side.
  c10::DataPtr wrap(size_t n) {
    void* data = base_->raw_allocate(n);
    if (data) {
      std::lock_guard<std::mutex> lock(mutex_);
      sizes_[data] = n;
    }
    const size_t now = current_.fetch_add(n) + n;
    size_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
    return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
  }

  static void release(void* data) {
    if (!data) return;
    MemoryMeter& meter = install();
    size_t n = 0;
    {
      std::lock_guard<std::mutex> lock(meter.mutex_);
      auto it = meter.sizes_.find(data);
      n = it->second;
      meter.sizes_.erase(it);
    }
    meter.current_.fetch_sub(n);
    meter.base_->raw_deallocate(data);
  }

 public:
  c10::DeleterFnPtr raw_deleter() const override { return &release; }

 private:
  std::mutex mutex_;
  std::unordered_map<void*, size_t> sizes_;
  c10::Allocator* base_;
  std::atomic<size_t> current_{0};
  std::atomic<size_t> peak_{0};
};
