#pragma once
// Every amp::Options field, written once. A row is X(type, name, default, help):
//   type     the resolved value's type in amp::Properties (a std::optional where Apex's "None" is a value);
//   default  the value Properties starts from before an opt level's table (opt_levels/) sets its own;
//   help     the field's documentation, and its config key's help text (values first).
// The rows make Options' setters and overrides, Properties' members, the config keys (amp/config.h), the copies
// Options::resolve() makes of what was set, and the rows of the initialize banner and of describe_overrides().
// Apex's rules stay hand-written in Options::check_rules (src/options/options.cpp): a new option is a row here and
// its rule there.

#include <c10/core/ScalarType.h>

#include <optional>
#include <string>
#include <vector>

#include "amp/cast_policy.h"
#include "amp/fp8.h"
#include "amp/loss_scale.h"
#include "amp/master_weights.h"
#include "amp/optimizer_state_format.h"
#include "amp/precision_policy.h"

#define AMP_OPTION_FIELDS(X)                                                                                       \
  X(bool, enabled, true, "true | false: false makes amp a pass-through (no casts, no loss scaling)")              \
  X(std::optional<c10::ScalarType>, cast_model_type, std::nullopt,                                               \
    "float32 | float16 | bfloat16: the dtype parameters are cast to; None leaves them as they are (O1)")         \
  X(bool, patch_torch_functions, false, "true | false: runs the forward under per-op casts (O1 only)")           \
  X(CastLists, cast_lists, CastLists::kApex,                                                                     \
    "apex | native: O1's per-op lists: Apex's (LibTorch's autocast lists plus Apex's rows they lack) or the "    \
    "LibTorch build's own autocast lists alone (torch.amp's O1); O1 only")                                        \
  X(std::optional<bool>, keep_batchnorm_fp32, std::nullopt,                                                      \
    "true | false: keeps BatchNorm parameters and buffers fp32 when the model is cast (not with O1)")            \
  X(std::vector<std::string>, keep_fp32, {},                                                                    \
    "module names, comma separated, with * and ? wildcards (head, *.norm, blocks.*.ln_1): modules whose "        \
    "parameters and buffers stay fp32 and whose ops run in fp32, at every level (fp32 islands)")                \
  X(std::vector<ModuleType>, keep_fp32_types, {},                                                                \
    "LibTorch module names, comma separated (LayerNorm, GroupNorm, Embedding, Linear, Conv2d, ...): module "     \
    "types kept in fp32 as keep_fp32 keeps modules by name")                                                     \
  X(int, auto_fp32, 0,                                                                                           \
    "0 (off) | overflows with the dynamic loss scale at its floor before amp moves the module that overflows "   \
    "to fp32 and goes on training")                                                                              \
  X(bool, cast_frozen_batchnorm, false,                                                                          \
    "true | false: casts BatchNorm layers frozen with amp::freeze_batchnorm with the model (the tutorials' "     \
    "bn.eval().half(), which rounds their statistics); by default they stay fp32 (O2, O3; amp's extension)")     \
  X(bool, master_weights, false, "true | false: gives the optimizer fp32 master copies of low-precision parameters") \
  X(MasterWeights, master_weights_format, MasterWeights::kCopy,                                                 \
    "copy | split | stochastic_rounding | kahan | residual8: how O2 keeps the fp32 value of bfloat16 "          \
    "parameters: Apex's fp32 copy, or 2/0/2/1 bytes per parameter beside the bf16 weight (amp::optim::Fused* "  \
    "optimizers only)")                                                                                          \
  X(OptimizerStateFormat, optimizer_state_format, OptimizerStateFormat::kFp32,                                  \
    "fp32 | bf16 | 8bit: how amp's fused Adam, AdamW, LAMB and Muon keep their moments: as LibTorch, in "        \
    "bfloat16 (stochastic rounding), or in torchao's 8-bit blocks (amp::optim::FusedAdam, FusedAdamW, FusedLAMB, " \
    "FusedMuon only)")                                                                                           \
  X(LossScale, loss_scale, LossScale::fixed(1.0), "dynamic | a positive number")                                 \
  X(c10::ScalarType, low_precision_dtype, c10::ScalarType::Half,                                                 \
    "float16 | bfloat16: what low precision means for this run")                                                 \
  X(c10::ScalarType, cast_model_outputs, c10::ScalarType::Float,                                                 \
    "float32 | float16 | bfloat16: the dtype floating outputs of the model are cast to")                         \
  X(int, num_losses, 1, "how many losses (and loss scalers) scale_loss addresses through loss_id")               \
  X(std::optional<double>, min_loss_scale, std::nullopt, "floor of the dynamic loss scale (default: none)")      \
  X(double, max_loss_scale, 16777216.0, "ceiling of the dynamic loss scale (default 16777216, 2^24)")            \
  X(int, verbosity, 1, "0 silent, 1 the initialize banner and overflow messages, as Apex")                      \
  /* The dynamic loss scaler's hyperparameters, named as in torch.amp.GradScaler; Apex's defaults. */            \
  X(double, init_scale, 65536.0,                                                                                 \
    "first dynamic loss scale (default 65536, 2^16), clamped into [min_loss_scale, max_loss_scale]")            \
  X(double, growth_factor, 2.0, "factor the dynamic scale grows by after growth_interval clean steps (default 2.0; > 1)") \
  X(double, backoff_factor, 0.5, "factor the dynamic scale shrinks by on an overflow (default 0.5; in (0, 1))")   \
  X(int, growth_interval, 2000, "clean steps in a row before the scale grows (default 2000; Apex's scale_window)") \
  X(int, hysteresis, 1,                                                                                          \
    "overflows before the scale backs off (default 1, as Apex; k > 1 is DeepSpeed's delayed shift: every "       \
    "overflow skips its step, the scale backs off at the k-th since the last growth)")                            \
  /* Options::fp8; the recipe's own keys (fp8_format, ...) are Options' fp8_* setters. */                        \
  X(std::optional<Fp8Options>, fp8, std::nullopt,                                                                \
    "true | false: runs the GEMMs of Linear layers whose dimensions are multiples of 16 in FP8 with per-tensor "  \
    "scales (O2/O3 with bfloat16; docs/fp8.md)")

namespace amp::detail {

/// The type an Options setter takes for a Properties field of type T: T itself, or what the optional holds.
template <class T>
struct Unoptional {
  using type = T;
};
template <class T>
struct Unoptional<std::optional<T>> {
  using type = T;
};
template <class T>
using unoptional_t = typename Unoptional<T>::type;

}  // namespace amp::detail
