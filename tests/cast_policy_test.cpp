// O1 per-op casts. Ports Apex's tests/L0/run_amp test_basic_casts.py, test_promotion.py and
// test_cache.py to amp::AutocastGuard on every device (the CPU, and CUDA, where LibTorch's AutocastCUDA lists
// cast most rows natively and amp's kernels the rest), for bf16 and (where the build computes it) fp16.
#include <ATen/record_function.h>

#include <map>

#include "casting/autocast_adapter.h"
#include "support/support.h"

namespace {

struct Case {
  c10::ScalarType dtype;
  c10::DeviceType device;
};

std::vector<Case> all_cases() {
  std::vector<Case> out;
  for (const auto device : amp_test::test_devices()) {
    for (const auto dtype : {torch::kBFloat16, torch::kHalf}) out.push_back({dtype, device});
  }
  return out;
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return amp_test::dtype_label(info.param.dtype) + amp_test::device_suffix(info.param.device);
}

class CastPolicyTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    lp = GetParam().dtype;
    SKIP_WITHOUT_DEVICE(GetParam().device);
    if (GetParam().device == torch::kCPU) {
      SKIP_WITHOUT_CPU_KERNELS(lp);
      if (lp == torch::kHalf && TORCH_VERSION_MAJOR < 2) GTEST_SKIP() << "CPU autocast is bf16-only in LibTorch 1.13";
    }
    amp_test::use_deterministic_fp32(GetParam().device);
    torch::manual_seed(0);
  }
  torch::Device device() const { return GetParam().device; }
  c10::DeviceType device_type() const { return GetParam().device; }
  // A tensor drawn on the CPU (as every device's variant draws it), then moved to the device.
  torch::Tensor draw(at::IntArrayRef shape, c10::ScalarType dtype = torch::kFloat) const {
    return torch::randn(shape).to(device(), dtype);
  }
  // Apex's run_layer_test: output dtype per input dtype, and grad dtype == input dtype.
  template <class F>
  void expect_dtypes(F&& fn, const std::vector<int64_t>& shape, bool lp_out_for_fp32_in, bool lp_out_for_lp_in,
                     const char* what) const {
    for (auto in_dtype : {torch::kFloat, lp}) {
      auto x = draw(shape, in_dtype).requires_grad_(true);
      torch::Tensor y;
      {
        amp::AutocastGuard casts(device_type(), lp);
        y = fn(x);
      }
      const bool lp_out = in_dtype == torch::kFloat ? lp_out_for_fp32_in : lp_out_for_lp_in;
      EXPECT_EQ(y.scalar_type(), lp_out ? lp : torch::kFloat) << what << " with input " << in_dtype;
      y.to(torch::kFloat).sum().backward();
      EXPECT_EQ(x.grad().scalar_type(), in_dtype) << what;
    }
  }

  c10::ScalarType lp = torch::kBFloat16;
  static constexpr int64_t h = 64, b = 16, c = 16, k = 3, t = 10;  // Apex utils.py sizes
};

}  // namespace

TEST_P(CastPolicyTest, LinearAndConvAreAlwaysLowPrecision) {
  torch::nn::Linear linear(h, h);
  linear->to(device());
  expect_dtypes([&](const torch::Tensor& x) { return linear(x); }, {b, h}, true, true, "Linear");
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(c, c, k).padding(1));
  conv->to(device());
  expect_dtypes([&](const torch::Tensor& x) { return conv(x); }, {b, c, h, h}, true, true, "Conv2d");
  auto w = draw({h, h});
  expect_dtypes([&](const torch::Tensor& x) { return torch::mm(x, w); }, {b, h}, true, true, "mm");
  expect_dtypes([&](const torch::Tensor& x) { return x.matmul(w); }, {b, h}, true, true, "Tensor::matmul");
  auto v = draw({h});
  expect_dtypes([&](const torch::Tensor& x) { return torch::mv(x, v); }, {b, h}, true, true, "mv (amp's row)");
}

