// amp::CustomFwdGuard / CustomBwdGuard: torch.amp.custom_fwd / custom_bwd for torch::autograd::Function<T>.
// Ports PyTorch's test/test_cuda.py test_autocast_custom_enabled and test_autocast_custom_cast_inputs (its
// test_autocast_custom_deprecated_warning has no counterpart: nothing is deprecated here) to every device, for bf16
// and fp16 (where the build's CPU autocast computes it), under amp's O1 casts (amp::AutocastGuard) and under the
// build's own autocast alone (turned on through the adapter, as torch.autocast does); PyTorch's test_autocast.py has
// no custom_fwd case. Added: the backward the engine runs outside autocast (or inside it) still sees the forward's
// state (the engine's own behaviour checked on an unguarded twin), the forward's dtype wins over the one current at
// backward (pytorch #87979, PR #88029), amp's O1 rows follow into backward, the state the guards found comes back,
// and the errors.
#include "casting/autocast_adapter.h"
#include "support/support.h"

namespace {

namespace autocast = amp::detail::autocast;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What the functions below saw, for the test to check after they ran.
struct CustomFnSeen {
  int forwards = 0, backwards = 0;
  bool fwd_autocast = false, fwd_amp_casts = false;
  c10::ScalarType fwd_a = torch::kDouble, fwd_b = torch::kDouble;
  bool bwd_autocast = false, bwd_amp_casts = false;
  c10::ScalarType bwd_dtype = torch::kDouble;           // autocast's dtype for the device inside backward
  c10::ScalarType bwd_grad_a = torch::kDouble, bwd_grad_b = torch::kDouble;
  c10::ScalarType bwd_softmax = torch::kDouble;         // softmax of the incoming gradient, inside backward
};
CustomFnSeen custom_fn_seen;

void custom_fn_see_forward(const torch::Tensor& a, const torch::Tensor& b) {
  CustomFnSeen& s = custom_fn_seen;
  ++s.forwards;
  s.fwd_autocast = autocast::is_enabled(a.device().type());
  s.fwd_amp_casts = amp::detail::amp_casts_active();
  s.fwd_a = a.scalar_type();
  s.fwd_b = b.scalar_type();
}

// The backward of a.mm(b) written as torch's test writes it: under autocast the fp32 inputs meet the
// low-precision gradient in low precision; without it, the mixed dtypes would not multiply.
variable_list custom_fn_mm_grads(AutogradContext* ctx, const variable_list& grads) {
  CustomFnSeen& s = custom_fn_seen;
  ++s.backwards;
  const auto saved = ctx->get_saved_variables();
  const torch::Tensor &a = saved[0], &b = saved[1], &g = grads[0];
  const c10::DeviceType device = g.device().type();
  s.bwd_autocast = autocast::is_enabled(device);
  s.bwd_amp_casts = amp::detail::amp_casts_active();
  s.bwd_dtype = autocast::get_dtype(device);
  s.bwd_softmax = torch::softmax(g, 1).scalar_type();
  torch::Tensor grad_a = g.mm(b.t()), grad_b = a.t().mm(g);
  s.bwd_grad_a = grad_a.scalar_type();
  s.bwd_grad_b = grad_b.scalar_type();
  return {grad_a, grad_b};
}

// test_autocast_custom_enabled's MyMM: custom_fwd without cast_inputs, custom_bwd.
struct CustomFnMM : torch::autograd::Function<CustomFnMM> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor a, torch::Tensor b) {
    amp::CustomFwdGuard guard(ctx);
    custom_fn_see_forward(a, b);
    ctx->save_for_backward({a, b});
    return a.mm(b);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    amp::CustomBwdGuard guard(ctx);
    return custom_fn_mm_grads(ctx, grads);
  }
};

