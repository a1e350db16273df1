// amp::checkpoint: gradients, losses and random draws equal to the run without checkpointing, bit for bit
// (recompute repeats the same kernels on the same values), at every level and dtype; the activations are
// really dropped; the errors a script can run into.
// Ported from PyTorch's test/test_utils.py (TestCheckpoint: test_checkpoint_rng_cpu, test_checkpoint_no_tensors,
// test_checkpoint_non_tensor_inputs_outputs (tuple outputs), test_checkpoint_not_preserve_rng_state's inverse,
// test_checkpointing_without_reentrant_input_requires_grad_False, _True) and test/test_autograd.py
// (test_checkpointing_without_reentrant_early_free's intent: activations not kept; test_checkpoint_valid's
// double backward refusal; test_checkpointing_without_reentrant_nested).

#include "../examples/common/memory_meter.h"
#include "support/support.h"

namespace {

// Linear -> GELU -> Dropout -> Linear with a residual, LayerNorm first (an fp32 op in O1's lists).
struct CkptBlockImpl : torch::nn::Module {
  explicit CkptBlockImpl(int64_t width)
      : norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})))),
        fc1(register_module("fc1", torch::nn::Linear(width, 4 * width))),
        fc2(register_module("fc2", torch::nn::Linear(4 * width, width))),
        drop(register_module("drop", torch::nn::Dropout(0.25))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return x + fc2(drop(torch::gelu(fc1(norm(x)))));
  }
  torch::nn::LayerNorm norm;
  torch::nn::Linear fc1, fc2;
  torch::nn::Dropout drop;
};
TORCH_MODULE(CkptBlock);

// An input layer (checkpointed on an input that does not require grad), blocks, a head.
struct CkptNetImpl : torch::nn::Module {
  CkptNetImpl(bool checkpointed, int64_t blocks = 3, int64_t width = 16)
      : checkpointed(checkpointed),
        in(register_module("in", torch::nn::Linear(8, width))),
        layers(register_module("layers", torch::nn::ModuleList())),
        head(register_module("head", torch::nn::Linear(width, 4))) {
    for (int64_t i = 0; i < blocks; ++i) layers->push_back(CkptBlock(width));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor h = checkpointed ? amp::checkpoint(in, x) : in(x);
    for (const auto& layer : *layers) {
      CkptBlock block(std::dynamic_pointer_cast<CkptBlockImpl>(layer));
      h = checkpointed ? amp::checkpoint(block, h) : block(h);
    }
    return head(h);
  }
  bool checkpointed;
  torch::nn::Linear in;
  torch::nn::ModuleList layers;
  torch::nn::Linear head;
};
TORCH_MODULE(CkptNet);

std::vector<torch::Tensor> ckpt_grads(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& p : m.parameters()) out.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
  return out;
}

void expect_same_tensors(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b,
                         const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].defined(), b[i].defined()) << what << " " << i;
    if (a[i].defined()) EXPECT_TRUE(amp_test::bitwise_equal(a[i], b[i])) << what << " " << i;
  }
}

class ActivationCheckpointLevelTest : public amp_test::LevelTest {};

// Three SGD steps with dynamic loss scaling, checkpointed and not: every loss, gradient and parameter is
// bitwise equal, and the RNG continues from the same state (recompute replayed the dropout draws and gave
// the generator back).
TEST_P(ActivationCheckpointLevelTest, TrainingIsBitwiseTheSameAsWithoutCheckpointing) {
  struct Run {
    Run(bool checkpointed, const amp::Options& options, torch::Device device) {
      torch::manual_seed(0);
      net = CkptNet(checkpointed);
      net->to(device);
      auto initialized = amp::initialize(
          net, torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9)), options);
      model.emplace(std::move(initialized.model));
      optimizer.emplace(std::move(initialized.optimizer));
    }
    CkptNet net{nullptr};
    std::optional<amp::Model<CkptNet>> model;
    std::optional<amp::Optimizer<torch::optim::SGD>> optimizer;
  };
  Run plain(false, options(), device()), checkpointed(true, options(), device());
  for (int step = 0; step < 3; ++step) {
    std::vector<torch::Tensor> losses, after;
    for (Run* run : {&plain, &checkpointed}) {
      torch::manual_seed(100 + step);
      const auto x = torch::randn({32, 8}, device()), y = torch::randint(0, 4, {32}, torch::TensorOptions(device()).dtype(torch::kLong));
      run->optimizer->zero_grad();
      auto loss = torch::nn::functional::cross_entropy((*run->model)(x).to(torch::kFloat), y);
      {
        auto scaled = amp::scale_loss(loss, *run->optimizer);
        scaled.backward();
      }
      losses.push_back(loss.detach());
      after.push_back(torch::rand({4}, device()));  // where the generator stands after backward
      run->optimizer->step();
    }
    EXPECT_TRUE(amp_test::bitwise_equal(losses[0], losses[1])) << "step " << step;
    EXPECT_TRUE(amp_test::bitwise_equal(after[0], after[1])) << "step " << step;
  }
  expect_same_tensors(ckpt_grads(*plain.net), ckpt_grads(*checkpointed.net), "gradient");
  std::vector<torch::Tensor> a, b;
  for (const auto& p : plain.net->parameters()) a.push_back(p.detach());
  for (const auto& p : checkpointed.net->parameters()) b.push_back(p.detach());
  expect_same_tensors(a, b, "parameter");
  EXPECT_EQ(plain.optimizer->loss_scaler().loss_scale(), checkpointed.optimizer->loss_scaler().loss_scale());
}

