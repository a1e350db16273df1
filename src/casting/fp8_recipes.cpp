// The FP8 recipes that scale slices, tiles or blocks (amp/fp8.h's kRowwise, kRowwiseGwHp, kBlockwise, kMxfp8).
//
// NOTE [FP8 recipes as their anchors compute them]
// Each recipe is its reference implementation op for op, so that tests/python/fp8_recipes.py can run the
// reference itself on the same LibTorch and compare bits:
// - kRowwise / kRowwiseGwHp are torchao's Float8Linear (float8_linear.py's matmul_with_hp_or_float8_args and
//   float8_ops.py's addmm_float8_unwrapped): the scale is 448 / max(amax, 1e-12) divided in float64 (as
//   `reciprocal() * 448`, Python's scalar / tensor), rounded to fp32, then down to a power of two; the forward
//   GEMM passes the inverse scales to at::_scaled_mm (torchao's use_fast_accum output GEMM), the backward GEMMs
//   run with unit scales and multiply the bfloat16 result by a_inverse * b_inverse after. High-precision inputs
//   and weights are saved and quantized again in backward, along that GEMM's reduction dimension.
// - kBlockwise quantizes as torchao's torch_blockwise_scale_* references (DeepSeek-V3's 1x128 and 128x128 rules).
// - kMxfp8 is torchao's to_mx (FLOOR) and MXFP8Linear's emulated GEMMs (mxfp8_linear.py's mx_mm).
// Where a reference needs the rows of the grad-weight GEMM (its reduction dimension: the batch) to fill whole
// tiles or blocks, they are padded with zeros, which change no amax and add nothing to the products; torchao
// asserts there instead.
//
// The emulated GEMMs (blockwise and MXFP8 where the device has no kernel: everywhere today, see docs/fp8.md)
// dequantize to bfloat16 and call at::mm, so the values the GEMM sees are exactly the recipe's FP8 values.

#include "casting/fp8_recipes.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/version.h>

#include <cmath>

#include "casting/fp8.h"

