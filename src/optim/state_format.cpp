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
namespace {

constexpr int64_t kStateBlock = cpu::kCodeBlock;
constexpr int64_t kMinQuantizedNumel = 4096;

// torchao's create_dynamic_map(signed, max_exponent_bits=7, total_bits=8) (from bitsandbytes), op for op: each
// decade 10^(i-6) holds the midpoints of linspace(0.1, 1, k) (fp32), scaled in fp32 by the Python float; plus 0 and 1.
std::array<float, 256> state_dynamic_map(bool is_signed) {
  c10::NoGradGuard no_grad;
  std::vector<float> data;
  for (int i = 0; i < 7; ++i) {
    const int64_t items = is_signed ? (int64_t{1} << i) + 1 : (int64_t{1} << (i + 1)) + 1;
    const at::Tensor boundaries = at::linspace(0.1, 1, items, at::TensorOptions().dtype(at::kFloat));
    const at::Tensor means = (boundaries.narrow(0, 0, items - 1) + boundaries.narrow(0, 1, items - 1)) / 2.0;
    const double decade = std::pow(10.0, i - 6);
    for (double sign : is_signed ? std::vector<double>{1.0, -1.0} : std::vector<double>{1.0}) {
      const at::Tensor scaled = means * (sign * decade);
      const float* v = scaled.data_ptr<float>();
      data.insert(data.end(), v, v + scaled.numel());
    }
  }
  data.push_back(0.0f);
  data.push_back(1.0f);
  TORCH_INTERNAL_ASSERT(data.size() == 256, "amp: the 8-bit map has ", data.size(), " entries");
  std::sort(data.begin(), data.end());
  std::array<float, 256> out;
  std::copy(data.begin(), data.end(), out.begin());
  return out;
}

int64_t state_packed_numel(const at::Tensor& stored) { return stored.numel() / (kStateBlock + 4) * kStateBlock; }

at::Tensor state_map_tensor(Moment moment, const at::Device& device) {
  const auto& map = quantization_map(moment);
  return at::from_blob(const_cast<float*>(map.data()), {256}, at::TensorOptions().dtype(at::kFloat)).to(device, false, true);
}

}  // namespace

const std::array<float, 256>& quantization_map(Moment moment) {
  static const std::array<float, 256> signed_map = state_dynamic_map(true);
  static const std::array<float, 256> unsigned_map = state_dynamic_map(false);
  return moment == Moment::kSigned ? signed_map : unsigned_map;
}

namespace {

// A map's bucket table (NOTE [Finding a code] in cpu_state_codec.cpp).
struct StateCodeTables {
  std::vector<cpu::CodeBucket> buckets;
  explicit StateCodeTables(Moment moment) : buckets(cpu::kCodeBuckets) {
    TORCH_INTERNAL_ASSERT(cpu::code_buckets(quantization_map(moment).data(), buckets.data()),
                          "amp: a bucket of the 8-bit map spans 3 codes");
  }
};

const StateCodeTables& state_code_tables(Moment moment) {
  static const StateCodeTables signed_tables(Moment::kSigned), unsigned_tables(Moment::kUnsigned);
  return moment == Moment::kSigned ? signed_tables : unsigned_tables;
}

}  // namespace

bool quantizes(int64_t numel) { return numel >= kMinQuantizedNumel && numel % kStateBlock == 0; }

bool is_packed(const at::Tensor& stored) { return stored.defined() && stored.scalar_type() == at::kByte; }

int64_t slice_alignment(const at::Tensor& stored) { return is_packed(stored) ? kStateBlock : 1; }

int64_t StateFormat::alignment(int64_t numel) const {
  return format_ == OptimizerStateFormat::k8Bit && quantizes(numel) ? kStateBlock : 1;
}

int64_t StateFormat::slice_alignment() const { return format_ == OptimizerStateFormat::k8Bit ? kStateBlock : 1; }

