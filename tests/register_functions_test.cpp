// Apex's register_half_function / register_float_function / register_promote_function (tests/L0/run_amp
// test_basic_casts's user-registration cases), on an ATen op and on this test's own TORCH_LIBRARY ops.
// Its own executable: registrations must come before any amp::initialize in the process (Apex's rule),
// and the last test checks that rule.
#include <torch/library.h>

#include "support/models.h"
#include "support/support.h"

namespace {

at::Tensor scaled_add(const at::Tensor& a, const at::Tensor& b) { return a + 2 * b; }
at::Tensor square(const at::Tensor& a) { return a * a; }
at::Tensor mix(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "amp_test_ops::mix needs one dtype, got ", a.scalar_type(), " and ",
              b.scalar_type());
  return a - b;
}

TORCH_LIBRARY(amp_test_ops, m) {
  m.def("scaled_add(Tensor a, Tensor b) -> Tensor");
  m.def("square(Tensor a) -> Tensor");
  m.def("mix(Tensor a, Tensor b) -> Tensor");
  m.def("untouched(Tensor a) -> Tensor");
}
TORCH_LIBRARY_IMPL(amp_test_ops, CPU, m) {
  m.impl("scaled_add", scaled_add);
  m.impl("square", square);
  m.impl("mix", mix);
  m.impl("untouched", square);
}

at::Tensor call(const char* name, const std::vector<at::Tensor>& args) {
  const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
  torch::jit::Stack stack(args.begin(), args.end());
  op.callBoxed(&stack);
  return stack.back().toTensor();
}

}  // namespace

TEST(RegisterFunctionsTest, HalfFloatAndPromoteOnCustomOps) {
  amp::register_half_function("amp_test_ops::scaled_add");
  amp::register_float_function("amp_test_ops::square");
  amp::register_promote_function("amp_test_ops::mix");
  const auto f = torch::ones({2, 2}), h = torch::ones({2, 2}, torch::kBFloat16);
  {
    amp::AutocastGuard casts(torch::kCPU, torch::kBFloat16);
    EXPECT_EQ(call("amp_test_ops::scaled_add", {f, f}).scalar_type(), torch::kBFloat16);
    EXPECT_EQ(call("amp_test_ops::square", {h}).scalar_type(), torch::kFloat);
    EXPECT_EQ(call("amp_test_ops::mix", {f, h}).scalar_type(), torch::kFloat);
    EXPECT_EQ(call("amp_test_ops::untouched", {h}).scalar_type(), torch::kBFloat16) << "unregistered: no cast";
  }
  {  // cast_lists native drops Apex's rows, not the user's
    amp::AutocastGuard casts(torch::kCPU, torch::kBFloat16, amp::CastLists::kNative);
    EXPECT_EQ(call("amp_test_ops::scaled_add", {f, f}).scalar_type(), torch::kBFloat16);
    EXPECT_EQ(call("amp_test_ops::square", {h}).scalar_type(), torch::kFloat);
    EXPECT_EQ(call("amp_test_ops::mix", {f, h}).scalar_type(), torch::kFloat);
  }
  // Outside the guard nothing is cast.
  EXPECT_EQ(call("amp_test_ops::scaled_add", {f, f}).scalar_type(), torch::kFloat);
  ASSERT_THROWS_WITH(call("amp_test_ops::mix", {f, h}), "amp_test_ops::mix needs one dtype");
}

TEST(RegisterFunctionsTest, AnAtenOpWithoutAPolicy) {
  amp::register_float_function("aten::tanh");
  amp::AutocastGuard casts(torch::kCPU, torch::kBFloat16);
  EXPECT_EQ(torch::tanh(torch::ones({2}, torch::kBFloat16)).scalar_type(), torch::kFloat);
}

TEST(RegisterFunctionsTest, MistakesGetClearErrors) {
  ASSERT_THROWS_WITH(amp::register_half_function("amp_test_ops::no_such_op"),
                     "amp::register_half_function: no operator 'amp_test_ops::no_such_op' is registered with the dispatcher");
  ASSERT_THROWS_WITH(amp::register_float_function("tanh"), "'tanh' is not an operator name");
  amp::register_half_function("amp_test_ops::scaled_add");  // the same policy again: nothing to do
  ASSERT_THROWS_WITH(amp::register_float_function("amp_test_ops::scaled_add"),
                     "'amp_test_ops::scaled_add' is already registered as a half function (low precision); registering "
                     "it as a float function (fp32) conflicts");
  ASSERT_THROWS_WITH(amp::register_half_function("aten::softmax.int"), "a half function (low precision) conflicts");
  ASSERT_THROWS_WITH(amp::register_float_function("aten::mm"), "conflicts");
}

// Last: after amp::initialize, registering is refused (Apex's rule), naming the call.
TEST(RegisterFunctionsTest, ZZAfterInitializeIsRefused) {
  amp_test::Mlp net;
  auto model = amp::initialize(net, amp::Options("O1").low_precision_dtype(torch::kBFloat16).verbosity(0));
  ASSERT_THROWS_WITH(amp::register_promote_function("amp_test_ops::square"),
                     "amp::register_promote_function('amp_test_ops::square'): called after amp::initialize. As in "
                     "Apex, register functions before amp::initialize");
}
