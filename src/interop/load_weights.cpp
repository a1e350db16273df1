#include "amp/load_weights.h"

#include <ATen/Functions.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <vector>

#include "optim/fp32_values.h"
#include "optim/master_weights.h"

namespace amp {
namespace {

struct Pending {
  std::string key;
  at::Tensor target;
  at::Tensor value;
};

// Reads every parameter and buffer of `module` (and its children, nested as torch::save writes them)
// from `archive`, checking keys and shapes.
void collect(torch::nn::Module& module, torch::serialize::InputArchive& archive, const std::string& prefix,
             std::vector<Pending>& out) {
  std::vector<std::string> expected;
  auto read = [&](const std::string& name, const at::Tensor& target, bool is_buffer) {
    const std::string key = prefix + name;
    detail::check_loadable(target, key, "amp::load_weights");
    expected.push_back(name);
    at::Tensor value;  // undefined: try_read hands the stored tensor over instead of set_-ing it into target
    TORCH_CHECK(archive.try_read(name, value, is_buffer), "amp::load_weights: the checkpoint has no ",
                (is_buffer ? "buffer" : "parameter"), " '", key, "'. It was saved from another model; load a "
                "checkpoint of this model's architecture.");
    TORCH_CHECK(value.sizes() == target.sizes(), "amp::load_weights: '", key, "' has shape ", value.sizes(),
                " in the checkpoint and ", target.sizes(), " in the model.");
    TORCH_CHECK(value.is_floating_point() == target.is_floating_point(), "amp::load_weights: '", key, "' is ",
                value.scalar_type(), " in the checkpoint and ", target.scalar_type(), " in the model.");
    out.push_back({key, target, value});
  };
  for (const auto& item : module.named_parameters(/*recurse=*/false)) read(item.key(), item.value(), false);
  for (const auto& item : module.named_buffers(/*recurse=*/false)) read(item.key(), item.value(), true);
  for (const auto& child : module.named_children()) {
    expected.push_back(child.key());
    torch::serialize::InputArchive child_archive;
    TORCH_CHECK(archive.try_read(child.key(), child_archive), "amp::load_weights: the checkpoint has no submodule '",
                prefix + child.key(), "'. It was saved from another model; load a checkpoint of this model's "
                "architecture.");
    collect(*child.value(), child_archive, prefix + child.key() + ".", out);
  }
  for (const auto& key : archive.keys()) {
    TORCH_CHECK(std::find(expected.begin(), expected.end(), key) != expected.end(), "amp::load_weights: the "
                "checkpoint has '", prefix + key, "', which the model does not have. It was saved from another "
                "model; load a checkpoint of this model's architecture.");
  }
}

}  // namespace

void load_weights(torch::nn::Module& module, torch::serialize::InputArchive& archive) {
  std::vector<Pending> pending;
  collect(module, archive, "", pending);
  // Everything read and checked: now write.
  for (const auto& p : pending) detail::write_loaded(p.target, p.value);
}

void load_weights(torch::nn::Module& module, const std::string& path) {
  torch::serialize::InputArchive archive;
  try {
    archive.load_from(path);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "amp::load_weights: cannot read '", path, "' as a torch::save archive: ",
                e.what_without_backtrace());
  }
  load_weights(module, archive);
}

}  // namespace amp
