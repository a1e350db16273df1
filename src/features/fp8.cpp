// Options::fp8 as a training feature: the scales and amax histories of each model's FP8 layers (src/casting/fp8.*)
// commit after a taken step, are dropped after a skipped one, resume bitwise from either checkpoint format, and,
// with delayed scaling under amp::parallel, commit the maximum over the ranks (as Transformer Engine reduces its
// amaxes over the data-parallel group; dynamic scaling and the slice, tile and block recipes scale each rank's
// tensors by their own amaxes, as torchao's recipes under DDP). auto_fallback's counts and decisions (NOTE [FP8
// auto fallback]) travel the same ways.

#include "features/fp8.h"

#include "amp/fp8.h"
#include "casting/fp8.h"
#include "casting/precision_policy.h"
#include "interop/python_values.h"
#include "optim/optimizer_access.h"

namespace amp::detail {
namespace {

// The FP8 states of the optimizer's models, in initialize's order.
std::vector<std::shared_ptr<Fp8State>> feature_fp8_states(const OptimizerBase& optimizer) {
  std::vector<std::shared_ptr<Fp8State>> out;
  if (!optimizer.properties().fp8) return out;
  for (const auto& model : OptimizerAccess::models(optimizer)) {
    if (const auto policy = precision_policy_of(*model); policy && policy->fp8()) out.push_back(policy->fp8());
  }
  return out;
}

}  // namespace

// Its scales commit only after a taken step, so the host must know each skip when it happens.
bool Fp8Feature::needs_overflow_on_host(const OptimizerBase& optimizer) const {
  return optimizer.properties().fp8.has_value();
}

void Fp8Feature::describe_overflow(const OptimizerBase& optimizer, OverflowReport& report) const {
  for (const auto& fp8 : feature_fp8_states(optimizer)) {
    for (auto& name : fp8->non_finite_layers()) report.fp8_layers.push_back(std::move(name));
  }
}

void Fp8Feature::after_step(OptimizerBase& optimizer, bool taken) {
  for (const auto& fp8 : feature_fp8_states(optimizer)) fp8->end_step(taken);  // a skipped step never reaches the history
}

void Fp8Feature::save(const OptimizerBase& optimizer, torch::serialize::OutputArchive& archive) const {
  const auto fp8 = feature_fp8_states(optimizer);  // one model after the other
  archive.write("fp8/models", c10::IValue(static_cast<int64_t>(fp8.size())));
  for (size_t k = 0; k < fp8.size(); ++k) fp8[k]->save(archive, "fp8/" + std::to_string(k) + "/");
}

std::function<void()> Fp8Feature::load(OptimizerBase& optimizer, torch::serialize::InputArchive& archive,
                                       const std::string& where) {
  const auto fp8 = feature_fp8_states(optimizer);
  c10::IValue models;
  const int64_t saved = archive.try_read("fp8/models", models) && models.isInt() ? models.toInt() : 0;
  TORCH_CHECK(saved == static_cast<int64_t>(fp8.size()), where, ": the checkpoint holds the FP8 scaling state of ",
              saved, " model(s), this optimizer trains ", fp8.size(), " model(s) with FP8 layers. Resume with fp8 ",
              saved > 0 ? "on (config: fp8 = true)" : "off", " as the checkpoint was saved, or start the new recipe "
              "from the weights alone (amp::load_weights).");
  std::vector<std::function<void()>> restore;
  for (size_t k = 0; k < fp8.size(); ++k) {
    restore.push_back(fp8[k]->load(archive, "fp8/" + std::to_string(k) + "/", where + ": the checkpoint"));
  }
  return [restore] {
    for (const auto& r : restore) r();
  };
}

// put_amp's entry: one dict per model with FP8 layers, {'layers': [str], 'fallbacks': [str], 'scales', 'history',
// 'history_amax', 'position', 'overflow_steps': Tensor}.
std::optional<c10::IValue> Fp8Feature::python_state(const OptimizerBase& optimizer) const {
  const auto states = feature_fp8_states(optimizer);
  if (states.empty()) return std::nullopt;
  c10::impl::GenericList models(c10::AnyType::get());
  for (const auto& state : states) {
    c10::impl::GenericDict entry(c10::StringType::get(), c10::AnyType::get());
    entry.insert("layers", c10::List<std::string>(state->names()));
    entry.insert("fallbacks", c10::List<std::string>(state->fallbacks()));
    for (const auto& [name, tensor] : state->state_tensors()) entry.insert(name, tensor);
    models.push_back(entry);
  }
  return c10::IValue(models);
}

std::function<void()> Fp8Feature::load_python_state(OptimizerBase& optimizer, const std::optional<c10::IValue>& entry,
                                                    const std::string& at) {
  if (!entry) return nullptr;  // an Apex or pre-FP8 checkpoint: FP8 layers start their scales afresh
  const char* m = "amp::PythonCheckpoint::load_amp: ";
  const auto states = feature_fp8_states(optimizer);
  TORCH_CHECK(entry->isList(), m, at, " is ", type_of(*entry), ", not the list of dicts put_amp writes.");
  const auto list = entry->toListRef();
  TORCH_CHECK(list.size() == states.size(), m, at, " holds the FP8 scaling state of ", list.size(), " model(s), this "
              "optimizer trains ", states.size(), " model(s) with FP8 layers. Resume with fp8 ",
              list.empty() ? "off" : "on (config: fp8 = true)", " as the checkpoint was saved.");
  std::vector<std::function<void()>> restore;
  for (size_t k = 0; k < list.size(); ++k) {
    const std::string here = at + "[" + std::to_string(k) + "]";
    TORCH_CHECK(list[k].isGenericDict(), m, here, " is ", type_of(list[k]), ", not a dict.");
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    std::vector<std::string> layers, fallbacks;
    for (const auto& item : list[k].toGenericDict()) {
      TORCH_CHECK(item.key().isString(), m, here, " has a key that is ", type_of(item.key()), ".");
      const std::string& name = item.key().toStringRef();
      if (name == "layers" || name == "fallbacks") {
        TORCH_CHECK(item.value().isList(), m, here, "['", name, "'] is ", type_of(item.value()), ", not a list of str.");
        for (const auto& v : item.value().toListRef()) {
          TORCH_CHECK(v.isString(), m, here, "['", name, "'] holds ", type_of(v), ", not only str.");
          (name == "layers" ? layers : fallbacks).push_back(v.toStringRef());
        }
      } else {
        TORCH_CHECK(item.value().isTensor(), m, here, "['", name, "'] is ", type_of(item.value()), ", not a tensor.");
        tensors.emplace_back(name, item.value().toTensor());
      }
    }
    restore.push_back(states[k]->restore_state(tensors, layers, fallbacks, std::string(m) + here));
  }
  return [restore] {
    for (const auto& r : restore) r();
  };
}

void Fp8Feature::join_ranks(torch::nn::Module& model, const std::shared_ptr<RankLink>& link) {
  const auto policy = precision_policy_of(model);
  if (!policy || !policy->fp8() || !policy->fp8()->reduces_over_ranks()) return;
  policy->fp8()->set_amax_reducer([weak = std::weak_ptr<RankLink>(link)](at::Tensor& amax) {
    if (const auto l = weak.lock()) l->max_over_ranks(amax);
  });
}

void Fp8Feature::leave_ranks(torch::nn::Module& model) {
  if (const auto policy = precision_policy_of(model); policy && policy->fp8()) policy->fp8()->set_amax_reducer(nullptr);
}

}  // namespace amp::detail

namespace amp {

std::vector<Fp8LayerState> fp8_layers(const OptimizerBase& optimizer) {
  std::vector<Fp8LayerState> out;
  for (const auto& state : detail::feature_fp8_states(optimizer)) {
    for (auto& layer : state->report()) out.push_back(std::move(layer));
  }
  return out;
}

std::vector<std::string> fp8_fallbacks(const OptimizerBase& optimizer) {
  std::vector<std::string> out;
  for (const auto& state : detail::feature_fp8_states(optimizer)) {
    for (auto& name : state->fallbacks()) out.push_back(std::move(name));
  }
  return out;
}

}  // namespace amp
