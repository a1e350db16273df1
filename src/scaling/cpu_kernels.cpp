#include "scaling/cpu_kernels.h"

#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstring>

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#endif
#include <limits>

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

// float16 <-> float32: one F16C instruction per 8 values where the CPU has it (every x86-64 CPU since
// 2013; checked at run time), c10::Half's exact software conversion otherwise. GCC's _Float16 would
// call into libgcc per element on CPUs without AVX512-FP16, so the F16C path is written with intrinsics.
using half_t = c10::Half;
inline float half_to_float(half_t h) { return static_cast<float>(h); }
inline half_t float_to_half(float f) { return half_t(f); }

#if defined(__GNUC__) && defined(__x86_64__)
#define AMP_HAVE_F16C_PATH 1
bool cpu_has_f16c() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return has;
}

__attribute__((target("avx2,f16c"))) int scale_f16_to_f32_f16c(const half_t* in, float* out, int64_t n, float inv,
                                                               bool acc) {
  const __m256 vinv = _mm256_set1_ps(inv), vmax = _mm256_set1_ps(kMax);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 bad = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i)));
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_and_ps(v, abs_mask), vmax, _CMP_NLE_UQ));  // > max or NaN
    __m256 r = _mm256_mul_ps(v, vinv);
    if (acc) r = _mm256_add_ps(_mm256_loadu_ps(out + i), r);
    _mm256_storeu_ps(out + i, r);
  }
  int flag = _mm256_movemask_ps(bad) != 0;
  for (; i < n; ++i) {
    const float v = half_to_float(in[i]);
    flag |= !(std::fabs(v) <= kMax);
    out[i] = acc ? out[i] + v * inv : v * inv;
  }
  return flag;
}

__attribute__((target("avx2,f16c"))) void f32_to_f16_f16c(const float* in, half_t* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  for (; i < n; ++i) out[i] = float_to_half(in[i]);
}

__attribute__((target("avx2,f16c"))) int scale_f16_f16c(const half_t* in, half_t* out, int64_t n, float inv) {
  const __m256 vinv = _mm256_set1_ps(inv), vmax = _mm256_set1_ps(kMax);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 bad = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i)));
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_and_ps(v, abs_mask), vmax, _CMP_NLE_UQ));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_mul_ps(v, vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  int flag = _mm256_movemask_ps(bad) != 0;
  for (; i < n; ++i) {
    const float v = half_to_float(in[i]);
    flag |= !(std::fabs(v) <= kMax);
    out[i] = float_to_half(v * inv);
  }
  return flag;
}
#endif

// Each kernel returns a nonzero int when it saw an inf or NaN; an int OR keeps the loops branch-free.
// The body shared by the three "into fp32" kernels; inlined into each clone, so every clone
// vectorizes it for its own instruction set.
template <class T, class Load>
__attribute__((always_inline)) inline int scale_into_f32(const T* in, float* out, int64_t n, float inv, bool acc,
                                                         Load load) {
  int bad = 0;
  if (acc) {
    for (int64_t i = 0; i < n; ++i) { const float v = load(in[i]); bad |= !(std::fabs(v) <= kMax); out[i] += v * inv; }
  } else {
    for (int64_t i = 0; i < n; ++i) { const float v = load(in[i]); bad |= !(std::fabs(v) <= kMax); out[i] = v * inv; }
  }
  return bad;
}

AMP_VECTOR_CLONES int scale_f32(const float* in, float* out, int64_t n, float inv, bool acc) {
  return scale_into_f32(in, out, n, inv, acc, [](float v) { return v; });
}

AMP_VECTOR_CLONES int scale_bf16_to_f32(const uint16_t* in, float* out, int64_t n, float inv, bool acc) {
  return scale_into_f32(in, out, n, inv, acc, bf16_to_float);
}

AMP_VECTOR_CLONES int scale_f16_to_f32(const half_t* in, float* out, int64_t n, float inv, bool acc) {
  return scale_into_f32(in, out, n, inv, acc, half_to_float);
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

template <class T, class Load>
__attribute__((always_inline)) inline int non_finite_body(const T* in, int64_t n, Load load) {
  int bad = 0;
  for (int64_t i = 0; i < n; ++i) bad |= !(std::fabs(load(in[i])) <= kMax);
  return bad;
}

AMP_VECTOR_CLONES int non_finite_f32(const float* in, int64_t n) {
  return non_finite_body(in, n, [](float v) { return v; });
}

AMP_VECTOR_CLONES int non_finite_bf16(const uint16_t* in, int64_t n) { return non_finite_body(in, n, bf16_to_float); }

// float16 is finite unless its exponent bits are all ones: an integer test, no conversion.
AMP_VECTOR_CLONES int non_finite_f16(const uint16_t* in, int64_t n) {
  int bad = 0;
  for (int64_t i = 0; i < n; ++i) bad |= (in[i] & 0x7C00u) == 0x7C00u;
  return bad;
}

AMP_VECTOR_CLONES void f32_to_bf16(const float* in, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = float_to_bf16(in[i]);
}

AMP_VECTOR_CLONES void f32_to_f16(const float* in, half_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = float_to_half(in[i]);
}

// Sixteen independent double accumulators, so that the loop vectorizes without reassociating one sum (which
// GCC does only under -ffast-math); the lanes are added in a fixed order, so the result does not depend on the CPU.
template <class T, class Load, class Op>
__attribute__((always_inline)) inline double accumulate_body(const T* in, int64_t n, Load load, Op op) {
  constexpr int kLanes = 16;
  double lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) lanes[j] = op(lanes[j], static_cast<double>(load(in[i + j])));
  }
  for (int j = 0; i < n; ++i, ++j) lanes[j] = op(lanes[j], static_cast<double>(load(in[i])));
  for (int width = kLanes / 2; width > 0; width /= 2) {
    for (int j = 0; j < width; ++j) lanes[j] = op(lanes[j], lanes[j + width], /*combine=*/true);
  }
  return lanes[0];
}

