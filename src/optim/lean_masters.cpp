#include "optim/lean_masters.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <c10/core/GradMode.h>
#include <c10/util/BFloat16.h>
#include <torch/serialize/archive.h>

#include <cstring>
#include <mutex>
#include <unordered_map>

#include "amp/properties.h"
#include "core/released_parameters.h"
#include "optim/float32_bytes.h"
#include "optim/fused_route.h"
#include "optim/residual8.h"
#include "optim/sharding.h"
#include "optim/stochastic_rounding.h"
#include "optim/stochastic_rounding_ops.h"

namespace amp::detail {
namespace {

const void* lean_storage_of(const at::Tensor& t) { return t.storage().unsafeGetStorageImpl(); }

uint32_t bits_of(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

float float_of(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

float float_of_bf16(uint16_t x) { return float_of(static_cast<uint32_t>(x) << 16); }

uint16_t round_to_nearest(float f) { return c10::BFloat16(f).x; }  // c10's conversion rounds to nearest even

template <class Body>
void each_element(int64_t n, Body body) {
  at::parallel_for(0, n, int64_t{1} << 15, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) body(i);
  });
}

std::mutex lean_registry_mutex;
struct LeanEntry {
  std::weak_ptr<LeanMasters> table;
  size_t index;
};
std::unordered_map<const c10::TensorImpl*, LeanEntry> lean_registry;

at::Tensor lean_cpu_contiguous(const at::Tensor& t) { return t.device().is_cpu() ? t.contiguous() : t.cpu().contiguous(); }

// round_to_nearest in ATen ops: ATen's vectorized conversions and CUDA's keep a NaN's sign and payload where c10's
// scalar conversion, the loops', writes 0x7fc0.
at::Tensor to_bf16_nearest(const at::Tensor& v) {
  return at::where(at::isnan(v), at::full({}, int16_t{0x7fc0}, v.options().dtype(at::kShort)).view(at::kBFloat16),
                   v.to(at::kBFloat16));
}

}  // namespace

std::optional<at::ScalarType> LeanMasters::aux_dtype() const noexcept {
  switch (format_) {
    case amp::MasterWeights::kSplit: return at::kShort;
    case amp::MasterWeights::kKahan: return at::kBFloat16;
    case amp::MasterWeights::kResidual8: return at::kChar;
    default: return std::nullopt;
  }
}

// A zero aux for `param` (undefined: the format keeps none).
at::Tensor LeanMasters::fresh_aux(const at::Tensor& param) const {
  const auto dtype = aux_dtype();
  return dtype ? at::zeros(param.sizes(), param.options().requires_grad(false).dtype(*dtype)) : at::Tensor();
}

void LeanMasters::add(std::string name, at::Tensor param) {
  at::Tensor aux = fresh_aux(param);
  names_.push_back(std::move(name));
  version_.push_back(param._version());
  storage_.push_back(lean_storage_of(param));
  offset_.push_back(total_);
  total_ += param.numel();
  params_.push_back(std::move(param));
  aux_.push_back(std::move(aux));
  loaded_.emplace_back();
}

void LeanMasters::adopt(const LeanMasters& other, size_t i) {
  offset_.push_back(total_);
  total_ += other.params_[i].numel();
  names_.push_back(other.names_[i]);
  params_.push_back(other.params_[i]);
  aux_.push_back(other.aux_[i]);
  loaded_.push_back(other.loaded_[i]);
  version_.push_back(other.version_[i]);
  storage_.push_back(other.storage_[i]);
}

void LeanMasters::add_slice(const LeanMasters& whole, size_t i, at::Tensor piece, int64_t begin, at::Tensor aux) {
  TORCH_INTERNAL_ASSERT(whole.format_ == format_ && piece.dim() == 1 && piece.scalar_type() == at::kBFloat16 &&
                        aux.defined() == (format_ != amp::MasterWeights::kStochasticRounding));
  names_.push_back(whole.names_[i]);
  version_.push_back(piece._version());
  storage_.push_back(lean_storage_of(piece));
  offset_.push_back(whole.offset_[i] + begin);
  total_ = whole.total_;
  params_.push_back(std::move(piece));
  aux_.push_back(std::move(aux));
  loaded_.emplace_back();
}

void LeanMasters::restore(size_t i, const at::Tensor& aux, const at::Tensor& loaded_weight) {
  c10::NoGradGuard no_grad;
  if (aux_[i].defined()) aux_[i].copy_(aux);
  loaded_[i] = loaded_weight.defined() ? loaded_weight.clone() : at::Tensor();
  mark_synced(i);
}

void LeanMasters::mark_whole(std::vector<at::Tensor> aux) {
  TORCH_INTERNAL_ASSERT(aux.size() == aux_.size());
  shards_.reset();
  if (aux_sharded_) aux_ = std::move(aux);
  aux_sharded_ = false;
}

void LeanMasters::mark_sharded(std::weak_ptr<Shards> shards) {
  shards_ = std::move(shards);
  aux_sharded_ = format_ != amp::MasterWeights::kStochasticRounding;
  if (!aux_sharded_) return;
  for (auto& aux : aux_) aux = at::Tensor();
  for (auto& loaded : loaded_) loaded = at::Tensor();  // the slices keep their own pairing
}

void LeanMasters::begin_step(const at::Tensor& found_inf) {
  in_step_ = true;
  step_skipped_ = found_inf.defined() ? found_inf.ne(0) : at::Tensor();
}

void LeanMasters::end_step() {
  in_step_ = false;
  if (format_ == amp::MasterWeights::kStochasticRounding) counter_.advance(static_cast<uint64_t>(total_), step_skipped_);
  step_skipped_ = at::Tensor();
}

void LeanMasters::rewind_step() noexcept {
  if (format_ == amp::MasterWeights::kStochasticRounding) counter_.rewind(static_cast<uint64_t>(total_));
}

bool LeanMasters::on_device_route(const at::Tensor& param) const {
  return !param.device().is_cpu() || optim::detail::forced_fused_route() == optim::detail::FusedRoute::kAten;
}

void LeanMasters::cast_from_float(size_t i) {
  c10::NoGradGuard no_grad;
  at::Tensor& p = params_[i];
  if (p.scalar_type() == at::kBFloat16) return;  // already cast: its bf16 value is exact
  const at::Tensor value = p.detach().to(at::kFloat).contiguous().clone();
  p.set_data(at::empty(p.sizes(), p.options().dtype(at::kBFloat16)));
  p.mutable_grad() = at::Tensor();
  store(i, value);
}

at::Tensor LeanMasters::value(size_t i) const {
  TORCH_INTERNAL_ASSERT(!aux_sharded_, "amp: a sharded lean master's value needs its gathered aux");
  return value(i, aux_[i]);
}

at::Tensor LeanMasters::value(size_t i, const at::Tensor& aux) const {
  if (on_device_route(params_[i])) {  // NOTE [Lean masters on the device]
    const at::Tensor& w = params_[i];
    switch (format_) {
      case amp::MasterWeights::kSplit:
        return at::bitwise_or(at::bitwise_left_shift(w.contiguous().view(at::kShort).to(at::kInt), 16),
                              at::bitwise_and(aux.to(at::kInt), 0xffff))
            .view(at::kFloat);
      case amp::MasterWeights::kKahan: return w.to(at::kFloat) + aux.to(at::kFloat);
      case amp::MasterWeights::kResidual8: return residual8_decode(w, aux);
      default: return w.to(at::kFloat, false, /*copy=*/true);
    }
  }
  const at::Tensor p = lean_cpu_contiguous(params_[i]);
  at::Tensor out = at::empty(p.sizes(), p.options().dtype(at::kFloat));
  const auto* w = reinterpret_cast<const uint16_t*>(p.data_ptr());
  float* o = out.data_ptr<float>();
  switch (format_) {
    case amp::MasterWeights::kSplit: {
      const at::Tensor lo_t = lean_cpu_contiguous(aux);
      const auto* lo = reinterpret_cast<const uint16_t*>(lo_t.data_ptr());
      each_element(p.numel(), [&](int64_t k) { o[k] = float_of((static_cast<uint32_t>(w[k]) << 16) | lo[k]); });
      break;
    }
    case amp::MasterWeights::kKahan: {
      const at::Tensor c_t = lean_cpu_contiguous(aux);
      const auto* c = reinterpret_cast<const uint16_t*>(c_t.data_ptr());
      each_element(p.numel(), [&](int64_t k) { o[k] = float_of_bf16(w[k]) + float_of_bf16(c[k]); });
      break;
    }
    case amp::MasterWeights::kResidual8: {
      const at::Tensor r_t = lean_cpu_contiguous(aux);
      residual8_decode(w, r_t.data_ptr<int8_t>(), o, p.numel());
      break;
    }
    default:
      each_element(p.numel(), [&](int64_t k) { o[k] = float_of_bf16(w[k]); });
      break;
  }
  return params_[i].device().is_cpu() ? out : out.to(params_[i].device());
}

void LeanMasters::store(size_t i, const at::Tensor& value) {
  c10::NoGradGuard no_grad;
  const at::Tensor& p = params_[i];
  TORCH_INTERNAL_ASSERT(p.scalar_type() == at::kBFloat16 && value.sizes() == p.sizes());
  // A sharded table's store (load_weights) computes the whole aux and hands it to its shards; at ZeRO stage 3 the
  // weight too, which between uses has no memory to take it.
  const std::shared_ptr<Shards> shards = shards_.lock();
  TORCH_INTERNAL_ASSERT(shards || !aux_sharded_, "amp: a sharded lean table outlived its sharding");
  const bool weight_sharded = shards && shards->holds_weights();
  const at::Tensor weight = weight_sharded && is_released(p) ? at::empty(p.sizes(), p.options()) : p;
  const at::Tensor whole_aux = aux_sharded_ ? fresh_aux(p) : aux_[i];
  if (on_device_route(p)) {
    store_on_device(i, weight, value, whole_aux);
  } else {
    store_on_host(i, weight, value, whole_aux);
  }
  loaded_[i] = at::Tensor();
  mark_synced(i);
  if (weight_sharded) shards->keep_weight(i, weight);
  if (aux_sharded_) shards->keep_aux(i, whole_aux, at::Tensor());
}

// NOTE [Lean masters on the device]: store()'s arithmetic in ATen ops, bit for bit store_on_host's.
void LeanMasters::store_on_device(size_t i, const at::Tensor& p, const at::Tensor& value, const at::Tensor& whole_aux) {
  const at::Tensor v = value.to(at::kFloat).contiguous();
  at::Tensor w, aux;
  switch (format_) {
    case amp::MasterWeights::kSplit: {
      const at::Tensor bits = v.view(at::kInt);
      w = at::bitwise_right_shift(bits, 16).to(at::kShort).view(at::kBFloat16);
      aux = at::bitwise_and(bits, 0xffff).to(at::kShort);
      break;
    }
    case amp::MasterWeights::kKahan:
      w = to_bf16_nearest(v);
      aux = to_bf16_nearest(v - w.to(at::kFloat));  // exact in fp32: w is v's neighbour
      break;
    case amp::MasterWeights::kResidual8:
      w = to_bf16_nearest(v);
      aux = residual8_encode(v, w);
      break;
    case amp::MasterWeights::kStochasticRounding:
      w = round_bf16_stochastically(v, seed_, counter_.on(p.device()) + offset_[i], ValuesPerDraw::kOne);
      if (!in_step_) counter_.advance(static_cast<uint64_t>(total_));  // a store of its own
      break;
    case amp::MasterWeights::kCopy:
      TORCH_INTERNAL_ASSERT(false, "amp: LeanMasters holds no kCopy parameters");
  }
  if (in_step_ && step_skipped_.defined()) {  // the device's skip: the old weight and aux
    w = at::where(step_skipped_, p, w.view(p.sizes()));
    if (aux.defined()) aux = at::where(step_skipped_, whole_aux, aux.view(p.sizes()));
  }
  p.copy_(w.view(p.sizes()));
  if (aux.defined()) whole_aux.copy_(aux.view(p.sizes()));
}

void LeanMasters::store_on_host(size_t i, const at::Tensor& p, const at::Tensor& value, const at::Tensor& whole_aux) {
  const at::Tensor v = lean_cpu_contiguous(value.to(at::kFloat));
  const bool in_place = p.device().is_cpu() && p.is_contiguous();
  at::Tensor w_t = in_place ? p : at::empty(p.sizes(), v.options().dtype(at::kBFloat16));
  at::Tensor aux_t = whole_aux.defined() ? (in_place ? whole_aux : at::empty_like(v, whole_aux.scalar_type())) : at::Tensor();
  const float* x = v.data_ptr<float>();
  auto* w = reinterpret_cast<uint16_t*>(w_t.data_ptr());
  auto* aux = aux_t.defined() ? reinterpret_cast<uint16_t*>(aux_t.data_ptr()) : nullptr;
  switch (format_) {
    case amp::MasterWeights::kSplit:
      each_element(v.numel(), [&](int64_t k) {
        const uint32_t b = bits_of(x[k]);
        w[k] = static_cast<uint16_t>(b >> 16);
        aux[k] = static_cast<uint16_t>(b & 0xffffu);
      });
      break;
    case amp::MasterWeights::kKahan:
      each_element(v.numel(), [&](int64_t k) {
        const uint16_t rounded = round_to_nearest(x[k]);
        w[k] = rounded;
        aux[k] = round_to_nearest(x[k] - float_of_bf16(rounded));  // exact in fp32: rounded is x's neighbour
      });
      break;
    case amp::MasterWeights::kResidual8:
      each_element(v.numel(), [&](int64_t k) { w[k] = round_to_nearest(x[k]); });
      residual8_encode(x, w, reinterpret_cast<int8_t*>(aux), v.numel());
      break;
    case amp::MasterWeights::kStochasticRounding: {
      const uint64_t seed = seed_, base = counter_.value() + static_cast<uint64_t>(offset_[i]);
      each_element(v.numel(), [&](int64_t k) {
        w[k] = round_stochastically(x[k], static_cast<uint16_t>(random_bits(seed, base + static_cast<uint64_t>(k))));
      });
      if (!in_step_) counter_.advance(static_cast<uint64_t>(total_));  // a store of its own (load_weights, initialize)
      break;
    }
    case amp::MasterWeights::kCopy:
      TORCH_INTERNAL_ASSERT(false, "amp: LeanMasters holds no kCopy parameters");
  }
  if (in_place) {
    p.unsafeGetTensorImpl()->bump_version();  // raw writes, like any in-place op, must say so
  } else {
    p.copy_(w_t);
    if (aux_t.defined()) whole_aux.copy_(aux_t);
  }
}

void LeanMasters::check_usable(size_t i) const {
  const at::Tensor& p = params_[i];
  if (holds_float32_bytes(p)) fail_float32_bytes("parameter", names_[i], p);
  TORCH_CHECK(p.scalar_type() == at::kBFloat16, "amp: parameter '", names_[i], "' is ", dtype_name(p.scalar_type()),
              " now, but amp::initialize cast it to torch.bfloat16 and keeps its fp32 value as master_weights_format ",
              to_string(format_), " (something replaced its data, e.g. set_data or Module::to, after initialize). "
              "Write weights in place instead: amp::load_weights(*model, path), or copy_ under torch::NoGradGuard.");
  TORCH_CHECK(!aux_[i].defined() || p.sizes() == aux_[i].sizes(), "amp: parameter '", names_[i], "' changed shape "
              "from ", aux_[i].sizes(), " to ", p.sizes(), " after amp::initialize. Load weights of the shapes the "
              "model was built with.");
}

void LeanMasters::refresh_changed() {
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i]._version() == version_[i] && lean_storage_of(params_[i]) == storage_[i]) continue;
    check_usable(i);
    follow_write(i);
  }
}

