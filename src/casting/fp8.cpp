// FP8 GEMMs for Linear layers (amp/fp8.h).
//
// NOTE [FP8 through the policy's dispatch key]
// A LibTorch Linear's forward can't be replaced (no hooks, NOTE [Why no forward hooks]), but every GEMM it runs
// reads its weight, and an interception handler (NOTE [One interception key] in src/interception/interception.h) sees each op
// of the model's forward with its arguments. LibTorch's F::linear computes addmm(bias, x, w.t()) on 2-d
// inputs and matmul(x, w.t()) (then `+= bias`) on others; TorchScript and torch::linear call aten::linear. So
// an op among those three whose weight argument is an FP8 layer's weight (or its transpose, a view of it) is
// replaced by Fp8Linear, an autograd function whose forward and backward run the three GEMMs through
// at::_scaled_mm. Everything else the layer does (`+= bias`, reading the weight elsewhere) runs as before.
//
// NOTE [FP8 scales never hide an overflow]
// Quantizing clamps to the format's range, which would turn an inf into a finite 448 and let an overflowing
// step through with wrong numbers. Each scale is multiplied by (amax * 0 + 1): exactly 1 for a finite amax, NaN
// for an inf/NaN one, so a non-finite tensor quantizes to NaN, the GEMM's output is NaN and the loss scaler
// skips the step, as it would without FP8. No host sync is needed for it. The slice, tile and block recipes need
// no factor: a non-finite amax gives a scale of 0 (0 * inf = NaN) or NaN, and MXFP8's E8M0 scale of an inf block
// dequantizes its values to inf.
//
// NOTE [FP8 auto fallback]
// Fp8Options::auto_fallback counts, per layer, the optimizer steps in a row (taken or skipped) on which one of its
// amaxes was inf/NaN, the layers the overflow report names; at kFallbackSteps the layer runs in the level's dtype
// from the next forward, for good. In a row, not in total: a dynamic loss scale overflows by design every
// growth_interval steps, and those isolated overflows must never add up to a fallback; a layer named 8 times running
// has seen its loss scale halved 8 times without effect. Under amp::parallel the flags are reduced (max) first, so
// every replica moves the same layers. The decisions and the counts are part of both checkpoint formats.

#include "casting/fp8.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/modules/linear.h>
#include <torch/version.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <mutex>
#include <stdexcept>

#include "core/host_sync.h"
#include "casting/fp8_recipes.h"
#include "options/exception_message.h"
#include "interception/interception.h"
#include "casting/jit_mirror.h"
#include "casting/precision_policy.h"

