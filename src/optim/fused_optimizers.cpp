#include "amp/fused_optimizers.h"

#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <torch/version.h>

#include <atomic>
#include <cmath>
#include <map>
#include <tuple>
#include <vector>

#include "amp/optimizer.h"
#include "core/host_sync.h"
#include "optim/cpu_optimizer_kernels.h"
#include "optim/fused_route.h"
#include "optim/fused_step.h"
#include "optim/fused_step_context.h"
#include "optim/lean_masters.h"
#include "optim/state_format.h"
#include "scaling/device_scale.h"
#include "scaling/multi_tensor.h"
#include "scaling/optimizer_grads.h"
#include "optim/optimizer_state_key.h"
#include "optim/python_steps.h"

// ATen's fused optimizer kernels with CPU implementations (and _fused_sgd_) arrived in LibTorch 2.4.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
#define AMP_HAVE_ATEN_FUSED_OPTIMIZERS 1
#endif

namespace amp::optim {
namespace detail {
namespace {
std::atomic<FusedRoute> forced_route{FusedRoute::kAuto};
}  // namespace

void force_fused_route(FusedRoute route) { forced_route = route; }
FusedRoute forced_fused_route() { return forced_route; }

bool has_aten_fused_optimizers() {
#ifdef AMP_HAVE_ATEN_FUSED_OPTIMIZERS
  return true;
#else
  return false;
#endif
}

}  // namespace detail

namespace {

using amp::detail::ShardSums;
using amp::detail::state_key;
using Skip = amp::detail::FusedStepContext::Skip;
using detail::FusedRoute;
using detail::bump;
using detail::check_all;
using detail::evaluate;
using detail::format_for;
using detail::LeanTable;
using detail::StoredMoment;
using detail::store_moments;
using detail::through_fp32;
using detail::Work;
using detail::work_for;
namespace cpu = amp::detail::cpu;

bool is_cpu_f32(const at::Tensor& t) {
  return t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() && !t.is_sparse();
}

// Picks the implementation for one parameter (see fused_optimizers.h).
FusedRoute route_for(const at::Tensor& p, const at::Tensor& grad, at::TensorList state,
                     const at::Tensor* copy) {
  const FusedRoute forced = detail::forced_route;
  const bool aten_ok = detail::has_aten_fused_optimizers() && grad.scalar_type() == p.scalar_type() &&
                       (p.scalar_type() == at::kFloat || p.scalar_type() == at::kHalf ||
                        p.scalar_type() == at::kBFloat16);
  if (forced == FusedRoute::kPerOp) return FusedRoute::kPerOp;
  if (forced == FusedRoute::kAten) return aten_ok ? FusedRoute::kAten : FusedRoute::kPerOp;
  bool own = is_cpu_f32(p) && is_cpu_f32(grad) && grad.sizes() == p.sizes();
  for (const auto& s : state) own = own && (!s.defined() || is_cpu_f32(s));
  if (copy) {
    own = own && copy->device().is_cpu() && copy->is_contiguous() && copy->numel() == p.numel() &&
          (copy->scalar_type() == at::kHalf || copy->scalar_type() == at::kBFloat16 || copy->scalar_type() == at::kFloat);
  }
  if (own) return FusedRoute::kAuto;
  if (!p.device().is_cpu() && aten_ok) return FusedRoute::kAten;
  return FusedRoute::kPerOp;
}

// The route of `p`'s update: its lean master's fp32 value (work_for) where it has one in `lean`, else its own.
FusedRoute update_route(const at::Tensor& p, const at::Tensor* copy, const detail::LeanTable& lean) {
  if (lean) {
    if (const auto found = amp::detail::find_lean(p); found && found->first == lean) {
      const at::Tensor fp32 = at::empty({0}, p.options().dtype(at::kFloat));  // stands for the value and its gradient
      return route_for(fp32, fp32, {}, copy);
    }
  }
  return route_for(p, p.grad(), {}, copy);
}

cpu::ModelCopy model_copy_arg(const at::Tensor* copy) {
  if (!copy) return {};
  const auto dtype = copy->scalar_type() == at::kHalf       ? cpu::Dtype::Half
                     : copy->scalar_type() == at::kBFloat16 ? cpu::Dtype::BFloat16
                                                            : cpu::Dtype::Float;
  return {dtype, copy->data_ptr()};
}

// The loss scale a GradScaler left in the gradients, as the float factor the loops multiply by (torch's
// inv_scale: the reciprocal in double, then rounded to float).
float inverse_scale(const std::optional<double>& grad_scale) {
  return grad_scale ? static_cast<float>(1.0 / *grad_scale) : 1.0f;
}

// Splits one parameter's update across ATen's intra-op threads, as LibTorch's own kernels are.
template <class Update>
void split(int64_t n, Update update) {
  at::parallel_for(0, n, int64_t{1} << 15, [&](int64_t begin, int64_t end) { update(begin, end - begin); });
}

cpu::ModelCopy offset(cpu::ModelCopy copy, int64_t begin) {
  if (copy.data) copy.data = static_cast<char*>(copy.data) + begin * (copy.dtype == cpu::Dtype::Float ? 4 : 2);
  return copy;
}

// ATen's fused kernels take whole lists: parameters of one group are batched per (device, dtype, flag).
struct AtenBatch {
  std::vector<at::Tensor> params, grads, buffers_a, buffers_b, buffers_c, steps, copies_from, copies_to;
  // After the step, `p` is copied into the model's low-precision `copy` (where there is one: O2's masters).
  void copy_after(const at::Tensor& p, const at::Tensor* copy) {
    if (!copy) return;
    copies_from.push_back(p);
    copies_to.push_back(*copy);
  }
};
using BatchKey = std::tuple<std::string, int, bool>;
BatchKey batch_key(const at::Tensor& p, bool flag) { return {p.device().str(), static_cast<int>(p.scalar_type()), flag}; }

#ifdef AMP_HAVE_ATEN_FUSED_OPTIMIZERS
void finish_batch(AtenBatch& batch) {
  bump(batch.params);
  for (size_t i = 0; i < batch.copies_to.size(); ++i) batch.copies_to[i].copy_(batch.copies_from[i]);
}
#endif

// ---- Adam and AdamW --------------------------------------------------------------------------------

template <class Options>
void check_adam_options(const Options& o, const char* name, size_t group) {
  const auto [beta1, beta2] = o.betas();
  TORCH_CHECK(o.lr() >= 0, name, ": invalid learning rate ", o.lr(), " in param group ", group, "; use lr >= 0.");
  TORCH_CHECK(o.eps() >= 0, name, ": invalid epsilon value ", o.eps(), " in param group ", group, "; use eps >= 0.");
  TORCH_CHECK(beta1 >= 0 && beta1 < 1, name, ": invalid beta parameter at index 0: ", beta1, " in param group ",
              group, "; betas must be in [0, 1).");
  TORCH_CHECK(beta2 >= 0 && beta2 < 1, name, ": invalid beta parameter at index 1: ", beta2, " in param group ",
              group, "; betas must be in [0, 1).");
  TORCH_CHECK(o.weight_decay() >= 0, name, ": invalid weight_decay value ", o.weight_decay(), " in param group ",
              group, "; use weight_decay >= 0.");
}

// LibTorch's Adam / AdamW step for one parameter, op for op (the route for what amp's loop does not take); on bf16 /
// fp16 parameters Python's, as amp::Optimizer steps LibTorch's Adam there (NOTE [LibTorch's optimizers on
// low-precision parameters] in python_steps.cpp).
template <class Options, class State>
void adam_per_op(at::Tensor& p, at::Tensor grad, State& state, const Options& o, bool decoupled,
                 const std::optional<double>& grad_scale) {
  if (grad_scale) grad.mul_(inverse_scale(grad_scale));  // unscaled in place, as ATen's fused kernels leave it
  const auto [beta1, beta2] = o.betas();
  if (p.scalar_type() == at::kBFloat16 || p.scalar_type() == at::kHalf) {
    auto exp_avg = state.exp_avg(), exp_avg_sq = state.exp_avg_sq(), max_exp_avg_sq = state.max_exp_avg_sq();
    amp::detail::adam_step_as_python(p, grad, exp_avg, exp_avg_sq, o.amsgrad() ? &max_exp_avg_sq : nullptr,
                                     state.step(), {o.lr(), beta1, beta2, o.weight_decay(), o.eps(), decoupled});
    return;
  }
  const double bias_correction1 = 1 - std::pow(beta1, state.step());
  const double bias_correction2 = 1 - std::pow(beta2, state.step());
  if (decoupled && o.weight_decay() != 0) p.mul_(1 - o.lr() * o.weight_decay());
  if (!decoupled && o.weight_decay() != 0) grad = grad.add(p, o.weight_decay());
  state.exp_avg().mul_(beta1).add_(grad, 1 - beta1);
  state.exp_avg_sq().mul_(beta2).addcmul_(grad, grad, 1 - beta2);
  at::Tensor denom;
  if (o.amsgrad()) {
    at::max_out(state.max_exp_avg_sq(), state.exp_avg_sq(), state.max_exp_avg_sq());
    denom = (state.max_exp_avg_sq().sqrt() / std::sqrt(bias_correction2)).add_(o.eps());
  } else {
    denom = (state.exp_avg_sq().sqrt() / std::sqrt(bias_correction2)).add_(o.eps());
  }
  p.addcdiv_(state.exp_avg(), denom, -(o.lr() / bias_correction1));
}

// ---- State formats (NOTE [Optimizer state formats] in src/optim/state_format.h) ----------------------------

using amp::detail::Moment;
using amp::detail::StateFormat;

// The CPU loops' views of `moments`, or nullopt where one is not on the CPU loop's route.
std::optional<std::vector<cpu::StateView>> cpu_views(const std::vector<StoredMoment>& moments, const StateFormat& format,
                                                     const StateFormat::Place& place) {
  std::vector<cpu::StateView> views;
  for (const auto& m : moments) {
    auto view = amp::detail::cpu_view(*m.stored, m.moment, format.draws(place, m.slot));
    if (!view) return std::nullopt;
    views.push_back(*view);
  }
  return views;
}

// Runs `update(begin, end)` over [0, n) in whole chunks of the stored loops, across ATen's intra-op threads.
template <class Update>
void split_chunks(int64_t n, Update update) {
  const int64_t chunks = (n + cpu::kStoredChunk - 1) / cpu::kStoredChunk;
  at::parallel_for(0, chunks, 16, [&](int64_t c0, int64_t c1) {
    update(c0 * cpu::kStoredChunk, std::min(n, c1 * cpu::kStoredChunk));
  });
}

template <class Options, class State>
void adam_stored(const at::Tensor& key, Work& work, State& state, const Options& o, bool decoupled,
                 const std::optional<double>& grad_scale, const at::Tensor* copy, StateFormat& format) {
  at::Tensor& p = work.param;
  const at::Tensor& grad = work.grad;
  const StateFormat::Place place = format.place(key);
  std::vector<StoredMoment> moments{{&state.exp_avg(), Moment::kSigned, 0}, {&state.exp_avg_sq(), Moment::kUnsigned, 1}};
  if (o.amsgrad()) moments.push_back({&state.max_exp_avg_sq(), Moment::kUnsigned, 2});
  const auto views = route_for(p, grad, {}, copy) == FusedRoute::kAuto ? cpu_views(moments, format, place) : std::nullopt;
  if (views) {
    const auto [beta1, beta2] = o.betas();
    const cpu::AdamScalars s{o.lr(), beta1, beta2, o.eps(), o.weight_decay(), decoupled, o.amsgrad(),
                             state.step(), inverse_scale(grad_scale)};
    float* pp = p.data_ptr<float>();
    float* gp = grad.data_ptr<float>();
    const cpu::ModelCopy c = model_copy_arg(copy);
    split_chunks(p.numel(), [&](int64_t b, int64_t e) {
      cpu::adam_step_stored(pp, gp, (*views)[0], (*views)[1], o.amsgrad() ? &(*views)[2] : nullptr, b, e, s, c);
    });
    bump({p, copy ? *copy : at::Tensor()});
    for (const auto& m : moments) bump({*m.stored});
  } else {
    through_fp32(moments, p, format, place, [&](std::vector<at::Tensor>& v) {
      State fp32;
      fp32.step(state.step());
      fp32.exp_avg(v[0]);
      fp32.exp_avg_sq(v[1]);
      if (o.amsgrad()) fp32.max_exp_avg_sq(v[2]);
      if (p.scalar_type() == at::kFloat) return adam_per_op(p, grad, fp32, o, decoupled, grad_scale);
      // O3's bf16/fp16 parameters: the update in fp32 (ATen's opmath), rounded to nearest once.
      at::Tensor p32 = p.to(at::kFloat), g32 = grad.to(at::kFloat);
      adam_per_op(p32, g32, fp32, o, decoupled, grad_scale);
      p.copy_(p32);
      if (grad_scale) grad.copy_(g32);  // stored back unscaled, as on every route
    });
    if (copy) copy->copy_(p);
  }
  work.finish();
}

// Whether every parameter with a gradient takes ATen's kernels (a step whose flag can stay on the device).
template <class CopyOf>
bool all_on_aten(const torch::optim::Optimizer& opt, CopyOf copy_of) {
  for (const auto& group : opt.param_groups()) {
    for (const auto& p : group.params()) {
      if (p.grad().defined() && route_for(p, p.grad(), {}, copy_of(p)) != FusedRoute::kAten) return false;
    }
  }
  return true;
}

// Whether every parameter with a gradient would take ATen's kernels on a device (CUDA's route for what the CPU's own
// loops step): what a step's host reads are counted against (NOTE [Counting host syncs]).
bool all_on_aten_there(const torch::optim::Optimizer& opt) {
  if (!detail::has_aten_fused_optimizers() || detail::forced_route == FusedRoute::kPerOp) return false;
  for (const auto& group : opt.param_groups()) {
    for (const auto& p : group.params()) {
      const at::Tensor& g = p.grad();
      if (!g.defined()) continue;
      const auto dtype = p.scalar_type();
      if (g.scalar_type() != dtype || (dtype != at::kFloat && dtype != at::kHalf && dtype != at::kBFloat16)) return false;
    }
  }
  return true;
}

// NOTE [Step routes]: a step plans once per call which route updates each parameter (route_for: amp's CPU loop, ATen's
// fused kernels, or per-op; moments held in a state format: through the stored loops or fp32), then runs each route
// as one function over its list, as torch's adam.py picks _single_tensor_adam, _multi_tensor_adam or _fused_adam.
// Updates of different parameters are independent, and every draw of stochastic rounding is numbered by place
// (NOTE [Lean masters], NOTE [Optimizer state formats]), so the order the routes run in changes no bit.

// One parameter's planned update: its state key, what the update reads and writes, its state and its model copy.
template <class State>
struct Planned {
  at::Tensor key;
  Work work;
  State* state = nullptr;
  const at::Tensor* copy = nullptr;
  bool first = false;  // SGD: its momentum buffer is created by this step
  at::Tensor first_flag;  // SGD with dampening: set on the device where this is its buffer's first step (NOTE [A
                          // first momentum buffer on the device])
};

template <class State>
struct RoutePlan {
  std::vector<Planned<State>> cpu_loop, aten, per_op, stored, stored_aten;  // stored: moments in a state format
  void add(FusedRoute route, Planned<State> item) {
    (route == FusedRoute::kAuto ? cpu_loop : route == FusedRoute::kAten ? aten : per_op).push_back(std::move(item));
  }
};

// The CPU loop: fp32 contiguous parameters, gradients and moments on the host (cpu::adam_step).
template <class Options, class State>
void adam_cpu_loop(std::vector<Planned<State>>& items, const Options& o, bool decoupled,
                   const std::optional<double>& grad_scale) {
  const auto [beta1, beta2] = o.betas();
  for (auto& item : items) {
    State& state = *item.state;
    at::Tensor& p = item.work.param;
    const at::Tensor vmax = o.amsgrad() ? state.max_exp_avg_sq() : at::Tensor();
    const cpu::AdamScalars s{o.lr(), beta1, beta2, o.eps(), o.weight_decay(), decoupled, o.amsgrad(),
                             state.step(), inverse_scale(grad_scale)};
    float* pp = p.data_ptr<float>();
    float* gp = item.work.grad.template data_ptr<float>();
    float* mp = state.exp_avg().template data_ptr<float>();
    float* vp = state.exp_avg_sq().template data_ptr<float>();
    float* xp = vmax.defined() ? vmax.data_ptr<float>() : nullptr;
    const cpu::ModelCopy c = model_copy_arg(item.copy);
    split(p.numel(), [&](int64_t b, int64_t n) {
      cpu::adam_step(pp + b, gp + b, mp + b, vp + b, xp ? xp + b : nullptr, n, s, offset(c, b));
    });
    bump({p, state.exp_avg(), state.exp_avg_sq(), vmax, item.copy ? *item.copy : at::Tensor()});
    item.work.finish();
  }
}

// ATen's _fused_adam_ / _fused_adamw_, one call per (device, dtype, amsgrad) batch; the step counts live on the device
// (NOTE [A step that never waits]: with the flag there, a skip undoes them there).
template <class Options, class State, class Fused>
void adam_aten(std::vector<Planned<State>>& items, const Options& o, bool decoupled, torch::optim::Optimizer& opt,
               Fused& fused, bool on_device) {
  if (items.empty()) return;
  std::map<BatchKey, AtenBatch> batches;
  auto& states = opt.state();
  for (auto& item : items) {
    State& state = *item.state;
    at::Tensor& p = item.work.param;
    auto& batch = batches[batch_key(p, o.amsgrad())];
    batch.params.push_back(p);
    batch.grads.push_back(item.work.grad);
    batch.buffers_a.push_back(state.exp_avg());
    batch.buffers_b.push_back(state.exp_avg_sq());
    if (o.amsgrad()) batch.buffers_c.push_back(state.max_exp_avg_sq());
    // The count lives on the device across steps (a captured step replays its own update of it).
    const auto slot_key = state_key(states, item.key);
    auto set_host = [slot_key](torch::optim::Optimizer& self, int64_t count) {
      const auto it = self.state().find(slot_key);
      if (it != self.state().end() && it->second) static_cast<State&>(*it->second).step(count);
    };
    batch.steps.push_back(fused.step_context().device_step(item.key, state.step(), p.device(), set_host));
    if (on_device) {
      fused.step_context().on_skip_undo([impl = item.key.unsafeGetTensorImpl(), slot_key](torch::optim::Optimizer& self,
                                                                                      FusedOptimizer& fused_self) {
        const auto it = self.state().find(slot_key);
        if (it != self.state().end() && it->second) {
          auto& counted = static_cast<State&>(*it->second);
          counted.step(counted.step() - 1);
        }
        fused_self.step_context().undo_device_step(impl);
      });
    }
    batch.copy_after(p, item.copy);
  }
#ifdef AMP_HAVE_ATEN_FUSED_OPTIMIZERS
  const auto [beta1, beta2] = o.betas();
  for (auto& [key, batch] : batches) {
    const bool amsgrad = std::get<2>(key);
    const auto scale = fused.step_context().aten_grad_scale(batch.params.front());
    const std::optional<at::Tensor> found_inf = on_device ? std::optional<at::Tensor>(fused.step_context().found_inf()) : std::nullopt;
    if (decoupled) {
      at::_fused_adamw_(batch.params, batch.grads, batch.buffers_a, batch.buffers_b, batch.buffers_c, batch.steps,
                        o.lr(), beta1, beta2, o.weight_decay(), o.eps(), amsgrad, /*maximize=*/false, scale,
                        found_inf);
    } else {
      at::_fused_adam_(batch.params, batch.grads, batch.buffers_a, batch.buffers_b, batch.buffers_c, batch.steps,
                       o.lr(), beta1, beta2, o.weight_decay(), o.eps(), amsgrad, /*maximize=*/false, scale,
                       found_inf);
    }
    if (on_device) {
      for (auto& count : batch.steps) count.sub_(fused.step_context().found_inf());  // torch's fused Adam: the skip uncounted
    }
    finish_batch(batch);
  }
#else
  (void)decoupled, (void)on_device;
  TORCH_INTERNAL_ASSERT(false, "amp: ATen's fused optimizer kernels are not in this LibTorch");
#endif
  for (const auto& item : items) item.work.finish();
}

// LibTorch's algorithm op for op (what neither the CPU loop nor ATen's kernels take).
template <class Options, class State>
void adam_per_op_all(std::vector<Planned<State>>& items, const Options& o, bool decoupled,
                     const std::optional<double>& grad_scale) {
  for (auto& item : items) {
    adam_per_op(item.work.param, item.work.grad, *item.state, o, decoupled, grad_scale);
    if (item.copy) item.copy->copy_(item.work.param);
    item.work.finish();
  }
}

// NOTE [Stored moments on the device]
// bf16 and 8-bit moments on ATen's route (a device's) take the fp32 moments' kernel: each moment decoded to fp32,
// _fused_adam_ / _fused_adamw_ on those with the step counts, the loss scale and the flag on the device (adam_aten),
// each encoded back. The host reads nothing. A skip the device decides leaves the parameter and the decoded moments
// as they were; the stored bytes are kept by a where() on the flag (encoding decoded values need not give the same
// bytes back: an 8-bit block's scale is recomputed, a NaN's payload quieted); bf16's stochastic rounding counts its
// draws from the generator's counter on the device (StateFormat::draws_on, stochastic_rounding_ops.h), which the flag
// holds back on a skip, while the host's counter runs ahead until it learns of the skip (StateFormat::rewind) or reads
// a capture's counter back (pull_device_counter). O3's bf16 / fp16 parameters step in fp32, rounded to nearest once,
// as on the per-op route.
template <class Options, class State, class Fused>
void adam_stored_aten(std::vector<Planned<State>>& items, const Options& o, bool decoupled, torch::optim::Optimizer& opt,
                      Fused& fused, bool on_device, StateFormat& format) {
  if (items.empty()) return;
  std::vector<State> decoded(items.size());  // what ATen's kernel updates: the moments in fp32
  std::vector<std::vector<StoredMoment>> stores(items.size());
  std::vector<Planned<State>> planned;
  for (size_t i = 0; i < items.size(); ++i) {
    Planned<State>& item = items[i];
    State& state = *item.state;
    const at::Tensor& p = item.work.param;
    stores[i] = {{&state.exp_avg(), Moment::kSigned, 0}, {&state.exp_avg_sq(), Moment::kUnsigned, 1}};
    if (o.amsgrad()) stores[i].push_back({&state.max_exp_avg_sq(), Moment::kUnsigned, 2});
    decoded[i].step(state.step());
    decoded[i].exp_avg(amp::detail::decode_moment(state.exp_avg(), p.sizes(), Moment::kSigned));
    decoded[i].exp_avg_sq(amp::detail::decode_moment(state.exp_avg_sq(), p.sizes(), Moment::kUnsigned));
    if (o.amsgrad()) decoded[i].max_exp_avg_sq(amp::detail::decode_moment(state.max_exp_avg_sq(), p.sizes(), Moment::kUnsigned));
    Planned<State> fp32{item.key, item.work};
    fp32.state = &decoded[i];
    fp32.copy = item.copy;
    if (p.scalar_type() != at::kFloat) {  // O3
      fp32.work.param = p.to(at::kFloat);
      fp32.work.grad = item.work.grad.to(at::kFloat);
    }
    planned.push_back(std::move(fp32));
  }
  adam_aten(planned, o, decoupled, opt, fused, on_device);
  const at::Tensor skipped = on_device ? fused.step_context().found_inf().ne(0) : at::Tensor();
  for (size_t i = 0; i < items.size(); ++i) {
    Work& work = items[i].work;
    if (!planned[i].work.param.is_same(work.param)) {
      work.param.copy_(planned[i].work.param);
      work.grad.copy_(planned[i].work.grad);  // stored back unscaled, as on every route
    }
    std::vector<at::Tensor> values{decoded[i].exp_avg(), decoded[i].exp_avg_sq()};
    if (o.amsgrad()) values.push_back(decoded[i].max_exp_avg_sq());
    store_moments(stores[i], values, format, format.place(items[i].key), /*on_device=*/true, skipped);
  }
}

template <class Options, class State, class CopyOf, class Fused>
void adam_family_step(torch::optim::Optimizer& opt, Fused& fused, CopyOf copy_of, const LeanTable& lean,
                      bool decoupled, const char* name, StateFormat& format) {
  check_all(opt, name, [name](const torch::optim::OptimizerOptions& o, size_t g) {
    check_adam_options(static_cast<const Options&>(o), name, g);
  });
  c10::NoGradGuard no_grad;
  // NOTE [A step that never waits]: the flag stays on the device where every update is ATen's kernel (the step
  // counts then live there too; stored moments: NOTE [Stored moments on the device]; lean masters: NOTE [Lean masters
  // on the device] in lean_masters.h).
  const bool aten_only = all_on_aten(opt, copy_of);
  const auto skip = fused.step_context().found_inf_decision(aten_only, all_on_aten_there(opt));
  if (skip == Skip::kYes) return;
  const bool on_device = skip == Skip::kOnDevice;
  const detail::LeanStepGuard lean_step(lean, on_device ? &fused.step_context() : nullptr);
  // The scale a GradScaler left in the gradients, on the host for the routes that are not ATen's kernels.
  const std::optional<double> grad_scale = aten_only ? std::nullopt : fused.step_context().grad_scale();
  format.begin_step(opt);
  auto& states = opt.state();
  for (size_t g = 0; g < opt.param_groups().size(); ++g) {
    auto& group = opt.param_groups()[g];
    const auto& o = static_cast<const Options&>(group.options());
    RoutePlan<State> plan;
    for (const at::Tensor& key : group.params()) {
      if (!key.grad().defined()) continue;
      Planned<State> item{key, work_for(key, lean)};
      const at::Tensor& p = item.work.param;
      auto& slot = states[state_key(states, key)];
      const StateFormat::Place place = format.place(key);
      if (!slot) {  // LibTorch's lazy state initialization
        auto fresh = std::make_unique<State>();
        fresh->step(0);
        fresh->exp_avg(format.fresh(p, place));
        fresh->exp_avg_sq(format.fresh(p, place));
        slot = std::move(fresh);
      }
      item.state = &static_cast<State&>(*slot);
      State& state = *item.state;
      if (o.amsgrad() && !state.max_exp_avg_sq().defined()) {
        state.max_exp_avg_sq(format.fresh(p, place));  // amsgrad turned on later
      }
      format.adopt(state.exp_avg(), p, place, Moment::kSigned);
      format.adopt(state.exp_avg_sq(), p, place, Moment::kUnsigned);
      format.adopt(state.max_exp_avg_sq(), p, place, Moment::kUnsigned);
      state.step(state.step() + 1);
      item.copy = copy_of(p);
      if (format.format() != amp::OptimizerStateFormat::kFp32) {
        const bool aten = route_for(p, item.work.grad, {}, item.copy) == FusedRoute::kAten;
        (aten ? plan.stored_aten : plan.stored).push_back(std::move(item));
        continue;
      }
      const at::Tensor vmax = o.amsgrad() ? state.max_exp_avg_sq() : at::Tensor();
      const FusedRoute route = route_for(p, item.work.grad, {state.exp_avg(), state.exp_avg_sq(), vmax}, item.copy);
      plan.add(route, std::move(item));
    }
    for (auto& item : plan.stored) {
      adam_stored(item.key, item.work, *item.state, o, decoupled, grad_scale, item.copy, format);
    }
    adam_cpu_loop(plan.cpu_loop, o, decoupled, grad_scale);
    adam_per_op_all(plan.per_op, o, decoupled, grad_scale);
    adam_aten(plan.aten, o, decoupled, opt, fused, on_device);
    adam_stored_aten(plan.stored_aten, o, decoupled, opt, fused, on_device, format);
  }
  fused.step_context().end_format_step(format, on_device);
}

// ---- SGD -------------------------------------------------------------------------------------------

void check_sgd_options(const torch::optim::SGDOptions& o, size_t group) {
  const char* name = "amp::optim::FusedSGD";
  TORCH_CHECK(o.lr() >= 0, name, ": invalid learning rate ", o.lr(), " in param group ", group, "; use lr >= 0.");
  TORCH_CHECK(o.momentum() >= 0, name, ": invalid momentum value ", o.momentum(), " in param group ", group,
              "; use momentum >= 0.");
  TORCH_CHECK(o.weight_decay() >= 0, name, ": invalid weight_decay value ", o.weight_decay(), " in param group ",
              group, "; use weight_decay >= 0.");
  TORCH_CHECK(!o.nesterov() || (o.momentum() > 0 && o.dampening() == 0), name, ": param group ", group,
              " has nesterov(true) with momentum ", o.momentum(), " and dampening ", o.dampening(),
              "; Nesterov momentum requires a momentum and zero dampening.");
}

// LibTorch's SGD step for one parameter, op for op, but for the momentum multiplied as Python does (the same bits on
// fp32; on bf16 / fp16 Python's: NOTE [LibTorch's optimizers on low-precision parameters] in python_steps.cpp).
void sgd_per_op(at::Tensor& p, const at::Tensor& grad, torch::optim::SGDParamState* state, bool first,
                const torch::optim::SGDOptions& o, const std::optional<double>& grad_scale) {
  if (grad_scale) grad.mul_(inverse_scale(grad_scale));  // unscaled in place, as ATen's fused kernels leave it
  at::Tensor d_p = grad;
  if (o.weight_decay() != 0) d_p = d_p.add(p, o.weight_decay());
  if (o.momentum() != 0) {
    at::Tensor buf;
    if (first) {
      buf = d_p.clone().detach();
      state->momentum_buffer(buf);
    } else {
      buf = state->momentum_buffer();
      buf.mul_(amp::detail::python_number(o.momentum())).add_(d_p, 1 - o.dampening());
    }
    d_p = o.nesterov() ? d_p.add(buf, o.momentum()) : buf;
  }
  p.add_(d_p, -1 * o.lr());
}

using SgdPlanned = Planned<torch::optim::SGDParamState>;

// The CPU loop: fp32 contiguous parameters, gradients and buffers on the host (cpu::sgd_step).
void sgd_cpu_loop(std::vector<SgdPlanned>& items, const torch::optim::SGDOptions& o,
                  const std::optional<double>& grad_scale) {
  for (auto& item : items) {
    at::Tensor& p = item.work.param;
    const cpu::SgdScalars s{o.lr(), o.momentum(), o.dampening(), o.weight_decay(), o.nesterov(), item.first,
                            inverse_scale(grad_scale)};
    const at::Tensor buf = item.state ? item.state->momentum_buffer() : at::Tensor();
    float* pp = p.data_ptr<float>();
    float* gp = item.work.grad.data_ptr<float>();
    float* bp = buf.defined() ? buf.data_ptr<float>() : nullptr;
    const cpu::ModelCopy c = model_copy_arg(item.copy);
    split(p.numel(), [&](int64_t b, int64_t n) { cpu::sgd_step(pp + b, gp + b, bp ? bp + b : nullptr, n, s, offset(c, b)); });
    bump({p, buf, item.copy ? *item.copy : at::Tensor()});
    item.work.finish();
  }
}

// ATen's _fused_sgd_ both ways, first step and later, on buffers whose first step depends on skips decided on the
// device: each parameter and buffer keeps the result its flag picks (NOTE [A first momentum buffer on the device]).
void sgd_aten_both_ways(std::vector<SgdPlanned>& items, const torch::optim::SGDOptions& o,
                        amp::detail::FusedStepContext& context, const std::optional<at::Tensor>& device_found_inf) {
#ifdef AMP_HAVE_ATEN_FUSED_OPTIMIZERS
  std::map<BatchKey, std::vector<SgdPlanned*>> batches;
  for (auto& item : items) batches[batch_key(item.work.param, false)].push_back(&item);
  for (auto& [key, batch_items] : batches) {
    std::vector<at::Tensor> params, grads, buffers, params_first, grads_first, buffers_first;
    for (SgdPlanned* item : batch_items) {
      params.push_back(item->work.param);
      grads.push_back(item->work.grad);
      buffers.push_back(item->state->momentum_buffer());
      // The first step's kernel runs on copies (it unscales the gradients in place too), the later step's in place.
      params_first.push_back(params.back().clone());
      grads_first.push_back(grads.back().clone());
      buffers_first.push_back(buffers.back().clone());
    }
    const auto grad_scale = context.aten_grad_scale(params.front());
    at::_fused_sgd_(params_first, grads_first, buffers_first, o.weight_decay(), o.momentum(), o.lr(), o.dampening(),
                    o.nesterov(), /*maximize=*/false, /*is_first_step=*/true, grad_scale, device_found_inf);
    at::_fused_sgd_(params, grads, buffers, o.weight_decay(), o.momentum(), o.lr(), o.dampening(), o.nesterov(),
                    /*maximize=*/false, /*is_first_step=*/false, grad_scale, device_found_inf);
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& flag = batch_items[i]->first_flag;
      params[i].copy_(at::where(flag, params_first[i], params[i]));
      buffers[i].copy_(at::where(flag, buffers_first[i], buffers[i]));
      if (device_found_inf) flag.logical_and_(device_found_inf->to(flag.device()).ne(0));
      else flag.fill_(false);
    }
    AtenBatch done;
    done.params = params;
    for (SgdPlanned* item : batch_items) done.copy_after(item->work.param, item->copy);
    finish_batch(done);
  }
#else
  (void)o, (void)context, (void)device_found_inf;
  TORCH_INTERNAL_ASSERT(items.empty(), "amp: ATen's fused optimizer kernels are not in this LibTorch");
#endif
  for (const auto& item : items) item.work.finish();
}

// ATen's _fused_sgd_, one call per (device, dtype, first step) batch.
void sgd_aten(std::vector<SgdPlanned>& items, const torch::optim::SGDOptions& o, amp::detail::FusedStepContext& context,
              const std::optional<at::Tensor>& device_found_inf) {
  const auto flagged = std::stable_partition(items.begin(), items.end(),
                                             [](const SgdPlanned& item) { return !item.first_flag.defined(); });
  std::vector<SgdPlanned> both_ways(std::make_move_iterator(flagged), std::make_move_iterator(items.end()));
  items.erase(flagged, items.end());
  if (!both_ways.empty()) sgd_aten_both_ways(both_ways, o, context, device_found_inf);
  if (items.empty()) return;
  std::map<BatchKey, AtenBatch> batches;
  for (const auto& item : items) {
    auto& batch = batches[batch_key(item.work.param, item.first)];
    batch.params.push_back(item.work.param);
    batch.grads.push_back(item.work.grad);
    if (item.state) batch.buffers_a.push_back(item.state->momentum_buffer());
    batch.copy_after(item.work.param, item.copy);
  }
#ifdef AMP_HAVE_ATEN_FUSED_OPTIMIZERS
  for (auto& [key, batch] : batches) {
    at::_fused_sgd_(batch.params, batch.grads, batch.buffers_a, o.weight_decay(), o.momentum(), o.lr(),
                    o.dampening(), o.nesterov(), /*maximize=*/false, /*is_first_step=*/std::get<2>(key),
                    context.aten_grad_scale(batch.params.front()), device_found_inf);
    finish_batch(batch);
  }
#else
  (void)o, (void)context, (void)device_found_inf;
  TORCH_INTERNAL_ASSERT(false, "amp: ATen's fused optimizer kernels are not in this LibTorch");
#endif
  for (const auto& item : items) item.work.finish();
}

// ---- LAMB -------------------------------------------------------------------------------------------

void check_lamb_options(const FusedLAMBOptions& o, size_t group) {
  const char* name = "amp::optim::FusedLAMB";
  check_adam_options(o, name, group);
  TORCH_CHECK(o.max_grad_norm() >= 0, name, ": invalid max_grad_norm ", o.max_grad_norm(), " in param group ", group,
              "; use max_grad_norm >= 0 (0: no clipping of the global gradient norm).");
}

// The float scalars of one group's step, computed as Apex's multi_tensor_lamb_cuda host code does.
cpu::LambScalars lamb_scalars(const FusedLAMBOptions& o, float clip) {
  const auto beta1 = static_cast<float>(std::get<0>(o.betas())), beta2 = static_cast<float>(std::get<1>(o.betas()));
  float bias_correction1 = 1.0f, bias_correction2 = 1.0f;
  if (o.bias_correction()) {  // std::pow(float, int) is computed in double, then stored as float
    bias_correction1 = static_cast<float>(1 - std::pow(beta1, static_cast<int>(o.step())));
    bias_correction2 = static_cast<float>(1 - std::pow(beta2, static_cast<int>(o.step())));
  }
  return {clip, static_cast<float>(o.weight_decay()), beta1, beta2, o.grad_averaging() ? 1.0f - beta1 : 1.0f,
          static_cast<float>(o.eps()), bias_correction1, bias_correction2, o.adam_w_mode()};
}

// Apex's trust ratio: lr * ||p|| / ||update|| where weight decay or NVLAMB asks for it and both norms are
// non-zero, else lr.
float lamb_ratio(const FusedLAMBOptions& o, float param_norm, float update_norm) {
  const auto lr = static_cast<float>(o.lr());
  if (!(o.use_nvlamb() || o.weight_decay() != 0)) return lr;
  return update_norm != 0.0f && param_norm != 0.0f ? lr * (param_norm / update_norm) : lr;
}

// NOTE [LAMB on the device]
// FusedLAMB's step counts are its groups' (Apex's), and its bias corrections 1 - beta^step are computed from them on
// the host. Where the flag stays on the device, each group's count also lives there (FusedStepContext::device_step,
// the flag subtracted after the step, the host's count put back when it learns of the skip), the bias corrections
// are computed from it there with the host's arithmetic (pow in double, then rounded to float: on the CPU the same
// std::pow), and a skipped step keeps every old value (where(flag, old, new)): no wait, and the host's bits.
struct LambOnDevice {
  at::Tensor bias_correction1, bias_correction2;  // 0-dim fp32; undefined without bias_correction (1)
  at::Tensor found_inf;
};

// `o`'s bias correction 1 - beta^step from the device's step count `count` (fp32), as lamb_scalars computes it.
at::Tensor lamb_bias_correction(double beta, const at::Tensor& count) {
  return at::rsub(at::pow(static_cast<double>(static_cast<float>(beta)), count.to(at::kDouble)), 1).to(at::kFloat);
}

// The same update with ATen ops, in fp32 whatever the tensors' dtype (bf16/fp16 parameters at O3, CUDA,
// non-contiguous tensors), without a host sync: the clip divisor and the norms stay tensors, and with `device` the
// bias corrections and the skip too (NOTE [LAMB on the device]).
void lamb_per_op(at::Tensor& p, const at::Tensor& grad, FusedLAMBParamState& state, const FusedLAMBOptions& o,
                 const at::Tensor& clip, const LambOnDevice* device = nullptr) {
  const cpu::LambScalars s = lamb_scalars(o, 1.0f);
  const at::Tensor p32 = p.to(at::kFloat);
  at::Tensor scaled = grad.to(at::kFloat).div(clip.to(p.device()));
  if (!s.adam_w_mode) scaled = scaled.add(p32.mul(s.weight_decay));
  const at::Tensor m = state.exp_avg().to(at::kFloat).mul(s.beta1).add(scaled.mul(s.beta3));
  const at::Tensor v = state.exp_avg_sq().to(at::kFloat).mul(s.beta2).add(scaled.mul(1.0f - s.beta2).mul(scaled));
  const bool corrected_there = device != nullptr && device->bias_correction1.defined();
  const at::Tensor corrected_v = corrected_there ? v.div(device->bias_correction2) : v.div(s.bias_correction2);
  const at::Tensor corrected_m = corrected_there ? m.div(device->bias_correction1) : m.div(s.bias_correction1);
  at::Tensor update = corrected_m.div(corrected_v.sqrt().add(s.eps));
  if (s.adam_w_mode) update = update.add(p32.mul(s.weight_decay));
  const auto lr = static_cast<float>(o.lr());
  at::Tensor ratio = at::full({}, lr, p32.options());
  if (o.use_nvlamb() || o.weight_decay() != 0) {
    const at::Tensor param_norm = amp::detail::total_norm({p32}, 2.0), update_norm = amp::detail::total_norm({update}, 2.0);
    ratio = at::where(update_norm.ne(0).logical_and(param_norm.ne(0)), param_norm.div(update_norm).mul(lr), ratio);
  }
  if (device == nullptr) {
    p.copy_(p32.sub(update.mul(ratio)));
    state.exp_avg().copy_(m);
    state.exp_avg_sq().copy_(v);
    return;
  }
  const at::Tensor skip = device->found_inf.to(p.device()).ne(0);
  p.copy_(at::where(skip, p32, p32.sub(update.mul(ratio))));
  state.exp_avg().copy_(at::where(skip, state.exp_avg(), m));
  state.exp_avg_sq().copy_(at::where(skip, state.exp_avg_sq(), v));
}

// The LAMB state of `key` (the tensor param_groups holds), created for `p` (the tensor stepped) on first use, in
// `format`'s representation.
template <class States>
FusedLAMBParamState& lamb_state(States& states, const at::Tensor& key, const at::Tensor& p, const StateFormat& format) {
  auto& slot = states[state_key(states, key)];
  const StateFormat::Place place = format.place(key);
  if (!slot) {
    auto fresh = std::make_unique<FusedLAMBParamState>();
    fresh->exp_avg(format.fresh(p, place));
    fresh->exp_avg_sq(format.fresh(p, place));
    slot = std::move(fresh);
  }
  auto& state = static_cast<FusedLAMBParamState&>(*slot);
  format.adopt(state.exp_avg(), p, place, Moment::kSigned);
  format.adopt(state.exp_avg_sq(), p, place, Moment::kUnsigned);
  return state;
}

std::vector<StoredMoment> lamb_moments(FusedLAMBParamState& state) {
  return {{&state.exp_avg(), Moment::kSigned, 0}, {&state.exp_avg_sq(), Moment::kUnsigned, 1}};
}

// Whether one parameter's LAMB step takes the CPU loops (`views` set where its moments are in a state format).
bool lamb_on_cpu(const at::Tensor& p, const at::Tensor& grad, FusedLAMBParamState& state, const at::Tensor* copy,
                 const StateFormat& format, const StateFormat::Place& place,
                 std::optional<std::vector<cpu::StateView>>& views) {
  if (format.format() == amp::OptimizerStateFormat::kFp32) {
    return route_for(p, grad, {state.exp_avg(), state.exp_avg_sq()}, copy) == FusedRoute::kAuto;
  }
  if (route_for(p, grad, {}, copy) != FusedRoute::kAuto) return false;
  views = cpu_views(lamb_moments(state), format, place);
  return views.has_value();
}

// Runs `step` on the LAMB state with its moments in fp32: the state itself, or its moments decoded from a state
// format and encoded back after.
template <class Step>
void in_fp32(FusedLAMBParamState& state, const at::Tensor& p, StateFormat& format, const StateFormat::Place& place,
             Step step, const at::Tensor& found_inf = at::Tensor()) {
  if (format.format() == amp::OptimizerStateFormat::kFp32) {
    step(state);
    return;
  }
  through_fp32(
      lamb_moments(state), p, format, place,
      [&](std::vector<at::Tensor>& v) {
        FusedLAMBParamState fp32;
        fp32.exp_avg(v[0]);
        fp32.exp_avg_sq(v[1]);
        step(fp32);
      },
      found_inf);
}

// LAMB's first stage on the CPU loop's route: the moments updated and the update written into `update`, with the
// moments in fp32 (as they are) or in a state format.
void lamb_stage1_any(const at::Tensor& p, const at::Tensor& grad, FusedLAMBParamState& state,
                     const at::Tensor& update, const cpu::LambScalars& s, const std::optional<std::vector<cpu::StateView>>& views) {
  const float* pp = p.data_ptr<float>();
  const float* gp = grad.data_ptr<float>();
  float* up = update.data_ptr<float>();
  if (views) {
    split_chunks(p.numel(), [&](int64_t b, int64_t e) { cpu::lamb_stage1_stored(pp, gp, (*views)[0], (*views)[1], up, b, e, s); });
  } else {
    float* mp = state.exp_avg().data_ptr<float>();
    float* vp = state.exp_avg_sq().data_ptr<float>();
    split(p.numel(), [&](int64_t b, int64_t n) { cpu::lamb_stage1(pp + b, gp + b, mp + b, vp + b, up + b, n, s); });
  }
}

}  // namespace

