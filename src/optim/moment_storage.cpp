#include "optim/moment_storage.h"

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "optim/stochastic_rounding_ops.h"

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

// Made once per device: a host-to-device copy waits for the device (kept for the process, as a device's tensors
// must not be freed after its runtime shuts down).
at::Tensor state_map_tensor(Moment moment, const at::Device& device) {
  static std::mutex mutex;
  static auto* maps = new std::map<std::pair<int, std::string>, at::Tensor>();
  const std::lock_guard<std::mutex> lock(mutex);
  at::Tensor& map = (*maps)[{moment == Moment::kSigned ? 0 : 1, device.str()}];
  if (!map.defined()) {
    const auto& values = quantization_map(moment);
    map = at::from_blob(const_cast<float*>(values.data()), {256}, at::TensorOptions().dtype(at::kFloat))
              .to(device, false, true);
  }
  return map;
}

}  // namespace

const std::array<float, 256>& quantization_map(Moment moment) {
  static const std::array<float, 256> signed_map = state_dynamic_map(true);
  static const std::array<float, 256> unsigned_map = state_dynamic_map(false);
  return moment == Moment::kSigned ? signed_map : unsigned_map;
}

namespace {

// A map's bucket table (NOTE [Finding a code] in cpu_state_codec.cpp), lines (NOTE [Codes by lines], there) and
// byte planes (NOTE [Decoding by permutes] in codes_avx512.h).
struct StateCodeTables {
  std::vector<cpu::CodeBucket> buckets;
  std::vector<uint8_t> map_bytes;
  cpu::CodeLines lines;
  bool has_lines = false;
  explicit StateCodeTables(Moment moment) : buckets(cpu::kCodeBuckets), map_bytes(cpu::kMapByteSize) {
    cpu::map_byte_planes(quantization_map(moment).data(), map_bytes.data());
    TORCH_INTERNAL_ASSERT(cpu::code_buckets(quantization_map(moment).data(), buckets.data()),
                          "amp: a bucket of the 8-bit map spans 3 codes");
    has_lines = cpu::code_lines(quantization_map(moment).data(), &lines);
  }
};

const StateCodeTables& state_code_tables(Moment moment) {
  static const StateCodeTables signed_tables(Moment::kSigned), unsigned_tables(Moment::kUnsigned);
  return moment == Moment::kSigned ? signed_tables : unsigned_tables;
}

}  // namespace

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

