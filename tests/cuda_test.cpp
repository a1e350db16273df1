// What only a GPU shows: the device-to-host synchronizations of a training step, counted by CUDA itself
// (c10's sync debug mode reports every synchronizing call: .item(), blocking copies, stream syncs), at
// every level in fp16 and bf16, with amp's optimizer, amp::optim::FusedAdam and amp::GradScaler: none with a fused
// optimizer, one (the inf/NaN flag) with LibTorch's; and the whole step captured in a CUDA graph
// (amp::GraphCaptureGuard), ported from torch's test_graph_grad_scaling and test_graph_scaling_fused_optimizers.
// Skips without a GPU.
#include <cmath>
#include <limits>
#include <sstream>
#include <string>

#include "core/host_sync.h"
#include "support/data.h"
#include "support/models.h"
#include "support/support.h"
#include "support/training.h"

#ifdef AMP_TEST_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
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
  const char* optimizer;  // "SGD" (LibTorch's, momentum), "FusedAdam" (ATen's fused kernel on CUDA), or with its
                          // moments in bf16 ("FusedAdam_bf16_moments": NOTE [Stored moments on the device]; the conv
                          // net's tensors are too small for 8-bit blocks), or FusedSGD with dampening
                          // ("FusedSGD_dampening": NOTE [A first momentum buffer on the device])
};

std::string sync_case_name(const ::testing::TestParamInfo<SyncCase>& info) {
  return std::string(info.param.level) + "_" + dtype_label(info.param.dtype) + "_" + info.param.optimizer;
}

class CudaSyncTest : public ::testing::TestWithParam<SyncCase> {
 protected:
  void SetUp() override { SKIP_WITHOUT_CUDA_COUNTERS(); }
};

// Checks that CUDA saw no sync in a step with amp's fused optimizer, at most one per step with LibTorch's (the
// inf/NaN flag its step needs on the host), and only the ones amp counted itself.
TEST_P(CudaSyncTest, NoneWithAFusedOptimizerOnlyAmpsOwnOtherwise) {
#ifdef AMP_TEST_CUDA
  const SyncCase c = GetParam();
  CudaProblem problem(3);
  auto& [x, y, net] = problem;
  const std::string name = c.optimizer;
  const auto format = name == "FusedAdam_bf16_moments" ? amp::OptimizerStateFormat::kBf16 : amp::OptimizerStateFormat::kFp32;
  const auto options = amp::Options(c.level).low_precision_dtype(c.dtype).optimizer_state_format(format).verbosity(0);
  auto run = [&](auto optimizer_in) {
    auto [model, optimizer] = amp::initialize(net, std::move(optimizer_in), options);
    auto step = [&, &model = model, &optimizer = optimizer] { return amp_test::train_step(model, optimizer, x, y); };
    const SyncCounts syncs = syncs_over(step, &optimizer);
    EXPECT_LE(syncs.cuda, kSteps) << "CUDA reported " << syncs.cuda << " synchronizations in " << kSteps << " steps";
    if (std::string(c.optimizer) != "SGD") EXPECT_EQ(syncs.cuda, 0) << "a fused optimizer's step never waits";
    EXPECT_EQ(syncs.cuda, syncs.amp) << "syncs that amp did not make itself (amp counted " << syncs.amp << ")";
    EXPECT_EQ(syncs.cuda, syncs.optimizer) << "amp::host_sync_count(optimizer) counted " << syncs.optimizer;
    EXPECT_TRUE(std::isfinite(step().template item<double>()));
  };
  if (std::string(c.optimizer) == "SGD") {
    run(torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9)));
  } else if (std::string(c.optimizer) == "FusedSGD_dampening") {
    run(amp::optim::FusedSGD(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9).dampening(0.25)));
  } else {
    run(amp::optim::FusedAdam(net->parameters(), torch::optim::AdamOptions(1e-3)));
  }
#endif
}

