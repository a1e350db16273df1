// Options::auto_fp32: a module whose overflows the loss scale can't cure moves to fp32, and training goes on.
//
// Each unscaled backward reports to after_backward. An overflow while the loss scale is at its floor (a dynamic
// scale at min_loss_scale or 1, below which a smaller scale only shrinks gradients that were non-finite already; a
// static scale always) counts; `patience` of them arm a diagnosis of the next iteration (NOTE [Finding the module
// that overflows] in src/casting/precision_policy.cpp). If that iteration overflows again, the module the diagnosis
// blames (failing that, the last FP8 layer whose amax overflowed, or the overflow report's last module in model
// order) leaves low precision one rung: an FP8 layer drops to bfloat16 first, anything else becomes an fp32 island.
// No value is rounded on the way up: at O2 each fp32 master becomes the parameter itself, with its optimizer
// state; a lean master format rebuilds the fp32 value from the bf16 weight and its low bits; without masters (O3)
// the parameter and its optimizer state are cast up. Its ops run in fp32 from the next forward. Under
// amp::parallel the ranks agree on the module (the lowest rank that found one decides), so the replicas stay
// identical. The decisions are part of both checkpoint formats.

#include "features/auto_fp32.h"

#include <ATen/Functions.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <iostream>

#include "amp/optimizer.h"
#include "core/host_sync.h"
#include "casting/fp8.h"
#include "casting/precision_policy.h"
#include "interop/python_values.h"
#include "options/format.h"
#include "optim/lean_masters.h"
#include "optim/master_weights.h"
#include "optim/optimizer_access.h"
#include "optim/optimizer_state_key.h"
#include "optim/param_index.h"
#include "optim/optimizer_kinds.h"
#include "optim/sharding.h"

