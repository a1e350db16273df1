// TorchScript models in checkpoints: Model<torch::jit::Module>::save writes the TorchScript module with the fp32 value
// amp keeps of each tensor (as a Python script's torch.jit.save of the fp32 model would), and PythonCheckpoint reads
// and writes a TorchScript model's state dict through its mirror (src/casting/jit_mirror.h).

#include <c10/core/GradMode.h>

#include "amp/python_checkpoint.h"
#include "amp/torchscript_model.h"
#include "casting/jit_mirror.h"
#include "optim/fp32_values.h"

namespace amp {

void Model<torch::jit::Module>::save(const std::string& path) const {
  torch::jit::Module copy = module_.clone();
  c10::NoGradGuard no_grad;
  for (const auto& [name, value] : detail::fp32_state(*mirror_)) {
    torch::jit::Module owner = copy;
    size_t start = 0;
    for (size_t dot = name.find('.'); dot != std::string::npos; start = dot + 1, dot = name.find('.', start)) {
      owner = owner.attr(name.substr(start, dot - start)).toModule();
    }
    const std::string attribute = name.substr(start);
    const bool requires_grad = owner.attr(attribute).toTensor().requires_grad();
    at::Tensor fp32 = value.detach().clone();
    fp32.set_requires_grad(requires_grad);
    owner.setattr(attribute, fp32);
  }
  copy.save(path);
}

void PythonCheckpoint::load_model(torch::jit::Module& module, std::string_view key) const {
  load_model(module, key, PythonCheckpointLoadOptions());
}

void PythonCheckpoint::load_model(torch::jit::Module& module, std::string_view key,
                                  const PythonCheckpointLoadOptions& options) const {
  load_model(*detail::jit_mirror_node(module), key, options);
}

void PythonCheckpoint::put_model(std::string_view key, torch::jit::Module& module) {
  put_model(key, *detail::jit_mirror_node(module));
}

}  // namespace amp
