#include "spec.h"

namespace amp::opt_levels {

OptLevelSpec o3() {
  Properties p;
  p.opt_level = OptLevel::O3;
  p.enabled = true;
  p.cast_model_type = c10::ScalarType::Half;
  p.patch_torch_functions = false;
  p.keep_batchnorm_fp32 = false;
  p.master_weights = false;
  p.loss_scale = LossScale::fixed(1.0);
  return {"O3:  Pure FP16 training.", p};
}

}  // namespace amp::opt_levels