// The same function without the guards: what the autograd engine does by itself. Its backward casts by hand
// (it may run without autocast).
struct CustomFnUnguardedMM : torch::autograd::Function<CustomFnUnguardedMM> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor a, torch::Tensor b) {
    custom_fn_see_forward(a, b);
    ctx->save_for_backward({a, b});
    return a.mm(b);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    CustomFnSeen& s = custom_fn_seen;
    ++s.backwards;
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor& g = grads[0];
    s.bwd_autocast = autocast::is_enabled(g.device().type());
    s.bwd_amp_casts = amp::detail::amp_casts_active();
    const auto dtype = g.scalar_type();
    return {g.mm(saved[1].t().to(dtype)), saved[0].t().to(dtype).mm(g)};
  }
};

// test_autocast_custom_cast_inputs's MyMM: custom_fwd(cast_inputs=torch.float32), one input in a container
// (no gradient for it: a std::vector argument is not a variable of the function, as a Python container isn't).
struct CustomFnCastMM : torch::autograd::Function<CustomFnCastMM> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor a, std::vector<torch::Tensor> container) {
    amp::CustomFwdGuard guard(ctx, torch::kFloat);
    a = guard.cast(a);
    const torch::Tensor b = guard.cast(container)[1];
    custom_fn_see_forward(a, b);
    ctx->save_for_backward({a, b});
    return a.mm(b);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    amp::CustomBwdGuard guard(ctx);
    CustomFnSeen& s = custom_fn_seen;
    ++s.backwards;
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor& g = grads[0];
    s.bwd_autocast = autocast::is_enabled(g.device().type());
    s.bwd_amp_casts = amp::detail::amp_casts_active();
    torch::Tensor grad_a = g.mm(saved[1].t());
    s.bwd_grad_a = grad_a.scalar_type();
    return {grad_a, torch::Tensor()};
  }
};

// An autocast region of either kind.
class CustomFnRegion {
 public:
  CustomFnRegion(bool amp_o1, c10::DeviceType device, c10::ScalarType dtype) {
    if (amp_o1) amp_.emplace(device, dtype);
    else native_.emplace(device, dtype);
  }

 private:
  std::optional<amp::AutocastGuard> amp_;
  std::optional<autocast::NativeAutocastGuard> native_;  // torch.autocast without amp's kernels
};

// The autocast nesting count (a region's exit drops the weight-cast cache when it reaches 0).
int custom_fn_nesting() {
  const int level = autocast::increment_nesting() - 1;
  autocast::decrement_nesting();
  return level;
}

struct CustomFnCase {
  c10::DeviceType device;
  c10::ScalarType dtype;
  bool amp_o1;  // the region is amp::AutocastGuard (amp's O1), else the build's autocast alone
};

std::vector<CustomFnCase> custom_fn_cases() {
  std::vector<CustomFnCase> out;
  for (const auto device : amp_test::test_devices())
    for (const auto dtype : {torch::kBFloat16, torch::kHalf})
      for (const bool amp_o1 : {true, false}) out.push_back({device, dtype, amp_o1});
  return out;
}

std::string custom_fn_case_name(const ::testing::TestParamInfo<CustomFnCase>& info) {
  return amp_test::dtype_label(info.param.dtype) + (info.param.amp_o1 ? "_amp" : "_native") +
         amp_test::device_suffix(info.param.device);
}

bool custom_fn_autocast_computes(c10::DeviceType device, c10::ScalarType dtype) {
  if (device == torch::kCUDA) return true;
  return amp_test::cpu_computes(dtype) && (dtype == torch::kBFloat16 || TORCH_VERSION_MAJOR >= 2);
}

