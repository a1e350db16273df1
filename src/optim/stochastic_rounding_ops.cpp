#include "optim/stochastic_rounding_ops.h"

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <c10/core/GradMode.h>

#include "core/host_sync.h"

namespace amp::detail {
namespace {

// int64 tensors hold uint64's bits: + and * wrap as uint64's do, only the right shift needs its zero fill.
constexpr int64_t bits_of(uint64_t v) { return static_cast<int64_t>(v); }

at::Tensor shift_right_logical(const at::Tensor& x, int s) {
  return at::bitwise_and(at::bitwise_right_shift(x, s), bits_of((uint64_t{1} << (64 - s)) - 1));
}

}  // namespace

at::Tensor round_bf16_stochastically(const at::Tensor& values, uint64_t seed, const at::Tensor& first,
                                     ValuesPerDraw per_draw) {
  const bool four = per_draw == ValuesPerDraw::kFour;
  c10::NoGradGuard no_grad;
  const at::Tensor flat = values.to(at::kFloat).contiguous().reshape({-1});
  const at::Tensor g = at::arange(flat.numel(), flat.options().dtype(at::kLong)) + first.to(flat.device(), at::kLong);
  // random_bits(seed, g / 4) (or g): splitmix64's output function.
  at::Tensor z = ((four ? shift_right_logical(g, 2) : g) + 1) * bits_of(0x9e3779b97f4a7c15ULL) + bits_of(seed);
  z = at::bitwise_xor(z, shift_right_logical(z, 30)) * bits_of(0xbf58476d1ce4e5b9ULL);
  z = at::bitwise_xor(z, shift_right_logical(z, 27)) * bits_of(0x94d049bb133111ebULL);
  z = at::bitwise_xor(z, shift_right_logical(z, 31));
  // Bits 16 * (g % 4) and up: never the sign's copies an arithmetic shift brings in (at most bit 63).
  const at::Tensor random = at::bitwise_and(four ? at::bitwise_right_shift(z, at::bitwise_and(g, 3) * 16) : z, 0xffff);
  // round_stochastically on the float's bits as a uint32 held in int64.
  const at::Tensor b = at::bitwise_and(flat.view(at::kInt).to(at::kLong), bits_of(0xffffffffULL));
  const at::Tensor special = at::bitwise_and(b, 0x7f800000).eq(0x7f800000);
  const at::Tensor nan = at::logical_and(special, at::bitwise_and(b, 0x007fffff).ne(0));
  const at::Tensor rounded = at::bitwise_right_shift(at::where(special, b, b + random), 16);
  const at::Tensor upper = at::where(nan, at::full({}, 0x7fc0, rounded.options()), rounded);
  return upper.to(at::kShort).view(at::kBFloat16).view(values.sizes());
}

void DrawCounter::set(uint64_t value) noexcept {
  if (value == host_) return;
  host_ = value;
  device_ = at::Tensor();
}

at::Tensor DrawCounter::on(const c10::Device& device) {
  if (!device_.defined() || device_.device() != device || device_host_ != host_) {
    device_ = at::full({}, bits_of(host_), at::TensorOptions().dtype(at::kLong).device(device));
    device_host_ = host_;
  }
  return device_;
}

void DrawCounter::advance(uint64_t by, const at::Tensor& skipped) {
  if (device_.defined() && device_host_ == host_) {
    if (skipped.defined()) device_.add_(skipped.logical_not().to(at::kLong) * bits_of(by));
    else device_.add_(bits_of(by));
    device_host_ += by;
  }
  host_ += by;
}

void DrawCounter::rewind(uint64_t by) noexcept {
  host_ -= by;
  device_host_ -= by;
}

void DrawCounter::pull() {
  if (!device_.defined() || device_host_ != host_) return;  // the host's is the truth
  count_host_sync();
  host_ = static_cast<uint64_t>(device_.item<int64_t>());
  device_host_ = host_;
}

}  // namespace amp::detail
