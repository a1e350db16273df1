// The fused unscale + inf/NaN check (src/scaling/multi_tensor.h). Ports PyTorch's test_grad_scaling_unscale
// (contiguous, transposed and sliced grads, inf/NaN injection, the mixed-list "perfect storm") and
// Apex's test_multi_tensor_scale (sizes around chunk boundaries, flag at first/middle/last element).
// On CUDA the same calls run ATen's _amp_foreach_non_finite_check_and_unscale_ (amp's own loop on the CPU).
#include "scaling/cpu_kernels.h"
#include "scaling/multi_tensor.h"
#include "support/models.h"
#include "support/support.h"

using amp::detail::FoundInf;

namespace {

class UnscaleTest : public amp_test::DeviceTest {
 protected:
  torch::TensorOptions on(c10::ScalarType dtype = torch::kFloat) const {
    return torch::TensorOptions().dtype(dtype).device(device());
  }
  // Contiguous, transposed (non-contiguous) and sliced (strided view) gradients of 4.0, made on the device
  // (moving a strided view with .to() would make it contiguous).
  std::vector<torch::Tensor> make_grads(c10::ScalarType dtype) const {
    return {torch::full({3, 5}, 4.0, on(dtype)), torch::full({5, 3}, 4.0, on(dtype)).t(),
            torch::full({4, 6}, 4.0, on(dtype)).slice(1, 0, 6, 2), torch::full({1000}, 4.0, on(dtype))};
  }
};

}  // namespace

TEST_P(UnscaleTest, UnscalesExactlyAndFindsNothingWhenClean) {
  for (auto dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16}) {
    auto grads = make_grads(dtype);
    FoundInf found;
    amp::detail::unscale_(grads, 0.25, found);
    EXPECT_FALSE(found.any()) << dtype;
    for (const auto& g : grads) EXPECT_TRUE(torch::equal(g, torch::ones_like(g))) << dtype;
  }
}

TEST_P(UnscaleTest, FindsInfAndNanWhereverInjected) {
  const double bad_values[] = {std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity(),
                               std::nan("")};
  for (auto dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16}) {
    for (double bad : bad_values) {
      for (size_t which = 0; which < 4; ++which) {
        auto grads = make_grads(dtype);
        grads[which].select(0, grads[which].size(0) - 1).fill_(bad);
        FoundInf found;
        amp::detail::unscale_(grads, 0.25, found);
        EXPECT_TRUE(found.any()) << dtype << " tensor " << which << " value " << bad;
      }
    }
  }
}

TEST_P(UnscaleTest, PerfectStormMixedList) {
  // fp32 and fp16/bf16, contiguous and strided, in one call; the inf is found in each position.
  for (size_t position = 0; position < 6; ++position) {
    std::vector<torch::Tensor> grads = {torch::full({7}, 2.0, on()), torch::full({3, 3}, 2.0, on(torch::kHalf)).t(),
                                        torch::full({9}, 2.0, on(torch::kBFloat16)).slice(0, 0, 9, 3),
                                        torch::full({2, 8}, 2.0, on()).slice(1, 1, 8, 2),
                                        torch::full({5}, 2.0, on(torch::kHalf)), torch::full({33333}, 2.0, on())};
    grads[position].select(0, grads[position].size(0) / 2).fill_(INFINITY);
    FoundInf found;
    amp::detail::unscale_(grads, 0.5, found);
    EXPECT_TRUE(found.any()) << "position " << position;
  }
}

TEST_P(UnscaleTest, ChunkBoundarySizesFlagFirstMiddleLast) {
  // Apex's sizes around its 2048*32 chunking and odd lengths; amp's CPU loop splits at 32768.
  for (int64_t n : {1, 555, 2048 * 32 - 1, 2048 * 32, 2048 * 32 + 1, 33333, 7777 * 77}) {
    for (auto dtype : {torch::kFloat, torch::kHalf}) {
      for (int64_t at : {int64_t{0}, n / 2, n - 1}) {
        auto g = torch::full({n}, 8.0, on(dtype));
        g[at] = NAN;
        FoundInf found;
        amp::detail::unscale_({g}, 0.125, found);
        ASSERT_TRUE(found.any()) << n << " " << dtype << " at " << at;
      }
      auto clean = torch::full({n}, 8.0, on(dtype));
      FoundInf found;
      amp::detail::unscale_({clean}, 0.125, found);
      EXPECT_FALSE(found.any());
      EXPECT_TRUE(torch::equal(clean, torch::ones_like(clean)));
    }
  }
}

