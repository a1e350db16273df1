// What only a GPU shows: the device-to-host synchronizations of a training step, counted by CUDA itself
// (c10's sync debug mode reports every synchronizing call: .item(), blocking copies, stream syncs), at
// every level in fp16 and bf16, with amp's optimizer, amp::optim::FusedAdam and amp::GradScaler. amp
// reads its inf/NaN flag once per step and nothing else may wait for the GPU. Skips without a GPU.
#include <cmath>

#include "support/data.h"
#include "support/models.h"
#include "support/support.h"
#include "support/training.h"

#ifdef AMP_TEST_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>
#endif

#include "scaling/multi_tensor.h"

// Skips without a GPU, or in a build that cannot read CUDA's own counters.
#ifdef AMP_TEST_CUDA
#define SKIP_WITHOUT_CUDA_COUNTERS() SKIP_WITHOUT_DEVICE(torch::kCUDA)
#else
#define SKIP_WITHOUT_CUDA_COUNTERS()                                                              \
  do {                                                                                            \
    SKIP_WITHOUT_DEVICE(torch::kCUDA);                                                            \
    GTEST_SKIP() << "this LibTorch build has CUDA but amp_tests was built without AMP_TEST_CUDA"; \
  } while (0)
#endif

namespace {

using amp_test::dtype_label;

#ifdef AMP_TEST_CUDA
// Counts the synchronizing CUDA operations while alive: sync debug mode turns each into a warning, and this
// guard's handler counts them (warnings raised in autograd's device threads are replayed on the caller's).
class CountCudaSyncsGuard {
 public:
  CountCudaSyncsGuard() : previous_(c10::cuda::warning_state().get_sync_debug_mode()), handler_guard_(&handler_) {
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_WARN);
  }
  ~CountCudaSyncsGuard() { c10::cuda::warning_state().set_sync_debug_mode(previous_); }
  CountCudaSyncsGuard(const CountCudaSyncsGuard&) = delete;
  CountCudaSyncsGuard& operator=(const CountCudaSyncsGuard&) = delete;
  int64_t count() const { return handler_.syncs; }

 private:
  struct Handler : c10::WarningHandler {
    void process(const c10::Warning& warning) override {
      if (warning.msg().find("synchronizing CUDA operation") != std::string::npos) ++syncs;
    }
    int64_t syncs = 0;
  };
  c10::cuda::SyncDebugMode previous_;
  Handler handler_;
  c10::WarningUtils::WarningHandlerGuard handler_guard_;
};

constexpr int kSteps = 5;

struct SyncCounts {
  int64_t cuda;       // what CUDA reported
  int64_t amp;        // what amp counted itself (detail::count_host_sync)
  int64_t optimizer;  // what amp::host_sync_count(optimizer) counted (0 without one)
};

// The synchronizations over kSteps calls of `step`, after two warm-up calls (which allocate optimizer state
// and cuDNN workspaces).
template <class Step>
SyncCounts syncs_over(Step&& step, const amp::OptimizerBase* optimizer = nullptr) {
  step();
  step();
  torch::cuda::synchronize();
  const int64_t amp_before = amp::detail::host_sync_count();
  const int64_t optimizer_before = optimizer ? amp::host_sync_count(*optimizer) : 0;
  CountCudaSyncsGuard count;
  for (int i = 0; i < kSteps; ++i) step();
  return {count.count(), amp::detail::host_sync_count() - amp_before,
          optimizer ? amp::host_sync_count(*optimizer) - optimizer_before : 0};
}

// A conv + BatchNorm net and a batch of its data, on the GPU.
struct CudaProblem {
  explicit CudaProblem(uint64_t seed) {
    amp_test::use_deterministic_fp32(torch::kCUDA);
    auto [x_cpu, y_cpu] = amp_test::quadrant_images(64, seed);
    x = x_cpu.to(torch::kCUDA);
    y = y_cpu.to(torch::kCUDA);
    torch::manual_seed(0);
    net = amp_test::ConvBnNet();
    net->to(torch::kCUDA);
  }
  torch::Tensor x, y;
  amp_test::ConvBnNet net{nullptr};
};
#endif