namespace {

// The tensor's own dtype: fp32 (or O3's fp16) values as they are.
class PlainMoment final : public MomentStorage {
 public:
  at::Tensor fresh(const at::Tensor& like) const override { return at::zeros_like(like, at::MemoryFormat::Preserve); }
  at::Tensor decode(const at::Tensor& stored, at::IntArrayRef shape, Moment) const override {
    c10::NoGradGuard no_grad;
    return stored.to(at::kFloat, false, /*copy=*/true).reshape(shape);
  }
  void encode(const at::Tensor& flat, const at::Tensor& stored, Moment, Draws) const override {
    stored.copy_(flat.view(stored.sizes()));
  }
  std::optional<cpu::StateView> view(const at::Tensor& stored, Moment, Draws) const override {
    cpu::StateView v;
    v.data = stored.data_ptr();
    switch (stored.scalar_type()) {
      case at::kFloat: v.kind = cpu::StateKind::kFloat; return v;
      case at::kHalf: v.kind = cpu::StateKind::kHalf; return v;
      default: return std::nullopt;
    }
  }
};

// bfloat16, rounded stochastically with the step's draws (NOTE [Optimizer state formats]), to nearest without.
class Bf16Moment final : public MomentStorage {
 public:
  at::Tensor fresh(const at::Tensor& like) const override {
    return at::zeros_like(like, like.options().dtype(at::kBFloat16));
  }
  at::Tensor decode(const at::Tensor& stored, at::IntArrayRef shape, Moment moment) const override {
    return plain_moments().decode(stored, shape, moment);
  }
  void encode(const at::Tensor& flat, const at::Tensor& stored, Moment moment, Draws draws) const override {
    if (draws && draws->on_device.defined()) {  // counted on the device: ATen ops there
      stored.copy_(round_bf16_stochastically(flat, draws->seed, draws->on_device).view(stored.sizes()));
      return;
    }
    if (draws) {  // the CPU loop's draws, whatever the device
      at::Tensor host = at::empty(stored.sizes(), stored.options().device(at::kCPU));
      encode_moment(flat.cpu(), host, moment, draws);
      stored.copy_(host);
      return;
    }
    stored.copy_(flat.view(stored.sizes()));
  }
  std::optional<cpu::StateView> view(const at::Tensor& stored, Moment, Draws draws) const override {
    cpu::StateView v;
    v.kind = cpu::StateKind::kBFloat16;
    v.data = stored.data_ptr();
    if (draws) {
      v.stochastic = true;
      v.seed = draws->seed;
      v.first = draws->first;
    }
    return v;
  }
};

// torchao's AdamW8bit layout: n codes, then the n / 256 fp32 scales of their blocks, in one 1-d uint8 tensor.
class CodesMoment final : public MomentStorage {
 public:
  at::Tensor fresh(const at::Tensor& like) const override {
    const int64_t n = like.numel();
    return at::zeros({n + n / kStateBlock * 4}, like.options().dtype(at::kByte));
  }
  int64_t values(const at::Tensor& stored) const override { return state_packed_numel(stored); }
  at::Tensor decode(const at::Tensor& stored, at::IntArrayRef shape, Moment moment) const override {
    c10::NoGradGuard no_grad;
    const int64_t n = state_packed_numel(stored);
    if (const auto v = cpu_view(stored, moment)) {
      at::Tensor out = at::empty({n}, at::TensorOptions().dtype(at::kFloat));
      cpu::decode(*v, 0, n, out.data_ptr<float>());
      return out.reshape(shape);
    }
    const at::Tensor codes = stored.narrow(0, 0, n).to(at::kLong);
    const at::Tensor scales = stored.narrow(0, n, stored.numel() - n).contiguous().view(at::kFloat);
    return (state_map_tensor(moment, stored.device()).index_select(0, codes).view({-1, kStateBlock}) *
            scales.view({-1, 1}))
        .reshape(shape);
  }
  void encode(const at::Tensor& flat, const at::Tensor& stored, Moment moment, Draws) const override {
    const int64_t n = state_packed_numel(stored);
    // torchao's scale_tensor and quantize_8bit_with_qmap.
    const at::Tensor blocks = flat.view({-1, kStateBlock});
    const at::Tensor scale = blocks.abs().amax(-1).clamp_min(1e-12);
    stored.narrow(0, 0, n).copy_(quantize_with_map(blocks / scale.view({-1, 1}), moment).reshape({-1}));
    stored.narrow(0, n, stored.numel() - n).copy_(scale.view(at::kByte));
  }
  std::optional<cpu::StateView> view(const at::Tensor& stored, Moment moment, Draws) const override {
    cpu::StateView v;
    v.kind = cpu::StateKind::kCodes;
    v.data = stored.data_ptr();
    v.scales = reinterpret_cast<float*>(static_cast<uint8_t*>(v.data) + state_packed_numel(stored));
    if (reinterpret_cast<uintptr_t>(v.scales) % alignof(float) != 0) return std::nullopt;
    v.map = quantization_map(moment).data();
    v.buckets = state_code_tables(moment).buckets.data();
    v.map_bytes = state_code_tables(moment).map_bytes.data();
    v.lines = state_code_tables(moment).has_lines ? &state_code_tables(moment).lines : nullptr;
    return v;
  }
  at::Tensor slice(const at::Tensor& stored, int64_t begin, int64_t length) const override {
    TORCH_INTERNAL_ASSERT(begin % kStateBlock == 0 && length % kStateBlock == 0, "amp: a slice of an 8-bit moment at ",
                          begin, " of ", length, " values straddles a block");
    const int64_t n = state_packed_numel(stored);
    return at::cat({stored.narrow(0, begin, length), stored.narrow(0, n + begin / kStateBlock * 4, length / kStateBlock * 4)});
  }
  at::Tensor join(const std::vector<at::Tensor>& parts) const override {
    std::vector<at::Tensor> codes, scales;
    for (const auto& p : parts) {
      const int64_t n = state_packed_numel(p);
      codes.push_back(p.narrow(0, 0, n));
      scales.push_back(p.narrow(0, n, p.numel() - n));
    }
    codes.insert(codes.end(), scales.begin(), scales.end());
    return at::cat(codes);
  }
  int64_t alignment() const override { return kStateBlock; }
};

}  // namespace

