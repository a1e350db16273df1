#pragma once
// What an amp::Optimizer and the models it trains hold in this process, in bytes, by kind: the figure ZeRO divides.

#include <cstdint>

namespace amp {

class OptimizerBase;

/// Bytes by kind; each tensor storage is counted once, under the first kind that holds it in this order.
struct StateBytes {
  int64_t params = 0;           // the model's parameters the optimizer trains (low precision at O2/O3)
  int64_t grads = 0;            // their .grad tensors defined now
  int64_t masters = 0;          // fp32 master weights (a sharded rank's slice; the lean formats' low halves)
  int64_t master_grads = 0;     // the masters' gradients (a stage-2 rank's slice)
  int64_t optimizer_state = 0;  // momentum, Adam's moments (a sharded rank's slice)
  int64_t total() const { return params + grads + masters + master_grads + optimizer_state; }
};

/// Returns what `optimizer` and its models hold in this process now.
///
/// Example:
///   const amp::StateBytes bytes = amp::state_bytes(optimizer);
///   std::cout << double(bytes.total()) / num_params << " bytes per parameter\n";
StateBytes state_bytes(const OptimizerBase& optimizer);

}  // namespace amp