TEST_P(CastPolicyTest, ReductionsSoftmaxNormsAndLossesAreAlwaysFloat) {
  expect_dtypes([](const torch::Tensor& x) { return torch::softmax(x, 1); }, {b, h}, false, false, "softmax");
  expect_dtypes([](const torch::Tensor& x) { return torch::log_softmax(x, 1); }, {b, h}, false, false, "log_softmax");
  torch::nn::GroupNorm group_norm(torch::nn::GroupNormOptions(4, c));
  group_norm->to(device());
  expect_dtypes([&](const torch::Tensor& x) { return group_norm(x); }, {b, c, 4, 4}, false, false, "GroupNorm");
  torch::nn::LayerNorm layer_norm(torch::nn::LayerNormOptions({h}));
  layer_norm->to(device());
  expect_dtypes([&](const torch::Tensor& x) { return layer_norm(x); }, {b, h}, false, false, "LayerNorm");
  auto target = draw({b, h});
  expect_dtypes([&](const torch::Tensor& x) { return torch::mse_loss(x, target); }, {b, h}, false, false, "MSELoss");
  expect_dtypes([](const torch::Tensor& x) { return x.exp(); }, {b, h}, false, false, "exp");
  expect_dtypes([](const torch::Tensor& x) { return x.abs().log(); }, {b, h}, false, false, "log");
  expect_dtypes([](const torch::Tensor& x) { return x.pow(2); }, {b, h}, false, false, "pow");
  expect_dtypes([](const torch::Tensor& x) { return x.sum(); }, {b, h}, false, false, "sum");
  expect_dtypes([](const torch::Tensor& x) { return x.cumsum(1); }, {b, h}, false, false, "cumsum");
  expect_dtypes([](const torch::Tensor& x) { return x.prod(1); }, {b, 4}, false, false, "prod");
  expect_dtypes([](const torch::Tensor& x) { return x.norm(); }, {b, h}, false, false, "norm");
  auto labels = torch::randint(h, {b}, torch::kLong).to(device());
  expect_dtypes([&](const torch::Tensor& x) { return torch::nn::functional::cross_entropy(x, labels); }, {b, h},
                false, false, "cross_entropy");
}

TEST_P(CastPolicyTest, ReluAndBatchNormMatchTheInput) {
  expect_dtypes([](const torch::Tensor& x) { return torch::relu(x); }, {b, h}, false, true, "relu");
  torch::nn::BatchNorm2d bn(c);
  bn->to(device());
  expect_dtypes([&](const torch::Tensor& x) { return bn(x); }, {b, c, 4, 4}, false, true, "BatchNorm2d train");
  bn->eval();
  expect_dtypes([&](const torch::Tensor& x) { return bn(x); }, {b, c, 4, 4}, false, true, "BatchNorm2d eval");
}

TEST_P(CastPolicyTest, MixedDtypeOpsPromoteToTheWidest) {
  amp::AutocastGuard casts(device_type(), lp);
  auto x_lp = draw({4, 4}, lp), x_f = draw({4, 4});
  EXPECT_EQ(torch::atan2(x_lp, x_f).scalar_type(), torch::kFloat);
  EXPECT_EQ(torch::atan2(x_lp, x_lp).scalar_type(), lp);
  EXPECT_EQ((x_lp * x_f).scalar_type(), torch::kFloat);
  EXPECT_EQ((x_lp * x_lp).scalar_type(), lp);
  EXPECT_EQ(torch::cat({x_lp, x_lp, x_f}).scalar_type(), torch::kFloat);
  EXPECT_EQ(torch::cat({x_lp, x_lp}).scalar_type(), lp);
  EXPECT_EQ(torch::stack({x_lp, x_f}).scalar_type(), torch::kFloat);
  EXPECT_EQ(torch::addcmul(x_f, x_lp, x_lp).scalar_type(), torch::kFloat);
  EXPECT_EQ(torch::dot(x_lp.flatten(), x_f.flatten()).scalar_type(), torch::kFloat);
  // In-place ops keep self's type (test_promotion's add_).
  auto self = draw({4, 4}, lp);
  self.add_(x_f);
  EXPECT_EQ(self.scalar_type(), lp);
}