namespace amp {

namespace detail {

bool fp8_supported_by_build() { return AMP_HAS_FP8; }

namespace {

constexpr double kE4M3Max = 448.0;
constexpr double kE5M2Max = 57344.0;
constexpr double kAmaxFloor = 1e-12;  // torchao's EPS: an all-zero tensor gets a large finite scale
const std::string kRootName = "(model)";  // a model that is itself a Linear

// The weight of a Linear layer, LibTorch's or TorchScript's; undefined for any other module.
at::Tensor linear_weight(const torch::nn::Module& m) {
  const bool linear = dynamic_cast<const torch::nn::LinearImpl*>(&m) != nullptr ||
                      (dynamic_cast<const JitModuleNode*>(&m) && static_cast<const JitModuleNode&>(m).class_name() == "Linear");
  if (!linear) return {};
  const auto parameters = m.named_parameters(/*recurse=*/false);  // held: find() points into it
  const at::Tensor* w = parameters.find("weight");
  return w && w->dim() == 2 ? *w : at::Tensor();
}

#if AMP_HAS_FP8

// The runtime a GEMM's backward needs: the layer's state, held weakly (a graph may outlive the model).
struct Fp8Runtime : torch::CustomClassHolder {
  std::weak_ptr<Fp8State> state;
  int64_t layer;
  Fp8Runtime(std::weak_ptr<Fp8State> s, int64_t l) : state(std::move(s)), layer(l) {}
};

at::Tensor quantize(const at::Tensor& t, const at::Tensor& scale, c10::ScalarType dtype, double max) {
  return t.to(at::kFloat).mul(scale).clamp(-max, max).to(dtype).contiguous();
}

at::Tensor amax_of(const at::Tensor& t) { return t.abs().amax().to(at::kFloat); }

// `b` of _scaled_mm must be column-major on CUDA: the transpose of a contiguous tensor.
at::Tensor column_major(const at::Tensor& t) { return t.t().contiguous().t(); }

// Pads dimension `dim` (the inner dimension of the grad-weight GEMM: the batch's rows) of an FP8 tensor to a
// multiple of 16, as _scaled_mm needs on CUDA; zero rows add nothing to the products. Done on the bytes (0x00 is
// +0 in e4m3 and e5m2), which every backend can fill and copy.
at::Tensor pad16(const at::Tensor& t, int64_t dim) {
  const int64_t n = t.size(dim), padded = (n + 15) / 16 * 16;
  if (n == padded) return t;
  std::vector<int64_t> sizes = t.sizes().vec();
  sizes[dim] = padded;
  at::Tensor out = at::zeros(sizes, t.options().dtype(at::kByte));
  out.narrow(dim, 0, n).copy_(t.view(at::kByte));
  return out.view(t.scalar_type());
}

class Fp8Linear : public torch::autograd::Function<Fp8Linear> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const at::Tensor& bias, c10::intrusive_ptr<Fp8Runtime> runtime, c10::ScalarType out_dtype,
                            bool record) {
    const std::shared_ptr<Fp8State> state = runtime->state.lock();
    const int64_t base = runtime->layer * 3;
    const at::Tensor x = input.reshape({-1, weight.size(1)});
    const at::Tensor x_amax = amax_of(x), w_amax = amax_of(weight);
    const at::Tensor x_scale = state->scale_for(base + Fp8State::kInput, x_amax);
    const at::Tensor w_scale = state->scale_for(base + Fp8State::kWeight, w_amax);
    const at::Tensor x8 = quantize(x, x_scale, state->fp8_dtype(Fp8State::kInput), state->fp8_max(Fp8State::kInput));
    const at::Tensor w8 = quantize(weight, w_scale, state->fp8_dtype(Fp8State::kWeight), state->fp8_max(Fp8State::kWeight));
    std::optional<at::Tensor> b;
    const bool has_bias = bias.numel() > 0;  // no bias: an empty tensor (see run())
    if (has_bias) b = bias.to(out_dtype);
    at::Tensor y = at::_scaled_mm(x8, w8.t(), x_scale.reciprocal(), w_scale.reciprocal(), b, std::nullopt, out_dtype);
    if (record) {
      state->record_amax(base + Fp8State::kInput, x_amax);
      state->record_amax(base + Fp8State::kWeight, w_amax);
    }
    ctx->save_for_backward({x8, w8, x_scale, w_scale});
    ctx->saved_data["runtime"] = c10::IValue::make_capsule(runtime);
    ctx->saved_data["has_bias"] = has_bias;
    ctx->saved_data["bias_dtype"] = static_cast<int64_t>(bias.scalar_type());
    ctx->saved_data["input_dtype"] = static_cast<int64_t>(input.scalar_type());
    ctx->saved_data["weight_dtype"] = static_cast<int64_t>(weight.scalar_type());
    ctx->saved_data["input_shape"] = input.sizes().vec();
    return y;  // [M, out]: run() views it as the input's shape outside, where in-place ops on it may follow
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x8 = saved[0], &w8 = saved[1], &x_scale = saved[2], &w_scale = saved[3];
    const auto runtime = c10::static_intrusive_pointer_cast<Fp8Runtime>(ctx->saved_data["runtime"].toCapsule());
    const std::shared_ptr<Fp8State> state = runtime->state.lock();
    TORCH_CHECK(state, "amp fp8: the backward of an FP8 Linear ran after its model was destroyed.");
    const int64_t slot = runtime->layer * 3 + Fp8State::kGrad;
    const at::Tensor& g = grads[0];
    const at::Tensor g_amax = amax_of(g);
    const at::Tensor g_scale = state->scale_for(slot, g_amax);
    state->record_amax(slot, g_amax);
    const at::Tensor g8 = quantize(g, g_scale, state->fp8_dtype(Fp8State::kGrad), state->fp8_max(Fp8State::kGrad));
    const at::Tensor g_inv = g_scale.reciprocal();
    const auto input_dtype = static_cast<c10::ScalarType>(ctx->saved_data["input_dtype"].toInt());
    const auto weight_dtype = static_cast<c10::ScalarType>(ctx->saved_data["weight_dtype"].toInt());
    // grad input [M, in] = g [M, out] @ w [out, in]
    at::Tensor grad_input = at::_scaled_mm(g8, column_major(w8), g_inv, w_scale.reciprocal(), std::nullopt,
                                           std::nullopt, input_dtype);
    // grad weight [out, in] = g^T [out, M] @ x [M, in]
    const at::Tensor grad_weight = at::_scaled_mm(pad16(g8.t().contiguous(), 1), column_major(pad16(x8, 0)), g_inv,
                                                  x_scale.reciprocal(), std::nullopt, std::nullopt, weight_dtype);
    at::Tensor grad_bias;
    if (ctx->saved_data["has_bias"].toBool()) {
      grad_bias = g.sum(0).to(static_cast<c10::ScalarType>(ctx->saved_data["bias_dtype"].toInt()));
    }
    return {grad_input.view(ctx->saved_data["input_shape"].toIntVector()), grad_weight, grad_bias, at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

at::Tensor tensor_or_undefined(const c10::IValue& v) { return v.isTensor() ? v.toTensor() : at::Tensor(); }

// `t` is weight.t(): a view of an FP8 weight with the transposed sizes and strides.
const c10::TensorImpl* transposed_weight(const at::Tensor& t) {
  if (!t.defined() || !t.is_view() || t.dim() != 2) return nullptr;
  const at::TensorBase& base = t._base();
  if (base.dim() != 2 || !base.is_contiguous() || t.sizes() != at::IntArrayRef{base.size(1), base.size(0)} ||
      t.strides() != at::IntArrayRef{1, base.size(1)} || t.storage_offset() != base.storage_offset()) {
    return nullptr;
  }
  return base.unsafeGetTensorImpl();
}

#endif  // AMP_HAS_FP8

// Runs one small FP8 GEMM on `device`, so that a device without FP8 kernels (CUDA before SM 8.9) is refused at
// initialize, not in the first forward.
void probe(const c10::Device& device, bool rowwise) {
#if AMP_HAS_FP8
  try {
    const auto options = at::TensorOptions().device(device);
    const at::Tensor a = at::ones({16, 16}, options.dtype(at::kFloat)).to(at::kFloat8_e4m3fn);
    const at::Tensor one = at::ones({}, options.dtype(at::kFloat));
    const at::Tensor out = at::_scaled_mm(a, a.t(), one, one, std::nullopt, std::nullopt, at::kBFloat16);
    TORCH_CHECK(out.to(at::kFloat).sum().item<double>() == 16.0 * 16 * 16, "wrong result");
    if (rowwise) {  // [M, 1] and [1, N] scales: CUDA before SM 9.0 has no kernel for them
      const at::Tensor ones = at::ones({16, 1}, options.dtype(at::kFloat));
      const at::Tensor row = at::_scaled_mm(a, a.t(), ones, ones.t(), std::nullopt, std::nullopt, at::kBFloat16);
      TORCH_CHECK(row.to(at::kFloat).sum().item<double>() == 16.0 * 16 * 16, "wrong rowwise result");
    }
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "amp::initialize: fp8 needs at::_scaled_mm", rowwise ? " with rowwise scales" : "", " on ",
                device, ", which this LibTorch build (",
                TORCH_VERSION, ") can't run there: ", message_of(e), "\nFP8 GEMMs need a CUDA GPU of compute "
                "capability 8.9 or newer (Ada, Hopper, Blackwell) or the CPU (emulated, slow). Remove fp8 on this "
                "device.");
  }
#else
  (void)rowwise;
  TORCH_CHECK(false, "amp::initialize: fp8 needs LibTorch 2.1 or newer (this build is ", TORCH_VERSION, ") on ", device);
#endif
}

}  // namespace

namespace {

// Runs an FP8 layer's GEMMs whole, in place of the op that reached them (first in the chain: kFp8GemmOrder).
class Fp8GemmHandler final : public InterceptionHandler {
 public:
  void handle(InterceptedOp& call, const InterceptNext& next) override {
    PrecisionPolicy* policy = active_precision_policy();
    if (policy && policy->fp8() && policy->fp8()->run(call.op, call.stack)) return;
    next(call);
  }
};

void register_fp8_handler() {
  static std::once_flag once;
  std::call_once(once, [] {
    register_interception_fallback();
    register_interception_handler(kFp8GemmOrder, std::make_shared<Fp8GemmHandler>());
  });
}

}  // namespace

Fp8State::Fp8State(const Properties& p, torch::nn::Module& root, const std::function<bool(const at::Tensor&)>& in_island)
    : options_(*p.fp8), out_dtype_(p.low_precision_dtype), verbosity_(p.verbosity) {
  const int64_t block = fp8_block_of(options_.scaling());
  for (const auto& item : root.named_modules("", /*include_self=*/true)) {
    const at::Tensor w = linear_weight(*item.value());
    if (!w.defined() || in_island(w)) continue;
    const std::string name = item.key().empty() ? kRootName : item.key();
    const std::string shape = " [" + std::to_string(w.size(0)) + " x " + std::to_string(w.size(1)) + "]";
    if (w.size(0) % block != 0 || w.size(1) % block != 0) {
      skipped_.push_back(name + shape + " (not multiples of " + std::to_string(block) + ")");
      continue;
    }
    if (w.numel() < options_.min_gemm_size()) {
      skipped_.push_back(name + shape + " (below min_gemm_size " + std::to_string(options_.min_gemm_size()) + ")");
      continue;
    }
    by_weight_.emplace(w.unsafeGetTensorImpl(), static_cast<int64_t>(layers_.size()));
    layers_.push_back({name, w});
  }
  if (layers_.empty()) {
    std::string skipped;
    for (const auto& l : skipped_) skipped += (skipped.empty() ? "" : ", ") + l;
    TORCH_CHECK(false, "amp::initialize: fp8 is on, but the model has no Linear layer FP8 can run: ",
                skipped.empty() ? "it has no torch::nn::Linear outside the fp32 islands"
                                : "each is left out: " + skipped + " (fp8_scaling " + to_string(options_.scaling()) +
                                      " needs dimensions that are multiples of " + std::to_string(block) + ")",
                ". Remove fp8, lower min_gemm_size, or give the layers dimensions that are multiples of ", block, ".");
  }
  const c10::Device device = layers_[0].weight.device();
  emulated_ = fp8_recipe_emulated(options_.scaling(), device);
  if (!emulated_) {
    const auto s = options_.scaling();
    probe(device, s == Fp8Options::Scaling::kRowwise || s == Fp8Options::Scaling::kRowwiseGwHp);
  }
  register_fp8_handler();
  const int64_t slots = static_cast<int64_t>(layers_.size()) * 3;
  const auto options = at::TensorOptions().dtype(at::kFloat).device(layers_.empty() ? at::kCPU : layers_[0].weight.device());
  scales_ = at::ones({slots}, options);
  used_ = at::ones({slots}, options);
  history_amax_ = at::zeros({slots}, options);
  history_ = at::zeros({slots, options_.scaling() == Fp8Options::Scaling::kDelayed ? options_.amax_history_len() : 0}, options);
  std::vector<float> maxima;
  for (int64_t i = 0; i < slots; ++i) maxima.push_back(static_cast<float>(fp8_max(static_cast<Kind>(i % 3))));
  maxima_ = at::tensor(maxima, options);
  pending_.assign(static_cast<size_t>(slots), at::Tensor());
  overflow_steps_.assign(layers_.size(), 0);
}

c10::ScalarType Fp8State::fp8_dtype(Kind kind) const {
#if AMP_HAS_FP8
  return kind == kGrad && options_.format() == Fp8Options::Format::kHybrid ? at::kFloat8_e5m2 : at::kFloat8_e4m3fn;
#else
  (void)kind;
  TORCH_CHECK(false, "amp fp8: this LibTorch build (", TORCH_VERSION, ") has no FP8 dtypes.");
#endif
}

double Fp8State::fp8_max(Kind kind) const {
  return kind == kGrad && options_.format() == Fp8Options::Format::kHybrid ? kE5M2Max : kE4M3Max;
}

at::Tensor Fp8State::rounded(const at::Tensor& scale) const {
  return options_.power_of_2_scales() ? at::exp2(at::floor(at::log2(scale))) : scale;
}

at::Tensor Fp8State::scale_from(const at::Tensor& amax, double max) const {
  return rounded(at::full({}, max, amax.options()).div(amax.clamp_min(kAmaxFloor)).div(std::ldexp(1.0, options_.margin())));
}

at::Tensor Fp8State::scale_for(int64_t slot, const at::Tensor& amax) {
  const double max = fp8_max(static_cast<Kind>(slot % 3));
  at::Tensor scale = scale_from(amax, max);
  if (options_.scaling() == Fp8Options::Scaling::kDelayed) {
    // The history's scale once it has an amax; until then (the first step) this tensor's own.
    scale = at::where(history_amax_.select(0, slot) > 0, scales_.select(0, slot), scale);
  }
  scale = scale.mul(amax.mul(0).add(1));  // NOTE [FP8 scales never hide an overflow]
  if (options_.scaling() == Fp8Options::Scaling::kDynamic) {  // report() shows kDelayed's history scales instead
    std::lock_guard<std::mutex> lock(mutex_);
    used_.select(0, slot).copy_(scale);
  }
  return scale;
}

void Fp8State::record_amax(int64_t slot, const at::Tensor& amax) {
  std::lock_guard<std::mutex> lock(mutex_);
  at::Tensor& p = pending_[static_cast<size_t>(slot)];
  p = p.defined() ? at::maximum(p, amax) : amax.clone();  // several forwards per step: their largest
}

void Fp8State::note_scale(int64_t slot, const at::Tensor& scale) {
  std::lock_guard<std::mutex> lock(mutex_);
  used_.select(0, slot).copy_(scale);
}

void Fp8State::set_amax_reducer(std::function<void(at::Tensor&)> reducer) { reducer_ = std::move(reducer); }

bool Fp8State::reduces_over_ranks() const {
  return options_.scaling() == Fp8Options::Scaling::kDelayed || options_.auto_fallback();
}

std::vector<std::string> Fp8State::fallbacks() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return fallbacks_;
}

// NOTE [FP8 auto fallback]
std::vector<std::string> Fp8State::count_overflows(const std::vector<at::Tensor>& pending) {
  const size_t n = layers_.size();
  std::vector<at::Tensor> flags;  // per layer: 1 if an amax of this step is non-finite; last: any FP8 GEMM ran
  at::Tensor ran = at::zeros({}, scales_.options());
  const at::Tensor zero = at::zeros({}, scales_.options());
  for (size_t i = 0; i < n; ++i) {
    at::Tensor bad = zero;
    for (size_t k = 0; k < 3; ++k) {
      const at::Tensor& p = pending[i * 3 + k];
      if (!p.defined()) continue;
      bad = at::maximum(bad, at::logical_not(at::isfinite(p)).to(at::kFloat));
      ran = at::ones({}, scales_.options());
    }
    flags.push_back(bad);
  }
  flags.push_back(ran);
  at::Tensor all = at::stack(flags);
  if (reducer_) reducer_(all);  // every replica counts the same flags
  count_host_sync();
  const at::Tensor host = all.to(at::kCPU);
  const float* f = host.data_ptr<float>();
  // No FP8 GEMM on any rank since the last step (a second optimizer's step over the same model): not a step here.
  if (f[n] == 0) return {};
  std::vector<std::string> moved;
  for (size_t i = 0; i < n; ++i) {
    overflow_steps_[i] = f[i] > 0 ? overflow_steps_[i] + 1 : 0;
    if (overflow_steps_[i] >= kFallbackSteps && leave_fp8(layers_[i].name)) {
      moved.push_back(layers_[i].name);
      std::lock_guard<std::mutex> lock(mutex_);
      fallbacks_.push_back(layers_[i].name);
    }
  }
  if (!moved.empty() && verbosity_ > 0) {
    std::cout << "amp: fp8 auto_fallback: ";
    for (size_t i = 0; i < moved.size(); ++i) std::cout << (i ? ", " : "") << "'" << moved[i] << "'";
    std::cout << (moved.size() == 1 ? " was" : " were") << " named by the FP8 overflow report on " << kFallbackSteps
              << " steps in a row; " << (moved.size() == 1 ? "it runs" : "they run") << " in "
              << c10::toString(out_dtype_) << " from now on (fp8_fallbacks() lists it, checkpoints keep it)."
              << std::endl;
  }
  return moved;
}

std::vector<std::string> Fp8State::end_step(bool taken) {
  std::vector<at::Tensor> pending;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    pending.swap(pending_);
    pending_.assign(pending.size(), at::Tensor());
  }
  std::vector<std::string> moved;
  if (options_.auto_fallback()) moved = count_overflows(pending);
  const bool any = std::any_of(pending.begin(), pending.end(), [](const at::Tensor& p) { return p.defined(); });
  // No FP8 GEMM since the last step (a second optimizer's step over the same model): nothing to commit.
  if (!taken || !any || options_.scaling() != Fp8Options::Scaling::kDelayed) return moved;
  at::Tensor zero = at::zeros({}, scales_.options());
  for (auto& p : pending) {
    if (!p.defined()) p = zero;
  }
  at::Tensor amax = at::stack(pending);
  amax = at::where(at::isfinite(amax), amax, zero);  // a taken step's amaxes are finite; never let one in
  if (reducer_) reducer_(amax);                      // every rank commits the same history
  history_.select(1, position_).copy_(amax);
  position_ = (position_ + 1) % history_.size(1);
  const at::Tensor h = options_.amax_compute_algo() == "max" ? history_.amax(1) : amax;
  const at::Tensor next = rounded(maxima_.div(h.clamp_min(kAmaxFloor)).div(std::ldexp(1.0, options_.margin())));
  scales_.copy_(at::where(h > 0, next, scales_));
  history_amax_.copy_(h);
  return moved;
}

