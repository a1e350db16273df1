#pragma once
// The bfloat16 parameters an O2 optimizer steps without a separate fp32 master (amp::MasterWeights kSplit,
// kStochasticRounding, kKahan, kResidual8), and what each keeps beside its weight.
//
// NOTE [Lean masters]
// The parameter itself stays in param_groups (no fp32 copy, no fp32 master gradient). A fused optimizer's step
// takes one parameter at a time: value(i) rebuilds its fp32 value, the unchanged update rule runs on it in
// fp32 (with fp32 optimizer state) and store(i, updated) writes it back:
//   kSplit               weight = the high 16 bits of the fp32 value (truncated), aux = its low 16 bits (int16);
//                        value() is the fp32 value exactly.
//   kKahan               weight = the value rounded to nearest, aux = what that rounding lost, rounded (bf16);
//                        value() = weight + aux in fp32.
//   kStochasticRounding  weight = the value rounded up or down with probability proportional to the distance
//                        (16 random bits added below the kept ones, then truncated); no aux.
//   kResidual8           weight = the value rounded to nearest, aux = the rounding error in 1/127ths of half the
//                        weight's ulp (int8, FlashOptim's 24-bit master: NOTE [Residual8 masters] in residual8.h);
//                        value() = weight + aux / 127 * ulp / 2.
// The random bits come from a counter-based generator (splitmix64 of seed and draw number): reproducible under a
// seed, independent of threading and of the order the step stores tensors in, and its whole state is two integers
// the optimizer archive keeps. Element k of entry i draws number counter + offset(i) + k, offset(i) the entry's place
// in the table's numbering (the values of the entries before it); a step (begin_step .. end_step) then moves the
// counter past the whole numbering once, stored or not, and a store outside a step moves it past it by itself. A ZeRO
// piece (add_slice) keeps its whole tensor's place plus its start, so a sharded step draws, element for element, what
// the unsharded one draws (NOTE [ZeRO layout] in src/parallel/zero.cpp).
//
// NOTE [Lean masters on the device]
// On a device (and on the CPU where a test forces ATen's route: FusedRouteGuard) value() and store() are ATen ops there,
// bit for bit the CPU loops (tests/master_weights_format_test.cpp), so the host reads nothing: no copy to the host and
// back. A step whose skip the device decides hands its flag to begin_step: its stores keep each old weight and aux
// where the flag is set (where()), and kStochasticRounding's draws count from the generator's counter on the device,
// which the flag holds back; the host's counter moves on until it learns of the skip (rewind) or reads a capture's
// counter back (pull_device_counter), as bf16 moments' do (NOTE [Stored moments on the device]).
//
// Writes into a weight from outside a step (load_weights aside, which stores the fp32 value itself) make its
// aux meaningless: refresh_changed() then zeroes it, so the weight alone is the value, as masters follow
// the model (NOTE [Masters follow the model] in master_weights.h). Except where a write repeats, bit for bit, the
// weight a checkpoint paired the aux with: a resume that loads the optimizer before the model keeps the fp32
// values whole.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "amp/master_weights.h"
#include "optim/stochastic_rounding_ops.h"

namespace torch::serialize {
class InputArchive;
class OutputArchive;
}  // namespace torch::serialize

namespace amp::detail {

class LeanMasters {
 public:
  /// `seed`, `counter`: the stochastic rounding generator's state (unused by the other formats).
  LeanMasters(amp::MasterWeights format, uint64_t seed, uint64_t counter = 0)
      : format_(format), seed_(seed), counter_(counter) {}

  amp::MasterWeights format() const noexcept { return format_; }
  /// The dtype of each parameter's aux (nullopt: kStochasticRounding keeps none).
  std::optional<at::ScalarType> aux_dtype() const noexcept;
  size_t size() const noexcept { return params_.size(); }
  const at::Tensor& param(size_t i) const { return params_[i]; }
  /// The low bits (kSplit, int16), the compensation (kKahan, bf16) or the residual (kResidual8, int8); undefined for
  /// kStochasticRounding.
  const at::Tensor& aux(size_t i) const { return aux_[i]; }
  const std::string& name(size_t i) const { return names_[i]; }

  /// Adds a model parameter; a bf16 one is exact as it is (aux 0), an fp32 one is split by cast_from().
  void add(std::string name, at::Tensor param);
  /// Takes over parameter `i` of `other` (its aux and sync state), for a rebuilt index.
  void adopt(const LeanMasters& other, size_t i);
  /// Adds `piece` (1-d bf16: elements [begin, begin + numel) of `whole`'s parameter i, flattened) with `aux` (its
  /// part of the aux; undefined for kStochasticRounding), stepped in `whole`'s numbering (ZeRO's pieces).
  void add_slice(const LeanMasters& whole, size_t i, at::Tensor piece, int64_t begin, at::Tensor aux);
  /// Restores entry i's aux (a checkpoint's), paired with `loaded_weight` (undefined: none) as load() pairs them.
  void restore(size_t i, const at::Tensor& aux, const at::Tensor& loaded_weight);
  /// The values of the table's numbering (every entry's, or the whole table's for slices).
  int64_t numbering() const noexcept { return total_; }

