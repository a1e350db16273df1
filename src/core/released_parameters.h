#pragma once
// ZeRO stage 3 gives a parameter's memory back between uses (NOTE [Stage 3 units] in src/parallel/zero_units.cpp):
// its shape and dtype stay, its values live in the ranks' shards. ATen reads such a tensor as if it had memory, so
// amp's own readers and writers of parameters check for it first: collective readers (PythonCheckpoint::put_model,
// a TorchScript model's save) make the parameters whole through the scope their owner registered; writers say what
// to do.

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <functional>
#include <memory>
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

/// ZeRO stage-3 shardings alive in this process (amp::Model's forward looks for released parameters only then).
void count_stage3_shardings(int delta);
bool stage3_shardings_exist();
/// How many forwards that gather what they read this thread runs now (ZeRO stage 3's gather_in_forward).
int& gathering_forwards();

/// Collective: makes every parameter its owner shards whole while the returned object lives (null: the owner is
/// gone). ZeRO stage 3 registers one per sharded storage, the same `owner` for all of one optimizer's.
using WholeScope = std::function<std::shared_ptr<void>()>;
struct WholeOwner {
  const void* owner = nullptr;
  WholeScope scope;
};
void register_whole_scope(const c10::StorageImpl* storage, WholeOwner owner);
/// The owner registered for `t`'s storage, or one without a scope.
WholeOwner whole_owner_of(const at::Tensor& t);

}  // namespace amp::detail
