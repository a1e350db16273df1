#include "optim/write_loaded.h"

#include <ATen/Functions.h>
#include <c10/core/GradMode.h>

#include "optim/float32_bytes.h"
#include "optim/lean_masters.h"
#include "optim/master_weights.h"

namespace amp::detail {

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

}  // namespace amp::detail
