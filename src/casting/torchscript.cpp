// TorchScript models at an opt level (amp/torchscript.h): the mirror (NOTE [TorchScript mirror] in jit_mirror.h),
// initialize, amp::Model's forward and the checkpoints.
//
// NOTE [TorchScript runs op by op]
// TorchScript's graph executor, optimizing, replaces a scripted forward's autograd by its own symbolic
// derivatives (DifferentiableGraph) and runs the JIT's autocast pass over the graph. Both were written for one
// dtype per graph: under eager autocast the derivative of a cast mm sees a Half grad and a Float input ("expected
// scalar type Half but found Float" in AD_mm_backward_self, pytorch #25387), and the pass puts casts where eager
// autocast would not (a residual add in fp32). amp::Model's forward turns the executor's optimization off for its
// own thread (setGraphExecutorOptimize is thread local; the JIT's global autocast switch is left alone): the graph
// then runs each op through the dispatcher with eager autograd, so autocast (O1), the precision policy and amp's
// cast kernels act exactly as on a torch::nn::Module, and a step equals Python's eager step on the same scripted
// module (tests/torchscript_test.cpp). Without optimization the executor forms no differentiable graphs and no
// fusion groups; on the CPU that costs nothing measurable (amp_bench --section torchscript: the bench CNN's plain
// step op by op was faster than optimized). Not yet measured on a GPU, where fusion groups can matter.

#include "amp/torchscript_model.h"

#include <c10/core/GradMode.h>
#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/runtime/graph_executor.h>

#include <algorithm>
#include <cctype>
#include <mutex>
#include <utility>

#include "amp/batchnorm.h"
#include "options/format.h"
#include "casting/jit_mirror.h"
#include "casting/model_casting.h"
#include "casting/precision_policy.h"

namespace amp {
namespace detail {
namespace {

// Strips the ___torch_mangle_N segments TorchScript adds to a class defined twice (traced modules, a Conv2d
// without bias): "__torch__.torch.nn.modules.batchnorm.___torch_mangle_3.BatchNorm2d" -> "....batchnorm.BatchNorm2d".
std::string demangled_type_name(const torch::jit::Module& module) {
  const auto name = module.type()->name();
  std::string text = name ? name->qualifiedName() : std::string("<unnamed>");
  const std::string mangle = "___torch_mangle_";
  for (size_t at = text.find(mangle); at != std::string::npos; at = text.find(mangle, at)) {
    size_t end = at + mangle.size();
    while (end < text.size() && std::isdigit(static_cast<unsigned char>(text[end]))) ++end;
    if (end < text.size() && text[end] == '.') ++end;
    text.erase(at, end - at);
  }
  return text;
}

// The `training` argument of the batch_norm in a BatchNorm layer's forward when it is a constant: a traced
// layer's (torch.jit.trace records the value the layer had). nullopt: the graph reads self.training (scripted).
std::optional<bool> baked_training(const torch::jit::Module& layer) {
  const auto method = layer.find_method("forward");
  if (!method) return std::nullopt;
  static const auto batch_norm = c10::Symbol::fromQualString("aten::batch_norm");
  static const auto impl_index = c10::Symbol::fromQualString("aten::_batch_norm_impl_index");
  for (torch::jit::Node* node : method->graph()->nodes()) {
    if (node->kind() != batch_norm && node->kind() != impl_index) continue;
    const auto training = torch::jit::toIValue(node->input(5));
    if (training && training->isBool()) return training->toBool();
    return std::nullopt;
  }
  return std::nullopt;
}

// TorchScript objects freeze_batchnorm froze, held weakly.
std::mutex frozen_mutex;
std::vector<std::pair<const c10::ivalue::Object*, c10::weak_intrusive_ptr<c10::ivalue::Object>>> frozen_objects;

// Live mirrors, one per TorchScript object.
std::mutex mirrors_mutex;
std::vector<std::weak_ptr<JitModuleNode>> mirrors;

void check_current(const torch::nn::Module& mirror) {
  if (const auto replaced = static_cast<const JitModuleNode&>(mirror).replaced_tensor()) {
    TORCH_CHECK(false, "amp::Model: '", *replaced, "' of the TorchScript module was replaced after amp::initialize "
                "(setattr or register_parameter), so amp's casts and fp32 master weights no longer reach it and the "
                "optimizer would step a tensor the module doesn't use. Load weights into the initialized module "
                "instead: amp::PythonCheckpoint::load_model(module, ...), or copy_ into the tensor under "
                "torch::NoGradGuard.");
  }
}

// Turns the graph executor's optimization off for this thread (NOTE [TorchScript runs op by op]).
class OpByOpGuard {
 public:
  OpByOpGuard() : previous_(torch::jit::getGraphExecutorOptimize()) { torch::jit::setGraphExecutorOptimize(false); }
  ~OpByOpGuard() { torch::jit::setGraphExecutorOptimize(previous_); }
  OpByOpGuard(const OpByOpGuard&) = delete;
  OpByOpGuard& operator=(const OpByOpGuard&) = delete;

