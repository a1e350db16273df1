// Apex's frontend.py table and Properties.__setattr__ rules (reference §1.1).
#include "support/support.h"

using amp::OptLevel;

TEST(PropertiesTest, LevelDefaultsAreApexsTable) {
  const auto o0 = amp::properties(OptLevel::O0);
  EXPECT_TRUE(o0.enabled);
  EXPECT_EQ(o0.cast_model_type, torch::kFloat);
  EXPECT_FALSE(o0.patch_torch_functions);
  EXPECT_FALSE(o0.keep_batchnorm_fp32.has_value());
  EXPECT_FALSE(o0.master_weights);
  EXPECT_EQ(o0.loss_scale, amp::LossScale::fixed(1.0));

  const auto o1 = amp::properties(OptLevel::O1);
  EXPECT_FALSE(o1.cast_model_type.has_value());
  EXPECT_TRUE(o1.patch_torch_functions);
  EXPECT_FALSE(o1.keep_batchnorm_fp32.has_value());
  EXPECT_FALSE(o1.master_weights);
  EXPECT_TRUE(o1.loss_scale.is_dynamic());

  const auto o2 = amp::properties(OptLevel::O2);
  EXPECT_EQ(o2.cast_model_type, torch::kHalf);
  EXPECT_FALSE(o2.patch_torch_functions);
  EXPECT_EQ(o2.keep_batchnorm_fp32, true);
  EXPECT_TRUE(o2.master_weights);
  EXPECT_TRUE(o2.loss_scale.is_dynamic());

  const auto o3 = amp::properties(OptLevel::O3);
  EXPECT_EQ(o3.cast_model_type, torch::kHalf);
  EXPECT_FALSE(o3.patch_torch_functions);
  EXPECT_EQ(o3.keep_batchnorm_fp32, false);
  EXPECT_FALSE(o3.master_weights);
  EXPECT_EQ(o3.loss_scale, amp::LossScale::fixed(1.0));

  for (auto level : {OptLevel::O0, OptLevel::O1, OptLevel::O2, OptLevel::O3}) {
    const auto p = amp::properties(level);
    EXPECT_EQ(p.opt_level, level);
    EXPECT_EQ(p.low_precision_dtype, torch::kHalf);
    EXPECT_EQ(p.cast_model_outputs, torch::kFloat);
    EXPECT_EQ(p.num_losses, 1);
    EXPECT_FALSE(p.min_loss_scale.has_value());
    EXPECT_EQ(p.max_loss_scale, 16777216.0);
    EXPECT_EQ(p.verbosity, 1);
  }
}

TEST(OptionsTest, UnsetOverridesKeepTheLevel) {
  for (auto level : {OptLevel::O0, OptLevel::O1, OptLevel::O2, OptLevel::O3}) {
    const auto a = amp::Options(level).resolve();
    const auto b = amp::properties(level);
    EXPECT_EQ(amp::to_string(a), amp::to_string(b));
  }
  EXPECT_EQ(amp::Options().opt_level(), OptLevel::O1);  // Apex's default opt_level
  EXPECT_EQ(amp::Options("O3").opt_level(), OptLevel::O3);
  ASSERT_THROWS_WITH(amp::Options("0O"), "the prefix O is the letter O");
}

TEST(OptionsTest, OverridesApply) {
  const auto p = amp::Options("O2")
                     .keep_batchnorm_fp32(false)
                     .loss_scale(amp::LossScale::fixed(128.0))
                     .num_losses(3)
                     .min_loss_scale(1.0)
                     .max_loss_scale(1024.0)
                     .cast_model_outputs(torch::kHalf)
                     .verbosity(0)
                     .resolve();
  EXPECT_EQ(p.keep_batchnorm_fp32, false);
  EXPECT_EQ(p.loss_scale, amp::LossScale::fixed(128.0));
  EXPECT_EQ(p.num_losses, 3);
  EXPECT_EQ(p.min_loss_scale, 1.0);
  EXPECT_EQ(p.max_loss_scale, 1024.0);
  EXPECT_EQ(p.cast_model_outputs, torch::kHalf);
  EXPECT_EQ(p.verbosity, 0);
  EXPECT_TRUE(p.master_weights);
}

