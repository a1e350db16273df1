#include "data.h"

#include <torch/utils.h>

namespace amp_test {

std::pair<torch::Tensor, torch::Tensor> blobs(int64_t n, int64_t features, int64_t classes, uint64_t seed) {
  torch::manual_seed(seed);
  auto centers = torch::randn({classes, features}) * 3.0;
  auto labels = torch::randint(classes, {n}, torch::kLong);
  auto points = centers.index_select(0, labels) + torch::randn({n, features});
  return {points, labels};
}

std::pair<torch::Tensor, torch::Tensor> quadrant_images(int64_t n, uint64_t seed) {
  torch::manual_seed(seed);
  auto labels = torch::randint(4, {n}, torch::kLong);
  auto images = torch::randn({n, 1, 8, 8}) * 0.3;
  auto acc = images.accessor<float, 4>();
  auto lab = labels.accessor<int64_t, 1>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = (lab[i] / 2) * 4, c = (lab[i] % 2) * 4;
    for (int64_t y = r; y < r + 4; ++y)
      for (int64_t x = c; x < c + 4; ++x) acc[i][0][y][x] += 2.0f;
  }
  return {images, labels};
}

}  // namespace amp_test