namespace amp::detail {

bool is_per_tensor(Fp8Options::Scaling scaling) {
  return scaling == Fp8Options::Scaling::kDynamic || scaling == Fp8Options::Scaling::kDelayed;
}

int64_t fp8_block_of(Fp8Options::Scaling scaling) {
  if (scaling == Fp8Options::Scaling::kBlockwise) return 128;
  if (scaling == Fp8Options::Scaling::kMxfp8) return 32;
  return 16;
}

bool fp8_recipe_emulated(Fp8Options::Scaling scaling, const c10::Device& device) {
  // Blockwise needs cuBLAS's 1x128/128x128 kernels (SM90, CUDA 12.9) and MXFP8 SM100's; amp calls neither yet, so
  // both emulate on every device. Rowwise runs at::_scaled_mm everywhere it runs (the CPU included).
  (void)device;
  return scaling == Fp8Options::Scaling::kBlockwise || scaling == Fp8Options::Scaling::kMxfp8;
}

#if AMP_HAS_FP8

namespace {

constexpr double kRecipeE4M3Max = 448.0;
constexpr double kRecipeEps = 1e-12;  // torchao's EPS
constexpr int64_t kTile = 128, kMxBlock = 32;

// torchao's amax_to_scale: float64 division (Python's `max / amax` is amax.reciprocal() * max), fp32 result.
at::Tensor torchao_scale(const at::Tensor& amax, bool power_of_2) {
  at::Tensor scale = amax.to(at::kDouble).clamp_min(kRecipeEps).reciprocal().mul(kRecipeE4M3Max).to(at::kFloat);
  return power_of_2 ? at::exp2(at::floor(at::log2(scale))) : scale;
}

at::Tensor to_e4m3(const at::Tensor& scaled) {
  return scaled.clamp(-kRecipeE4M3Max, kRecipeE4M3Max).to(at::kFloat8_e4m3fn);
}

// torchao's is_row_major: a 2-d tensor whose rows are contiguous.
bool row_major(const at::Tensor& t) { return t.stride(0) > t.stride(1) && t.stride(1) == 1; }

// torchao's addmm_float8_unwrapped after preprocess_addmm, for rowwise (or one tensorwise) scales.
at::Tensor torchao_scaled_mm(at::Tensor a, at::Tensor a_scale, at::Tensor b, at::Tensor b_scale,
                             c10::ScalarType out_dtype, bool fast_accum) {
  if (!row_major(a)) a = a.contiguous();
  if (row_major(b)) b = b.t().contiguous().t();
  if (a_scale.dim() == 0 && b_scale.dim() == 2) a_scale = a_scale.repeat({a.size(0)}).reshape({-1, 1});
  if (a_scale.dim() == 2 && b_scale.dim() == 0) b_scale = b_scale.repeat({b.size(1)}).reshape({1, -1});
  at::Tensor a_inverse = a_scale.reciprocal(), b_inverse = b_scale.reciprocal();
  at::Tensor post_inverse;
  if (!fast_accum) {  // torchao: better accuracy when the scales are applied in fp32 after the GEMM
    post_inverse = a_inverse * b_inverse;
    a_inverse = at::ones({}, a_inverse.options());
    b_inverse = at::ones({}, a_inverse.options());
  }
  const bool via_bf16 = out_dtype == at::kHalf || out_dtype == at::kFloat;  // rowwise _scaled_mm writes bfloat16
  at::Tensor out = at::_scaled_mm(a, b, a_inverse, b_inverse, std::nullopt, std::nullopt,
                                  via_bf16 ? at::kBFloat16 : out_dtype, fast_accum);
  if (post_inverse.defined()) out.mul_(post_inverse);
  return via_bf16 ? out.to(out_dtype) : out;
}

// Pads the rows of a 2-d tensor with zeros to a multiple of `multiple` (the grad-weight GEMM's batch).
at::Tensor pad_rows(const at::Tensor& t, int64_t multiple) {
  const int64_t n = t.size(0), padded = (n + multiple - 1) / multiple * multiple;
  if (n == padded) return t;
  return at::cat({t, at::zeros({padded - n, t.size(1)}, t.options())}, 0);
}

// On CUDA, _scaled_mm wants the reduction dimension a multiple of 16; zero rows of both FP8 operands do nothing.
at::Tensor pad_fp8_rows(const at::Tensor& t, int64_t multiple) {
  if (t.size(0) % multiple == 0) return t;
  return pad_rows(t.view(at::kByte), multiple).view(t.scalar_type());  // 0x00 is +0 in e4m3
}

// The smallest scale of an operand's slices (what fp8_layers reports): that of its largest amax.
at::Tensor smallest_scale(const Fp8Quantized& q, bool mx) {
  if (!mx) return q.scales.amin();
  // MXFP8 quantizes by dividing by 2^(e - 127): its multiplying scale is 2^(127 - e).
  return at::exp2(q.scales.amax().to(at::kFloat).neg().add(127.0));
}

// Dequantizes a [R, C] operand whose scales are one per `rows` x `cols` block.
at::Tensor dequantize_by_blocks(const Fp8Quantized& q, int64_t rows, int64_t cols) {
  const int64_t r = q.values.size(0), c = q.values.size(1);
  const at::Tensor inverse = q.scales.reciprocal().view({r / rows, 1, c / cols, 1});  // torchao's `1.0 / s`
  return q.values.to(at::kFloat).view({r / rows, rows, c / cols, cols}).mul(inverse).view({r, c}).to(at::kBFloat16);
}

}  // namespace

Fp8Quantized quantize_rowwise(const at::Tensor& t, int64_t dim, bool power_of_2) {
  const at::Tensor amax = t.abs().amax({dim}, /*keepdim=*/true);
  const at::Tensor scale = torchao_scale(amax, power_of_2);
  return {to_e4m3(t.to(at::kFloat).mul(scale)), scale, amax.amax().to(at::kFloat)};
}

Fp8Quantized quantize_tensorwise(const at::Tensor& t, bool power_of_2) {
  const at::Tensor amax = t.abs().max();
  const at::Tensor scale = torchao_scale(amax, power_of_2);
  return {to_e4m3(t.to(at::kFloat).mul(scale)), scale, amax.to(at::kFloat)};
}

Fp8Quantized quantize_tiles(const at::Tensor& t, bool power_of_2) {
  const int64_t r = t.size(0), c = t.size(1);
  const at::Tensor tiles = t.contiguous().view({r, c / kTile, kTile});
  const at::Tensor amax = std::get<0>(tiles.abs().max(2));  // [R, C/128]
  const at::Tensor scale = torchao_scale(amax, power_of_2);
  const at::Tensor values = to_e4m3(tiles.to(at::kFloat).mul(scale.unsqueeze(2))).view({r, c});
  return {values, scale, amax.amax().to(at::kFloat)};
}

Fp8Quantized quantize_blocks(const at::Tensor& t, bool power_of_2) {
  const int64_t r = t.size(0), c = t.size(1);
  const at::Tensor blocks = t.contiguous().view({r / kTile, kTile, c / kTile, kTile});
  const at::Tensor amax = blocks.abs().amax({1, 3});  // [R/128, C/128]
  const at::Tensor scale = torchao_scale(amax, power_of_2);
  const at::Tensor values = to_e4m3(blocks.to(at::kFloat).mul(scale.view({r / kTile, 1, c / kTile, 1}))).view({r, c});
  return {values, scale, amax.amax().to(at::kFloat)};
}

Fp8Quantized quantize_mx(const at::Tensor& t) {
  const int64_t r = t.size(0), c = t.size(1);
  const at::Tensor blocks = t.contiguous().view({r, c / kMxBlock, kMxBlock});
  const at::Tensor max_abs = blocks.abs().amax({-1}).unsqueeze(-1).to(at::kFloat);
  // The exponent of the block's amax, less e4m3's largest (2^8 = 256), clamped to E8M0's range and biased.
  const at::Tensor exponent = max_abs.view(at::kInt).bitwise_right_shift(23).bitwise_and(0xFF).sub(127);
  at::Tensor biased = exponent.sub(8).clamp(-127, 128).add(127).to(at::kByte);
  biased = at::where(at::isnan(max_abs), at::scalar_tensor(255, biased.options()), biased);  // E8M0's NaN
  const at::Tensor scale = biased.to(at::kInt).bitwise_left_shift(23).view(at::kFloat).clamp_min(std::ldexp(1.0, -126));
  const at::Tensor values = to_e4m3(blocks.to(at::kFloat).div(scale)).view({r, c});
  return {values, biased.view({r, c / kMxBlock}), max_abs.amax()};
}

at::Tensor dequantize_tiles(const Fp8Quantized& q) { return dequantize_by_blocks(q, 1, kTile); }
at::Tensor dequantize_blocks(const Fp8Quantized& q) { return dequantize_by_blocks(q, kTile, kTile); }

at::Tensor dequantize_mx(const Fp8Quantized& q) {
  const int64_t r = q.values.size(0), c = q.values.size(1);
  // torchao's get_fp_scale: 2^(e - 127) in fp32 (NaN for 255), then to the target dtype.
  const at::Tensor offset = q.scales.to(at::kShort).sub(127);
  at::Tensor scale = at::pow(at::full_like(offset, 2.0, offset.options().dtype(at::kFloat)), offset);
  scale = at::where(q.scales != 255, scale, at::scalar_tensor(NAN, scale.options()));
  return q.values.to(at::kBFloat16).reshape({-1, kMxBlock}).mul(scale.reshape({-1, 1}).to(at::kBFloat16)).view({r, c});
}

namespace {

// A recipe layer's state as a backward needs it, held weakly (a graph may outlive the model).
struct Fp8RecipeRuntime : torch::CustomClassHolder {
  std::weak_ptr<Fp8State> state;
  int64_t layer;
  Fp8RecipeRuntime(std::weak_ptr<Fp8State> s, int64_t l) : state(std::move(s)), layer(l) {}
};

// Records an operand's amax (overflow report) and smallest scale (fp8_layers) in its slot.
void note(Fp8State& state, int64_t slot, const Fp8Quantized& q, bool mx, bool record) {
  state.note_scale(slot, smallest_scale(q, mx));
  if (record) state.record_amax(slot, q.amax);
}

class Fp8RecipeLinear : public torch::autograd::Function<Fp8RecipeLinear> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            c10::intrusive_ptr<Fp8RecipeRuntime> runtime, bool record) {
    const std::shared_ptr<Fp8State> state = runtime->state.lock();
    const int64_t base = runtime->layer * 3;
    const Fp8Options::Scaling scaling = state->options().scaling();
    const at::Tensor x = input.reshape({-1, weight.size(1)});
    at::Tensor y;
    if (scaling == Fp8Options::Scaling::kRowwise || scaling == Fp8Options::Scaling::kRowwiseGwHp) {
      const Fp8Quantized xq = quantize_rowwise(x, -1, true);
      const Fp8Quantized wq = quantize_rowwise(weight.t(), 0, true);
      note(*state, base + Fp8State::kInput, xq, false, record);
      note(*state, base + Fp8State::kWeight, wq, false, record);
      y = torchao_scaled_mm(xq.values, xq.scales, wq.values, wq.scales, input.scalar_type(), /*fast_accum=*/true);
    } else if (scaling == Fp8Options::Scaling::kBlockwise) {
      const bool p2 = state->options().power_of_2_scales();
      const Fp8Quantized xq = quantize_tiles(x, p2), wq = quantize_blocks(weight, p2);
      note(*state, base + Fp8State::kInput, xq, false, record);
      note(*state, base + Fp8State::kWeight, wq, false, record);
      y = at::mm(dequantize_tiles(xq), dequantize_blocks(wq).t());
    } else {  // kMxfp8
      const Fp8Quantized xq = quantize_mx(x), wq = quantize_mx(weight);
      note(*state, base + Fp8State::kInput, xq, true, record);
      note(*state, base + Fp8State::kWeight, wq, true, record);
      y = at::mm(dequantize_mx(xq), dequantize_mx(wq).t());
    }
    ctx->save_for_backward({input, weight});
    ctx->saved_data["runtime"] = c10::IValue::make_capsule(runtime);
    return y;  // [M, out]: fp8_recipe_linear views it as the input's shape outside, where in-place ops may follow
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &input = saved[0], &weight = saved[1];
    const auto runtime = c10::static_intrusive_pointer_cast<Fp8RecipeRuntime>(ctx->saved_data["runtime"].toCapsule());
    const std::shared_ptr<Fp8State> state = runtime->state.lock();
    TORCH_CHECK(state, "amp fp8: the backward of an FP8 Linear ran after its model was destroyed.");
    const int64_t slot = runtime->layer * 3 + Fp8State::kGrad;
    const Fp8Options::Scaling scaling = state->options().scaling();
    const at::Tensor g = grads[0].reshape({-1, weight.size(0)});  // [M, out]
    const at::Tensor x = input.reshape({-1, weight.size(1)});     // [M, in]
    const bool cuda = g.is_cuda();
    at::Tensor grad_input, grad_weight;
    if (scaling == Fp8Options::Scaling::kRowwise || scaling == Fp8Options::Scaling::kRowwiseGwHp) {
      const bool gw_hp = scaling == Fp8Options::Scaling::kRowwiseGwHp;
      const Fp8Quantized gq = quantize_rowwise(g, -1, true);
      note(*state, slot, gq, false, true);
      const Fp8Quantized wq = gw_hp ? quantize_tensorwise(weight.t(), true) : quantize_rowwise(weight.t(), -1, true);
      grad_input = torchao_scaled_mm(gq.values, gq.scales, wq.values.t(), wq.scales.dim() ? wq.scales.t() : wq.scales,
                                     g.scalar_type(), /*fast_accum=*/false);
      if (gw_hp) {
        grad_weight = at::mm(g.t(), x.to(g.scalar_type()));
      } else {
        const Fp8Quantized gt = quantize_rowwise(g, 0, true), xt = quantize_rowwise(x, 0, true);
        const at::Tensor a = cuda ? pad_fp8_rows(gt.values, 16).t() : gt.values.t();
        const at::Tensor b = cuda ? pad_fp8_rows(xt.values, 16) : xt.values;
        grad_weight = torchao_scaled_mm(a, gt.scales.t(), b, xt.scales, g.scalar_type(), /*fast_accum=*/false);
      }
    } else if (scaling == Fp8Options::Scaling::kBlockwise) {
      const bool p2 = state->options().power_of_2_scales();
      const Fp8Quantized gq = quantize_tiles(g, p2), wq = quantize_blocks(weight, p2);
      note(*state, slot, gq, false, true);
      grad_input = at::mm(dequantize_tiles(gq), dequantize_blocks(wq));
      // grad weight [out, in] = g^T @ x, both in 1x128 tiles along the batch.
      const Fp8Quantized gt = quantize_tiles(pad_rows(g, kTile).t(), p2);
      const Fp8Quantized xt = quantize_tiles(pad_rows(x, kTile).t(), p2);
      grad_weight = at::mm(dequantize_tiles(gt), dequantize_tiles(xt).t());
    } else {  // kMxfp8
      const Fp8Quantized gq = quantize_mx(g.contiguous()), wq = quantize_mx(weight.t().contiguous());
      note(*state, slot, gq, true, true);
      grad_input = at::mm(dequantize_mx(gq), dequantize_mx(wq).t());
      const Fp8Quantized gt = quantize_mx(pad_rows(g, kMxBlock).t().contiguous());
      const Fp8Quantized xt = quantize_mx(pad_rows(x, kMxBlock).t().contiguous());
      grad_weight = at::mm(dequantize_mx(gt), dequantize_mx(xt).t());
    }
    return {grad_input.reshape(input.sizes()).to(input.scalar_type()), grad_weight.to(weight.scalar_type()),
            at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor fp8_recipe_linear(const at::Tensor& input, const at::Tensor& weight, const std::shared_ptr<Fp8State>& state,
                             int64_t layer, bool record) {
  std::vector<int64_t> shape = input.sizes().vec();
  shape.back() = weight.size(0);
  return Fp8RecipeLinear::apply(input, weight, c10::make_intrusive<Fp8RecipeRuntime>(state, layer), record).view(shape);
}

#else  // LibTorch before 2.1: no FP8 dtypes (Options refuses fp8 there)

namespace {
[[noreturn]] void no_fp8() { TORCH_CHECK(false, "amp fp8: this LibTorch build (", TORCH_VERSION, ") has no FP8 dtypes."); }
}  // namespace

Fp8Quantized quantize_rowwise(const at::Tensor&, int64_t, bool) { no_fp8(); }
Fp8Quantized quantize_tensorwise(const at::Tensor&, bool) { no_fp8(); }
Fp8Quantized quantize_tiles(const at::Tensor&, bool) { no_fp8(); }
Fp8Quantized quantize_blocks(const at::Tensor&, bool) { no_fp8(); }
Fp8Quantized quantize_mx(const at::Tensor&) { no_fp8(); }
at::Tensor dequantize_tiles(const Fp8Quantized&) { no_fp8(); }
at::Tensor dequantize_blocks(const Fp8Quantized&) { no_fp8(); }
at::Tensor dequantize_mx(const Fp8Quantized&) { no_fp8(); }
at::Tensor fp8_recipe_linear(const at::Tensor&, const at::Tensor&, const std::shared_ptr<Fp8State>&, int64_t, bool) {
  no_fp8();
}

#endif

}  // namespace amp::detail