struct SyncCase {
  const char* level;
  c10::ScalarType dtype;
  const char* optimizer;  // "SGD" (LibTorch's, momentum) or "FusedAdam" (ATen's fused kernel on CUDA)
};

std::string sync_case_name(const ::testing::TestParamInfo<SyncCase>& info) {
  return std::string(info.param.level) + "_" + dtype_label(info.param.dtype) + "_" + info.param.optimizer;
}

class CudaSyncTest : public ::testing::TestWithParam<SyncCase> {
 protected:
  void SetUp() override { SKIP_WITHOUT_CUDA_COUNTERS(); }
};

// Checks that CUDA saw at most one sync per amp step, and only the ones amp counted itself (FoundInf::any).
TEST_P(CudaSyncTest, AtMostOneHostSyncPerStepAndOnlyAmpsOwn) {
#ifdef AMP_TEST_CUDA
  const SyncCase c = GetParam();
  CudaProblem problem(3);
  auto& [x, y, net] = problem;
  const auto options = amp::Options(c.level).low_precision_dtype(c.dtype).verbosity(0);
  auto run = [&](auto optimizer_in) {
    auto [model, optimizer] = amp::initialize(net, std::move(optimizer_in), options);
    auto step = [&, &model = model, &optimizer = optimizer] { return amp_test::train_step(model, optimizer, x, y); };
    const SyncCounts syncs = syncs_over(step, &optimizer);
    EXPECT_LE(syncs.cuda, kSteps) << "CUDA reported " << syncs.cuda << " synchronizations in " << kSteps << " steps";
    EXPECT_EQ(syncs.cuda, syncs.amp) << "syncs that amp did not make itself (amp counted " << syncs.amp << ")";
    EXPECT_EQ(syncs.cuda, syncs.optimizer) << "amp::host_sync_count(optimizer) counted " << syncs.optimizer;
    EXPECT_TRUE(std::isfinite(step().template item<double>()));
  };
  if (std::string(c.optimizer) == "SGD") {
    run(torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9)));
  } else {
    run(amp::optim::FusedAdam(net->parameters(), torch::optim::AdamOptions(1e-3)));
  }
#endif
}

std::vector<SyncCase> all_sync_cases() {
  std::vector<SyncCase> out;
  for (const char* level : {"O0", "O1", "O2", "O3"}) {
    for (const auto dtype : amp_test::low_precision_dtypes()) {
      for (const char* optimizer : {"SGD", "FusedAdam"}) out.push_back({level, dtype, optimizer});
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Levels, CudaSyncTest, ::testing::ValuesIn(all_sync_cases()), sync_case_name);

// torch.amp's recipe through amp::GradScaler on a plain LibTorch model under amp::AutocastGuard: one sync per step
// (step's found_inf read); amp keeps the scale on the host, so update() needs none.
class CudaGradScalerSyncTest : public ::testing::TestWithParam<c10::ScalarType> {
 protected:
  void SetUp() override { SKIP_WITHOUT_CUDA_COUNTERS(); }
};

TEST_P(CudaGradScalerSyncTest, AtMostOneHostSyncPerStep) {
#ifdef AMP_TEST_CUDA
  CudaProblem problem(4);
  auto& [x, y, net] = problem;
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  amp::GradScaler scaler;
  const SyncCounts syncs = syncs_over([&] {
    optimizer.zero_grad();
    torch::Tensor loss;
    {
      amp::AutocastGuard autocast(torch::kCUDA, GetParam());
      loss = torch::nn::functional::cross_entropy(net(x), y);
    }
    scaler.scale(loss).backward();
    scaler.step(optimizer);
    scaler.update();
  });
  EXPECT_LE(syncs.cuda, kSteps) << "CUDA reported " << syncs.cuda << " synchronizations in " << kSteps << " steps";
#endif
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaGradScalerSyncTest, ::testing::ValuesIn(amp_test::low_precision_dtypes()),
                         [](const auto& info) { return dtype_label(info.param); });

}  // namespace
