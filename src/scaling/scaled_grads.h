#pragma once
// Gradients left multiplied by a loss scale, and the check that no optimizer steps on them.
//
// NOTE [Scaled gradients outside the optimizers of a backward]
// scale_loss(loss, optimizers) unscales the gradients of the parameters those optimizers hold. A loss can
// reach other parameters too: a head trained by a second optimizer that the user forgot to pass, a
// discriminator whose gradients a generator's loss runs through, a layer not (yet) in any optimizer. Their
// gradients stay multiplied by the loss scale. Before backward, scale_loss walks the loss's autograd graph
// (nodes, not gradient data) to the AccumulateGrad leaves outside its optimizers; after backward it records
// each such gradient (its TensorImpl and version) in a process-wide ledger. Every amp optimizer checks its
// parameters against the ledger before a step or a backward and refuses to use a recorded gradient,
// naming the fix. Zeroing the gradient (zero_grad, set to none, zero_ in place) retires the record. On the
// normal path the ledger is empty and the check is one atomic load.

#include <ATen/core/Tensor.h>

#include <functional>
#include <string>
#include <vector>

namespace amp::detail {

/// Returns the leaf tensors that backward from `loss` accumulates gradients into.
std::vector<at::Tensor> gradient_leaves(const at::Tensor& loss);

/// Records that each tensor's current gradient holds values multiplied by `scale` (loss `loss_id`).
void record_scaled_grads(const std::vector<at::Tensor>& leaves, double scale, int loss_id);

/// Throws if any of `params` holds a gradient recorded as scaled; `name_of(i)` names params[i] in the
/// error and `action` says what was about to happen ("step", "backward").
void check_no_scaled_grads(const std::vector<at::Tensor>& params, const std::function<std::string(size_t)>& name_of,
                           const char* action);

}  // namespace amp::detail
