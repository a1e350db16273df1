#pragma once
// The fp32 islands (keep_fp32, keep_fp32_types, BatchNorm kept fp32, auto_fp32's moves) as a training feature.

#include "optim/feature.h"

namespace amp::detail {

class IslandsFeature : public Feature {
 public:
  const char* key() const override { return "islands"; }
  /// amp::parallel: every rank must keep the same modules in fp32, or their replicas compute in other dtypes.
  void join_ranks(torch::nn::Module& model, const std::shared_ptr<RankLink>& link) override;
};

}  // namespace amp::detail
