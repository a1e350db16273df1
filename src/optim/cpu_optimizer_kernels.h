#pragma once
// amp's CPU loops for the fused optimizers (amp/fused_optimizers.h): one pass over a parameter reads
// its gradient (times the inverse loss scale, storing the unscaled gradient back as ATen does), updates the parameter and the optimizer state in fp32
// and, at O2, writes the rounded copy into the model's low-precision parameter.
//
// Each element gets the operations of LibTorch's torch::optim::SGD / Adam / AdamW in their order, with
// their scalars rounded to float as ATen does (NOTE [Fused step arithmetic] in the .cpp).

#include <cstdint>

#include "optim/cpu_state_codec.h"
#include "scaling/cpu_kernels.h"

namespace amp::detail::cpu {

/// The low-precision model copy a fused step also writes (nullptr data: none).
struct ModelCopy {
  Dtype dtype = Dtype::Float;
  void* data = nullptr;
};

struct AdamScalars {
  double lr, beta1, beta2, eps, weight_decay;
  bool decoupled_weight_decay;  // AdamW: p *= 1 - lr * weight_decay; Adam: g += weight_decay * p
  bool amsgrad;
  int64_t step;                 // after this update's increment (1 on the first step)
  float inv_scale;              // multiplies the gradient first, which is stored back (1: already unscaled)
};

/// One Adam/AdamW update of n fp32 elements; max_exp_avg_sq is used when amsgrad.
void adam_step(float* param, float* grad, float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq,
               int64_t n, const AdamScalars& s, ModelCopy copy);

/// adam_step for moments kept in a state format (NOTE [Optimizer state formats] in state_format.h): elements
/// [begin, end) of `param` and `grad` (whole-tensor pointers) chunk by chunk, each chunk's moments decoded to fp32,
/// updated as torchao updates them (lerp, fused as ATen's vectorized lerp is; L2 decay added unfused) and encoded
/// back (with AVX-512, 8-bit and bf16 moments in one pass, the same bits: NOTE [The 8-bit step in one pass], NOTE [The
/// bf16 step in one pass]). begin is a multiple of 2048 (a chunk). The parameter's arithmetic is adam_step's.
void adam_step_stored(float* param, float* grad, const StateView& exp_avg, const StateView& exp_avg_sq,
                      const StateView* max_exp_avg_sq, int64_t begin, int64_t end, const AdamScalars& s, ModelCopy copy);
constexpr int64_t kStoredChunk = 2048;

struct SgdScalars {
  double lr, momentum, dampening, weight_decay;
  bool nesterov;
  bool first_step;  // the momentum buffer is empty and takes the gradient itself
  float inv_scale;
};

/// One SGD update of n fp32 elements; momentum_buffer is used when momentum != 0.
void sgd_step(float* param, float* grad, float* momentum_buffer, int64_t n, const SgdScalars& s,
              ModelCopy copy);

struct LambScalars {
  // Apex's kernel arguments, as floats: clip is the global-norm divisor (norm / max_grad_norm, or 1), beta3 the
  // first moment's gradient coefficient, bias_correction1/2 the divisors 1 - beta^step (1 without correction).
  float clip, weight_decay, beta1, beta2, beta3, eps, bias_correction1, bias_correction2;
  bool adam_w_mode;  // decay added to the update (true) or to the gradient (false)
};

/// FusedLAMB's first stage over n fp32 elements (Apex's LAMBStage1Functor): updates the moments and writes the
/// Adam-style update into `update`; the gradient is read only.
void lamb_stage1(const float* param, const float* grad, float* exp_avg, float* exp_avg_sq, float* update, int64_t n,
                 const LambScalars& s);

/// lamb_stage1 over elements [begin, end) (begin a multiple of kStoredChunk) with moments kept in a state format.
void lamb_stage1_stored(const float* param, const float* grad, const StateView& exp_avg, const StateView& exp_avg_sq,
                        float* update, int64_t begin, int64_t end, const LambScalars& s);

/// FusedLAMB's second stage (LAMBStage2Functor): param -= ratio * update, then the O2 model copy.
void lamb_stage2(float* param, const float* update, int64_t n, float ratio, ModelCopy copy);

}  // namespace amp::detail::cpu
