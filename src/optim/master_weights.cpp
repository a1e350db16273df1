#include "optim/master_weights.h"

#include <ATen/Functions.h>
#include <c10/core/GradMode.h>

#include "amp/model.h"

#include <mutex>
#include <unordered_map>

#include "amp/properties.h"
#include "optim/lean_masters.h"
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
  unreduced_flag_.push_back(0);
}

void MasterWeights::clear_pending_grads() {
  for (auto& t : pending_) t = at::Tensor();
  for (auto& t : unreduced_) t = at::Tensor();
  unreduced_flag_.assign(unreduced_flag_.size(), 0);
}

bool holds_float32_bytes(const at::Tensor& t) {
  if (!t.defined() || t.element_size() != 2 || !t.is_floating_point() || !t.has_storage()) return false;
  return t.storage_offset() == 0 && t.is_contiguous() &&
         t.storage().nbytes() == static_cast<size_t>(t.numel()) * 4 && t.numel() > 0;
}

void fail_float32_bytes(const std::string& what, const std::string& name, const at::Tensor& t) {
  TORCH_CHECK(false, "amp: ", what, " '", name, "' is ", dtype_name(t.scalar_type()), " but holds the bytes of ",
              t.numel(), " float32 values: an fp32 tensor was loaded into it with torch::load (or Tensor::set_), "
              "which reinterprets bytes instead of converting them, so its values are garbage. amp::initialize had "
              "already cast the model. Load weights after amp::initialize with amp::load_weights(*model, path), "
              "which converts dtypes and refreshes the fp32 master weights, or torch::load before amp::initialize.");
}

std::vector<std::pair<std::string, at::Tensor>> low_precision_tensors(torch::nn::Module& module) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  auto add = [&out](const std::string& name, const at::Tensor& t) {
    if (t.defined() && t.is_floating_point() && t.element_size() == 2) out.emplace_back(name, t);
  };
  for (const auto& item : module.named_parameters()) add(item.key(), item.value());
  for (const auto& item : module.named_buffers()) add(item.key(), item.value());
  return out;
}

void check_low_precision_tensors(const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  for (const auto& [name, t] : tensors) {
    if (holds_float32_bytes(t)) fail_float32_bytes(t.requires_grad() ? "parameter" : "tensor", name, t);
  }
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

void write_loaded(const at::Tensor& target, const at::Tensor& value) {
  c10::NoGradGuard no_grad;
  at::Tensor t = target;
  if (holds_float32_bytes(t)) t.set_(at::empty(t.sizes(), t.options()));
  if (auto master = find_master(t)) {
    auto& [table, index] = *master;
    table->master()[index].copy_(value);  // the fp32 value itself, not its rounded copy
    t.copy_(table->master()[index]);
    table->mark_synced(index);
  } else if (auto lean = find_lean(t)) {
    auto& [table, index] = *lean;
    table->store(index, value.to(t.device(), at::kFloat));  // the fp32 value in the lean form, not its rounded copy
  } else {
    t.copy_(value);
  }
}

void MasterWeights::refresh_changed() {
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
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < model_.size(); ++i) {
    check_usable(i);
    keep_where_rounded_equal(master_[i], model_[i]);
    mark_synced(i);
  }
}

void MasterWeights::copy_to_model() {
  if (model_.empty()) return;
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