TEST_P(CastPolicyTest, DoublesAndIntegersAreNeverCast) {
  amp::AutocastGuard casts(device_type(), lp);
  auto d = draw({4, 4}, torch::kDouble);
  EXPECT_EQ(torch::mm(d, d).scalar_type(), torch::kDouble);
  EXPECT_EQ(d.exp().scalar_type(), torch::kDouble);
  auto i = torch::ones({4}, torch::TensorOptions(device()).dtype(torch::kLong));
  EXPECT_EQ(i.sum().scalar_type(), torch::kLong);
}

TEST_P(CastPolicyTest, AmpsRowsActOnlyInsideTheGuard) {
  auto x = draw({4, 4}, lp);
  EXPECT_EQ(torch::softmax(x, 1).scalar_type(), lp);  // no casts outside
  {
    amp::AutocastGuard casts(device_type(), lp);
    EXPECT_EQ(torch::softmax(x, 1).scalar_type(), torch::kFloat);
    amp::DisableCastsGuard off;
    EXPECT_EQ(torch::softmax(x, 1).scalar_type(), lp);
    EXPECT_EQ(torch::mm(draw({2, 2}), draw({2, 2})).scalar_type(), torch::kFloat);
  }
  EXPECT_EQ(torch::mm(draw({2, 2}), draw({2, 2})).scalar_type(), torch::kFloat);
}

// amp's kernels pass an op on to the keys below autocast once (RecordFunction sees the op as called, not a second
// time from inside the kernel), and cast only the arguments that are not in the target dtype yet.
TEST_P(CastPolicyTest, AmpsKernelsDispatchOnceAndCastOnlyWhatNeedsIt) {
  if (device_type() != c10::DeviceType::CPU) GTEST_SKIP() << "softmax and addcmul are native autocast rows on CUDA";
  const auto fp32 = draw({4, 4}), low = draw({4, 4}, lp);
  static thread_local std::map<std::string, int> calls;
  calls.clear();
  const auto handle = at::addThreadLocalCallback(
      at::RecordFunctionCallback([](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
        ++calls[fn.name()];
        return nullptr;
      }).scopes({at::RecordScope::FUNCTION}));
  torch::Tensor soft, same, mixed;
  {
    amp::AutocastGuard casts(device_type(), lp);
    soft = torch::softmax(fp32, 1);  // Fp32 row, input already fp32
    same = torch::addcmul(fp32, fp32, fp32);  // Promote row, nothing to promote
  }
  const auto quiet = calls;
  {
    amp::AutocastGuard casts(device_type(), lp);
    mixed = torch::addcmul(fp32, low, fp32);  // one argument to promote
  }
  at::removeCallback(handle);
  EXPECT_EQ(quiet.at("aten::softmax"), 1);
  EXPECT_EQ(quiet.at("aten::addcmul"), 1);
  EXPECT_EQ(quiet.count("aten::_to_copy"), 0u) << "an argument already in the target dtype was copied";
  EXPECT_EQ(calls.at("aten::addcmul"), 2);
  EXPECT_EQ(calls.at("aten::_to_copy"), 1);
  EXPECT_TRUE(amp_test::bitwise_equal(soft, torch::softmax(fp32, 1)));
  EXPECT_TRUE(amp_test::bitwise_equal(same, torch::addcmul(fp32, fp32, fp32)));
  EXPECT_TRUE(amp_test::bitwise_equal(mixed, torch::addcmul(fp32, low.to(torch::kFloat), fp32)));
}

