#pragma once
// amp's own CPU loops for the unscale + inf/NaN check and the masters -> model copy. Each is one pass
// over memory, written so the compiler vectorizes it, and built twice on x86-64 (for AVX2+F16C+FMA
// and a baseline) with the fitting clone picked at load time.

#include <cstdint>

// NOTE [Vectorized clones]
// amp's loops (here and in cpu_optimizer_kernels.cpp) are plain C++ that GCC auto-vectorizes;
// target_clones compiles them once more for x86-64-v3 (AVX2, FMA) and the loader picks that clone on CPUs
// that have it. The baseline clone keeps the library runnable anywhere. float16 conversions get explicit
// F16C code in cpu_kernels.cpp.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define AMP_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define AMP_VECTOR_CLONES
#endif

namespace amp::detail::cpu {

enum class Dtype { Float, BFloat16, Half };

/// out[i] = in[i] * inv, or out[i] += in[i] * inv when accumulate; `in` and `out` may alias (in-place).
/// `out` is `in`'s dtype, or Float. Returns whether `in` held an inf or NaN.
bool scale(Dtype in_dtype, const void* in, Dtype out_dtype, void* out, int64_t n, float inv, bool accumulate);

/// Returns whether `in` holds an inf or NaN (reads only).
bool any_non_finite(Dtype dtype, const void* in, int64_t n);

/// out[i] = in[i] rounded to `out_dtype` (round to nearest even).
void convert(const float* in, Dtype out_dtype, void* out, int64_t n);

enum class Norm { kL1, kL2, kInf };

/// Returns, accumulated in double, the sum of |in[i]| (kL1), of in[i]^2 (kL2) or the largest |in[i]| (kInf, which
/// passes over NaN). Partials of a gradient norm: clip_grad_norm_ combines them over every tensor.
double norm_partial(Dtype dtype, const void* in, int64_t n, Norm norm);

}  // namespace amp::detail::cpu