std::vector<std::string> Fp8State::non_finite_layers() const {
  std::vector<std::string> out;
  std::lock_guard<std::mutex> lock(mutex_);
  for (size_t i = 0; i < layers_.size(); ++i) {
    for (size_t k = 0; k < 3; ++k) {
      const at::Tensor& p = pending_[i * 3 + k];
      if (!p.defined()) continue;
      count_host_sync();
      if (!at::isfinite(p).item<bool>()) {
        out.push_back(layers_[i].name);
        break;
      }
    }
  }
  return out;
}

std::vector<Fp8LayerState> Fp8State::report() const {
  std::lock_guard<std::mutex> lock(mutex_);
  const at::Tensor s = (options_.scaling() == Fp8Options::Scaling::kDelayed ? scales_ : used_).to(at::kCPU).to(at::kDouble);
  const double* v = s.data_ptr<double>();
  std::vector<Fp8LayerState> out;
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (!by_weight_.count(layers_[i].weight.unsafeGetTensorImpl())) continue;  // left FP8 (auto_fallback, auto_fp32)
    out.push_back({layers_[i].name, v[i * 3], v[i * 3 + 1], v[i * 3 + 2], emulated_});
  }
  return out;
}

void describe_fp8_layers(const Fp8State& state, std::ostream& out) {
  const Fp8Options& o = state.options();
  out << "FP8 layers (";
  if (is_per_tensor(o.scaling())) out << to_string(o.format()) << ", ";
  out << to_string(o.scaling()) << " scaling" << (o.power_of_2_scales() ? ", power-of-two scales" : "")
      << (state.emulated() ? ", emulated on this device" : "") << (o.auto_fallback() ? ", auto_fallback" : "") << "): ";
  for (size_t i = 0; i < state.layers().size(); ++i) out << (i ? ", " : "") << state.layers()[i].name;
  out << "\n";
  if (!state.skipped().empty()) {
    out << "Linear layers left in bfloat16: ";
    for (size_t i = 0; i < state.skipped().size(); ++i) out << (i ? ", " : "") << state.skipped()[i];
    out << "\n";
  }
  out << std::flush;
}