// Apex's test_cache: a weight used in train -> no_grad eval -> train gets exactly one gradient, of its
// own dtype, equal to the fp32 reference; and a cast made before an optimizer step is never reused.
TEST_P(CastPolicyTest, WeightCastCacheIsInvalidatedCorrectly) {
  auto weight = draw({8, 8}).requires_grad_(true);
  auto x = draw({4, 8});
  auto forward = [&](const torch::Tensor& w) { return torch::mm(x, w).to(torch::kFloat).pow(2).sum(); };
  {
    amp::AutocastGuard casts(device_type(), lp);
    forward(weight).backward();
  }
  {
    torch::NoGradGuard no_grad;
    amp::AutocastGuard casts(device_type(), lp);
    (void)forward(weight);
  }
  {
    amp::AutocastGuard casts(device_type(), lp);
    forward(weight).backward();
  }
  ASSERT_TRUE(weight.grad().defined());
  EXPECT_EQ(weight.grad().scalar_type(), torch::kFloat);
  auto reference_w = weight.detach().clone().requires_grad_(true);
  (torch::mm(x, reference_w).pow(2).sum() * 2).backward();
  // Rounding x and w to lp (the same on every device; GEMMs accumulate in fp32 on both, CUDA without TF32).
  EXPECT_TRUE(torch::allclose(weight.grad(), reference_w.grad(), 0.05, 0.05));

  // An update between regions must be seen by the next region's cast.
  torch::Tensor before, after;
  {
    amp::AutocastGuard casts(device_type(), lp);
    before = torch::mm(x, weight);
  }
  {
    torch::NoGradGuard no_grad;
    weight.add_(1.0);
  }
  {
    amp::AutocastGuard casts(device_type(), lp);
    after = torch::mm(x, weight);
  }
  // The same GEMM of the same operands on the same device: bitwise, on CUDA too (cuBLAS picks its kernel by
  // shape, layout and alignment, all equal here).
  EXPECT_TRUE(torch::equal(after, torch::mm(x.to(lp), weight.detach().to(lp))));
  EXPECT_FALSE(torch::equal(before, after));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CastPolicyTest, ::testing::ValuesIn(all_cases()), case_name);

TEST(CastRulesTest, TableIsApexsLists) {
  const auto& rules = amp::o1_cast_rules();
  auto policy_of = [&](const std::string& op) -> std::optional<amp::CastPolicy> {
    for (const auto& r : rules) if (r.op == op) return r.policy;
    return std::nullopt;
  };
  EXPECT_EQ(policy_of("aten::linear"), amp::CastPolicy::LowerPrecision);
  EXPECT_EQ(policy_of("aten::conv2d"), amp::CastPolicy::LowerPrecision);
  EXPECT_EQ(policy_of("aten::softmax.int"), amp::CastPolicy::Fp32);
  EXPECT_EQ(policy_of("aten::sum"), amp::CastPolicy::Fp32);
  EXPECT_EQ(policy_of("aten::layer_norm"), amp::CastPolicy::Fp32);
  EXPECT_EQ(policy_of("aten::cat"), amp::CastPolicy::Promote);
  EXPECT_EQ(policy_of("aten::binary_cross_entropy"), amp::CastPolicy::Banned);
  EXPECT_FALSE(policy_of("aten::batch_norm").has_value());  // apex #691: BN matches its input
  std::set<std::string> seen;
  for (const auto& r : rules) {
    EXPECT_TRUE(seen.insert(r.op).second) << "duplicate row " << r.op;
    EXPECT_EQ(r.op.rfind("aten::", 0), 0u) << r.op;
    EXPECT_EQ(r.policy == amp::CastPolicy::Banned, !r.banned_message.empty()) << r.op;
  }
}

// Every overload of every row is under a policy on both autocast keys: amp's kernel or a native one
// (the upsample rows once covered only `.vec`, so F::interpolate ran in low precision at O1).
TEST(CastRulesTest, EveryOverloadOfEveryRowIsCovered) {
  amp::AutocastGuard register_kernels(torch::kCPU, torch::kBFloat16);  // the first guard registers amp's kernels
  std::map<std::string, amp::CastPolicy> policy_of_overload;
  for (const auto& rule : amp::o1_cast_rules()) {
    const auto overloads = amp::covered_overloads(rule);
    if (rule.op.find('.') == std::string::npos) {
      EXPECT_FALSE(overloads.empty()) << rule.op << " is not an operator of this LibTorch";
    }
    for (const auto& name : overloads) {
      const auto dot = name.find('.');
      const c10::OperatorName op{name.substr(0, dot), dot == std::string::npos ? "" : name.substr(dot + 1)};
      const auto handle = c10::Dispatcher::singleton().findSchema(op);
      ASSERT_TRUE(handle.has_value()) << name;
      EXPECT_FALSE(handle->schema().is_mutable()) << name << " writes into its arguments";
      EXPECT_TRUE(handle->hasKernelForDispatchKey(c10::DispatchKey::AutocastCPU)) << name << " on AutocastCPU";
      EXPECT_TRUE(handle->hasKernelForDispatchKey(c10::DispatchKey::AutocastCUDA)) << name << " on AutocastCUDA";
      const auto [it, inserted] = policy_of_overload.emplace(name, rule.policy);
      EXPECT_TRUE(inserted || it->second == rule.policy) << name << " is under two different policies";
    }
  }
  for (const char* op : {"aten::upsample_nearest2d", "aten::upsample_bilinear2d", "aten::upsample_nearest2d.vec"}) {
    EXPECT_EQ(policy_of_overload.count(op), 1u) << op;
  }
}