TEST(OptionsTest, LowPrecisionDtypeDrivesTheCastType) {
  const auto o2 = amp::Options("O2").low_precision_dtype(torch::kBFloat16).resolve();
  EXPECT_EQ(o2.cast_model_type, torch::kBFloat16);
  EXPECT_EQ(o2.low_precision_dtype, torch::kBFloat16);
  const auto o3 = amp::Options("O3").cast_model_type(torch::kBFloat16).resolve();
  EXPECT_EQ(o3.low_precision_dtype, torch::kBFloat16);
  const auto o0 = amp::Options("O0").low_precision_dtype(torch::kBFloat16).resolve();
  EXPECT_EQ(o0.cast_model_type, torch::kFloat);  // O0 stays fp32
  ASSERT_THROWS_WITH(amp::Options("O2").low_precision_dtype(torch::kFloat).resolve(),
                     "low_precision_dtype must be torch::kHalf (float16) or torch::kBFloat16 (bfloat16), got torch.float32");
  ASSERT_THROWS_WITH(amp::Options("O2").low_precision_dtype(torch::kBFloat16).cast_model_type(torch::kHalf).resolve(),
                     "cast_model_type torch.float16 contradicts low_precision_dtype torch.bfloat16");
}

TEST(OptionsTest, ApexValidationRules) {
  ASSERT_THROWS_WITH(amp::Options("O1").cast_model_type(torch::kHalf).resolve(),
                     "O1 inserts casts around Torch functions rather than model weights");
  ASSERT_THROWS_WITH(amp::Options("O1").cast_model_type(torch::kHalf).resolve(), "cast_model_type was torch.float16");
  EXPECT_NO_THROW(amp::Options("O1").cast_model_type(torch::kFloat).resolve());
  ASSERT_THROWS_WITH(amp::Options("O1").keep_batchnorm_fp32(true).resolve(),
                     "keep_batchnorm_fp32 should be None");
  ASSERT_THROWS_WITH(amp::Options("O1").master_weights(true).resolve(),
                     "It doesn't make sense to use master_weights with O1");
  ASSERT_THROWS_WITH(amp::Options("O2").patch_torch_functions(true).resolve(),
                     "patch_torch_functions=True should only be set by selecting opt_level='O1' (got opt_level O2)");
  ASSERT_THROWS_WITH(amp::Options("O2").cast_model_type(torch::kInt).resolve(), "got torch.int32");
  ASSERT_THROWS_WITH(amp::Options("O2").num_losses(0).resolve(), "num_losses must be in [1, 1024]");
  ASSERT_THROWS_WITH(amp::Options("O2").min_loss_scale(0.0).resolve(), "min_loss_scale must be positive and finite, got 0.0");
  ASSERT_THROWS_WITH(amp::Options("O2").max_loss_scale(-1.0).resolve(), "max_loss_scale must be positive");
  ASSERT_THROWS_WITH(amp::Options("O2").max_loss_scale(1e39).resolve(), "got 1e+39");
  ASSERT_THROWS_WITH(amp::Options("O2").min_loss_scale(8.0).max_loss_scale(4.0).resolve(),
                     "min_loss_scale (8.0) is greater than max_loss_scale (4.0)");
  ASSERT_THROWS_WITH(amp::Options("O2").verbosity(-1).resolve(), "verbosity must be 0");
  ASSERT_THROWS_WITH(amp::Options("O2").cast_model_outputs(torch::kLong).resolve(), "cast_model_outputs must be a floating dtype");
}

TEST(LossScaleTest, FixedAndDynamic) {
  EXPECT_TRUE(amp::LossScale::dynamic().is_dynamic());
  EXPECT_EQ(amp::LossScale::dynamic().value(), 65536.0);
  EXPECT_EQ(amp::LossScale::fixed(128.0).value(), 128.0);
  EXPECT_FALSE(amp::LossScale::fixed(128.0).is_dynamic());
  ASSERT_THROWS_WITH(amp::LossScale::fixed(0.0), "loss_scale must be positive and finite, got 0.0");
  ASSERT_THROWS_WITH(amp::LossScale::fixed(-2.0), "got -2.0");
  ASSERT_THROWS_WITH(amp::LossScale::fixed(std::numeric_limits<double>::infinity()), "got inf");
  ASSERT_THROWS_WITH(amp::LossScale::fixed(std::nan("")), "got nan");
}

TEST(LossScaleTest, ParsesApexsStrings) {
  EXPECT_TRUE(amp::parse_loss_scale("dynamic").is_dynamic());
  EXPECT_EQ(amp::parse_loss_scale("128.0").value(), 128.0);
  EXPECT_EQ(amp::parse_loss_scale("128").value(), 128.0);
  EXPECT_EQ(amp::parse_loss_scale("1e3").value(), 1000.0);
  ASSERT_THROWS_WITH(amp::parse_loss_scale("Dynamic"), "got 'Dynamic'");
  ASSERT_THROWS_WITH(amp::parse_loss_scale("12x"), "\"dynamic\" or a positive number");
  ASSERT_THROWS_WITH(amp::parse_loss_scale(""), "got ''");
  ASSERT_THROWS_WITH(amp::parse_loss_scale("-4"), "got -4.0");
  EXPECT_EQ(amp::to_string(amp::LossScale::fixed(128)), "128.0");
  EXPECT_EQ(amp::to_string(amp::LossScale::dynamic()), "dynamic");
}

