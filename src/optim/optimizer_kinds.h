#pragma once
// NOTE [Optimizer kinds]
// The one table of the optimizer types amp knows beyond torch::optim::Optimizer's interface: LibTorch's SGD, Adam,
// AdamW, RMSprop and Adagrad, and amp::optim's FusedSGD, FusedAdam, FusedAdamW, FusedLAMB and FusedMuon. Each row says
// what a parameter's state holds (what amp::state_bytes counts, ZeRO slices, auto_fp32 casts, a state format stores),
// how to make a fresh one, and what the type takes part in (state formats, ZeRO, CUDA graphs), with the reason where
// it can't. The rest of amp asks this table, never the state types themselves: an optimizer is one row here, plus one
// in interop/optimizer_formats.cpp for Python's state_dict.

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <memory>
#include <string>
#include <vector>

namespace amp::detail {

/// Pointers to the tensor fields of one parameter's state (an undefined field stays in its place; the first is the
/// signed moment where a state format stores them) and to its per-parameter step count (null where it keeps none).
struct StateFields {
  std::vector<at::Tensor*> tensors;
  int64_t* step = nullptr;
};

struct OptimizerKind {
  const char* name;  // as messages name it
  bool (*is)(const torch::optim::Optimizer&);
  /// The fields of `state` if it is this kind's state type; `ok` false otherwise.
  StateFields (*fields)(torch::optim::OptimizerParamState& state, bool& ok);
  std::unique_ptr<torch::optim::OptimizerParamState> (*fresh)();
  /// An amp::optim fused optimizer: its step rebuilds lean masters and takes the overflow flag.
  bool fused = false;
  /// optimizer_state_format bf16 and 8bit store its state tensors.
  bool stores_formats = false;
  /// Its constructor creates each parameter's state (LibTorch's Adagrad: step 0, the initial accumulator).
  bool state_at_construction = false;
  /// Why ZeRO can't shard it (nullptr: it can).
  const char* unshardable = nullptr;
  /// ZeRO gives each rank whole tensors (its step needs each whole tensor: FusedMuon's orthogonalization).
  bool shards_whole_tensors = false;
  /// Its step skips on the device with ordinary ATen ops (FusedMuon: no step count; FusedLAMB: its groups' counts
  /// kept there), so it needs none of ATen's fused kernels.
  bool skips_without_fused_kernels = false;
};

/// The kind of `optimizer` (the most derived row: FusedAdam before Adam), or nullptr for a type amp does not know.
const OptimizerKind* kind_of(const torch::optim::Optimizer& optimizer);

/// The fields of `state`; empty `tensors` for a state type amp does not know.
StateFields state_fields(torch::optim::OptimizerParamState& state);

/// A fresh, empty state of the type `optimizer` keeps per parameter, or null if amp does not know it.
std::unique_ptr<torch::optim::OptimizerParamState> new_state_for(const torch::optim::Optimizer& optimizer);

/// Casts every floating tensor of `state` to fp32 (auto_fp32 without master weights); throws naming `param` for a
/// state type amp does not know.
void cast_state_to_float(torch::optim::OptimizerParamState& state, const std::string& param);

/// "FusedAdam, FusedAdamW, FusedLAMB or FusedMuon": the fused optimizers with `flag` set, for messages.
std::string fused_kinds_with(bool OptimizerKind::*flag);

}  // namespace amp::detail
