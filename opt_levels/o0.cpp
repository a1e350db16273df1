#include "spec.h"

namespace amp::opt_levels {

OptLevelSpec o0() {
  Properties p;
  p.opt_level = OptLevel::O0;
  p.enabled = true;
  p.cast_model_type = c10::ScalarType::Float;
  p.patch_torch_functions = false;
  p.keep_batchnorm_fp32 = std::nullopt;
  p.master_weights = false;
  p.loss_scale = LossScale::fixed(1.0);
  return {"O0:  Pure FP32 training.", p};
}

}  // namespace amp::opt_levels
