#include "amp/fused_muon.h"

#include <ATen/Functions.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <sstream>

#include "optim/fused_step.h"
#include "optim/fused_step_context.h"
#include "optim/optimizer_state_key.h"
#include "optim/python_steps.h"
#include "scaling/multi_tensor.h"
#include "scaling/optimizer_grads.h"

namespace amp::optim {
namespace {

using amp::detail::Moment;
using Skip = amp::detail::FusedStepContext::Skip;
using amp::detail::python_number;
using amp::detail::state_key;
using amp::detail::StateFormat;

constexpr const char* kName = "amp::optim::FusedMuon";

std::string shape_text(at::IntArrayRef sizes) {
  std::ostringstream out;
  out << sizes;
  return out.str();
}

// torch.optim.Muon's argument checks (its messages), with the fix; and amp's for what torch lets through unchecked.
void check_muon_options(const FusedMuonOptions& o, size_t group) {
  TORCH_CHECK(o.lr() >= 0, kName, ": Learning rate should be >= 0 but is: ", o.lr(), " (param group ", group, "). Use lr >= 0.");
  TORCH_CHECK(o.momentum() >= 0, kName, ": momentum should be >= 0 but is: ", o.momentum(), " (param group ", group,
              "). Use momentum >= 0 (0.95 is Muon's default).");
  TORCH_CHECK(o.weight_decay() >= 0, kName, ": weight decay should be >= 0 but is: ", o.weight_decay(), " (param group ",
              group, "). Use weight_decay >= 0.");
  TORCH_CHECK(o.adjust_lr_fn() == "original" || o.adjust_lr_fn() == "match_rms_adamw", kName,
              ": Adjust learning rate function ", o.adjust_lr_fn(), " is not supported (param group ", group,
              "). Use adjust_lr_fn \"original\" or \"match_rms_adamw\".");
  TORCH_CHECK(o.ns_steps() < 100, kName, ": Number of steps must be less than 100 for computational efficiency; "
              "ns_steps is ", o.ns_steps(), " in param group ", group, ". Use ns_steps < 100 (5 is Muon's default).");
  TORCH_CHECK(o.ns_steps() >= 0, kName, ": ns_steps is ", o.ns_steps(), " in param group ", group, "; use ns_steps "
              ">= 0 (0: the update is only normalized; 5 is Muon's default).");
  TORCH_CHECK(o.ns_coefficients().size() == 3, kName, ": Coefficients must be a tuple of exactly 3 values; "
              "ns_coefficients has ", o.ns_coefficients().size(), " in param group ", group,
              ". Pass (a, b, c), e.g. {3.4445, -4.7750, 2.0315}.");
  TORCH_CHECK(o.eps() >= 0, kName, ": eps is ", o.eps(), " in param group ", group, "; use eps >= 0 (the update is "
              "divided by max(norm, eps)).");
}

// What Muon orthogonalizes and what it refuses, for one parameter of `shape` (torch refuses all but 2-D weights).
void check_param(const at::Tensor& p, at::IntArrayRef shape, const FusedMuonOptions& o, size_t group, size_t index) {
  TORCH_CHECK(!p.is_complex(), kName, ": Muon does not support complex parameters (parameter ", index,
              " of param group ", group, ", ", p.scalar_type(), ").");
  if (shape.size() == 2) return;
  TORCH_CHECK(o.flatten() && shape.size() > 2, kName, ": Muon only supports 2D parameters whereas we found a parameter "
              "with size: ", shape_text(shape), " (parameter ", index, " of param group ", group, "). ",
              shape.size() > 2 ? "Set FusedMuonOptions::flatten(true) to orthogonalize it as [out, rest], or give it to "
                                 "AdamW."
                               : "Give biases, norms' weights and other vectors to AdamW (Muon is for hidden 2-D "
                                 "weights).");
}

// The [out, rest] matrix Muon sees of a tensor whose parameter has `shape` (a ZeRO piece is its flattened whole): a
// view, so in-place updates reach the tensor.
at::Tensor as_matrix(const at::Tensor& t, at::IntArrayRef shape) {
  return t.dim() == 2 && t.size(0) == shape[0] ? t : t.view({shape[0], -1});
}

// torch.optim._muon._zeropower_via_newtonschulz, op for op. torch's `grad.bfloat16()` returns a bfloat16 input
// itself, and the div_ below then divides it in place (a bf16 parameter's momentum buffer, without nesterov): amp
// always works on a copy.
at::Tensor zeropower_via_newtonschulz(const at::Tensor& grad, const std::vector<double>& abc, int64_t steps, double eps) {
  const double a = abc[0], b = abc[1], c = abc[2];
  at::Tensor x = grad.scalar_type() == at::kBFloat16 ? grad.clone() : grad.to(at::kBFloat16);
  const bool tall = grad.size(0) > grad.size(1);
  if (tall) x = x.t();
  x.div_(at::clamp_min(at::linalg_vector_norm(x, 2), eps));  // spectral norm at most 1 (clamp(min=eps)'s kernel)
  for (int64_t i = 0; i < steps; ++i) {
    const at::Tensor gram = at::matmul(x, x.t());
    const at::Tensor gram_update = at::addmm(gram, gram, gram, /*beta=*/b, /*alpha=*/c);
    x = at::addmm(x, gram_update, x, /*beta=*/a);
  }
  return tall ? x.t() : x;
}

// torch.optim._muon._adjust_lr, in Python's double arithmetic, on the matrix's [A, B].
double adjust_lr(double lr, const std::string& fn, int64_t rows, int64_t cols) {
  const auto A = static_cast<double>(rows), B = static_cast<double>(cols);
  const double ratio = fn == "match_rms_adamw" ? 0.2 * std::sqrt(std::max(A, B)) : std::sqrt(std::max(1.0, A / B));
  return lr * ratio;
}

// The Muon state of `key` (the tensor param_groups holds), created for `p` (the tensor stepped) on first use, in
// `format`'s representation (torch: zeros_like(grad)).
template <class States>
FusedMuonParamState& muon_state(States& states, const at::Tensor& key, const at::Tensor& p, const StateFormat& format) {
  auto& slot = states[state_key(states, key)];
  const StateFormat::Place place = format.place(key);
  if (!slot) {
    auto fresh = std::make_unique<FusedMuonParamState>();
    fresh->momentum_buffer(format.fresh(p, place));
    slot = std::move(fresh);
  }
  auto& state = static_cast<FusedMuonParamState&>(*slot);
  format.adopt(state.momentum_buffer(), p, place, Moment::kSigned);
  return state;
}

// One parameter's step on `buffer` (its momentum in fp32 or the parameter's dtype). With `found_inf` (a step whose
// skip only the device knows) every write keeps the old value where the flag is set.
void muon_update(at::Tensor& param, at::IntArrayRef shape, const at::Tensor& grad, at::Tensor& buffer,
                 const FusedMuonOptions& o, const at::Tensor& found_inf) {
  // A ZeRO piece (flattened) is updated through a view of its tensor's shape: the same strides, so the same kernels
  // and roundings, as the unsharded step.
  at::Tensor p = param.sizes() == shape ? param : param.view(shape);
  const at::Tensor g = as_matrix(grad, shape);
  at::Tensor buf = as_matrix(buffer, shape);
  const bool blend = found_inf.defined();
  const at::Tensor stepped = blend ? buf.lerp(g, 1 - o.momentum()) : buf.lerp_(g, 1 - o.momentum());
  const at::Tensor mixed = o.nesterov() ? g.lerp(stepped, o.momentum()) : stepped;
  const at::Tensor update = zeropower_via_newtonschulz(mixed, o.ns_coefficients(), o.ns_steps(), o.eps());
  const double lr = adjust_lr(o.lr(), o.adjust_lr_fn(), g.size(0), g.size(1));
  const at::Tensor step = p.sizes() == update.sizes() ? update : update.reshape(p.sizes());
  if (!blend) {
    p.mul_(python_number(1 - o.lr() * o.weight_decay()));
    p.add_(step, -lr);
    return;
  }
  const at::Tensor keep = found_inf.ne(0);
  buf.copy_(at::where(keep, buf, stepped));
  at::Tensor next = p.mul(python_number(1 - o.lr() * o.weight_decay()));
  next.add_(step, -lr);
  p.copy_(at::where(keep, p, next));
}

}  // namespace

void FusedMuonOptions::serialize(torch::serialize::OutputArchive& archive) const {
  archive.write("lr", c10::IValue(lr()));
  archive.write("weight_decay", c10::IValue(weight_decay()));
  archive.write("momentum", c10::IValue(momentum()));
  archive.write("nesterov", c10::IValue(nesterov()));
  archive.write("ns_coefficients", c10::IValue(ns_coefficients()));
  archive.write("eps", c10::IValue(eps()));
  archive.write("ns_steps", c10::IValue(ns_steps()));
  archive.write("adjust_lr_fn", c10::IValue(adjust_lr_fn()));
  archive.write("flatten", c10::IValue(flatten()));
}

void FusedMuonOptions::serialize(torch::serialize::InputArchive& archive) {
  c10::IValue v;
  archive.read("lr", v), lr(v.toDouble());
  archive.read("weight_decay", v), weight_decay(v.toDouble());
  archive.read("momentum", v), momentum(v.toDouble());
  archive.read("nesterov", v), nesterov(v.toBool());
  archive.read("ns_coefficients", v), ns_coefficients(v.toDoubleVector());
  archive.read("eps", v), eps(v.toDouble());
  archive.read("ns_steps", v), ns_steps(v.toInt());
  archive.read("adjust_lr_fn", v), adjust_lr_fn(v.toStringRef());
  archive.read("flatten", v), flatten(v.toBool());
}

void FusedMuonParamState::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(momentum_buffer);
}

