#pragma once
// The tests' synthetic classification data: seeded, so every run draws the same batches.

#include <torch/types.h>

#include <cstdint>
#include <utility>

namespace amp_test {

/// A separable classification problem: `n` points in `features` dims, `classes` Gaussian blobs.
std::pair<torch::Tensor, torch::Tensor> blobs(int64_t n, int64_t features, int64_t classes, uint64_t seed);

/// 8x8 one-channel images whose class is the quadrant holding a bright square.
std::pair<torch::Tensor, torch::Tensor> quadrant_images(int64_t n, uint64_t seed);

}  // namespace amp_test
