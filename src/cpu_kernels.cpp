#include "cpu_kernels.h"

#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstring>
#include <limits>

// NOTE [Vectorized clones]
// The loops below are plain C++ that GCC auto-vectorizes; target_clones compiles them once more for
// x86-64-v3 (AVX2, FMA, F16C, where float16 <-> float32 is one instruction per 8 values) and the
// loader picks that clone on CPUs that have it. The baseline clone keeps the library runnable anywhere.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define AMP_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define AMP_VECTOR_CLONES
#endif

namespace amp::detail::cpu {
namespace {

constexpr float kMax = std::numeric_limits<float>::max();

inline float bf16_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return f != f ? static_cast<uint16_t>(0x7FC0u) : static_cast<uint16_t>(rounded);
}

#if defined(__FLT16_MAX__)
using half_t = _Float16;  // GCC >= 12 on x86-64: converts with F16C in the v3 clone
inline float half_to_float(half_t h) { return static_cast<float>(h); }
inline half_t float_to_half(float f) { return static_cast<half_t>(f); }
#else
using half_t = c10::Half;
inline float half_to_float(half_t h) { return static_cast<float>(h); }
inline half_t float_to_half(float f) { return half_t(f); }
#endif
static_assert(sizeof(half_t) == 2, "float16 storage");

// Each kernel returns a nonzero int when it saw an inf or NaN; an int OR keeps the loops branch-free.
AMP_VECTOR_CLONES int scale_f32(const float* in, float* out, int64_t n, float inv, bool acc) {
  int bad = 0;
  if (acc) {
    for (int64_t i = 0; i < n; ++i) { bad |= !(std::fabs(in[i]) <= kMax); out[i] += in[i] * inv; }
  } else {
    for (int64_t i = 0; i < n; ++i) { bad |= !(std::fabs(in[i]) <= kMax); out[i] = in[i] * inv; }
  }
  return bad;
}

AMP_VECTOR_CLONES int scale_bf16_to_f32(const uint16_t* in, float* out, int64_t n, float inv, bool acc) {
  int bad = 0;
  if (acc) {
    for (int64_t i = 0; i < n; ++i) { const float v = bf16_to_float(in[i]); bad |= !(std::fabs(v) <= kMax); out[i] += v * inv; }
  } else {
    for (int64_t i = 0; i < n; ++i) { const float v = bf16_to_float(in[i]); bad |= !(std::fabs(v) <= kMax); out[i] = v * inv; }
  }
  return bad;
}

AMP_VECTOR_CLONES int scale_f16_to_f32(const half_t* in, float* out, int64_t n, float inv, bool acc) {
  int bad = 0;
  if (acc) {
    for (int64_t i = 0; i < n; ++i) { const float v = half_to_float(in[i]); bad |= !(std::fabs(v) <= kMax); out[i] += v * inv; }
  } else {
    for (int64_t i = 0; i < n; ++i) { const float v = half_to_float(in[i]); bad |= !(std::fabs(v) <= kMax); out[i] = v * inv; }
  }
  return bad;
}

AMP_VECTOR_CLONES int scale_bf16(const uint16_t* in, uint16_t* out, int64_t n, float inv) {
  int bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = bf16_to_float(in[i]);
    bad |= !(std::fabs(v) <= kMax);
    out[i] = float_to_bf16(v * inv);
  }
  return bad;
}

AMP_VECTOR_CLONES int scale_f16(const half_t* in, half_t* out, int64_t n, float inv) {
  int bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = half_to_float(in[i]);
    bad |= !(std::fabs(v) <= kMax);
    out[i] = float_to_half(v * inv);
  }
  return bad;
}

AMP_VECTOR_CLONES void f32_to_bf16(const float* in, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = float_to_bf16(in[i]);
}

AMP_VECTOR_CLONES void f32_to_f16(const float* in, half_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = float_to_half(in[i]);
}

}  // namespace

bool scale(Dtype in_dtype, const void* in, Dtype out_dtype, void* out, int64_t n, float inv, bool accumulate) {
  if (out_dtype == Dtype::Float) {
    switch (in_dtype) {
      case Dtype::Float: return scale_f32(static_cast<const float*>(in), static_cast<float*>(out), n, inv, accumulate);
      case Dtype::BFloat16:
        return scale_bf16_to_f32(static_cast<const uint16_t*>(in), static_cast<float*>(out), n, inv, accumulate);
      case Dtype::Half: return scale_f16_to_f32(static_cast<const half_t*>(in), static_cast<float*>(out), n, inv, accumulate);
    }
  }
  TORCH_INTERNAL_ASSERT(in_dtype == out_dtype && !accumulate, "amp: unsupported scale kernel");
  if (in_dtype == Dtype::BFloat16) {
    return scale_bf16(static_cast<const uint16_t*>(in), static_cast<uint16_t*>(out), n, inv);
  }
  return scale_f16(static_cast<const half_t*>(in), static_cast<half_t*>(out), n, inv);
}

void convert(const float* in, Dtype out_dtype, void* out, int64_t n) {
  if (out_dtype == Dtype::BFloat16) f32_to_bf16(in, static_cast<uint16_t*>(out), n);
  else if (out_dtype == Dtype::Half) f32_to_f16(in, static_cast<half_t*>(out), n);
  else std::memcpy(out, in, static_cast<size_t>(n) * sizeof(float));
}

}  // namespace amp::detail::cpu