class CustomFnTest : public ::testing::TestWithParam<CustomFnCase> {
 protected:
  void SetUp() override {
    SKIP_WITHOUT_DEVICE(GetParam().device);
    if (GetParam().device == torch::kCPU) {
      SKIP_WITHOUT_CPU_KERNELS(lp());
      if (lp() == torch::kHalf && TORCH_VERSION_MAJOR < 2) GTEST_SKIP() << "CPU autocast is bf16-only in LibTorch 1.13";
    }
    amp_test::use_deterministic_fp32(GetParam().device);
    torch::manual_seed(0);
    custom_fn_seen = CustomFnSeen();
  }
  c10::DeviceType device() const { return GetParam().device; }
  c10::ScalarType lp() const { return GetParam().dtype; }
  bool amp_o1() const { return GetParam().amp_o1; }
  torch::Tensor draw(c10::ScalarType dtype = torch::kFloat) const {
    return torch::randn({8, 8}).to(device(), dtype);
  }
  // The dtype softmax gives a low-precision tensor in a region of this case's kind (fp32 where it casts).
  c10::ScalarType softmax_dtype_in_region(bool amp_o1) const {
    const auto t = draw(lp());
    CustomFnRegion region(amp_o1, device(), lp());
    return torch::softmax(t, 1).scalar_type();
  }
};

// test_autocast_custom_enabled: forward runs under the caller's autocast (fp32 inputs, low-precision mm), and so
// does backward, which the engine runs after the region ended: its mm of fp32 inputs by a low-precision gradient
// runs in low precision. Values are bitwise those of the same ops written by hand.
TEST_P(CustomFnTest, ForwardAndBackwardRunUnderTheCallersAutocast) {
  auto x = draw().requires_grad_(true), y = draw().requires_grad_(true);
  const auto w = draw();
  torch::Tensor out, loss;
  {
    CustomFnRegion region(amp_o1(), device(), lp());
    out = CustomFnMM::apply(x, y);
    loss = (out.to(torch::kFloat) * w).sum();
  }
  EXPECT_FALSE(autocast::is_enabled(device()));
  loss.backward();
  const CustomFnSeen& s = custom_fn_seen;
  ASSERT_EQ(s.forwards, 1);
  ASSERT_EQ(s.backwards, 1);
  EXPECT_EQ(s.fwd_a, torch::kFloat);
  EXPECT_EQ(s.fwd_b, torch::kFloat);
  EXPECT_TRUE(s.fwd_autocast);
  EXPECT_EQ(s.fwd_amp_casts, amp_o1());
  EXPECT_EQ(out.scalar_type(), lp());
  EXPECT_TRUE(s.bwd_autocast);
  EXPECT_EQ(s.bwd_amp_casts, amp_o1());
  EXPECT_EQ(s.bwd_dtype, lp());
  EXPECT_EQ(s.bwd_grad_a, lp());
  EXPECT_EQ(s.bwd_grad_b, lp());
  // amp's O1 rows follow the forward into backward: softmax casts there exactly as in a region of that kind.
  EXPECT_EQ(s.bwd_softmax, softmax_dtype_in_region(amp_o1()));
  if (device() == torch::kCPU) {  // on the CPU, Apex's softmax row (fp32) is not in LibTorch's lists: the check bites
    ASSERT_NE(softmax_dtype_in_region(true), softmax_dtype_in_region(false));
  }

  const auto xd = x.detach(), yd = y.detach();
  EXPECT_TRUE(amp_test::bitwise_equal(out, torch::mm(xd.to(lp()), yd.to(lp()))));
  const auto g = w.to(lp());
  EXPECT_TRUE(amp_test::bitwise_equal(x.grad(), g.mm(yd.t().to(lp())).to(torch::kFloat)));
  EXPECT_TRUE(amp_test::bitwise_equal(y.grad(), xd.t().to(lp()).mm(g).to(torch::kFloat)));
}

