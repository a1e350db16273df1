// torch.amp.custom_fwd / custom_bwd (torch/amp/autocast_mode.py) for torch::autograd::Function<T>.
//
// NOTE [What the forward records]
// torch records two attributes on ctx, `_fwd_used_autocast` (autocast on at the call, and no cast_inputs) and
// `_dtype`, for its one device_type; custom_bwd then enters `autocast(device_type, enabled, dtype)`. amp's
// guards take no device, so they record, in ctx->saved_data, what amp::checkpoint calls the cast state: both
// devices' autocast flag and dtype and amp's O1 flags. With cast_inputs every device is recorded as off, as torch
// records `_fwd_used_autocast = False` whether or not autocast was on. The backward guard is torch's autocast
// region: it bumps the nesting count, and the outermost region drops the weight-cast cache when it ends. Inside
// an amp::Model's forward the guard records the model's precision policy too, and the backward guard runs under
// it, so a custom backward's ops on an fp32 island's tensors compute as the forward's did.

#include "amp/custom_function.h"

#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>

#include <memory>
#include <string>
#include <utility>

#include "amp/autocast_guard.h"
#include "amp/precision_policy.h"
#include "amp/properties.h"
#include "casting/autocast_adapter.h"

namespace amp {
namespace {

constexpr c10::DeviceType kCpu = c10::DeviceType::CPU;
constexpr c10::DeviceType kCuda = c10::DeviceType::CUDA;

// ctx->saved_data keys (NOTE [What the forward records]).
constexpr const char* kCpuEnabled = "amp.autocast.cpu.enabled";
constexpr const char* kCpuDtype = "amp.autocast.cpu.dtype";
constexpr const char* kCudaEnabled = "amp.autocast.cuda.enabled";
constexpr const char* kCudaDtype = "amp.autocast.cuda.dtype";
constexpr const char* kAmpCasts = "amp.autocast.amp_casts";
constexpr const char* kApexRows = "amp.autocast.apex_rows";
constexpr const char* kPolicy = "amp.precision_policy";

// The forward's precision policy, held in ctx->saved_data (an IValue capsule) until backward.
struct PolicyCapsule : torch::CustomClassHolder {
  explicit PolicyCapsule(std::shared_ptr<detail::PrecisionPolicy> p) : policy(std::move(p)) {}
  std::shared_ptr<detail::PrecisionPolicy> policy;
};

void save_policy(torch::autograd::AutogradContext& ctx) {
  if (auto policy = detail::current_precision_policy()) {
    ctx.saved_data[kPolicy] = c10::IValue::make_capsule(c10::make_intrusive<PolicyCapsule>(std::move(policy)));
  }
}

std::shared_ptr<detail::PrecisionPolicy> load_policy(const torch::autograd::AutogradContext& ctx) {
  const auto it = ctx.saved_data.find(kPolicy);
  if (it == ctx.saved_data.end() || !it->second.isCapsule()) return nullptr;
  return c10::static_intrusive_pointer_cast<PolicyCapsule>(it->second.toCapsule())->policy;
}

// The cast state a custom function's forward ran under (named apart from checkpoint.cpp's CastState: the
// library compiles in unity batches).
struct CustomFnCastState {
  bool cpu_enabled = false;
  c10::ScalarType cpu_dtype = c10::ScalarType::BFloat16;
  bool cuda_enabled = false;
  c10::ScalarType cuda_dtype = c10::ScalarType::Half;
  bool amp_casts = false;
  bool apex_rows = true;

  static CustomFnCastState current() {
    CustomFnCastState s;
    s.cpu_enabled = detail::autocast::is_enabled(kCpu);
    s.cpu_dtype = detail::autocast::get_dtype(kCpu);
    s.cuda_enabled = detail::autocast::is_enabled(kCuda);
    s.cuda_dtype = detail::autocast::get_dtype(kCuda);
    s.amp_casts = detail::amp_casts_active();
    s.apex_rows = detail::apex_rows_active();
    return s;
  }

  void save(torch::autograd::AutogradContext& ctx) const {
    ctx.saved_data[kCpuEnabled] = cpu_enabled;
    ctx.saved_data[kCpuDtype] = static_cast<int64_t>(cpu_dtype);
    ctx.saved_data[kCudaEnabled] = cuda_enabled;
    ctx.saved_data[kCudaDtype] = static_cast<int64_t>(cuda_dtype);
    ctx.saved_data[kAmpCasts] = amp_casts;
    ctx.saved_data[kApexRows] = apex_rows;
  }