TEST_P(CastPolicyTest, InterpolateAndUpsampleRunInFp32) {
  namespace F = torch::nn::functional;
  const auto x = draw({1, 2, 4, 4});
  amp::AutocastGuard casts(device_type(), lp);
  const auto input = x.to(lp);
  EXPECT_EQ(F::interpolate(input, F::InterpolateFuncOptions().size(std::vector<int64_t>{8, 8}).mode(torch::kNearest))
                .scalar_type(), torch::kFloat);
  EXPECT_EQ(F::interpolate(input, F::InterpolateFuncOptions().scale_factor(std::vector<double>{2, 2}).mode(torch::kBilinear)
                                      .align_corners(false)).scalar_type(), torch::kFloat);
  torch::nn::Upsample upsample(torch::nn::UpsampleOptions().scale_factor(std::vector<double>{2, 2}).mode(torch::kNearest));
  upsample->to(device());
  EXPECT_EQ(upsample(input).scalar_type(), torch::kFloat);
}

// cast_lists native: every op casts exactly as the build's own autocast does (same dtype, same bits), for fp32
// and low-precision inputs; with Apex's lists (the default) the rows LibTorch lacks cast differently.
TEST_P(CastPolicyTest, NativeListsCastExactlyAsTheBuildsAutocast) {
  torch::nn::Linear linear(h, h);
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(c, c, k).padding(1));
  torch::nn::LayerNorm layer_norm(torch::nn::LayerNormOptions({h}));
  torch::nn::GroupNorm group_norm(torch::nn::GroupNormOptions(4, c));
  torch::nn::BatchNorm2d bn(c);
  for (torch::nn::Module* m : std::initializer_list<torch::nn::Module*>{linear.get(), conv.get(), layer_norm.get(),
                                                                      group_norm.get(), bn.get()})
    m->to(device());
  const auto w = draw({h, h}), v = draw({h}), target = draw({b, h}), other = draw({b, h});
  const auto labels = torch::randint(h, {b}, torch::kLong).to(device());
  using Op = std::function<torch::Tensor(const torch::Tensor&)>;
  const std::vector<std::pair<std::string, Op>> ops = {
      {"linear", [&](const torch::Tensor& x) { return linear(x); }},
      {"mm", [&](const torch::Tensor& x) { return torch::mm(x, w); }},
      {"matmul", [&](const torch::Tensor& x) { return x.matmul(w); }},
      {"addmm", [&](const torch::Tensor& x) { return torch::addmm(v, x, w); }},
      {"mv", [&](const torch::Tensor& x) { return torch::mv(x, v); }},
      {"softmax", [](const torch::Tensor& x) { return torch::softmax(x, 1); }},
      {"log_softmax", [](const torch::Tensor& x) { return torch::log_softmax(x, 1); }},
      {"gelu", [](const torch::Tensor& x) { return torch::gelu(x); }},
      {"tanh", [](const torch::Tensor& x) { return torch::tanh(x); }},
      {"sigmoid", [](const torch::Tensor& x) { return torch::sigmoid(x); }},
      {"exp", [](const torch::Tensor& x) { return x.exp(); }},
      {"pow", [](const torch::Tensor& x) { return x.pow(2); }},
      {"sum", [](const torch::Tensor& x) { return x.sum(); }},
      {"cumsum", [](const torch::Tensor& x) { return x.cumsum(1); }},
      {"norm", [](const torch::Tensor& x) { return x.norm(); }},
      {"layer_norm", [&](const torch::Tensor& x) { return layer_norm(x); }},
      {"mse_loss", [&](const torch::Tensor& x) { return torch::mse_loss(x, target); }},
      {"cross_entropy", [&](const torch::Tensor& x) { return torch::nn::functional::cross_entropy(x, labels); }},
      {"add mixed", [&](const torch::Tensor& x) { return x + other.to(lp); }},
      {"cat mixed", [&](const torch::Tensor& x) { return torch::cat({x, other.to(lp)}); }},
      {"relu", [](const torch::Tensor& x) { return torch::relu(x); }},
      {"conv2d", [&](const torch::Tensor& x) { return conv(x.reshape({b, c, 2, 2})); }},
      {"group_norm", [&](const torch::Tensor& x) { return group_norm(x.reshape({b, c, 2, 2})); }},
      {"batch_norm", [&](const torch::Tensor& x) { return bn(x.reshape({b, c, 2, 2})); }},
  };
  int apex_differs = 0;
  for (const auto& [name, op] : ops) {
    for (auto in_dtype : {torch::kFloat, lp}) {
      const auto x = draw({b, h}, in_dtype);
      // What a region gives: the result, or the error (native lists leave some mixed-dtype calls failing).
      auto run = [&](auto&& region) -> std::pair<torch::Tensor, std::string> {
        try {
          return {region(), ""};
        } catch (const std::exception& e) {
          const std::string what = amp_test::message(e);
          return {torch::Tensor(), what.substr(0, what.find('\n'))};
        }
      };
      const auto native = run([&] {  // the build's autocast alone, as torch.autocast turns it on
        amp::detail::autocast::NativeAutocastGuard region(device_type(), lp);
        return op(x);
      });
      const auto amp_native = run([&] {
        amp::AutocastGuard casts(device_type(), lp, amp::CastLists::kNative);
        return op(x);
      });
      const auto apex = run([&] {
        amp::AutocastGuard casts(device_type(), lp);
        return op(x);
      });
      const std::string where = name + " on " + c10::toString(in_dtype) + " input";
      EXPECT_EQ(amp_native.second, native.second) << where;
      if (!native.first.defined() || !amp_native.first.defined()) continue;
      EXPECT_EQ(amp_native.first.scalar_type(), native.first.scalar_type()) << where;
      EXPECT_TRUE(amp_test::bitwise_equal(amp_native.first, native.first)) << where;
      if (!apex.first.defined() || apex.first.scalar_type() != native.first.scalar_type()) ++apex_differs;
    }
  }
  // On the CPU, Apex's fp32 rows (softmax, GELU, tanh, ...) are not in LibTorch's lists; CUDA lists most natively.
  if (device_type() == torch::kCPU) EXPECT_GT(apex_differs, 3);
}

