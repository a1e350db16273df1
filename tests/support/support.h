#pragma once
// Shared test helpers: message checks, dtype availability, device and level fixtures.
// The test models are in models.h, their data in data.h, the training step in training.h.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <string>
#include <vector>

#include "amp/amp.h"

/// Asserts that `statement` throws a std::exception whose message contains `substring`.
#define ASSERT_THROWS_WITH(statement, substring)                                                  \
  do {                                                                                            \
    try {                                                                                         \
      (void)(statement);                                                                          \
      FAIL() << "expected an exception containing \"" << (substring) << "\"";                    \
    } catch (const std::exception& e) {                                                           \
      ASSERT_NE(amp_test::message(e).find(substring), std::string::npos)                          \
          << "message: " << amp_test::message(e) << "\nexpected to contain: " << (substring);     \
    }                                                                                             \
  } while (0)

/// Skips the test where this LibTorch build can't compute `dtype` on the CPU (fp16 on 1.13).
#define SKIP_WITHOUT_CPU_KERNELS(dtype)                                                             \
  do {                                                                                              \
    if (!amp_test::cpu_computes(dtype))                                                             \
      GTEST_SKIP() << "this LibTorch (" << TORCH_VERSION << ") has no CPU kernels for "             \
                   << c10::toString(dtype) << " (fp16 CPU kernels arrived in LibTorch 2.x)";        \
  } while (0)

/// Whether this build runs under AddressSanitizer (the 2.13-sanitize flavor).
#if defined(__SANITIZE_ADDRESS__)
#define AMP_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define AMP_TEST_SANITIZED 1
#endif
#endif

/// Skips a training-quality figure (many steps of the same amp code that smaller tests run) under the sanitizers: it
/// would find no memory error the smaller tests miss, and the instrumented build runs it slowest. The 2.13 flavor runs it.
#ifdef AMP_TEST_SANITIZED
#define SKIP_QUALITY_FIGURE_UNDER_SANITIZERS()                                                                      \
  GTEST_SKIP() << "a training-quality figure: the sanitizer build runs the same FP8 code in the smaller tests, the " \
                  "2.13 flavor runs this one"
#else
#define SKIP_QUALITY_FIGURE_UNDER_SANITIZERS() (void)0
#endif

/// Skips the test where `device` is CUDA and this machine has none (the same test runs on a GPU
/// machine, built against a CUDA LibTorch: scripts/gpu-check.sh).
#define SKIP_WITHOUT_DEVICE(device)                                                                  \
  do {                                                                                               \
    if ((device) == torch::kCUDA && !torch::cuda::is_available())                                    \
      GTEST_SKIP() << "no CUDA device here (torch::cuda::is_available() is false; "                  \
                   << (amp_test::built_with_cuda() ? "CUDA build" : "CPU-only build")               \
                   << "): the CUDA variant runs on a machine with a GPU and a CUDA LibTorch";        \
  } while (0)