  static CustomFnCastState load(const torch::autograd::AutogradContext& ctx) {
    const auto& data = ctx.saved_data;
    for (const char* key : {kCpuEnabled, kCpuDtype, kCudaEnabled, kCudaDtype, kAmpCasts, kApexRows}) {
      TORCH_CHECK(data.find(key) != data.end(),
                  "amp::CustomBwdGuard: ctx holds no autocast state of its forward (no '", key,
                  "' in ctx->saved_data). Construct an amp::CustomFwdGuard with the same ctx first thing in "
                  "forward (amp::CustomFwdGuard guard(ctx);), or drop the CustomBwdGuard");
    }
    CustomFnCastState s;
    s.cpu_enabled = data.at(kCpuEnabled).toBool();
    s.cpu_dtype = static_cast<c10::ScalarType>(data.at(kCpuDtype).toInt());
    s.cuda_enabled = data.at(kCudaEnabled).toBool();
    s.cuda_dtype = static_cast<c10::ScalarType>(data.at(kCudaDtype).toInt());
    s.amp_casts = data.at(kAmpCasts).toBool();
    s.apex_rows = data.at(kApexRows).toBool();
    return s;
  }
};

}  // namespace

CustomFwdGuard::CustomFwdGuard(torch::autograd::AutogradContext* ctx, std::optional<c10::ScalarType> cast_inputs)
    : cast_inputs_(cast_inputs) {
  TORCH_CHECK(ctx != nullptr,
              "amp::CustomFwdGuard: ctx is null. Pass the AutogradContext* your forward receives: "
              "static torch::Tensor forward(torch::autograd::AutogradContext* ctx, ...) { amp::CustomFwdGuard "
              "guard(ctx); ... }");
  TORCH_CHECK(!cast_inputs || c10::isFloatingType(*cast_inputs),
              "amp::CustomFwdGuard: cast_inputs must be a floating-point dtype (torch::kFloat, torch::kHalf, "
              "torch::kBFloat16 or torch::kDouble), got ", cast_inputs ? dtype_name(*cast_inputs) : "",
              ". Pass the dtype the forward computes in, or no cast_inputs to run it under the caller's autocast.");
  CustomFnCastState state = CustomFnCastState::current();
  save_policy(*ctx);
  if (!cast_inputs_) {
    state.save(*ctx);
    return;
  }
  cast_cpu_ = state.cpu_enabled;
  cast_cuda_ = state.cuda_enabled;
  prev_cpu_ = state.cpu_enabled;
  prev_cuda_ = state.cuda_enabled;
  prev_amp_casts_ = state.amp_casts;
  // Backward runs with autocast off, whether or not it was on here (torch's `_fwd_used_autocast = False`).
  CustomFnCastState off = state;
  off.cpu_enabled = off.cuda_enabled = off.amp_casts = false;
  off.save(*ctx);
  if (!cast_cpu_ && !cast_cuda_) return;  // autocast off at the call: torch's custom_fwd is a no-op
  // torch's `with autocast(device_type, enabled=False)`.
  detail::autocast::increment_nesting();
  detail::autocast::set_enabled(kCpu, false);
  detail::autocast::set_enabled(kCuda, false);
  detail::set_amp_casts_active(false);
  turned_off_ = true;
}

CustomFwdGuard::~CustomFwdGuard() {
  if (!turned_off_) return;
  if (detail::autocast::decrement_nesting() == 0) detail::autocast::clear_cache();
  detail::autocast::set_enabled(kCpu, prev_cpu_);
  detail::autocast::set_enabled(kCuda, prev_cuda_);
  detail::set_amp_casts_active(prev_amp_casts_);
}

at::Tensor CustomFwdGuard::cast(const at::Tensor& input) const {
  if (!cast_inputs_ || !input.defined()) return input;
  if (!input.is_floating_point() || input.scalar_type() == c10::ScalarType::Double) return input;
  const c10::DeviceType device = input.device().type();
  const bool on = (device == kCpu && cast_cpu_) || (device == kCuda && cast_cuda_);
  return on ? input.to(*cast_inputs_) : input;
}

std::vector<at::Tensor> CustomFwdGuard::cast(std::vector<at::Tensor> inputs) const {
  for (auto& input : inputs) input = cast(input);
  return inputs;
}

CustomBwdGuard::CustomBwdGuard(torch::autograd::AutogradContext* ctx)
    : prev_cpu_(detail::autocast::is_enabled(kCpu)),
      prev_cpu_dtype_(detail::autocast::get_dtype(kCpu)),
      prev_cuda_(detail::autocast::is_enabled(kCuda)),
      prev_cuda_dtype_(detail::autocast::get_dtype(kCuda)),
      prev_amp_casts_(detail::amp_casts_active()),
      prev_apex_rows_(detail::apex_rows_active()) {
  TORCH_CHECK(ctx != nullptr,
              "amp::CustomBwdGuard: ctx is null. Pass the AutogradContext* your backward receives: "
              "static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, "
              "torch::autograd::variable_list grads) { amp::CustomBwdGuard guard(ctx); ... }");
  const CustomFnCastState recorded = CustomFnCastState::load(*ctx);
  if (recorded.amp_casts) detail::register_cast_kernels();
  // The dtypes first: the only calls that can throw, before anything is switched on.
  detail::autocast::set_dtype(kCpu, recorded.cpu_dtype);
  detail::autocast::set_dtype(kCuda, recorded.cuda_dtype);
  detail::autocast::set_enabled(kCpu, recorded.cpu_enabled);
  detail::autocast::set_enabled(kCuda, recorded.cuda_enabled);
  detail::set_amp_casts_active(recorded.amp_casts);
  detail::set_apex_rows_active(recorded.apex_rows);
  detail::autocast::increment_nesting();
  if (auto policy = load_policy(*ctx)) policy_ = std::make_unique<detail::PrecisionPolicyGuard>(policy);
}

CustomBwdGuard::~CustomBwdGuard() {
  policy_.reset();
  // Mirrors torch's autocast.__exit__: the outermost region drops the cast cache.
  if (detail::autocast::decrement_nesting() == 0) detail::autocast::clear_cache();
  detail::autocast::set_enabled(kCpu, prev_cpu_);
  detail::autocast::set_enabled(kCuda, prev_cuda_);
  try {
    detail::autocast::set_dtype(kCpu, prev_cpu_dtype_);
    detail::autocast::set_dtype(kCuda, prev_cuda_dtype_);
  } catch (...) {
    // Both dtypes were read from ATen when the guard began, so setting them back can't fail in practice.
  }
  detail::set_amp_casts_active(prev_amp_casts_);
  detail::set_apex_rows_active(prev_apex_rows_);
}

}  // namespace amp