// amp::Model at O1 with cast_lists native runs the forward as torch.autocast would (outputs then cast to fp32).
TEST(CastListsModelTest, O1NativeForwardIsTheBuildsAutocastForward) {
  struct NetImpl : torch::nn::Module {
    NetImpl() : fc(register_module("fc", torch::nn::Linear(16, 16))) {}
    torch::Tensor forward(const torch::Tensor& x) { return torch::softmax(torch::gelu(fc(x)), 1); }
    torch::nn::Linear fc;
  };
  torch::manual_seed(0);
  auto net = std::make_shared<NetImpl>();
  const auto x = torch::randn({8, 16});
  torch::Tensor expected;
  {
    amp::detail::autocast::NativeAutocastGuard region(torch::kCPU, torch::kBFloat16);
    expected = net->forward(x).to(torch::kFloat);
  }
  auto model = amp::initialize(net, amp::Options("O1").low_precision_dtype(torch::kBFloat16).cast_lists(amp::CastLists::kNative).verbosity(0));
  const auto got = model(x);
  EXPECT_TRUE(amp_test::bitwise_equal(got, expected));
  {
    amp::AutocastGuard casts(torch::kCPU, torch::kBFloat16);
    EXPECT_FALSE(amp_test::bitwise_equal(net->forward(x).to(torch::kFloat), expected)) << "Apex's lists run GELU and softmax in fp32";
  }
}