std::vector<std::string> Fp8State::names() const {
  std::vector<std::string> out;
  for (const auto& l : layers_) out.push_back(l.name);
  return out;
}

std::string Fp8State::layer_names() const {
  std::string out;
  for (const auto& l : layers_) out += (out.empty() ? "" : ", ") + l.name;
  return out.empty() ? "(none)" : out;
}

std::vector<std::pair<std::string, at::Tensor>> Fp8State::state_tensors() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return {{"scales", scales_.clone()},
          {"history", history_.clone()},
          {"history_amax", history_amax_.clone()},
          {"position", at::tensor(position_, at::kLong)},
          {"overflow_steps", at::tensor(overflow_steps_, at::kLong)}};
}

std::function<void()> Fp8State::restore_state(const std::vector<std::pair<std::string, at::Tensor>>& state,
                                              const std::vector<std::string>& saved_names,
                                              const std::vector<std::string>& fallbacks, const std::string& where) {
  const std::vector<std::string>& names = saved_names;
  std::string saved;
  for (const auto& name : names) saved += (saved.empty() ? "" : ", ") + name;
  TORCH_CHECK(names == this->names(), where, " holds the FP8 state of the layers ",
              saved.empty() ? "(none)" : saved, ", but this model's FP8 layers are ", layer_names(),
              ". Resume with the model (and keep_fp32) the checkpoint was saved with.");
  auto find = [&](const std::string& name) -> at::Tensor {
    for (const auto& [key, value] : state) {
      if (key == name) return value;
    }
    TORCH_CHECK(false, where, " has no FP8 '", name, "' entry. Save checkpoints with this version of amp.");
  };
  const at::Tensor scales = find("scales"), history = find("history"), amax = find("history_amax");
  const at::Tensor position = find("position");
  // auto_fallback's counts (absent before it existed: none yet) and decisions, checked against this model's layers.
  at::Tensor overflow_steps = at::zeros({static_cast<int64_t>(layers_.size())}, at::kLong);
  for (const auto& [key, value] : state) {
    if (key == "overflow_steps") overflow_steps = value;
  }
  TORCH_CHECK(overflow_steps.dim() == 1 && overflow_steps.size(0) == static_cast<int64_t>(layers_.size()), where,
              " holds FP8 overflow counts for ", overflow_steps.numel(), " layers, but the model has ", layers_.size(),
              ": the checkpoint is damaged.");
  for (const auto& name : fallbacks) {
    TORCH_CHECK(std::find(names.begin(), names.end(), name) != names.end(), where, " says auto_fallback moved FP8 "
                "layer '", name, "', which is not among its FP8 layers (", saved.empty() ? "(none)" : saved,
                "): the checkpoint is damaged.");
  }
  TORCH_CHECK(history.dim() == 2 && history.size(1) == history_.size(1), where, " holds an FP8 amax history of ",
              history.dim() == 2 ? history.size(1) : -1, " steps, but this run's amax_history_len is ", history_.size(1),
              " (", to_string(options_.scaling()), " scaling). Resume with the fp8 recipe the checkpoint was saved "
              "with (fp8_amax_history_len, fp8_scaling).");
  TORCH_CHECK(scales.sizes() == scales_.sizes() && amax.sizes() == history_amax_.sizes() &&
                  history.size(0) == history_.size(0) && position.numel() == 1,
              where, " holds FP8 state of the wrong shape (scales ", scales.sizes(), ", expected ", scales_.sizes(),
              "): the checkpoint is damaged.");
  const int64_t pos = position.item<int64_t>();
  TORCH_CHECK(pos >= 0 && (history_.size(1) == 0 ? pos == 0 : pos < history_.size(1)), where,
              " holds FP8 history position ", pos, ", outside [0, ", history_.size(1), "): the checkpoint is damaged.");
  const at::Tensor counts = overflow_steps.to(at::kCPU).to(at::kLong).contiguous();
  std::vector<int64_t> steps(counts.data_ptr<int64_t>(), counts.data_ptr<int64_t>() + counts.numel());
  return [self = shared_from_this(), scales, history, amax, pos, steps, fallbacks] {
    for (const auto& name : fallbacks) self->leave_fp8(name);
    std::lock_guard<std::mutex> lock(self->mutex_);
    c10::NoGradGuard no_grad;
    self->scales_.copy_(scales);
    self->history_.copy_(history);
    self->history_amax_.copy_(amax);
    self->position_ = pos;
    self->overflow_steps_ = steps;
    self->fallbacks_ = fallbacks;
    for (auto& p : self->pending_) p = at::Tensor();
  };
}

