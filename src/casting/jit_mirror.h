#pragma once
// The torch::nn::Module tree amp works on for a TorchScript module (amp/torchscript.h).
//
// NOTE [TorchScript mirror]
// amp's machinery (casts, masters, the precision policy, frozen BatchNorm, checkpoints) walks torch::nn::Module
// trees and keys everything by TensorImpl. A torch::jit::Module is another tree over the same kind of tensors, so
// amp builds one JitModuleNode per TorchScript submodule, with the submodule's own parameters and buffers
// registered under their TorchScript names: the same TensorImpls, not copies. set_data (initialize's casts, the
// masters' copies) then changes what the TorchScript module computes with, and qualified names are the Python
// state_dict's. A node's train() sets its TorchScript module's `training` attribute. One mirror per TorchScript
// object lives as long as something holds it (amp::Model, amp::Optimizer); freeze_batchnorm's marks live on the
// TorchScript objects, so a mirror made later sees them.

#include <ATen/core/Tensor.h>
#include <torch/csrc/jit/api/module.h>
#include <torch/nn/module.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace amp::detail {

class JitModuleNode : public torch::nn::Module {
 public:
  /// `root`: the node amp was handed (it records every slot of the tree, for replaced_tensor).
  explicit JitModuleNode(const torch::jit::Module& module, bool root = true);

  /// Sets this node's TorchScript `training` attribute and its children's.
  void train(bool on = true) override;

  const torch::jit::Module& jit_module() const noexcept { return module_; }
  /// The TorchScript type with the ___torch_mangle_N segments removed ("__torch__.torch.nn.modules.batchnorm.BatchNorm2d").
  const std::string& type_name() const noexcept { return type_name_; }
  /// The type name's last segment ("BatchNorm2d", "LayerNorm", a Python class's own name).
  std::string class_name() const;
  /// Whether the type is torch.nn's BatchNorm1d/2d/3d.
  bool is_batchnorm() const noexcept { return is_batchnorm_; }
  /// For a BatchNorm layer: the `training` value its traced graph has baked in (nullopt: scripted, reads self.training).
  std::optional<bool> traced_training() const noexcept { return traced_training_; }
  /// Whether freeze_batchnorm(torch::jit::Module&) froze this layer.
  bool frozen() const;
  void mark_frozen();

  /// The qualified name of the first parameter or buffer whose TorchScript slot no longer holds the tensor the
  /// mirror registered (replaced with setattr or register_parameter after the mirror was made), or nullopt.
  std::optional<std::string> replaced_tensor() const;

 private:
  struct Slot {
    std::string name;       // qualified, from the mirror's root
    c10::intrusive_ptr<c10::ivalue::Object> object;
    size_t slot;
    const c10::TensorImpl* tensor;
  };
  JitModuleNode(const torch::jit::Module& module, bool root, std::string type_name);

  torch::jit::Module module_;
  std::string type_name_;
  bool is_batchnorm_ = false;
  std::optional<bool> traced_training_;
  std::vector<Slot> slots_;  // the root's: every registered tensor of the tree
};

/// The mirror of `module`: the live one if amp made one already, else a new one.
std::shared_ptr<JitModuleNode> jit_mirror_node(const torch::jit::Module& module);

/// Whether `root` is a TorchScript mirror (a mirror is a whole tree: its root tells).
bool holds_jit_modules(const torch::nn::Module& root);

}  // namespace amp::detail
