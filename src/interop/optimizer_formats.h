#pragma once

// The Python state_dict format of each torch.optim optimizer amp reads and writes, one row per optimizer: Python's
// class, group keys and state names, and how the hyperparameters map to the C++ options. PythonCheckpoint::load_optimizer
// and put_optimizer both read these rows, so adding an optimizer is one row (optimizer_formats.cpp); the state's C++
// fields come from the optimizer kinds table (optim/optimizer_kinds.h).

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace amp::detail {

/// A param group's hyperparameters by Python key: bools as 0/1, `betas` as "beta1" and "beta2", a triple's as key0..2,
/// a name as its index in OptimizerFormat::names.
using Hyperparameters = std::map<std::string, double>;
/// One parameter's state tensors by Python name (an undefined tensor: absent).
using StateTensors = std::map<std::string, at::Tensor>;

// A float, a bool, betas' (float, float), a count written as an int once it is above 0 (Apex's per-group 'step'),
// three floats (Muon's ns_coefficients), an int always written (Muon's ns_steps), or one of OptimizerFormat::names
// (None: the first; Muon's adjust_lr_fn).
enum class GroupValue { kNumber, kBool, kPair, kCount, kTriple, kInt, kName };

struct GroupField {
  const char* name;
  GroupValue kind;
};

struct StateField {
  const char* name;
  /// nullptr: optional; "": always needed; else needed when that hyperparameter is nonzero (e.g. "amsgrad").
  const char* needed_when;
  /// Written only when needed (Adam's max_exp_avg_sq, as Python writes it), else whenever defined.
  bool written_only_when_needed = false;
};

struct OptimizerFormat {
  const char* python_class;  // "SGD": torch.optim.SGD; a dotted name is a class outside torch.optim
  /// Keys only this class's param groups have, which tell a Python group's class.
  std::vector<const char*> marker_keys;
  /// Adam and AdamW share their keys; torch >= 2.7 tells them apart by this flag (-1: not written).
  int decoupled_weight_decay = -1;
  /// The hyperparameters amp maps, in the order Python writes them.
  std::vector<GroupField> group_keys;
  /// Keys Python writes that LibTorch has no option for, with the values amp writes (Python's defaults).
  std::vector<std::pair<const char*, c10::IValue>> python_only_keys;
  bool has_step = false;
  /// The names a kName key takes (the first is what Python's None means).
  std::vector<const char*> names;
  /// Python's names of the state's tensors, in the order of the C++ state's fields (NOTE [Optimizer kinds]).
  std::vector<StateField> state_fields;
  /// The C++ types this row reads and writes, as the optimizer kinds table names them.
  std::vector<const char*> kinds;

  Hyperparameters (*read_group)(const torch::optim::OptimizerOptions&);
  void (*write_group)(const Hyperparameters&, torch::optim::OptimizerOptions&);
  /// The state's tensors by name; sets *step where the optimizer counts steps.
  StateTensors read_state(torch::optim::OptimizerParamState& state, int64_t* step) const;
  /// A state of `optimizer`'s type from tensors that were read and checked; null where there is none (SGD without
  /// momentum).
  std::unique_ptr<torch::optim::OptimizerParamState> make_state(const torch::optim::Optimizer& optimizer,
                                                                const StateTensors& tensors, int64_t step) const;

  /// Whether a Python param group may have been written by this class.
  bool accepts(const c10::impl::GenericDict& group) const;
  bool needs(const StateField& field, const Hyperparameters& h) const;
};

const std::vector<OptimizerFormat>& optimizer_formats();
/// The row of `optimizer`'s type (amp::optim's fused optimizers are their torch::optim base's), or nullptr.
const OptimizerFormat* format_of(const torch::optim::Optimizer& optimizer);
/// The one row that accepts a Python group, or nullptr when none or several do.
const OptimizerFormat* python_format_of(const c10::impl::GenericDict& group);
/// "SGD, Adam, AdamW, RMSprop and Adagrad" (torch.optim's), for messages.
std::string optimizer_format_names();

}  // namespace amp::detail