std::optional<cpu::StateView> cpu_view(const at::Tensor& stored, Moment moment,
                                       std::optional<std::pair<uint64_t, uint64_t>> draws) {
  if (!stored.device().is_cpu() || !stored.is_contiguous()) return std::nullopt;
  cpu::StateView view;
  view.data = stored.data_ptr();
  switch (stored.scalar_type()) {
    case at::kFloat: view.kind = cpu::StateKind::kFloat; break;
    case at::kHalf: view.kind = cpu::StateKind::kHalf; break;
    case at::kBFloat16:
      view.kind = cpu::StateKind::kBFloat16;
      if (draws) {
        view.stochastic = true;
        view.seed = draws->first;
        view.first = draws->second;
      }
      break;
    case at::kByte: {
      view.kind = cpu::StateKind::kCodes;
      auto* bytes = static_cast<uint8_t*>(view.data);
      view.scales = reinterpret_cast<float*>(bytes + state_packed_numel(stored));
      if (reinterpret_cast<uintptr_t>(view.scales) % alignof(float) != 0) return std::nullopt;
      view.map = quantization_map(moment).data();
      view.buckets = state_code_tables(moment).buckets.data();
      break;
    }
    default: return std::nullopt;
  }
  return view;
}

at::Tensor quantize_with_map(const at::Tensor& scaled, Moment moment) {
  // torchao's GPU-friendly binary search, then rounding up where at least half-way to the next entry.
  const at::Tensor map = state_map_tensor(moment, scaled.device());
  auto at_or_above = [&](const at::Tensor& codes, int64_t step) {
    return at::where(scaled >= map.index_select(0, (codes + step).reshape({-1})).view(scaled.sizes()),
                     at::full({}, step, codes.options()), at::zeros({}, codes.options()));
  };
  at::Tensor codes = at::where(scaled >= map[128], at::full({}, 128, scaled.options().dtype(at::kLong)),
                               at::zeros({}, scaled.options().dtype(at::kLong)));
  for (int64_t step : {64, 32, 16, 8, 4, 2, 1}) codes = codes + at_or_above(codes, step);
  const at::Tensor up = (codes + 1).clamp_max(255);
  const at::Tensor down_value = map.index_select(0, codes.reshape({-1})).view(scaled.sizes());
  const at::Tensor up_value = map.index_select(0, up.reshape({-1})).view(scaled.sizes());
  return at::where(scaled - down_value >= (up_value - down_value) * 0.5, up, codes).to(at::kByte);
}

at::Tensor decode_moment(const at::Tensor& stored, at::IntArrayRef shape, Moment moment) {
  c10::NoGradGuard no_grad;
  if (!is_packed(stored)) return stored.to(at::kFloat, false, /*copy=*/true).reshape(shape);
  const int64_t n = state_packed_numel(stored);
  if (const auto view = cpu_view(stored, moment)) {
    at::Tensor out = at::empty({n}, at::TensorOptions().dtype(at::kFloat));
    cpu::decode(*view, 0, n, out.data_ptr<float>());
    return out.reshape(shape);
  }
  const at::Tensor codes = stored.narrow(0, 0, n).to(at::kLong);
  const at::Tensor scales = stored.narrow(0, n, stored.numel() - n).contiguous().view(at::kFloat);
  return (state_map_tensor(moment, stored.device()).index_select(0, codes).view({-1, kStateBlock}) * scales.view({-1, 1}))
      .reshape(shape);
}