AMP_INSTANTIATE_FOR_LEVELS(ActivationCheckpointLevelTest, amp_test::level_cases());

// The fixture of the plain-autograd cases: fp32, CPU.
class ActivationCheckpointTest : public ::testing::Test {};

TEST_F(ActivationCheckpointTest, DropsTheActivationsAndKeepsOnlyTheInputs) {
  MemoryMeter& meter = MemoryMeter::install();
  torch::manual_seed(0);
  CkptNet plain(false, 6, 64);
  torch::manual_seed(0);
  CkptNet checkpointed(true, 6, 64);
  const auto x = torch::randn({256, 8});
  auto held_after_forward = [&](CkptNet& net) {
    torch::manual_seed(1);
    const size_t before = meter.current_bytes();
    auto loss = net(x).sum();
    const size_t held = meter.current_bytes() - before;
    loss.backward();
    return held;
  };
  const size_t plain_bytes = held_after_forward(plain), checkpointed_bytes = held_after_forward(checkpointed);
  // A block keeps its input (256 x 64 fp32, 64 KiB) and the head's; plain autograd keeps ~10 tensors a block.
  EXPECT_LT(checkpointed_bytes * 4, plain_bytes) << "checkpointed " << checkpointed_bytes << " B, plain " << plain_bytes;
  expect_same_tensors(ckpt_grads(*plain), ckpt_grads(*checkpointed), "gradient");
}

TEST_F(ActivationCheckpointTest, ParametersGetGradientsWhenNoInputRequiresGrad) {
  torch::manual_seed(0);
  torch::nn::Linear linear(8, 4);
  const auto x = torch::randn({16, 8});
  linear(x).pow(2).sum().backward();
  const auto expected = ckpt_grads(*linear);
  linear->zero_grad();
  auto y = amp::checkpoint(linear, x);
  ASSERT_TRUE(y.requires_grad());
  y.pow(2).sum().backward();
  expect_same_tensors(expected, ckpt_grads(*linear), "gradient");
}

TEST_F(ActivationCheckpointTest, TupleOutputsSeveralInputsAndAnUnusedOutput) {
  torch::manual_seed(0);
  torch::nn::Linear linear(6, 6);
  const auto a = torch::randn({5, 6}, torch::requires_grad()), b = torch::randn({5, 6});
  const auto index = torch::tensor({4, 0, 2}, torch::kLong);
  auto fn = [linear](const torch::Tensor& p, const torch::Tensor& q, const torch::Tensor& i) mutable {
    auto h = torch::tanh(linear->forward(p * q));
    return std::make_tuple(h.index_select(0, i), h.sum(1), i + 1);
  };
  auto [first, unused, shifted] = fn(a, b, index);
  (first * 3).sum().backward();
  const auto expected_params = ckpt_grads(*linear);
  const auto expected_a = a.grad().clone();
  linear->zero_grad();
  a.mutable_grad().reset();

  auto [first2, unused2, shifted2] = amp::checkpoint(fn, a, b, index);
  EXPECT_TRUE(amp_test::bitwise_equal(first, first2));
  EXPECT_TRUE(amp_test::bitwise_equal(unused, unused2));
  EXPECT_TRUE(torch::equal(shifted, shifted2));
  EXPECT_FALSE(shifted2.requires_grad());  // integer outputs carry no gradient
  (first2 * 3).sum().backward();
  expect_same_tensors(expected_params, ckpt_grads(*linear), "parameter gradient");
  EXPECT_TRUE(amp_test::bitwise_equal(expected_a, a.grad()));
  EXPECT_FALSE(b.grad().defined());
}