  /// A step's stores draw in one numbering; end_step() moves the generator past it (NOTE [Lean masters]). With
  /// `found_inf`, the step's flag kept on the device, its stores keep old values where it is set (NOTE [Lean masters
  /// on the device]).
  void begin_step(const at::Tensor& found_inf = at::Tensor());
  void end_step();
  /// A skip the host learned of after end_step: the generator's host counter back past that step.
  void rewind_step() noexcept;
  /// The device's counter read into the host's (a graph capture's steps, which the host never settles); counted as
  /// a host sync.
  void pull_device_counter() { counter_.pull(); }
  /// Casts parameter i, still fp32, to bfloat16 keeping its fp32 value in the lean form (amp::initialize's cast).
  void cast_from_float(size_t i);

  /// Returns the fp32 value of parameter i (a new tensor).
  at::Tensor value(size_t i) const;
  /// The same from `aux`, parameter i's whole aux (a sharded table keeps none: Shards::gather_aux).
  at::Tensor value(size_t i, const at::Tensor& aux) const;
  /// Writes `value` (fp32, same shape) as parameter i's value: the bf16 weight and its aux.
  void store(size_t i, const at::Tensor& value);
  /// Zeroes the aux of parameters written since they were last stored, except elements that repeat the weight
  /// load() restored; throws if a write left one unusable.
  void refresh_changed();
  /// The same for entry i, whose weight its owner saw written (ZeRO's slices alias the weight they follow).
  void follow_write(size_t i);
  void mark_synced(size_t i);

  /// The generator's state: seed and how many random draws were used.
  uint64_t seed() const noexcept { return seed_; }
  uint64_t counter() const noexcept { return counter_.value(); }
  /// Sets the generator's state (amp::parallel gives every rank rank 0's, so the ranks round alike).
  void set_generator(uint64_t seed, uint64_t counter) noexcept {
    seed_ = seed;
    counter_.set(counter);
  }

  /// What ZeRO does for a table whose aux it holds in slices (NOTE [ZeRO layout] in src/parallel/zero.cpp).
  class Shards {
   public:
    virtual ~Shards() = default;
    /// Parameter i's whole aux was written (a store outside a step, or a checkpoint's, paired with `loaded_weight`):
    /// this rank keeps its slices of it.
    virtual void keep_aux(size_t i, const at::Tensor& aux, const at::Tensor& loaded_weight) = 0;
    /// Collective (every rank calls it): every parameter's whole aux, in this table's order.
    virtual std::vector<at::Tensor> gather_aux() = 0;
    /// While save_consolidated writes: every parameter's whole aux; else null (a rank's archive holds its slices).
    virtual const std::vector<at::Tensor>* consolidated_aux() const = 0;
    /// ZeRO stage 3: the slices hold the weights too, and the parameters hold no values between uses, so a store or
    /// a load hands each written weight to keep_weight instead of writing the parameter alone.
    virtual bool holds_weights() const = 0;
    /// Parameter i's whole weight was written (a store, a checkpoint's): this rank keeps its slices of it.
    virtual void keep_weight(size_t i, const at::Tensor& weight) = 0;
    /// While save_consolidated writes at stage 3: every parameter's whole weight; else null (a rank's archive holds
    /// its slices).
    virtual const std::vector<at::Tensor>* consolidated_weights() const = 0;
  };
  /// From now on `shards` holds the aux in slices and this table keeps none (stores hand theirs over).
  void mark_sharded(std::weak_ptr<Shards> shards);
  /// Holds every parameter's whole aux again (`aux`, in this table's order: what Shards::gather_aux gave).
  void mark_whole(std::vector<at::Tensor> aux);
  std::shared_ptr<Shards> shards() const { return shards_.lock(); }

  /// Writes the format, the generator and every parameter's weight and aux under "lean/" (the optimizer archive).
  void save(torch::serialize::OutputArchive& archive) const;
  /// Checks what save() wrote against this index (the caller has checked the format: the lean masters feature does,
  /// kCopy included) and returns what restores it; `where` prefixes the errors.
  std::function<void()> load(torch::serialize::InputArchive& archive, const char* where);

 private:
  void check_usable(size_t i) const;
  at::Tensor fresh_aux(const at::Tensor& param) const;
  bool on_device_route(const at::Tensor& param) const;
  void store_on_device(size_t i, const at::Tensor& weight, const at::Tensor& value, const at::Tensor& whole_aux);
  void store_on_host(size_t i, const at::Tensor& weight, const at::Tensor& value, const at::Tensor& whole_aux);

  amp::MasterWeights format_;
  uint64_t seed_;
  DrawCounter counter_;
  std::vector<std::string> names_;
  std::vector<at::Tensor> params_;
  std::vector<at::Tensor> aux_;
  std::vector<at::Tensor> loaded_;  // the weight load() paired aux with, until the weight's next write
  std::vector<int64_t> version_;
  std::vector<const void*> storage_;
  std::vector<int64_t> offset_;  // each entry's place in the numbering
  int64_t total_ = 0;
  bool in_step_ = false;
  at::Tensor step_skipped_;  // this step's flag as a 0-dim bool, where it stays on the device
  std::weak_ptr<Shards> shards_;
  bool aux_sharded_ = false;  // shards_ holds the aux (a format with one, after mark_sharded)
};

/// Makes `table`'s parameters findable, in place of `replaced`'s (the index it rebuilds, or null). Throws if a
/// parameter already belongs to another live table.
void register_lean(const std::shared_ptr<LeanMasters>& table, const LeanMasters* replaced);

/// Returns the table and index holding `param`, if it has a lean master.
std::optional<std::pair<std::shared_ptr<LeanMasters>, size_t>> find_lean(const at::Tensor& param);

/// Draws a seed for stochastic rounding from torch's default CPU generator (torch::manual_seed decides it).
uint64_t seed_from_default_generator();

}  // namespace amp::detail