TEST_P(UnscaleTest, IntoFp32MastersConvertsAndAccumulates) {
  for (auto dtype : {torch::kHalf, torch::kBFloat16}) {
    auto model_grad = torch::full({4097}, 1024.0, on(dtype));
    auto master_grad = torch::empty({4097}, on());
    FoundInf found;
    amp::detail::unscale_into({model_grad}, {master_grad}, /*accumulate=*/false, 1.0 / 512, found);
    EXPECT_FALSE(found.any());
    EXPECT_TRUE(torch::equal(master_grad, torch::full({4097}, 2.0, on())));
    amp::detail::unscale_into({model_grad}, {master_grad}, /*accumulate=*/true, 1.0 / 1024, found);
    EXPECT_TRUE(torch::equal(master_grad, torch::full({4097}, 3.0, on())));
    EXPECT_TRUE(torch::equal(model_grad, torch::full({4097}, 1024.0, on(dtype))));  // the input is untouched

    model_grad[17] = INFINITY;
    FoundInf found_inf;
    amp::detail::unscale_into({model_grad}, {master_grad}, false, 1.0, found_inf);
    EXPECT_TRUE(found_inf.any());

    // Strided inputs take the generic path, same results.
    auto strided = torch::full({8, 8}, 64.0, on(dtype)).t();
    auto out = torch::empty({8, 8}, on());
    FoundInf f2;
    amp::detail::unscale_into({strided}, {out}, false, 1.0 / 64, f2);
    EXPECT_FALSE(f2.any());
    EXPECT_TRUE(torch::equal(out, torch::ones({8, 8}, on())));
    FoundInf f3;
    amp::detail::unscale_into({strided}, {out}, /*accumulate=*/true, 1.0 / 32, f3);
    EXPECT_FALSE(f3.any());
    EXPECT_TRUE(torch::equal(out, torch::full({8, 8}, 3.0, on())));
    strided[2][5] = NAN;
    FoundInf f4;
    amp::detail::unscale_into({strided}, {out}, /*accumulate=*/false, 1.0 / 64, f4);
    EXPECT_TRUE(f4.any());
  }
}

TEST_P(UnscaleTest, MixedDtypeListsAreGroupedNotRejected) {
  // ATen's op rejects mixed dtypes ("must have the same dtype"); amp groups by (device, dtype) first.
  std::vector<torch::Tensor> grads = {torch::full({3}, 4.0, on()), torch::full({3}, 4.0, on(torch::kHalf))};
  FoundInf found;
  amp::detail::unscale_(grads, 0.25, found);
  EXPECT_FALSE(found.any());
  EXPECT_TRUE(torch::equal(grads[0], torch::ones({3}, on())));
  EXPECT_TRUE(torch::equal(grads[1], torch::ones({3}, on(torch::kHalf))));
}

// Refused before any device work: the message is the same everywhere.
TEST(UnscaleTestCpu, SparseGradientsAreRefusedClearly) {
  auto sparse = torch::eye(3).to_sparse();
  FoundInf found;
  ASSERT_THROWS_WITH(amp::detail::unscale_({sparse}, 0.5, found), "sparse gradients are not supported");
}

TEST_P(UnscaleTest, CopyMastersIntoModel) {
  for (auto dtype : {torch::kHalf, torch::kBFloat16}) {
    auto masters = std::vector<torch::Tensor>{torch::randn({100}).to(device()), torch::randn({3, 4}).to(device()).t()};
    auto model = std::vector<torch::Tensor>{torch::empty({100}, on(dtype)), torch::empty({4, 3}, on(dtype))};
    amp::detail::copy_(model, masters);
    for (size_t i = 0; i < model.size(); ++i) EXPECT_TRUE(torch::equal(model[i], masters[i].to(dtype)));
  }
}

