#include "scaling/scaled_grads.h"

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <atomic>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "options/format.h"

namespace amp::detail {
namespace {

struct Record {
  c10::weak_intrusive_ptr<c10::TensorImpl> grad;
  int64_t version;
  double scale;
  int loss_id;
};

std::mutex ledger_mutex;
std::unordered_map<const c10::TensorImpl*, Record> ledger;  // keyed by the parameter
std::atomic<size_t> ledger_size{0};

// Returns whether `record` still describes `param`'s gradient (not zeroed, replaced or freed since).
bool still_scaled(const at::Tensor& param, const Record& record) {
  const at::Tensor& grad = param.grad();
  if (!grad.defined() || record.grad.expired()) return false;
  return record.grad._unsafe_get_target() == grad.unsafeGetTensorImpl() && grad._version() == record.version;
}

}  // namespace

std::vector<at::Tensor> gradient_leaves(const at::Tensor& loss) {
  std::vector<at::Tensor> leaves;
  const auto root = loss.grad_fn();
  if (!root) {
    if (loss.requires_grad()) leaves.push_back(loss);
    return leaves;
  }
  std::unordered_set<const torch::autograd::Node*> seen{root.get()};
  std::vector<torch::autograd::Node*> stack{root.get()};
  while (!stack.empty()) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    if (auto* accumulate = dynamic_cast<torch::autograd::AccumulateGrad*>(node)) {
      if (accumulate->variable.defined()) leaves.push_back(accumulate->variable);
      continue;
    }
    for (const auto& edge : node->next_edges()) {
      torch::autograd::Node* next = edge.function.get();
      if (next && seen.insert(next).second) stack.push_back(next);
    }
  }
  return leaves;
}

void record_scaled_grads(const std::vector<at::Tensor>& leaves, double scale, int loss_id) {
  if (leaves.empty()) return;
  std::lock_guard<std::mutex> lock(ledger_mutex);
  for (const auto& leaf : leaves) {
    const at::Tensor& grad = leaf.grad();
    if (!grad.defined()) continue;
    Record record{c10::weak_intrusive_ptr<c10::TensorImpl>(grad.getIntrusivePtr()), grad._version(), scale, loss_id};
    const auto [it, inserted] = ledger.emplace(leaf.unsafeGetTensorImpl(), record);
    if (!inserted) it->second = std::move(record);
  }
  // Keep the ledger as small as the live records: drop those whose gradient is gone.
  for (auto it = ledger.begin(); it != ledger.end();) it = it->second.grad.expired() ? ledger.erase(it) : std::next(it);
  ledger_size.store(ledger.size(), std::memory_order_release);
}

void check_no_scaled_grads(const std::vector<at::Tensor>& params, const std::function<std::string(size_t)>& name_of,
                           const char* action) {
  if (ledger_size.load(std::memory_order_acquire) == 0) return;
  std::lock_guard<std::mutex> lock(ledger_mutex);
  for (size_t i = 0; i < params.size(); ++i) {
    const auto it = ledger.find(params[i].unsafeGetTensorImpl());
    if (it == ledger.end()) continue;
    if (!still_scaled(params[i], it->second)) {
      ledger.erase(it);
      ledger_size.store(ledger.size(), std::memory_order_release);
      continue;
    }
    TORCH_CHECK(false, "amp::Optimizer::", action, ": the gradient of parameter '", name_of(i), "' is still "
                "multiplied by loss scale ", format_float(it->second.scale), " (loss_id ", it->second.loss_id,
                "): it came from amp::scale_loss with other optimizers, which unscale only their own parameters' "
                "gradients. Pass every optimizer whose parameters the loss reaches: amp::scale_loss(loss, "
                "{&optimizer_a, &optimizer_b}) (initialize them together, so they share loss scalers), or clear "
                "this gradient first (zero_grad) if it should not be used.");
  }
}

}  // namespace amp::detail