FusedOptimizer::FusedOptimizer() : context_(std::make_unique<amp::detail::FusedStepContext>()) {}
FusedOptimizer::~FusedOptimizer() = default;
FusedOptimizer::FusedOptimizer(FusedOptimizer&& other)
    : context_(std::exchange(other.context_, std::make_unique<amp::detail::FusedStepContext>())) {}
FusedOptimizer& FusedOptimizer::operator=(FusedOptimizer&& other) {
  if (this != &other) context_ = std::exchange(other.context_, std::make_unique<amp::detail::FusedStepContext>());
  return *this;
}

void FusedOptimizer::settle_step(uint64_t step_id, bool skipped) { context_->settle_step(*this, step_id, skipped); }
void FusedOptimizer::pull_device_steps() { context_->pull_device_steps(*this); }
const at::Tensor* FusedOptimizer::model_copy(const at::Tensor& p) const { return context_->model_copy(p); }
const std::shared_ptr<amp::detail::LeanMasters>& FusedOptimizer::lean_masters() const noexcept {
  return context_->lean_masters();
}
const std::shared_ptr<amp::detail::StateFormat>& FusedOptimizer::state_format() const noexcept {
  return context_->state_format();
}
const amp::detail::ShardSums* FusedOptimizer::shard_sums() const noexcept { return context_->shard_sums(); }