void FusedMuonParamState::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, momentum_buffer);
}

FusedMuon::FusedMuon(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, FusedMuonOptions defaults)
    : torch::optim::Optimizer(std::vector<torch::optim::OptimizerParamGroup>{}, std::make_unique<FusedMuonOptions>(defaults)) {
  check_muon_options(defaults, 0);
  for (const auto& group : param_groups) add_param_group(group);
}

void FusedMuon::add_param_group(const torch::optim::OptimizerParamGroup& param_group) {
  const auto& options = param_group.has_options() ? static_cast<const FusedMuonOptions&>(param_group.options())
                                                  : static_cast<const FusedMuonOptions&>(defaults());
  check_muon_options(options, param_groups_.size());
  for (size_t i = 0; i < param_group.params().size(); ++i) {
    check_param(param_group.params()[i], param_group.params()[i].sizes(), options, param_groups_.size(), i);
  }
  torch::optim::Optimizer::add_param_group(param_group);
  // LibTorch 2.13's add_param_group merges options only of the types it knows: keep this group's own.
  if (param_group.has_options()) param_groups_.back().set_options(param_group.options().clone());
}

void FusedMuon::save(torch::serialize::OutputArchive& archive) const { serialize(*this, archive); }

void FusedMuon::load(torch::serialize::InputArchive& archive) {
  serialize(*this, archive);
  detail::install_saved_group_options<FusedMuonOptions>(archive, param_groups_, "amp::optim::FusedMuon::load");
}

