#include "optim/residual8.h"

#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>

#include <cmath>
#include <cstring>

namespace amp::detail {
namespace {

float float_of_bf16_bits(uint16_t w) {
  const uint32_t bits = static_cast<uint32_t>(w) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// FlashOptim's _log_ulp_for_mantissa(w, 7) - 1: the log2 of half the weight's ulp.
int log_half_ulp(uint16_t w) {
  const int exponent_bits = (w & 0x7fff) >> 7;
  const int unbiased = exponent_bits == 0 ? 1 - 127 : exponent_bits - 127;
  return unbiased - 7 - 1;
}

template <class Body>
void each(int64_t n, Body body) {
  at::parallel_for(0, n, int64_t{1} << 15, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) body(k);
  });
}

}  // namespace

void residual8_encode(const float* value, const uint16_t* weight, int8_t* residual, int64_t n) {
  each(n, [&](int64_t k) {
    const float e = value[k] - float_of_bf16_bits(weight[k]);
    const auto neg_log_scale = static_cast<float>(-log_half_ulp(weight[k]));
    const float h = std::floor(neg_log_scale / 2.0f);
    const float temp = e * std::exp2(h);
    const float e_norm = temp * std::exp2(neg_log_scale - h);
    const float clamped = std::fmin(std::fmax(e_norm, -1.0f), 1.0f);
    const float scaled = clamped * 127.0f;
    const float rounded = std::copysign(std::floor(std::fabs(scaled) + 0.5f), scaled);
    residual[k] = std::isfinite(rounded) ? static_cast<int8_t>(rounded) : int8_t{0};
  });
}

void residual8_decode(const uint16_t* weight, const int8_t* residual, float* value, int64_t n) {
  each(n, [&](int64_t k) {
    const float correction = static_cast<float>(residual[k]) / 127.0f;
    const auto log_scale = static_cast<float>(log_half_ulp(weight[k]));
    const float h = std::floor(log_scale / 2.0f);
    const float e = correction * std::exp2(h) * std::exp2(log_scale - h);
    value[k] = float_of_bf16_bits(weight[k]) + e;
  });
}

namespace {

// log_half_ulp of each bf16 weight, as fp32.
at::Tensor log_half_ulp(const at::Tensor& weight) {
  const at::Tensor exponent =
      at::bitwise_right_shift(at::bitwise_and(weight.contiguous().view(at::kShort).to(at::kInt), 0x7fff), 7);
  return (at::where(exponent.eq(0), at::full({}, 1 - 127, exponent.options()), exponent - 127) - 8).to(at::kFloat);
}

// 2^t for integral fp32 t in [-126, 127], from its bits (std::exp2's exact powers).
at::Tensor power_of_two(const at::Tensor& t) {
  return at::bitwise_left_shift(t.to(at::kInt) + 127, 23).view(at::kFloat);
}

}  // namespace

at::Tensor residual8_encode(const at::Tensor& value, const at::Tensor& weight) {
  const at::Tensor e = value.to(at::kFloat) - weight.to(at::kFloat);
  const at::Tensor neg_log_scale = log_half_ulp(weight).neg();
  const at::Tensor h = at::floor(neg_log_scale / 2.0);
  const at::Tensor e_norm = e * power_of_two(h) * power_of_two(neg_log_scale - h);
  const at::Tensor one = at::ones({}, e_norm.options());
  const at::Tensor scaled = at::fmin(at::fmax(e_norm, one.neg()), one) * 127.0;
  const at::Tensor rounded = at::copysign(at::floor(scaled.abs() + 0.5), scaled);
  return at::where(at::isfinite(rounded), rounded, at::zeros_like(rounded)).to(at::kChar);
}

at::Tensor residual8_decode(const at::Tensor& weight, const at::Tensor& residual) {
  const at::Tensor correction = residual.to(at::kFloat) / 127.0;
  const at::Tensor log_scale = log_half_ulp(weight);
  const at::Tensor h = at::floor(log_scale / 2.0);
  return weight.to(at::kFloat) + correction * power_of_two(h) * power_of_two(log_scale - h);
}

}  // namespace amp::detail
