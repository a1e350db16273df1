// amp's O1 cast kernels: one boxed kernel per (policy, device), registered on the autocast dispatch
// keys for the rows of o1_cast_rules() that the running LibTorch has no native autocast kernel for.
//
// NOTE [Why no forward hooks]
// torch::nn::Module has no forward or forward-pre hooks (pytorch #25888), so amp can't patch a
// module's forward the way Apex patched Python functions. Casting therefore lives in two places:
//  - amp::Model casts inputs and outputs around the module's forward (O0/O2/O3 and outputs at O1);
//  - per-op casts (O1) ride on the dispatcher: amp::AutocastGuard turns on ATen's Autocast keys, whose
//    native kernels cast the ops LibTorch lists, and the kernels below add Apex's rows LibTorch lacks.
// The kernels act only while amp_casts_active() (inside an AutocastGuard); otherwise they pass the call on
// untouched, autocast included, so plain at::autocast behaves in a process that uses amp as in one that does not
// (NativeListsTest checks both against torch.autocast).

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string_view>

#include "amp/autocast_guard.h"
#include "amp/cast_policy.h"
#include "casting/autocast_adapter.h"

namespace amp::detail {
namespace {

const c10::DispatchKeySet kAutocastKeys{c10::DispatchKey::AutocastCPU, c10::DispatchKey::AutocastCUDA};

class CastKernel final : public c10::OperatorKernel {
 public:
  // `apex_row`: a row of amp's table (off under cast_lists native), not a user registration.
  CastKernel(CastPolicy policy, c10::DeviceType device, std::string banned_message, bool apex_row)
      : policy_(policy), device_(device), banned_message_(std::move(banned_message)), apex_row_(apex_row) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
    // On to the keys below autocast with the keys the call already computed: no second RecordFunction and
    // argument scan, as a fresh callBoxed would do (casts change dtypes, never a tensor's dispatch keys).
    const auto below = keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::AutocastCPU);
    if (!amp_casts_active() || (apex_row_ && !apex_rows_active())) {
      // Not amp's call to cast (plain at::autocast, or an Apex row under cast_lists native): it goes on exactly
      // as if this kernel were not registered, autocast still on for the ops inside, so a composite op's parts
      // cast natively (nll_loss_nd's nll_loss runs in fp32, as in torch.autocast).
      op.redispatchBoxed(below, stack);
      return;
    }
    // Nested ops (a composite op's parts) run without autocast, as under ATen's own autocast kernels.
    c10::impl::ExcludeDispatchKeyGuard no_autocast(kAutocastKeys);
    cast_arguments(op, *stack);
    op.redispatchBoxed(below, stack);
  }

 private:
  bool eligible(const at::Tensor& t) const {
    return t.defined() && t.is_floating_point() && t.scalar_type() != at::kDouble && t.device().type() == device_;
  }

  template <class F>
  void for_each_tensor(c10::IValue* args, size_t n, F&& f) const {
    for (size_t i = 0; i < n; ++i) {
      c10::IValue& v = args[i];
      if (v.isTensor()) {
        f(v.toTensor());
      } else if (v.isTensorList()) {
        for (const at::Tensor& t : v.toTensorVector()) f(t);
      }
    }
  }

  void cast_arguments(const c10::OperatorHandle& op, torch::jit::Stack& stack) const {
    TORCH_CHECK(policy_ != CastPolicy::Banned, banned_message_);
    const size_t n = op.schema().arguments().size();
    c10::IValue* args = stack.data() + (stack.size() - n);

    c10::ScalarType target;
    if (policy_ == CastPolicy::LowerPrecision) {
      target = autocast::get_dtype(device_);
    } else if (policy_ == CastPolicy::Fp32) {
      target = at::kFloat;
    } else {  // Promote: the widest floating dtype among the eligible arguments.
      std::optional<c10::ScalarType> widest;
      for_each_tensor(args, n, [&](const at::Tensor& t) {
        if (!eligible(t)) return;
        if (!widest) widest = t.scalar_type();
        else if (*widest != t.scalar_type()) widest = at::kFloat;  // fp32 wins; fp16 + bf16 meet in fp32
      });
      if (!widest) return;
      target = *widest;
    }
    // Arguments already in the target dtype stay as they are (no new IValue, no list rebuilt).
    auto needs_cast = [&](const at::Tensor& t) { return eligible(t) && t.scalar_type() != target; };
    for (size_t i = 0; i < n; ++i) {
      c10::IValue& v = args[i];
      if (v.isTensor()) {
        if (needs_cast(v.toTensor())) v = autocast::cached_cast(target, v.toTensor(), device_);
      } else if (v.isTensorList()) {
        const auto list = v.toTensorList();
        if (std::none_of(list.begin(), list.end(), [&](const at::Tensor& t) { return needs_cast(t); })) continue;
        std::vector<at::Tensor> cast = v.toTensorVector();
        for (auto& t : cast) {
          if (needs_cast(t)) t = autocast::cached_cast(target, t, device_);
        }
        v = c10::IValue(std::move(cast));
      }
    }
  }