struct SumSquares {
  double operator()(double acc, double v, bool combine = false) const { return combine ? acc + v : acc + v * v; }
};
struct SumAbs {
  double operator()(double acc, double v, bool combine = false) const { return acc + std::fabs(v); }
};
struct MaxAbs {  // a NaN is passed over: callers check finiteness first (an overflowing backward is skipped)
  double operator()(double acc, double v, bool combine = false) const {
    const double a = std::fabs(v);
    return a > acc ? a : acc;
  }
};

// One clone set per dtype and norm (target_clones does not apply to templates).
#define AMP_NORM_KERNEL(name, T, load, Op) \
  AMP_VECTOR_CLONES double name(const T* in, int64_t n) { return accumulate_body(in, n, load, Op{}); }
inline float load_f32(float v) { return v; }
AMP_NORM_KERNEL(l1_f32, float, load_f32, SumAbs)
AMP_NORM_KERNEL(l2_f32, float, load_f32, SumSquares)
AMP_NORM_KERNEL(inf_f32, float, load_f32, MaxAbs)
AMP_NORM_KERNEL(l1_bf16, uint16_t, bf16_to_float, SumAbs)
AMP_NORM_KERNEL(l2_bf16, uint16_t, bf16_to_float, SumSquares)
AMP_NORM_KERNEL(inf_bf16, uint16_t, bf16_to_float, MaxAbs)
AMP_NORM_KERNEL(l1_f16, half_t, half_to_float, SumAbs)
AMP_NORM_KERNEL(l2_f16, half_t, half_to_float, SumSquares)
AMP_NORM_KERNEL(inf_f16, half_t, half_to_float, MaxAbs)
#undef AMP_NORM_KERNEL

}  // namespace

double norm_partial(Dtype dtype, const void* in, int64_t n, Norm norm) {
  switch (dtype) {
    case Dtype::Float: {
      const auto* x = static_cast<const float*>(in);
      return norm == Norm::kL1 ? l1_f32(x, n) : norm == Norm::kL2 ? l2_f32(x, n) : inf_f32(x, n);
    }
    case Dtype::BFloat16: {
      const auto* x = static_cast<const uint16_t*>(in);
      return norm == Norm::kL1 ? l1_bf16(x, n) : norm == Norm::kL2 ? l2_bf16(x, n) : inf_bf16(x, n);
    }
    case Dtype::Half: {
      const auto* x = static_cast<const half_t*>(in);
      return norm == Norm::kL1 ? l1_f16(x, n) : norm == Norm::kL2 ? l2_f16(x, n) : inf_f16(x, n);
    }
  }
  return 0.0;
}

bool scale(Dtype in_dtype, const void* in, Dtype out_dtype, void* out, int64_t n, float inv, bool accumulate) {
  if (out_dtype == Dtype::Float) {
    switch (in_dtype) {
      case Dtype::Float: return scale_f32(static_cast<const float*>(in), static_cast<float*>(out), n, inv, accumulate);
      case Dtype::BFloat16:
        return scale_bf16_to_f32(static_cast<const uint16_t*>(in), static_cast<float*>(out), n, inv, accumulate);
      case Dtype::Half:
#ifdef AMP_HAVE_F16C_PATH
        if (cpu_has_f16c()) {
          return scale_f16_to_f32_f16c(static_cast<const half_t*>(in), static_cast<float*>(out), n, inv, accumulate);
        }
#endif
        return scale_f16_to_f32(static_cast<const half_t*>(in), static_cast<float*>(out), n, inv, accumulate);
    }
  }
  TORCH_INTERNAL_ASSERT(in_dtype == out_dtype && !accumulate, "amp: unsupported scale kernel");
  if (in_dtype == Dtype::BFloat16) {
    return scale_bf16(static_cast<const uint16_t*>(in), static_cast<uint16_t*>(out), n, inv);
  }
#ifdef AMP_HAVE_F16C_PATH
  if (cpu_has_f16c()) return scale_f16_f16c(static_cast<const half_t*>(in), static_cast<half_t*>(out), n, inv);
#endif
  return scale_f16(static_cast<const half_t*>(in), static_cast<half_t*>(out), n, inv);
}

bool any_non_finite(Dtype dtype, const void* in, int64_t n) {
  switch (dtype) {
    case Dtype::Float: return non_finite_f32(static_cast<const float*>(in), n);
    case Dtype::BFloat16: return non_finite_bf16(static_cast<const uint16_t*>(in), n);
    case Dtype::Half: return non_finite_f16(static_cast<const uint16_t*>(in), n);
  }
  return false;
}

void convert(const float* in, Dtype out_dtype, void* out, int64_t n) {
  if (out_dtype == Dtype::BFloat16) f32_to_bf16(in, static_cast<uint16_t*>(out), n);
  else if (out_dtype == Dtype::Half) {
#ifdef AMP_HAVE_F16C_PATH
    if (cpu_has_f16c()) return f32_to_f16_f16c(in, static_cast<half_t*>(out), n);
#endif
    f32_to_f16(in, static_cast<half_t*>(out), n);
  }
  else std::memcpy(out, in, static_cast<size_t>(n) * sizeof(float));
}

}  // namespace amp::detail::cpu