TEST_F(ActivationCheckpointTest, NestedCheckpointsRecomputeInsideRecompute) {
  torch::manual_seed(0);
  CkptBlock inner(8), outer(8);
  const auto x = torch::randn({4, 8}, torch::requires_grad());
  auto plain = [&] { return outer(inner(x)); };
  torch::manual_seed(3);
  plain().sum().backward();
  const auto expected = ckpt_grads(*inner), expected_outer = ckpt_grads(*outer);
  const auto expected_x = x.grad().clone();
  inner->zero_grad(), outer->zero_grad(), x.mutable_grad().reset();

  torch::manual_seed(3);
  auto y = amp::checkpoint([inner, outer](const torch::Tensor& h) mutable { return outer->forward(amp::checkpoint(inner, h)); }, x);
  y.sum().backward();
  expect_same_tensors(expected, ckpt_grads(*inner), "inner gradient");
  expect_same_tensors(expected_outer, ckpt_grads(*outer), "outer gradient");
  EXPECT_TRUE(amp_test::bitwise_equal(expected_x, x.grad()));
}

torch::nn::Sequential bn_block() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(8, 8), torch::nn::BatchNorm1d(8), torch::nn::ReLU());
}

std::vector<torch::Tensor> ckpt_buffers(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& b : m.buffers()) out.push_back(b.clone());
  return out;
}

TEST_F(ActivationCheckpointTest, TrainingBatchNormStatisticsMoveOnceWhenFnIsTheModule) {
  const auto x = torch::randn({16, 8});
  auto plain = bn_block();
  plain->forward(x).sum().backward();
  auto checkpointed = bn_block();
  amp::checkpoint(checkpointed, x).sum().backward();
  expect_same_tensors(ckpt_buffers(*plain), ckpt_buffers(*checkpointed), "buffer");
  expect_same_tensors(ckpt_grads(*plain), ckpt_grads(*checkpointed), "gradient");
  EXPECT_EQ(checkpointed[1]->as<torch::nn::BatchNorm1d>()->num_batches_tracked.item<int64_t>(), 1);
}

// DESIGN 1c: once per forward, whatever fn is. A lambda over the module, a lambda over F::batch_norm with its own
// statistics tensors, and a cumulative-average BatchNorm (momentum None, which reads num_batches_tracked): the
// statistics, the batch count and the gradients equal the run without checkpointing, bit for bit.
TEST_F(ActivationCheckpointTest, TrainingBatchNormStatisticsMoveOnceWhateverFnIs) {
  const auto x = torch::randn({16, 8});
  {
    auto plain = bn_block(), checkpointed = bn_block();
    plain->forward(x).sum().backward();
    amp::checkpoint([checkpointed](const torch::Tensor& h) mutable { return checkpointed->forward(h); }, x).sum().backward();
    EXPECT_EQ(checkpointed[1]->as<torch::nn::BatchNorm1d>()->num_batches_tracked.item<int64_t>(), 1);
    expect_same_tensors(ckpt_buffers(*plain), ckpt_buffers(*checkpointed), "lambda over the module: buffer");
    expect_same_tensors(ckpt_grads(*plain), ckpt_grads(*checkpointed), "lambda over the module: gradient");
  }
  {
    torch::manual_seed(0);
    const auto weight = torch::randn({8}, torch::requires_grad()), bias = torch::randn({8}, torch::requires_grad());
    const auto mean = torch::zeros({8}), var = torch::ones({8});
    const auto mean_ckpt = mean.clone(), var_ckpt = var.clone();
    namespace F = torch::nn::functional;
    auto bn = [weight, bias](const torch::Tensor& h, const torch::Tensor& m, const torch::Tensor& v) {
      return F::batch_norm(h, m, v, F::BatchNormFuncOptions().weight(weight).bias(bias).training(true).momentum(0.3));
    };
    bn(x, mean, var).pow(2).sum().backward();
    const std::vector<torch::Tensor> expected = {weight.grad().clone(), bias.grad().clone()};
    weight.mutable_grad().reset(), bias.mutable_grad().reset();
    amp::checkpoint([bn, mean_ckpt, var_ckpt](const torch::Tensor& h) { return bn(h, mean_ckpt, var_ckpt); }, x)
        .pow(2).sum().backward();
    expect_same_tensors({mean, var}, {mean_ckpt, var_ckpt}, "F::batch_norm: statistic");
    expect_same_tensors(expected, {weight.grad(), bias.grad()}, "F::batch_norm: gradient");
  }
  {
    const auto cumulative = [] {
      torch::manual_seed(0);
      return torch::nn::Sequential(torch::nn::Linear(8, 8),
                                   torch::nn::BatchNorm1d(torch::nn::BatchNormOptions(8).momentum(c10::nullopt)));
    };
    auto plain = cumulative(), checkpointed = cumulative();
    for (int step = 0; step < 3; ++step) {
      plain->forward(x * (step + 1)).sum().backward();
      amp::checkpoint([checkpointed](const torch::Tensor& h) mutable { return checkpointed->forward(h); }, x * (step + 1))
          .sum().backward();
    }
    EXPECT_EQ(checkpointed[1]->as<torch::nn::BatchNorm1d>()->num_batches_tracked.item<int64_t>(), 3);
    expect_same_tensors(ckpt_buffers(*plain), ckpt_buffers(*checkpointed), "momentum None: buffer");
    expect_same_tensors(ckpt_grads(*plain), ckpt_grads(*checkpointed), "momentum None: gradient");
  }
}

