#include "casting/cpu_features.h"

#include <fstream>
#include <sstream>
#include <string>

namespace amp::detail {

CpuFeatures cpu_features() {
  CpuFeatures out;
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("flags", 0) != 0) continue;
    std::istringstream words(line.substr(line.find(':') + 1));
    for (std::string flag; words >> flag;) {
      if (flag == "avx512_fp16") out.avx512_fp16 = true;
      if (flag == "amx_fp16") out.amx_fp16 = true;
      if (flag == "avx512_bf16") out.avx512_bf16 = true;
      if (flag == "amx_bf16") out.amx_bf16 = true;
    }
    break;  // every core reports the same flags
  }
  return out;
}

std::optional<std::string> slow_dtype_notice(c10::ScalarType dtype, const CpuFeatures& cpu) {
  const bool fast_fp16 = cpu.avx512_fp16 || cpu.amx_fp16;
  const bool fast_bf16 = cpu.avx512_bf16 || cpu.amx_bf16;
  if (dtype == c10::ScalarType::Half && !fast_fp16) {
    return std::string("amp: this CPU has no native float16 arithmetic (no avx512_fp16 or amx_fp16): float16 runs "
                       "through conversions and can be several times slower than fp32. ") +
           (fast_bf16 ? "low_precision_dtype = bfloat16 has a native path here (" +
                            std::string(cpu.amx_bf16 ? "amx_bf16" : "avx512_bf16") + ")."
                      : "Neither has bfloat16 (no avx512_bf16 or amx_bf16): opt_level O0 (fp32) is likely fastest.");
  }
  if (dtype == c10::ScalarType::BFloat16 && !fast_bf16) {
    return std::string("amp: this CPU has no native bfloat16 arithmetic (no avx512_bf16 or amx_bf16): bfloat16 runs "
                       "through conversions and may be slower than fp32. ") +
           (fast_fp16 ? "low_precision_dtype = float16 has a native path here." : "opt_level O0 (fp32) is likely fastest.");
  }
  return std::nullopt;
}

}  // namespace amp::detail
