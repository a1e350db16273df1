#pragma once
// What the CPU computes natively in low precision, and the notice amp prints when a run picks a dtype
// the CPU only emulates (issue: fp16 on a CPU without avx512_fp16 ran 6-20x slower than fp32, silently).

#include <c10/core/ScalarType.h>

#include <optional>
#include <string>

namespace amp::detail {

struct CpuFeatures {
  bool avx512_fp16 = false;
  bool amx_fp16 = false;
  bool avx512_bf16 = false;
  bool amx_bf16 = false;
};

/// Reads the running CPU's flags (Linux: /proc/cpuinfo, as the kernel reports cpuid); all false elsewhere.
CpuFeatures cpu_features();

/// Returns one line saying that `dtype` has no native arithmetic on a CPU with `cpu`'s features and
/// naming the faster choice, or nullopt when the dtype has a fast path (or is not low precision).
std::optional<std::string> slow_dtype_notice(c10::ScalarType dtype, const CpuFeatures& cpu);

}  // namespace amp::detail
