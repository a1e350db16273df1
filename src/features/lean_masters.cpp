// The lean master formats as a training feature: each bf16 weight's low bits or compensation and the stochastic
// rounding generator (NOTE [Lean masters] in src/optim/lean_masters.h) go into torch::save archives beside the
// weights, and under amp::parallel every rank starts from rank 0's, so that the ranks rebuild and round the same
// fp32 values. Python checkpoints hold each parameter's fp32 value instead (PythonCheckpoint::put_model).

#include "features/lean_masters.h"

#include "amp/master_weights.h"
#include "optim/lean_masters.h"
#include "optim/optimizer_access.h"
#include "optim/param_index.h"

namespace amp::detail {

void LeanMastersFeature::save(const OptimizerBase& optimizer, torch::serialize::OutputArchive& archive) const {
  if (const auto& lean = OptimizerAccess::index(optimizer).lean()) lean->save(archive);
}

std::function<void()> LeanMastersFeature::load(OptimizerBase& optimizer, torch::serialize::InputArchive& archive,
                                               const std::string& where) {
  const auto& lean = OptimizerAccess::index(optimizer).lean();
  c10::IValue format;
  const amp::MasterWeights saved = archive.try_read("lean/format", format) && format.isInt()
                                  ? static_cast<amp::MasterWeights>(format.toInt())
                                  : amp::MasterWeights::kCopy;
  const amp::MasterWeights mine = lean ? lean->format() : amp::MasterWeights::kCopy;
  TORCH_CHECK(saved == mine, where, ": the checkpoint was saved with master_weights_format ", to_string(saved),
              ", this optimizer runs with ", to_string(mine), ". Resume with the format the checkpoint was saved "
              "with (amp::Options::master_weights_format / config key master_weights_format).");
  return lean ? lean->load(archive, where.c_str()) : nullptr;
}

void LeanMastersFeature::join_ranks(torch::nn::Module& model, const std::shared_ptr<RankLink>& link) {
  const auto index = index_.lock();
  const std::shared_ptr<LeanMasters> table = index ? index->lean() : nullptr;
  if (!table) return;
  std::vector<size_t> mine;  // this model's parameters in the optimizer's table
  for (const auto& p : model.parameters()) {
    if (auto m = find_lean(p); m && m->first == table) mine.push_back(m->second);
  }
  if (mine.empty()) return;
  if (link->rank() == 0) table->refresh_changed();  // the low bits follow writes into the model first
  const at::Tensor generator = at::tensor({static_cast<int64_t>(table->seed()), static_cast<int64_t>(table->counter())},
                                          at::TensorOptions().dtype(at::kLong)).to(table->param(mine.front()).device());
  std::vector<at::Tensor> outgoing{generator};
  for (size_t i : mine) {
    if (table->aux(i).defined()) outgoing.push_back(table->aux(i));
  }
  link->broadcast_from_rank0(std::move(outgoing), [table, generator, mine] {
    const at::Tensor state = generator.cpu();
    table->set_generator(static_cast<uint64_t>(state[0].item<int64_t>()), static_cast<uint64_t>(state[1].item<int64_t>()));
    for (size_t i : mine) table->mark_synced(i);
  });
}

}  // namespace amp::detail
