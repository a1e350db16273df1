#pragma once
// Gradient clipping that knows the loss scale: clips the gradients the next step() will use (at O2 the fp32
// masters' gradients), after amp unscaled them, in one fused norm pass, without a host sync.

#include <ATen/core/Tensor.h>

#include "amp/optimizer.h"

namespace amp {

/// Scales the gradients of `optimizer`'s parameters so that their total norm of order `norm_type` (2, 1 or
/// INFINITY) is at most `max_norm`, as torch.nn.utils.clip_grad_norm_ does (coefficient max_norm / (norm + 1e-6),
/// at most 1), and returns the norm before clipping as a 0-dim fp32 tensor on the gradients' device (no host
/// sync). Call it between scale_loss's backward and step(): the gradients are unscaled then, and at O2 they are
/// the fp32 masters' (what step() reads), not the model's bf16/fp16 ones.
///
/// On a backward that overflowed (the step will be skipped), returns inf and leaves every gradient as it is
/// (torch would spread NaN through them). Under amp::parallel the gradients are already averaged, so every rank
/// gets the same norm and clips alike. Throws if the gradients are still scaled (an open scale_loss handle, or
/// delay_unscale(true) on the last micro-batch) and on a max_norm that is not positive and finite or a norm_type
/// other than 1, 2 and inf.
///
/// Example:
///   { auto scaled = amp::scale_loss(loss, optimizer); scaled.backward(); }
///   torch::Tensor norm = amp::clip_grad_norm_(optimizer, 1.0);
///   optimizer.step();
at::Tensor clip_grad_norm_(OptimizerBase& optimizer, double max_norm, double norm_type = 2.0);

namespace detail {
/// Checks clip_grad_norm_'s arguments; `caller` names the function in the message.
void check_clip_arguments(const char* caller, double max_norm, double norm_type);
/// Clips `grads` to `max_norm` and returns their norm; where `skip` (a 0-dim bool tensor, or undefined for
/// none) is true, returns inf and multiplies by 1 instead (sync-free: GradScaler's found_inf stays on its device).
/// `norm`: their norm computed elsewhere (every rank's shards together), or undefined to compute it here.
at::Tensor clip_grads(const std::vector<at::Tensor>& grads, double max_norm, double norm_type, const at::Tensor& skip,
                      at::Tensor norm = {});
}  // namespace detail

}  // namespace amp
