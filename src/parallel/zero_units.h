#pragma once
// ZeRO stage 3's units (NOTE [Stage 3 units]): which parameters are gathered together, a parameter's memory given
// back and made again, and the interception handler through which the ops of a forward gather what they read.

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/released_parameters.h"

namespace amp::parallel::detail {

/// The parameters gathered and freed together: a module's (recursively), or the root's (name "<root>": those in no
/// unit). Each parameter is in one unit: the first, in module order, that holds it.
struct ZeroUnit {
  std::string name;
  std::vector<at::Tensor> params;
};

/// ZeroOptions::units against `module`: each module whose qualified name a pattern matches (the outermost where a
/// module and its children match), or each direct child for no patterns; units without parameters are left out and
/// the root unit, where it has parameters, comes last. Throws on a pattern that matches no module, naming it.
std::vector<ZeroUnit> resolve_units(const torch::nn::Module& module, const std::vector<std::string>& patterns,
                                    const char* where);

/// A parameter's storage without memory (ATen refuses to read it: "data is not allocated"), its metadata kept, and
/// the same storage given memory again (its views, autograd's saved tensors included, see it).
void release_storage(const at::Tensor& t);
using amp::detail::is_released;  // src/core/released_parameters.h
void materialize_storage(const at::Tensor& t, size_t nbytes);

/// What the interception handler asks of the ZeRO engine that owns this thread's forward.
class UnitGatherer {
 public:
  virtual ~UnitGatherer() = default;
  /// The unit whose parameter's storage `storage` is (a parameter's, or a view's of it), or -1.
  virtual int unit_of(const c10::StorageImpl* storage) const = 0;
  /// Collective: makes `unit` whole (in a forward, or before the backward of an op that read it).
  virtual void gather(int unit, bool backward) = 0;
  /// An op read `unit` with gradients off inside a forward that records them: a custom autograd function's forward
  /// (SyncBatchNorm's), whose backward reads the saved parameters with no op to hook. The unit stays whole until
  /// backward ends.
  virtual void keep_for_backward(int unit) = 0;
};

/// Runs this thread's ops through the interception key while the returned object lives: an op reading a parameter
/// of an unwhole unit gathers it first, and hooks the outputs that need a gradient so that their backward gathers
/// it again. `on_end` runs when the object dies (the engine frees the units).
std::shared_ptr<void> gather_in_forward(const std::shared_ptr<UnitGatherer>& gatherer, std::function<void()> on_end);

}  // namespace amp::parallel::detail