torch::Tensor FusedAdam::step(LossClosure closure) {
  torch::Tensor loss = evaluate(closure);
  adam_family_step<torch::optim::AdamOptions, torch::optim::AdamParamState>(
      *this, *static_cast<FusedOptimizer*>(this), [this](const at::Tensor& p) { return model_copy(p); }, lean_masters(),
      /*decoupled=*/false,
      "amp::optim::FusedAdam", *format_for(state_format()));
  return loss;
}

torch::Tensor FusedAdamW::step(LossClosure closure) {
  torch::Tensor loss = evaluate(closure);
  adam_family_step<torch::optim::AdamWOptions, torch::optim::AdamWParamState>(
      *this, *static_cast<FusedOptimizer*>(this), [this](const at::Tensor& p) { return model_copy(p); }, lean_masters(),
      /*decoupled=*/true,
      "amp::optim::FusedAdamW", *format_for(state_format()));
  return loss;
}

void FusedAdam::save(torch::serialize::OutputArchive& archive) const {
  if (step_context().counts_ahead()) const_cast<FusedAdam*>(this)->pull_device_steps();
  torch::optim::Adam::save(archive);
}

void FusedAdamW::save(torch::serialize::OutputArchive& archive) const {
  if (step_context().counts_ahead()) const_cast<FusedAdamW*>(this)->pull_device_steps();
  torch::optim::AdamW::save(archive);
}

