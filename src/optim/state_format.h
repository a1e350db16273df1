#pragma once
// How amp's fused Adam, AdamW, LAMB and Muon store their moments (Options::optimizer_state_format).
//
// NOTE [Optimizer state formats]
// A moment is one tensor in the optimizer's state, whatever its format, so torch::save / torch::load, ZeRO's shards
// and state_bytes need no second place to look:
//   kFp32   the parameter's dtype, as LibTorch (fp32 beside a master or a lean bf16 weight);
//   kBf16   bfloat16 of the parameter's shape, written with stochastic rounding (a counter-based generator seeded as
//           kStochasticRounding's: element i of moment k of the tensor at offset o in the optimizer's numbering is
//           number g = counter + k * total + o + i and takes 16 bits of draw g / 4, so a ZeRO shard draws what the
//           unsharded step draws for its elements; each step advances the counter by 3 * total);
//   k8Bit   torchao's AdamW8bit: a 1-d uint8 tensor of n codes followed by the n / 256 fp32 scales of its blocks
//           (packed). Tensors under 4096 values or not a multiple of 256 stay in the parameter's dtype.
// The step decodes each chunk to fp32, updates it with torchao's arithmetic for the moments (lerp, fused as ATen's
// vectorized lerp is), takes the update from those fp32 moments and encodes them (torchao's order). A moment held in
// another representation (a checkpoint of another format, a Python checkpoint's fp32) is converted first, rounded to
// nearest: formats can change between runs.

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <unordered_map>
#include <vector>

#include "amp/optimizer_state_format.h"
#include "optim/moment_storage.h"
#include "optim/stochastic_rounding_ops.h"

namespace torch::optim {
class Optimizer;
}

namespace amp::detail {

class StateFormat;

/// Runs `fn` with `opt`'s moments in fp32 (8-bit ones decoded; bf16 ones too under kBf16), as torch.optim keeps
/// them (PythonCheckpoint::put_optimizer), and puts the stored ones back after.
void with_fp32_moments(torch::optim::Optimizer& opt, const StateFormat* format, const std::function<void()>& fn);
/// Stores `opt`'s moments in `format` (after PythonCheckpoint::load_optimizer read fp32 ones).
void encode_moments(torch::optim::Optimizer& opt, const StateFormat& format);

/// One optimizer's state format and the generator of its stochastic rounding.
class StateFormat {
 public:
  /// Where a stepped tensor's elements sit in the optimizer's numbering, and how many values its whole tensor has.
  struct Place {
    int64_t offset = 0;
    int64_t whole_numel = 0;
  };
  /// ZeRO's answer for a piece of a tensor (nullopt: the tensor is whole).
  using Placement = std::function<std::optional<Place>(const at::Tensor&)>;

  StateFormat(OptimizerStateFormat format, uint64_t seed, uint64_t counter = 0)
      : format_(format), seed_(seed), counter_(counter) {}

  OptimizerStateFormat format() const noexcept { return format_; }
  uint64_t seed() const noexcept { return seed_; }
  uint64_t counter() const noexcept { return counter_.value(); }
  void set_generator(uint64_t seed, uint64_t counter) noexcept {
    seed_ = seed;
    counter_.set(counter);
  }
  /// Set by ZeRO for as long as the optimizer's param_groups hold its pieces; `total`: the values of every whole
  /// tensor (the numbering's length).
  void set_placement(Placement placement, int64_t total) {
    placement_ = std::move(placement);
    placement_total_ = total;
  }

  /// Numbers the tensors of `opt`'s param_groups for one step; end_step() advances the generator past it, and
  /// returns by how much the host's counter moved. With `found_inf` (the step's skip decided on the device) the
  /// device's counter moves only where the step was taken, the host's always, until rewind() (NOTE [Stored moments
  /// on the device] in fused_optimizers.cpp).
  void begin_step(const torch::optim::Optimizer& opt);
  uint64_t end_step(const at::Tensor& found_inf = at::Tensor());
  /// A skip the host learned of after end_step: its counter back by `by` (end_step's advance).
  void rewind(uint64_t by) noexcept { counter_.rewind(by); }
  /// The device's counter read into the host's (a graph capture's steps, which the host never settles); counted as
  /// a host sync.
  void pull_device_counter() { counter_.pull(); }
  Place place(const at::Tensor& stepped) const;
  /// The draws of moment `slot` (0 exp_avg, 1 exp_avg_sq, 2 max_exp_avg_sq) of the tensor at `place` in this step;
  /// nullopt unless kBf16.
  Draws draws(const Place& place, int slot) const;
  /// The same draws counted on `device` (a device's route): the first number a tensor there, from the generator's
  /// counter kept there across steps (made from the host's where that changed, as after a load).
  Draws draws_on(const Place& place, int slot, const c10::Device& device);

  /// Where ZeRO may cut a tensor of `numel` values so each piece's moments are its own (NOTE [ZeRO layout]): the
  /// multiple its start in a flat run must be (an 8-bit moment's block, or 1), and the multiple every rank's slice
  /// of the run must be for any tensor.
  int64_t alignment(int64_t numel) const;
  int64_t slice_alignment() const;

  /// How this format stores the moments of `like` (the stepped tensor) at `place` (NOTE [Moment storage]).
  const MomentStorage& storage_for(const at::Tensor& like, const Place& place) const;
  /// A zero moment for `like` at `place`, in this format.
  at::Tensor fresh(const at::Tensor& like, const Place& place) const;
  /// Converts `stored` in place to this format's representation for `like` at `place`, if it has another; throws if
  /// it holds another number of values than `like`.
  void adopt(at::Tensor& stored, const at::Tensor& like, const Place& place, Moment moment) const;

 private:
  bool holds(const at::Tensor& stored, const at::Tensor& like, const Place& place) const;

  OptimizerStateFormat format_;
  uint64_t seed_;
  DrawCounter counter_;
  Placement placement_;
  int64_t placement_total_ = 0;
  std::unordered_map<const void*, Place> places_;  // this step's whole tensors, by TensorImpl
  int64_t total_ = 0;
};

}  // namespace amp::detail