namespace amp_test {

/// The devices behavioural tests are parametrized over: the CPU and CUDA (skipped where absent).
inline std::vector<c10::DeviceType> test_devices() { return {torch::kCPU, torch::kCUDA}; }
inline std::string device_suffix(c10::DeviceType d) { return d == torch::kCUDA ? "_cuda" : ""; }
inline std::string device_name(const ::testing::TestParamInfo<c10::DeviceType>& info) {
  return info.param == torch::kCUDA ? "cuda" : "cpu";
}

/// Returns whether this LibTorch was built with CUDA (the `cuda` build flavor), GPU or not.
bool built_with_cuda();

/// Returns whether GEMM, conv and BatchNorm run in `dtype` on the CPU in this build.
bool cpu_computes(c10::ScalarType dtype);

/// Makes GPU runs reproducible and their fp32 references real fp32: deterministic cuDNN, no autotuning,
/// no TF32 (which would round fp32 GEMMs and convolutions to 10 mantissa bits). No-op on the CPU.
void use_deterministic_fp32(c10::DeviceType device);

/// The fixture of a behavioural test that runs on every device with the same assertions:
///   class LossScalerTest : public amp_test::DeviceTest {};
///   TEST_P(LossScalerTest, Name) { auto x = torch::ones({4}, device()); ... }
///   AMP_INSTANTIATE_FOR_DEVICES(LossScalerTest);
/// The CUDA variant (ctest name ".../cuda") skips with the reason where there is no GPU.
class DeviceTest : public ::testing::TestWithParam<c10::DeviceType> {
 protected:
  void SetUp() override {
    SKIP_WITHOUT_DEVICE(GetParam());
    use_deterministic_fp32(GetParam());
  }
  torch::Device device() const { return GetParam(); }
  bool on_cuda() const { return GetParam() == torch::kCUDA; }
  /// Returns whether `dtype` computes on this device (not fp16 on the CPU of LibTorch 1.13).
  bool computes(c10::ScalarType dtype) const { return on_cuda() || cpu_computes(dtype); }
};

/// The parameter of a test that runs at each opt level: level x low-precision dtype x device.
struct LevelCase {
  const char* level;
  c10::ScalarType dtype;
  c10::DeviceType device;
};

/// Every device x `levels` x {bf16, fp16}; with `o0_once`, O0 once per device (its dtype is unused).
std::vector<LevelCase> level_cases(const std::vector<const char*>& levels = {"O0", "O1", "O2", "O3"},
                                   bool o0_once = false);

/// "O2_fp16" on the CPU, "O2_fp16_cuda" on CUDA.
std::string level_case_name(const ::testing::TestParamInfo<LevelCase>& info);

/// The fixture of a level-parametrized test (AMP_INSTANTIATE_FOR_LEVELS): skips a CUDA case without a GPU
/// and a CPU case whose dtype this build cannot compute; deterministic fp32 on CUDA.
class LevelTest : public ::testing::TestWithParam<LevelCase> {
 protected:
  void SetUp() override {
    SKIP_WITHOUT_DEVICE(GetParam().device);
    if (GetParam().device == torch::kCPU) SKIP_WITHOUT_CPU_KERNELS(GetParam().dtype);
    use_deterministic_fp32(GetParam().device);
  }
  torch::Device device() const { return GetParam().device; }
  amp::Options options() const {
    return amp::Options(GetParam().level).low_precision_dtype(GetParam().dtype).verbosity(0);
  }
};

std::string message(const std::exception& e);

/// The Python that computes references at test time: $AMP_PYTHON, else python3 from PATH (the one whose torch
/// wheel amp builds against).
std::string python_interpreter();
/// Whether python_interpreter() imports torch (checked once per process).
bool python_has_torch();
/// Runs `script ARGS... DIR` (a reference of tests/python/) with python_interpreter(), its output in DIR/python.log,
/// under `timeout 300`, and returns its exit status. A reference that ran before with the same script, arguments,
/// Python and `inputs` (files in DIR the script reads) is not run again: its outputs are copied into DIR
/// (NOTE [Python references run once] in support.cpp). Round trips that check C++ output in Python call it without a
/// cache: python_interpreter() directly.
int run_python(const std::string& script, const std::vector<std::string>& args, const std::filesystem::path& dir,
               const std::vector<std::string>& inputs);
/// run_python(script, {}, DIR, {}) in a fresh DIR under the test temporary directory named after `name` and this
/// process. Returns DIR, or an empty path (and a test failure naming the log) when it fails.
std::filesystem::path run_python_reference(const std::string& script, const std::string& name);

/// Returns whether the two tensors have the same dtype, shape and bits.
bool bitwise_equal(const torch::Tensor& a, const torch::Tensor& b);

/// The low-precision dtypes, for parameterised tests.
inline std::vector<c10::ScalarType> low_precision_dtypes() { return {torch::kHalf, torch::kBFloat16}; }

inline std::string dtype_label(c10::ScalarType t) { return t == torch::kHalf ? "fp16" : "bf16"; }

}  // namespace amp_test

/// Runs the LevelTest-derived `suite` over `cases` (amp_test::level_cases(...)).
#define AMP_INSTANTIATE_FOR_LEVELS(suite, cases) \
  INSTANTIATE_TEST_SUITE_P(Levels, suite, ::testing::ValuesIn(cases), amp_test::level_case_name)

/// Runs the DeviceTest-derived `suite` on the CPU and on CUDA.
#define AMP_INSTANTIATE_FOR_DEVICES(suite) \
  INSTANTIATE_TEST_SUITE_P(Devices, suite, ::testing::ValuesIn(amp_test::test_devices()), amp_test::device_name)