// test_autocast_custom_cast_inputs, inside autocast: the low-precision inputs (one in a container) reach forward
// as fp32, forward and backward run with autocast off (an fp32 mm, fp32 output), the input's gradient comes back
// in its own dtype, and the caller's region is as it was once forward returns.
TEST_P(CustomFnTest, CastInputsRunsTheForwardInThatDtypeWithAutocastOff) {
  auto x = draw(lp()).requires_grad_(true);
  const auto y = draw(lp());
  const auto w = draw();
  torch::Tensor out, loss;
  {
    CustomFnRegion region(amp_o1(), device(), lp());
    out = CustomFnCastMM::apply(x, std::vector<torch::Tensor>{torch::ones({1}), y});
    EXPECT_TRUE(autocast::is_enabled(device()));
    EXPECT_EQ(autocast::get_dtype(device()), lp());
    EXPECT_EQ(amp::detail::amp_casts_active(), amp_o1());
    loss = (out * w).sum();
  }
  loss.backward();
  const CustomFnSeen& s = custom_fn_seen;
  ASSERT_EQ(s.forwards, 1);
  ASSERT_EQ(s.backwards, 1);
  EXPECT_EQ(s.fwd_a, torch::kFloat);
  EXPECT_EQ(s.fwd_b, torch::kFloat);
  EXPECT_FALSE(s.fwd_autocast);
  EXPECT_FALSE(s.fwd_amp_casts);
  EXPECT_EQ(out.scalar_type(), torch::kFloat);
  EXPECT_FALSE(s.bwd_autocast);
  EXPECT_FALSE(s.bwd_amp_casts);
  EXPECT_EQ(s.bwd_grad_a, torch::kFloat);
  ASSERT_TRUE(x.grad().defined());
  EXPECT_EQ(x.grad().scalar_type(), lp());

  const auto xf = x.detach().to(torch::kFloat), yf = y.to(torch::kFloat);
  EXPECT_TRUE(amp_test::bitwise_equal(out, xf.mm(yf)));
  EXPECT_TRUE(amp_test::bitwise_equal(x.grad(), w.mm(yf.t()).to(lp())));
}

// test_autocast_custom_cast_inputs, outside autocast: custom_fwd is a no-op, the inputs stay low precision.
TEST_P(CustomFnTest, CastInputsIsANoOpOutsideAutocast) {
  auto x = draw(lp()).requires_grad_(true);
  const auto y = draw(lp());
  const auto out = CustomFnCastMM::apply(x, std::vector<torch::Tensor>{torch::ones({1}), y});
  out.to(torch::kFloat).sum().backward();
  const CustomFnSeen& s = custom_fn_seen;
  ASSERT_EQ(s.backwards, 1);
  EXPECT_EQ(s.fwd_a, lp());
  EXPECT_EQ(s.fwd_b, lp());
  EXPECT_FALSE(s.fwd_autocast);
  EXPECT_EQ(out.scalar_type(), lp());
  EXPECT_FALSE(s.bwd_autocast);
  EXPECT_EQ(s.bwd_grad_a, lp());
  EXPECT_TRUE(amp_test::bitwise_equal(out, x.detach().mm(y)));
  EXPECT_TRUE(amp_test::bitwise_equal(x.grad(), torch::ones({8, 8}, torch::TensorOptions(device()).dtype(lp())).mm(y.t())));
}