  CastPolicy policy_;
  c10::DeviceType device_;
  std::string banned_message_;
  bool apex_row_;
};

}  // namespace

std::vector<c10::OperatorName> covered_operators(const CastRule& rule) {
  const auto dot = rule.op.find('.');
  const std::string name = rule.op.substr(0, dot);
  std::vector<c10::OperatorName> out;
  if (dot != std::string::npos) {
    c10::OperatorName op{name, rule.op.substr(dot + 1)};
    if (c10::Dispatcher::singleton().findSchema(op)) out.push_back(std::move(op));
    return out;
  }
  // A row without an overload stands for the function, as Apex patched it in Python: every overload that
  // computes a new result (out= and in-place variants write into their arguments and are left alone).
  for (const c10::OperatorName& op : c10::Dispatcher::singleton().getAllOpNames()) {
    if (op.name != name) continue;
    const auto handle = c10::Dispatcher::singleton().findSchema(op);
    if (handle && handle->hasSchema() && !handle->schema().is_mutable()) out.push_back(op);
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.overload_name < b.overload_name; });
  return out;
}

void register_cast_kernels() {
  static std::once_flag once;
  std::call_once(once, [] {
    // The libraries must outlive every call through them: they live for the process.
    static std::vector<std::unique_ptr<torch::Library>> libraries;
    const std::pair<c10::DispatchKey, c10::DeviceType> keys[] = {
        {c10::DispatchKey::AutocastCPU, c10::DeviceType::CPU},
        {c10::DispatchKey::AutocastCUDA, c10::DeviceType::CUDA}};
    for (const auto& [key, device] : keys) {
      auto library = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", key, __FILE__, __LINE__);
      std::set<std::string> registered;  // a whole-function row and an overload row may name one operator
      for (const CastRule& rule : o1_cast_rules()) {
        for (const c10::OperatorName& op : covered_operators(rule)) {
          const auto handle = c10::Dispatcher::singleton().findSchema(op);
          if (!handle || handle->hasKernelForDispatchKey(key)) continue;  // native policy holds
          if (!registered.insert(c10::toString(op)).second) continue;
          const std::string op_name = op.name.substr(6) + (op.overload_name.empty() ? "" : "." + op.overload_name);
          library->impl(op_name.c_str(), torch::CppFunction::makeFromBoxedFunctor(
                                              std::make_unique<CastKernel>(rule.policy, device, rule.banned_message, true)));
        }
      }
      libraries.push_back(std::move(library));
    }
  });
}

namespace {

// User registrations (Apex's register_half_function family): their policy per operator, and the
// dispatcher libraries that hold their kernels (one per namespace and key, alive for the process).
std::mutex user_mutex;
std::map<std::string, CastPolicy> user_policies;
std::vector<std::unique_ptr<torch::Library>> user_libraries;
std::atomic<bool> any_initialize{false};

const char* policy_word(CastPolicy policy) {
  switch (policy) {
    case CastPolicy::LowerPrecision: return "a half function (low precision)";
    case CastPolicy::Fp32: return "a float function (fp32)";
    case CastPolicy::Promote: return "a promote function (widest input dtype)";
    case CastPolicy::Banned: return "banned";
  }
  return "?";
}

}  // namespace

void note_initialize() { any_initialize.store(true); }

