// The precision policy: fp32 islands by module name and type.
//
// NOTE [Precision policy dispatch key]
// torch::nn::Module has no hooks (NOTE [Why no forward hooks]), so amp can't wrap a kept module's forward. It
// acts on the ops instead: every op that reads an island's parameter or buffer is an op of that module, whoever
// wrote the forward. amp::Model's forward turns on the interception key (PrecisionPolicyGuard; NOTE [One
// interception key] in src/interception/interception.h), and the policy's handlers look at each op's tensor arguments:
//  - it reads an island tensor: its other floating inputs are cast to fp32 and it runs with autocast off (O1),
//    so it computes in fp32 and returns fp32;
//  - it reads a low-precision parameter (O2/O3) and has fp32 floating inputs (an island's output): they are cast
//    to the model's dtype, so the island's output goes back to low precision at the next layer;
//  - it reads no model tensor and mixes fp32 with low precision (O2/O3; attention's matmul of an island's
//    output): it runs in fp32, as Apex's promote functions, where the op would refuse mixed dtypes.
// Two more handlers live here: amp::parallel's kernel for a BatchNorm a module holds as a member, and
// auto_fp32's diagnosis (NOTE [Finding the module that overflows]).

#include "casting/precision_policy.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/functional/instancenorm.h>  // LibTorch 1.13's modules/instancenorm.h uses it without including it
#include <torch/nn/modules/instancenorm.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/modules/rnn.h>
#include <torch/nn/modules/transformer.h>
#include <torch/nn/modules/transformercoder.h>
#include <torch/nn/modules/transformerlayer.h>

#include <atomic>
#include <iostream>
#include <map>
#include <mutex>

#include "amp/batchnorm.h"
#include "core/host_sync.h"
#include "options/format.h"
#include "casting/fp8.h"
#include "interception/interception.h"
#include "casting/jit_mirror.h"
#include "casting/libtorch_module_types.h"
#include "options/model_cast.h"