// The engine runs a custom backward under the state of the thread that called backward(), not the forward's:
// the unguarded twin sees autocast off after a forward under it, and on after a forward without it. The guarded
// function sees the forward's state both ways; the second way it multiplies in fp32, bitwise as fp32 by hand.
TEST_P(CustomFnTest, BackwardReentersTheForwardsStateWhereverTheEngineRunsIt) {
  auto x = draw().requires_grad_(true), y = draw().requires_grad_(true);
  {
    torch::Tensor loss;
    {
      CustomFnRegion region(amp_o1(), device(), lp());
      loss = CustomFnUnguardedMM::apply(x, y).to(torch::kFloat).sum();
    }
    loss.backward();
    EXPECT_TRUE(custom_fn_seen.fwd_autocast);
    EXPECT_FALSE(custom_fn_seen.bwd_autocast) << "the engine ran backward under the caller's autocast state";
    EXPECT_FALSE(custom_fn_seen.bwd_amp_casts);
  }
  custom_fn_seen = CustomFnSeen();
  {
    auto loss = CustomFnUnguardedMM::apply(x, y).sum();
    CustomFnRegion region(amp_o1(), device(), lp());
    loss.backward();
    EXPECT_FALSE(custom_fn_seen.fwd_autocast);
    EXPECT_TRUE(custom_fn_seen.bwd_autocast);
    // (CUDA's backward runs on the engine's device thread, which gets ATen's thread-local state, not amp's flag.)
    if (device() == torch::kCPU) {
      EXPECT_EQ(custom_fn_seen.bwd_amp_casts, amp_o1());
    }
  }

  x = x.detach().requires_grad_(true);
  y = y.detach().requires_grad_(true);
  custom_fn_seen = CustomFnSeen();
  const auto w = draw();
  auto out = CustomFnMM::apply(x, y);
  EXPECT_EQ(out.scalar_type(), torch::kFloat);
  auto loss = (out * w).sum();
  {
    CustomFnRegion region(amp_o1(), device(), lp());
    loss.backward();
    EXPECT_TRUE(autocast::is_enabled(device()));  // the region is back after the guard's backward
    EXPECT_EQ(amp::detail::amp_casts_active(), amp_o1());
  }
  const CustomFnSeen& s = custom_fn_seen;
  ASSERT_EQ(s.backwards, 1);
  EXPECT_FALSE(s.bwd_autocast);
  EXPECT_FALSE(s.bwd_amp_casts);
  EXPECT_EQ(s.bwd_grad_a, torch::kFloat);
  EXPECT_EQ(s.bwd_grad_b, torch::kFloat);
  const auto xd = x.detach(), yd = y.detach();
  EXPECT_TRUE(amp_test::bitwise_equal(x.grad(), w.mm(yd.t())));
  EXPECT_TRUE(amp_test::bitwise_equal(y.grad(), xd.t().mm(w)));
}

// pytorch #87979 (fixed by PR #88029): a forward under bf16 autocast got an fp16 backward, the default dtype.
// Here backward runs inside a region of the other low-precision dtype, and still computes in the forward's.
TEST_P(CustomFnTest, BackwardComputesInTheForwardsDtypeNotTheCurrentOne) {
  const c10::ScalarType other = lp() == torch::kHalf ? torch::kBFloat16 : torch::kHalf;
  if (!custom_fn_autocast_computes(device(), other))
    GTEST_SKIP() << "this build's autocast on " << device() << " has no " << c10::toString(other);
  auto x = draw().requires_grad_(true), y = draw().requires_grad_(true);
  const auto w = draw();
  torch::Tensor loss;
  {
    CustomFnRegion region(amp_o1(), device(), lp());
    loss = (CustomFnMM::apply(x, y).to(torch::kFloat) * w).sum();
  }
  {
    CustomFnRegion region(amp_o1(), device(), other);
    loss.backward();
    EXPECT_EQ(autocast::get_dtype(device()), other);
  }
  const CustomFnSeen& s = custom_fn_seen;
  ASSERT_EQ(s.backwards, 1);
  EXPECT_EQ(s.bwd_dtype, lp());
  EXPECT_EQ(s.bwd_grad_a, lp());
  EXPECT_EQ(s.bwd_grad_b, lp());
  const auto g = w.to(lp());
  EXPECT_TRUE(amp_test::bitwise_equal(x.grad(), g.mm(y.detach().t().to(lp())).to(torch::kFloat)));
}

INSTANTIATE_TEST_SUITE_P(CustomFnCases, CustomFnTest, ::testing::ValuesIn(custom_fn_cases()), custom_fn_case_name);

// The guards on their own (a context built by hand), on the CPU's bf16 autocast.
class CustomFnGuardTest : public ::testing::Test {
 protected:
  void SetUp() override { SKIP_WITHOUT_CPU_KERNELS(torch::kBFloat16); }
};

