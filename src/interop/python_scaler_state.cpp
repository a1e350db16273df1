#include "amp/python_checkpoint.h"

// Python checkpoints' loss-scaler states: Apex's amp.state_dict() ({'loss_scaler0': {'loss_scale', 'unskipped'},
// ...}) and torch.amp.GradScaler's state_dict() ({'scale', 'growth_factor', 'backoff_factor', 'growth_interval',
// '_growth_tracker'}), read into and written from amp's loss scalers and amp::GradScaler.

#include <cmath>
#include <functional>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "amp/grad_scaler.h"
#include "amp/optimizer.h"
#include "options/format.h"
#include "casting/fp8.h"
#include "interop/python_values.h"

namespace amp {

using detail::as_number;
using detail::key_text;
using detail::quoted_list;
using detail::type_of;

namespace {

// put_amp's 'auto_fp32' entry: {'models': [int], 'modules': [str], 'overflows': int, 'armed': bool}.
OptimizerBase::AutoFp32State auto_fp32_state_of(const c10::IValue& value, const std::string& at) {
  const char* m = "amp::PythonCheckpoint::load_amp: ";
  TORCH_CHECK(value.isGenericDict(), m, at, " is ", type_of(value), ", not the dict put_amp writes ('models', "
              "'modules', 'overflows', 'armed').");
  const auto d = value.toGenericDict();
  auto field = [&](const char* name) -> c10::IValue {  // Dict::at returns a copy
    TORCH_CHECK(d.contains(c10::IValue(name)), m, at, " has no '", name, "'.");
    return d.at(c10::IValue(name));
  };
  const c10::IValue models = field("models"), modules = field("modules"), overflows = field("overflows"),
                    armed = field("armed");
  TORCH_CHECK(models.isList() && modules.isList() && models.toListRef().size() == modules.toListRef().size(), m, at,
              "['models'] and ['modules'] are not two lists of one length.");
  TORCH_CHECK(overflows.isInt() && overflows.toInt() >= 0 && armed.isBool(), m, at, "['overflows'] is not a count "
              "or ['armed'] not a bool.");
  OptimizerBase::AutoFp32State state;
  for (size_t i = 0; i < models.toListRef().size(); ++i) {
    const c10::IValue &model = models.toListRef()[i], &module = modules.toListRef()[i];
    TORCH_CHECK(model.isInt() && model.toInt() >= 0 && module.isString(), m, at, " entry ", i, " is not a model "
                "index and a module name.");
    state.moved.emplace_back(model.toInt(), module.toStringRef());
  }
  state.overflows = overflows.toInt();
  state.armed = armed.toBool();
  return state;
}

// put_amp's 'fp8' entry: one dict per model with FP8 layers, {'layers': [str], 'scales', 'history', 'history_amax',
// 'position': Tensor}. Checks it against the optimizer's FP8 layers; returns the functions that restore it.
std::vector<std::function<void()>> fp8_restorers(const c10::IValue& value, const OptimizerBase& optimizer,
                                                 const std::string& at) {
  const char* m = "amp::PythonCheckpoint::load_amp: ";
  const auto states = optimizer.fp8_states();
  TORCH_CHECK(value.isList(), m, at, " is ", type_of(value), ", not the list of dicts put_amp writes.");
  const auto list = value.toListRef();
  TORCH_CHECK(list.size() == states.size(), m, at, " holds the FP8 scaling state of ", list.size(), " model(s), this "
              "optimizer trains ", states.size(), " model(s) with FP8 layers. Resume with fp8 ",
              list.empty() ? "off" : "on (config: fp8 = true)", " as the checkpoint was saved.");
  std::vector<std::function<void()>> out;
  for (size_t k = 0; k < list.size(); ++k) {
    const std::string here = at + "[" + std::to_string(k) + "]";
    TORCH_CHECK(list[k].isGenericDict(), m, here, " is ", type_of(list[k]), ", not a dict.");
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    std::vector<std::string> layers;
    for (const auto& item : list[k].toGenericDict()) {
      TORCH_CHECK(item.key().isString(), m, here, " has a key that is ", type_of(item.key()), ".");
      const std::string& name = item.key().toStringRef();
      if (name == "layers") {
        TORCH_CHECK(item.value().isList(), m, here, "['layers'] is ", type_of(item.value()), ", not a list of str.");
        for (const auto& v : item.value().toListRef()) {
          TORCH_CHECK(v.isString(), m, here, "['layers'] holds ", type_of(v), ", not only str.");
          layers.push_back(v.toStringRef());
        }
      } else {
        TORCH_CHECK(item.value().isTensor(), m, here, "['", name, "'] is ", type_of(item.value()), ", not a tensor.");
        tensors.emplace_back(name, item.value().toTensor());
      }
    }
    out.push_back(states[k]->restore_state(tensors, layers, std::string(m) + here));
  }
  return out;
}

}  // namespace

void PythonCheckpoint::load_amp(OptimizerBase& optimizer, std::string_view key) const {
  const std::string what = "entry '" + key_text(key) + "'";
  const char* m = "amp::PythonCheckpoint::load_amp: ";
  const c10::IValue& value = value_of(key, "load_amp");
  TORCH_CHECK(value.isGenericDict(), m, what, " of ", where(), " is ", type_of(value),
              ", not amp.state_dict() or GradScaler.state_dict().");
  const auto dict = value.toGenericDict();
  const Properties& props = optimizer.properties();
  const size_t num_scalers = optimizer.loss_scalers().size();
  auto number = [&](const c10::impl::GenericDict& d, const std::string& field, const std::string& at) {
    const c10::IValue k(field);
    TORCH_CHECK(d.contains(k), m, at, " has no '", field, "'.");
    const auto n = as_number(d.at(k));
    TORCH_CHECK(n.has_value(), m, at, "['", field, "'] is ", type_of(d.at(k)), ", not a number.");
    return *n;
  };
  struct Loaded {
    double scale;
    int64_t unskipped;
  };
  std::vector<Loaded> loaded;
  struct Schedule {
    double growth_factor, backoff_factor;
    int growth_interval;
  };
  std::optional<Schedule> schedule;  // a GradScaler state's growth schedule

  bool apex = false, grad_scaler = false;
  std::vector<std::string> keys;
  std::optional<OptimizerBase::AutoFp32State> auto_fp32;  // amp's own keys beside the scalers (put_amp)
  std::optional<c10::IValue> fp8_entry;
  for (const auto& item : dict) {
    TORCH_CHECK(item.key().isString(), m, what, " has a key that is ", type_of(item.key()), ".");
    if (item.key().toStringRef() == "auto_fp32") {
      auto_fp32 = auto_fp32_state_of(item.value(), what + "['auto_fp32']");
      continue;
    }
    if (item.key().toStringRef() == "fp8") {
      fp8_entry = item.value();
      continue;
    }
    keys.push_back(item.key().toStringRef());
    if (keys.back().compare(0, 11, "loss_scaler") == 0) {
      apex = true;
    } else if (keys.back() == "scale" || keys.back() == "_growth_tracker" || keys.back() == "growth_interval") {
      grad_scaler = true;
    }
  }
  TORCH_CHECK(!dict.empty(), m, what, " is empty: a GradScaler(enabled=False) saves {}. There is no loss scale to "
              "load; skip load_amp, or save the state of an enabled scaler.");
  TORCH_CHECK(apex || grad_scaler, m, what, " is neither Apex's amp.state_dict() ('loss_scaler0', ...) nor "
              "torch.amp.GradScaler's state_dict() ('scale', '_growth_tracker', ...); its keys are ", quoted_list(keys), ".");
  TORCH_CHECK(!(apex && grad_scaler), m, what, " mixes Apex's keys ('loss_scaler<i>') with GradScaler's ('scale', ...).");
  if (apex) {  // Apex: {'loss_scaler0': {'loss_scale': float, 'unskipped': int}, ...}
    for (const auto& k : keys) {
      TORCH_CHECK(k.compare(0, 11, "loss_scaler") == 0, m, what, " has '", k, "', which is not 'loss_scaler<i>' (as "
                  "Apex's amp.load_state_dict, amp reads only loss scalers there).");
    }
    TORCH_CHECK(keys.size() == num_scalers, m, what, " has ", keys.size(), " loss scaler(s), this optimizer has ",
                num_scalers, " (num_losses). Initialize with amp::Options(...).num_losses(", keys.size(), ").");
    for (size_t i = 0; i < num_scalers; ++i) {
      const std::string name = "loss_scaler" + std::to_string(i);
      const c10::IValue k(name);
      TORCH_CHECK(dict.contains(k), m, what, " has no '", name, "' (it has ", quoted_list(keys), ").");
      const c10::IValue& s = dict.at(k);
      const std::string at = what + "['" + name + "']";
      TORCH_CHECK(s.isGenericDict(), m, at, " is ", type_of(s), ", not a dict with 'loss_scale' and 'unskipped'.");
      const double scale = number(s.toGenericDict(), "loss_scale", at);
      const double unskipped = number(s.toGenericDict(), "unskipped", at);
      TORCH_CHECK(unskipped >= 0 && std::floor(unskipped) == unskipped && unskipped < 9.2e18, m, at,
                  "['unskipped'] is not a count.");
      loaded.push_back({scale, static_cast<int64_t>(unskipped)});
    }
  } else {  // GradScaler: {'scale', 'growth_factor', 'backoff_factor', 'growth_interval', '_growth_tracker'}
    TORCH_CHECK(num_scalers == 1, m, what, " is a GradScaler's state (one loss scale), this optimizer has ", num_scalers,
                " loss scalers (num_losses); load a GradScaler's state into an optimizer with num_losses 1.");
    const double scale = number(dict, "scale", what);
    const double tracker = number(dict, "_growth_tracker", what);
    // As torch's GradScaler.load_state_dict: the schedule comes with the state.
    const double growth_factor = number(dict, "growth_factor", what);
    const double backoff_factor = number(dict, "backoff_factor", what);
    const double growth_interval = number(dict, "growth_interval", what);
    TORCH_CHECK(growth_factor > 1.0 && std::isfinite(growth_factor), m, what, "['growth_factor'] is ",
                detail::format_float(growth_factor), "; a GradScaler's growth_factor is a finite number above 1.0.");
    TORCH_CHECK(backoff_factor > 0.0 && backoff_factor < 1.0, m, what, "['backoff_factor'] is ",
                detail::format_float(backoff_factor), "; a GradScaler's backoff_factor is in (0, 1).");
    TORCH_CHECK(growth_interval >= 1 && std::floor(growth_interval) == growth_interval && growth_interval < 2147483648.0,
                m, what, "['growth_interval'] is ", detail::format_float(growth_interval), "; a GradScaler's "
                "growth_interval is a whole number of steps, at least 1.");
    TORCH_CHECK(tracker >= 0 && std::floor(tracker) == tracker && tracker < 9.2e18, m, what,
                "['_growth_tracker'] is not a count.");
    schedule = Schedule{growth_factor, backoff_factor, static_cast<int>(growth_interval)};
    loaded.push_back({scale, static_cast<int64_t>(tracker)});
  }
  std::vector<LossScaler> scalers = optimizer.loss_scalers();
  const LossScaler before = scalers.front();
  if (schedule) {
    for (auto& scaler : scalers) scaler.set_schedule(schedule->growth_factor, schedule->backoff_factor, schedule->growth_interval);
  }
  for (size_t i = 0; i < scalers.size(); ++i) {
    TORCH_CHECK(!(loaded[i].scale > props.max_loss_scale), m, what, " has loss scale ",
                detail::format_float(loaded[i].scale), ", above this optimizer's max_loss_scale ",
                detail::format_float(props.max_loss_scale), " (GradScaler has no maximum). Initialize with "
                "amp::Options(...).max_loss_scale(", detail::format_float(loaded[i].scale), ") or more.");
    try {
      scalers[i].load(loaded[i].scale, loaded[i].unskipped);
    } catch (const std::invalid_argument& e) {
      TORCH_CHECK(false, m, what, " (loss scaler ", i, "): ", e.what());
    }
  }
  // Without an 'fp8' entry (an Apex or pre-FP8 checkpoint), FP8 layers start their scales afresh.
  const std::vector<std::function<void()>> restore_fp8 =
      fp8_entry ? fp8_restorers(*fp8_entry, optimizer, what + "['fp8']") : std::vector<std::function<void()>>{};
  optimizer.restore_loss_scalers(std::move(scalers));  // optimizers sharing the bank see the restored scales
  for (const auto& restore : restore_fp8) restore();
  if (auto_fp32) {
    TORCH_CHECK(auto_fp32->moved.empty() || props.auto_fp32 > 0, m, what, " holds auto_fp32's decisions (",
                auto_fp32->moved.size(), " module(s) moved to fp32, the first '", auto_fp32->moved.empty() ? "" :
                auto_fp32->moved.front().second, "'), but this optimizer runs without auto_fp32. Initialize with "
                "amp::Options(...).auto_fp32(patience) (config auto_fp32) to resume them.");
    if (props.auto_fp32 > 0) optimizer.restore_auto_fp32_state(*auto_fp32);
  }
  if (schedule) {
    std::string changes;
    auto note = [&](const char* name, const std::string& was, const std::string& now) {
      if (was != now) changes += std::string(changes.empty() ? "" : ", ") + name + " " + was + " -> " + now;
    };
    note("growth_factor", detail::format_float(before.growth_factor()), detail::format_float(schedule->growth_factor));
    note("backoff_factor", detail::format_float(before.backoff_factor()), detail::format_float(schedule->backoff_factor));
    note("growth_interval", std::to_string(before.growth_interval()), std::to_string(schedule->growth_interval));
    if (!changes.empty() && props.verbosity >= 1) {
      std::cout << "amp::PythonCheckpoint::load_amp: the GradScaler state in " << what << " sets " << changes
                << " (as torch's GradScaler.load_state_dict does)" << std::endl;
    }
  }
}

void PythonCheckpoint::load_grad_scaler(GradScaler& scaler, std::string_view key) const {
  const std::string what = "entry '" + key_text(key) + "'";
  const char* m = "amp::PythonCheckpoint::load_grad_scaler: ";
  const c10::IValue& value = value_of(key, "load_grad_scaler");
  TORCH_CHECK(value.isGenericDict(), m, what, " of ", where(), " is ", type_of(value),
              ", not a GradScaler.state_dict().");
  auto state = c10::impl::toTypedDict<std::string, c10::IValue>(
      c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get()));
  for (const auto& item : value.toGenericDict()) {
    TORCH_CHECK(item.key().isString(), m, what, " has a key that is ", type_of(item.key()), ", not a str.");
    state.insert(item.key().toStringRef(), item.value());
  }
  TORCH_CHECK(!state.contains("loss_scaler0"), m, what, " is Apex's amp.state_dict(), not a GradScaler's; load it "
              "into an amp::Optimizer with load_amp.");
  try {
    scaler.load_state_dict(state);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, m, what, " of ", where(), ": ", e.what_without_backtrace());
  }
}