void LeanMasters::follow_write(size_t i) {
  c10::NoGradGuard no_grad;
  if (aux_[i].defined()) {
    // The weight as written is the value now, unless it is bit for bit the weight a load paired the aux with
    // (the model loaded after the optimizer): there the aux still completes it.
    if (loaded_[i].defined()) {
      aux_[i].masked_fill_(loaded_[i].view(at::kShort).ne(params_[i].view(at::kShort)), 0);
    } else {
      aux_[i].zero_();
    }
  }
  loaded_[i] = at::Tensor();
  mark_synced(i);
}

void LeanMasters::mark_synced(size_t i) {
  version_[i] = params_[i]._version();
  storage_[i] = lean_storage_of(params_[i]);
}

void LeanMasters::save(torch::serialize::OutputArchive& archive) const {
  const std::shared_ptr<Shards> shards = shards_.lock();
  const std::vector<at::Tensor>* whole = aux_sharded_ && shards ? shards->consolidated_aux() : &aux_;  // null: a rank's shard
  // ZeRO stage 3: the weights are the shards' too (a rank's archive holds its slices, the sharding writes them).
  const std::vector<at::Tensor>* weights = shards && shards->holds_weights() ? shards->consolidated_weights() : &params_;
  archive.write("lean/format", c10::IValue(static_cast<int64_t>(format_)));
  archive.write("lean/seed", c10::IValue(static_cast<int64_t>(seed_)));  // the bits of the uint64
  archive.write("lean/counter", c10::IValue(static_cast<int64_t>(counter_.value())));
  archive.write("lean/count", c10::IValue(static_cast<int64_t>(params_.size())));
  for (size_t i = 0; i < params_.size(); ++i) {
    if (weights) archive.write("lean/param/" + std::to_string(i), (*weights)[i].detach());
    if (whole && (*whole)[i].defined()) archive.write("lean/aux/" + std::to_string(i), (*whole)[i]);
  }
}

