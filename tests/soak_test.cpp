// Fault-injection soak: thousands of steps across random opt levels and dtypes, with inf/NaN injected
// in ~5% of steps into a random gradient (by a gradient hook, so it meets amp's unscale like a real
// overflow), a single element of the input, the loss, or one element of a large parameter's gradient.
// Every injected step must be skipped and change nothing, every clean step must apply, the scale must
// stay normal and within [min, max], and no weight may ever be non-finite.
//
// AMP_SOAK_STEPS sets the length (default 10000; CI's long mode runs more under a time budget).
#include <random>

#include "support/support.h"

namespace {

struct SoakNetImpl : torch::nn::Module {
  SoakNetImpl()
      : fc1(register_module("fc1", torch::nn::Linear(16, 32))),
        bn(register_module("bn", torch::nn::BatchNorm1d(32))),
        big(register_module("big", torch::nn::Linear(32, 512))),  // 16k-element weight: single-element injections
        fc2(register_module("fc2", torch::nn::Linear(512, 4))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(big(torch::relu(bn(fc1(x)))))); }
  torch::nn::Linear fc1;
  torch::nn::BatchNorm1d bn;
  torch::nn::Linear big, fc2;
};
TORCH_MODULE(SoakNet);

int64_t soak_steps() {
  const char* env = std::getenv("AMP_SOAK_STEPS");
  return env ? std::atoll(env) : 10000;
}

}  // namespace

TEST(SoakTest, InjectedOverflowsAreAlwaysSkippedAndCleanStepsAlwaysApplied) {
  const int64_t total_steps = soak_steps();
  std::mt19937_64 rng(20261129);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  const bool fp16 = amp_test::cpu_computes(torch::kHalf) && TORCH_VERSION_MAJOR >= 2;
  int64_t steps = 0, injected = 0, skipped = 0, natural_overflows = 0, segments = 0;
  std::map<std::string, int64_t> injections_by_kind;

  while (steps < total_steps) {
    // A segment: a fresh model at a random level, dtype, optimizer and scale range.
    const char* levels[] = {"O0", "O1", "O2", "O3"};
    const std::string level = levels[rng() % 4];
    const auto lp = fp16 && rng() % 2 ? torch::kHalf : torch::kBFloat16;
    const std::optional<double> min_scale = rng() % 2 ? std::optional<double>(64.0) : std::nullopt;
    // A dynamic scale at every level: O0/O3's default fixed scale of 1 checks nothing, like Apex. O3 keeps
    // BatchNorm fp32 here because an injected inf input poisons running statistics in any dtype, which
    // amp reports as an error for float16 statistics (see docs/batchnorm.md).
    auto options = amp::Options(level).low_precision_dtype(lp).verbosity(0).loss_scale(amp::LossScale::dynamic());
    if (level == "O3") options.keep_batchnorm_fp32(true);
    if (min_scale) options.min_loss_scale(*min_scale);
    const auto props = options.resolve();
    torch::manual_seed(rng());
    SoakNet net;
    const bool adam = rng() % 2;
    auto run_segment = [&](auto optimizer_in) {
      auto [model, optimizer] = amp::initialize(net, std::move(optimizer_in), options);
      for (int i = 0; i < 250 && steps < total_steps; ++i, ++steps) {
        auto x = torch::randn({16, 16});
        auto target = torch::randn({16, 4});
        const bool inject = uniform(rng) < 0.05;
        const int kind = static_cast<int>(rng() % 4);
        const double bad = rng() % 2 ? std::numeric_limits<double>::infinity() : std::nan("");
        torch::Tensor hooked;
        unsigned hook = 0;
        if (inject) {
          ++injected;
          static const char* names[] = {"gradient", "input element", "loss", "one element of a 16k gradient"};
          ++injections_by_kind[names[kind]];
          if (kind == 1) x[rng() % 16][rng() % 16] = bad;
          if (kind == 0 || kind == 3) {
            // A hook on the (model-dtype) parameter fires in backward, before amp unscales.
            hooked = kind == 0 ? net->parameters()[rng() % net->parameters().size()] : net->big->weight;
            const int64_t index = static_cast<int64_t>(rng() % static_cast<uint64_t>(hooked.numel()));
            hook = hooked.register_hook([bad, index](torch::Tensor g) {
              g = g.clone();
              g.view(-1)[index] = bad;
              return g;
            });
          }
        }
        std::vector<torch::Tensor> before;
        for (auto& p : amp::master_params(optimizer)) before.push_back(p.detach().clone());
        optimizer.zero_grad();
        auto loss = torch::mse_loss(model(x), target);
        if (inject && kind == 2) loss = loss * bad;
        bool overflow;
        {
          auto scaled = amp::scale_loss(loss, optimizer);
          scaled.backward();
          overflow = scaled.overflow();
        }
        const int64_t skipped_before = optimizer.skipped_steps();
        optimizer.step();
        if (hooked.defined()) hooked.remove_hook(hook);
        const bool was_skipped = optimizer.skipped_steps() > skipped_before;
        skipped += was_skipped;
        if (inject) {
          ASSERT_TRUE(was_skipped) << "step " << steps << " level " << level << ": an injected overflow was applied";
        }
        if (!inject) {
          natural_overflows += overflow;
          ASSERT_EQ(was_skipped, overflow) << "step " << steps;
        }
        const auto after = amp::master_params(optimizer);
        bool changed = false;
        for (size_t k = 0; k < after.size(); ++k) changed |= !torch::equal(after[k], before[k]);
        ASSERT_EQ(changed, !was_skipped) << "step " << steps << " level " << level;
        const double scale = amp::loss_scale(optimizer);
        ASSERT_TRUE(std::isnormal(static_cast<float>(scale))) << scale;
        ASSERT_LE(scale, props.max_loss_scale);
        if (min_scale) ASSERT_GE(scale, *min_scale);
      }
      for (auto& p : net->parameters()) ASSERT_TRUE(torch::isfinite(p).all().template item<bool>()) << "non-finite weight";
      for (auto& p : amp::master_params(optimizer)) ASSERT_TRUE(torch::isfinite(p).all().template item<bool>());
    };
    if (adam) run_segment(torch::optim::Adam(net->parameters(), torch::optim::AdamOptions(1e-3).eps(1e-4)));
    else run_segment(torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9)));
    ++segments;
  }
  std::cout << "soak: " << steps << " steps in " << segments << " segments, " << injected << " injected overflows ("
            << skipped << " skipped steps, " << natural_overflows << " natural overflows)";
  for (const auto& [kind, n] : injections_by_kind) std::cout << "; " << kind << " " << n;
  std::cout << std::endl;
  EXPECT_EQ(skipped, injected + natural_overflows);
  EXPECT_GT(injected, steps / 40);  // ~5%
}