 private:
  bool previous_;
};

}  // namespace

JitModuleNode::JitModuleNode(const torch::jit::Module& module, bool root)
    : JitModuleNode(module, root, demangled_type_name(module)) {}

JitModuleNode::JitModuleNode(const torch::jit::Module& module, bool root, std::string type_name)
    : torch::nn::Module(type_name), module_(module), type_name_(std::move(type_name)) {
  const std::string batchnorm = "__torch__.torch.nn.modules.batchnorm.", name = class_name();
  is_batchnorm_ = type_name_ == batchnorm + name && (name == "BatchNorm1d" || name == "BatchNorm2d" || name == "BatchNorm3d");
  if (is_batchnorm_) traced_training_ = baked_training(module);
  torch::nn::Module::train(module.is_training());  // before children exist: this node's flag alone
  for (const auto& p : module.named_parameters(/*recurse=*/false)) register_parameter(p.name, p.value, p.value.requires_grad());
  for (const auto& b : module.named_buffers(/*recurse=*/false)) register_buffer(b.name, b.value);
  for (const auto& c : module.named_children()) register_module(c.name, std::make_shared<JitModuleNode>(c.value, false));
  if (!root) return;
  for (const auto& item : module.named_modules()) {
    const auto object = item.value._ivalue();
    const auto type = object->type();
    for (size_t i = 0; i < type->numAttributes(); ++i) {
      if (!(type->is_parameter(i) || type->is_buffer(i)) || !object->getSlot(i).isTensor()) continue;
      const std::string prefix = item.name.empty() ? "" : item.name + ".";
      slots_.push_back({prefix + type->getAttributeName(i), object, i, object->getSlot(i).toTensor().unsafeGetTensorImpl()});
    }
  }
}

void JitModuleNode::train(bool on) {
  if (module_.hasattr("training")) module_._ivalue()->setAttr("training", on);
  torch::nn::Module::train(on);  // the children (their own train) and this node's flag
}

std::string JitModuleNode::class_name() const {
  const size_t dot = type_name_.rfind('.');
  return dot == std::string::npos ? type_name_ : type_name_.substr(dot + 1);
}

bool JitModuleNode::frozen() const {
  std::lock_guard<std::mutex> lock(frozen_mutex);
  const auto* object = module_._ivalue().get();
  return std::any_of(frozen_objects.begin(), frozen_objects.end(),
                     [&](const auto& e) { return e.first == object && !e.second.expired(); });
}

void JitModuleNode::mark_frozen() {
  std::lock_guard<std::mutex> lock(frozen_mutex);
  frozen_objects.erase(std::remove_if(frozen_objects.begin(), frozen_objects.end(),
                                      [](const auto& e) { return e.second.expired(); }),
                       frozen_objects.end());
  const auto* object = module_._ivalue().get();
  if (std::none_of(frozen_objects.begin(), frozen_objects.end(), [&](const auto& e) { return e.first == object; })) {
    frozen_objects.emplace_back(object, c10::weak_intrusive_ptr<c10::ivalue::Object>(module_._ivalue()));
  }
}

std::optional<std::string> JitModuleNode::replaced_tensor() const {
  for (const auto& s : slots_) {
    const c10::IValue& value = s.object->getSlot(s.slot);
    if (!value.isTensor() || value.toTensor().unsafeGetTensorImpl() != s.tensor) return s.name;
  }
  return std::nullopt;
}

std::shared_ptr<JitModuleNode> jit_mirror_node(const torch::jit::Module& module) {
  std::lock_guard<std::mutex> lock(mirrors_mutex);
  mirrors.erase(std::remove_if(mirrors.begin(), mirrors.end(), [](const auto& w) { return w.expired(); }), mirrors.end());
  for (const auto& weak : mirrors) {
    if (auto node = weak.lock(); node && node->jit_module()._ivalue().get() == module._ivalue().get()) return node;
  }
  auto node = std::make_shared<JitModuleNode>(module);
  mirrors.push_back(node);
  return node;
}

bool holds_jit_modules(const torch::nn::Module& root) { return dynamic_cast<const JitModuleNode*>(&root) != nullptr; }

std::shared_ptr<torch::nn::Module> jit_mirror(const torch::jit::Module& model) { return jit_mirror_node(model); }

c10::IValue cast_ivalue(const c10::IValue& value, c10::ScalarType dtype) {
  if (value.isTensor()) return cast_floating(value.toTensor(), dtype);
  if (value.isTuple()) {
    const auto tuple = value.toTuple();
    std::vector<c10::IValue> elements;
    for (const auto& e : tuple->elements()) elements.push_back(cast_ivalue(e, dtype));
    const auto type = tuple->type();
    return type && type->schema() ? c10::ivalue::Tuple::createNamed(std::move(elements), type)
                                  : c10::ivalue::Tuple::create(std::move(elements));
  }
  if (value.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor& t : value.toTensorList()) out.push_back(cast_floating(t, dtype));
    return out;
  }
  if (value.isList()) {
    const auto list = value.toList();
    c10::impl::GenericList out(list.elementType());
    for (const c10::IValue& e : list) out.push_back(cast_ivalue(e, dtype));
    return out;
  }
  if (value.isGenericDict()) {
    const auto dict = value.toGenericDict();
    c10::impl::GenericDict out(dict.keyType(), dict.valueType());
    for (const auto& item : dict) out.insert(item.key(), cast_ivalue(item.value(), dtype));
    return out;
  }
  return value;
}

}  // namespace detail