void PythonCheckpoint::put_amp(std::string_view key, const OptimizerBase& optimizer) {
  c10::impl::GenericDict out(c10::StringType::get(), c10::AnyType::get());
  const auto& scalers = optimizer.loss_scalers();
  for (size_t i = 0; i < scalers.size(); ++i) {
    c10::impl::GenericDict s(c10::StringType::get(), c10::AnyType::get());
    s.insert("loss_scale", scalers[i].loss_scale());
    s.insert("unskipped", scalers[i].unskipped());
    out.insert("loss_scaler" + std::to_string(i), s);
  }
  if (optimizer.properties().auto_fp32 > 0) {  // amp's key: Apex's amp.load_state_dict would refuse it
    const auto state = optimizer.auto_fp32_state();
    c10::List<int64_t> models;
    c10::List<std::string> modules;
    for (const auto& [model, module] : state.moved) models.push_back(model), modules.push_back(module);
    c10::impl::GenericDict entry(c10::StringType::get(), c10::AnyType::get());
    entry.insert("models", models);
    entry.insert("modules", modules);
    entry.insert("overflows", state.overflows);
    entry.insert("armed", state.armed);
    out.insert("auto_fp32", entry);
  }
  if (const auto states = optimizer.fp8_states(); !states.empty()) {  // amp's key: FP8 scales and amax histories
    c10::impl::GenericList models(c10::AnyType::get());
    for (const auto& state : states) {
      c10::impl::GenericDict entry(c10::StringType::get(), c10::AnyType::get());
      entry.insert("layers", c10::List<std::string>(state->names()));
      for (const auto& [name, tensor] : state->state_tensors()) entry.insert(name, tensor);
      models.push_back(entry);
    }
    out.insert("fp8", models);
  }
  put(key, out);
}

void PythonCheckpoint::put_grad_scaler(std::string_view key, const GradScaler& scaler) {
  c10::impl::GenericDict out(c10::StringType::get(), c10::AnyType::get());
  for (const auto& item : scaler.state_dict()) out.insert(item.key(), item.value());
  put(key, out);
}

void PythonCheckpoint::put_grad_scaler(std::string_view key, const OptimizerBase& optimizer, int loss_id) {
  const LossScaler& scaler = optimizer.loss_scaler(loss_id);
  c10::impl::GenericDict out(c10::StringType::get(), c10::AnyType::get());
  out.insert("scale", scaler.loss_scale());
  out.insert("growth_factor", scaler.growth_factor());
  out.insert("backoff_factor", scaler.backoff_factor());
  out.insert("growth_interval", static_cast<int64_t>(scaler.growth_interval()));
  out.insert("_growth_tracker", scaler.unskipped());
  put(key, out);
}

}  // namespace amp
