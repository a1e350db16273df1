#pragma once
// How amp's fused Adam, AdamW and LAMB store Adam's two moments (Options::optimizer_state_format): fp32 as
// LibTorch does, bfloat16, or torchao's 8-bit blocks (docs/master-weights.md).

namespace amp {

enum class OptimizerStateFormat {
  kFp32,  // as LibTorch: the moments in the parameter's dtype (fp32 beside a master or a lean bf16 weight)
  kBf16,  // exp_avg and exp_avg_sq in bfloat16, stored with stochastic rounding (2 B each)
  k8Bit,  // torchao's AdamW8bit format: blocks of 256 values, one fp32 absmax scale per block, torchao's dynamic
          // quantization maps (signed for exp_avg, unsigned for exp_avg_sq); tensors under 4096 values or not a
          // multiple of 256 stay fp32, as torchao and bitsandbytes do
};

/// "fp32", "bf16" or "8bit": the config file's spelling.
const char* to_string(OptimizerStateFormat format);

}  // namespace amp