void FusedLAMBOptions::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(betas);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(bias_correction);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(adam_w_mode);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(grad_averaging);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(max_grad_norm);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(use_nvlamb);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(step);
}

void FusedLAMBOptions::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(betas_t, betas);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, bias_correction);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, adam_w_mode);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, grad_averaging);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, max_grad_norm);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, use_nvlamb);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(int64_t, step);
}

void FusedLAMBParamState::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_sq);
}

void FusedLAMBParamState::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, exp_avg);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, exp_avg_sq);
}

FusedLAMB::FusedLAMB(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, FusedLAMBOptions defaults)
    : torch::optim::Optimizer(param_groups, std::make_unique<FusedLAMBOptions>(defaults)) {
  check_lamb_options(defaults, 0);
  for (size_t i = 0; i < param_groups.size(); ++i) {  // see add_param_group
    if (param_groups[i].has_options()) param_groups_[i].set_options(param_groups[i].options().clone());
  }
}

void FusedLAMB::add_param_group(const torch::optim::OptimizerParamGroup& param_group) {
  torch::optim::Optimizer::add_param_group(param_group);
  if (param_group.has_options()) param_groups_.back().set_options(param_group.options().clone());
}

void FusedLAMB::save(torch::serialize::OutputArchive& archive) const {
  if (step_context().counts_ahead()) const_cast<FusedLAMB*>(this)->pull_device_steps();
  serialize(*this, archive);
}
void FusedLAMB::load(torch::serialize::InputArchive& archive) {
  serialize(*this, archive);
  detail::install_saved_group_options<FusedLAMBOptions>(archive, param_groups_, "amp::optim::FusedLAMB::load");
}

