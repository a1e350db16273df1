#pragma once
// ZeRO stage 3 gives a parameter's memory back between uses (NOTE [Stage 3 units] in src/parallel/zero_units.cpp):
// its shape and dtype stay, its values live in the ranks' shards. ATen reads such a tensor as if it had memory, so
// amp's own readers and writers of parameters check for it first and say what to do.

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <string>

namespace amp::detail {

/// Whether `t` holds no memory for its elements (a ZeRO stage-3 parameter between uses).
inline bool is_released(const at::Tensor& t) {
  return t.defined() && t.has_storage() && t.numel() > 0 && t.storage().nbytes() == 0;
}

/// Throws where `t` (named `name`) is released: `where` names the caller.
inline void check_not_released(const at::Tensor& t, const std::string& name, const char* where) {
  TORCH_CHECK(!is_released(t), where, ": parameter '", name, "' holds no values on this rank: ZeRO stage 3 keeps them "
              "in the ranks' shards between uses. Read or write parameters under amp::parallel::GatheredParametersGuard "
              "(every rank constructs it; writes reach the shards when it ends).");
}

}  // namespace amp::detail
