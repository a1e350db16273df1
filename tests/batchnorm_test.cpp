// BatchNorm under every level and dtype, on every device: BatchNorm1d/2d/3d x affine on/off x
// track_running_stats on/off x {train, eval, frozen}. Checks no dtype error (apex #122/#614/#121/#133), the
// dtypes each level promises, gradients flowing through eval-mode BN to the layers before it, frozen
// statistics never changing (skipped steps included), and results close to an fp32 reference.
#include "support/models.h"
#include "support/support.h"

namespace {

struct BnNetImpl : torch::nn::Module {
  BnNetImpl(int dims, bool affine, bool track) : dims(dims) {
    const int64_t c = 4;
    if (dims == 1) {
      pre = register_module("pre", torch::nn::Linear(6, c));
      bn = register_module("bn", torch::nn::BatchNorm1d(torch::nn::BatchNormOptions(c).affine(affine).track_running_stats(track)));
    } else if (dims == 2) {
      pre = register_module("pre", torch::nn::Conv2d(torch::nn::Conv2dOptions(2, c, 3).padding(1)));
      bn = register_module("bn", torch::nn::BatchNorm2d(torch::nn::BatchNormOptions(c).affine(affine).track_running_stats(track)));
    } else {
      pre = register_module("pre", torch::nn::Conv3d(torch::nn::Conv3dOptions(2, c, 3).padding(1)));
      bn = register_module("bn", torch::nn::BatchNorm3d(torch::nn::BatchNormOptions(c).affine(affine).track_running_stats(track)));
    }
  }
  torch::Tensor input(int64_t batch) const {
    if (dims == 1) return torch::randn({batch, 6}) * 3 + 1;
    if (dims == 2) return torch::randn({batch, 2, 5, 5}) * 3 + 1;
    return torch::randn({batch, 2, 3, 4, 4}) * 3 + 1;
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return bn.forward<torch::Tensor>(pre.forward<torch::Tensor>(x));
  }
  int dims;
  torch::nn::AnyModule pre, bn;
  torch::nn::Module& bn_module() { return *named_children()["bn"]; }
};
TORCH_MODULE(BnNet);

class BatchNormMatrixTest : public amp_test::LevelTest {};

class BatchNormTest : public amp_test::DeviceTest {};

std::vector<torch::Tensor> stats(torch::nn::Module& bn) {
  std::vector<torch::Tensor> out;
  for (auto& b : bn.buffers()) out.push_back(b.clone());
  return out;
}

}  // namespace