std::function<void()> LeanMasters::load(torch::serialize::InputArchive& archive, const char* where) {
  auto read_int = [&](const std::string& key) -> std::optional<int64_t> {
    c10::IValue v;
    if (!archive.try_read(key, v) || !v.isInt()) return std::nullopt;
    return v.toInt();
  };
  const auto seed = read_int("lean/seed"), counter = read_int("lean/counter"), count = read_int("lean/count");
  TORCH_CHECK(seed && counter && count, where, ": the checkpoint's lean master state is incomplete; it is corrupt.");
  TORCH_CHECK(*count == static_cast<int64_t>(params_.size()), where, ": the checkpoint has ", *count, " bfloat16 "
              "parameters with lean masters, this optimizer has ", params_.size(), ". Resume with the same model, "
              "opt level and param groups.");
  std::vector<at::Tensor> weights(params_.size()), aux(params_.size());
  // A ZeRO rank's own archive holds no whole aux (its slices are the sharding's), nor at stage 3 whole weights; any
  // other holds each.
  const std::shared_ptr<Shards> owner = shards_.lock();
  const bool weights_sharded = owner && owner->holds_weights();
  const bool shard_archive = Sharding::is_shard_amp_archive(archive);
  const bool sliced = aux_sharded_ && shard_archive;
  for (size_t i = 0; i < params_.size() && !(weights_sharded && shard_archive); ++i) {
    archive.read("lean/param/" + std::to_string(i), weights[i]);
    TORCH_CHECK(weights[i].sizes() == params_[i].sizes() && weights[i].scalar_type() == at::kBFloat16, where,
                ": lean master ", i, " ('", names_[i], "') is ", dtype_name(weights[i].scalar_type()), " of shape ",
                weights[i].sizes(), " in the checkpoint, torch.bfloat16 of shape ", params_[i].sizes(), " here.");
    const at::Tensor like = aux_sharded_ ? fresh_aux(params_[i]) : aux_[i];
    if (!like.defined()) continue;
    const std::string key = "lean/aux/" + std::to_string(i);
    if (sliced) continue;
    archive.read(key, aux[i]);
    TORCH_CHECK(aux[i].sizes() == like.sizes() && aux[i].scalar_type() == like.scalar_type(), where,
                ": the saved low bits / compensation of '", names_[i], "' do not match the parameter.");
  }
  return [this, weights, aux, seed = static_cast<uint64_t>(*seed), counter = static_cast<uint64_t>(*counter)] {
    c10::NoGradGuard no_grad;
    const std::shared_ptr<Shards> shards = shards_.lock();
    for (size_t i = 0; i < params_.size(); ++i) {
      if (!weights[i].defined()) continue;  // a stage-3 rank's archive: its sharding restores its slices
      if (shards && shards->holds_weights()) shards->keep_weight(i, weights[i].to(params_[i].device()));
      else params_[i].copy_(weights[i]);
      if (aux_[i].defined()) {
        aux_[i].copy_(aux[i]);
        loaded_[i] = weights[i].to(params_[i].device());  // until the weight's next write (refresh_changed)
      }
      mark_synced(i);
      if (shards && aux[i].defined()) shards->keep_aux(i, aux[i].to(params_[i].device()), weights[i].to(params_[i].device()));
    }
    seed_ = seed;
    counter_.set(counter);
  };
}

