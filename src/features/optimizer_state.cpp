// The optimizer state format as a training feature (NOTE [Optimizer state formats] in src/optim/state_format.h). The
// moments themselves are the optimizer's state, in their format, so torch::save archives them already; the archive
// also gets the format and the stochastic rounding generator, so a resume rounds as the run it continues would have.
// Python checkpoints hold fp32 moments (PythonCheckpoint::put_optimizer decodes them).

#include "features/optimizer_state.h"

#include <c10/util/Type.h>

#include "amp/fused_optimizers.h"
#include "optim/optimizer_access.h"
#include "optim/optimizer_kinds.h"
#include "optim/param_index.h"
#include "optim/state_format.h"

namespace amp::detail {

void OptimizerStateFeature::save(const OptimizerBase& optimizer, torch::serialize::OutputArchive& archive) const {
  const auto& format = OptimizerAccess::index(optimizer).state_format();
  if (!format || format->format() == OptimizerStateFormat::kFp32) return;  // archives as before the formats existed
  archive.write("state_format/format", c10::IValue(static_cast<int64_t>(format->format())));
  archive.write("state_format/seed", c10::IValue(static_cast<int64_t>(format->seed())));  // the bits of the uint64
  archive.write("state_format/counter", c10::IValue(static_cast<int64_t>(format->counter())));
}

std::function<void()> OptimizerStateFeature::load(OptimizerBase& optimizer, torch::serialize::InputArchive& archive,
                                                  const std::string& where) {
  c10::IValue format, seed, counter;
  if (!archive.try_read("state_format/format", format)) return nullptr;  // fp32 moments
  TORCH_CHECK(format.isInt() && format.toInt() >= 0 && format.toInt() <= static_cast<int64_t>(OptimizerStateFormat::k8Bit) &&
                  archive.try_read("state_format/seed", seed) && seed.isInt() &&
                  archive.try_read("state_format/counter", counter) && counter.isInt(),
              where, ": the checkpoint's optimizer state format entries are incomplete; it is corrupt.");
  const auto saved = static_cast<OptimizerStateFormat>(format.toInt());
  const auto& opt = OptimizerAccess::torch_optimizer(optimizer);
  const OptimizerKind* kind = kind_of(opt);  // NOTE [Optimizer kinds]
  TORCH_CHECK(kind && kind->stores_formats, where, ": the checkpoint holds Adam's moments in optimizer_state_format ",
              to_string(saved), ", which only amp's fused Adam, AdamW, LAMB and Muon read; this optimizer is ",
              c10::demangle(typeid(opt).name()), ". Resume with amp::optim::", fused_kinds_with(&OptimizerKind::stores_formats),
              ".");
  const std::shared_ptr<StateFormat> mine = OptimizerAccess::index(optimizer).state_format();
  if (!mine || mine->format() != saved) return nullptr;  // the moments convert at the next step (rounded to nearest)
  return [mine, seed = static_cast<uint64_t>(seed.toInt()), counter = static_cast<uint64_t>(counter.toInt())] {
    mine->set_generator(seed, counter);
  };
}

// put_amp's entry: the format and bf16's generator (the moments themselves go into put_optimizer's fp32 state_dict).
std::optional<c10::IValue> OptimizerStateFeature::python_state(const OptimizerBase& optimizer) const {
  const auto& format = OptimizerAccess::index(optimizer).state_format();
  if (!format || format->format() == OptimizerStateFormat::kFp32) return std::nullopt;
  c10::impl::GenericDict entry(c10::StringType::get(), c10::AnyType::get());
  entry.insert("format", std::string(to_string(format->format())));
  entry.insert("seed", static_cast<int64_t>(format->seed()));
  entry.insert("counter", static_cast<int64_t>(format->counter()));
  return c10::IValue(entry);
}

std::function<void()> OptimizerStateFeature::load_python_state(OptimizerBase& optimizer,
                                                               const std::optional<c10::IValue>& entry,
                                                               const std::string& where) {
  const std::shared_ptr<StateFormat> mine = OptimizerAccess::index(optimizer).state_format();
  if (!entry || !mine) return nullptr;  // none saved: fp32 moments, a fresh generator
  TORCH_CHECK(entry->isGenericDict(), where, " is not a dict; the checkpoint is corrupt.");
  const auto dict = entry->toGenericDict();
  auto get = [&](const char* key) -> c10::IValue {
    TORCH_CHECK(dict.contains(key), where, " has no '", key, "'; the checkpoint is corrupt.");
    return dict.at(key);
  };
  const c10::IValue format = get("format"), seed = get("seed"), counter = get("counter");
  TORCH_CHECK(format.isString() && seed.isInt() && counter.isInt(), where, " holds values of the wrong types; the "
              "checkpoint is corrupt.");
  if (format.toStringRef() != to_string(mine->format())) return nullptr;  // the moments convert; the generator is new
  return [mine, seed = static_cast<uint64_t>(seed.toInt()), counter = static_cast<uint64_t>(counter.toInt())] {
    mine->set_generator(seed, counter);
  };
}

void OptimizerStateFeature::join_ranks(torch::nn::Module& model, const std::shared_ptr<RankLink>& link) {
  const auto index = index_.lock();
  const std::shared_ptr<StateFormat> format = index ? index->state_format() : nullptr;
  const auto params = model.parameters();
  if (!format || format->format() != OptimizerStateFormat::kBf16 || params.empty()) return;
  const at::Tensor generator = at::tensor({static_cast<int64_t>(format->seed()), static_cast<int64_t>(format->counter())},
                                          at::TensorOptions().dtype(at::kLong)).to(params.front().device());
  link->broadcast_from_rank0({generator}, [format, generator] {
    const at::Tensor state = generator.cpu();
    format->set_generator(static_cast<uint64_t>(state[0].item<int64_t>()), static_cast<uint64_t>(state[1].item<int64_t>()));
  });
}

}  // namespace amp::detail