at::Tensor MomentStorage::slice(const at::Tensor& stored, int64_t begin, int64_t length) const {
  return stored.reshape({-1}).narrow(0, begin, length).clone();
}

at::Tensor MomentStorage::join(const std::vector<at::Tensor>& parts) const { return at::cat(parts); }

const MomentStorage& plain_moments() {
  static const PlainMoment storage;
  return storage;
}
const MomentStorage& bf16_moments() {
  static const Bf16Moment storage;
  return storage;
}
const MomentStorage& codes_moments() {
  static const CodesMoment storage;
  return storage;
}

const MomentStorage& moment_storage_of(const at::Tensor& stored) {
  switch (stored.scalar_type()) {
    case at::kByte: return codes_moments();
    case at::kBFloat16: return bf16_moments();
    default: return plain_moments();
  }
}

bool quantizes(int64_t numel) { return numel >= kMinQuantizedNumel && numel % kStateBlock == 0; }

bool is_packed(const at::Tensor& stored) { return stored.defined() && stored.scalar_type() == at::kByte; }

int64_t slice_alignment(const at::Tensor& stored) { return moment_storage_of(stored).alignment(); }

std::optional<cpu::StateView> cpu_view(const at::Tensor& stored, Moment moment, Draws draws) {
  if (!stored.device().is_cpu() || !stored.is_contiguous()) return std::nullopt;
  return moment_storage_of(stored).view(stored, moment, draws);
}

at::Tensor decode_moment(const at::Tensor& stored, at::IntArrayRef shape, Moment moment) {
  return moment_storage_of(stored).decode(stored, shape, moment);
}

void encode_moment(const at::Tensor& values, const at::Tensor& stored, Moment moment, Draws draws) {
  c10::NoGradGuard no_grad;
  const at::Tensor flat = values.to(at::kFloat).contiguous().reshape({-1});
  const MomentStorage& storage = moment_storage_of(stored);
  TORCH_INTERNAL_ASSERT(flat.numel() == storage.values(stored), "amp: encoding ", flat.numel(), " values into a moment of ",
                        stored.numel(), " elements");
  const bool counted_on_device = draws && draws->on_device.defined();
  if (const auto v = counted_on_device ? std::nullopt : cpu_view(stored, moment, draws); v && flat.device().is_cpu()) {  // the CPU loops, any class
    cpu::encode(*v, 0, flat.numel(), flat.data_ptr<float>());
    stored.unsafeGetTensorImpl()->bump_version();
    return;
  }
  storage.encode(flat, stored, moment, draws);
}

at::Tensor slice_moment(const at::Tensor& stored, int64_t begin, int64_t length) {
  return moment_storage_of(stored).slice(stored, begin, length);
}

at::Tensor join_moments(const std::vector<at::Tensor>& parts) {
  return parts.empty() ? at::cat(parts) : moment_storage_of(parts.front()).join(parts);
}

}  // namespace amp::detail