void register_lean(const std::shared_ptr<LeanMasters>& table, const LeanMasters* replaced) {
  std::lock_guard<std::mutex> lock(lean_registry_mutex);
  for (auto it = lean_registry.begin(); it != lean_registry.end();) {
    const auto owner = it->second.table.lock();
    it = (!owner || owner == table || owner.get() == replaced) ? lean_registry.erase(it) : std::next(it);
  }
  for (size_t i = 0; i < table->size(); ++i) {
    TORCH_CHECK(!lean_registry.count(table->param(i).unsafeGetTensorImpl()), "amp::initialize: parameter '",
                table->name(i), "' is already stepped by another amp::Optimizer with lean master weights; two "
                "optimizers would update one weight's fp32 value twice. Put each parameter in one optimizer.");
  }
  for (size_t i = 0; i < table->size(); ++i) lean_registry.emplace(table->param(i).unsafeGetTensorImpl(), LeanEntry{table, i});
}

std::optional<std::pair<std::shared_ptr<LeanMasters>, size_t>> find_lean(const at::Tensor& param) {
  std::lock_guard<std::mutex> lock(lean_registry_mutex);
  const auto it = lean_registry.find(param.unsafeGetTensorImpl());
  if (it == lean_registry.end()) return std::nullopt;
  auto table = it->second.table.lock();
  if (!table) return std::nullopt;
  return std::make_pair(std::move(table), it->second.index);
}

uint64_t seed_from_default_generator() {
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  return at::check_generator<at::CPUGeneratorImpl>(generator)->random64();
}

}  // namespace amp::detail
