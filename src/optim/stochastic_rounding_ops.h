#pragma once
// Stochastic rounding to bfloat16 in ATen ops, for tensors on a device: the generator and the bits of the CPU loops'
// (stochastic_rounding.h: draw g of stream `seed` is 16 bits of random_bits(seed, g / 4)), with the first draw's
// number a tensor on the values' device, so a step whose skip the device decides keeps its draw count there too
// (NOTE [Stored moments on the device] in fused_optimizers.cpp).

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace amp::detail {

/// How many values one 64-bit draw serves: bf16 moments take 16 bits of draw g / 4 for their element g (kFour), lean
/// masters the low 16 bits of draw g (kOne).
enum class ValuesPerDraw { kOne = 1, kFour = 4 };

/// `values` (fp32) rounded to bfloat16 stochastically, element i (row-major) taking number `first + i` of stream
/// `seed`, where `first` is a 0-dim int64 tensor holding the number's bits: bit for bit round_stochastically of
/// random_bits, as the CPU loops write them. Reads nothing on the host.
at::Tensor round_bf16_stochastically(const at::Tensor& values, uint64_t seed, const at::Tensor& first,
                                     ValuesPerDraw per_draw = ValuesPerDraw::kFour);

/// How many draws a generator (bf16 moments', stochastic-rounding masters') has used: on the host, and, once a step
/// has drawn on a device, there too, kept across steps. A step whose skip the device decides advances the device's
/// count only where the step was taken and the host's always, until the host learns of the skip (rewind) or reads
/// the device's count back (pull: a graph capture's steps, which the host never settles).
class DrawCounter {
 public:
  explicit DrawCounter(uint64_t value = 0) : host_(value) {}
  uint64_t value() const noexcept { return host_; }
  /// Sets the count (a checkpoint's, another table's); the device's is made again from it at the next on().
  void set(uint64_t value) noexcept;
  /// The count as a 0-dim int64 tensor on `device` (made from the host's where that changed).
  at::Tensor on(const c10::Device& device);
  /// Moves past `by` draws; `skipped` (a 0-dim bool on the device, or undefined) holds the device's count back.
  void advance(uint64_t by, const at::Tensor& skipped = at::Tensor());
  /// A skip the host learned of after advance(by, skipped).
  void rewind(uint64_t by) noexcept;
  /// Reads the device's count into the host's, where the device's may be behind; counted as a host sync.
  void pull();

 private:
  uint64_t host_;
  at::Tensor device_;         // int64 bits of the count, on the device of the last on()
  uint64_t device_host_ = 0;  // the host count device_ equals unless the device skipped
};

}  // namespace amp::detail