TEST_P(BatchNormMatrixTest, EveryVariantAndMode) {
  const char* level = GetParam().level;
  const auto lp = GetParam().dtype;
  const auto props = amp::Options(level).low_precision_dtype(lp).verbosity(0).resolve();
  const bool bn_fp32 = props.opt_level != amp::OptLevel::O3;
  for (int dims : {1, 2, 3}) {
    for (bool affine : {true, false}) {
      for (bool track : {true, false}) {
        for (const std::string mode : {"train", "eval", "frozen"}) {
          SCOPED_TRACE("BatchNorm" + std::to_string(dims) + "d affine=" + std::to_string(affine) +
                       " track=" + std::to_string(track) + " mode=" + mode);
          torch::manual_seed(dims * 100 + affine * 10 + track);
          BnNet net(dims, affine, track), reference(dims, affine, track);
          {
            torch::NoGradGuard no_grad;
            for (size_t i = 0; i < net->parameters().size(); ++i) reference->parameters()[i].copy_(net->parameters()[i]);
          }
          net->to(device());
          reference->to(device());
          if (mode == "frozen") amp::freeze_batchnorm(*net);
          torch::optim::SGD sgd(net->parameters(), 0.01);
          auto [model, optimizer] = amp::initialize(net, std::move(sgd), amp::Options(level).low_precision_dtype(lp).verbosity(0));
          if (mode == "eval") model.eval();
          else model.train();
          if (mode != "train") reference->bn_module().eval();

          // Dtypes as the level promises: BN parameters and buffers fp32 except at O3, where only frozen
          // layers stay fp32 (their pretrained statistics must not be rounded).
          const auto bn_dtype = bn_fp32 || mode == "frozen" ? torch::kFloat : lp;
          for (auto& t : net->bn_module().parameters()) EXPECT_EQ(t.scalar_type(), bn_dtype);
          for (auto& t : net->bn_module().buffers()) {
            if (t.is_floating_point()) EXPECT_EQ(t.scalar_type(), bn_dtype);
          }
          const auto before = stats(net->bn_module());
          const auto x = net->input(8).to(device());
          torch::Tensor y;
          ASSERT_NO_THROW(y = model(x));
          EXPECT_EQ(y.scalar_type(), torch::kFloat);
          const auto y_ref = reference(x);
          // The error is rounding the inputs, weights and outputs to `lp` (the same on every device; CUDA
          // accumulates fp16/bf16 convolutions and GEMMs in fp32, as the CPU does).
          const double tol = props.opt_level == amp::OptLevel::O0 ? 1e-5 : (lp == torch::kHalf ? 2e-2 : 1e-1);
          EXPECT_TRUE(torch::allclose(y, y_ref, tol, tol)) << (y - y_ref).abs().max().item<double>();

          optimizer.zero_grad();
          {
            auto scaled = amp::scale_loss(y.pow(2).mean(), optimizer);
            ASSERT_NO_THROW(scaled.backward());
          }
          // Gradients reach the layer before BN, in train and eval mode alike.
          const auto pre_weight_grad = amp::master_params(optimizer)[0].grad();
          ASSERT_TRUE(pre_weight_grad.defined());
          EXPECT_GT(pre_weight_grad.abs().sum().item<double>(), 0.0);
          optimizer.step();
          // An overflowing step: skipped (dynamic levels) without touching frozen statistics.
          optimizer.zero_grad();
          {
            auto scaled = amp::scale_loss(model(x).pow(2).mean() * INFINITY, optimizer);
            scaled.backward();
          }
          optimizer.step();
          if (mode == "frozen" || (mode == "eval" && track)) {
            const auto after = stats(net->bn_module());
            for (size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(torch::equal(after[i], before[i])) << "buffer " << i;
          }
          if (mode == "frozen") {
            EXPECT_FALSE(net->bn_module().is_training());
            for (auto& p : net->bn_module().parameters()) EXPECT_FALSE(p.grad().defined());
          }
        }
      }
    }
  }
}

AMP_INSTANTIATE_FOR_LEVELS(BatchNormMatrixTest, amp_test::level_cases());

TEST_P(BatchNormTest, CastFrozenBatchNormIsAnExplicitOptionWithItsPrecisionCost) {
  for (bool cast : {false, true}) {
    amp_test::ConvBnNet net;
    {
      torch::NoGradGuard no_grad;
      net->bn->running_var.uniform_(0.5, 3.0);  // "pretrained" statistics
      net->bn->running_mean.uniform_(-1.0, 1.0);
    }
    net->to(device());
    const auto var = net->bn->running_var.clone();
    amp::freeze_batchnorm(*net);
    torch::optim::SGD sgd(net->fc->parameters(), 0.1);
    auto [model, optimizer] = amp::initialize(
        net, std::move(sgd), amp::Options("O2").low_precision_dtype(torch::kBFloat16).cast_frozen_batchnorm(cast).verbosity(0));
    EXPECT_EQ(net->bn->weight.scalar_type(), cast ? torch::kBFloat16 : torch::kFloat);
    EXPECT_EQ(net->bn->running_var.scalar_type(), cast ? torch::kBFloat16 : torch::kFloat);
    // The default keeps the statistics exactly; the tutorials' cast rounds them to 8 bits of mantissa.
    EXPECT_EQ(torch::equal(net->bn->running_var.to(torch::kFloat), var), !cast);
    EXPECT_NO_THROW(model(torch::randn({4, 1, 8, 8}).to(device())));
  }
  ASSERT_THROWS_WITH(amp::Options("O1").cast_frozen_batchnorm(true).resolve(), "applies at O2 and O3 only (got opt_level O1)");
}

TEST_P(BatchNormTest, Float16RunningStatisticsNeverOverflowSilently) {
  if (!on_cuda()) SKIP_WITHOUT_CPU_KERNELS(torch::kHalf);
  // momentum 0.1 x batch variance ~5e6 > 65504 (pytorch #115500)
  const auto huge = (torch::randn({8, 1, 8, 8}) * 4000).to(device());
  {
    amp_test::ConvBnNet net;
    net->to(device());
    torch::optim::SGD sgd(net->parameters(), 0.1);
    auto [model, optimizer] = amp::initialize(net, std::move(sgd), amp::Options("O3").low_precision_dtype(torch::kHalf).verbosity(0));
    ASSERT_THROWS_WITH(model(huge), "a BatchNorm running statistic overflowed float16");
    ASSERT_THROWS_WITH(model(huge), "keep_batchnorm_fp32(true)");
  }
  for (const auto& options : {amp::Options("O2").low_precision_dtype(torch::kHalf),
                              amp::Options("O3").low_precision_dtype(torch::kHalf).keep_batchnorm_fp32(true),
                              amp::Options("O3").low_precision_dtype(torch::kBFloat16)}) {
    amp_test::ConvBnNet net;
    net->to(device());
    torch::optim::SGD sgd(net->parameters(), 0.1);
    auto [model, optimizer] = amp::initialize(net, std::move(sgd), amp::Options(options).verbosity(0));
    EXPECT_NO_THROW(model(huge));
    EXPECT_TRUE(torch::isfinite(net->bn->running_var).all().item<bool>());
  }
}

AMP_INSTANTIATE_FOR_DEVICES(BatchNormTest);