// amp's own vectorized loops (used on CPUs and builds without ATen's kernel, and for O2's
// low-precision -> fp32 pass) must agree bit for bit with ATen's conversions and arithmetic.
TEST(UnscaleTestCpu, OwnCpuKernelsMatchATenBitForBit) {
  using amp::detail::cpu::Dtype;
  torch::manual_seed(0);
  const int64_t n = 10007;  // odd: exercises the vector loops' tails
  auto values = torch::randn({n}) * 1000;
  values[1] = 65504.0;        // float16 max
  values[2] = 1e-7;           // a float16 subnormal
  values[3] = 3.0e38;         // beyond float16 and near the bfloat16 max
  values[4] = -0.0;
  const std::pair<c10::ScalarType, Dtype> types[] = {{torch::kBFloat16, Dtype::BFloat16}, {torch::kHalf, Dtype::Half}};
  for (const auto& [dtype, cpu_dtype] : types) {
    SCOPED_TRACE(c10::toString(dtype));
    const auto lp = values.to(dtype);
    // low precision -> fp32 with 1/scale, and accumulated
    auto out = torch::empty({n});
    EXPECT_FALSE(amp::detail::cpu::scale(cpu_dtype, lp.data_ptr(), Dtype::Float, out.data_ptr(), n, 0.25f, false) &&
                 torch::isfinite(lp).all().item<bool>());
    EXPECT_TRUE(amp_test::bitwise_equal(out, lp.to(torch::kFloat) * 0.25f));
    auto acc = torch::ones({n});
    amp::detail::cpu::scale(cpu_dtype, lp.data_ptr(), Dtype::Float, acc.data_ptr(), n, 0.5f, true);
    EXPECT_TRUE(amp_test::bitwise_equal(acc, torch::ones({n}) + lp.to(torch::kFloat) * 0.5f));
    // in place, rounding back to low precision
    auto inplace = lp.clone();
    amp::detail::cpu::scale(cpu_dtype, inplace.data_ptr(), cpu_dtype, inplace.data_ptr(), n, 0.125f, false);
    EXPECT_TRUE(amp_test::bitwise_equal(inplace, (lp.to(torch::kFloat) * 0.125f).to(dtype)));
    // fp32 masters -> model
    auto model = torch::empty({n}, dtype);
    amp::detail::cpu::convert(values.data_ptr<float>(), cpu_dtype, model.data_ptr(), n);
    EXPECT_TRUE(amp_test::bitwise_equal(model, values.to(dtype)));
    // inf / NaN anywhere is flagged
    for (int64_t at : {int64_t{0}, n / 2, n - 1}) {
      for (float bad : {INFINITY, -INFINITY, NAN}) {
        auto poisoned = lp.clone();
        poisoned[at] = bad;
        EXPECT_TRUE(amp::detail::cpu::scale(cpu_dtype, poisoned.data_ptr(), Dtype::Float, out.data_ptr(), n, 1.0f, false));
      }
    }
  }
}

// The read-only check GradScaler runs before a fused step: every dtype (float16's integer test included),
// inf or NaN at the first, a middle and the last element, strided tensors; the tensors are left unchanged.
TEST_P(UnscaleTest, CheckFiniteFindsInfAndNanAndChangesNothing) {
  // On the CPU amp's loop only reads: every bit stays. On CUDA the check is ATen's unscale kernel with a scale
  // of 1, which writes each value back unmultiplied but, for float16/bfloat16, through an fp32 round trip whose
  // conversions may canonicalize a NaN's payload: there every value and every bit of the non-NaNs must stay.
  const auto unchanged = [&](const torch::Tensor& now, const torch::Tensor& before) {
    const auto a = now.cpu(), b = before.cpu();
    if (!on_cuda()) return amp_test::bitwise_equal(a, b);
    return torch::equal(a.isnan(), b.isnan()) &&
           amp_test::bitwise_equal(a.masked_fill(a.isnan(), 0.0), b.masked_fill(b.isnan(), 0.0));
  };
  for (const auto dtype : {torch::kFloat, torch::kBFloat16, torch::kHalf}) {
    for (const int64_t n : {1, 7, 33, 70000}) {
      for (const int64_t at : {int64_t{0}, n / 2, n - 1}) {
        for (const float bad : {INFINITY, -INFINITY, NAN}) {
          auto t = torch::randn({n}).to(on(dtype));
          t[at] = bad;
          const auto before = t.clone();
          amp::detail::FoundInf found;
          amp::detail::check_finite({t, torch::ones({4, 4}, on(dtype)).t()}, found);
          EXPECT_TRUE(found.any()) << dtype << " n=" << n << " at " << at << " " << bad;
          EXPECT_TRUE(unchanged(t, before));
        }
      }
      amp::detail::FoundInf clean;
      amp::detail::check_finite({torch::full({n}, 65504.0).to(on(dtype)), torch::ones({4, 4}, on(dtype)).t()}, clean);
      EXPECT_FALSE(clean.any()) << dtype << " n=" << n << ": the largest finite float16 is finite";
    }
  }
}

