// Apex's LossScaler algorithm (reference §1.5), every transition; PyTorch's
// test_grad_scaling_update_scale and test_grad_scale_will_not_overflow in Apex's terms.
#include "support/support.h"

using amp::LossScale;
using amp::LossScaler;

TEST(LossScalerTest, DynamicStartsAtMinOf2To16AndMax) {
  EXPECT_EQ(LossScaler(LossScale::dynamic()).loss_scale(), 65536.0);
  EXPECT_EQ(LossScaler(LossScale::dynamic(), std::nullopt, 1024.0).loss_scale(), 1024.0);
  EXPECT_EQ(LossScaler(LossScale::fixed(3.0)).loss_scale(), 3.0);
}

TEST(LossScalerTest, HalvesOnOverflowAndSkips) {
  LossScaler s(LossScale::dynamic());
  const double expected[] = {32768.0, 16384.0, 8192.0, 4096.0};
  for (double e : expected) {
    EXPECT_TRUE(s.update_scale(true));
    EXPECT_EQ(s.loss_scale(), e);
    EXPECT_EQ(s.unskipped(), 0);
  }
}

TEST(LossScalerTest, DoublesAfterExactly2000CleanSteps) {
  LossScaler s(LossScale::dynamic());
  for (int i = 1; i < 2000; ++i) {
    EXPECT_FALSE(s.update_scale(false));
    ASSERT_EQ(s.unskipped(), i);
    ASSERT_EQ(s.loss_scale(), 65536.0);
  }
  EXPECT_FALSE(s.update_scale(false));
  EXPECT_EQ(s.loss_scale(), 131072.0);
  EXPECT_EQ(s.unskipped(), 0);
}

TEST(LossScalerTest, OverflowResetsTheCleanStepCounter) {
  LossScaler s(LossScale::dynamic());
  for (int i = 0; i < 1999; ++i) s.update_scale(false);
  s.update_scale(true);  // 32768, counter 0
  for (int i = 0; i < 1999; ++i) s.update_scale(false);
  EXPECT_EQ(s.loss_scale(), 32768.0);
  s.update_scale(false);
  EXPECT_EQ(s.loss_scale(), 65536.0);
}

TEST(LossScalerTest, NeverAboveMaxNorInf) {
  LossScaler capped(LossScale::dynamic(), std::nullopt, 65536.0 * 3);  // not a power of two
  for (int i = 0; i < 2000 * 3; ++i) capped.update_scale(false);
  EXPECT_EQ(capped.loss_scale(), 65536.0 * 3);

  // test_grad_scale_will_not_overflow: grow toward the largest float for ~230k clean steps.
  const double float_max = std::numeric_limits<float>::max();
  LossScaler s(LossScale::dynamic(), std::nullopt, float_max);
  for (int i = 0; i < 2000 * 120; ++i) s.update_scale(false);
  EXPECT_EQ(s.loss_scale(), float_max);
  EXPECT_TRUE(std::isfinite(static_cast<float>(s.loss_scale())));
}

TEST(LossScalerTest, NeverBelowMinNorZeroNorDenormal) {
  LossScaler floored(LossScale::dynamic(), 1000.0);
  for (int i = 0; i < 20; ++i) floored.update_scale(true);
  EXPECT_EQ(floored.loss_scale(), 1000.0);

  // No floor given (apex #318, #834: the scale sank to 0): amp stops at the smallest normal float.
  LossScaler s(LossScale::dynamic());
  for (int i = 0; i < 2000; ++i) {
    s.update_scale(true);
    ASSERT_GT(s.loss_scale(), 0.0);
    ASSERT_TRUE(std::isnormal(static_cast<float>(s.loss_scale())));
  }
  EXPECT_EQ(s.loss_scale(), LossScaler::kSmallestScale);
  EXPECT_TRUE(std::isfinite(1.0f / static_cast<float>(s.loss_scale())));
}