TEST(PropertiesTest, BannerMatchesApexsLayout) {
  const std::string text = amp::to_string(amp::properties(OptLevel::O2));
  EXPECT_NE(text.find("enabled                : True\n"), std::string::npos) << text;
  EXPECT_NE(text.find("opt_level              : O2\n"), std::string::npos) << text;
  EXPECT_NE(text.find("cast_model_type        : torch.float16\n"), std::string::npos) << text;
  EXPECT_NE(text.find("keep_batchnorm_fp32    : True\n"), std::string::npos) << text;
  EXPECT_NE(text.find("loss_scale             : dynamic\n"), std::string::npos) << text;
  EXPECT_NE(amp::to_string(amp::properties(OptLevel::O1)).find("cast_model_type        : None\n"), std::string::npos);
}

// Issue: Apex rejects any master_weights value at O1, False included.
TEST(OptionsTest, MasterWeightsFalseAtO1IsRejectedAsInApex) {
  ASSERT_THROWS_WITH(amp::Options("O1").master_weights(false).resolve(),
                     "It doesn't make sense to use master_weights with O1. With O1, your model weights themselves "
                     "should be FP32. Remove master_weights (it was set to False)");
  EXPECT_NO_THROW(amp::Options("O2").master_weights(false).resolve());
}

// Issue: out-of-range scales and loss counts were accepted, then every step was skipped or bad_alloc.
TEST(OptionsTest, ScalesAndLossCountsOutsideTheirRangesAreRejected) {
  ASSERT_THROWS_WITH(amp::LossScale::fixed(1e39), "loss_scale 1e+39 is outside the float range");
  ASSERT_THROWS_WITH(amp::LossScale::fixed(1e39), "in fp32 it would be inf");
  ASSERT_THROWS_WITH(amp::LossScale::fixed(1e-46), "in fp32 it would be 0 or a denormal");
  ASSERT_THROWS_WITH(amp::parse_loss_scale("1e-40"), "outside the float range");
  EXPECT_EQ(amp::LossScale::fixed(3.4028234663852886e+38).value(), 3.4028234663852886e+38);
  ASSERT_THROWS_WITH(amp::Options("O2").num_losses(2147483647).resolve(),
                     "num_losses must be in [1, 1024] (one loss scaler per loss), got 2147483647");
}

TEST(OptionsTest, LossScalerHyperparametersDefaultToApexAndValidate) {
  const auto p = amp::Options("O2").resolve();
  EXPECT_EQ(p.init_scale, 65536.0);
  EXPECT_EQ(p.growth_factor, 2.0);
  EXPECT_EQ(p.backoff_factor, 0.5);
  EXPECT_EQ(p.growth_interval, 2000);
  EXPECT_EQ(p.hysteresis, 1);
  const auto q = amp::Options("O1").init_scale(1024).growth_factor(4).backoff_factor(0.25).growth_interval(10).hysteresis(3).resolve();
  EXPECT_EQ(q.init_scale, 1024.0);
  EXPECT_EQ(q.growth_factor, 4.0);
  EXPECT_EQ(q.backoff_factor, 0.25);
  EXPECT_EQ(q.growth_interval, 10);
  EXPECT_EQ(q.hysteresis, 3);
  ASSERT_THROWS_WITH(amp::Options("O2").init_scale(0).resolve(), "init_scale must be in [1.1754943508222875e-38");
  ASSERT_THROWS_WITH(amp::Options("O2").init_scale(1e39).resolve(), "got 1e+39");
  ASSERT_THROWS_WITH(amp::Options("O2").growth_factor(1.0).resolve(), "growth_factor must be greater than 1.0 (and finite), got 1.0");
  ASSERT_THROWS_WITH(amp::Options("O2").backoff_factor(1.0).resolve(), "backoff_factor must be in (0, 1), got 1.0");
  ASSERT_THROWS_WITH(amp::Options("O2").backoff_factor(0.0).resolve(), "backoff_factor must be in (0, 1), got 0.0");
  ASSERT_THROWS_WITH(amp::Options("O2").growth_interval(0).resolve(), "growth_interval must be at least 1");
  ASSERT_THROWS_WITH(amp::Options("O2").hysteresis(0).resolve(), "hysteresis must be at least 1");
  EXPECT_NE(amp::Options("O2").hysteresis(2).describe_overrides().find("hysteresis             : 2"), std::string::npos);
}