AMP_INSTANTIATE_FOR_DEVICES(UnscaleTest);

// CUDA has no BFloat16 case in _amp_foreach_non_finite_check_and_unscale_ (pytorch #127176), so bf16 groups go
// through fp32 copies there (issue 19). Fp32UnscaleRouteGuard sends CPU bf16 groups the same way: the route must
// give the kernel's bits (the product in fp32, rounded once) and the same inf/NaN verdicts.
namespace {

struct RoutedRun {
  std::vector<torch::Tensor> tensors;
  std::vector<double> scales;
  int64_t routed;
};

// Runs `train` once on ATen's (or amp's CPU) path and once forced through fp32; returns both.
template <class Train>
std::pair<RoutedRun, RoutedRun> both_routes(Train train) {
  const int64_t before = amp::detail::Fp32UnscaleRouteGuard::groups_routed();
  RoutedRun plain = train();
  plain.routed = amp::detail::Fp32UnscaleRouteGuard::groups_routed() - before;
  amp::detail::Fp32UnscaleRouteGuard guard;
  RoutedRun routed = train();
  routed.routed = amp::detail::Fp32UnscaleRouteGuard::groups_routed() - before - plain.routed;
  return {plain, routed};
}

void expect_same_run(const std::pair<RoutedRun, RoutedRun>& runs, bool on_cuda) {
  const auto& [plain, routed] = runs;
  EXPECT_GT(routed.routed, 0) << "the fp32 route was not taken";
  if (!on_cuda) EXPECT_EQ(plain.routed, 0) << "CPU bf16 groups take the fused kernel unless forced";
  EXPECT_EQ(plain.scales, routed.scales);
  ASSERT_EQ(plain.tensors.size(), routed.tensors.size());
  for (size_t i = 0; i < plain.tensors.size(); ++i) {
    EXPECT_TRUE(amp_test::bitwise_equal(plain.tensors[i].cpu(), routed.tensors[i].cpu())) << "tensor " << i;
  }
}

}  // namespace

TEST_P(UnscaleTest, Bf16GroupsThroughFp32GiveTheKernelsBits) {
  for (const double inv : {1.0 / 65536.0, 1.0 / 3.0, 1.0, 3.0e38}) {
    for (const int64_t bad_at : {int64_t{-1}, int64_t{0}, int64_t{4999}}) {
      torch::manual_seed(7);
      const auto values = torch::randn({5000}) * 100.0;
      auto make = [&] {
        std::vector<torch::Tensor> grads = {values.to(on(torch::kBFloat16)),
                                            values.slice(0, 0, 1000).reshape({10, 100}).to(on(torch::kBFloat16)).t(),
                                            values.to(on(torch::kBFloat16)).slice(0, 0, 5000, 7)};
        if (bad_at >= 0) grads[0][bad_at] = NAN;
        return grads;
      };
      auto kernel = make(), routed = make();
      FoundInf kernel_found, routed_found;
      amp::detail::unscale_(kernel, inv, kernel_found);  // on CUDA this already is the route
      at::Tensor flag = routed_found.on(device());
      amp::detail::unscale_through_fp32_(routed, inv, flag);
      const bool expect_bad = bad_at >= 0;  // the kernel checks its inputs: 100 * 3e38 overflows but is no verdict
      EXPECT_EQ(kernel_found.any(), expect_bad) << inv;
      EXPECT_EQ(routed_found.any(), expect_bad) << inv;
      for (size_t i = 0; i < kernel.size(); ++i) {
        // The reference, computed here on the CPU: the fp32 product rounded once to bf16.
        const auto reference = (make()[i].cpu().to(torch::kFloat) * static_cast<float>(inv)).to(torch::kBFloat16);
        const auto nan_safe = [](const torch::Tensor& t) { return t.cpu().masked_fill(t.cpu().isnan(), 0.0); };
        EXPECT_TRUE(amp_test::bitwise_equal(nan_safe(routed[i]), nan_safe(reference))) << "tensor " << i << " inv " << inv;
        EXPECT_TRUE(amp_test::bitwise_equal(nan_safe(kernel[i]), nan_safe(reference))) << "tensor " << i << " inv " << inv;
      }
    }
  }
}