// Each guard gives back exactly the state it found: both devices' flags and dtypes, amp's flags and the nesting
// count; the backward guard re-enters every part of the recorded state, CUDA's included, and (cast_lists
// native) that Apex's rows were off.
TEST_F(CustomFnGuardTest, GuardsRecordReenterAndRestoreTheWholeCastState) {
  const int nesting = custom_fn_nesting();
  const auto cuda_dtype = autocast::get_dtype(torch::kCUDA);
  AutogradContext plain, casting;
  {
    amp::AutocastGuard o1(torch::kCPU, torch::kBFloat16, amp::CastLists::kNative);
    autocast::set_enabled(torch::kCUDA, true);  // a TLS flag: no GPU needed
    autocast::set_dtype(torch::kCUDA, torch::kBFloat16);
    { amp::CustomFwdGuard guard(&plain); }
    {
      amp::CustomFwdGuard guard(&casting, torch::kFloat);
      EXPECT_FALSE(autocast::is_enabled(torch::kCPU));
      EXPECT_FALSE(autocast::is_enabled(torch::kCUDA));
      EXPECT_FALSE(amp::detail::amp_casts_active());
      EXPECT_EQ(custom_fn_nesting(), nesting + 2);
    }
    EXPECT_TRUE(autocast::is_enabled(torch::kCPU));
    EXPECT_TRUE(autocast::is_enabled(torch::kCUDA));
    EXPECT_EQ(autocast::get_dtype(torch::kCPU), torch::kBFloat16);
    EXPECT_TRUE(amp::detail::amp_casts_active());
    EXPECT_FALSE(amp::detail::apex_rows_active());
    EXPECT_EQ(custom_fn_nesting(), nesting + 1);
    autocast::set_enabled(torch::kCUDA, false);
    autocast::set_dtype(torch::kCUDA, cuda_dtype);
  }
  for (const auto& entry : plain.saved_data) EXPECT_EQ(entry.first.rfind("amp.", 0), 0u) << entry.first;
  EXPECT_FALSE(plain.saved_data.empty());

  ASSERT_FALSE(autocast::is_enabled(torch::kCPU));
  {
    amp::CustomBwdGuard guard(&plain);
    EXPECT_TRUE(autocast::is_enabled(torch::kCPU));
    EXPECT_EQ(autocast::get_dtype(torch::kCPU), torch::kBFloat16);
    EXPECT_TRUE(autocast::is_enabled(torch::kCUDA));
    EXPECT_EQ(autocast::get_dtype(torch::kCUDA), torch::kBFloat16);
    EXPECT_TRUE(amp::detail::amp_casts_active());
    EXPECT_FALSE(amp::detail::apex_rows_active());
    EXPECT_EQ(custom_fn_nesting(), nesting + 1);
    {
      amp::CustomBwdGuard off(&casting);  // nested: the cast_inputs forward recorded autocast off
      EXPECT_FALSE(autocast::is_enabled(torch::kCPU));
      EXPECT_FALSE(autocast::is_enabled(torch::kCUDA));
      EXPECT_FALSE(amp::detail::amp_casts_active());
    }
    EXPECT_TRUE(autocast::is_enabled(torch::kCPU));
    EXPECT_TRUE(autocast::is_enabled(torch::kCUDA));
    EXPECT_TRUE(amp::detail::amp_casts_active());
  }
  EXPECT_FALSE(autocast::is_enabled(torch::kCPU));
  EXPECT_FALSE(autocast::is_enabled(torch::kCUDA));
  EXPECT_EQ(autocast::get_dtype(torch::kCUDA), cuda_dtype);
  EXPECT_FALSE(amp::detail::amp_casts_active());
  EXPECT_TRUE(amp::detail::apex_rows_active());
  EXPECT_EQ(custom_fn_nesting(), nesting);
}