torch::Tensor FusedLAMB::step(LossClosure closure) {
  torch::Tensor loss = evaluate(closure);
  check_all(*this, "amp::optim::FusedLAMB", [](const torch::optim::OptimizerOptions& o, size_t g) {
    check_lamb_options(static_cast<const FusedLAMBOptions&>(o), g);
  });
  const std::shared_ptr<StateFormat> format = format_for(state_format());
  // NOTE [LAMB on the device]: the flag stays there where every update is lamb_per_op's (every route but amp's CPU
  // loop: a device's always), unsharded (stored moments: NOTE [Stored moments on the device]; lean masters: NOTE
  // [Lean masters on the device]); else the host reads it (a wait on a device).
  const bool plain = !shard_sums();
  bool per_op_only = plain;
  for (const auto& group : param_groups_) {
    for (const auto& p : group.params()) {
      if (p.grad().defined()) per_op_only = per_op_only && update_route(p, model_copy(p), lean_masters()) != FusedRoute::kAuto;
    }
  }
  const Skip skip = step_context().found_inf_decision(per_op_only, plain);
  if (skip == Skip::kYes) return loss;
  const detail::LeanStepGuard lean_step(lean_masters(), skip == Skip::kOnDevice ? &step_context() : nullptr);
  c10::NoGradGuard no_grad;
  const std::vector<at::Tensor> grads = amp::detail::defined_grads(*this);
  // A GradScaler's loss scale comes off first and the unscaled gradients are stored back (as ATen's fused
  // kernels leave them): the global norm is the unscaled gradients'.
  if (step_context().grad_scale() && !grads.empty()) {
    amp::detail::mul_(grads, at::full({}, inverse_scale(step_context().grad_scale()), at::TensorOptions().dtype(at::kFloat)));
  }
  format->begin_step(*this);
  if (shard_sums()) {
    sharded_step(grads, *format);
    format->end_step();
    return loss;
  }
  // Apex: the norm of every group's gradients, before any update; its max_grad_norm is the defaults' value.
  const double max_grad_norm = static_cast<const FusedLAMBOptions&>(defaults()).max_grad_norm();
  at::Tensor clip = at::ones({}, at::TensorOptions().dtype(at::kFloat));
  if (max_grad_norm > 0 && !grads.empty()) {
    const at::Tensor norm = amp::detail::total_norm(grads, 2.0);
    const auto max = static_cast<float>(max_grad_norm);
    clip = at::where(norm.gt(max), norm.div(max), at::ones_like(norm));
  }
  std::optional<float> clip_on_host;  // amp's CPU loop takes it as a float (a CPU tensor: no device sync)
  // A group's count on the device, keyed by its first tensor (NOTE [LAMB on the device]).
  auto lamb_on_device = [this](torch::optim::OptimizerParamGroup& group) {
    const auto& o = static_cast<const FusedLAMBOptions&>(group.options());
    const at::Tensor& key = group.params().front();
    const c10::TensorImpl* impl = key.unsafeGetTensorImpl();
    auto options_of = [impl](torch::optim::Optimizer& self) -> FusedLAMBOptions* {
      for (auto& g : self.param_groups()) {
        if (!g.params().empty() && g.params().front().unsafeGetTensorImpl() == impl) {
          return &static_cast<FusedLAMBOptions&>(g.options());
        }
      }
      return nullptr;
    };
    at::Tensor count = step_context().device_step(key, o.step(), key.device(), [options_of](torch::optim::Optimizer& self, int64_t n) {
      if (FusedLAMBOptions* found = options_of(self)) found->step(n);
    });
    step_context().on_skip_undo([options_of, impl](torch::optim::Optimizer& self, FusedOptimizer& fused) {
      if (FusedLAMBOptions* found = options_of(self)) found->step(found->step() - 1);
      fused.step_context().undo_device_step(impl);
    });
    LambOnDevice out;
    out.found_inf = step_context().found_inf();
    if (o.bias_correction()) {
      out.bias_correction1 = lamb_bias_correction(std::get<0>(o.betas()), count);
      out.bias_correction2 = lamb_bias_correction(std::get<1>(o.betas()), count);
    }
    count.sub_(out.found_inf.to(count.device()));  // a skipped step uncounted there, as torch's fused Adam
    return out;
  };
  auto& states = state_;
  for (auto& group : param_groups_) {
    auto& o = static_cast<FusedLAMBOptions&>(group.options());
    o.step(o.step() + 1);  // per group, with or without gradients, as Apex
    std::optional<LambOnDevice> on_device;
    if (skip == Skip::kOnDevice && !group.params().empty()) on_device = lamb_on_device(group);
    for (const auto& key : group.params()) {
      if (!key.grad().defined()) continue;
      Work work = work_for(key, lean_masters());
      at::Tensor& p = work.param;
      const at::Tensor& grad = work.grad;
      FusedLAMBParamState& state = lamb_state(states, key, p, *format);
      const at::Tensor* copy = model_copy(p);
      const StateFormat::Place place = format->place(key);
      std::optional<std::vector<cpu::StateView>> views;
      const bool on_cpu = lamb_on_cpu(p, grad, state, copy, *format, place, views);
      if (!on_cpu || !clip.device().is_cpu()) {  // no ATen LAMB kernel: per-op elsewhere
        in_fp32(
            state, p, *format, place,
            [&](FusedLAMBParamState& fp32) { lamb_per_op(p, grad, fp32, o, clip, on_device ? &*on_device : nullptr); },
            on_device ? on_device->found_inf : at::Tensor());
        if (copy) copy->copy_(p);
        work.finish();
        continue;
      }
      if (!clip_on_host) clip_on_host = clip.item<float>();
      const cpu::LambScalars s = lamb_scalars(o, *clip_on_host);
      const at::Tensor update = at::empty_like(p);
      lamb_stage1_any(p, grad, state, update, s, views);
      // The parameter's norm before the update (Apex takes it before stage 1, which does not write p).
      const float param_norm = amp::detail::total_norm({p}, 2.0).item<float>();
      const float update_norm = amp::detail::total_norm({update}, 2.0).item<float>();
      const float ratio = lamb_ratio(o, param_norm, update_norm);
      const cpu::ModelCopy c = model_copy_arg(copy);
      float* pw = p.data_ptr<float>();
      split(p.numel(), [&](int64_t b, int64_t n) { cpu::lamb_stage2(pw + b, update.data_ptr<float>() + b, n, ratio, offset(c, b)); });
      bump({p, state.exp_avg(), state.exp_avg_sq(), copy ? *copy : at::Tensor()});
      work.finish();
    }
  }
  step_context().end_format_step(*format, skip == Skip::kOnDevice);
  return loss;
}