namespace amp::detail {
namespace {

std::shared_ptr<torch::nn::Module> find_module(torch::nn::Module& root, const std::string& name) {
  for (const auto& item : root.named_modules("", /*include_self=*/false)) {
    if (item.key() == name) return item.value();
  }
  return nullptr;
}

// The module holding a parameter named "blocks.1.fc.weight": "blocks.1.fc".
std::string module_of(const std::string& parameter) {
  const auto dot = parameter.rfind('.');
  return dot == std::string::npos ? std::string() : parameter.substr(0, dot);
}

bool is_island(const PrecisionPolicy& policy, const std::string& name) {
  for (const auto& k : policy.kept()) {
    if (k.name == name && k.reason != "keep_batchnorm_fp32") return true;
  }
  return false;
}

// The index of `name` among `root`'s named modules (-1: none), the same on every rank for one model.
int64_t index_of_module(torch::nn::Module& root, const std::string& name) {
  int64_t i = 0;
  for (const auto& item : root.named_modules("", /*include_self=*/false)) {
    if (item.key() == name) return i;
    ++i;
  }
  return -1;
}

std::string module_at_index(torch::nn::Module& root, int64_t index) {
  int64_t i = 0;
  for (const auto& item : root.named_modules("", /*include_self=*/false)) {
    if (i++ == index) return item.key();
  }
  return {};
}

using AutoFp32Culprit = std::optional<std::pair<size_t, std::string>>;

// The ranks' culprits, one row per rank of (model + 1, module index + 1) (0: found none), gathered as a maximum:
// the lowest rank that found one decides.
AutoFp32Culprit agree_on_culprit(const AutoFp32Culprit& mine, const std::vector<std::shared_ptr<torch::nn::Module>>& models, RankLink& link) {
  at::Tensor rows = at::zeros({link.world_size(), 2}, at::kLong);
  if (mine) {
    rows[link.rank()][0] = static_cast<int64_t>(mine->first) + 1;
    rows[link.rank()][1] = index_of_module(*models[mine->first], mine->second) + 1;
  }
  link.max_over_ranks(rows);
  count_host_sync();
  for (int64_t r = 0; r < rows.size(0); ++r) {
    const int64_t model = rows[r][0].item<int64_t>() - 1, module = rows[r][1].item<int64_t>() - 1;
    if (model >= 0 && module >= 0 && static_cast<size_t>(model) < models.size()) {
      return std::make_pair(static_cast<size_t>(model), module_at_index(*models[static_cast<size_t>(model)], module));
    }
  }
  return std::nullopt;
}

}  // namespace

void AutoFp32::set_armed(OptimizerBase& optimizer, bool armed) {
  for (const auto& m : OptimizerAccess::models(optimizer)) {
    if (auto policy = precision_policy_of(*m)) {
      if (armed) policy->arm_diagnosis();
      else policy->disarm_diagnosis();
    }
  }
  armed_ = armed;
}

void AutoFp32::after_backward(OptimizerBase& optimizer, const BackwardOutcome& outcome) {
  if (patience_ <= 0) return;
  const double loss_scale = outcome.loss_scale, floor = outcome.floor;
  if (!outcome.overflow || loss_scale > floor) {
    if (loss_scale > floor) overflows_ = 0;
    if (armed_) set_armed(optimizer, false);  // the diagnosed iteration did not overflow: nothing to blame yet
    return;
  }
  ++overflows_;
  if (!armed_) {
    if (overflows_ >= patience_) set_armed(optimizer, true);
    return;
  }
  // This backward followed a diagnosed forward and overflowed again: find the module.
  const auto models = OptimizerAccess::models(optimizer);
  const auto& report = optimizer.last_overflow();
  AutoFp32Culprit culprit;
  for (size_t k = 0; k < models.size() && !culprit; ++k) {
    if (auto policy = precision_policy_of(*models[k])) {
      if (auto name = policy->diagnosed_module()) culprit.emplace(k, *name);
    }
  }
  // FP8 GEMMs run before the diagnosis sees them: an FP8 layer whose amax overflowed is the next suspect.
  for (size_t k = 0; k < models.size() && !culprit && report && !report->fp8_layers.empty(); ++k) {
    const auto policy = precision_policy_of(*models[k]);
    if (policy && policy->fp8() && policy->fp8()->in_fp8(report->fp8_layers.back())) culprit.emplace(k, report->fp8_layers.back());
  }
  if (!culprit && report) {  // the report lists non-finite gradients in model order: the last is nearest the loss
    for (auto it = report->parameters.rbegin(); it != report->parameters.rend() && !culprit; ++it) {
      const std::string name = module_of(*it);
      for (size_t k = 0; k < models.size() && !culprit; ++k) {
        const auto policy = precision_policy_of(*models[k]);
        if (policy && find_module(*models[k], name) && !is_island(*policy, name)) culprit.emplace(k, name);
      }
    }
  }
  if (const auto link = link_.lock()) culprit = agree_on_culprit(culprit, models, *link);
  set_armed(optimizer, false);
  const Properties& p = optimizer.properties();
  if (!culprit) {
    if (p.verbosity >= 1) {
      std::cout << "amp: auto_fp32: the loss scale is at its floor (" << format_float(loss_scale)
                << ") and gradients keep overflowing, but no module still in low precision produced the first "
                   "inf/NaN (the loss or the inputs may hold it). Trying again at the next overflow." << std::endl;
    }
    overflows_ = patience_ - 1;  // the next overflow re-arms
    return;
  }
  const bool to_bf16 = move_up(optimizer, culprit->first, culprit->second, /*to_fp32=*/true);
  overflows_ = 0;
  if (p.verbosity >= 1) {
    std::cout << "amp: auto_fp32: module '" << culprit->second << "' kept overflowing with the loss scale at its floor ("
              << format_float(loss_scale) << "); "
              << (to_bf16 ? "its GEMMs leave FP8 and run in bfloat16 from now on (fp32 next, if it keeps overflowing)"
                          : "it runs in fp32 from now on")
              << ". Keep it there from the start with keep_fp32 = " << culprit->second << "." << std::endl;
  }
}

bool AutoFp32::move_up(OptimizerBase& optimizer, size_t model, const std::string& name, bool to_fp32) {
  const auto models = OptimizerAccess::models(optimizer);
  TORCH_CHECK(model < models.size(), "amp::Optimizer: auto_fp32 names model ", model, " of a checkpoint, but this "
              "optimizer trains ", models.size(), " model(s). Resume with the models the checkpoint was saved with.");
  const auto module = find_module(*models[model], name);
  const auto policy = precision_policy_of(*models[model]);
  TORCH_CHECK(module && policy, "amp::Optimizer: auto_fp32 moved module '", name, "' to fp32, but the model has no "
              "module of that name. Resume with the model the checkpoint was saved with.");
  if (is_island(*policy, name)) return false;
  // The first rung: FP8 layers in the module run in bfloat16.
  if (policy->fp8() && policy->fp8()->leave_fp8(name)) {
    out_of_fp8_.emplace_back(static_cast<int64_t>(model), name);
    return true;
  }
  if (!to_fp32) return false;
  c10::NoGradGuard no_grad;
  // Under ZeRO the move needs the optimizer whole (the masters' values, the state keyed by the whole tensors): the
  // sharding gathers it on every rank (they agreed on the module), and the sync the move ends with lays it out again.
  auto move = [&] {
    torch::optim::Optimizer& opt = OptimizerAccess::synced_torch_optimizer(optimizer);
    auto& state = opt.state();
    ParamIndex& index = OptimizerAccess::index(optimizer);
    if (index.lean()) index.lean()->refresh_changed();  // lean values follow writes into the model before they are read
    for (const auto& item : module->named_parameters(/*recurse=*/true)) {
      at::Tensor p = item.value();
      if (p.scalar_type() == at::kFloat || !p.is_floating_point()) continue;
      if (const auto master = find_master(p); master && master->first.get() == &index.masters()) {
        at::Tensor m = master->first->master()[master->second];
        // The master's fp32 value becomes the parameter's (its storage, no copy), and the parameter takes the
        // master's place in param_groups, keyed optimizer state included. Where the model's weights were loaded
        // before this optimizer's checkpoint, torch::load left the checkpoint's fp32 bytes under the bf16 tensor:
        // those are the value.
        if (holds_float32_bytes(p)) {
          at::Tensor value = at::empty({0}, p.options().dtype(at::kFloat));
          value.set_(p.storage(), 0, p.sizes(), p.strides());
          p.set_data(value.clone());
        } else {
          p.set_data(m.detach());
        }
        for (auto& group : opt.param_groups()) {
          for (auto& q : group.params()) {
            if (q.unsafeGetTensorImpl() == m.unsafeGetTensorImpl()) q = p;
          }
        }
        if (auto it = state.find(state_key(state, m)); it != state.end()) {
          auto moved = std::move(it->second);
          state.erase(it);
          state[state_key(state, p)] = std::move(moved);
        }
      } else if (const auto lean = find_lean(p); lean && lean->first == index.lean()) {
        p.set_data(lean->first->value(lean->second));  // bf16 weight + low bits: the fp32 value, exactly (kSplit)
      } else {
        // No master (O3, or master_weights off): the value is the low-precision one, and its state follows it up
        // (first: a state amp can't cast stops the move before the parameter changed).
        if (auto it = state.find(state_key(state, p)); it != state.end()) cast_state_to_float(*it->second, name + "." + item.key());
        p.set_data(p.to(at::kFloat));
      }
      p.mutable_grad() = at::Tensor();
    }
    for (at::Tensor b : module->buffers(/*recurse=*/true)) {
      if (b.is_floating_point() && b.scalar_type() != at::kFloat) b.set_data(b.to(at::kFloat));
    }
    policy->keep(*module, name, "auto_fp32");
    index.invalidate();  // the moved parameters are direct fp32 ones now, out of the masters and the lean table
    OptimizerAccess::sync_param_groups(optimizer);
  };
  if (Sharding* sharding = OptimizerAccess::sharding(optimizer)) sharding->with_whole(optimizer, move);
  else move();
  return false;
}

AutoFp32State AutoFp32::state(const OptimizerBase& optimizer) const {
  AutoFp32State state;
  const auto models = OptimizerAccess::models(optimizer);
  for (size_t k = 0; k < models.size(); ++k) {
    const auto policy = precision_policy_of(*models[k]);
    if (!policy) continue;
    for (const auto& m : policy->kept()) {
      if (m.reason == "auto_fp32") state.moved.emplace_back(static_cast<int64_t>(k), m.name);
    }
  }
  state.out_of_fp8 = out_of_fp8_;
  state.overflows = overflows_;
  state.armed = armed_;
  return state;
}

void AutoFp32::restore(OptimizerBase& optimizer, const AutoFp32State& state) {
  for (const bool to_fp32 : {false, true}) {  // the decisions in the order they can have been taken
    for (const auto& [model, name] : to_fp32 ? state.moved : state.out_of_fp8) {
      TORCH_CHECK(model >= 0, "amp::Optimizer: auto_fp32 names model ", model, " of a checkpoint; it is corrupt.");
      move_up(optimizer, static_cast<size_t>(model), name, to_fp32);
    }
  }
  overflows_ = static_cast<int>(state.overflows);
  set_armed(optimizer, state.armed);
}

void AutoFp32::save(const OptimizerBase& optimizer, torch::serialize::OutputArchive& archive) const {
  const AutoFp32State s = state(optimizer);
  auto write_list = [&](const std::string& list, const std::vector<std::pair<int64_t, std::string>>& entries) {
    for (size_t j = 0; j < entries.size(); ++j) {
      const std::string prefix = list + "/" + std::to_string(j) + "/";
      archive.write(prefix + "model", c10::IValue(entries[j].first));
      archive.write(prefix + "module", c10::IValue(entries[j].second));
    }
    archive.write(list + "/count", c10::IValue(static_cast<int64_t>(entries.size())));
  };
  // "auto_fp32/<j>/..." and "auto_fp32/moved" (the count) as before FP8 moves existed, so older readers read it.
  for (size_t j = 0; j < s.moved.size(); ++j) {
    const std::string prefix = "auto_fp32/" + std::to_string(j) + "/";
    archive.write(prefix + "model", c10::IValue(s.moved[j].first));
    archive.write(prefix + "module", c10::IValue(s.moved[j].second));
  }
  archive.write("auto_fp32/moved", c10::IValue(static_cast<int64_t>(s.moved.size())));
  write_list("auto_fp32/out_of_fp8", s.out_of_fp8);
  archive.write("auto_fp32/overflows", c10::IValue(s.overflows));
  archive.write("auto_fp32/armed", c10::IValue(s.armed));
}

std::function<void()> AutoFp32::load(OptimizerBase& optimizer, torch::serialize::InputArchive& archive,
                                     const std::string& where) {
  auto read = [&](const std::string& key, bool (c10::IValue::*is)() const) {
    c10::IValue v;
    TORCH_CHECK(archive.try_read(key, v) && (v.*is)(), where, ": the checkpoint's amp state has no valid '", key,
                "'; it is corrupt or from another program.");
    return v;
  };
  c10::IValue moved;
  if (!archive.try_read("auto_fp32/moved", moved) || !moved.isInt()) return nullptr;  // saved before auto_fp32 existed
  AutoFp32State state;
  auto read_list = [&](const std::string& list, int64_t count, std::vector<std::pair<int64_t, std::string>>& out) {
    for (int64_t j = 0; j < count; ++j) {
      const std::string prefix = list + "/" + std::to_string(j) + "/";
      out.emplace_back(read(prefix + "model", &c10::IValue::isInt).toInt(),
                       read(prefix + "module", &c10::IValue::isString).toStringRef());
    }
  };
  read_list("auto_fp32", moved.toInt(), state.moved);
  c10::IValue fp8_count;
  if (archive.try_read("auto_fp32/out_of_fp8/count", fp8_count) && fp8_count.isInt()) {
    read_list("auto_fp32/out_of_fp8", fp8_count.toInt(), state.out_of_fp8);
  }
  state.overflows = read("auto_fp32/overflows", &c10::IValue::isInt).toInt();
  c10::IValue armed;
  state.armed = archive.try_read("auto_fp32/armed", armed) && armed.isBool() && armed.toBool();
  TORCH_CHECK((state.moved.empty() && state.out_of_fp8.empty()) || patience_ > 0, where, ": the checkpoint holds "
              "auto_fp32's decisions (", state.moved.size() + state.out_of_fp8.size(), " module(s) moved), but this "
              "optimizer runs without auto_fp32. Initialize with amp::Options(...).auto_fp32(patience) (config "
              "auto_fp32) to resume them.");
  // Applied now, not after the last check: the decisions decide which parameters have masters, which the rest of
  // the load checks against.
  if (patience_ > 0) restore(optimizer, state);
  return nullptr;
}

// put_amp's entry: {'models': [int], 'modules': [str], 'fp8_models': [int], 'fp8_modules': [str],
// 'overflows': int, 'armed': bool}.
std::optional<c10::IValue> AutoFp32::python_state(const OptimizerBase& optimizer) const {
  if (patience_ <= 0) return std::nullopt;  // amp's key: Apex's amp.load_state_dict would refuse it
  const AutoFp32State s = state(optimizer);
  c10::impl::GenericDict entry(c10::StringType::get(), c10::AnyType::get());
  auto put_list = [&](const char* models_key, const char* modules_key,
                      const std::vector<std::pair<int64_t, std::string>>& entries) {
    c10::List<int64_t> models;
    c10::List<std::string> modules;
    for (const auto& [model, module] : entries) models.push_back(model), modules.push_back(module);
    entry.insert(models_key, models);
    entry.insert(modules_key, modules);
  };
  put_list("models", "modules", s.moved);
  put_list("fp8_models", "fp8_modules", s.out_of_fp8);
  entry.insert("overflows", s.overflows);
  entry.insert("armed", s.armed);
  return c10::IValue(entry);
}

std::function<void()> AutoFp32::load_python_state(OptimizerBase& optimizer, const std::optional<c10::IValue>& entry,
                                                  const std::string& at) {
  if (!entry) return nullptr;
  const char* m = "amp::PythonCheckpoint::load_amp: ";
  TORCH_CHECK(entry->isGenericDict(), m, at, " is ", type_of(*entry), ", not the dict put_amp writes ('models', "
              "'modules', 'overflows', 'armed').");
  const auto d = entry->toGenericDict();
  auto field = [&](const char* name, bool optional = false) -> std::optional<c10::IValue> {  // Dict::at copies
    if (!d.contains(c10::IValue(name))) {
      TORCH_CHECK(optional, m, at, " has no '", name, "'.");
      return std::nullopt;
    }
    return d.at(c10::IValue(name));
  };
  AutoFp32State state;
  auto read_list = [&](const char* models_key, const char* modules_key, bool optional,
                       std::vector<std::pair<int64_t, std::string>>& out) {
    const auto models = field(models_key, optional), modules = field(modules_key, optional);
    if (!models || !modules) return;
    TORCH_CHECK(models->isList() && modules->isList() && models->toListRef().size() == modules->toListRef().size(), m,
                at, "['", models_key, "'] and ['", modules_key, "'] are not two lists of one length.");
    for (size_t i = 0; i < models->toListRef().size(); ++i) {
      const c10::IValue &model = models->toListRef()[i], &module = modules->toListRef()[i];
      TORCH_CHECK(model.isInt() && model.toInt() >= 0 && module.isString(), m, at, " entry ", i, " is not a model "
                  "index and a module name.");
      out.emplace_back(model.toInt(), module.toStringRef());
    }
  };
  read_list("models", "modules", /*optional=*/false, state.moved);
  read_list("fp8_models", "fp8_modules", /*optional=*/true, state.out_of_fp8);
  const c10::IValue overflows = *field("overflows"), armed = *field("armed");
  TORCH_CHECK(overflows.isInt() && overflows.toInt() >= 0 && armed.isBool(), m, at, "['overflows'] is not a count "
              "or ['armed'] not a bool.");
  state.overflows = overflows.toInt();
  state.armed = armed.toBool();
  TORCH_CHECK((state.moved.empty() && state.out_of_fp8.empty()) || patience_ > 0, m, at, " holds auto_fp32's "
              "decisions (", state.moved.size(), " module(s) moved to fp32, the first '",
              state.moved.empty() ? "" : state.moved.front().second, "'), but this optimizer runs without auto_fp32. "
              "Initialize with amp::Options(...).auto_fp32(patience) (config auto_fp32) to resume them.");
  if (patience_ <= 0) return nullptr;
  return [this, &optimizer, state] { restore(optimizer, state); };
}

void AutoFp32::join_ranks(torch::nn::Module& model, const std::shared_ptr<RankLink>& link) { link_ = link; }

void AutoFp32::leave_ranks(torch::nn::Module& model) { link_.reset(); }

}  // namespace amp::detail