// cast(): floating tensors other than float64, on a device whose autocast was on at the call (torch's _cast);
// integers, doubles, undefined tensors and other devices' tensors pass through as they are.
TEST_F(CustomFnGuardTest, CastConvertsOnlyFloatingTensorsOfADeviceUnderAutocast) {
  AutogradContext ctx;
  const auto f = torch::randn({3}), h = f.to(torch::kBFloat16), d = f.to(torch::kDouble);
  const auto i = torch::arange(3);
  {
    amp::AutocastGuard o1(torch::kCPU, torch::kBFloat16);
    amp::CustomFwdGuard identity(&ctx);
    EXPECT_TRUE(identity.cast(h).is_same(h));
    amp::CustomFwdGuard guard(&ctx, torch::kFloat);
    EXPECT_TRUE(amp_test::bitwise_equal(guard.cast(h), h.to(torch::kFloat)));
    EXPECT_TRUE(guard.cast(f).is_same(f));
    EXPECT_TRUE(guard.cast(d).is_same(d));
    EXPECT_TRUE(guard.cast(i).is_same(i));
    EXPECT_FALSE(guard.cast(torch::Tensor()).defined());
    const auto list = guard.cast(std::vector<torch::Tensor>{h, i});
    EXPECT_EQ(list[0].scalar_type(), torch::kFloat);
    EXPECT_TRUE(list[1].is_same(i));
    amp::CustomFwdGuard to_double(&ctx, torch::kDouble);
    EXPECT_TRUE(to_double.cast(h).is_same(h)) << "autocast is off inside the first cast_inputs guard";
  }
  {
    amp::AutocastGuard cuda_only(torch::kCUDA, torch::kHalf);  // CUDA autocast on: CPU tensors stay
    amp::CustomFwdGuard guard(&ctx, torch::kFloat);
    EXPECT_TRUE(guard.cast(h).is_same(h));
  }
  amp::CustomFwdGuard outside(&ctx, torch::kFloat);
  EXPECT_TRUE(outside.cast(h).is_same(h));
}

// Like torch's autocast region, the backward guard that ends the outermost region drops the weight-cast cache;
// inside another region it leaves the cache alone.
TEST_F(CustomFnGuardTest, BackwardGuardDropsTheWeightCastCacheOnlyWhenOutermost) {
  AutogradContext ctx;
  {
    amp::AutocastGuard o1(torch::kCPU, torch::kBFloat16);
    amp::CustomFwdGuard guard(&ctx);
  }
  const auto weight = torch::randn({4, 4}).requires_grad_(true);
  torch::Tensor first;
  {
    amp::CustomBwdGuard guard(&ctx);
    first = autocast::cached_cast(torch::kBFloat16, weight, torch::kCPU);
    EXPECT_TRUE(autocast::cached_cast(torch::kBFloat16, weight, torch::kCPU).is_same(first));
  }
  {
    amp::CustomBwdGuard guard(&ctx);
    EXPECT_FALSE(autocast::cached_cast(torch::kBFloat16, weight, torch::kCPU).is_same(first));
  }
  {
    amp::AutocastGuard region(torch::kCPU, torch::kBFloat16);
    const auto cast = autocast::cached_cast(torch::kBFloat16, weight, torch::kCPU);
    { amp::CustomBwdGuard guard(&ctx); }
    EXPECT_TRUE(autocast::cached_cast(torch::kBFloat16, weight, torch::kCPU).is_same(cast));
  }
}