TEST(LossScalerTest, FixedScaleNeverChangesButOverflowStillSkips) {
  LossScaler s(LossScale::fixed(128.0));
  EXPECT_TRUE(s.update_scale(true));
  EXPECT_EQ(s.loss_scale(), 128.0);
  for (int i = 0; i < 4000; ++i) EXPECT_FALSE(s.update_scale(false));
  EXPECT_EQ(s.loss_scale(), 128.0);
}

TEST(LossScalerTest, LoadValidates) {
  LossScaler s(LossScale::dynamic(), 1.0, 65536.0);
  s.load(256.0, 17);
  EXPECT_EQ(s.loss_scale(), 256.0);
  EXPECT_EQ(s.unskipped(), 17);
  ASSERT_THROWS_WITH(s.load(131072.0, 0), "checkpointed loss scale 131072.0 is outside this scaler's range [1.0, 65536.0]");
  ASSERT_THROWS_WITH(s.load(0.5, 0), "0.5");
  ASSERT_THROWS_WITH(s.load(256.0, -1), "unskipped count -1");
  ASSERT_THROWS_WITH(s.load(256.0, 2000), "unskipped count 2000");
  EXPECT_EQ(s.loss_scale(), 256.0);  // failed loads change nothing
}

// Issue: a floor above 2^16 started the scaler below its own minimum, and resuming then threw.
TEST(LossScalerTest, FirstScaleIsClampedIntoMinMax) {
  EXPECT_EQ(LossScaler(amp::Options("O2").min_loss_scale(1e6).max_loss_scale(1e7).resolve()).loss_scale(), 1e6);
  EXPECT_EQ(LossScaler(amp::Options("O2").max_loss_scale(1024).resolve()).loss_scale(), 1024.0);
  EXPECT_EQ(LossScaler(amp::Options("O2").init_scale(8).resolve()).loss_scale(), 8.0);
  EXPECT_EQ(LossScaler(amp::Options("O2").init_scale(8).min_loss_scale(16).resolve()).loss_scale(), 16.0);
  LossScaler s(amp::Options("O2").min_loss_scale(1e6).max_loss_scale(1e7).resolve());
  EXPECT_NO_THROW(s.load(s.loss_scale(), s.unskipped()));
}

TEST(LossScalerTest, GrowthAndBackoffFactorsAndInterval) {
  LossScaler s(amp::Options("O2").init_scale(1024).growth_factor(4).backoff_factor(0.25).growth_interval(3).resolve());
  EXPECT_TRUE(s.update_scale(true));
  EXPECT_EQ(s.loss_scale(), 256.0);
  for (int i = 0; i < 2; ++i) EXPECT_FALSE(s.update_scale(false));
  EXPECT_EQ(s.loss_scale(), 256.0);
  EXPECT_FALSE(s.update_scale(false));
  EXPECT_EQ(s.loss_scale(), 1024.0);
  EXPECT_EQ(s.unskipped(), 0);
}

// DeepSpeed's delayed shift: every overflow skips, the scale drops from the k-th overflow since the last
// growth on (DeepSpeed's DynamicLossScaler with consecutive_hysteresis=false).
TEST(LossScalerTest, HysteresisDelaysTheBackoff) {
  LossScaler s(amp::Options("O2").hysteresis(3).growth_interval(2).resolve());
  const double scales[] = {65536, 65536, 32768, 16384};
  for (double expected : scales) {
    EXPECT_TRUE(s.update_scale(true));
    EXPECT_EQ(s.loss_scale(), expected);
  }
  EXPECT_EQ(s.hysteresis_left(), 1);
  EXPECT_FALSE(s.update_scale(false));
  EXPECT_EQ(s.hysteresis_left(), 1);  // a clean step alone does not refill it
  EXPECT_FALSE(s.update_scale(false));
  EXPECT_EQ(s.loss_scale(), 32768.0);  // growth refills
  EXPECT_EQ(s.hysteresis_left(), 3);
  EXPECT_TRUE(s.update_scale(true));
  EXPECT_EQ(s.loss_scale(), 32768.0);
  ASSERT_THROWS_WITH(s.load(32768.0, 0, 4), "checkpointed hysteresis count 4 is outside [1, 3]");
}
