#include "optim/float32_bytes.h"

// What torch::load leaves in a model amp has cast: fp32 bytes under a float16/bfloat16 tensor. Checked before each
// forward (amp::Model) and wherever amp reads a parameter it keeps a master or lean value of.

#include "amp/model.h"
#include "options/format.h"

namespace amp::detail {

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

}  // namespace amp::detail