namespace amp::detail {
namespace {

const c10::DispatchKeySet kAutocastKeys{c10::DispatchKey::AutocastCPU, c10::DispatchKey::AutocastCUDA};

thread_local std::shared_ptr<PrecisionPolicy> current_policy;

// replace_batch_norm's layers, process-wide; each policy picks its model's (refreshed when the epoch moves).
std::mutex batch_norm_mutex;
std::vector<std::pair<std::weak_ptr<torch::nn::Module>, BatchNormKernel>> batch_norm_layers;
std::atomic<uint64_t> batch_norm_epoch{0};

const c10::OperatorHandle& batch_norm_op() {
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("aten::batch_norm", "");
  return op;
}

at::Tensor optional_tensor(const c10::IValue& v) { return v.isTensor() ? v.toTensor() : at::Tensor(); }

// Policies by model, held as long as the model lives.
std::mutex policies_mutex;
std::vector<std::pair<std::weak_ptr<torch::nn::Module>, std::shared_ptr<PrecisionPolicy>>> policies;

bool is_computable(const at::Tensor& t) {
  return t.defined() && t.is_floating_point() && t.scalar_type() != at::kDouble;
}

template <class F>
void for_each_tensor(const c10::IValue* args, size_t n, F&& f) {
  for (size_t i = 0; i < n; ++i) {
    const c10::IValue& v = args[i];
    if (v.isTensor()) {
      f(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorVector()) f(t);
    }
  }
}

// Casts the computable tensor arguments for which `wanted(t)` holds to `dtype`.
template <class Wanted>
void cast_arguments(c10::IValue* args, size_t n, c10::ScalarType dtype, Wanted&& wanted) {
  auto cast = [&](const at::Tensor& t) { return is_computable(t) && wanted(t) ? t.to(dtype) : t; };
  for (size_t i = 0; i < n; ++i) {
    c10::IValue& v = args[i];
    if (v.isTensor()) {
      v = cast(v.toTensor());
    } else if (v.isTensorList()) {
      std::vector<at::Tensor> list = v.toTensorVector();
      for (auto& t : list) t = cast(t);
      v = c10::IValue(std::move(list));
    }
  }
}

// amp::parallel's synchronized statistics for a training-mode BatchNorm a module holds as a member.
class MemberBatchNormHandler final : public InterceptionHandler {
 public:
  void handle(InterceptedOp& call, const InterceptNext& next) override {
    PrecisionPolicy* policy = current_policy.get();
    c10::IValue* args = call.arguments();
    // One schema object per operator; (input, weight, bias, running_mean, running_var, training, momentum, eps).
    if (!policy || &call.op.schema() != &batch_norm_op().schema() || !args[5].toBool()) return next(call);
    const at::Tensor weight = optional_tensor(args[1]), mean = optional_tensor(args[3]);
    const BatchNormKernel* kernel = policy->batch_norm_kernel(weight.defined() ? weight.unsafeGetTensorImpl() : nullptr);
    if (!kernel && mean.defined()) kernel = policy->batch_norm_kernel(mean.unsafeGetTensorImpl());
    if (!kernel) return next(call);
    at::Tensor input = args[0].toTensor();
    const size_t n = call.num_arguments();
    if (policy->active() && policy->decide(args, n) == PrecisionPolicy::Action::kFp32) input = input.to(at::kFloat);
    at::Tensor out = (*kernel)(input, weight, optional_tensor(args[2]), mean, optional_tensor(args[4]),
                               args[6].toDouble(), args[7].toDouble());
    if (!out.defined()) return next(call);  // one rank: the op as it is
    torch::jit::drop(*call.stack, n);
    torch::jit::push(*call.stack, std::move(out));
  }
};

// The fp32 islands' casts (NOTE [Precision policy dispatch key]).
class IslandCastHandler final : public InterceptionHandler {
 public:
  void handle(InterceptedOp& call, const InterceptNext& next) override {
    PrecisionPolicy* policy = current_policy.get();
    if (!policy || !policy->active()) return next(call);
    c10::IValue* args = call.arguments();
    const size_t n = call.num_arguments();
    std::optional<c10::impl::ExcludeDispatchKeyGuard> no_autocast;
    switch (policy->decide(args, n)) {
      case PrecisionPolicy::Action::kNone:
        break;
      case PrecisionPolicy::Action::kFp32:
        cast_arguments(args, n, at::kFloat, [](const at::Tensor& t) { return t.scalar_type() != at::kFloat; });
        if (policy->per_op()) {
          no_autocast.emplace(kAutocastKeys);
          call.keys = call.keys - kAutocastKeys;
        }
        break;
      case PrecisionPolicy::Action::kLowPrecision:
        cast_arguments(args, n, policy->low_precision_dtype(), [](const at::Tensor& t) { return t.scalar_type() == at::kFloat; });
        break;
      case PrecisionPolicy::Action::kPromote:
        cast_arguments(args, n, at::kFloat, [](const at::Tensor& t) { return t.scalar_type() != at::kFloat; });
        break;
    }
    next(call);
  }
};

// auto_fp32's diagnosed iteration: each op reading a low-precision module's parameter, checked around its run.
class DiagnosisHandler final : public InterceptionHandler {
 public:
  void handle(InterceptedOp& call, const InterceptNext& next) override {
    PrecisionPolicy* policy = current_policy.get();
    if (!policy || !policy->diagnosing()) return next(call);
    const std::optional<size_t> record = policy->before_op(call.arguments(), call.num_arguments());
    next(call);
    if (record) policy->after_op(*record, *call.stack, call.op.schema().returns().size());
  }
};

void register_policy_handlers() {
  static std::once_flag once;
  std::call_once(once, [] {
    register_interception_fallback();
    register_interception_handler(kMemberBatchNormOrder, std::make_shared<MemberBatchNormHandler>());
    register_interception_handler(kIslandCastOrder, std::make_shared<IslandCastHandler>());
    register_interception_handler(kDiagnosisOrder, std::make_shared<DiagnosisHandler>());
  });
}

using Matcher = std::function<bool(const torch::nn::Module&)>;

// LibTorch's module types by name, for keep_fp32_types read from a config file.
const std::map<std::string, Matcher>& libtorch_types() {
  static const std::map<std::string, Matcher> types = {
#define AMP_TYPE_MATCHER(name) \
  {#name, [](const torch::nn::Module& m) { return dynamic_cast<const torch::nn::name##Impl*>(&m) != nullptr; }},
      AMP_LIBTORCH_MODULE_TYPES(AMP_TYPE_MATCHER)
#undef AMP_TYPE_MATCHER
  };
  return types;
}

// `torchscript`: the models are TorchScript mirrors, whose modules go by their class's name ("LayerNorm", a Python
// class's own name), so a name that is no LibTorch type may still name one of them.
Matcher matcher_of(const ModuleType& type, bool torchscript) {
  Matcher cxx = type.matches;
  if (!cxx) {
    const auto it = libtorch_types().find(type.name);
    TORCH_CHECK(it != libtorch_types().end() || torchscript, "amp::initialize: keep_fp32_types names '", type.name,
                "', which is not a LibTorch module type. Use LibTorch's names (LayerNorm, Embedding, ...) or "
                "keep_fp32_type<MyModuleImpl>().");
    if (it != libtorch_types().end()) cxx = it->second;
  }
  if (!torchscript) return cxx;
  return [cxx, name = type.name](const torch::nn::Module& m) {
    if (const auto* node = dynamic_cast<const JitModuleNode*>(&m)) return node->class_name() == name;
    return cxx && cxx(m);
  };
}

bool keeps_batchnorm(const torch::nn::Module& m, const Properties& p) {
  if (!casts_model_to_low_precision(p) || !is_batchnorm(m)) return false;
  return is_frozen(m) ? !p.cast_frozen_batchnorm : p.keep_batchnorm_fp32.value_or(false);
}

}  // namespace

PrecisionPolicy::PrecisionPolicy(const Properties& properties, std::vector<KeptModule> kept, torch::nn::Module& root)
    : properties_(properties),
      per_op_(properties.enabled && properties.patch_torch_functions),
      cast_model_(casts_model_to_low_precision(properties)),
      low_dtype_(properties.low_precision_dtype),
      kept_(std::move(kept)),
      root_(root.shared_from_this()) {
  for (const auto& k : kept_) {
    if (k.reason == "keep_batchnorm_fp32") continue;  // BatchNorm's own rule: fp32 tensors, ops as before
    if (auto m = k.module.lock()) collect_island(*m);
  }
  active_ = properties.enabled && !island_.empty() && (per_op_ || cast_model_);
  if (active_) register_policy_handlers();
  if (properties.enabled && properties.fp8) {
    fp8_ = std::make_shared<Fp8State>(properties, root, [this](const at::Tensor& t) { return in_island(t.unsafeGetTensorImpl()); });
  }
}

bool PrecisionPolicy::engaged() {
  const uint64_t epoch = batch_norm_epoch.load();
  if (epoch != batch_norm_epoch_) {  // a layer was registered since: find this model's
    batch_norm_epoch_ = epoch;
    batch_norm_kernels_.clear();
    if (const auto root = root_.lock()) {
      std::unordered_set<const torch::nn::Module*> mine;
      for (const auto& m : root->modules(/*include_self=*/true)) mine.insert(m.get());
      std::lock_guard<std::mutex> lock(batch_norm_mutex);
      for (const auto& [weak, kernel] : batch_norm_layers) {
        const auto layer = weak.lock();
        if (!layer || !mine.count(layer.get())) continue;
        // The dicts are held: find() points into them.
        const auto parameters = layer->named_parameters(/*recurse=*/false);
        const auto buffers = layer->named_buffers(/*recurse=*/false);
        for (const char* name : {"weight", "running_mean"}) {
          if (const at::Tensor* t = parameters.find(name)) {
            batch_norm_kernels_[t->unsafeGetTensorImpl()] = kernel;
          } else if (const at::Tensor* b = buffers.find(name)) {
            batch_norm_kernels_[b->unsafeGetTensorImpl()] = kernel;
          }
        }
      }
    }
  }
  return active_ || diagnosing() || !batch_norm_kernels_.empty() || (fp8_ && !fp8_->layers().empty());
}

void PrecisionPolicy::keep(torch::nn::Module& module, const std::string& name, const std::string& reason) {
  kept_.push_back({name, reason, module.shared_from_this()});
  if (const auto root = root_.lock()) {  // model order, as fp32_modules promises
    std::unordered_map<std::string, size_t> order;
    for (const auto& item : root->named_modules("", /*include_self=*/false)) order.emplace(item.key(), order.size());
    std::stable_sort(kept_.begin(), kept_.end(), [&](const KeptModule& a, const KeptModule& b) {
      return order[a.name] < order[b.name];
    });
  }
  collect_island(module);
  for (const auto* t : island_) low_.erase(t);
  active_ = properties_.enabled && !island_.empty() && (per_op_ || cast_model_);
  if (active_) register_policy_handlers();
}

// NOTE [Finding the module that overflows]
// Once the loss scale sits at its floor and gradients keep overflowing (Options::auto_fp32), the overflow report
// can't say which layer made the first inf: a forward inf makes every gradient non-finite, a backward one every
// upstream gradient. So the next forward runs diagnosed: each op that reads a parameter of a module still in low
// precision is checked, and
//  - forward: the first op whose floating inputs were finite and whose output is not blames its module;
//  - backward (if the forward was finite): hooks on each such op's output and activation inputs see its
//    incoming and outgoing gradients; the first op in backward order whose incoming gradient was finite and whose
//    outgoing one is not blames its module.
// Each checked op costs a host sync, so only that one iteration runs diagnosed.
struct PrecisionPolicy::OpRecord {
  std::string module;
  bool grad_out_finite = true;
  bool grad_in_finite = true;
};

struct PrecisionPolicy::Diagnosis {
  std::mutex mutex;  // hooks run on the autograd engine's threads
  std::unordered_map<const c10::TensorImpl*, std::string> owner;  // parameter -> its module's qualified name
  std::optional<std::string> forward_culprit;
  std::vector<OpRecord> ops;                                      // in forward order
};

namespace {

// Clears op `index`'s `flag` when the gradient reaching `t` holds an inf or NaN (a hook on the autograd engine's
// thread; the diagnosis may be gone by then).
template <class Diagnosis, class Record>
void watch_gradient(const at::Tensor& t, const std::shared_ptr<Diagnosis>& diagnosis, size_t index, bool Record::*flag) {
  std::weak_ptr<Diagnosis> weak = diagnosis;
  t.register_hook([weak, index, flag](const at::TensorBase& grad) {
    const auto d = weak.lock();
    const at::Tensor g(grad);
    if (!d || !g.defined()) return;
    count_host_sync();
    if (at::isfinite(g).all().item<bool>()) return;
    std::lock_guard<std::mutex> lock(d->mutex);
    d->ops[index].*flag = false;
  });
}

}  // namespace

void PrecisionPolicy::arm_diagnosis() {
  auto d = std::make_shared<Diagnosis>();
  if (const auto root = root_.lock()) {
    for (const auto& item : root->named_modules("", /*include_self=*/false)) {
      for (const auto& t : item.value()->parameters(/*recurse=*/false)) {
        if (!island_.count(t.unsafeGetTensorImpl())) d->owner.emplace(t.unsafeGetTensorImpl(), item.key());
      }
    }
  }
  diagnosis_ = std::move(d);
}

void PrecisionPolicy::disarm_diagnosis() { diagnosis_.reset(); }

std::optional<size_t> PrecisionPolicy::before_op(const c10::IValue* args, size_t n) {
  Diagnosis& d = *diagnosis_;
  const std::string* owner = nullptr;
  bool inputs_finite = true;
  std::vector<at::Tensor> activations;
  for_each_tensor(args, n, [&](const at::Tensor& t) {
    if (!t.defined()) return;
    if (const auto it = d.owner.find(t.unsafeGetTensorImpl()); it != d.owner.end()) {
      if (!owner) owner = &it->second;
      return;
    }
    if (!t.is_floating_point() || island_.count(t.unsafeGetTensorImpl())) return;
    activations.push_back(t);
    count_host_sync();
    inputs_finite = inputs_finite && at::isfinite(t).all().item<bool>();
  });
  if (!owner) return std::nullopt;
  std::lock_guard<std::mutex> lock(d.mutex);
  const size_t index = d.ops.size();
  d.ops.push_back({*owner});
  if (!inputs_finite) d.ops.back().grad_out_finite = false;  // not this op's doing: never blamed in backward
  for (const at::Tensor& a : activations) {
    if (!a.requires_grad() || a.is_leaf()) continue;  // a leaf's hook would outlive this iteration
    watch_gradient(a, diagnosis_, index, &OpRecord::grad_in_finite);
  }
  return inputs_finite ? std::optional<size_t>(index) : std::nullopt;
}

void PrecisionPolicy::after_op(size_t index, const torch::jit::Stack& stack, size_t returns) {
  Diagnosis& d = *diagnosis_;
  for (size_t i = stack.size() - returns; i < stack.size(); ++i) {
    if (!stack[i].isTensor()) continue;
    at::Tensor out = stack[i].toTensor();
    if (!out.defined() || !out.is_floating_point()) continue;
    count_host_sync();
    const bool finite = at::isfinite(out).all().item<bool>();
    std::lock_guard<std::mutex> lock(d.mutex);
    if (!finite && !d.forward_culprit) d.forward_culprit = d.ops[index].module;
    if (!out.requires_grad()) continue;
    watch_gradient(out, diagnosis_, index, &OpRecord::grad_out_finite);
  }
}

std::optional<std::string> PrecisionPolicy::diagnosed_module() const {
  if (!diagnosis_) return std::nullopt;
  std::lock_guard<std::mutex> lock(diagnosis_->mutex);
  if (diagnosis_->forward_culprit) return diagnosis_->forward_culprit;
  for (auto it = diagnosis_->ops.rbegin(); it != diagnosis_->ops.rend(); ++it) {  // backward order
    if (it->grad_out_finite && !it->grad_in_finite) return it->module;
  }
  return std::nullopt;
}

const BatchNormKernel* PrecisionPolicy::batch_norm_kernel(const c10::TensorImpl* t) const {
  if (!t) return nullptr;
  const auto it = batch_norm_kernels_.find(t);
  return it == batch_norm_kernels_.end() ? nullptr : &it->second;
}

void replace_batch_norm(torch::nn::Module& layer, BatchNormKernel kernel) {
  register_policy_handlers();
  std::lock_guard<std::mutex> lock(batch_norm_mutex);
  batch_norm_layers.erase(std::remove_if(batch_norm_layers.begin(), batch_norm_layers.end(),
                                         [&](const auto& e) { return e.first.expired() || e.first.lock().get() == &layer; }),
                          batch_norm_layers.end());
  batch_norm_layers.emplace_back(layer.shared_from_this(), std::move(kernel));
  batch_norm_epoch.fetch_add(1);
}

void PrecisionPolicy::collect_island(torch::nn::Module& module) {
  for (const auto& t : module.parameters(/*recurse=*/true)) island_.insert(t.unsafeGetTensorImpl());
  for (const auto& t : module.buffers(/*recurse=*/true)) {
    if (t.is_floating_point()) island_.insert(t.unsafeGetTensorImpl());
  }
}

void PrecisionPolicy::note_cast(torch::nn::Module& root) {
  low_.clear();
  if (!cast_model_) return;
  auto note = [&](const at::Tensor& t) {
    if (t.defined() && t.scalar_type() == low_dtype_ && !island_.count(t.unsafeGetTensorImpl())) {
      low_.insert(t.unsafeGetTensorImpl());
    }
  };
  for (const auto& t : root.parameters()) note(t);
  for (const auto& t : root.buffers()) note(t);
}

PrecisionPolicy::Action PrecisionPolicy::decide(const c10::IValue* args, size_t n) const {
  bool reads_island = false, reads_low = false, has_fp32 = false, has_low = false;
  for_each_tensor(args, n, [&](const at::Tensor& t) {
    if (!t.defined()) return;
    // A view of a parameter reads the parameter: LibTorch's F::linear on inputs of more than 2 dims computes
    // input.matmul(weight.t()), so the GEMM sees only the view.
    const c10::TensorImpl* impl = t.is_view() ? t._base().unsafeGetTensorImpl() : t.unsafeGetTensorImpl();
    reads_island = reads_island || island_.count(impl) > 0;
    reads_low = reads_low || low_.count(impl) > 0;
    if (is_computable(t)) {
      has_fp32 = has_fp32 || t.scalar_type() == at::kFloat;
      has_low = has_low || t.scalar_type() != at::kFloat;
    }
  });
  if (reads_island) return Action::kFp32;
  if (!cast_model_) return Action::kNone;
  if (reads_low) return has_fp32 ? Action::kLowPrecision : Action::kNone;
  return has_fp32 && has_low ? Action::kPromote : Action::kNone;
}

void resolve_precision_policy(const std::vector<torch::nn::Module*>& models, const Properties& p) {
  const bool torchscript = std::any_of(models.begin(), models.end(), [](const torch::nn::Module* m) {
    return holds_jit_modules(*m);
  });
  std::vector<Matcher> matchers;
  for (const auto& type : p.keep_fp32_types) matchers.push_back(matcher_of(type, torchscript));
  std::vector<bool> pattern_used(p.keep_fp32.size(), false), type_used(p.keep_fp32_types.size(), false);
  std::vector<std::string> all_names;
  std::vector<std::vector<KeptModule>> kept(models.size());
  for (size_t k = 0; k < models.size(); ++k) {
    for (const auto& item : models[k]->named_modules("", /*include_self=*/false)) {
      const torch::nn::Module& m = *item.value();
      all_names.push_back(item.key());
      std::string reason;
      for (size_t i = 0; i < p.keep_fp32.size(); ++i) {
        if (!glob_match(p.keep_fp32[i], item.key())) continue;
        pattern_used[i] = true;
        if (reason.empty()) reason = "keep_fp32";
      }
      for (size_t i = 0; i < matchers.size(); ++i) {
        if (!matchers[i](m)) continue;
        type_used[i] = true;
        if (reason.empty()) reason = "keep_fp32_type";
      }
      if (reason.empty() && keeps_batchnorm(m, p)) reason = "keep_batchnorm_fp32";
      if (!reason.empty()) kept[k].push_back({item.key(), reason, item.value()});
    }
  }
  for (size_t i = 0; i < p.keep_fp32.size(); ++i) {
    if (pattern_used[i]) continue;
    std::string close;
    for (const auto& name : closest_names(p.keep_fp32[i], all_names)) close += (close.empty() ? "'" : ", '") + name + "'";
    TORCH_CHECK(false, "amp::initialize: keep_fp32 pattern '", p.keep_fp32[i], "' matches no module of the model",
                models.size() > 1 ? "s" : "", ". Closest module names: ", close.empty() ? "(the model has no submodules)" : close,
                ". Patterns match the whole qualified name, as named_modules() gives it: '*' matches any characters, "
                "dots included ('*.norm' matches 'blocks.0.norm', not 'norm'), '?' one character.");
  }
  for (size_t i = 0; i < p.keep_fp32_types.size(); ++i) {
    if (type_used[i]) continue;
    TORCH_CHECK(false, "amp::initialize: keep_fp32_types names ", p.keep_fp32_types[i].name, ", but the model",
                models.size() > 1 ? "s hold" : " holds", " no module of that type. Remove it from keep_fp32_types "
                "(a config shared by several models may list only the types each one has).");
  }

  std::lock_guard<std::mutex> lock(policies_mutex);
  policies.erase(std::remove_if(policies.begin(), policies.end(), [](const auto& e) { return e.first.expired(); }),
                 policies.end());
  for (size_t k = 0; k < models.size(); ++k) {
    auto policy = std::make_shared<PrecisionPolicy>(p, std::move(kept[k]), *models[k]);
    if (p.enabled && p.verbosity >= 1) {
      std::string islands;
      for (const auto& m : policy->kept()) {
        if (m.reason != "keep_batchnorm_fp32") islands += (islands.empty() ? "" : ", ") + m.name + " (" + m.reason + ")";
      }
      // Where the model computes in fp32 throughout (O0), an island changes nothing: say so rather than list it.
      const bool all_fp32 = !p.patch_torch_functions && !casts_model_to_low_precision(p);
      if (!islands.empty() && all_fp32) {
        std::cout << "Note: keep_fp32 has no effect at opt_level " << to_string(p.opt_level) << ", where every module "
                  << "computes in fp32 already (matched: " << islands << "). It keeps modules in fp32 at O1, O2 and O3."
                  << std::endl;
      } else if (!islands.empty()) {
        std::cout << "Kept in fp32 (fp32 islands): " << islands << std::endl;
      }
      if (const auto& fp8 = policy->fp8()) describe_fp8_layers(*fp8, std::cout);
    }
    policies.emplace_back(models[k]->shared_from_this(), std::move(policy));
  }
}

std::shared_ptr<PrecisionPolicy> precision_policy_of(const torch::nn::Module& module) {
  std::lock_guard<std::mutex> lock(policies_mutex);
  for (const auto& [weak, policy] : policies) {
    if (auto m = weak.lock(); m.get() == &module) return policy;
  }
  return nullptr;
}

std::shared_ptr<PrecisionPolicy> current_precision_policy() { return current_policy; }

PrecisionPolicy* active_precision_policy() noexcept { return current_policy.get(); }

PrecisionPolicyGuard::PrecisionPolicyGuard(const std::shared_ptr<PrecisionPolicy>& policy) {
  if (!policy || !policy->engaged()) return;
  register_policy_handlers();  // once per process; the key must never be on without it
  previous_ = std::move(current_policy);
  current_policy = policy;
  key_.emplace(kInterceptionKey);
  engaged_ = true;
}

PrecisionPolicyGuard::~PrecisionPolicyGuard() {
  if (!engaged_) return;
  key_.reset();
  current_policy = std::move(previous_);
}

}  // namespace amp::detail
