#pragma once
// The FP8 layers of one model (amp/fp8.h): which Linear layers run in FP8, their scales and amax histories, and
// the kernel the precision policy's dispatcher hook calls for their GEMMs.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/nn/module.h>
#include <torch/serialize/archive.h>
#include <torch/version.h>

#include <functional>
#include <ostream>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "amp/fp8.h"
#include "amp/properties.h"

/// Whether this LibTorch build has FP8 dtypes and at::_scaled_mm (2.1 and newer), for the preprocessor.
#define AMP_HAS_FP8 (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1))

namespace amp::detail {

/// Whether this LibTorch build has FP8 dtypes and at::_scaled_mm (2.1 and newer).
bool fp8_supported_by_build();

class Fp8State;
/// Prints the initialize banner's FP8 lines: the FP8 layers, and the Linear layers left in bfloat16.
void describe_fp8_layers(const Fp8State& state, std::ostream& out);

class Fp8State : public std::enable_shared_from_this<Fp8State> {
 public:
  enum Kind { kInput = 0, kWeight = 1, kGrad = 2 };
  struct Layer {
    std::string name;
    at::Tensor weight;  // the Linear's weight (the model's parameter), [out, in]
  };

  /// Chooses the FP8 layers among `root`'s Linear modules: those whose weight is not `in_island`, whose dimensions
  /// are multiples of the recipe's block and whose in*out is at least min_gemm_size; the others are listed by
  /// skipped().
  Fp8State(const Properties& properties, torch::nn::Module& root,
           const std::function<bool(const at::Tensor&)>& in_island);

  const std::vector<Layer>& layers() const noexcept { return layers_; }
  /// "name [out x in] (why)" of the Linear layers left in the level's dtype: a dimension no multiple of the
  /// recipe's block, or below min_gemm_size.
  const std::vector<std::string>& skipped() const noexcept { return skipped_; }
  /// Whether the recipe's GEMMs are emulated on the layers' device (amp/fp8.h's Fp8LayerState::emulated).
  bool emulated() const noexcept { return emulated_; }
  const Fp8Options& options() const noexcept { return options_; }

  /// Runs `op` (on `stack`, as the dispatcher hands it) as an FP8 GEMM if it is an FP8 layer's linear, addmm or
  /// matmul; returns false (the stack untouched) otherwise.
  bool run(const c10::OperatorHandle& op, torch::jit::Stack* stack);

  /// After an optimizer step: `taken` commits the step's amaxes into the history (kDelayed: reduced over the
  /// ranks first, then scales recomputed); a skipped step drops them. Either way the step's amaxes are cleared.
  /// With auto_fallback, a layer whose amaxes were non-finite on kFallbackSteps steps in a row leaves FP8
  /// (NOTE [FP8 auto fallback]); the names of those that left now are returned.
  std::vector<std::string> end_step(bool taken);
  /// Makes end_step reduce the step's amaxes and overflow flags (max over the ranks): amp::parallel.
  void set_amax_reducer(std::function<void(at::Tensor&)> reducer);
  /// Whether end_step needs the reducer under amp::parallel (delayed scaling or auto_fallback).
  bool reduces_over_ranks() const;
  /// The layers auto_fallback moved to the level's dtype, in the order it moved them.
  std::vector<std::string> fallbacks() const;

  /// The layers whose amax in this step is inf/NaN (the overflow report), in model order.
  std::vector<std::string> non_finite_layers() const;
  /// The layers' scales as amp::fp8_layers reports them.
  std::vector<Fp8LayerState> report() const;

  // The state that resumes bitwise: scales, the amax history and its position.
  void save(torch::serialize::OutputArchive& archive, const std::string& prefix) const;
  /// Checks save()'s state in `archive` (`where` names it in errors: other layers, another history length) and
  /// returns the function that restores it, so a load changes nothing until every part is checked.
  std::function<void()> load(torch::serialize::InputArchive& archive, const std::string& prefix,
                             const std::string& where);
  /// The same state by name, for Python checkpoints: "scales", "history", "history_amax", "position".
  std::vector<std::pair<std::string, at::Tensor>> state_tensors() const;
  /// Checks state_tensors()-shaped `state` saved for the layers `layer_names` (with auto_fallback's `fallbacks`);
  /// returns what restores it.
  std::function<void()> restore_state(const std::vector<std::pair<std::string, at::Tensor>>& state,
                                      const std::vector<std::string>& layer_names,
                                      const std::vector<std::string>& fallbacks, const std::string& where);
  /// The FP8 layers' qualified names, in model order.
  std::vector<std::string> names() const;

  /// Runs the GEMMs of the FP8 layers at or under module `name` in the level's dtype from now on (auto_fp32's first
  /// rung up); their scales stay in the state, unused. Returns whether any was still in FP8.
  bool leave_fp8(const std::string& name);
  /// Whether layer `name` still runs in FP8.
  bool in_fp8(const std::string& name) const;

  // For the GEMMs (src/casting/fp8.cpp).
  /// The scale for `slot`'s tensor whose amax is `amax` (dynamic: from it; delayed: from the history), NaN for a
  /// non-finite amax (NOTE [FP8 scales never hide an overflow]).
  at::Tensor scale_for(int64_t slot, const at::Tensor& amax);
  /// Adds `amax` to this step's amaxes (their max per slot).
  void record_amax(int64_t slot, const at::Tensor& amax);
  /// The scale fp8_layers reports for `slot` (the slice, tile and block recipes: their smallest).
  void note_scale(int64_t slot, const at::Tensor& scale);
  c10::ScalarType fp8_dtype(Kind kind) const;
  double fp8_max(Kind kind) const;

 private:
  at::Tensor scale_from(const at::Tensor& amax, double max) const;
  at::Tensor rounded(const at::Tensor& scale) const;  // power_of_2_scales
  std::string layer_names() const;
  std::vector<std::string> count_overflows(const std::vector<at::Tensor>& pending);

  Fp8Options options_;
  c10::ScalarType out_dtype_;
  std::vector<Layer> layers_;
  std::vector<std::string> skipped_;
  bool emulated_ = false;
  std::unordered_map<const c10::TensorImpl*, int64_t> by_weight_;  // weight -> layer index
  // Per slot (layer * 3 + kind), on the layers' device:
  at::Tensor scales_;        // [S] kDelayed: the scales from the history; 1.0 before any
  at::Tensor history_amax_;  // [S] the history's amax (max or most recent); 0 means none yet
  at::Tensor history_;       // [S, amax_history_len] a ring of committed amaxes (kDelayed)
  at::Tensor used_;          // [S] kDynamic: the scale of the most recent GEMM operand
  at::Tensor maxima_;        // [S] each slot's format maximum
  int64_t position_ = 0;     // the ring's next column
  mutable std::mutex mutex_;  // backward records amaxes on autograd's threads
  std::vector<at::Tensor> pending_;  // [S] this step's amax per slot (undefined: none yet)
  std::function<void(at::Tensor&)> reducer_;
  std::vector<int64_t> overflow_steps_;  // per layer: steps in a row the overflow report named it (auto_fallback)
  std::vector<std::string> fallbacks_;   // the layers auto_fallback moved, in order
  int verbosity_ = 1;
};

/// Steps in a row a layer's FP8 amaxes must be non-finite before auto_fallback moves it (DESIGN.md 1d).
constexpr int64_t kFallbackSteps = 8;

}  // namespace amp::detail
