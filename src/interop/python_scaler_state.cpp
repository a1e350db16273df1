#include "amp/python_checkpoint.h"

// Python checkpoints' loss-scaler states: Apex's amp.state_dict() ({'loss_scaler0': {'loss_scale', 'unskipped'},
// ...}) and torch.amp.GradScaler's state_dict() ({'scale', 'growth_factor', 'backoff_factor', 'growth_interval',
// '_growth_tracker'}), read into and written from amp's loss scalers and amp::GradScaler.

#include <algorithm>
#include <cmath>
#include <functional>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "amp/grad_scaler.h"
#include "amp/optimizer.h"
#include "options/format.h"
#include "interop/python_values.h"
#include "optim/feature.h"
#include "optim/optimizer_access.h"

namespace amp {

using detail::as_number;
using detail::key_text;
using detail::quoted_list;
using detail::type_of;

void PythonCheckpoint::load_amp(OptimizerBase& optimizer, std::string_view key) const {
  const std::string what = "entry '" + key_text(key) + "'";
  const char* m = "amp::PythonCheckpoint::load_amp: ";
  const c10::IValue& value = value_of(key, "load_amp");
  TORCH_CHECK(value.isGenericDict(), m, what, " of ", where(), " is ", type_of(value),
              ", not amp.state_dict() or GradScaler.state_dict().");
  const auto dict = value.toGenericDict();
  const Properties& props = optimizer.properties();
  const size_t num_scalers = detail::OptimizerAccess::loss_scalers(optimizer).size();
  const auto& features = detail::OptimizerAccess::features(optimizer);
  auto feature_key = [&](const std::string& k) {
    return std::any_of(features.begin(), features.end(), [&](const auto& f) { return k == f->key(); });
  };
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
  for (const auto& item : dict) {
    TORCH_CHECK(item.key().isString(), m, what, " has a key that is ", type_of(item.key()), ".");
    if (feature_key(item.key().toStringRef())) continue;  // amp's own entries beside the scalers (put_amp)
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
  std::vector<LossScaler> scalers = detail::OptimizerAccess::loss_scalers(optimizer);
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
  // The training features' entries: each checks its own (or its absence) before anything changes.
  std::vector<std::function<void()>> restore;
  for (const auto& feature : features) {
    const c10::IValue k(feature->key());
    const std::optional<c10::IValue> entry = dict.contains(k) ? std::optional<c10::IValue>(dict.at(k)) : std::nullopt;
    if (auto apply = feature->load_python_state(optimizer, entry, what + "['" + feature->key() + "']")) {
      restore.push_back(std::move(apply));
    }
  }
  detail::OptimizerAccess::restore_loss_scalers(optimizer, std::move(scalers));  // optimizers sharing the bank see them
  for (const auto& apply : restore) apply();
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
  const auto& scalers = detail::OptimizerAccess::loss_scalers(optimizer);
  for (size_t i = 0; i < scalers.size(); ++i) {
    c10::impl::GenericDict s(c10::StringType::get(), c10::AnyType::get());
    s.insert("loss_scale", scalers[i].loss_scale());
    s.insert("unskipped", scalers[i].unskipped());
    out.insert("loss_scaler" + std::to_string(i), s);
  }
  for (const auto& feature : detail::OptimizerAccess::features(optimizer)) {  // amp's keys (Apex would refuse them)
    if (auto entry = feature->python_state(optimizer)) out.insert(feature->key(), *entry);
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