std::vector<torch::Tensor> parameters(const torch::jit::Module& model) {
  std::vector<torch::Tensor> out;
  for (const auto& p : model.parameters(/*recurse=*/true)) out.push_back(p);
  return out;
}

void freeze_batchnorm(torch::jit::Module& model) {
  const auto mirror = detail::jit_mirror_node(model);
  std::vector<detail::JitModuleNode*> layers;
  for (const auto& item : mirror->named_modules("", /*include_self=*/true)) {
    auto* node = dynamic_cast<detail::JitModuleNode*>(item.value().get());
    if (!node || !node->is_batchnorm()) continue;
    TORCH_CHECK(node->traced_training() != std::optional<bool>(true), "amp::freeze_batchnorm: BatchNorm layer '",
                item.key().empty() ? "<the module itself>" : item.key(), "' was traced in training mode: torch.jit.trace "
                "baked training=True into its graph, so it normalizes with batch statistics and updates its running "
                "statistics whatever eval() says. Trace the model in eval mode (model.eval() before torch.jit.trace: the "
                "layers then use their running statistics), or script it (torch.jit.script keeps self.training).");
    layers.push_back(node);
  }
  for (auto* node : layers) {  // all checked before any is changed
    node->eval();
    for (auto& p : node->parameters(/*recurse=*/false)) p.set_requires_grad(false);
    node->mark_frozen();
  }
}

Model<torch::jit::Module>::Model(torch::jit::Module module, std::shared_ptr<torch::nn::Module> mirror,
                                 const Properties& properties, c10::DeviceType device)
    : module_(std::move(module)),
      mirror_(std::move(mirror)),
      properties_(properties),
      device_(device),
      float16_bn_statistics_(detail::float16_batchnorm_statistics(*mirror_)),
      low_precision_tensors_(detail::low_precision_tensors(*mirror_)),
      policy_(detail::precision_policy_of(*mirror_)) {}

c10::IValue Model<torch::jit::Module>::forward(std::vector<c10::IValue> inputs) {
  detail::check_current(*mirror_);
  detail::check_parameters_gathered(*mirror_);
  std::optional<AutocastGuard> casts;
  detail::PrecisionPolicyGuard policy(policy_);
  detail::OpByOpGuard op_by_op;
  if (properties_.enabled) {
    if (properties_.patch_torch_functions) casts.emplace(device_, properties_.low_precision_dtype, properties_.cast_lists);
    if (properties_.cast_model_type) {
      for (auto& input : inputs) input = detail::cast_ivalue(input, *properties_.cast_model_type);
    }
    detail::check_low_precision_tensors(low_precision_tensors_);
  }
  c10::IValue output = module_.forward(std::move(inputs));
  if (!properties_.enabled) return output;
  if (!float16_bn_statistics_.empty() && is_training()) detail::check_batchnorm_statistics(float16_bn_statistics_);
  return detail::cast_ivalue(output, properties_.cast_model_outputs);
}

void Model<torch::jit::Module>::train(bool on) {
  mirror_->train(on);
  detail::keep_frozen_layers_frozen(*mirror_);
  if (on || warned_traced_batchnorm_) return;
  std::string traced;
  for (const auto& item : mirror_->named_modules("", /*include_self=*/true)) {
    const auto* node = dynamic_cast<const detail::JitModuleNode*>(item.value().get());
    if (node && node->traced_training() == std::optional<bool>(true)) {
      traced += (traced.empty() ? "'" : ", '") + (item.key().empty() ? std::string("<the module itself>") : item.key()) + "'";
    }
  }
  if (traced.empty()) return;
  warned_traced_batchnorm_ = true;
  TORCH_WARN("amp::Model::eval: BatchNorm layer(s) ", traced, " of this TorchScript module were traced in training "
             "mode: their graphs normalize with batch statistics and update the running statistics even in eval mode. "
             "For evaluation, trace the model in eval mode or script it.");
}

}  // namespace amp
