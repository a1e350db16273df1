#include "spec.h"

namespace amp::opt_levels {

OptLevelSpec o1() {
  Properties p;
  p.opt_level = OptLevel::O1;
  p.enabled = true;
  p.cast_model_type = std::nullopt;
  p.patch_torch_functions = true;
  p.keep_batchnorm_fp32 = std::nullopt;
  p.master_weights = false;  // Apex: None, which it treats as False.
  p.loss_scale = LossScale::dynamic();
  return {"O1:  Insert automatic casts around Pytorch functions and Tensor methods.", p};
}

}  // namespace amp::opt_levels