std::vector<int64_t> FusedMuon::shape_of(const at::Tensor& p) const {
  if (shard_sums() == nullptr || !shard_sums()->whole_shape) return p.sizes().vec();
  // NOTE [ZeRO layout]: ZeRO gives each rank whole tensors of Muon's, flattened; Muon orthogonalizes their matrices.
  const auto shape = shard_sums()->whole_shape(p);
  TORCH_INTERNAL_ASSERT(shape.has_value(), kName, ": ZeRO handed the step a part of a tensor; it shards Muon's by "
                        "whole tensors");
  return *shape;
}

torch::Tensor FusedMuon::step(LossClosure closure) {
  torch::Tensor loss = detail::evaluate(closure);
  detail::check_all(*this, kName, [this](const torch::optim::OptimizerOptions& options, size_t g) {
    const auto& o = static_cast<const FusedMuonOptions&>(options);
    check_muon_options(o, g);
    const auto& params = param_groups_[g].params();
    for (size_t i = 0; i < params.size(); ++i) {
      if (params[i].grad().defined()) check_param(params[i], shape_of(params[i]), o, g, i);
    }
  });
  c10::NoGradGuard no_grad;
  const std::shared_ptr<StateFormat> format = detail::format_for(state_format());
  // NOTE [A step that never waits]: Muon keeps no step count, so every write can keep its old value on the device
  // where the flag says so, a stored momentum's bytes, a lean master's weight and aux and their draw counters too
  // (NOTE [Stored moments on the device] in fused_optimizers.cpp, NOTE [Lean masters on the device]).
  const Skip skip = step_context().found_inf_decision(/*aten_only=*/true, /*on_device_there=*/true);
  if (skip == Skip::kYes) return loss;
  const detail::LeanStepGuard lean_step(lean_masters(), skip == Skip::kOnDevice ? &step_context() : nullptr);
  const at::Tensor found_inf = skip == Skip::kOnDevice ? step_context().found_inf() : at::Tensor();
  const std::vector<at::Tensor> grads = amp::detail::defined_grads(*this);
  // A GradScaler's scale comes off first and the gradients keep it off (torch's unscale_ before the step), except
  // in a skipped step; the factor stays a tensor, so the host reads nothing.
  if (!grads.empty()) {
    if (const auto scale = step_context().aten_grad_scale(grads.front())) {
      at::Tensor inverse = scale->to(at::kDouble).reciprocal().to(at::kFloat);
      if (found_inf.defined()) inverse = at::where(found_inf.ne(0), at::ones_like(inverse), inverse);
      amp::detail::mul_(grads, inverse);
    }
  }
  format->begin_step(*this);
  auto& states = state_;
  for (auto& group : param_groups_) {
    const auto& o = static_cast<const FusedMuonOptions&>(group.options());
    for (const auto& key : group.params()) {
      if (!key.grad().defined()) continue;
      detail::Work work = detail::work_for(key, lean_masters());
      at::Tensor& p = work.param;
      FusedMuonParamState& state = muon_state(states, key, p, *format);
      const std::vector<int64_t> shape = shape_of(key);
      if (format->format() == amp::OptimizerStateFormat::kFp32) {
        muon_update(p, shape, work.grad, state.momentum_buffer(), o, found_inf);
      } else {
        const StateFormat::Place place = format->place(key);
        detail::through_fp32({{&state.momentum_buffer(), Moment::kSigned, 0}}, p, *format, place,
                             [&](std::vector<at::Tensor>& fp32) {
                               if (p.scalar_type() == at::kFloat) {
                                 return muon_update(p, shape, work.grad, fp32[0], o, found_inf);
                               }
                               // O3's bf16/fp16 parameters beside decoded fp32 momentum: the update in fp32, rounded
                               // to the parameter once.
                               at::Tensor p32 = p.to(at::kFloat);
                               muon_update(p32, shape, work.grad.to(at::kFloat), fp32[0], o, found_inf);
                               p.copy_(p32);
                             },
                             found_inf);
      }
      if (const at::Tensor* copy = model_copy(p)) copy->copy_(p);
      work.finish();
    }
  }
  step_context().end_format_step(*format, found_inf.defined());
  return loss;
}

}  // namespace amp::optim