std::vector<SyncCase> all_sync_cases() {
  std::vector<SyncCase> out;
  for (const char* level : {"O0", "O1", "O2", "O3"}) {
    for (const auto dtype : amp_test::low_precision_dtypes()) {
      for (const char* optimizer : {"SGD", "FusedAdam", "FusedAdam_bf16_moments", "FusedSGD_dampening"}) {
        out.push_back({level, dtype, optimizer});
      }
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Levels, CudaSyncTest, ::testing::ValuesIn(all_sync_cases()), sync_case_name);

// torch.amp's recipe through amp::GradScaler on a plain LibTorch model under amp::AutocastGuard: one sync per step
// (step's found_inf read: LibTorch's SGD can't skip on the device); the scale and its update live on the device, so
// update() needs none.
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

// ---- The whole step in one CUDA graph (amp::GraphCaptureGuard; docs/cuda.md's recipe) ----------------------------

class CudaGraphTest : public ::testing::Test {
 protected:
  void SetUp() override { SKIP_WITHOUT_CUDA_COUNTERS(); }
};

#ifdef AMP_TEST_CUDA
// One weight of 100 values whose loss is summed in fp16: an input of 20000 makes the sum overflow (torch's
// test_graph_grad_scaling model).
struct HalfSumImpl : torch::nn::Module {
  HalfSumImpl() : weight(register_parameter("weight", torch::ones({100}, torch::kCUDA))) {}
  torch::Tensor forward(const torch::Tensor& x) { return (weight.to(torch::kHalf) * x.to(torch::kHalf)).sum(); }
  torch::Tensor weight;
};
TORCH_MODULE(HalfSum);

// Captures `step` on a side stream after `warmups` eager calls there (the recipe of docs/cuda.md).
template <class Step>
void capture_step(at::cuda::CUDAGraph& graph, amp::OptimizerBase& optimizer, Step&& step, int warmups) {
  c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool();
  torch::cuda::synchronize();
  {
    c10::cuda::CUDAStreamGuard on_side(side);
    for (int i = 0; i < warmups; ++i) step();
  }
  torch::cuda::synchronize();
  {
    c10::cuda::CUDAStreamGuard on_side(side);
    amp::GraphCaptureGuard capture(optimizer);
    graph.capture_begin();
    step();
    graph.capture_end();
  }
  torch::cuda::synchronize();
}
#endif

// torch's test_graph_grad_scaling in amp's terms: the whole step (zero_grad, forward, scale_loss's backward with its
// unscale and scale update, the fused step) captured once, replayed with inputs 5, 20000, 5, 40000. After each
// replay the scale and clean-pass count follow torch's expected sequence (scales 4, 2, 2, 1; clean passes 2, 0, 1, 0:
// the eager warm-up step's clean pass counts too), the gradients are the unscaled 5 or inf, and the weight is the
// eager control's.
TEST_F(CudaGraphTest, GraphGradScaling) {
#ifdef AMP_TEST_CUDA
  const auto options = amp::Options("O0").loss_scale(amp::LossScale::dynamic()).init_scale(4.0).verbosity(0);
  HalfSum graphed_net, control_net;
  auto [graphed, graphed_opt] = amp::initialize(
      graphed_net, amp::optim::FusedSGD(graphed_net->parameters(), torch::optim::SGDOptions(0.1)), options);
  auto [control, control_opt] = amp::initialize(
      control_net, amp::optim::FusedSGD(control_net->parameters(), torch::optim::SGDOptions(0.1)), options);
  const torch::Tensor static_input = torch::full({100}, 5.0, torch::kCUDA);
  auto step = [&](auto& model, auto& optimizer, const torch::Tensor& input) {
    optimizer.zero_grad();
    amp::scale_loss(model(input), optimizer).backward();
    optimizer.step();
  };
  at::cuda::CUDAGraph graph;
  capture_step(
      graph, graphed_opt, [&, &m = graphed, &o = graphed_opt] { step(m, o, static_input); }, /*warmups=*/1);
  step(control, control_opt, static_input);  // the control's warm-up
  const double inputs[] = {5, 20000, 5, 40000};
  const double scales[] = {4, 2, 2, 1};
  const int64_t clean_passes[] = {2, 0, 1, 0};
  for (int i = 0; i < 4; ++i) {
    static_input.fill_(inputs[i]);
    graph.replay();
    step(control, control_opt, static_input);
    torch::cuda::synchronize();
    const torch::Tensor grad = graphed_net->weight.grad();
    if (inputs[i] * 100 <= 65504) {  // the fp16 sum of 100 products is finite
      EXPECT_TRUE(torch::equal(grad, torch::full_like(grad, inputs[i]))) << "replay " << i;
    } else {
      EXPECT_FALSE(torch::isfinite(grad).all().item<bool>()) << "replay " << i;
    }
    EXPECT_EQ(amp::loss_scale(graphed_opt), scales[i]) << "replay " << i;
    EXPECT_EQ(graphed_opt.loss_scaler().unskipped(), clean_passes[i]) << "replay " << i;
    EXPECT_EQ(amp::loss_scale(control_opt), scales[i]) << "the eager control, step " << i;
    EXPECT_TRUE(torch::equal(graphed_net->weight, control_net->weight)) << "replay " << i;
  }
  EXPECT_EQ(graphed_opt.skipped_steps(), 2);
#endif
}

// torch's test_graph_scaling_fused_optimizers in amp's terms: FusedSGD (momentum), FusedAdam and FusedAdamW at O2
// in fp16 and bf16, the whole step graphed and replayed over batches (one of them overflowing) against the same
// steps taken eagerly: the parameters, the loss scale and the skips agree (torch's float32 tolerance), and so do the
// Adam step counts a checkpoint writes.
TEST_F(CudaGraphTest, GraphedFusedOptimizersMatchTheEagerControl) {
#ifdef AMP_TEST_CUDA
  for (const auto dtype : amp_test::low_precision_dtypes()) {
    for (const std::string name : {"FusedSGD", "FusedAdam", "FusedAdamW"}) {
      SCOPED_TRACE(name + " " + dtype_label(dtype));
      const auto options = amp::Options("O2").low_precision_dtype(dtype).growth_interval(3).verbosity(0);
      torch::manual_seed(0);
      amp_test::Mlp graphed_net(16, 64, 4), control_net(16, 64, 4);
      {
        torch::NoGradGuard no_grad;
        for (size_t i = 0; i < graphed_net->parameters().size(); ++i) {
          control_net->parameters()[i].copy_(graphed_net->parameters()[i]);
        }
      }
      graphed_net->to(torch::kCUDA);
      control_net->to(torch::kCUDA);
      std::vector<torch::Tensor> xs, ys;
      for (int i = 0; i < 8; ++i) {
        // Step 4 overflows in both dtypes: infinite inputs (x * 1e30 would stay finite in bf16).
        xs.push_back(torch::randn({32, 16}).to(torch::kCUDA) * (i == 4 ? std::numeric_limits<double>::infinity() : 1.0));
        ys.push_back(torch::randint(0, 4, {32}).to(torch::kCUDA));
      }
      auto run = [&](auto graphed_in, auto control_in) {
        auto [graphed, graphed_opt] = amp::initialize(graphed_net, std::move(graphed_in), options);
        auto [control, control_opt] = amp::initialize(control_net, std::move(control_in), options);
        torch::Tensor static_x = xs[0].clone(), static_y = ys[0].clone();
        at::cuda::CUDAGraph graph;
        capture_step(
            graph, graphed_opt,
            [&, &m = graphed, &o = graphed_opt] { amp_test::train_step(m, o, static_x, static_y); }, /*warmups=*/3);
        for (int i = 0; i < 3; ++i) amp_test::train_step(control, control_opt, static_x, static_y);
        for (size_t i = 0; i < xs.size(); ++i) {
          static_x.copy_(xs[i]);
          static_y.copy_(ys[i]);
          graph.replay();
          amp_test::train_step(control, control_opt, xs[i], ys[i]);
        }
        torch::cuda::synchronize();
        EXPECT_EQ(control_opt.skipped_steps(), 1) << "the overflowing batch was skipped";
        EXPECT_EQ(graphed_opt.skipped_steps(), control_opt.skipped_steps());
        EXPECT_EQ(amp::loss_scale(graphed_opt), amp::loss_scale(control_opt));
        const auto g = graphed_net->parameters(), e = control_net->parameters();
        for (size_t i = 0; i < g.size(); ++i) {
          EXPECT_TRUE(torch::allclose(g[i].to(torch::kFloat), e[i].to(torch::kFloat), 1.3e-6, 1e-5)) << "parameter " << i;
        }
        std::stringstream graphed_bytes, control_bytes;
        torch::save(graphed_opt, graphed_bytes);
        torch::save(control_opt, control_bytes);
        torch::serialize::InputArchive graphed_archive, control_archive;
        graphed_archive.load_from(graphed_bytes);
        control_archive.load_from(control_bytes);
        c10::IValue graphed_skips, control_skips;
        torch::serialize::InputArchive graphed_amp, control_amp;
        graphed_archive.read("amp", graphed_amp);
        control_archive.read("amp", control_amp);
        graphed_amp.read("skipped_steps", graphed_skips);
        control_amp.read("skipped_steps", control_skips);
        EXPECT_EQ(graphed_skips.toInt(), control_skips.toInt());
      };
      auto params_of = [](amp_test::Mlp& net) { return net->parameters(); };
      if (name == "FusedSGD") {
        run(amp::optim::FusedSGD(params_of(graphed_net), torch::optim::SGDOptions(0.05).momentum(0.9)),
            amp::optim::FusedSGD(params_of(control_net), torch::optim::SGDOptions(0.05).momentum(0.9)));
      } else if (name == "FusedAdam") {
        run(amp::optim::FusedAdam(params_of(graphed_net), torch::optim::AdamOptions(1e-3)),
            amp::optim::FusedAdam(params_of(control_net), torch::optim::AdamOptions(1e-3)));
      } else {
        run(amp::optim::FusedAdamW(params_of(graphed_net), torch::optim::AdamWOptions(1e-3)),
            amp::optim::FusedAdamW(params_of(control_net), torch::optim::AdamWOptions(1e-3)));
      }
    }
  }
#endif
}

}  // namespace