void Fp8State::save(torch::serialize::OutputArchive& archive, const std::string& prefix) const {
  for (const auto& [name, value] : state_tensors()) archive.write(prefix + name, value);
  archive.write(prefix + "layers", c10::IValue(c10::List<std::string>(names())));
  archive.write(prefix + "fallbacks", c10::IValue(c10::List<std::string>(fallbacks())));
}

std::function<void()> Fp8State::load(torch::serialize::InputArchive& archive, const std::string& prefix,
                                     const std::string& where) {
  std::vector<std::pair<std::string, at::Tensor>> state;
  for (const char* name : {"scales", "history", "history_amax", "position", "overflow_steps"}) {
    at::Tensor t;
    if (archive.try_read(prefix + name, t)) state.emplace_back(name, t);
  }
  c10::IValue names_value;
  std::vector<std::string> names;
  if (archive.try_read(prefix + "layers", names_value) && names_value.isList()) {
    for (const auto& v : names_value.toListRef()) names.push_back(v.toStringRef());
  }
  std::vector<std::string> fallbacks;
  if (archive.try_read(prefix + "fallbacks", names_value) && names_value.isList()) {
    for (const auto& v : names_value.toListRef()) fallbacks.push_back(v.toStringRef());
  }
  return restore_state(state, names, fallbacks, where);
}

