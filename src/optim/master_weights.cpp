#include "optim/master_weights.h"

#include <ATen/Functions.h>
#include <c10/core/GradMode.h>

#include <mutex>
#include <unordered_map>

#include "amp/properties.h"
#include "scaling/multi_tensor.h"

namespace amp::detail {
namespace {

const void* storage_of(const at::Tensor& t) { return t.storage().unsafeGetStorageImpl(); }

struct Entry {
  std::weak_ptr<MasterWeights> table;
  size_t index;
};
std::mutex registry_mutex;
std::unordered_map<const c10::TensorImpl*, Entry> registry;

}  // namespace

void MasterWeights::add(std::string name, at::Tensor model, at::Tensor master) {
  names_.push_back(std::move(name));
  version_.push_back(model._version());
  storage_.push_back(storage_of(model));
  model_.push_back(std::move(model));
  master_.push_back(std::move(master));
  pending_.emplace_back();
  unreduced_.emplace_back();
  reduced_.emplace_back();
  unreduced_flag_.push_back(0);
}

void MasterWeights::clear_pending_grads() {
  for (auto& t : pending_) t = at::Tensor();
  for (auto& t : unreduced_) t = at::Tensor();
  unreduced_flag_.assign(unreduced_flag_.size(), 0);
  clear_reduced_grads();
}

void MasterWeights::clear_reduced_grads() {
  for (auto& t : reduced_) t = at::Tensor();
}

void MasterWeights::check_usable(size_t i) const {
  const at::Tensor& m = model_[i];
  if (holds_float32_bytes(m)) fail_float32_bytes("parameter", names_[i], m);
  TORCH_CHECK(m.sizes() == master_[i].sizes(), "amp: parameter '", names_[i], "' changed shape from ",
              master_[i].sizes(), " to ", m.sizes(), " after amp::initialize. amp keeps an fp32 master of each "
              "weight; load weights of the shapes the model was built with.");
  TORCH_CHECK(m.scalar_type() != at::kFloat && m.is_floating_point(), "amp: parameter '", names_[i], "' is ",
              dtype_name(m.scalar_type()), " now, but amp::initialize cast it to low precision and keeps its fp32 "
              "master weight (something replaced its data, e.g. set_data or Module::to, after initialize). Write "
              "weights in place instead: amp::load_weights(*model, path), or copy_ under torch::NoGradGuard.");
}

void MasterWeights::refresh_changed() {
  TORCH_CHECK(!sharded(), "amp: the fp32 master weights are sharded by amp::parallel::shard_optimizer; its Sharding "
              "updates them (internal error: refresh_changed reached a sharded table).");
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < model_.size(); ++i) {
    const at::Tensor& m = model_[i];
    if (m._version() == version_[i] && storage_of(m) == storage_[i]) continue;
    check_usable(i);
    keep_where_rounded_equal(master_[i], m);
    mark_synced(i);
  }
}

void keep_where_rounded_equal(const at::Tensor& master, const at::Tensor& written) {
  // Compared as bits where they are 16 (float16, bfloat16): -0 and +0 differ, and NaN equals the same NaN.
  const at::Tensor rounded = master.to(written.scalar_type());
  const at::Tensor same = written.element_size() == 2 ? rounded.view(at::kShort).eq(written.view(at::kShort))
                                                      : rounded.eq(written);
  master.copy_(at::where(same, master, written.to(master.scalar_type())));
}

void MasterWeights::refresh_all() {
  TORCH_CHECK(!sharded(), "amp: the fp32 master weights are sharded by amp::parallel::shard_optimizer; its Sharding "
              "updates them (internal error: refresh_all reached a sharded table).");
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < model_.size(); ++i) {
    check_usable(i);
    keep_where_rounded_equal(master_[i], model_[i]);
    mark_synced(i);
  }
}

void MasterWeights::copy_to_model() {
  if (model_.empty()) return;
  TORCH_CHECK(!sharded(), "amp: the fp32 master weights are sharded by amp::parallel::shard_optimizer; its Sharding "
              "updates them (internal error: copy_to_model reached a sharded table).");

  copy_(model_, master_);
  for (size_t i = 0; i < model_.size(); ++i) mark_synced(i);
}

void MasterWeights::mark_all_synced() {
  for (size_t i = 0; i < model_.size(); ++i) mark_synced(i);
}

void MasterWeights::mark_synced(size_t i) {
  version_[i] = model_[i]._version();
  storage_[i] = storage_of(model_[i]);
}

void register_masters(const std::shared_ptr<MasterWeights>& table) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  for (auto it = registry.begin(); it != registry.end();) {
    const auto owner = it->second.table.lock();
    it = (!owner || owner == table) ? registry.erase(it) : std::next(it);
  }
  for (size_t i = 0; i < table->size(); ++i) {
    TORCH_CHECK(!registry.count(table->model()[i].unsafeGetTensorImpl()), "amp::initialize: parameter '",
                table->name(i), "' is already stepped by another amp::Optimizer with fp32 master weights; two "
                "optimizers would update two masters of one weight. Put each parameter in one optimizer.");
  }
  for (size_t i = 0; i < table->size(); ++i) {
    registry.emplace(table->model()[i].unsafeGetTensorImpl(), Entry{table, i});
  }
}

std::optional<std::pair<std::shared_ptr<MasterWeights>, size_t>> find_master(const at::Tensor& model_param) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  const auto it = registry.find(model_param.unsafeGetTensorImpl());
  if (it == registry.end()) return std::nullopt;
  auto table = it->second.table.lock();
  if (!table) return std::nullopt;
  return std::make_pair(std::move(table), it->second.index);
}

}  // namespace amp::detail