void encode_moment(const at::Tensor& values, const at::Tensor& stored, Moment moment,
                   std::optional<std::pair<uint64_t, uint64_t>> draws) {
  c10::NoGradGuard no_grad;
  const at::Tensor flat = values.to(at::kFloat).contiguous().reshape({-1});
  const bool stochastic = draws && stored.scalar_type() == at::kBFloat16;
  if (const auto view = cpu_view(stored, moment, draws); view && flat.device().is_cpu()) {
    const int64_t n = flat.numel();
    TORCH_INTERNAL_ASSERT(n == (is_packed(stored) ? state_packed_numel(stored) : stored.numel()), "amp: encoding ", n,
                          " values into a moment of ", stored.numel(), " elements");
    cpu::encode(*view, 0, n, flat.data_ptr<float>());
    stored.unsafeGetTensorImpl()->bump_version();
    return;
  }
  if (stochastic) {  // the draws are the CPU loop's, whatever the device
    at::Tensor host = at::empty(stored.sizes(), stored.options().device(at::kCPU));
    encode_moment(flat.cpu(), host, moment, draws);
    stored.copy_(host);
    return;
  }
  if (!is_packed(stored)) {
    stored.copy_(flat.view(stored.sizes()));
    return;
  }
  // torchao's scale_tensor and quantize_8bit_with_qmap.
  const int64_t n = state_packed_numel(stored);
  const at::Tensor blocks = flat.view({-1, kStateBlock});
  const at::Tensor scale = blocks.abs().amax(-1).clamp_min(1e-12);
  stored.narrow(0, 0, n).copy_(quantize_with_map(blocks / scale.view({-1, 1}), moment).reshape({-1}));
  stored.narrow(0, n, stored.numel() - n).copy_(scale.view(at::kByte));
}

at::Tensor slice_moment(const at::Tensor& stored, int64_t begin, int64_t length) {
  if (!is_packed(stored)) return stored.reshape({-1}).narrow(0, begin, length).clone();
  TORCH_INTERNAL_ASSERT(begin % kStateBlock == 0 && length % kStateBlock == 0, "amp: a slice of an 8-bit moment at ", begin,
                        " of ", length, " values straddles a block");
  const int64_t n = state_packed_numel(stored);
  return at::cat({stored.narrow(0, begin, length), stored.narrow(0, n + begin / kStateBlock * 4, length / kStateBlock * 4)});
}

at::Tensor join_moments(const std::vector<at::Tensor>& parts) {
  if (parts.empty() || !is_packed(parts.front())) return at::cat(parts);
  std::vector<at::Tensor> codes, scales;
  for (const auto& p : parts) {
    const int64_t n = state_packed_numel(p);
    codes.push_back(p.narrow(0, 0, n));
    scales.push_back(p.narrow(0, n, p.numel() - n));
  }
  codes.insert(codes.end(), scales.begin(), scales.end());
  return at::cat(codes);
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

void StateFormat::end_step() {
  if (format_ == OptimizerStateFormat::kBf16) counter_ += 3 * static_cast<uint64_t>(total_);
}

StateFormat::Place StateFormat::place(const at::Tensor& stepped) const {
  if (placement_) {
    if (const auto p = placement_(stepped)) return *p;
  }
  const auto it = places_.find(stepped.unsafeGetTensorImpl());
  return it != places_.end() ? it->second : Place{0, stepped.numel()};
}

std::optional<std::pair<uint64_t, uint64_t>> StateFormat::draws(const Place& place, int slot) const {
  if (format_ != OptimizerStateFormat::kBf16) return std::nullopt;
  return std::make_pair(seed_, counter_ + static_cast<uint64_t>(slot) * static_cast<uint64_t>(total_) +
                                   static_cast<uint64_t>(place.offset));
}

at::Tensor StateFormat::fresh(const at::Tensor& like, const Place& place) const {
  switch (format_) {
    case OptimizerStateFormat::kFp32: break;
    case OptimizerStateFormat::kBf16: return at::zeros_like(like, like.options().dtype(at::kBFloat16));
    case OptimizerStateFormat::k8Bit:
      if (quantizes(place.whole_numel)) {
        const int64_t n = like.numel();
        return at::zeros({n + n / kStateBlock * 4}, like.options().dtype(at::kByte));
      }
      break;
  }
  return at::zeros_like(like, at::MemoryFormat::Preserve);
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
  const int64_t n = is_packed(stored) ? state_packed_numel(stored) : stored.numel();
  TORCH_CHECK(n == like.numel() && (!is_packed(stored) || stored.numel() == n + n / kStateBlock * 4),
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