TEST_P(UnscaleTest, GradScalerOnBf16ParametersTakesTheFp32Route) {
  const auto runs = both_routes([&] {
    torch::manual_seed(3);
    amp_test::Mlp net;
    net->to(device(), torch::kBFloat16);
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    amp::GradScaler scaler(amp::GradScalerOptions().init_scale(1024.0).growth_interval(2));
    RoutedRun run;
    const auto x = torch::randn({8, 8}).to(on(torch::kBFloat16));
    for (int step = 0; step < 5; ++step) {
      sgd.zero_grad();
      auto loss = net(x).to(torch::kFloat).pow(2).mean() * (step == 2 ? INFINITY : 1.0);
      scaler.scale(loss).backward();
      scaler.step(sgd);
      scaler.update();
      run.scales.push_back(scaler.get_scale());
    }
    for (const auto& p : net->parameters()) run.tensors.push_back(p.detach().clone());
    return run;
  });
  expect_same_run(runs, on_cuda());
  EXPECT_EQ(runs.first.scales, (std::vector<double>{1024.0, 2048.0, 1024.0, 1024.0, 2048.0}));
}

TEST_P(UnscaleTest, O3Bf16WithADynamicScaleTakesTheFp32Route) {
  const auto runs = both_routes([&] {
    torch::manual_seed(4);
    amp_test::Mlp net;
    net->to(device());
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.05));
    auto [model, optimizer] = amp::initialize(net, std::move(sgd), amp::Options("O3").low_precision_dtype(torch::kBFloat16)
                                                                       .loss_scale(amp::LossScale::dynamic()).verbosity(0));
    RoutedRun run;
    const auto x = torch::randn({8, 8}).to(device());
    for (int step = 0; step < 4; ++step) {
      optimizer.zero_grad();
      auto loss = model(x).pow(2).mean() * (step == 1 ? INFINITY : 1.0);
      {
        auto scaled = amp::scale_loss(loss, optimizer);
        scaled.backward();
      }
      optimizer.step();
      run.scales.push_back(amp::loss_scale(optimizer));
    }
    for (const auto& p : net->parameters()) run.tensors.push_back(p.detach().clone());
    return run;
  });
  expect_same_run(runs, on_cuda());
  EXPECT_EQ(runs.first.scales, (std::vector<double>{65536.0, 32768.0, 32768.0, 32768.0}));
}

TEST_P(UnscaleTest, FusedOptimizerStepByGradScalerOnBf16GradientsTakesTheFp32Route) {
  const auto runs = both_routes([&] {
    torch::manual_seed(5);
    amp_test::Mlp net;
    net->to(device(), torch::kBFloat16);
    amp::optim::FusedAdam adam(net->parameters(), torch::optim::AdamOptions(0.01));
    amp::GradScaler scaler;
    RoutedRun run;
    const auto x = torch::randn({8, 8}).to(on(torch::kBFloat16));
    for (int step = 0; step < 3; ++step) {
      adam.zero_grad();
      auto loss = net(x).to(torch::kFloat).pow(2).mean() * (step == 1 ? INFINITY : 1.0);
      scaler.scale(loss).backward();
      scaler.step(adam);
      scaler.update();
      run.scales.push_back(scaler.get_scale());
    }
    for (const auto& p : net->parameters()) run.tensors.push_back(p.detach().clone());
    return run;
  });
  expect_same_run(runs, on_cuda());
  EXPECT_EQ(runs.first.scales, (std::vector<double>{65536.0, 32768.0, 32768.0}));
}