bool Fp8State::leave_fp8(const std::string& name) {
  bool left = false;
  for (const auto& layer : layers_) {
    const bool under = layer.name == name || layer.name.compare(0, name.size() + 1, name + ".") == 0;
    if (under && by_weight_.erase(layer.weight.unsafeGetTensorImpl()) > 0) left = true;
  }
  return left;
}

bool Fp8State::in_fp8(const std::string& name) const {
  for (const auto& layer : layers_) {
    if (layer.name == name) return by_weight_.count(layer.weight.unsafeGetTensorImpl()) > 0;
  }
  return false;
}

bool Fp8State::run(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
#if AMP_HAS_FP8
  const auto& schema = op.schema();
  if (!schema.overload_name().empty()) return false;
  const std::string& name = schema.name();
  const size_t n = schema.arguments().size();
  c10::IValue* args = stack->data() + (stack->size() - n);
  at::Tensor input, bias;
  const c10::TensorImpl* weight = nullptr;
  if (name == "aten::linear") {  // (input, weight, bias?)
    if (!args[1].isTensor()) return false;
    weight = args[1].toTensor().unsafeGetTensorImpl();
    input = args[0].toTensor();
    bias = tensor_or_undefined(args[2]);
  } else if (name == "aten::addmm") {  // (self = bias, mat1 = input, mat2 = weight.t(), beta, alpha)
    if (!args[3].isScalar() || !args[4].isScalar() || args[3].toScalar().toDouble() != 1.0 ||
        args[4].toScalar().toDouble() != 1.0) {
      return false;
    }
    weight = transposed_weight(args[2].toTensor());
    input = args[1].toTensor();
    bias = args[0].toTensor();
  } else if (name == "aten::matmul") {  // (self = input, other = weight.t())
    weight = transposed_weight(args[1].toTensor());
    input = args[0].toTensor();
  } else {
    return false;
  }
  const auto it = weight ? by_weight_.find(weight) : by_weight_.end();
  if (it == by_weight_.end()) return false;
  const at::Tensor& w = layers_[static_cast<size_t>(it->second)].weight;
  if (input.dim() < 1 || input.size(-1) != w.size(1) || (bias.defined() && (bias.dim() != 1 || bias.size(0) != w.size(0)))) {
    return false;  // not the layer's own GEMM: let ATen run it (and say what is wrong)
  }
  // Training forwards feed the amax history; evaluation (under NoGradGuard) reads it only.
  const bool training = at::GradMode::is_enabled() && (input.requires_grad() || w.requires_grad());
  if (!is_per_tensor(options_.scaling())) {  // torchao's Float8Linear: the GEMM without bias, the bias added after
    at::Tensor out = fp8_recipe_linear(input, w, shared_from_this(), it->second, training);
    if (bias.defined()) out = out + bias.to(out.scalar_type());
    torch::jit::drop(*stack, n);
    torch::jit::push(*stack, std::move(out));
    return true;
  }
  // A custom function's tensor arguments must be defined: no bias travels as an empty tensor.
  if (!bias.defined()) bias = at::empty({0}, w.options().requires_grad(false));
  at::Tensor out = Fp8Linear::apply(input, w, bias, c10::make_intrusive<Fp8Runtime>(weak_from_this(), it->second),
                                    out_dtype_, training);
  std::vector<int64_t> shape = input.sizes().vec();
  shape.back() = w.size(0);
  out = out.view(shape);
  torch::jit::drop(*stack, n);
  torch::jit::push(*stack, std::move(out));
  return true;
#else
  (void)op;
  (void)stack;
  return false;
#endif
}

}  // namespace detail
}  // namespace amp
