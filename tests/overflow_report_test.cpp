// Overflow diagnostics: which parameters had inf/NaN gradients, the extended skip line, and the notice
// when the scale sits at its minimum and still overflows (apex #318, #834, #1135).
#include <sstream>

#include "casting/cpu_features.h"
#include "support/models.h"
#include "support/support.h"

namespace {

struct ThreeLayerImpl : torch::nn::Module {
  ThreeLayerImpl()
      : a(register_module("a", torch::nn::Linear(4, 4))),
        b(register_module("b", torch::nn::Linear(4, 4))),
        c(register_module("c", torch::nn::Linear(4, 2))) {}
  torch::Tensor forward(const torch::Tensor& x) { return c(b(a(x))); }
  torch::nn::Linear a, b, c;
};
TORCH_MODULE(ThreeLayer);

// Runs one backward; with poison_b, b.weight's gradient is NaN (0 * inf) and every other gradient finite.
void overflowing_backward(amp::Model<ThreeLayer>& model, amp::OptimizerBase& optimizer, ThreeLayer& net, bool poison_b) {
  auto loss = model(torch::randn({3, 4})).sum();
  if (poison_b) loss = loss + (net->b->weight.to(torch::kFloat) * INFINITY).sum() * 0;
  auto scaled = amp::scale_loss(loss, optimizer);
  scaled.backward();
  EXPECT_EQ(scaled.overflow(), poison_b);
}

}  // namespace

TEST(OverflowReportTest, NamesTheNonFiniteGradientsInModelOrder) {
  for (const char* level : {"O1", "O2"}) {
    ThreeLayer net;
    auto [model, optimizer] = amp::initialize(
        net, torch::optim::SGD(net->parameters(), 0.1), amp::Options(level).low_precision_dtype(torch::kBFloat16).verbosity(0));
    EXPECT_FALSE(amp::last_overflow(optimizer).has_value());
    overflowing_backward(model, optimizer, net, /*poison_b=*/true);
    const auto report = amp::last_overflow(optimizer);
    ASSERT_TRUE(report.has_value()) << level;
    EXPECT_EQ(report->loss_id, 0);
    EXPECT_EQ(report->loss_scale, 65536.0);
    EXPECT_EQ(report->parameters, std::vector<std::string>({"b.weight"})) << level;
    optimizer.step();  // skipped
    // A clean backward leaves the last report as it was and costs no per-parameter check.
    optimizer.zero_grad();
    overflowing_backward(model, optimizer, net, /*poison_b=*/false);
    EXPECT_EQ(amp::last_overflow(optimizer)->parameters, std::vector<std::string>({"b.weight"}));
  }
}

TEST(OverflowReportTest, SkipLineNamesTheParameters) {
  ThreeLayer net;
  auto [model, optimizer] =
      amp::initialize(net, torch::optim::SGD(net->parameters(), 0.1), amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(1));
  overflowing_backward(model, optimizer, net, /*poison_b=*/true);
  testing::internal::CaptureStdout();
  optimizer.step();
  const std::string out = testing::internal::GetCapturedStdout();
  EXPECT_NE(out.find("Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0 (non-finite "
                     "gradients: b.weight)\n"), std::string::npos) << out;
}

TEST(OverflowReportTest, OverflowAtTheMinimumScaleIsExplainedOnce) {
  ThreeLayer net;
  auto [model, optimizer] = amp::initialize(
      net, torch::optim::SGD(net->parameters(), 0.1),
      amp::Options("O2").low_precision_dtype(torch::kBFloat16).init_scale(4.0).min_loss_scale(2.0).verbosity(1));
  testing::internal::CaptureStdout();
  for (int i = 0; i < 4; ++i) {  // 4 -> 2 (the minimum), then stuck at 2, still overflowing
    optimizer.zero_grad();
    overflowing_backward(model, optimizer, net, /*poison_b=*/true);
    optimizer.step();
  }
  const std::string out = testing::internal::GetCapturedStdout();
  const std::string notice = "amp: loss scaler 0 is at its minimum (2.0) and the gradients still hold inf/NaN (in b.weight). "
                             "Lowering the scale can't fix this";
  const auto first = out.find(notice);
  ASSERT_NE(first, std::string::npos) << out;
  EXPECT_EQ(out.find(notice, first + 1), std::string::npos) << "said once";
  EXPECT_EQ(amp::loss_scale(optimizer), 2.0);
}

// Issue: fp16 on a CPU without native fp16 arithmetic ran 6-20x slower than fp32 with no hint.
TEST(SlowDtypeNoticeTest, DecidesFromTheCpuFeatures) {
  using amp::detail::CpuFeatures;
  using amp::detail::slow_dtype_notice;
  CpuFeatures epyc;  // AMD EPYC Zen 4: avx512_bf16, no avx512_fp16
  epyc.avx512_bf16 = true;
  const auto fp16 = slow_dtype_notice(torch::kHalf, epyc);
  ASSERT_TRUE(fp16.has_value());
  EXPECT_NE(fp16->find("no native float16 arithmetic (no avx512_fp16 or amx_fp16)"), std::string::npos);
  EXPECT_NE(fp16->find("low_precision_dtype = bfloat16 has a native path here (avx512_bf16)"), std::string::npos);
  EXPECT_FALSE(slow_dtype_notice(torch::kBFloat16, epyc).has_value());

  CpuFeatures sapphire_rapids;  // avx512_fp16 and AMX
  sapphire_rapids.avx512_fp16 = sapphire_rapids.avx512_bf16 = sapphire_rapids.amx_bf16 = true;
  EXPECT_FALSE(slow_dtype_notice(torch::kHalf, sapphire_rapids).has_value());
  EXPECT_FALSE(slow_dtype_notice(torch::kBFloat16, sapphire_rapids).has_value());

  const CpuFeatures avx2_only;
  EXPECT_NE(slow_dtype_notice(torch::kHalf, avx2_only)->find("opt_level O0 (fp32) is likely fastest"), std::string::npos);
  EXPECT_NE(slow_dtype_notice(torch::kBFloat16, avx2_only)->find("no native bfloat16 arithmetic"), std::string::npos);
  EXPECT_FALSE(slow_dtype_notice(torch::kFloat, avx2_only).has_value());
}

TEST(SlowDtypeNoticeTest, PrintedAtInitializeWhenTheCpuLacksTheDtype) {
  SKIP_WITHOUT_CPU_KERNELS(torch::kHalf);
  const auto notice = amp::detail::slow_dtype_notice(torch::kHalf, amp::detail::cpu_features());
  amp_test::Mlp net;
  testing::internal::CaptureStdout();
  auto [model, optimizer] = amp::initialize(net, torch::optim::SGD(net->parameters(), 0.1), amp::Options("O2").verbosity(1));
  const std::string out = testing::internal::GetCapturedStdout();
  EXPECT_EQ(out.find("no native float16 arithmetic") != std::string::npos, notice.has_value()) << out;
}
