#include "support.h"

#include <unistd.h>

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

std::filesystem::path run_python_reference(const std::string& script, const std::string& name) {
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) / ("amp_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string command = "timeout 300 " + python_interpreter() + " '" + script + "' '" + dir.string() + "' > '" +
                              (dir / "python.log").string() + "' 2>&1";
  if (std::system(command.c_str()) != 0) {
    ADD_FAILURE() << command << " failed; see " << (dir / "python.log");
    return {};
  }
  return dir;
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
