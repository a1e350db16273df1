#pragma once
// O1's per-op cast policies: Apex's FP16_FUNCS / FP32_FUNCS / CASTS / SEQUENCE_CASTS / BANNED lists.

#include <string>
#include <string_view>
#include <vector>

namespace amp {

/// What an op does with its floating tensor arguments under O1.
enum class CastPolicy {
  LowerPrecision,  // Cast fp32 inputs to the low-precision dtype (GEMM/conv family: fast and safe).
  Fp32,            // Cast inputs to fp32 (reductions, softmax, norms, pointwise ops that overflow, losses).
  Promote,         // Cast all inputs to the widest floating dtype among them (mixed-dtype ops, cat, stack).
  Banned,          // Refuse: the op is unsafe in low precision; the message says what to use instead.
};

/// One row of the table: an ATen operator and its policy. "aten::softmax.int" names one overload;
/// "aten::upsample_nearest2d" stands for the function, every overload of it that does not write into
/// its arguments (out= and in-place variants are left alone), as Apex patched the Python function.
struct CastRule {
  std::string op;
  CastPolicy policy;
  std::string banned_message = {};  // for CastPolicy::Banned
};

/// Returns Apex's O1 table as amp applies it (opt_levels/o1_cast_lists.cpp). Where LibTorch's native
/// autocast already has a kernel for an op on a device, the native policy stays in effect for it.
const std::vector<CastRule>& o1_cast_rules();

/// Returns the operators ("aten::upsample_nearest2d.vec", ...) a row covers in this LibTorch build.
std::vector<std::string> covered_overloads(const CastRule& rule);

/// Apex's amp.register_half_function / register_float_function / register_promote_function: puts a
/// dispatcher operator under O1's per-op casts, through the same mechanism as the built-in table. `op` is
/// the full name, "namespace::name" (every overload that does not write into its arguments) or
/// "namespace::name.overload", of an ATen op or the user's own TORCH_LIBRARY op. "Half" means the run's
/// low-precision dtype (float16 or bfloat16). Call before amp::initialize (Apex's rule). Throws on an
/// unknown name, a call after initialize, and a policy that conflicts with an earlier registration,
/// amp's table or LibTorch's native autocast lists; registering the same policy again does nothing.
///
/// Example:
///   amp::register_float_function("myops::fused_softmax");   // before amp::initialize
void register_half_function(std::string_view op);
void register_float_function(std::string_view op);
void register_promote_function(std::string_view op);

/// Returns "LowerPrecision", "Fp32", "Promote" or "Banned".
const char* to_string(CastPolicy policy);

/// O1's per-op lists (Options::cast_lists): kApex, LibTorch's native autocast lists plus the rows of Apex's
/// table LibTorch lacks (the table above; Apex's O1, the default); kNative, the LibTorch build's own autocast
/// lists alone (torch.amp's O1). Registered functions (register_half_function, ...) apply with either.
enum class CastLists { kApex, kNative };

/// Returns "apex" or "native" (the config values).
const char* to_string(CastLists lists);

}  // namespace amp
