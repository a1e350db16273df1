#pragma once
// How O2 keeps the fp32 value of each bfloat16 parameter (Options::master_weights_format): Apex's separate fp32
// copy, or one of four leaner forms that need amp's fused optimizers (docs/master-weights.md).

namespace amp {

enum class MasterWeights {
  kCopy,                // Apex: a separate fp32 master (4 B/param) and fp32 master gradients (4 B/param)
  kSplit,               // the bf16 parameter is the high half of the fp32 master; amp keeps the low 16 bits (2 B)
  kStochasticRounding,  // no master: each update rounds stochastically into the bf16 parameter (0 B)
  kKahan,               // a bf16 compensation buffer carries what rounding lost (2 B)
  kResidual8,           // FlashOptim's 24-bit master: the rounding error in one int8 per value (1 B)
};

/// "copy", "split", "stochastic_rounding", "kahan" or "residual8": the config file's spelling.
const char* to_string(MasterWeights format);

}  // namespace amp