TEST_F(CustomFnGuardTest, MisuseNamesTheValueAndTheFix) {
  AutogradContext ctx;
  ASSERT_THROWS_WITH(amp::CustomFwdGuard(nullptr), "amp::CustomFwdGuard: ctx is null. Pass the AutogradContext*");
  ASSERT_THROWS_WITH(amp::CustomBwdGuard(nullptr), "amp::CustomBwdGuard: ctx is null. Pass the AutogradContext*");
  {
    amp::AutocastGuard o1(torch::kCPU, torch::kBFloat16);
    ASSERT_THROWS_WITH(amp::CustomFwdGuard(&ctx, torch::kInt),
                       "amp::CustomFwdGuard: cast_inputs must be a floating-point dtype (torch::kFloat, torch::kHalf, "
                       "torch::kBFloat16 or torch::kDouble), got torch.int32. Pass the dtype the forward computes in, "
                       "or no cast_inputs");
    ASSERT_THROWS_WITH(amp::CustomFwdGuard(&ctx, torch::kBool), "got torch.bool");
    EXPECT_TRUE(autocast::is_enabled(torch::kCPU)) << "a refused guard changed nothing";
    EXPECT_TRUE(amp::detail::amp_casts_active());
  }
  EXPECT_TRUE(ctx.saved_data.empty());
  ASSERT_THROWS_WITH(amp::CustomBwdGuard(&ctx),
                     "amp::CustomBwdGuard: ctx holds no autocast state of its forward (no 'amp.autocast.cpu.enabled' "
                     "in ctx->saved_data). Construct an amp::CustomFwdGuard with the same ctx first thing in forward");
  EXPECT_EQ(custom_fn_nesting(), 0);
}

// A custom function over an fp32 island's weight (keep_fp32 at O2 bf16): its backward mixes the island's fp32
// gradient with the bf16 activation it saved. The forward ran under the model's precision policy; CustomBwdGuard
// brings the policy back into backward, so the mixed GEMM runs in fp32 as the forward's did (without it: a dtype
// error). The gradients equal those of the same head written with plain ops, bit for bit.
struct IslandMatMul : torch::autograd::Function<IslandMatMul> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, torch::Tensor w) {
    amp::CustomFwdGuard guard(ctx);
    ctx->save_for_backward({x, w});
    return x.matmul(w.t());  // reads the island's weight: fp32 under the policy
  }
  static torch::autograd::variable_list backward(AutogradContext* ctx, torch::autograd::variable_list grads) {
    amp::CustomBwdGuard guard(ctx);
    const auto saved = ctx->get_saved_variables();
    return {grads[0].matmul(saved[1]), grads[0].t().matmul(saved[0])};  // fp32 gradient x bf16 activation
  }
};

struct IslandHeadNetImpl : torch::nn::Module {
  explicit IslandHeadNetImpl(bool custom)
      : custom(custom), fc(register_module("fc", torch::nn::Linear(8, 16))),
        head(register_module("head", torch::nn::Linear(torch::nn::LinearOptions(16, 4).bias(false)))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    const auto h = torch::relu(fc(x));
    return custom ? IslandMatMul::apply(h, head->weight) : h.matmul(head->weight.t());
  }
  bool custom;
  torch::nn::Linear fc;
  torch::nn::Linear head;
};
TORCH_MODULE(IslandHeadNet);

TEST(CustomFnIslandTest, BackwardRunsUnderTheForwardsFp32Islands) {
  std::vector<std::vector<torch::Tensor>> grads;
  for (bool custom : {false, true}) {
    torch::manual_seed(5);
    IslandHeadNet net(custom);
    auto model = amp::initialize(net, amp::Options("O2").low_precision_dtype(torch::kBFloat16).keep_fp32({"head"}).verbosity(0));
    ASSERT_EQ(net->head->weight.scalar_type(), torch::kFloat);
    ASSERT_EQ(net->fc->weight.scalar_type(), torch::kBFloat16);
    torch::manual_seed(6);
    const auto out = model(torch::randn({4, 8}));
    out.pow(2).sum().backward();
    grads.push_back({});
    for (const auto& p : net->parameters()) grads.back().push_back(p.grad().clone());
  }
  ASSERT_EQ(grads[0].size(), grads[1].size());
  for (size_t i = 0; i < grads[0].size(); ++i) {
    EXPECT_TRUE(amp_test::bitwise_equal(grads[0][i], grads[1][i])) << "gradient " << i;
  }
}

}  // namespace