void register_user_function(std::string_view text, CastPolicy policy, const char* api) {
  const std::string op_text(text);
  TORCH_CHECK(!any_initialize.load(), "amp::", api, "('", op_text, "'): called after amp::initialize. As in Apex, "
              "register functions before amp::initialize, at the start of the program.");
  const auto colons = op_text.find("::");
  TORCH_CHECK(colons != std::string::npos && colons > 0 && colons + 2 < op_text.size(), "amp::", api, ": '", op_text,
              "' is not an operator name. Give the dispatcher's full name, namespace::name[.overload], such as "
              "'aten::grid_sampler' or 'myops::fused_gelu'.");
  register_cast_kernels();  // amp's table first, so conflicts with it are seen
  const CastRule requested{op_text, policy};
  const auto ops = covered_operators(requested);
  TORCH_CHECK(!ops.empty(), "amp::", api, ": no operator '", op_text, "' is registered with the dispatcher (or it has "
              "only out= and in-place overloads). Check the spelling (namespace::name[.overload], e.g. "
              "'aten::grid_sampler'), and load the library that defines a custom op (TORCH_LIBRARY) first.");

  std::map<std::string, CastPolicy> table;  // amp's own rows, by operator
  for (const CastRule& rule : o1_cast_rules()) {
    for (const auto& op : covered_operators(rule)) table.emplace(c10::toString(op), rule.policy);
  }
  std::lock_guard<std::mutex> lock(user_mutex);
  std::vector<c10::OperatorName> to_register;
  for (const auto& op : ops) {  // check everything first: a refused call registers nothing
    const std::string name = c10::toString(op);
    if (const auto it = user_policies.find(name); it != user_policies.end()) {
      TORCH_CHECK(it->second == policy, "amp::", api, ": '", name, "' is already registered as ", policy_word(it->second),
                  "; registering it as ", policy_word(policy), " conflicts. Register each function once.");
      continue;
    }
    if (const auto it = table.find(name); it != table.end()) {
      TORCH_CHECK(it->second == policy, "amp::", api, ": '", name, "' is in amp's O1 table as ", policy_word(it->second),
                  " (Apex's lists, opt_levels/o1_cast_lists.cpp); registering it as ", policy_word(policy),
                  " conflicts.");
      continue;
    }
    const auto handle = c10::Dispatcher::singleton().findSchema(op);
    TORCH_CHECK(!handle->hasKernelForDispatchKey(c10::DispatchKey::AutocastCPU) &&
                    !handle->hasKernelForDispatchKey(c10::DispatchKey::AutocastCUDA),
                "amp::", api, ": '", name, "' already has a cast policy in LibTorch's native autocast lists; amp does "
                "not override native policies.");
    to_register.push_back(op);
  }
  const std::pair<c10::DispatchKey, c10::DeviceType> keys[] = {
      {c10::DispatchKey::AutocastCPU, c10::DeviceType::CPU}, {c10::DispatchKey::AutocastCUDA, c10::DeviceType::CUDA}};
  for (const auto& op : to_register) {
    const auto colon = op.name.find("::");
    const std::string ns = op.name.substr(0, colon);
    const std::string op_name = op.name.substr(colon + 2) + (op.overload_name.empty() ? "" : "." + op.overload_name);
    for (const auto& [key, device] : keys) {
      auto library = std::make_unique<torch::Library>(torch::Library::IMPL, ns, key, __FILE__, __LINE__);
      library->impl(op_name.c_str(), torch::CppFunction::makeFromBoxedFunctor(std::make_unique<CastKernel>(policy, device, "", false)));
      user_libraries.push_back(std::move(library));
    }
    user_policies.emplace(c10::toString(op), policy);
  }
}

}  // namespace amp::detail

namespace amp {

void register_half_function(std::string_view op) {
  detail::register_user_function(op, CastPolicy::LowerPrecision, "register_half_function");
}

void register_float_function(std::string_view op) {
  detail::register_user_function(op, CastPolicy::Fp32, "register_float_function");
}

void register_promote_function(std::string_view op) {
  detail::register_user_function(op, CastPolicy::Promote, "register_promote_function");
}

std::vector<std::string> covered_overloads(const CastRule& rule) {
  std::vector<std::string> out;
  for (const auto& op : detail::covered_operators(rule)) {
    out.push_back(op.name + (op.overload_name.empty() ? "" : "." + op.overload_name));
  }
  return out;
}

}  // namespace amp
