#include "support.h"

#include <cstdlib>

namespace amp_test {

std::string message(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

std::string python_interpreter() {
  const char* env = std::getenv("AMP_PYTHON");
  return env && *env ? env : "python3";
}

bool python_has_torch() {
  static const bool have = std::system((python_interpreter() + " -c 'import torch' > /dev/null 2>&1").c_str()) == 0;
  return have;
}

bool cpu_computes(c10::ScalarType dtype) {
  try {
    torch::NoGradGuard no_grad;
    auto a = torch::ones({4, 4}, dtype);
    (void)torch::mm(a, a);
    (void)torch::conv2d(torch::ones({1, 2, 5, 5}, dtype), torch::ones({2, 2, 3, 3}, dtype));
    (void)torch::batch_norm(torch::ones({2, 2, 3, 3}, dtype), torch::ones({2}), torch::zeros({2}), torch::zeros({2}),
                            torch::ones({2}), false, 0.1, 1e-5, false);
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

bool bitwise_equal(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  auto ca = a.contiguous(), cb = b.contiguous();
  return std::memcmp(ca.data_ptr(), cb.data_ptr(), static_cast<size_t>(ca.numel()) * ca.element_size()) == 0;
}

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

bool built_with_cuda() {
#ifdef AMP_TEST_CUDA
  return true;
#else
  return false;
#endif
}

std::vector<LevelCase> level_cases(const std::vector<const char*>& levels, bool o0_once) {
  std::vector<LevelCase> out;
  for (const auto device : test_devices()) {
    for (const char* level : levels) {
      for (const auto dtype : {torch::kBFloat16, torch::kHalf}) {
        if (o0_once && std::string(level) == "O0" && dtype != torch::kBFloat16) continue;
        out.push_back({level, dtype, device});
      }
    }
  }
  return out;
}

std::string level_case_name(const ::testing::TestParamInfo<LevelCase>& info) {
  return std::string(info.param.level) + "_" + dtype_label(info.param.dtype) + device_suffix(info.param.device);
}

void use_deterministic_fp32(c10::DeviceType device) {
  if (device != torch::kCUDA) return;
  auto& context = at::globalContext();
  context.setDeterministicCuDNN(true);
  context.setBenchmarkCuDNN(false);
  context.setAllowTF32CuBLAS(false);
  context.setAllowTF32CuDNN(false);
}

}  // namespace amp_test
