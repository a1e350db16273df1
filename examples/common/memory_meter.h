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
  struct Block {
    c10::DataPtr inner;
    size_t bytes;
    MemoryMeter* meter;
  };

  explicit MemoryMeter(c10::Allocator* base) : base_(base) {}

  c10::DataPtr wrap(size_t n) {
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    const c10::Device device = inner.device();
    auto* block = new Block{std::move(inner), n, this};
    const size_t now = current_.fetch_add(n) + n;
    size_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
    return {data, block, &release, device};
  }

  static void release(void* ctx) {
    auto* block = static_cast<Block*>(ctx);
    block->meter->current_.fetch_sub(block->bytes);
    delete block;
  }

  c10::Allocator* base_;
  std::atomic<size_t> current_{0};
  std::atomic<size_t> peak_{0};
};