// NOTE [Sharded LAMB]: under ZeRO a piece holds part of a tensor, and LAMB's norms are whole tensors' (and the
// global gradient norm every rank's): each is a sum of squares over the pieces, in double, summed over the ranks
// (ShardSums), then rooted and rounded to float as the unsharded step rounds its norms. The update is the unsharded
// step's, piece by piece (the same kernels on the CPU, lamb_per_op's arithmetic elsewhere), in two passes around
// the one exchange of the per-tensor sums.
void FusedLAMB::sharded_step(const std::vector<at::Tensor>& grads, amp::detail::StateFormat& format) {
  const ShardSums& sums = *shard_sums();
  auto square_sum = [](const at::Tensor& t) {
    amp::detail::count_host_sync();
    return t.to(at::kDouble).pow(2).sum().item<double>();
  };
  const double max_grad_norm = static_cast<const FusedLAMBOptions&>(defaults()).max_grad_norm();
  float clip = 1.0f;
  if (max_grad_norm > 0) {
    double local = 0;
    for (const auto& g : grads) local += square_sum(g);
    const auto norm = static_cast<float>(std::sqrt(sums.over_ranks(local)));
    const auto max = static_cast<float>(max_grad_norm);
    clip = norm > max ? norm / max : 1.0f;
  }
  struct Pending {
    Work work;
    FusedLAMBOptions* options;
    at::Tensor update, p32;
    bool on_cpu;
  };
  std::vector<Pending> pending;  // one per parameter of param_groups, in order (without a gradient: none)
  std::vector<double> param_sums, update_sums;
  auto& states = state_;
  for (auto& group : param_groups_) {
    auto& o = static_cast<FusedLAMBOptions&>(group.options());
    o.step(o.step() + 1);
    for (const auto& key : group.params()) {
      Pending entry{work_for(key, lean_masters()), &o, {}, {}, false};
      if (!key.grad().defined()) {
        pending.push_back(std::move(entry));
        param_sums.push_back(0);
        update_sums.push_back(0);
        continue;
      }
      at::Tensor& p = entry.work.param;
      const at::Tensor& grad = entry.work.grad;
      FusedLAMBParamState& state = lamb_state(states, key, p, format);
      const StateFormat::Place place = format.place(key);
      std::optional<std::vector<cpu::StateView>> views;
      entry.on_cpu = lamb_on_cpu(p, grad, state, nullptr, format, place, views);
      const cpu::LambScalars s = lamb_scalars(o, clip);
      if (entry.on_cpu) {
        entry.update = at::empty_like(p);
        lamb_stage1_any(p, grad, state, entry.update, s, views);
        entry.p32 = p;
      } else {  // lamb_per_op's arithmetic
        in_fp32(state, p, format, place, [&](FusedLAMBParamState& fp32) {
          entry.p32 = p.to(at::kFloat);
          at::Tensor scaled = grad.to(at::kFloat).div(clip);
          if (!s.adam_w_mode) scaled = scaled.add(entry.p32.mul(s.weight_decay));
          const at::Tensor m = fp32.exp_avg().to(at::kFloat).mul(s.beta1).add(scaled.mul(s.beta3));
          const at::Tensor v = fp32.exp_avg_sq().to(at::kFloat).mul(s.beta2).add(scaled.mul(1.0f - s.beta2).mul(scaled));
          entry.update = m.div(s.bias_correction1).div(v.div(s.bias_correction2).sqrt().add(s.eps));
          if (s.adam_w_mode) entry.update = entry.update.add(entry.p32.mul(s.weight_decay));
          fp32.exp_avg().copy_(m);
          fp32.exp_avg_sq().copy_(v);
        });
      }
      param_sums.push_back(square_sum(entry.p32));  // before the update, as Apex
      update_sums.push_back(square_sum(entry.update));
      bump({state.exp_avg(), state.exp_avg_sq()});
      pending.push_back(std::move(entry));
    }
  }
  sums.per_tensor(param_sums);
  sums.per_tensor(update_sums);
  for (size_t i = 0; i < pending.size(); ++i) {
    Pending& entry = pending[i];
    if (!entry.update.defined()) continue;
    const float ratio = lamb_ratio(*entry.options, static_cast<float>(std::sqrt(param_sums[i])),
                                   static_cast<float>(std::sqrt(update_sums[i])));
    at::Tensor& p = entry.work.param;
    if (entry.on_cpu) {
      cpu::lamb_stage2(p.data_ptr<float>(), entry.update.data_ptr<float>(), p.numel(), ratio, model_copy_arg(nullptr));
    } else {
      p.copy_(entry.p32.sub(entry.update.mul(ratio)));
    }
    bump({p});
    entry.work.finish();
  }
}