TEST_F(ActivationCheckpointTest, FrozenBatchNormKeepsItsStatisticsThroughRecompute) {
  const auto x = torch::randn({16, 8});
  auto plain = bn_block(), checkpointed = bn_block();
  amp::freeze_batchnorm(*plain);
  amp::freeze_batchnorm(*checkpointed);
  const auto pretrained = ckpt_buffers(*checkpointed);
  plain->forward(x).sum().backward();
  amp::checkpoint([checkpointed](const torch::Tensor& h) mutable { return checkpointed->forward(h); }, x).sum().backward();
  expect_same_tensors(pretrained, ckpt_buffers(*checkpointed), "buffer");
  expect_same_tensors(ckpt_grads(*plain), ckpt_grads(*checkpointed), "gradient");
}

TEST_F(ActivationCheckpointTest, WithoutGradModeFnRunsOnceAndNothingIsRecorded) {
  torch::nn::Linear linear(4, 4);
  int calls = 0;
  torch::NoGradGuard no_grad;
  auto y = amp::checkpoint([linear, &calls](const torch::Tensor& x) mutable { return ++calls, linear->forward(x); }, torch::ones({2, 4}));
  EXPECT_EQ(calls, 1);
  EXPECT_FALSE(y.requires_grad());
}

TEST_F(ActivationCheckpointTest, RetainGraphAllowsASecondBackwardAndItsAbsenceIsNamed) {
  torch::nn::Linear linear(4, 4);
  const auto x = torch::randn({2, 4}, torch::requires_grad());
  auto loss = amp::checkpoint(linear, x).sum();
  loss.backward({}, /*retain_graph=*/true);
  const auto once = linear->weight.grad().clone();
  loss.backward();
  EXPECT_TRUE(torch::allclose(linear->weight.grad(), 2 * once));
  ASSERT_THROWS_WITH(loss.backward(), "backward ran through a checkpoint a second time");
}

TEST_F(ActivationCheckpointTest, RefusesACapturedActivationNamingTheFix) {
  torch::nn::Linear linear(4, 4);
  const auto x = torch::randn({2, 4}, torch::requires_grad());
  const auto activation = x * 2;  // computed before the checkpoint, requires grad
  ASSERT_THROWS_WITH(
      amp::checkpoint([linear, activation](const torch::Tensor& h) mutable { return linear->forward(h + activation); }, x),
      "fn reads a tensor that requires grad and was computed before the checkpoint (its grad_fn is MulBackward");
  ASSERT_THROWS_WITH(
      amp::checkpoint([linear, activation](const torch::Tensor& h) mutable { return linear->forward(h + activation); }, x),
      "Pass that tensor to amp::checkpoint as an input");
  // The fix: the same tensor as an input.
  auto y = amp::checkpoint([linear](const torch::Tensor& h, const torch::Tensor& a) mutable { return linear->forward(h + a); }, x,
                           activation);
  y.sum().backward();
  EXPECT_TRUE(x.grad().defined());
}

TEST_F(ActivationCheckpointTest, RefusesAnInputModifiedInPlaceBeforeBackward) {
  torch::nn::Linear linear(4, 4);
  auto x = torch::randn({2, 4});
  auto y = amp::checkpoint(linear, x);
  x.add_(1);
  ASSERT_THROWS_WITH(y.sum().backward(),
                     "input 0 was modified in place after the checkpointed forward (version 0 -> 1)");
}

TEST_F(ActivationCheckpointTest, RefusesDoubleBackward) {
  torch::nn::Linear linear(4, 4);
  const auto x = torch::randn({2, 4}, torch::requires_grad());
  auto y = amp::checkpoint(linear, x).pow(2).sum();
  ASSERT_THROWS_WITH(torch::autograd::grad({y}, {x}, {}, true, /*create_graph=*/true),
                     "double backward (create_graph=true) through a checkpoint is not supported");
}

TEST_F(ActivationCheckpointTest, RefusesAFnThatReturnsADifferentNumberOfTensorsOnRecompute) {
  torch::nn::Linear linear(4, 4);
  int calls = 0;
  auto fn = [linear, calls](const torch::Tensor& x) mutable {
    std::vector<torch::Tensor> out{linear->forward(x)};
    if (++calls > 1) out.push_back(x);
    return out;
  };
  auto outs = amp::checkpoint(fn, torch::randn({2, 4}));
  ASSERT_EQ(outs.size(), 1u);
  ASSERT_THROWS_WITH(outs[0].sum().backward(), "fn returned 2 tensors when recomputed and 1 on the first run");
}

}  // namespace
