// Optimizer states in bf16 and 8 bits (amp::OptimizerStateFormat, NOTE [Optimizer state formats] in
// src/optim/state_format.h): torchao's maps and each 8-bit step from the same state (codes equal), a 20-step run
// beside torchao's AdamW8bit (tests/python/state_formats.py, at test time), bf16's stochastic rounding (torchao's
// test_bf16_stochastic_round, ported), every master format and level, skipped steps, resume, Python checkpoints,
// training quality against fp32 moments and O3's stall, bytes per parameter, and the errors.
//
// Ported from torchao's test/test_low_bit_optim.py: test_bf16_stochastic_round (the mean of 100k stochastic
// roundings within 3e-5), test_optim_8bit_correctness (the 8-bit step against a reference, here torchao itself).

#include <amp/amp.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "optim/cpu_optimizer_kernels.h"
#include "optim/fused_route.h"
#include "optim/fused_step_context.h"
#include "optim/optimizer_state_key.h"
#include "optim/state_format.h"
#include "optim/stochastic_rounding_ops.h"
#include "support/data.h"
#include "support/support.h"

namespace {

namespace fs = std::filesystem;
using amp::OptimizerStateFormat;
using amp::detail::Moment;

// ---- helpers ---------------------------------------------------------------------------------------

fs::path sf_dir(const std::string& name) {
  const fs::path dir = fs::path(::testing::TempDir()) / ("state_format_" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// Runs tests/python/state_formats.py MODE DIR under its own time limit (a hang fails here, named); returns its exit
// status (3: torchao is not importable, 124: it ran past 300 s). The references (maps, steps, run: Python computes
// from the inputs C++ wrote) run once per test command; resume, a round trip Python checks, runs every time.
int sf_python(const std::string& mode, const fs::path& dir) {
  const char* const script = AMP_SOURCE_DIR "/tests/python/state_formats.py";
  if (mode == "resume") {
    const std::string command = "timeout 300 " + amp_test::python_interpreter() + " '" + script + "' " + mode + " '" +
                                dir.string() + "' > '" + (dir / "python.log").string() + "' 2>&1";
    const int status = std::system(command.c_str());
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }
  std::vector<std::string> inputs;
  if (fs::exists(dir / (mode + "_in.pt"))) inputs.push_back(mode + "_in.pt");
  return amp_test::run_python(script, {mode}, dir, inputs);
}

#define SF_RUN_PYTHON(mode, dir)                                                                        \
  do {                                                                                                 \
    if (!amp_test::python_has_torch()) GTEST_SKIP() << "no Python torch to compute the reference";     \
    const int rc = sf_python(mode, dir);                                                               \
    if (rc == 3) GTEST_SKIP() << "torchao==0.18.0 is not installed (scripts/setup.sh installs it)";    \
    std::ifstream log((dir) / "python.log");                                                           \
    ASSERT_EQ(rc, 0) << std::string(std::istreambuf_iterator<char>(log), {});                          \
  } while (0)

// A packed 8-bit moment's codes and scales (NOTE [Optimizer state formats]).
torch::Tensor codes_of(const torch::Tensor& packed, int64_t n) { return packed.narrow(0, 0, n); }
torch::Tensor scales_of(const torch::Tensor& packed, int64_t n) {
  return packed.narrow(0, n, packed.numel() - n).contiguous().view(torch::kFloat);
}

// The largest difference in ulps of the reference tensor's largest magnitude.
double sf_ulps(const torch::Tensor& a, const torch::Tensor& b) {
  const double scale = b.abs().max().item<double>();
  if (scale == 0) return (a - b).abs().max().item<double>() == 0 ? 0 : INFINITY;
  const double ulp = std::ldexp(1.0, std::ilogb(scale) - 23);
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>() / ulp;
}

// Moment k (0 exp_avg, 1 exp_avg_sq, 2 max_exp_avg_sq) of an Adam or AdamW state.
torch::Tensor& sf_field(torch::optim::OptimizerParamState& state, size_t k) {
  if (auto* s = dynamic_cast<torch::optim::AdamWParamState*>(&state)) return k == 0 ? s->exp_avg() : k == 1 ? s->exp_avg_sq() : s->max_exp_avg_sq();
  auto& a = dynamic_cast<torch::optim::AdamParamState&>(state);
  return k == 0 ? a.exp_avg() : k == 1 ? a.exp_avg_sq() : a.max_exp_avg_sq();
}

template <class Opt>
void set_format(Opt& optimizer, OptimizerStateFormat format, uint64_t seed = 0) {
  optimizer.step_context().set_state_format(std::make_shared<amp::detail::StateFormat>(format, seed));
}

// The classification MLP the composition tests train: a 64x128 layer (8192 values: 8-bit), a 128x4 layer (512: fp32
// in the 8-bit format, as torchao keeps tensors under 4096) and their biases.
struct SfNet : torch::nn::Module {
  SfNet() : a(register_module("a", torch::nn::Linear(64, 128))), b(register_module("b", torch::nn::Linear(128, 4))) {}
  torch::Tensor forward(const torch::Tensor& x) { return b(torch::relu(a(x))); }
  torch::nn::Linear a, b;
};

std::shared_ptr<SfNet> sf_net() {
  torch::manual_seed(5);
  return std::make_shared<SfNet>();
}

amp::Options sf_options(const std::string& level, c10::ScalarType dtype, OptimizerStateFormat format) {
  return amp::Options(level).low_precision_dtype(dtype).optimizer_state_format(format).verbosity(0);
}

template <class Model, class Optimizer>
double sf_step(Model& model, Optimizer& optimizer, const torch::Tensor& x, const torch::Tensor& y, bool overflow = false) {
  optimizer.zero_grad();
  const auto loss = torch::nn::functional::cross_entropy(model(x), y);
  {
    auto scaled = amp::scale_loss(overflow ? loss * std::numeric_limits<float>::infinity() : loss, optimizer);
    scaled.backward();
  }
  optimizer.step();
  return loss.template item<double>();
}

// Every moment tensor of `optimizer`'s state, in param_groups order (exp_avg, exp_avg_sq[, max_exp_avg_sq]).
template <class Optimizer>
std::vector<torch::Tensor> sf_moments(Optimizer& optimizer) {
  std::vector<torch::Tensor> out;
  auto& state = optimizer.state();
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      const auto it = state.find(amp::detail::state_key(state, p));
      if (it == state.end()) continue;
      if (auto* s = dynamic_cast<torch::optim::AdamWParamState*>(it->second.get())) {
        out.push_back(s->exp_avg()), out.push_back(s->exp_avg_sq());
      } else if (auto* s = dynamic_cast<torch::optim::AdamParamState*>(it->second.get())) {
        out.push_back(s->exp_avg()), out.push_back(s->exp_avg_sq());
      } else if (auto* s = dynamic_cast<amp::optim::FusedLAMBParamState*>(it->second.get())) {
        out.push_back(s->exp_avg()), out.push_back(s->exp_avg_sq());
      }
    }
  }
  return out;
}

// ---- against torchao -------------------------------------------------------------------------------

// Whether the reference ran on this build's LibTorch version (the 1.13 flavor's Python torch is the 2.13 wheel).
bool sf_same_torch(const amp::PythonCheckpoint& reference) {
  const std::string version = reference.get("torch_version").toStringRef();
  return version.substr(0, version.find('+')) == TORCH_VERSION;
}

// The maps come from ATen's linspace and fp32 products, as torchao's create_dynamic_map computes them: on the same
// LibTorch, torchao's bit for bit. Another LibTorch's linspace may round an entry differently (1.13's does).
TEST(StateFormatReferenceTest, QuantizationMapsAreTorchaos) {
  const auto dir = sf_dir("maps");
  SF_RUN_PYTHON("maps", dir);
  const auto reference = amp::PythonCheckpoint::load((dir / "maps.pt").string());
  for (const auto& [key, moment] : {std::make_pair("signed", Moment::kSigned), std::make_pair("unsigned", Moment::kUnsigned)}) {
    const auto& map = amp::detail::quantization_map(moment);
    const auto mine = torch::from_blob(const_cast<float*>(map.data()), {256}, torch::kFloat);
    const auto theirs = reference.get(key).toTensor();
    if (sf_same_torch(reference)) {
      EXPECT_TRUE(amp_test::bitwise_equal(mine, theirs)) << key;
    } else {
      std::cout << "[ measured ] " << key << " map against torchao on torch " << reference.get("torch_version").toStringRef()
                << ": " << mine.ne(theirs).sum().item<int64_t>() << " of 256 entries differ" << std::endl;
      EXPECT_TRUE(torch::allclose(mine, theirs, /*rtol=*/1e-6, /*atol=*/0)) << key;
    }
  }
  fs::remove_all(dir);
}

// One step from a given state, amp's against torchao's single_param_adam (eager), for AdamW and Adam (L2), over 4
// steps of a training run: the codes and scales equal, the parameters within rounding (the parameter's arithmetic is
// LibTorch's order, torchao's differs by an ulp). torchao 0.18's 8-bit amsgrad does not run (OptimState8bit has no
// aten.maximum), so amp's amsgrad (max_exp_avg_sq on the unsigned map) is checked against its own fp32 route below.
TEST(StateFormatReferenceTest, EachEightBitStepFromTheSameStateIsTorchaos) {
  struct Case {
    const char* name;
    bool adamw, amsgrad;
  };
  const std::vector<Case> cases = {{"adamw", true, false}, {"adam_l2", false, false}};
  const std::vector<std::vector<int64_t>> shapes = {{64, 128}, {16, 256}, {64}, {3, 100}};
  const double lr = 1e-2, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, wd = 0.01;
  c10::impl::GenericList inputs(c10::AnyType::get());
  std::vector<torch::Tensor> after_params;
  std::vector<std::vector<torch::Tensor>> after_moments;
  for (const auto& c : cases) {
    torch::manual_seed(17);
    std::vector<torch::Tensor> params;
    for (const auto& s : shapes) params.push_back(torch::randn(s).mul_(0.1).requires_grad_());
    auto run = [&](auto& optimizer) {
      set_format(optimizer, OptimizerStateFormat::k8Bit);
      for (int step = 1; step <= 4; ++step) {
        for (auto& p : params) p.mutable_grad() = torch::randn(p.sizes()) * (0.01 * step);
        std::vector<c10::impl::GenericDict> entries;
        for (const auto& p : params) {
          c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
          d.insert("param", p.detach().clone());
          d.insert("grad", p.grad().clone());
          d.insert("step", static_cast<int64_t>(step));
          d.insert("lr", lr), d.insert("beta1", beta1), d.insert("beta2", beta2), d.insert("eps", eps);
          d.insert("weight_decay", wd), d.insert("adamw", c.adamw), d.insert("amsgrad", c.amsgrad);
          auto& state = optimizer.state();
          const auto it = state.find(amp::detail::state_key(state, p));
          const std::vector<std::string> keys = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
          for (size_t k = 0; k < keys.size(); ++k) {
            torch::Tensor t;
            if (it != state.end()) t = sf_field(*it->second, k);
            const bool packed = amp::detail::quantizes(p.numel());
            if (!t.defined()) t = packed ? torch::zeros({p.numel() + p.numel() / 64}, torch::kUInt8) : torch::zeros_like(p);
            d.insert(keys[k] + "_codes", packed ? c10::IValue(codes_of(t, p.numel()).clone()) : c10::IValue());
            d.insert(keys[k] + "_scales", packed ? c10::IValue(scales_of(t, p.numel()).clone()) : c10::IValue());
            d.insert(keys[k], packed ? c10::IValue() : c10::IValue(t.clone()));
          }
          entries.push_back(d);
        }
        optimizer.step();
        for (size_t i = 0; i < params.size(); ++i) {
          inputs.push_back(entries[i]);
          after_params.push_back(params[i].detach().clone());
          auto& state = optimizer.state();
          auto& s = *state.at(amp::detail::state_key(state, params[i]));
          after_moments.push_back({sf_field(s, 0).clone(), sf_field(s, 1).clone(),
                                   c.amsgrad ? sf_field(s, 2).clone() : torch::Tensor()});
        }
      }
    };
    if (c.adamw) {
      amp::optim::FusedAdamW optimizer(params, torch::optim::AdamWOptions(lr).betas({beta1, beta2}).eps(eps)
                                                   .weight_decay(wd).amsgrad(c.amsgrad));
      run(optimizer);
    } else {
      amp::optim::FusedAdam optimizer(params, torch::optim::AdamOptions(lr).betas({beta1, beta2}).eps(eps).weight_decay(wd));
      run(optimizer);
    }
  }
  const auto dir = sf_dir("steps");
  amp::PythonCheckpoint in;
  in.put("cases", inputs);
  in.save((dir / "steps_in.pt").string());
  SF_RUN_PYTHON("steps", dir);
  const auto reference = amp::PythonCheckpoint::load((dir / "steps_out.pt").string());
  const auto results = reference.get("results").toList();
  ASSERT_EQ(results.size(), after_params.size());
  double worst_param = 0, worst_moment = 0;
  int64_t codes_compared = 0, codes_differing = 0;
  const bool same_torch = sf_same_torch(reference);
  for (size_t i = 0; i < results.size(); ++i) {
    const auto r = results.get(i).toGenericDict();
    const int64_t n = after_params[i].numel();
    worst_param = std::max(worst_param, sf_ulps(after_params[i], r.at("param").toTensor()));
    const std::vector<std::string> keys = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
    for (size_t k = 0; k < keys.size(); ++k) {
      const torch::Tensor& mine = after_moments[i][k];
      if (!mine.defined()) continue;
      if (amp::detail::is_packed(mine)) {
        const auto codes = r.at(keys[k] + "_codes").toTensor(), scales = r.at(keys[k] + "_scales").toTensor();
        codes_differing += codes_of(mine, n).ne(codes).sum().item<int64_t>();
        if (same_torch) {
          EXPECT_TRUE(amp_test::bitwise_equal(scales_of(mine, n), scales)) << "case " << i;
        } else {
          EXPECT_TRUE(torch::allclose(scales_of(mine, n), scales, 1e-5, 0)) << "case " << i;
        }
        codes_compared += n;
      } else {
        worst_moment = std::max(worst_moment, sf_ulps(mine, r.at(keys[k]).toTensor()));
      }
    }
  }
  std::cout << "[ measured ] " << results.size() << " tensor steps against torchao: " << codes_compared - codes_differing
            << " of " << codes_compared << " codes equal; parameters within " << worst_param << " ulp, fp32 moments "
            << "within " << worst_moment << " ulp" << std::endl;
  // Another LibTorch's map differs in an entry's last bit (QuantizationMapsAreTorchaos): a code here and there.
  EXPECT_LE(codes_differing, same_torch ? 0 : codes_compared / 1000);
  // The update's two roundings in another order (lr * m / bc1 / denom): a few ulps of the tensor's largest value.
  EXPECT_LE(worst_param, 16.0);
  EXPECT_LE(worst_moment, same_torch ? 2.0 : 64.0);
  fs::remove_all(dir);
}

// 20 free-running steps of a regression beside torchao's AdamW8bit from the same start: the runs part only where a
// code lands on the other side of a rounding boundary, so the weights must agree to a small fraction of how far
// training moved them.
TEST(StateFormatReferenceTest, TwentyStepsTrackTorchaosAdamW8bit) {
  torch::manual_seed(23);
  const auto w0 = torch::randn({64, 128}) * 0.1, b0 = torch::zeros({64});
  const auto x = torch::randn({256, 128}), y = torch::randn({256, 64});
  auto weight = w0.clone().requires_grad_(), bias = b0.clone().requires_grad_();
  amp::optim::FusedAdamW optimizer(std::vector<torch::Tensor>{weight, bias}, torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
  set_format(optimizer, OptimizerStateFormat::k8Bit);
  std::vector<double> losses;
  for (int s = 0; s < 20; ++s) {
    optimizer.zero_grad();
    const auto loss = torch::mse_loss(torch::nn::functional::linear(x, weight, bias), y);
    loss.backward();
    optimizer.step();
    losses.push_back(loss.item<double>());
  }
  const auto dir = sf_dir("run");
  amp::PythonCheckpoint in;
  in.put("weight", w0), in.put("bias", b0), in.put("x", x), in.put("y", y);
  in.put("lr", 1e-2), in.put("weight_decay", 0.01), in.put("steps", static_cast<int64_t>(20));
  in.save((dir / "run_in.pt").string());
  SF_RUN_PYTHON("run", dir);
  const auto reference = amp::PythonCheckpoint::load((dir / "run_out.pt").string());
  const auto ref_w = reference.get("weight").toTensor();
  const double moved = (ref_w - w0).norm().item<double>(), apart = (weight.detach() - ref_w).norm().item<double>();
  auto& state = optimizer.state();
  const auto& mine = static_cast<torch::optim::AdamWParamState&>(*state.at(amp::detail::state_key(state, weight)));
  const double same_codes =
      codes_of(mine.exp_avg(), weight.numel()).eq(reference.get("exp_avg_codes").toTensor()).to(torch::kDouble).mean().item<double>();
  const double last_ref = reference.get("losses").toTensor()[19].item<double>();
  std::cout << "[ measured ] after 20 steps: |w - w_torchao| / |w_torchao - w0| = " << apart / moved << ", exp_avg codes "
            << "equal: " << 100 * same_codes << "%, loss " << losses.back() << " (torchao " << last_ref << ")" << std::endl;
  EXPECT_LT(apart, 1e-2 * moved);
  EXPECT_GT(same_codes, 0.98);
  EXPECT_NEAR(losses.back(), last_ref, 1e-3 * last_ref);
  fs::remove_all(dir);
}

// ---- the codec -------------------------------------------------------------------------------------

// torchao's test_bf16_stochastic_round: 100,000 stochastic roundings of each of 32 values average to the value.
// Runs `body` on each of the codec's loops this CPU has: AVX-512 with VBMI (decoding by permutes), AVX-512 (by
// gathers), AVX2 and portable.
template <class Body>
void on_every_codec(Body body) {
  using amp::detail::cpu::CodecLoops;
  struct CodecLoopsGuard {
    explicit CodecLoopsGuard(CodecLoops widest) { amp::detail::cpu::force_codec_loops(widest); }
    ~CodecLoopsGuard() { amp::detail::cpu::force_codec_loops(amp::detail::cpu::default_codec_loops()); }
  };
  for (const auto level : {CodecLoops::kAvx512Vbmi, CodecLoops::kAvx512, CodecLoops::kAvx2, CodecLoops::kPortable}) {
    if (!amp::detail::cpu::codec_loops_on_cpu(level)) continue;
    SCOPED_TRACE(level == CodecLoops::kAvx512Vbmi ? "AVX-512 VBMI loops"
                 : level == CodecLoops::kAvx512   ? "AVX-512 loops"
                 : level == CodecLoops::kAvx2     ? "AVX2 loops"
                                                  : "portable loops");
    const CodecLoopsGuard loops(level);
    body();
  }
}

// The decode the 8-bit step runs by default is the one that times faster on this CPU (NOTE [Choosing the decode by
// timing it]): checked where one is clearly the faster (on Zen 5 the permutes are about 4x); where they are within
// 1.5x of each other either is right.
TEST(StateFormatCodecTest, DefaultDecodeIsTheFasterOneHere) {
  namespace cpu = amp::detail::cpu;
  const cpu::DecodeTimes t = cpu::time_decodes();
  if (!cpu::codec_loops_on_cpu(cpu::CodecLoops::kAvx512Vbmi)) {
    EXPECT_EQ(t.by_gathers, 0.0);
    EXPECT_EQ(t.by_permutes, 0.0);
    EXPECT_EQ(cpu::default_codec_loops(), cpu::CodecLoops::kAvx512);
    GTEST_SKIP() << "no AVX-512 VBMI: gathers are the only AVX-512 decode";
  }
  ASSERT_GT(t.by_gathers, 0.0);
  ASSERT_GT(t.by_permutes, 0.0);
  ASSERT_LT(t.by_gathers, 1e-6);  // seconds a value: a decode takes nanoseconds
  std::printf("decoding by gathers %.3f ns a value, by permutes %.3f\n", 1e9 * t.by_gathers, 1e9 * t.by_permutes);
  if (t.by_permutes * 1.5 < t.by_gathers) EXPECT_EQ(cpu::default_codec_loops(), cpu::CodecLoops::kAvx512Vbmi);
  if (t.by_gathers * 1.5 < t.by_permutes) EXPECT_EQ(cpu::default_codec_loops(), cpu::CodecLoops::kAvx512);
  EXPECT_EQ(cpu::default_codec_loops(), cpu::default_codec_loops());  // decided once
}

TEST(StateFormatCodecTest, Bf16StochasticRoundingIsUnbiased) {
  torch::manual_seed(0);
  const auto x = torch::rand({32}) * 100;
  const auto copies = x.view({-1, 1}).repeat({1, 100000});
  auto stored = torch::empty(copies.sizes(), torch::kBFloat16);
  amp::detail::encode_moment(copies, stored, Moment::kSigned, amp::detail::DrawStream{42, 0, {}});
  const auto mean = stored.to(torch::kFloat).mean(1);
  EXPECT_TRUE(torch::allclose(mean, x, /*rtol=*/3e-5, /*atol=*/3e-5)) << (mean - x).abs().max().item<float>();
  // Each copy is one of the value's two bf16 neighbours; the same draws give the same bits, others differ.
  auto again = torch::empty(copies.sizes(), torch::kBFloat16);
  amp::detail::encode_moment(copies, again, Moment::kSigned, amp::detail::DrawStream{42, 0, {}});
  EXPECT_TRUE(amp_test::bitwise_equal(stored, again));
  amp::detail::encode_moment(copies, again, Moment::kSigned, amp::detail::DrawStream{42, 1, {}});
  EXPECT_FALSE(amp_test::bitwise_equal(stored, again));
  const auto gap = (stored.to(torch::kFloat) - copies).abs();
  EXPECT_TRUE((gap <= copies.abs() * std::ldexp(1.0, -7)).all().item<bool>());
}

// NOTE [Stored moments on the device]: the ATen ops a device rounds with (the draw count a tensor there) give the CPU
// loops' bits, on each loop this CPU has (AVX-512 rounds 32 values a step): every class of float (signs, subnormals,
// the largest finite values, which round up to inf, inf and NaN of any payload), draw counts starting mid-group and
// crossing 2^63, seeds with the top bit set (a count wrapping past 2^64, 6e9 steps of 10^9 values away, is numbered
// per group by the CPU loops).
TEST(StateFormatCodecTest, Bf16RoundingInAtenOpsIsTheCpuLoops) {
  on_every_codec([] {
    torch::manual_seed(3);
    auto values = torch::cat({torch::randn({4099}) * torch::logspace(-40, 38, 4099),
                              torch::tensor({0.0f, -0.0f, 1e-45f, -1e-45f, 3.3895314e38f, -3.3895314e38f,
                                             std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(),
                                             std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()})});
    auto bits = values.view(torch::kInt);
    for (const int32_t nan : {0x7fc00000, 0x7f800001, static_cast<int32_t>(0xffc12345u), 0x7fffffff}) {
      values = torch::cat({values, torch::tensor({nan}, torch::kInt).view(torch::kFloat)});
    }
    const uint64_t top = uint64_t{1} << 63;
    for (const uint64_t seed : {uint64_t{0}, uint64_t{42}, top | 12345u}) {
      for (const uint64_t first : {uint64_t{0}, uint64_t{3}, uint64_t{4097}, top - 5}) {
        SCOPED_TRACE("seed " + std::to_string(seed) + ", first draw " + std::to_string(first));
        auto expected = torch::empty(values.sizes(), torch::kBFloat16);
        amp::detail::encode_moment(values, expected, Moment::kSigned, amp::detail::DrawStream{seed, first, {}});
        const auto on_device = torch::full({}, static_cast<int64_t>(first), torch::kLong);
        const auto rounded = amp::detail::round_bf16_stochastically(values, seed, on_device);
        ASSERT_EQ(rounded.scalar_type(), torch::kBFloat16);
        EXPECT_TRUE(torch::equal(rounded.view(torch::kShort), expected.view(torch::kShort)));
        // encode_moment takes the device's count over the host's when it has one.
        auto stored = torch::empty(values.sizes(), torch::kBFloat16);
        amp::detail::encode_moment(values, stored, Moment::kSigned, amp::detail::DrawStream{seed, first + 1, on_device});
        EXPECT_TRUE(torch::equal(stored.view(torch::kShort), expected.view(torch::kShort)));
      }
    }
  });
}

// The CPU loop's codes are torchao's ATen ops' (quantize_with_map), block scales included; decoding is
// map[code] * scale; slicing and joining by blocks (ZeRO's pieces) is lossless.
TEST(StateFormatCodecTest, CpuCodesAreTheAtenOpsAndSlicesJoinBack) {
  on_every_codec([] {
    torch::manual_seed(1);
    auto values = torch::randn({64, 256}) * torch::logspace(-8, 2, 64).view({-1, 1});
    values[3].zero_();           // a block of zeros: scale 1e-12
    values[5][7] = 1e-30f;       // far below the block's scale
    values[9][4] = std::numeric_limits<float>::infinity();  // scale inf: the vector loops leave the block to the search
    values[11][200] = std::numeric_limits<float>::quiet_NaN();  // scale NaN: likewise
    for (const Moment moment : {Moment::kSigned, Moment::kUnsigned}) {
      const auto v = moment == Moment::kSigned ? values : values.abs();
      const int64_t n = v.numel();
      auto packed = torch::zeros({n + n / 64}, torch::kUInt8);
      amp::detail::encode_moment(v, packed, moment);
      const auto blocks = v.view({-1, 256});
      const auto scale = blocks.abs().amax(-1).clamp_min(1e-12);
      const auto codes = amp::detail::quantize_with_map(blocks / scale.view({-1, 1}), moment).reshape({-1});
      EXPECT_TRUE(torch::equal(codes_of(packed, n), codes));
      EXPECT_TRUE(amp_test::bitwise_equal(scales_of(packed, n), scale));
      const auto& map = amp::detail::quantization_map(moment);
      const auto map_t = torch::from_blob(const_cast<float*>(map.data()), {256}, torch::kFloat);
      const auto expected = (map_t.index_select(0, codes.to(torch::kLong)).view({-1, 256}) * scale.view({-1, 1})).reshape(v.sizes());
      EXPECT_TRUE(amp_test::bitwise_equal(amp::detail::decode_moment(packed, v.sizes(), moment), expected));
      // Within half a code's gap of the value: the largest gap of the map near 1 is 0.0141 (of the block's absmax).
      const auto error = ((expected - v).abs() / scale.view({-1, 1}).expand({64, 256}).reshape(v.sizes())).view({64, 256});
      EXPECT_LE(error.index({torch::isfinite(scale)}).max().item<double>(), 0.0071);
      const auto joined = amp::detail::join_moments({amp::detail::slice_moment(packed, 0, 4096),
                                                     amp::detail::slice_moment(packed, 4096, 8192),
                                                     amp::detail::slice_moment(packed, 12288, n - 12288)});
      EXPECT_TRUE(torch::equal(joined, packed));
    }
  });
}

// The bucket table (NOTE [Finding a code] in src/optim/cpu_state_codec.cpp) against torchao's search in ATen ops,
// where codes change: every rounding midpoint of both maps and the 6 floats on each side of it, and each map value's
// neighbours, in blocks whose absmax is 1 (so the values are divided by exactly 1).
TEST(StateFormatCodecTest, BucketTableGivesTheSearchsCodesAtEveryBoundary) {
  on_every_codec([] {
    for (const Moment moment : {Moment::kSigned, Moment::kUnsigned}) {
      const auto& map = amp::detail::quantization_map(moment);
      std::vector<float> values;
      for (int c = 0; c < 256; ++c) {
        std::vector<float> centres = {map[c]};
        if (c < 255) centres.push_back(map[c] + (map[c + 1] - map[c]) * 0.5f);
        for (float centre : centres) {
          float below = centre, above = centre;
          values.push_back(centre);
          for (int k = 0; k < 6; ++k) {
            below = std::nextafter(below, -2.0f), above = std::nextafter(above, 2.0f);
            for (float v : {below, above}) {
              if (std::abs(v) <= 1.0f) values.push_back(v);
            }
          }
        }
      }
      while (values.size() % 255 != 0) values.push_back(0.0f);
      // Each block: 255 values and a 1 (the absmax).
      std::vector<float> blocks;
      for (size_t i = 0; i < values.size(); i += 255) {
        blocks.insert(blocks.end(), values.begin() + static_cast<int64_t>(i), values.begin() + static_cast<int64_t>(i) + 255);
        blocks.push_back(1.0f);
      }
      const auto v = torch::tensor(blocks);
      const int64_t n = v.numel();
      auto packed = torch::zeros({n + n / 64}, torch::kUInt8);
      amp::detail::encode_moment(v, packed, moment);
      const auto expected = amp::detail::quantize_with_map(v.view({-1, 256}), moment).reshape({-1});
      const auto mismatches = codes_of(packed, n).ne(expected).sum().item<int64_t>();
      EXPECT_EQ(mismatches, 0) << (moment == Moment::kSigned ? "signed" : "unsigned") << " map, " << n << " values";
    }
  });
}

// NOTE [Codes by lines] in src/optim/cpu_state_codec.cpp: both of torchao's maps have lines (so the AVX-512 loops
// encode without gathers), each line's certain codes are torchao's search in ATen ops (every float within 64 of each
// place the code changes, and random ones), values near a change are left to the table (and few others are), the
// vector loops give the search's codes for quotients by random scales, and a map that is not made of evenly spaced
// runs has no lines rather than wrong ones.
TEST(StateFormatCodecTest, LinesGiveTheSearchsCodesOrLeaveThemToTheTable) {
  namespace cpu = amp::detail::cpu;
  std::mt19937 draw(11);
  for (const Moment moment : {Moment::kSigned, Moment::kUnsigned}) {
    SCOPED_TRACE(moment == Moment::kSigned ? "signed map" : "unsigned map");
    const auto& map = amp::detail::quantization_map(moment);
    cpu::CodeLines lines;
    ASSERT_TRUE(cpu::code_lines(map.data(), &lines));
    std::vector<float> ys;
    for (int c = 0; c + 1 < 256; ++c) {  // each rounding midpoint, and the 64 floats on each side of it
      float below = map[c] + (map[c + 1] - map[c]) * 0.5f, above = below;
      ys.push_back(below);
      for (int k = 0; k < 64; ++k) {
        below = std::nextafter(below, -2.0f), above = std::nextafter(above, 2.0f);
        ys.push_back(below), ys.push_back(above);
      }
    }
    std::uniform_real_distribution<float> uniform(moment == Moment::kSigned ? -1.0f : 0.0f, 1.0f);
    for (int k = 0; k < 200000; ++k) {
      ys.push_back(uniform(draw));
      ys.push_back(std::ldexp(uniform(draw), -static_cast<int>(draw() % 30)));
    }
    const auto y = torch::tensor(ys);
    const auto expected = amp::detail::quantize_with_map(y, moment);
    const auto* want = expected.data_ptr<uint8_t>();
    int64_t uncertain_random = 0, wrong = 0;
    for (size_t i = 0; i < ys.size(); ++i) {
      uint32_t bits;
      std::memcpy(&bits, &ys[i], sizeof bits);
      bool uncertain = false;
      const int32_t code = cpu::code_on_lines(lines, bits, &uncertain);
      if (!uncertain && code != want[i]) ++wrong;
      if (uncertain && i >= 255 * 129) ++uncertain_random;
    }
    EXPECT_EQ(wrong, 0);
    EXPECT_LT(uncertain_random, 400000 / 500) << "more than 0.2% of random values are left to the table";
    // Every value whose window of quotients holds a change is uncertain: the midpoint itself, on both sides.
    for (int c = 0; c + 1 < 256; ++c) {
      const float mid = map[c] + (map[c + 1] - map[c]) * 0.5f;
      if (amp::detail::cpu::code_by_search(mid, map.data()) == amp::detail::cpu::code_by_search(std::nextafter(mid, -2.0f), map.data())) {
        continue;  // not where the code changes
      }
      uint32_t bits;
      std::memcpy(&bits, &mid, sizeof bits);
      bool uncertain = false;
      cpu::code_on_lines(lines, bits, &uncertain);
      EXPECT_TRUE(uncertain) << "the midpoint " << mid << " between codes " << c << " and " << c + 1;
    }
  }
  // The AVX-512 loops on lines: blocks of values over 30 octaves with random scales, against torchao's ops.
  on_every_codec([&] {
    for (const Moment moment : {Moment::kSigned, Moment::kUnsigned}) {
      auto v = torch::randn({4096, 256}) * torch::logspace(-20, 10, 4096).view({-1, 1}) *
               torch::exp(torch::randn({4096, 1}) * 3);
      if (moment == Moment::kUnsigned) v = v.square();
      const int64_t n = v.numel();
      auto packed = torch::zeros({n + n / 64}, torch::kUInt8);
      amp::detail::encode_moment(v.reshape({-1}), packed, moment);
      const auto scale = v.abs().amax(-1).clamp_min(1e-12);
      const auto expected = amp::detail::quantize_with_map(v / scale.view({-1, 1}), moment).reshape({-1});
      EXPECT_EQ(codes_of(packed, n).ne(expected).sum().item<int64_t>(), 0) << (moment == Moment::kSigned ? "signed" : "unsigned");
      // The same through the table, as for a map without lines.
      auto by_table = torch::zeros_like(packed);
      auto view = amp::detail::cpu_view(by_table, moment);
      ASSERT_TRUE(view.has_value());
      view->lines = nullptr;
      const auto flat = v.reshape({-1}).contiguous();
      cpu::encode(*view, 0, n, flat.data_ptr<float>());
      EXPECT_TRUE(torch::equal(by_table, packed));
    }
  });
  // Random sorted values are no runs: no lines, and the codec keeps the table.
  std::vector<float> random_map(256);
  for (float& value : random_map) value = std::uniform_real_distribution<float>(-1.0f, 1.0f)(draw);
  std::sort(random_map.begin(), random_map.end());
  cpu::CodeLines lines;
  EXPECT_FALSE(cpu::code_lines(random_map.data(), &lines));
}

// NOTE [Dividing by the scale]: the vector loops' quotients by multiply-adds against ATen's division, where a wrong
// quotient changes a code: each block's scale is an awkward one (all-ones mantissas, the powers of two at and beyond
// the reciprocal route's limits, random ones) and its values are the scale times each rounding midpoint of the map,
// with their float neighbours, so x / s lands on, just below and just above where codes change.
TEST(StateFormatCodecTest, QuotientsByTheScaleAreTheDivisionsAtEveryBoundary) {
  on_every_codec([] {
    std::vector<float> scales;
    for (int e = -64; e <= 104; e += 4) {
      scales.push_back(std::ldexp(1.0f, e));                              // a power of two
      scales.push_back(std::nextafter(std::ldexp(1.0f, e + 1), 0.0f));  // an all-ones mantissa
    }
    for (float s : {0x1p-60f, 0x1p100f}) scales.insert(scales.end(), {std::nextafter(s, 0.0f), std::nextafter(s, 1e38f)});
    std::mt19937 draw(7);
    for (int k = 0; k < 40; ++k) scales.push_back(std::ldexp(1.0f + static_cast<float>(draw() % 8388608) / 8388608.0f, -40 + k * 3));
    for (const Moment moment : {Moment::kSigned, Moment::kUnsigned}) {
      const auto& map = amp::detail::quantization_map(moment);
      std::vector<float> blocks;
      for (const float s : scales) {
        std::vector<float> block;
        for (int c = 0; c + 1 < 256 && block.size() < 255; c += 1 + static_cast<int>(draw() % 4)) {
          const float x = (map[c] + (map[c + 1] - map[c]) * 0.5f) * s;
          for (float v : {x, std::nextafter(x, 0.0f), std::nextafter(x, 2 * x + 1)}) {
            if (block.size() < 255 && std::abs(v) < s) block.push_back(v);
          }
        }
        block.resize(255, 0.0f);
        block.push_back(s);  // the absmax
        blocks.insert(blocks.end(), block.begin(), block.end());
      }
      const auto v = torch::tensor(blocks);
      const int64_t n = v.numel();
      auto packed = torch::zeros({n + n / 64}, torch::kUInt8);
      amp::detail::encode_moment(v, packed, moment);
      const auto b = v.view({-1, 256});
      const auto expected = amp::detail::quantize_with_map(b / b.abs().amax(-1, true).clamp_min(1e-12), moment).reshape({-1});
      const auto mismatches = codes_of(packed, n).ne(expected).sum().item<int64_t>();
      EXPECT_EQ(mismatches, 0) << (moment == Moment::kSigned ? "signed" : "unsigned") << " map, " << n << " values";
    }
  });
}

// The 8-bit Adam step on each loop this CPU has (NOTE [The 8-bit step in one pass] in cpu_optimizer_kernels.cpp: the
// AVX-512 one decodes, updates and encodes in one pass), with codes on the maps' lines and from the table, gives the
// portable loops' parameters, unscaled gradients, codes, scales and O2 copy bit for bit: Adam and AdamW, a loss scale
// or none, a step over a slice starting past the tensor's first chunk and ending inside one, a block whose moments
// become NaN (an inf gradient: the codec's search), a block of zero moments (scale 1e-12) and one of tiny ones (scales
// below 2^-60: divided, not multiplied by 1 / s).
TEST(StateFormatCodecTest, EightBitAdamStepOnEveryLoop) {
  namespace cpu = amp::detail::cpu;
  const int64_t n = 3 * cpu::kStoredChunk + 512;
  torch::manual_seed(5);
  const auto param0 = torch::randn({n});
  auto grad0 = torch::randn({n}) * torch::logspace(-6, 0, n);
  grad0[cpu::kStoredChunk + 300] = std::numeric_limits<float>::infinity();
  auto m0 = torch::randn({n}) * 1e-3, v0 = torch::rand({n}) * 1e-6;
  m0.narrow(0, 2 * cpu::kStoredChunk, 256).zero_(), v0.narrow(0, 2 * cpu::kStoredChunk, 256).zero_();
  grad0.narrow(0, 2 * cpu::kStoredChunk, 512).zero_();
  m0.narrow(0, 2 * cpu::kStoredChunk + 256, 256).mul_(1e-20), v0.narrow(0, 2 * cpu::kStoredChunk + 256, 256).mul_(1e-28);
  auto packed = [&](const torch::Tensor& values, Moment moment) {
    auto out = torch::zeros({n + n / 64}, torch::kUInt8);
    amp::detail::encode_moment(values, out, moment);
    return out;
  };
  struct Result {
    torch::Tensor param, grad, m, v, copy;
  };
  for (const bool decoupled : {true, false}) {
    for (const float inv : {1.0f, 1.0f / 1024}) {
      for (const int64_t begin : {int64_t{0}, cpu::kStoredChunk}) {
        SCOPED_TRACE(std::string(decoupled ? "AdamW" : "Adam") + ", inv " + std::to_string(inv) + ", from " +
                     std::to_string(begin));
        std::vector<Result> results;
        on_every_codec([&] {
          for (const bool lines : {true, false}) {  // codes on the maps' lines, and the table a map without them keeps
            Result r{param0.clone(), grad0.clone() / inv, packed(m0, Moment::kSigned), packed(v0, Moment::kUnsigned),
                     torch::zeros({n}, torch::kBFloat16)};
            auto m = amp::detail::cpu_view(r.m, Moment::kSigned), v = amp::detail::cpu_view(r.v, Moment::kUnsigned);
            ASSERT_TRUE(m && v && m->lines && v->lines);
            if (!lines) m->lines = v->lines = nullptr;
            const cpu::AdamScalars scalars{1e-3, 0.9, 0.999, 1e-8, 0.01, decoupled, false, 3, inv};
            cpu::adam_step_stored(r.param.data_ptr<float>(), r.grad.data_ptr<float>(), *m, *v, nullptr, begin, n,
                                  scalars, cpu::ModelCopy{cpu::Dtype::BFloat16, r.copy.data_ptr()});
            results.push_back(r);
          }
        });
        ASSERT_FALSE(results.empty());
        const Result& portable = results.back();
        EXPECT_FALSE(torch::isfinite(amp::detail::decode_moment(portable.v, {n}, Moment::kUnsigned)).all().item<bool>());
        for (size_t i = 0; i + 1 < results.size(); ++i) {
          EXPECT_TRUE(amp_test::bitwise_equal(results[i].param, portable.param)) << "loop " << i;
          EXPECT_TRUE(amp_test::bitwise_equal(results[i].grad, portable.grad)) << "loop " << i;
          EXPECT_TRUE(torch::equal(results[i].m, portable.m)) << "loop " << i;
          EXPECT_TRUE(torch::equal(results[i].v, portable.v)) << "loop " << i;
          EXPECT_TRUE(amp_test::bitwise_equal(results[i].copy, portable.copy)) << "loop " << i;
        }
        EXPECT_TRUE(amp_test::bitwise_equal(portable.param.narrow(0, 0, begin), param0.narrow(0, 0, begin)));
      }
    }
  }
}

// The bf16 moments' Adam step on every codec loop (NOTE [The bf16 step in one pass]): the AVX-512 loops update and
// round in one pass, the others decode, update and encode chunk by chunk; parameters, unscaled gradients, moments
// and the O2 copy bit for bit the portable loops'. Each moment's draw count starting at every offset within a draw
// (its words start mid-draw) and near 2^63, a slice starting past the tensor's first chunk, a length that leaves a
// tail under 32 values, Adam and AdamW, a loss scale or none, an inf and a NaN gradient and a NaN moment (inf and NaN
// moments: NaN is stored as c10's quiet NaN), zero and tiny moments (denormal bf16).
TEST(StateFormatCodecTest, Bf16AdamStepOnEveryLoop) {
  namespace cpu = amp::detail::cpu;
  const int64_t n = 3 * cpu::kStoredChunk + 77;
  torch::manual_seed(6);
  const auto param0 = torch::randn({n});
  auto grad0 = torch::randn({n}) * torch::logspace(-6, 0, n);
  grad0[cpu::kStoredChunk + 300] = std::numeric_limits<float>::infinity();
  grad0[cpu::kStoredChunk + 333] = std::numeric_limits<float>::quiet_NaN();
  auto m0 = (torch::randn({n}) * 1e-3).to(torch::kBFloat16), v0 = (torch::rand({n}) * 1e-6).to(torch::kBFloat16);
  m0[cpu::kStoredChunk + 1000] = -std::numeric_limits<float>::quiet_NaN();
  m0.narrow(0, 2 * cpu::kStoredChunk, 256).zero_(), v0.narrow(0, 2 * cpu::kStoredChunk, 256).zero_();
  grad0.narrow(0, 2 * cpu::kStoredChunk, 512).zero_();
  m0.narrow(0, 2 * cpu::kStoredChunk + 256, 256).mul_(1e-38), v0.narrow(0, 2 * cpu::kStoredChunk + 256, 256).mul_(1e-38);
  struct Result {
    torch::Tensor param, grad, m, v, copy;
  };
  const uint64_t near_2_63 = (uint64_t{1} << 63) - 6;
  for (const auto& [m_first, v_first] : {std::pair<uint64_t, uint64_t>{0, 0}, {1, 3}, {2, 1}, {3, 2}, {near_2_63, 7}}) {
    for (const bool decoupled : {true, false}) {
      for (const float inv : {1.0f, 1.0f / 1024}) {
        for (const int64_t begin : {int64_t{0}, cpu::kStoredChunk}) {
          SCOPED_TRACE(std::string(decoupled ? "AdamW" : "Adam") + ", inv " + std::to_string(inv) + ", from " +
                       std::to_string(begin) + ", draws from " + std::to_string(m_first) + " and " + std::to_string(v_first));
          std::vector<Result> results;
          on_every_codec([&] {
            Result r{param0.clone(), grad0.clone() / inv, m0.clone(), v0.clone(), torch::zeros({n}, torch::kBFloat16)};
            auto view = [](const torch::Tensor& stored, uint64_t seed, uint64_t first) {
              cpu::StateView v;
              v.kind = cpu::StateKind::kBFloat16;
              v.data = stored.data_ptr();
              v.stochastic = true;
              v.seed = seed;
              v.first = first;
              return v;
            };
            const cpu::AdamScalars scalars{1e-3, 0.9, 0.999, 1e-8, 0.01, decoupled, false, 3, inv};
            cpu::adam_step_stored(r.param.data_ptr<float>(), r.grad.data_ptr<float>(), view(r.m, 17, m_first),
                                  view(r.v, 17, v_first), nullptr, begin, n, scalars,
                                  cpu::ModelCopy{cpu::Dtype::BFloat16, r.copy.data_ptr()});
            results.push_back(r);
          });
          ASSERT_FALSE(results.empty());
          const Result& portable = results.back();
          EXPECT_TRUE(torch::isinf(portable.v).any().item<bool>());  // the inf gradient's
          EXPECT_TRUE(torch::isnan(portable.m).any().item<bool>());  // the NaN gradient's and moment's
          EXPECT_FALSE(torch::equal(portable.m, m0));
          for (size_t i = 0; i + 1 < results.size(); ++i) {
            EXPECT_TRUE(amp_test::bitwise_equal(results[i].param, portable.param)) << "loop " << i;
            EXPECT_TRUE(amp_test::bitwise_equal(results[i].grad, portable.grad)) << "loop " << i;
            EXPECT_TRUE(amp_test::bitwise_equal(results[i].m, portable.m)) << "loop " << i;
            EXPECT_TRUE(amp_test::bitwise_equal(results[i].v, portable.v)) << "loop " << i;
            EXPECT_TRUE(amp_test::bitwise_equal(results[i].copy, portable.copy)) << "loop " << i;
          }
          EXPECT_TRUE(amp_test::bitwise_equal(portable.param.narrow(0, 0, begin), param0.narrow(0, 0, begin)));
          EXPECT_TRUE(amp_test::bitwise_equal(portable.m.narrow(0, 0, begin), m0.narrow(0, 0, begin)));
        }
      }
    }
  }
}

// ---- through amp::initialize: levels, master formats, routes ---------------------------------------------

struct SfCase {
  std::string level;
  c10::ScalarType dtype;
  amp::MasterWeights master;
  OptimizerStateFormat format;
};

std::string sf_case_name(const ::testing::TestParamInfo<SfCase>& info) {
  const auto& c = info.param;
  return c.level + "_" + (c.dtype == torch::kHalf ? "fp16" : "bf16") + "_" + amp::to_string(c.master) + "_" +
         (c.format == OptimizerStateFormat::k8Bit ? "8bit" : "bf16state");
}

std::vector<SfCase> sf_cases() {
  std::vector<SfCase> out;
  for (const auto format : {OptimizerStateFormat::kBf16, OptimizerStateFormat::k8Bit}) {
    out.push_back({"O0", torch::kBFloat16, amp::MasterWeights::kCopy, format});
    out.push_back({"O1", torch::kBFloat16, amp::MasterWeights::kCopy, format});
    out.push_back({"O2", torch::kHalf, amp::MasterWeights::kCopy, format});
    out.push_back({"O3", torch::kBFloat16, amp::MasterWeights::kCopy, format});
    for (const auto master : {amp::MasterWeights::kCopy, amp::MasterWeights::kSplit, amp::MasterWeights::kStochasticRounding,
                              amp::MasterWeights::kKahan}) {
      out.push_back({"O2", torch::kBFloat16, master, format});
    }
  }
  return out;
}

class StateFormatLevelTest : public ::testing::TestWithParam<SfCase> {
 protected:
  void SetUp() override {
    if (GetParam().level != "O0") SKIP_WITHOUT_CPU_KERNELS(GetParam().dtype);
  }
  amp::Options options() const {
    auto o = sf_options(GetParam().level, GetParam().dtype, GetParam().format);
    if (GetParam().level == "O2") o.master_weights_format(GetParam().master);
    return o;
  }
};

// Trains, with FusedAdamW and FusedLAMB, on both routes: the moments are stored in the format (8-bit for the
// 64x128 layer's weight, whose 8192 values quantize; fp32 or the parameter's dtype for the others), the loss falls
// as with fp32 moments, and state_bytes counts them.
TEST_P(StateFormatLevelTest, TrainsWithTheMomentsInTheFormat) {
  const auto [x, y] = amp_test::blobs(256, 64, 4, 3);
  for (const bool lamb : {false, true}) {
    for (const auto route : {amp::optim::detail::FusedRoute::kAuto, amp::optim::detail::FusedRoute::kPerOp}) {
      SCOPED_TRACE(std::string(lamb ? "FusedLAMB" : "FusedAdamW") + (route == amp::optim::detail::FusedRoute::kPerOp ? " per-op" : ""));
      const amp::optim::detail::FusedRouteGuard forced(route);
      auto train = [&](OptimizerStateFormat format, auto make) {
        torch::manual_seed(9);
        auto net = sf_net();
        auto o = options();
        o.optimizer_state_format(format);
        auto [model, optimizer] = amp::initialize(net, make(net), o);
        double first = 0, last = 0;
        for (int s = 0; s < 30; ++s) {
          last = sf_step(model, optimizer, x, y);
          if (s == 0) first = last;
        }
        return std::make_tuple(first, last, sf_moments(optimizer), amp::state_bytes(optimizer));
      };
      auto run = [&](OptimizerStateFormat format) {
        if (lamb) {
          return train(format, [](const std::shared_ptr<SfNet>& n) { return amp::optim::FusedLAMB(n->parameters(), amp::optim::FusedLAMBOptions(1e-2)); });
        }
        return train(format, [](const std::shared_ptr<SfNet>& n) { return amp::optim::FusedAdamW(n->parameters(), torch::optim::AdamWOptions(1e-2)); });
      };
      const auto [first32, last32, moments32, bytes32] = run(OptimizerStateFormat::kFp32);
      const auto [first, last, moments, bytes] = run(GetParam().format);
      EXPECT_LT(last, 0.7 * first);
      EXPECT_LT(last, last32 + 0.05 * first32) << "fp32 moments reach " << last32;
      ASSERT_EQ(moments.size(), 8u);
      for (size_t i = 0; i < moments.size(); ++i) {
        const bool big = i < 2;  // a.weight's exp_avg and exp_avg_sq
        if (GetParam().format == OptimizerStateFormat::kBf16) {
          EXPECT_EQ(moments[i].scalar_type(), torch::kBFloat16) << i;
        } else {
          EXPECT_EQ(moments[i].scalar_type(), big ? torch::kUInt8 : moments32[i].scalar_type()) << i;
        }
      }
      // Where fp32 moments are fp32 (not O3's bf16 ones): bf16 halves every moment; 8 bits turn a.weight's two
      // 8192-value moments into codes and one scale per 256 values.
      if (moments32.front().scalar_type() == torch::kFloat) {
        const int64_t big_n = 64 * 128;
        const int64_t saved = GetParam().format == OptimizerStateFormat::k8Bit ? 2 * (big_n * 4 - (big_n + big_n / 64))
                                                                              : bytes32.optimizer_state / 2;
        EXPECT_EQ(bytes32.optimizer_state - bytes.optimizer_state, saved);
      }
    }
  }
}

// An overflowing step changes no code, scale, moment or generator state; a torch::save archive resumes bit for bit
// (the generator of bf16's rounding included), whichever seed the resuming process has.
TEST_P(StateFormatLevelTest, SkipsOverflowsAndResumesBitwise) {
  const auto [x, y] = amp_test::blobs(128, 64, 4, 4);
  auto net_a = sf_net();
  torch::manual_seed(31);  // the generator of bf16's rounding is seeded here
  auto [model_a, opt_a] = amp::initialize(net_a, amp::optim::FusedAdamW(net_a->parameters(), torch::optim::AdamWOptions(1e-2)), options());
  for (int s = 0; s < 3; ++s) sf_step(model_a, opt_a, x, y);
  if (opt_a.properties().loss_scale.is_dynamic()) {
    const auto moments = sf_moments(opt_a);
    std::vector<torch::Tensor> params;
    for (const auto& p : net_a->parameters()) params.push_back(p.detach().clone());
    sf_step(model_a, opt_a, x, y, /*overflow=*/true);
    EXPECT_EQ(opt_a.skipped_steps(), 1);
    const auto after = sf_moments(opt_a);
    for (size_t i = 0; i < moments.size(); ++i) EXPECT_TRUE(amp_test::bitwise_equal(moments[i], after[i])) << i;
    for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(amp_test::bitwise_equal(params[i], net_a->parameters()[i]));
  }
  std::stringstream model_bytes, opt_bytes;
  torch::save(net_a, model_bytes);
  torch::save(opt_a, opt_bytes);
  for (int s = 0; s < 3; ++s) sf_step(model_a, opt_a, x, y);
  auto net_b = sf_net();
  torch::manual_seed(777);  // another seed: the archive's generator must win
  auto [model_b, opt_b] = amp::initialize(net_b, amp::optim::FusedAdamW(net_b->parameters(), torch::optim::AdamWOptions(1e-2)), options());
  torch::load(net_b, model_bytes);
  torch::load(opt_b, opt_bytes);
  for (int s = 0; s < 3; ++s) sf_step(model_b, opt_b, x, y);
  for (size_t i = 0; i < net_a->parameters().size(); ++i) {
    EXPECT_TRUE(amp_test::bitwise_equal(net_a->parameters()[i], net_b->parameters()[i])) << "parameter " << i;
  }
  const auto ma = sf_moments(opt_a), mb = sf_moments(opt_b);
  ASSERT_EQ(ma.size(), mb.size());
  for (size_t i = 0; i < ma.size(); ++i) EXPECT_TRUE(amp_test::bitwise_equal(ma[i], mb[i])) << "moment " << i;
}

INSTANTIATE_TEST_SUITE_P(Cases, StateFormatLevelTest, ::testing::ValuesIn(sf_cases()), sf_case_name);

// amp::GradScaler steps a fused optimizer with the loss scale still in the gradients (the loop unscales as it
// reads them), after clip_grad_norm_: with 8-bit and bf16 moments the step is the one unscaled gradients give.
TEST(StateFormatCompositionTest, GradScalerStepsAndClipping) {
  for (const auto format : {OptimizerStateFormat::kBf16, OptimizerStateFormat::k8Bit}) {
    for (const bool unscale_first : {false, true}) {
      SCOPED_TRACE(std::string(amp::to_string(format)) + (unscale_first ? " unscale_ and clip first" : ""));
      auto run = [&](bool scaled) {
        torch::manual_seed(3);
        auto w = (torch::randn({64, 128}) * 0.1).requires_grad_();
        amp::optim::FusedAdamW optimizer(std::vector<torch::Tensor>{w}, torch::optim::AdamWOptions(1e-2));
        set_format(optimizer, format, 5);
        amp::GradScaler scaler(amp::GradScalerOptions().init_scale(1024.0));
        const auto x = torch::randn({32, 128});
        for (int s = 0; s < 5; ++s) {
          optimizer.zero_grad();
          const auto loss = torch::nn::functional::linear(x, w).pow(2).mean();
          if (scaled) {
            scaler.scale(loss).backward();
            if (unscale_first) {
              scaler.unscale_(optimizer);
              torch::nn::utils::clip_grad_norm_(std::vector<torch::Tensor>{w}, 0.05);
            }
            scaler.step(optimizer);
            scaler.update();
          } else {
            loss.backward();
            if (unscale_first) torch::nn::utils::clip_grad_norm_(std::vector<torch::Tensor>{w}, 0.05);
            optimizer.step();
          }
        }
        return w.detach().clone();
      };
      // 1024 is a power of two: scaling and unscaling are exact, so the runs agree bit for bit.
      EXPECT_TRUE(amp_test::bitwise_equal(run(true), run(false)));
    }
  }
}

// ---- Python checkpoints ------------------------------------------------------------------------------

// put_optimizer writes torch.optim's fp32 moments (a Python torch.optim.AdamW continues from them), and
// load_optimizer stores what Python saved in the format: the 8-bit codes of Python's fp32 moments.
TEST(StateFormatPythonTest, PythonContinuesFromFp32MomentsAndLoadQuantizesThem) {
  const auto dir = sf_dir("resume");
  torch::manual_seed(41);
  auto net = torch::nn::Linear(128, 64);
  auto [model, optimizer] = amp::initialize(net, amp::optim::FusedAdamW(net->parameters(), torch::optim::AdamWOptions(1e-3)),
                                            sf_options("O0", torch::kBFloat16, OptimizerStateFormat::k8Bit));
  const auto x = torch::randn({32, 128});
  for (int s = 0; s < 3; ++s) {
    optimizer.zero_grad();
    model(x).pow(2).mean().backward();
    optimizer.step();
  }
  amp::PythonCheckpoint out;
  out.put_model("model", *net);
  out.put_optimizer("optimizer", optimizer);
  out.put("grad_weight", torch::randn({64, 128}) * 0.01);
  out.put("grad_bias", torch::randn({64}) * 0.01);
  out.save((dir / "cpp.pt").string());
  // What was written is the decoded moments, in fp32.
  const auto written = amp::PythonCheckpoint::load((dir / "cpp.pt").string()).get("optimizer").toGenericDict();
  const auto weight_state = written.at("state").toGenericDict().at(c10::IValue(int64_t{0})).toGenericDict();
  const auto& stored = static_cast<torch::optim::AdamWParamState&>(
      *optimizer.state().at(amp::detail::state_key(optimizer.state(), net->weight)));
  EXPECT_TRUE(amp_test::bitwise_equal(weight_state.at("exp_avg").toTensor(),
                                      amp::detail::decode_moment(stored.exp_avg(), {64, 128}, Moment::kSigned)));
  SF_RUN_PYTHON("resume", dir);
  const auto python = amp::PythonCheckpoint::load((dir / "python.pt").string());
  python.load_model(*net, "model");
  python.load_optimizer(optimizer, "optimizer");
  const auto py_state = python.get("optimizer").toGenericDict().at("state").toGenericDict();
  const auto py_weight = py_state.at(c10::IValue(int64_t{0})).toGenericDict();
  const auto py_bias = py_state.at(c10::IValue(int64_t{1})).toGenericDict();
  const auto& loaded = static_cast<torch::optim::AdamWParamState&>(
      *optimizer.state().at(amp::detail::state_key(optimizer.state(), net->weight)));
  const auto& loaded_bias = static_cast<torch::optim::AdamWParamState&>(
      *optimizer.state().at(amp::detail::state_key(optimizer.state(), net->bias)));
  for (const auto& [key, moment] : {std::make_pair("exp_avg", Moment::kSigned), std::make_pair("exp_avg_sq", Moment::kUnsigned)}) {
    const auto& mine = std::string(key) == "exp_avg" ? loaded.exp_avg() : loaded.exp_avg_sq();
    ASSERT_TRUE(amp::detail::is_packed(mine)) << key;
    auto expected = torch::zeros_like(mine);
    amp::detail::encode_moment(py_weight.at(key).toTensor(), expected, moment);
    EXPECT_TRUE(torch::equal(mine, expected)) << key;
  }
  EXPECT_TRUE(amp_test::bitwise_equal(loaded_bias.exp_avg(), py_bias.at("exp_avg").toTensor()));  // 64 values: fp32
  EXPECT_EQ(loaded.step(), 4);
  optimizer.zero_grad();
  model(x).pow(2).mean().backward();
  optimizer.step();  // and trains on
  fs::remove_all(dir);
}

// ---- quality -----------------------------------------------------------------------------------------

// The stalling regression of LeanFormatQualityTest with Adam: 64 weights start at 1, optima in [1, 1.08]; AdamW's
// updates of about lr = 1e-3 are below half a bf16 ulp (2^-8 at 1), so O3 (bf16 weights, bf16 moments) never moves,
// while O2's fp32 masters accumulate them. 300 steps; the quality is the fp32 masters' squared distance from the
// optimum (no batch noise in it). fp32 moments end at the floor the bf16 forward leaves (the masters dither within a
// bf16 ulp of the optimum: 0.2% of the starting distance), so a format that stalls anywhere above that floor closes
// less than 99.9% of the distance fp32 moments close; each format must close at least that.
TEST(StateFormatQualityTest, ClosesWhatFp32MomentsCloseAndFarFromO3sStall) {
  SKIP_WITHOUT_CPU_KERNELS(torch::kBFloat16);
  constexpr int64_t dim = 64, batch = 256;
  torch::manual_seed(0);
  const auto target = 1.0 + 0.08 * torch::rand({1, dim});
  // The mean squared distance of the weights (the fp32 masters where there are some) from the optimum.
  auto distance = [&](const torch::Tensor& w) { return (w.to(torch::kFloat) - target).pow(2).mean().item<double>(); };
  auto train = [&](const amp::Options& options, bool lamb, uint64_t data_seed) {
    torch::manual_seed(1);
    auto net = torch::nn::Linear(torch::nn::LinearOptions(dim, 64).bias(false));  // 4096 weights: 8-bit
    {
      torch::NoGradGuard no_grad;
      net->weight.fill_(1.0);
    }
    const double start = distance(net->weight.detach());
    auto body = [&](auto model, auto& optimizer) {
      torch::manual_seed(data_seed);
      for (int s = 0; s < 300; ++s) {
        const auto x = torch::randn({batch, dim});
        const auto y = torch::matmul(x, target.t()).expand({batch, 64});
        optimizer.zero_grad();
        const auto loss = torch::mse_loss(model(x), y);
        {
          auto scaled = amp::scale_loss(loss, optimizer);
          scaled.backward();
        }
        optimizer.step();
      }
      return std::make_pair(start, distance(amp::master_params(optimizer).front().detach()));
    };
    if (lamb) {
      auto [model, optimizer] = amp::initialize(net, amp::optim::FusedLAMB(net->parameters(), amp::optim::FusedLAMBOptions(1e-3).weight_decay(0)), options);
      return body(model, optimizer);
    }
    auto [model, optimizer] = amp::initialize(net, amp::optim::FusedAdamW(net->parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0)), options);
    return body(model, optimizer);
  };
  for (const bool lamb : {false, true}) {
    const auto fp32 = train(sf_options("O2", torch::kBFloat16, OptimizerStateFormat::kFp32), lamb, 2);
    const auto o3 = train(sf_options("O3", torch::kBFloat16, OptimizerStateFormat::kFp32), lamb, 2);
    std::printf("[ curves   ] %s distance from the optimum, start -> end: fp32 moments %.3g -> %.3g, O3 -> %.3g",
                lamb ? "LAMB" : "AdamW", fp32.first, fp32.second, o3.second);
    EXPECT_GT(o3.second, 0.9 * o3.first) << "O3's updates should vanish in bf16 here";
    EXPECT_LT(fp32.second, 0.01 * fp32.first);
    for (const auto format : {OptimizerStateFormat::kBf16, OptimizerStateFormat::k8Bit}) {
      const auto run = train(sf_options("O2", torch::kBFloat16, format), lamb, 2);
      std::printf(", %s -> %.3g (closes %.5f of fp32's)", amp::to_string(format), run.second,
                  (run.first - run.second) / (fp32.first - fp32.second));
      EXPECT_GE(run.first - run.second, 0.999 * (fp32.first - fp32.second)) << amp::to_string(format);
    }
    std::printf("\n");
  }
}

// A bench-style task: an MLP memorizing random labels (the loss falls slowly and stays far from 0), 300 steps at O2
// bf16. Each format ends within 3% of fp32 moments' loss (mean of the last 20 steps); LAMB's close at least 98% of
// fp32 moments' loss drop.
TEST(StateFormatQualityTest, MemorizationWithinThreePercentOfFp32Moments) {
  SKIP_WITHOUT_CPU_KERNELS(torch::kBFloat16);
  torch::manual_seed(12);
  const auto x = torch::randn({512, 64}), y = torch::randint(4, {512}, torch::kLong);
  auto train = [&](OptimizerStateFormat format, bool lamb) {
    auto net = sf_net();
    auto body = [&](auto model, auto& optimizer) {
      double first = 0, tail = 0;
      for (int s = 0; s < 300; ++s) {
        const double loss = sf_step(model, optimizer, x, y);
        if (s == 0) first = loss;
        if (s >= 280) tail += loss / 20;
      }
      return std::make_pair(first, tail);
    };
    const auto options = sf_options("O2", torch::kBFloat16, format);
    if (lamb) {
      auto [model, optimizer] = amp::initialize(net, amp::optim::FusedLAMB(net->parameters(), amp::optim::FusedLAMBOptions(3e-3)), options);
      return body(model, optimizer);
    }
    auto [model, optimizer] = amp::initialize(net, amp::optim::FusedAdamW(net->parameters(), torch::optim::AdamWOptions(3e-3)), options);
    return body(model, optimizer);
  };
  for (const bool lamb : {false, true}) {
    const auto fp32 = train(OptimizerStateFormat::kFp32, lamb);
    std::printf("[ curves   ] %s memorization, first -> mean of the last 20 losses: fp32 moments %.4f -> %.4f",
                lamb ? "LAMB" : "AdamW", fp32.first, fp32.second);
    EXPECT_LT(fp32.second, 0.8 * fp32.first);
    for (const auto format : {OptimizerStateFormat::kBf16, OptimizerStateFormat::k8Bit}) {
      const auto run = train(format, lamb);
      std::printf(", %s %.4f -> %.4f", amp::to_string(format), run.first, run.second);
      EXPECT_LE(run.second, 1.03 * fp32.second) << amp::to_string(format);
      if (lamb) EXPECT_GE(run.first - run.second, 0.98 * (fp32.first - fp32.second)) << amp::to_string(format);
    }
    std::printf("\n");
  }
}

// amsgrad's max_exp_avg_sq takes the unsigned map: the CPU loop and the per-op route (fp32 values through ATen's
// ops) train alike.
TEST(StateFormatCompositionTest, AmsgradOnBothRoutes) {
  auto run = [&](amp::optim::detail::FusedRoute route) {
    const amp::optim::detail::FusedRouteGuard forced(route);
    torch::manual_seed(4);
    auto w = (torch::randn({64, 128}) * 0.1).requires_grad_();
    amp::optim::FusedAdam optimizer(std::vector<torch::Tensor>{w}, torch::optim::AdamOptions(1e-2).amsgrad(true));
    set_format(optimizer, OptimizerStateFormat::k8Bit);
    const auto x = torch::randn({32, 128});
    for (int s = 0; s < 10; ++s) {
      optimizer.zero_grad();
      torch::nn::functional::linear(x, w).pow(2).mean().backward();
      optimizer.step();
    }
    auto& state = static_cast<torch::optim::AdamParamState&>(*optimizer.state().at(amp::detail::state_key(optimizer.state(), w)));
    EXPECT_TRUE(amp::detail::is_packed(state.max_exp_avg_sq()));
    return std::make_pair(w.detach().clone(), amp::detail::decode_moment(state.max_exp_avg_sq(), w.sizes(), Moment::kUnsigned));
  };
  const auto [w_cpu, v_cpu] = run(amp::optim::detail::FusedRoute::kAuto);
  const auto [w_op, v_op] = run(amp::optim::detail::FusedRoute::kPerOp);
  EXPECT_LT((w_cpu - w_op).abs().max().item<double>(), 1e-3);
  EXPECT_LT(((v_cpu - v_op).abs() / v_op.abs().max()).max().item<double>(), 0.02);
}

// ---- errors ------------------------------------------------------------------------------------------

TEST(StateFormatErrorsTest, OptimizersThatKeepFp32MomentsAreRefused) {
  auto net = sf_net();
  ASSERT_THROWS_WITH(amp::initialize(net, torch::optim::Adam(net->parameters()), sf_options("O2", torch::kBFloat16, OptimizerStateFormat::k8Bit)),
                     "amp::initialize: optimizer_state_format 8bit stores Adam's moments inside amp's fused step; this "
                     "optimizer is amp::Optimizer<torch::optim::Adam>, whose step keeps them in fp32. Use "
                     "amp::optim::FusedAdam, FusedAdamW, FusedLAMB or FusedMuon (same options as torch::optim's Adam and "
                     "AdamW), or optimizer_state_format fp32.");
  EXPECT_EQ(net->parameters().front().scalar_type(), torch::kFloat) << "a refused initialize leaves the model as it was";
  ASSERT_THROWS_WITH(amp::initialize(net, amp::optim::FusedSGD(net->parameters(), torch::optim::SGDOptions(0.1)),
                                     sf_options("O0", torch::kBFloat16, OptimizerStateFormat::kBf16)),
                     "amp::initialize: optimizer_state_format bf16 stores Adam's two moments; amp::optim::FusedSGD keeps "
                     "one momentum buffer, which stays in the parameter's dtype. Use amp::optim::FusedAdam, FusedAdamW, "
                     "FusedLAMB or FusedMuon, or optimizer_state_format fp32.");
}

TEST(StateFormatErrorsTest, ConfigKeyAndItsBadValue) {
  auto config = [](const std::string& text) {
    const std::string path = ::testing::TempDir() + "/state_format.cfg";
    std::ofstream(path) << text;
    return path;
  };
  EXPECT_EQ(amp::load_options(config("opt_level = O2\noptimizer_state_format = 8bit\n")).resolve().optimizer_state_format,
            OptimizerStateFormat::k8Bit);
  EXPECT_EQ(amp::load_options(config("opt_level = O1\noptimizer_state_format = bf16\n")).resolve().optimizer_state_format,
            OptimizerStateFormat::kBf16);
  const std::string bad = config("opt_level = O2\noptimizer_state_format = int8\n");
  ASSERT_THROWS_WITH(amp::load_options(bad), "optimizer_state_format");
  ASSERT_THROWS_WITH(amp::load_options(bad), "expected fp32, bf16 or 8bit");
}

// An archive with 8-bit moments can't resume a LibTorch optimizer (its step would read codes as values); a fused one
// of another format converts them at its next step.
TEST(StateFormatErrorsTest, EightBitArchivesNeedAFusedOptimizer) {
  const auto [x, y] = amp_test::blobs(64, 64, 4, 8);
  auto net = sf_net();
  auto [model, optimizer] = amp::initialize(net, amp::optim::FusedAdamW(net->parameters()),
                                            sf_options("O0", torch::kBFloat16, OptimizerStateFormat::k8Bit));
  sf_step(model, optimizer, x, y);
  std::stringstream bytes;
  torch::save(optimizer, bytes);
  auto net2 = sf_net();
  auto [model2, plain] = amp::initialize(net2, torch::optim::AdamW(net2->parameters()), sf_options("O0", torch::kBFloat16, OptimizerStateFormat::kFp32));
  std::stringstream copy(bytes.str());
  ASSERT_THROWS_WITH(torch::load(plain, copy),
                     "amp::Optimizer::load: the checkpoint holds Adam's moments in optimizer_state_format 8bit, which "
                     "only amp's fused Adam, AdamW, LAMB and Muon read; this optimizer is amp::Optimizer<torch::optim::AdamW>. "
                     "Resume with amp::optim::FusedAdam, FusedAdamW, FusedLAMB or FusedMuon.");
  auto net3 = sf_net();
  auto [model3, fp32] = amp::initialize(net3, amp::optim::FusedAdamW(net3->parameters()), sf_options("O0", torch::kBFloat16, OptimizerStateFormat::kFp32));
  std::stringstream again(bytes.str());
  torch::load(fp32, again);
  sf_step(model3, fp32, x, y);
  for (const auto& m : sf_moments(fp32)) EXPECT_EQ(m.scalar_type(), torch::kFloat);
}

// An archive loaded into an optimizer whose parameters come in another order hands each parameter another one's
// moments: every format's step refuses them (the loops would read and write past the smaller tensor).
TEST(StateFormatErrorsTest, MomentsOfAnotherParameterAreRefusedAtTheStep) {
  const auto [x, y] = amp_test::blobs(64, 64, 4, 9);
  for (const auto format : {OptimizerStateFormat::kFp32, OptimizerStateFormat::kBf16, OptimizerStateFormat::k8Bit}) {
    SCOPED_TRACE(amp::to_string(format));
    auto net = sf_net();
    auto [model, optimizer] = amp::initialize(net, amp::optim::FusedAdamW(net->parameters()),
                                              sf_options("O0", torch::kBFloat16, format));
    sf_step(model, optimizer, x, y);
    std::stringstream bytes;
    torch::save(optimizer, bytes);
    auto net2 = sf_net();
    std::vector<torch::Tensor> reversed = net2->parameters();
    std::reverse(reversed.begin(), reversed.end());
    auto [model2, optimizer2] = amp::initialize(net2, amp::optim::FusedAdamW(reversed), sf_options("O0", torch::kBFloat16, format));
    torch::load(optimizer2, bytes);  // b.bias (4 values) now holds a.weight's moments (8192)
    ASSERT_THROWS_WITH(sf_step(model2, optimizer2, x, y),
                       "amp::optim: an Adam moment of 8192 values is the state of a parameter of shape [4] (4 "
                       "values): the optimizer's state was loaded from another model or another order of parameters. "
                       "Load the checkpoint into an optimizer built as the saved one was (same model, same param groups "
                       "in the same order).");
  }
}

}  // namespace
