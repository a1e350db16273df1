#pragma once
// The collectives amp::parallel builds on: gradient averaging, bitwise broadcast from rank 0, and the
// cross-rank shape check.

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <functional>
#include <string>
#include <vector>

#include "group_state.h"

namespace amp::parallel::detail {

/// How gradients are averaged (Apex's allreduce_always_fp32 and gradient_predivide_factor).
struct AverageSettings {
  bool always_fp32 = false;
  double predivide = 1.0;
};

/// Returns the dtype `dtype` gradients travel in: fp32 when asked, or where the backend can't sum them
/// (LibTorch 1.13's Gloo has no bfloat16 reduction).
c10::ScalarType wire_dtype(c10::ScalarType dtype, const AverageSettings& settings);

/// Starts averaging `flat` over the ranks: divides by the predivide factor, sums over the ranks (in
/// wire_dtype), divides by world_size / predivide and writes the result back into `flat`. Returns a future
/// whose value is `flat`; a failure (a rank gone, the timeout) completes it with amp's error. With
/// allreduce_always_fp32 and a low-precision `flat`, `wide` (if set) first receives the fp32 average, which `flat`
/// then holds rounded (NOTE [fp32 reductions reach the masters] in distributed_data_parallel.cpp).
c10::intrusive_ptr<c10::ivalue::Future> average_async(const GroupState& group, const at::Tensor& flat,
                                                      const AverageSettings& settings,
                                                      std::function<void(const at::Tensor&)> wide = nullptr);

/// Copies rank 0's values into `tensors` on every other rank, bitwise (every dtype travels as bytes),
/// in buckets of at most `bucket_bytes`. Rank 0's tensors are not written (their version counters stay).
/// Returns the bytes broadcast.
int64_t broadcast_from_rank0(const GroupState& group, const std::vector<at::Tensor>& tensors, int64_t bucket_bytes,
                             const std::string& what);

/// Throws on every rank, naming the first tensor whose dtype or shape differs from rank 0's (`names[i]`
/// and `kinds[i]`, e.g. "parameter"), or a different count. `where` starts the message.
void verify_same_shapes(const GroupState& group, const std::vector<at::Tensor>& tensors,
                        const std::vector<std::string>& names, const std::vector<std::string>& kinds,
                        const std::string& where);

}  // namespace amp::parallel::detail
