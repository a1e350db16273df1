#include "optim/state_format.h"

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <c10/core/GradMode.h>
#include <torch/optim/optimizer.h>

#include "optim/optimizer_state_key.h"
#include "optim/optimizer_kinds.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace amp::detail {

int64_t StateFormat::alignment(int64_t numel) const {
  return format_ == OptimizerStateFormat::k8Bit && quantizes(numel) ? codes_moments().alignment() : 1;
}

int64_t StateFormat::slice_alignment() const {
  return format_ == OptimizerStateFormat::k8Bit ? codes_moments().alignment() : 1;
}

void with_fp32_moments(torch::optim::Optimizer& opt, const StateFormat* format, const std::function<void()>& fn) {
  const bool bf16 = format && format->format() == OptimizerStateFormat::kBf16;
  auto& state = opt.state();
  std::remove_reference_t<decltype(state)> decoded;
  bool any = false;
  for (const auto& group : opt.param_groups()) {
    for (const auto& p : group.params()) {
      const auto it = state.find(state_key(state, p));
      if (it == state.end() || !it->second) continue;
      auto copy = it->second->clone();
      const auto fields = state_fields(*copy).tensors;
      for (size_t f = 0; f < fields.size(); ++f) {
        at::Tensor& t = *fields[f];
        if (!t.defined() || !(is_packed(t) || (bf16 && t.scalar_type() == at::kBFloat16))) continue;
        t = decode_moment(t, p.sizes(), moment_of_field(f));
        any = true;
      }
      decoded[it->first] = std::move(copy);
    }
  }
  if (!any) {
    fn();
    return;
  }
  for (auto& [key, value] : state) {  // state of tensors param_groups no longer hold goes along as it is
    if (!decoded.count(key) && value) decoded[key] = value->clone();
  }
  std::swap(state, decoded);
  try {
    fn();
  } catch (...) {
    std::swap(state, decoded);
    throw;
  }
  std::swap(state, decoded);
}

void encode_moments(torch::optim::Optimizer& opt, const StateFormat& format) {
  if (format.format() == OptimizerStateFormat::kFp32) return;
  auto& state = opt.state();
  for (const auto& group : opt.param_groups()) {
    for (const auto& p : group.params()) {
      const auto it = state.find(state_key(state, p));
      if (it == state.end() || !it->second) continue;
      if (format.format() == OptimizerStateFormat::k8Bit && !quantizes(p.numel())) continue;  // stays as read
      const auto fields = state_fields(*it->second).tensors;
      for (size_t f = 0; f < fields.size(); ++f) {
        format.adopt(*fields[f], p, StateFormat::Place{0, p.numel()}, moment_of_field(f));
      }
    }
  }
}

void StateFormat::begin_step(const torch::optim::Optimizer& opt) {
  places_.clear();
  if (format_ == OptimizerStateFormat::kFp32) return;  // places decide only quantization and draws
  if (placement_) {
    total_ = placement_total_;
    return;
  }
  int64_t offset = 0;
  for (const auto& group : opt.param_groups()) {
    for (const auto& p : group.params()) {
      places_[p.unsafeGetTensorImpl()] = Place{offset, p.numel()};
      offset += p.numel();
    }
  }
  total_ = offset;
}

uint64_t StateFormat::end_step(const at::Tensor& found_inf) {
  if (format_ != OptimizerStateFormat::kBf16) return 0;
  const uint64_t advance = 3 * static_cast<uint64_t>(total_);
  counter_.advance(advance, found_inf.defined() ? found_inf.ne(0) : at::Tensor());
  return advance;
}

StateFormat::Place StateFormat::place(const at::Tensor& stepped) const {
  if (placement_) {
    if (const auto p = placement_(stepped)) return *p;
  }
  const auto it = places_.find(stepped.unsafeGetTensorImpl());
  return it != places_.end() ? it->second : Place{0, stepped.numel()};
}

Draws StateFormat::draws(const Place& place, int slot) const {
  if (format_ != OptimizerStateFormat::kBf16) return std::nullopt;
  return DrawStream{seed_, counter_.value() + static_cast<uint64_t>(slot) * static_cast<uint64_t>(total_) +
                              static_cast<uint64_t>(place.offset), at::Tensor()};
}

Draws StateFormat::draws_on(const Place& place, int slot, const c10::Device& device) {
  Draws d = draws(place, slot);
  if (!d) return d;
  d->on_device = counter_.on(device) + static_cast<int64_t>(d->first - counter_.value());
  return d;
}

at::Tensor StateFormat::fresh(const at::Tensor& like, const Place& place) const {
  return storage_for(like, place).fresh(like);
}

const MomentStorage& StateFormat::storage_for(const at::Tensor& like, const Place& place) const {
  switch (format_) {
    case OptimizerStateFormat::kFp32: break;
    case OptimizerStateFormat::kBf16: return bf16_moments();
    case OptimizerStateFormat::k8Bit:
      if (quantizes(place.whole_numel)) return codes_moments();
      break;
  }
  return like.scalar_type() == at::kBFloat16 ? bf16_moments() : plain_moments();
}

bool StateFormat::holds(const at::Tensor& stored, const at::Tensor& like, const Place& place) const {
  switch (format_) {
    case OptimizerStateFormat::kFp32: return !is_packed(stored);
    case OptimizerStateFormat::kBf16: return stored.scalar_type() == at::kBFloat16;
    case OptimizerStateFormat::k8Bit:
      return quantizes(place.whole_numel) ? is_packed(stored) : stored.scalar_type() == like.scalar_type();
  }
  return true;
}

void StateFormat::adopt(at::Tensor& stored, const at::Tensor& like, const Place& place, Moment moment) const {
  if (!stored.defined()) return;
  // Every step checks the size: the loops read and write as many values as the parameter has.
  const int64_t n = moment_storage_of(stored).values(stored);
  TORCH_CHECK(n == like.numel() && (!is_packed(stored) || stored.numel() == codes_moments().fresh(like).numel()),
              "amp::optim: an Adam moment of ", n, " values is the state of a parameter of shape ", like.sizes(),
              " (", like.numel(), " values): the optimizer's state was loaded from another model or another order of "
              "parameters. Load the checkpoint into an optimizer built as the saved one was (same model, same param "
              "groups in the same order).");
  if (holds(stored, like, place)) return;
  at::Tensor target = fresh(like, place);
  encode_moment(decode_moment(stored, like.sizes(), moment), target, moment);
  stored = std::move(target);
}

}  // namespace amp::detail