torch::Tensor FusedSGD::step(LossClosure closure) {
  torch::Tensor loss = evaluate(closure);
  check_all(*this, "amp::optim::FusedSGD", [](const torch::optim::OptimizerOptions& o, size_t g) {
    check_sgd_options(static_cast<const torch::optim::SGDOptions&>(o), g);
  });
  c10::NoGradGuard no_grad;
  auto& states = state_;
  // NOTE [A first momentum buffer on the device]
  // LibTorch's first step clones the gradient into the buffer; a later one computes momentum * buf + (1 - dampening) * g.
  // Without dampening, a buffer of -0.0 makes the later formula the first's bit for bit (momentum * -0.0 = -0.0, and
  // -0.0 + g = g for every g, -0.0 included), so where the flag stays on the device the step makes such buffers and
  // runs as a later step: skipped there, the buffers stay -0.0 and the next step is the first one. With dampening the
  // first step must clone, and whether a step is a buffer's first depends on skips the host has not seen: the buffer
  // is made (zeros) with a flag on the device, set while every step since has been skipped there
  // (FusedStepContext::first_step_flag), and while the host does not know it clear, ATen's kernel runs both ways, first
  // step and later, and each parameter and buffer keeps what the flag picks. The host forgets the flag once it learns
  // a step committed, and drops the buffer again once it learns every step since it was made was skipped, so a settled
  // optimizer (a checkpoint) is the host path's. Under amp::GradScaler, which settles nothing, the flag would stay and
  // the kernel run both ways until a save: there the host reads the skip until every such buffer exists.
  bool plain = true;
  if (step_context().found_inf().defined() && !step_context().device_skips_settle()) {
    for (const auto& group : param_groups_) {
      const auto& o = static_cast<const torch::optim::SGDOptions&>(group.options());
      if (o.momentum() == 0 || o.dampening() == 0) continue;
      for (const auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        const auto it = states.find(state_key(states, p));
        plain = plain && it != states.end() && it->second &&
                static_cast<torch::optim::SGDParamState&>(*it->second).momentum_buffer().defined();
      }
    }
  }
  const Skip skip = step_context().found_inf_decision(
      plain && all_on_aten(*this, [this](const at::Tensor& p) { return model_copy(p); }), plain && all_on_aten_there(*this));
  if (skip != Skip::kOnDevice) step_context().settle_first_step_flags(*this);  // left by a graph capture
  if (skip == Skip::kYes) return loss;
  const detail::LeanStepGuard lean_step(lean_masters(), skip == Skip::kOnDevice ? &step_context() : nullptr);
  const std::optional<at::Tensor> device_found_inf =
      skip == Skip::kOnDevice ? std::optional<at::Tensor>(step_context().found_inf()) : std::nullopt;
  // The scale a GradScaler left in the gradients, on the host for the routes that are not ATen's kernels.
  const bool aten_only = all_on_aten(*this, [this](const at::Tensor& p) { return model_copy(p); });
  std::optional<double> grad_scale;
  if (!aten_only) grad_scale = step_context().grad_scale();
  for (auto& group : param_groups_) {
    const auto& o = static_cast<const torch::optim::SGDOptions&>(group.options());
    RoutePlan<torch::optim::SGDParamState> plan;  // NOTE [Step routes]
    for (const at::Tensor& key : group.params()) {
      if (!key.grad().defined()) continue;
      Planned<torch::optim::SGDParamState> item{key, work_for(key, lean_masters())};
      const at::Tensor& p = item.work.param;
      if (o.momentum() != 0) {
        auto& slot = states[state_key(states, key)];
        if (!slot) slot = std::make_unique<torch::optim::SGDParamState>();
        item.state = static_cast<torch::optim::SGDParamState*>(slot.get());
        item.first = !item.state->momentum_buffer().defined();
        if (skip == Skip::kOnDevice && o.dampening() == 0 && item.first) {  // NOTE [A first momentum buffer on the device]
          item.state->momentum_buffer(at::full_like(p, -0.0, at::MemoryFormat::Preserve));
          item.first = false;
        } else if (skip == Skip::kOnDevice && o.dampening() != 0) {
          if (item.first) item.state->momentum_buffer(at::zeros_like(p, at::MemoryFormat::Preserve));
          auto drop = [slot_key = state_key(states, key)](torch::optim::Optimizer& self, const c10::TensorImpl* buffer) {
            const auto it = self.state().find(slot_key);
            if (it == self.state().end() || !it->second) return;
            auto& state = static_cast<torch::optim::SGDParamState&>(*it->second);
            if (state.momentum_buffer().unsafeGetTensorImpl() == buffer) state.momentum_buffer(at::Tensor());
          };
          item.first_flag = step_context().first_step_flag(key, item.state->momentum_buffer(), item.first, drop);
          item.first = false;
        }
      }
      item.copy = model_copy(p);
      const auto route =
          route_for(p, item.work.grad, {item.state && !item.first ? item.state->momentum_buffer() : at::Tensor()}, item.copy);
      if (item.first && route != FusedRoute::kPerOp) item.state->momentum_buffer(at::empty_like(p, at::MemoryFormat::Preserve));
      plan.add(route, std::move(item));
    }
    sgd_cpu_loop(plan.cpu_loop, o, grad_scale);
    for (auto& item : plan.per_op) {
      sgd_per_op(item.work.param, item.work.grad, item.state, item.first, o, grad_scale);
      if (item.copy) item.copy->copy_(item.work.param);
      item.work.finish();
    }
    sgd_aten(plan.aten, o, step_context(), device_found_inf);
  }
  return loss;
}

}  // namespace amp::optim
