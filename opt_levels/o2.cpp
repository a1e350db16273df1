#include "spec.h"

namespace amp::opt_levels {

OptLevelSpec o2() {
  Properties p;
  p.opt_level = OptLevel::O2;
  p.enabled = true;
  p.cast_model_type = c10::ScalarType::Half;
  p.patch_torch_functions = false;
  p.keep_batchnorm_fp32 = true;
  p.master_weights = true;
  p.loss_scale = LossScale::dynamic();
  return {"O2:  FP16 training with FP32 batchnorm and FP32 master weights.", p};
}

}  // namespace amp::opt_levels
