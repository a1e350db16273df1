// O1's per-op cast table: Apex's lists (apex/amp/lists/{functional,torch,tensor}_overrides.py) as
// ATen operator names. One op per line, grouped like ATen's autocast_mode.cpp.
//
// Mechanism (src/casting/cast_kernels.cpp): LibTorch's native autocast already covers most of these ops on
// CUDA and the GEMM/conv family on CPU; amp registers a kernel on the AutocastCPU / AutocastCUDA keys
// only for the rows the running LibTorch lacks, so native policies are never overridden and users of
// plain autocast see no change (amp's kernels act only inside amp::AutocastGuard). Binary arithmetic
// and comparisons (add, sub, mul, div, eq, ...) need no row: ATen's type promotion already runs them in
// the widest dtype, which is Apex's CASTS behaviour.

#include "amp/cast_policy.h"

namespace amp {

const std::vector<CastRule>& o1_cast_rules() {
  using P = CastPolicy;
  static const std::vector<CastRule> rules = {
      // ---- LowerPrecision: GEMM and convolution (Apex FP16_FUNCS) ----
      {"aten::conv1d", P::LowerPrecision},
      {"aten::conv1d.padding", P::LowerPrecision},
      {"aten::conv2d", P::LowerPrecision},
      {"aten::conv2d.padding", P::LowerPrecision},
      {"aten::conv3d", P::LowerPrecision},
      {"aten::conv3d.padding", P::LowerPrecision},
      {"aten::conv_transpose1d", P::LowerPrecision},
      {"aten::conv_transpose2d.input", P::LowerPrecision},
      {"aten::conv_transpose3d.input", P::LowerPrecision},
      {"aten::conv_tbc", P::LowerPrecision},
      {"aten::prelu", P::LowerPrecision},
      {"aten::addmm", P::LowerPrecision},
      {"aten::addmv", P::LowerPrecision},
      {"aten::addr", P::LowerPrecision},
      {"aten::matmul", P::LowerPrecision},
      {"aten::mm", P::LowerPrecision},
      {"aten::mv", P::LowerPrecision},
      {"aten::linear", P::LowerPrecision},
      {"aten::bmm", P::LowerPrecision},
      {"aten::baddbmm", P::LowerPrecision},
      {"aten::addbmm", P::LowerPrecision},

      // ---- Fp32: pointwise ops that overflow or lose precision in fp16 (Apex FP32_FUNCS) ----
      {"aten::acos", P::Fp32},
      {"aten::asin", P::Fp32},
      {"aten::cosh", P::Fp32},
      {"aten::erfinv", P::Fp32},
      {"aten::exp", P::Fp32},
      {"aten::expm1", P::Fp32},
      {"aten::log", P::Fp32},
      {"aten::log10", P::Fp32},
      {"aten::log2", P::Fp32},
      {"aten::log1p", P::Fp32},
      {"aten::reciprocal", P::Fp32},
      {"aten::rsqrt", P::Fp32},
      {"aten::sinh", P::Fp32},
      {"aten::tan", P::Fp32},
      {"aten::pow.Tensor_Scalar", P::Fp32},
      {"aten::pow.Tensor_Tensor", P::Fp32},
      {"aten::pow.Scalar", P::Fp32},
      {"aten::softplus", P::Fp32},
      {"aten::gelu", P::Fp32},

      // ---- Fp32: reductions ----
      {"aten::sum", P::Fp32},
      {"aten::sum.dim_IntList", P::Fp32},
      {"aten::prod", P::Fp32},
      {"aten::prod.dim_int", P::Fp32},
      {"aten::cumsum", P::Fp32},
      {"aten::cumprod", P::Fp32},
      {"aten::norm.Scalar", P::Fp32},
      {"aten::norm.ScalarOpt_dim", P::Fp32},
      {"aten::dist", P::Fp32},
      {"aten::std", P::Fp32},
      {"aten::std.dim", P::Fp32},
      {"aten::var", P::Fp32},
      {"aten::var.dim", P::Fp32},
      {"aten::renorm", P::Fp32},
      {"aten::logsumexp", P::Fp32},

      // ---- Fp32: softmax and normalization ----
      {"aten::softmax.int", P::Fp32},
      {"aten::log_softmax.int", P::Fp32},
      {"aten::layer_norm", P::Fp32},
      {"aten::group_norm", P::Fp32},
      {"aten::cosine_similarity", P::Fp32},

      // ---- Fp32: resampling ----
      {"aten::grid_sampler", P::Fp32},
      // Apex's `interpolate`: every upsampling kernel F::interpolate / nn::Upsample can reach, every overload.
      {"aten::upsample_nearest1d", P::Fp32},
      {"aten::upsample_nearest2d", P::Fp32},
      {"aten::upsample_nearest3d", P::Fp32},
      {"aten::_upsample_nearest_exact1d", P::Fp32},
      {"aten::_upsample_nearest_exact2d", P::Fp32},
      {"aten::_upsample_nearest_exact3d", P::Fp32},
      {"aten::upsample_linear1d", P::Fp32},
      {"aten::upsample_bilinear2d", P::Fp32},
      {"aten::_upsample_bilinear2d_aa", P::Fp32},
      {"aten::upsample_bicubic2d", P::Fp32},
      {"aten::_upsample_bicubic2d_aa", P::Fp32},
      {"aten::upsample_trilinear3d", P::Fp32},

      // ---- Fp32: losses ----
      {"aten::poisson_nll_loss", P::Fp32},
      {"aten::cosine_embedding_loss", P::Fp32},
      {"aten::cross_entropy_loss", P::Fp32},
      {"aten::hinge_embedding_loss", P::Fp32},
      {"aten::kl_div", P::Fp32},
      {"aten::l1_loss", P::Fp32},
      {"aten::mse_loss", P::Fp32},
      {"aten::margin_ranking_loss", P::Fp32},
      {"aten::multilabel_margin_loss", P::Fp32},
      {"aten::multi_margin_loss", P::Fp32},
      {"aten::nll_loss", P::Fp32},
      {"aten::nll_loss2d", P::Fp32},
      {"aten::nll_loss_nd", P::Fp32},
      {"aten::binary_cross_entropy_with_logits", P::Fp32},
      {"aten::smooth_l1_loss", P::Fp32},
      {"aten::huber_loss", P::Fp32},
      {"aten::soft_margin_loss", P::Fp32},
      {"aten::triplet_margin_loss", P::Fp32},
      {"aten::ctc_loss.IntList", P::Fp32},
      {"aten::ctc_loss.Tensor", P::Fp32},

      // ---- Promote: mixed-dtype ops without ATen type promotion (Apex CASTS, SEQUENCE_CASTS) ----
      {"aten::addcdiv", P::Promote},
      {"aten::addcmul", P::Promote},
      {"aten::atan2", P::Promote},
      {"aten::bilinear", P::Promote},
      {"aten::cross", P::Promote},
      {"aten::linalg_cross", P::Promote},
      {"aten::dot", P::Promote},
      {"aten::vdot", P::Promote},
      {"aten::equal", P::Promote},
      {"aten::cat", P::Promote},
      {"aten::stack", P::Promote},
      {"aten::index_put", P::Promote},
      {"aten::scatter_add", P::Promote},

      // ---- Banned (Apex BANNED_FUNCS) ----
      {"aten::binary_cross_entropy", P::Banned,
       "amp: binary_cross_entropy (torch::nn::BCELoss, torch::nn::functional::binary_cross_entropy) is unsafe "
       "to run under per-op casts (O1): its log of a low-precision probability underflows. Combine the sigmoid "
       "and the loss into torch::nn::BCEWithLogitsLoss / binary_cross_entropy_with_logits, which is safe."},
  };
  return rules;
}

const char* to_string(CastPolicy policy) {
  switch (policy) {
    case CastPolicy::LowerPrecision: return "LowerPrecision";
    case CastPolicy::Fp32: return "Fp32";
    case CastPolicy::Promote: return "Promote";
    case CastPolicy::Banned: return "Banned";
  }
  return "?";
}

}  // namespace amp
