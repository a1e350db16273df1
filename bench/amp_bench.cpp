// amp's benchmarks: what each level costs and buys, and what amp's own machinery costs.
//   amp_bench [--section all|steps|overhead|unscale|fused|clip|lamb|checkpoint|o1|o1_profile|o1_dispatch|versus_python|masters|policy|torchscript|fp8] [--reps 7] [--csv FILE]
// Every number is the median of --reps repetitions after warm-up; each repetition runs enough steps
// to last ~0.3 s. Prints markdown tables and, with --csv, one CSV row per measurement.

#include <amp/amp.h>
#include <torch/torch.h>
#include <torch/csrc/jit/runtime/graph_executor.h>
#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <sstream>
#include <tuple>

#include "core/host_sync.h"
#include "../examples/common/memory_meter.h"
#include "fp8_task.h"
#include "models.h"
#include "op_profile.h"
#include "timing.h"
#include "training_steps.h"
#include "optim/cpu_state_codec.h"
#include "optim/fused_route.h"
#include "optim/fused_step_context.h"
#include "optim/state_format.h"
#include "scaling/multi_tensor.h"

namespace {

using Clock = std::chrono::steady_clock;

int reps = 7;
std::ofstream csv;

void record(const std::string& section, const std::string& name, const std::string& config, const std::string& metric,
            double value) {
  if (csv) csv << section << "," << name << "," << config << "," << metric << "," << value << "\n";
}

using bench::median;

// Seconds per call of `f`: warm-up, then `reps` repetitions of K calls (K sized to ~0.3 s), median.
template <class F>
double time_per_call(F&& f, double rep_seconds = 0.3) {
  f();
  auto start = Clock::now();
  f();
  const double once = std::chrono::duration<double>(Clock::now() - start).count();
  const int k = std::max(1, std::min(2000, static_cast<int>(rep_seconds / std::max(once, 1e-7))));
  std::vector<double> samples;
  for (int r = 0; r < reps; ++r) {
    start = Clock::now();
    for (int i = 0; i < k; ++i) f();
    samples.push_back(std::chrono::duration<double>(Clock::now() - start).count() / k);
  }
  return median(samples);
}

// bench/timing.h's, with --reps repetitions.
std::vector<double> time_alternating(const std::vector<std::function<void()>>& fs, double rep_seconds = 0.3) {
  return bench::time_alternating(fs, reps, rep_seconds);
}

template <class A, class B>
std::pair<double, double> time_interleaved(A&& a, B&& b, double rep_seconds = 0.3) {
  const auto t = time_alternating({a, b}, rep_seconds);
  return {t[0], t[1]};
}

std::string cpu_flags() {
  std::ifstream in("/proc/cpuinfo");
  std::string line, model;
  std::set<std::string> flags;
  while (std::getline(in, line)) {
    if (model.empty() && line.rfind("model name", 0) == 0) model = line.substr(line.find(':') + 2);
    if (line.rfind("flags", 0) == 0) {
      std::istringstream words(line.substr(line.find(':') + 1));
      for (std::string w; words >> w;) flags.insert(w);
      break;
    }
  }
  std::string out = model + "; flags:";
  for (const char* f : {"avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile"}) {
    out += std::string(" ") + f + (flags.count(f) ? "+" : "-");
  }
  return out;
}

void print_environment() {
  std::printf("## Environment\n\n- LibTorch %s, %d intra-op threads (OMP_NUM_THREADS=%s)\n- CPU: %s\n", TORCH_VERSION,
              at::get_num_threads(), std::getenv("OMP_NUM_THREADS") ? std::getenv("OMP_NUM_THREADS") : "unset",
              cpu_flags().c_str());
  std::istringstream config(at::show_config());
  for (std::string line; std::getline(config, line);) {
    if (line.find("BLAS") != std::string::npos || line.find("CPU capability") != std::string::npos ||
        line.find("oneDNN") != std::string::npos || line.find("MKL") != std::string::npos) {
      std::printf("- %s\n", line.substr(line.find_first_not_of(" -")).c_str());
    }
  }
  std::printf("- median of %d repetitions after warm-up\n\n", reps);
}

struct Config {
  std::string name;
  amp::OptLevel level;
  c10::ScalarType dtype;
};

const std::vector<Config> kConfigs = {
    {"O0", amp::OptLevel::O0, torch::kBFloat16},      {"O1 bf16", amp::OptLevel::O1, torch::kBFloat16},
    {"O2 bf16", amp::OptLevel::O2, torch::kBFloat16}, {"O3 bf16", amp::OptLevel::O3, torch::kBFloat16},
    {"O1 fp16", amp::OptLevel::O1, torch::kHalf},     {"O2 fp16", amp::OptLevel::O2, torch::kHalf},
    {"O3 fp16", amp::OptLevel::O3, torch::kHalf}};

template <class Net>
int64_t parameter_count(Net& net) {
  int64_t n = 0;
  for (auto& p : net->parameters()) n += p.numel();
  return n;
}

template <class Net>
void steps_for(const std::string& name, MemoryMeter& meter) {
  std::printf("### %s\n\n| config | ms/step | samples/s | speedup vs O0 | state B/param between steps | B/param at peak | loss after 10 steps |\n|---|---|---|---|---|---|---|\n",
              name.c_str());
  double o0_ms = 0;
  for (const auto& config : kConfigs) {
    torch::manual_seed(0);
    const auto x = bench::input_for(name);
    const auto y = torch::randint(10, {x.size(0)}, torch::kLong);
    const size_t baseline = meter.current_bytes();
    Net net;
    const double params = static_cast<double>(parameter_count(net));
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
    try {
      auto [model, optimizer] =
          amp::initialize(net, std::move(sgd), amp::Options(config.level).low_precision_dtype(config.dtype).verbosity(0));
      torch::Tensor loss;
      for (int i = 0; i < 10; ++i) loss = bench::amp_step(model, optimizer, x, y);
      const double loss10 = loss.item<double>();
      const double between = static_cast<double>(meter.current_bytes() - baseline) / params;
      meter.reset_peak();
      bench::amp_step(model, optimizer, x, y);
      const double peak = static_cast<double>(meter.peak_bytes() - baseline) / params;
      const double ms = 1e3 * time_per_call([&] { bench::amp_step(model, optimizer, x, y); });
      if (config.name == "O0") o0_ms = ms;
      std::printf("| %s | %.3f | %.0f | %.2fx | %.1f | %.1f | %.4f |\n", config.name.c_str(), ms,
                  1e3 * bench::batch_of(name) / ms, o0_ms / ms, between, peak, loss10);
      record("steps", name, config.name, "ms_per_step", ms);
      record("steps", name, config.name, "speedup_vs_O0", o0_ms / ms);
      record("steps", name, config.name, "state_bytes_per_param", between);
      record("steps", name, config.name, "peak_bytes_per_param", peak);
      record("steps", name, config.name, "loss_after_10", loss10);
    } catch (const c10::Error& e) {
      std::string why = e.what_without_backtrace();
      std::printf("| %s | skipped: %s | | | | | |\n", config.name.c_str(), why.substr(0, why.find('\n')).substr(0, 120).c_str());
    }
  }
  std::printf("\n");
}

template <class Net>
void overhead_for(const std::string& name) {
  for (bool o2 : {false, true}) {
    torch::manual_seed(0);
    const auto x = bench::input_for(name);
    const auto y = torch::randint(10, {x.size(0)}, torch::kLong);
    bench::HandWritten<Net> hand(o2);
    Net net;
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
    auto [model, optimizer] = amp::initialize(
        net, std::move(sgd), amp::Options(o2 ? "O2" : "O1").low_precision_dtype(torch::kBFloat16).verbosity(0));
    const int64_t syncs_before = amp::detail::host_sync_count();
    int64_t amp_steps = 0;
    const auto [amp_s, hand_s] = time_interleaved([&] { bench::amp_step(model, optimizer, x, y); ++amp_steps; },
                                                  [&] { hand.step(x, y); });
    const double syncs = static_cast<double>(amp::detail::host_sync_count() - syncs_before) / amp_steps;
    const std::string level = o2 ? "O2 bf16" : "O1 bf16";
    std::printf("| %s | %s | %.3f | %.3f | %.3f | %.2f |\n", name.c_str(), level.c_str(), 1e3 * amp_s, 1e3 * hand_s,
                amp_s / hand_s, syncs);
    record("overhead", name, level, "amp_ms", 1e3 * amp_s);
    record("overhead", name, level, "hand_ms", 1e3 * hand_s);
    record("overhead", name, level, "ratio", amp_s / hand_s);
    record("overhead", name, level, "host_syncs_per_step", syncs);
  }
}

// Bytes per second of a large copy_ (read + write), the machine's streaming bandwidth for one thread set.
double copy_bandwidth() {
  auto src = torch::ones({int64_t{1} << 26}), dst = torch::empty({int64_t{1} << 26});
  const double s = time_per_call([&] { dst.copy_(src); });
  return 2.0 * static_cast<double>(src.nbytes()) / s;
}

// `count` parameters of `total / count` elements: the "model" of the optimizer-only benchmark.
struct ParamBankImpl : torch::nn::Module {
  ParamBankImpl(int64_t total, int64_t count) {
    for (int64_t i = 0; i < count; ++i) register_parameter("p" + std::to_string(i), torch::randn({total / count}) * 0.01);
  }
};
TORCH_MODULE(ParamBank);

// The optimizer step alone: LibTorch's optimizer vs amp's fused one, plain fp32 and inside amp at O2 (masters
// stepped, then written into the low-precision model: LibTorch's step + amp's copy pass vs one fused pass).
template <class Plain, class Fused, class Options>
void optimizer_step_rows(const std::string& opt_name, const Options& options, double bytes_per_element, double bandwidth) {
  for (int64_t total : {int64_t{1} << 20, int64_t{1} << 24}) {
    for (int64_t count : {10, 100, 1000}) {
      for (const char* level : {"fp32", "O2 bf16", "O2 fp16"}) {
        const bool o2 = std::string(level) != "fp32";
        torch::manual_seed(0);
        ParamBank plain_bank(total, count), fused_bank(total, count);
        auto grads = [](const std::vector<torch::Tensor>& params) {
          for (const auto& p : params) p.mutable_grad() = torch::full_like(p, 1e-3);
        };
        double plain_s = 0, fused_s = 0;
        if (o2) {
          const auto amp_options = amp::Options("O2").low_precision_dtype(std::string(level) == "O2 fp16" ? torch::kHalf : torch::kBFloat16).verbosity(0);
          auto [pm, plain] = amp::initialize(plain_bank, Plain(plain_bank->parameters(), options), amp_options);
          auto [fm, fused] = amp::initialize(fused_bank, Fused(fused_bank->parameters(), options), amp_options);
          grads(amp::master_params(plain));
          grads(amp::master_params(fused));
          std::tie(plain_s, fused_s) = time_interleaved([&, &plain = plain] { plain.step(); }, [&, &fused = fused] { fused.step(); }, 0.2);
        } else {
          Plain plain(plain_bank->parameters(), options);
          Fused fused(fused_bank->parameters(), options);
          grads(plain_bank->parameters());
          grads(fused_bank->parameters());
          std::tie(plain_s, fused_s) = time_interleaved([&] { plain.step(); }, [&] { fused.step(); }, 0.2);
        }
        const double bytes = (bytes_per_element + (o2 ? 2.0 : 0.0)) * static_cast<double>(total);
        const double fused_gbs = bytes / fused_s / 1e9, bound_s = bytes / bandwidth;
        const std::string label = std::to_string(total >> 20) + "M";
        std::printf("| %s | %lld | %s | %s | %.3f | %.3f | %.2f | %.1f | %.2f |\n", label.c_str(), static_cast<long long>(count),
                    opt_name.c_str(), level, 1e3 * plain_s, 1e3 * fused_s, plain_s / fused_s, fused_gbs, fused_s / bound_s);
        const std::string config = opt_name + " " + level + " x" + std::to_string(count);
        record("optimizer_step", label, config, "libtorch_ms", 1e3 * plain_s);
        record("optimizer_step", label, config, "fused_ms", 1e3 * fused_s);
        record("optimizer_step", label, config, "speedup", plain_s / fused_s);
        record("optimizer_step", label, config, "fused_GBps", fused_gbs);
        record("optimizer_step", label, config, "fused_over_copy_bound", fused_s / bound_s);
      }
    }
  }
}

// Whole training steps: amp with the fused optimizer, amp with LibTorch's, and the hand-written LibTorch loop
// with LibTorch's optimizer (the overhead section's reference).
template <class Net>
void fused_steps_for(const std::string& name) {
  for (bool adam : {false, true}) {
    for (bool o2 : {false, true}) {
      torch::manual_seed(0);
      const auto x = bench::input_for(name);
      const auto y = torch::randint(10, {x.size(0)}, torch::kLong);
      bench::HandWritten<Net> hand(o2, adam);
      Net plain_net, fused_net;
      const auto options = amp::Options(o2 ? "O2" : "O1").low_precision_dtype(torch::kBFloat16).verbosity(0);
      auto timed = [&](auto plain_opt, auto fused_opt) {
        auto [pm, plain] = amp::initialize(plain_net, std::move(plain_opt), options);
        auto [fm, fused] = amp::initialize(fused_net, std::move(fused_opt), options);
        const int64_t syncs_before = amp::detail::host_sync_count();
        for (int i = 0; i < 10; ++i) bench::amp_step(fm, fused, x, y);
        const double syncs = static_cast<double>(amp::detail::host_sync_count() - syncs_before) / 10;
        const auto t = time_alternating({[&, &fm = fm, &fused = fused] { bench::amp_step(fm, fused, x, y); },
                                         [&, &pm = pm, &plain = plain] { bench::amp_step(pm, plain, x, y); },
                                         [&] { hand.step(x, y); }});
        return std::make_tuple(t[0], t[1], t[2], syncs);
      };
      const auto [fused_s, plain_s, hand_s, syncs] =
          adam ? timed(torch::optim::Adam(plain_net->parameters(), torch::optim::AdamOptions(1e-4)),
                       amp::optim::FusedAdam(fused_net->parameters(), torch::optim::AdamOptions(1e-4)))
               : timed(torch::optim::SGD(plain_net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9)),
                       amp::optim::FusedSGD(fused_net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9)));
      const std::string config = std::string(o2 ? "O2 bf16 " : "O1 bf16 ") + (adam ? "Adam" : "SGD");
      std::printf("| %s | %s | %.3f | %.3f | %.3f | %.3f | %.3f | %.2f |\n", name.c_str(), config.c_str(), 1e3 * fused_s,
                  1e3 * plain_s, 1e3 * hand_s, fused_s / hand_s, plain_s / hand_s, syncs);
      record("fused_steps", name, config, "amp_fused_ms", 1e3 * fused_s);
      record("fused_steps", name, config, "amp_libtorch_ms", 1e3 * plain_s);
      record("fused_steps", name, config, "hand_ms", 1e3 * hand_s);
      record("fused_steps", name, config, "fused_over_hand", fused_s / hand_s);
      record("fused_steps", name, config, "libtorch_over_hand", plain_s / hand_s);
      record("fused_steps", name, config, "host_syncs_per_step", syncs);
    }
  }
}

void fused_section() {
  const double bandwidth = copy_bandwidth();
  std::printf("## Fused optimizers: the optimizer step alone\n\nLibTorch's optimizer vs amp::optim::Fused* on the same "
              "parameters and gradients. fp32: the optimizers alone; O2: amp's step (fp32 masters stepped, then the "
              "model's low-precision parameters written: LibTorch's step + amp's copy pass vs one fused pass). Memory "
              "traffic: the bytes the step must touch (SGD momentum 20 B/element, Adam 28, +2 for the O2 model copy) per "
              "second of the fused step, and the fused time over those bytes at a large copy_'s rate (%.1f GB/s; below 1 "
              "where the data sits in cache, or where copy_ itself does not reach the memory's rate).\n\n| elements | "
              "tensors | optimizer | level | LibTorch ms | fused ms | LibTorch / fused | fused GB/s | fused / copy_ bound "
              "|\n|---|---|---|---|---|---|---|---|---|\n", bandwidth / 1e9);
  optimizer_step_rows<torch::optim::SGD, amp::optim::FusedSGD>("SGD momentum", torch::optim::SGDOptions(0.01).momentum(0.9), 20.0, bandwidth);
  optimizer_step_rows<torch::optim::Adam, amp::optim::FusedAdam>("Adam", torch::optim::AdamOptions(1e-3), 28.0, bandwidth);
  std::printf("\n## Fused optimizers: whole training steps\n\namp with amp::optim::Fused*, amp with LibTorch's optimizer, and "
              "the hand-written LibTorch loop of the overhead section with LibTorch's optimizer; interleaved repetitions.\n\n"
              "| model | config | amp fused ms | amp LibTorch ms | hand ms | amp fused / hand | amp LibTorch / hand | host syncs per "
              "fused step |\n|---|---|---|---|---|---|---|---|\n");
  fused_steps_for<bench::TinyMlp>("tiny_mlp");
  fused_steps_for<bench::Mlp>("mlp");
  fused_steps_for<bench::Cnn>("cnn");
  fused_steps_for<bench::Transformer>("transformer");
  std::printf("\n");
}

void unscale_section() {
  std::printf("## Unscale + inf/NaN check\n\namp's pass vs the bandwidth bound over the same buffers: in-place `mul_` (fp32 grads), or a plain `copy_` (O2: low-precision model grads into fp32 master grads).\n\n"
              "| elements | tensors | grads | amp ms | bound ms | amp / bound | host syncs per call |\n|---|---|---|---|---|---|---|\n");
  for (int64_t total : {int64_t{1} << 20, int64_t{1} << 24}) {
    for (int64_t count : {1, 100, 1000}) {
      for (const char* kind : {"fp32", "bf16->fp32", "fp16->fp32"}) {
        const bool o2 = std::string(kind) != "fp32";
        const auto src_dtype = std::string(kind) == "fp16->fp32" ? torch::kHalf : std::string(kind) == "bf16->fp32" ? torch::kBFloat16 : torch::kFloat;
        std::vector<torch::Tensor> src, dst;
        for (int64_t i = 0; i < count; ++i) {
          src.push_back(torch::ones({total / count}, src_dtype));
          dst.push_back(torch::empty({total / count}));
        }
        int flip = 0;
        int64_t calls = 0;
        const int64_t syncs_before = amp::detail::host_sync_count();
        auto amp_pass = [&] {
          const double inv = (++flip % 2) ? 0.5 : 2.0;  // keeps the values from sinking into denormals
          amp::detail::FoundInf found;
          if (o2) amp::detail::unscale_into(src, dst, false, inv, found);
          else amp::detail::unscale_(src, inv, found);
          (void)found.any();
          ++calls;
        };
        auto bound = [&] {
          const double inv = (++flip % 2) ? 0.5 : 2.0;
          if (o2) for (int64_t i = 0; i < count; ++i) dst[i].copy_(src[i]);
          else for (auto& t : src) t.mul_(inv);
        };
        const auto [amp_s, bound_s] = time_interleaved(amp_pass, bound, 0.2);
        const double syncs = static_cast<double>(amp::detail::host_sync_count() - syncs_before) / calls;
        const std::string label = std::to_string(total >> 20) + "M";
        std::printf("| %s | %lld | %s | %.3f | %.3f | %.2f | %.0f |\n", label.c_str(), static_cast<long long>(count), kind,
                    1e3 * amp_s, 1e3 * bound_s, amp_s / bound_s, syncs);
        const std::string config = std::string(kind) + " x" + std::to_string(count);
        record("unscale", label, config, "amp_ms", 1e3 * amp_s);
        record("unscale", label, config, "bound_ms", 1e3 * bound_s);
        record("unscale", label, config, "ratio", amp_s / bound_s);
        record("unscale", label, config, "host_syncs_per_call", syncs);
      }
    }
  }
  std::printf("\n");
}

// Tensors of `total / count` elements, with gradients, for the clipping and LAMB rows.
std::vector<torch::Tensor> params_with_grads(int64_t total, int64_t count) {
  std::vector<torch::Tensor> params;
  for (int64_t i = 0; i < count; ++i) {
    auto p = torch::randn({total / count}).requires_grad_(true);
    p.mutable_grad() = torch::randn({total / count});
    params.push_back(p);
  }
  return params;
}

// One row "| 1M | 100 | a ms | b ms | b / a |" of the clip and lamb tables, and its CSV records.
void ratio_row(const char* section, int64_t total, int64_t count, std::pair<const char*, double> a,
               std::pair<const char*, double> b, const char* ratio_metric) {
  const std::string label = std::to_string(total >> 20) + "M";
  std::printf("| %s | %lld | %.3f | %.3f | %.2f |\n", label.c_str(), static_cast<long long>(count), 1e3 * a.second,
              1e3 * b.second, b.second / a.second);
  const std::string config = "fp32 x" + std::to_string(count);
  record(section, label, config, a.first, 1e3 * a.second);
  record(section, label, config, b.first, 1e3 * b.second);
  record(section, label, config, ratio_metric, b.second / a.second);
}

void clip_section() {
  std::printf("## Gradient clipping\n\namp::clip_grad_norm_'s pass (one norm pass over all tensors, accumulated in double, "
              "then one scaling pass; the norm stays a tensor) vs LibTorch's torch::nn::utils::clip_grad_norm_ (a norm "
              "op per tensor, the total read back as a double, a mul_ per tensor) on the same fp32 gradients, max_norm "
              "1.0; interleaved repetitions.\n\n| elements | tensors | amp ms | LibTorch ms | LibTorch / amp |\n|---|---|---|---|---|\n");
  for (int64_t total : {int64_t{1} << 20, int64_t{1} << 24}) {
    for (int64_t count : {10, 100, 1000}) {
      const auto params = params_with_grads(total, count);
      std::vector<torch::Tensor> grads;
      for (const auto& p : params) grads.push_back(p.grad());
      const auto [amp_s, torch_s] = time_interleaved(
          [&] { amp::detail::clip_grads(grads, 1.0, 2.0, torch::Tensor()); },
          [&] { torch::nn::utils::clip_grad_norm_(params, 1.0); }, 0.2);
      ratio_row("clip", total, count, {"amp_ms", amp_s}, {"libtorch_ms", torch_s}, "libtorch_over_amp");
    }
  }
  std::printf("\n");
}

void lamb_section() {
  std::printf("## FusedLAMB: the optimizer step alone\n\nLibTorch has no LAMB. amp::optim::FusedLAMB's CPU loop (per "
              "tensor: the update in one pass, its norm and the parameter's, then the parameter in a second pass) vs the "
              "same update in ATen ops, one op after another (FusedLAMB's per-op route, what a LAMB written with LibTorch "
              "tensor ops does), fp32, Apex's defaults; interleaved repetitions.\n\n| elements | tensors | fused ms | "
              "per-op ms | per-op / fused |\n|---|---|---|---|---|\n");
  using amp::optim::detail::FusedRoute;
  for (int64_t total : {int64_t{1} << 20, int64_t{1} << 24}) {
    for (int64_t count : {10, 100, 1000}) {
      auto fused_params = params_with_grads(total, count), per_op_params = params_with_grads(total, count);
      amp::optim::FusedLAMB fused(fused_params), per_op(per_op_params);
      const auto [fused_s, per_op_s] = time_interleaved(
          [&] { fused.step(); },
          [&] {
            amp::optim::detail::force_fused_route(FusedRoute::kPerOp);
            per_op.step();
            amp::optim::detail::force_fused_route(FusedRoute::kAuto);
          }, 0.2);
      ratio_row("lamb", total, count, {"fused_ms", fused_s}, {"per_op_ms", per_op_s}, "per_op_over_fused");
    }
  }
  std::printf("\n");
}

// O2's master weight formats (amp::MasterWeights) and O3, bf16, with a fused optimizer: state bytes per parameter
// held between steps, step time (alternating repetitions) and the loss after 20 steps.
struct MastersConfig {
  std::string name;
  amp::Options options;
};

template <class Net>
void masters_for(const std::string& name, const std::string& optimizer_name, MemoryMeter& meter) {
  const auto bf16 = [](const char* level) { return amp::Options(level).low_precision_dtype(torch::kBFloat16).verbosity(0); };
  const std::vector<MastersConfig> configs = {
      {"O2 copy", bf16("O2")},
      {"O2 split", bf16("O2").master_weights_format(amp::MasterWeights::kSplit)},
      {"O2 stochastic_rounding", bf16("O2").master_weights_format(amp::MasterWeights::kStochasticRounding)},
      {"O2 kahan", bf16("O2").master_weights_format(amp::MasterWeights::kKahan)},
      {"O3", bf16("O3")}};
  torch::manual_seed(0);
  const auto x = bench::input_for(name);
  const auto y = torch::randint(10, {x.size(0)}, torch::kLong);
  struct Run {
    std::function<torch::Tensor()> step;
    double between = 0;
    double loss20 = 0;
  };
  std::vector<Run> runs;
  std::vector<std::shared_ptr<void>> keep;  // the models and optimizers, alive while timed
  for (const auto& config : configs) {
    const size_t baseline = meter.current_bytes();
    torch::manual_seed(1);
    auto net = std::make_shared<Net>();
    const double params = static_cast<double>(parameter_count(*net));
    auto run_with = [&](auto optimizer) {
      using Result = decltype(amp::initialize(*net, std::move(optimizer), config.options));
      auto result = std::make_shared<Result>(amp::initialize(*net, std::move(optimizer), config.options));
      keep.push_back(result);
      Run run;
      run.step = [result, &x, &y] { return bench::amp_step(result->model, result->optimizer, x, y); };
      torch::Tensor loss;
      for (int i = 0; i < 20; ++i) loss = run.step();
      run.loss20 = loss.item<double>();
      run.between = static_cast<double>(meter.current_bytes() - baseline) / params;
      runs.push_back(std::move(run));
    };
    if (optimizer_name == "adam") {
      run_with(amp::optim::FusedAdam((*net)->parameters(), torch::optim::AdamOptions(1e-3)));
    } else {
      run_with(amp::optim::FusedSGD((*net)->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9)));
    }
    keep.push_back(net);
  }
  std::vector<std::function<void()>> steps;
  for (auto& run : runs) steps.push_back([&run] { run.step(); });
  const auto t = time_alternating(steps);
  for (size_t i = 0; i < configs.size(); ++i) {
    std::printf("| %s | %s | %s | %.1f | %.3f | %.2f | %.4f |\n", name.c_str(), optimizer_name.c_str(), configs[i].name.c_str(),
                runs[i].between, 1e3 * t[i], t[i] / t[0], runs[i].loss20);
    record("masters", name + " " + optimizer_name, configs[i].name, "state_bytes_per_param", runs[i].between);
    record("masters", name + " " + optimizer_name, configs[i].name, "ms_per_step", 1e3 * t[i]);
    record("masters", name + " " + optimizer_name, configs[i].name, "loss_after_20", runs[i].loss20);
  }
}

void masters_section(MemoryMeter& meter) {
  std::printf("## O2's master weight formats (bf16)\n\nmaster_weights_format copy (Apex), split, stochastic_rounding and "
              "kahan, and O3, with amp::optim::FusedAdam (lr 1e-3) and FusedSGD (lr 0.01, momentum 0.9). State: bytes "
              "per parameter held between steps (weights, gradients, masters or low bits / compensation, optimizer "
              "state; counted from tensor allocations). Time: alternating repetitions, and the ratio to O2 copy.\n\n"
              "| model | optimizer | config | state B/param | ms/step | / O2 copy | loss after 20 steps |\n"
              "|---|---|---|---|---|---|---|\n");
  for (const char* optimizer : {"adam", "sgd"}) {
    masters_for<bench::Mlp>("mlp", optimizer, meter);
    masters_for<bench::Cnn>("cnn", optimizer, meter);
    masters_for<bench::Transformer>("transformer", optimizer, meter);
  }
  std::printf("\n");
}

// Optimizer state formats (amp::OptimizerStateFormat) with O2's master formats, bf16, amp::optim::FusedAdamW:
// amp::state_bytes per parameter right after a step (gradients defined), each part, and the loss after 20 steps.
template <class Net>
void state_bytes_for(const std::string& name) {
  const auto o2 = [](amp::MasterWeights master, amp::OptimizerStateFormat format) {
    return amp::Options("O2").low_precision_dtype(torch::kBFloat16).master_weights_format(master)
        .optimizer_state_format(format).verbosity(0);
  };
  torch::manual_seed(0);
  const auto x = bench::input_for(name);
  const auto y = torch::randint(10, {x.size(0)}, torch::kLong);
  for (const auto master : {amp::MasterWeights::kCopy, amp::MasterWeights::kSplit, amp::MasterWeights::kStochasticRounding,
                            amp::MasterWeights::kResidual8}) {
    for (const auto format : {amp::OptimizerStateFormat::kFp32, amp::OptimizerStateFormat::kBf16, amp::OptimizerStateFormat::k8Bit}) {
      torch::manual_seed(1);
      Net net;
      const double params = static_cast<double>(parameter_count(net));
      auto [model, optimizer] = amp::initialize(net, amp::optim::FusedAdamW(net->parameters(), torch::optim::AdamWOptions(1e-3)),
                                                o2(master, format));
      torch::Tensor loss;
      for (int i = 0; i < 20; ++i) loss = bench::amp_step(model, optimizer, x, y);
      const amp::StateBytes b = amp::state_bytes(optimizer);
      const std::string config = std::string(amp::to_string(master)) + " + " + amp::to_string(format);
      std::printf("| %s | %s | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.4f |\n", name.c_str(), config.c_str(), b.params / params,
                  b.grads / params, b.masters / params, b.master_grads / params, b.optimizer_state / params,
                  b.total() / params, loss.item<double>());
      record("state_formats", name, config, "state_bytes_per_param", b.total() / params);
      record("state_formats", name, config, "optimizer_state_bytes_per_param", b.optimizer_state / params);
    }
  }
}

// The fused AdamW step over 8 tensors of 2^20 fp32 values with fp32, bf16 and 8-bit moments (alternating repetitions);
// the 8-bit step once on each of the codec's AVX-512 loops this CPU has (same bits, NOTE [Decoding by permutes]), and
// where it has AVX-512, bf16 and 8-bit on the AVX2 loops too.
void state_step_times() {
  using amp::detail::cpu::CodecLoops;
  torch::manual_seed(0);
  struct Row {
    amp::OptimizerStateFormat format;
    CodecLoops loops;
    std::string name;
  };
  std::vector<Row> rows = {{amp::OptimizerStateFormat::kFp32, amp::detail::cpu::default_codec_loops(), "fp32"},
                           {amp::OptimizerStateFormat::kBf16, amp::detail::cpu::default_codec_loops(), "bf16"}};
  for (const auto loops : {CodecLoops::kAvx512Vbmi, CodecLoops::kAvx512}) {
    if (!amp::detail::cpu::codec_loops_on_cpu(loops)) continue;
    rows.push_back({amp::OptimizerStateFormat::k8Bit, loops,
                    std::string(loops == CodecLoops::kAvx512Vbmi ? "8bit (decoding by permutes" : "8bit (decoding by gathers") +
                        (loops == amp::detail::cpu::default_codec_loops() ? ", the default here)" : ")")});
  }
  if (rows.size() == 2) rows.push_back({amp::OptimizerStateFormat::k8Bit, amp::detail::cpu::default_codec_loops(), "8bit"});
  if (amp::detail::cpu::codec_loops_on_cpu(CodecLoops::kAvx512)) {  // what a CPU with AVX2 alone runs
    rows.push_back({amp::OptimizerStateFormat::kBf16, CodecLoops::kAvx2, "bf16 (AVX2 loops)"});
    rows.push_back({amp::OptimizerStateFormat::k8Bit, CodecLoops::kAvx2, "8bit (AVX2 loops)"});
  }
  std::vector<std::function<void()>> steps;
  for (const auto& row : rows) {
    std::vector<torch::Tensor> params;
    for (int i = 0; i < 8; ++i) {
      auto p = torch::randn({1024, 1024}).requires_grad_();
      p.mutable_grad() = torch::randn({1024, 1024}) * 1e-3;
      params.push_back(p);
    }
    auto optimizer = std::make_shared<amp::optim::FusedAdamW>(params, torch::optim::AdamWOptions(1e-4));
    if (row.format != amp::OptimizerStateFormat::kFp32) {
      optimizer->step_context().set_state_format(std::make_shared<amp::detail::StateFormat>(row.format, 7));
    }
    steps.push_back([optimizer, loops = row.loops] {
      amp::detail::cpu::force_codec_loops(loops);
      optimizer->step();
      amp::detail::cpu::force_codec_loops(amp::detail::cpu::default_codec_loops());
    });
  }
  const auto t = time_alternating(steps);
  for (size_t i = 0; i < rows.size(); ++i) {
    std::printf("| %s | %.2f | %.2f | %.2f |\n", rows[i].name.c_str(), 1e3 * t[i], 1e9 * t[i] / (8.0 * 1024 * 1024),
                t[i] / t[0]);
    record("state_formats", "adamw_8x1M", rows[i].name, "ms_per_step", 1e3 * t[i]);
    record("state_formats", "adamw_8x1M", rows[i].name, "over_fp32", t[i] / t[0]);
  }
  const auto decodes = amp::detail::cpu::time_decodes();
  if (decodes.by_permutes > 0) {
    std::printf("\nThe default is timed at the first use (NOTE [Choosing the decode by timing it]); timed again now: "
                "decoding by gathers %.3f ns a value, by permutes %.3f.\n", 1e9 * decodes.by_gathers,
                1e9 * decodes.by_permutes);
  }
}

void state_formats_section() {
  std::printf("## Optimizer state formats\n\noptimizer_state_format fp32, bf16 and 8bit with O2's master formats (bf16), "
              "amp::optim::FusedAdamW (lr 1e-3): amp::state_bytes per parameter after a step (gradients defined), by "
              "part, and the loss after 20 steps. Apex's O2 with FusedAdam holds 20 B/param.\n\n"
              "| model | master + state format | params | grads | masters | master grads | optimizer state | total | loss after 20 |\n"
              "|---|---|---|---|---|---|---|---|---|\n");
  state_bytes_for<bench::Mlp>("mlp");
  state_bytes_for<bench::Transformer>("transformer");
  std::printf("\nThe fused AdamW step alone, 8 tensors of 2^20 fp32 values (CPU loop), alternating repetitions; ns per "
              "value and the ratio to fp32 moments.\n\n| moments | ms/step | ns/value | / fp32 |\n|---|---|---|---|\n");
  state_step_times();
  std::printf("\n");
}

// O1 with Apex's lists and with the build's native lists, each against the hand-written loop doing the same casts.
template <class Net>
void o1_lists_for(const std::string& name) {
  torch::manual_seed(0);
  const auto x = bench::input_for(name);
  const auto y = torch::randint(10, {x.size(0)}, torch::kLong);
  bench::HandWritten<Net> hand_apex(false), hand_native(false);
  hand_native.lists = amp::CastLists::kNative;
  Net apex_net, native_net;
  auto sgd = [](Net& net) { return torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9)); };
  const auto options = amp::Options("O1").low_precision_dtype(torch::kBFloat16).verbosity(0);
  auto [apex_model, apex_opt] = amp::initialize(apex_net, sgd(apex_net), options);
  auto [native_model, native_opt] =
      amp::initialize(native_net, sgd(native_net), amp::Options(options).cast_lists(amp::CastLists::kNative));
  const auto t = time_alternating({[&, &m = apex_model, &o = apex_opt] { bench::amp_step(m, o, x, y); },
                                   [&, &m = native_model, &o = native_opt] { bench::amp_step(m, o, x, y); },
                                   [&] { hand_apex.step(x, y); }, [&] { hand_native.step(x, y); }});
  std::printf("| %s | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.2f |\n", name.c_str(), 1e3 * t[0], 1e3 * t[1],
              1e3 * t[2], 1e3 * t[3], t[0] / t[2], t[1] / t[3], t[0] / t[1]);
  record("o1_lists", name, "O1 bf16 apex", "ms_per_step", 1e3 * t[0]);
  record("o1_lists", name, "O1 bf16 native", "ms_per_step", 1e3 * t[1]);
  record("o1_lists", name, "O1 bf16 apex", "over_hand", t[0] / t[2]);
  record("o1_lists", name, "O1 bf16 native", "over_hand", t[1] / t[3]);
}

void o1_lists_section() {
  std::printf("## O1's cast lists\n\namp's O1 bf16 step with Apex's lists (the default: LibTorch's autocast lists plus "
              "Apex's rows they lack, such as softmax and GELU in fp32) and with cast_lists native (the build's lists "
              "alone, torch.amp's O1), each against the hand-written loop under the same casts; SGD with momentum; "
              "interleaved repetitions.\n\n| model | amp apex ms | amp native ms | hand apex ms | hand native ms | "
              "amp apex / hand | amp native / hand | apex / native |\n|---|---|---|---|---|---|---|---|\n");
  o1_lists_for<bench::TinyMlp>("tiny_mlp");
  o1_lists_for<bench::Mlp>("mlp");
  o1_lists_for<bench::Cnn>("cnn");
  o1_lists_for<bench::Transformer>("transformer");
  std::printf("\n");
}

// Where an O1 step's time goes, per op category, for amp with Apex's lists, amp with the native lists, and torch.amp's
// O1 in C++ (NativeAutocastGuard + amp::GradScaler, the Python script's loop): the step time without the profiler
// (interleaved), then the self time of the ops by category with it (RecordFunction's own cost inflates those).
template <class Net>
void o1_profile_for(const std::string& name) {
  torch::manual_seed(0);
  const auto x = bench::input_for(name);
  const auto y = torch::randint(10, {x.size(0)}, torch::kLong);
  auto sgd = [](Net& net) { return torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9)); };
  const auto options = amp::Options("O1").low_precision_dtype(torch::kBFloat16).verbosity(0);
  Net apex_net, native_net;
  auto [apex_model, apex_opt] = amp::initialize(apex_net, sgd(apex_net), options);
  auto [native_model, native_opt] =
      amp::initialize(native_net, sgd(native_net), amp::Options(options).cast_lists(amp::CastLists::kNative));
  bench::TorchAmpStep<Net> torch_amp(torch::kBFloat16);
  const std::vector<std::pair<std::string, std::function<void()>>> configs = {
      {"amp O1 apex", [&, &m = apex_model, &o = apex_opt] { bench::amp_step(m, o, x, y); }},
      {"amp O1 native", [&, &m = native_model, &o = native_opt] { bench::amp_step(m, o, x, y); }},
      {"torch.amp in C++", [&] { torch_amp.step(x, y); }}};
  std::vector<std::function<void()>> steps;
  for (const auto& c : configs) steps.push_back(c.second);
  const auto t = time_alternating(steps);
  std::printf("### %s\n\n| config | ms/step | ", name.c_str());
  for (int c = 0; c < bench::OpProfile::kCategories; ++c) std::printf("%s ms | ", bench::OpProfile::category_name(c));
  std::printf("outside ops ms |\n|---|---|");
  for (int c = 0; c <= bench::OpProfile::kCategories; ++c) std::printf("---|");
  std::printf("\n");
  std::vector<std::map<std::string, double>> per_op;
  std::vector<std::map<std::string, double>> per_op_calls;
  for (size_t i = 0; i < configs.size(); ++i) {
    const int steps_profiled = std::max(3, static_cast<int>(0.5 / t[i]));
    double profiled_s = 0;
    {
      bench::OpProfile profile;
      const auto start = Clock::now();
      for (int k = 0; k < steps_profiled; ++k) configs[i].second();
      profiled_s = std::chrono::duration<double>(Clock::now() - start).count();
      per_op.push_back(profile.op_ns());
      per_op_calls.emplace_back();
      for (const auto& [op, n] : profile.op_calls()) per_op_calls.back()[op] = static_cast<double>(n) / steps_profiled;
      std::printf("| %s | %.3f | ", configs[i].first.c_str(), 1e3 * t[i]);
      for (int c = 0; c < bench::OpProfile::kCategories; ++c) {
        const double ms = 1e-6 * profile.category_ns()[c] / steps_profiled;
        std::printf("%.3f | ", ms);
        record("o1_profile", name, configs[i].first, bench::OpProfile::category_name(c), ms);
      }
      const double outside = 1e3 * profiled_s / steps_profiled - 1e-6 * profile.op_total_ns() / steps_profiled;
      std::printf("%.3f |\n", outside);
      for (auto& [op, ns] : per_op.back()) ns /= steps_profiled;
    }
    record("o1_profile", name, configs[i].first, "ms_per_step", 1e3 * t[i]);
  }
  // The ops whose time differs most between the configurations.
  std::map<std::string, double> spread;
  for (const auto& ops : per_op) {
    for (const auto& [op, ns] : ops) spread[op] = 0;
  }
  for (auto& [op, s] : spread) {
    double lo = 1e300, hi = 0;
    for (const auto& ops : per_op) {
      const auto it = ops.find(op);
      const double v = it == ops.end() ? 0.0 : it->second;
      lo = std::min(lo, v), hi = std::max(hi, v);
    }
    s = hi - lo;
  }
  std::vector<std::pair<double, std::string>> ranked;
  for (const auto& [op, s] : spread) ranked.push_back({s, op});
  std::sort(ranked.rbegin(), ranked.rend());
  std::printf("\nSelf time per step of the ops that differ most (ms, with the profiler on):\n\n| op |");
  for (const auto& c : configs) std::printf(" %s |", c.first.c_str());
  std::printf("\n|---|");
  for (size_t i = 0; i < configs.size(); ++i) std::printf("---|");
  std::printf("\n");
  for (size_t r = 0; r < std::min<size_t>(12, ranked.size()); ++r) {
    std::printf("| %s |", ranked[r].second.c_str());
    for (const auto& ops : per_op) {
      const auto it = ops.find(ranked[r].second);
      std::printf(" %.3f |", it == ops.end() ? 0.0 : 1e-6 * it->second);
    }
    std::printf("\n");
  }
  // Every op of each configuration, calls and self time per step: what bench/o1_profile_python.py prints for the
  // Python twin, to read side by side (which overloads each side calls, how often).
  std::printf("\nEvery op, calls per step and self ms per step (with the profiler on):\n\n| op |");
  for (const auto& c : configs) std::printf(" %s calls | %s ms |", c.first.c_str(), c.first.c_str());
  std::printf("\n|---|");
  for (size_t i = 0; i < configs.size(); ++i) std::printf("---|---|");
  std::printf("\n");
  auto value = [](const std::map<std::string, double>& m, const std::string& op) {
    const auto it = m.find(op);
    return it == m.end() ? 0.0 : it->second;
  };
  for (const auto& [op, unused] : spread) {
    std::printf("| %s |", op.c_str());
    for (size_t i = 0; i < configs.size(); ++i) {
      const double calls = value(per_op_calls[i], op), ms = 1e-6 * value(per_op[i], op);
      std::printf(" %.1f | %.3f |", calls, ms);
      record("o1_profile_ops", name + " " + op, configs[i].first, "calls_per_step", calls);
      record("o1_profile_ops", name + " " + op, configs[i].first, "self_ms_per_step", ms);
    }
    std::printf("\n");
  }
  std::printf("\n");
}

// The C++ side of the comparison with Python (bench/versus_python.py runs it alternately with python_amp.py):
// plain LibTorch and amp at O0, torch.amp's loop in C++ and amp's O1 with either list, interleaved.
template <class Net>
void versus_python_for(const std::string& name) {
  torch::manual_seed(0);
  const auto x = bench::input_for(name);
  const auto y = torch::randint(10, {x.size(0)}, torch::kLong);
  auto sgd = [](Net& net) { return torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9)); };
  Net o0_net, native_net, apex_net;
  bench::TorchAmpStep<Net> libtorch(std::nullopt), torch_amp(torch::kBFloat16);
  auto [o0_model, o0_opt] = amp::initialize(o0_net, sgd(o0_net), amp::Options("O0").verbosity(0));
  const auto o1 = amp::Options("O1").low_precision_dtype(torch::kBFloat16).verbosity(0);
  auto [native_model, native_opt] =
      amp::initialize(native_net, sgd(native_net), amp::Options(o1).cast_lists(amp::CastLists::kNative));
  auto [apex_model, apex_opt] = amp::initialize(apex_net, sgd(apex_net), o1);
  const std::vector<std::string> configs = {"LibTorch O0", "amp O0", "torch.amp in C++ O1 bf16", "amp O1 bf16 native",
                                            "amp O1 bf16 apex"};
  const auto t = time_alternating({[&] { libtorch.step(x, y); },
                                   [&, &m = o0_model, &o = o0_opt] { bench::amp_step(m, o, x, y); },
                                   [&] { torch_amp.step(x, y); },
                                   [&, &m = native_model, &o = native_opt] { bench::amp_step(m, o, x, y); },
                                   [&, &m = apex_model, &o = apex_opt] { bench::amp_step(m, o, x, y); }});
  std::printf("| %s |", name.c_str());
  for (size_t i = 0; i < configs.size(); ++i) {
    std::printf(" %.3f |", 1e3 * t[i]);
    record("versus_python", name, configs[i], "ms_per_step", 1e3 * t[i]);
  }
  std::printf("\n");
}

void versus_python_section() {
  std::printf("## The C++ side of the Python comparison\n\nms per step, SGD with momentum, interleaved repetitions "
              "(bench/versus_python.py alternates this with bench/python_amp.py).\n\n| model | LibTorch O0 | amp O0 | "
              "torch.amp in C++ O1 bf16 | amp O1 bf16 native | amp O1 bf16 apex |\n|---|---|---|---|---|---|\n");
  versus_python_for<bench::TinyMlp>("tiny_mlp");
  versus_python_for<bench::Mlp>("mlp");
  versus_python_for<bench::Cnn>("cnn");
  versus_python_for<bench::Transformer>("transformer");
  std::printf("\n");
}

// What a cast kernel's dispatch costs per call, on tensors small enough that the op's math is negligible: ops in
// each of O1's cases (an Apex row amp adds, native promote and bf16 rows, an op in no list) with fp32
// inputs, so no cast happens, under no autocast, ATen's autocast (amp's kernels registered but inactive), and amp's
// O1 guard with either list.
void o1_dispatch_section() {
  std::printf("## O1's per-op dispatch cost\n\nNanoseconds per call on 4x4 fp32 tensors (nothing to cast), interleaved; "
              "the difference to \"no autocast\" is the cost of the autocast kernel's dispatch.\n\n| op | no autocast ns "
              "| ATen autocast ns | amp native ns | amp apex ns |\n|---|---|---|---|---|\n");
  const auto a = torch::randn({4, 4}), b = torch::randn({4, 4});
  const std::vector<std::pair<std::string, std::function<void()>>> ops = {
      {"softmax (Apex row: fp32)", [&] { (void)torch::softmax(a, -1); }},
      {"cat (native row: promote)", [&] { (void)torch::cat({a, b}); }},
      {"mm (native row: bf16)", [&] { (void)torch::mm(a, b); }},
      {"relu (no row)", [&] { (void)torch::relu(a); }}};
  for (const auto& [label, op] : ops) {
    auto under = [&op = op](int mode) {
      return [&op, mode] {
        if (mode == 0) {
          for (int i = 0; i < 100; ++i) op();
        } else if (mode == 1) {
          amp::detail::autocast::NativeAutocastGuard autocast(torch::kCPU, torch::kBFloat16);
          for (int i = 0; i < 100; ++i) op();
        } else {
          amp::AutocastGuard casts(torch::kCPU, torch::kBFloat16, mode == 2 ? amp::CastLists::kNative : amp::CastLists::kApex);
          for (int i = 0; i < 100; ++i) op();
        }
      };
    };
    const auto t = time_alternating({under(0), under(1), under(2), under(3)}, 0.1);
    std::printf("| %s | %.0f | %.0f | %.0f | %.0f |\n", label.c_str(), 1e7 * t[0], 1e7 * t[1], 1e7 * t[2], 1e7 * t[3]);
    const char* modes[] = {"no autocast", "ATen autocast", "amp native", "amp apex"};
    for (int m = 0; m < 4; ++m) record("o1_dispatch", label, modes[m], "ns_per_call", 1e7 * t[m]);
  }
  std::printf("\n");
}

void o1_profile_section() {
  std::printf("## Where O1's time goes\n\nSelf time per step by op category (RecordFunction, outermost categorized op "
              "decides; an autocast kernel's own work is the self time of an op that calls itself), for amp's O1 bf16 "
              "with Apex's lists, with the native lists, and torch.amp's O1 written in C++ (ATen's autocast + "
              "amp::GradScaler). ms/step: without the profiler, interleaved.\n\n");
  o1_profile_for<bench::TinyMlp>("tiny_mlp");
  o1_profile_for<bench::Mlp>("mlp");
  o1_profile_for<bench::Cnn>("cnn");
  o1_profile_for<bench::Transformer>("transformer");
}

// The bench transformer (one block) and a four-block one, every block checkpointed or none, at O0 and O2 bf16:
// the peak of a step above the state kept between steps (activations, gradients, temporaries), and the step time.
void checkpoint_section(MemoryMeter& meter) {
  std::printf("## Activation checkpointing\n\nThe bench transformer's blocks (d 256, 4 heads, feed-forward 1024, "
              "batch 16 x 64 tokens), each run through amp::checkpoint or not; SGD with momentum. Peak: the bytes "
              "allocated at the peak of a step above those held between steps (counted from tensor allocations). Time: "
              "interleaved repetitions.\n\n| blocks | config | peak MiB | checkpointed peak MiB | checkpointed / plain "
              "peak | ms/step | checkpointed ms/step | checkpointed / plain time |\n|---|---|---|---|---|---|---|---|\n");
  for (int64_t blocks : {1, 4}) {
    for (const auto& [label, level] : {std::make_pair("O0", amp::OptLevel::O0), std::make_pair("O2 bf16", amp::OptLevel::O2)}) {
      torch::manual_seed(0);
      const auto x = bench::input_for("transformer");
      const auto y = torch::randint(10, {x.size(0)}, torch::kLong);
      double peak_mib[2], ms[2];
      std::vector<std::function<void()>> steps;
      std::vector<std::shared_ptr<void>> keep;  // the two runs' models and optimizers
      for (bool checkpointed : {false, true}) {
        bench::Transformer net(bench::TransformerImpl::d, 4, 1024, blocks);
        net->checkpoint_blocks = checkpointed;
        auto initialized = amp::initialize(
            net, torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9)),
            amp::Options(level).low_precision_dtype(torch::kBFloat16).verbosity(0));
        auto run = std::make_shared<decltype(initialized)>(std::move(initialized));
        for (int i = 0; i < 3; ++i) bench::amp_step(run->model, run->optimizer, x, y);
        const size_t between = meter.current_bytes();
        meter.reset_peak();
        bench::amp_step(run->model, run->optimizer, x, y);
        peak_mib[checkpointed] = static_cast<double>(meter.peak_bytes() - between) / (1 << 20);
        steps.push_back([run, &x, &y] { bench::amp_step(run->model, run->optimizer, x, y); });
        keep.push_back(run);
      }
      const auto times = time_alternating(steps);
      for (int i = 0; i < 2; ++i) ms[i] = 1e3 * times[i];
      std::printf("| %lld | %s | %.1f | %.1f | %.2f | %.2f | %.2f | %.2f |\n", static_cast<long long>(blocks), label,
                  peak_mib[0], peak_mib[1], peak_mib[1] / peak_mib[0], ms[0], ms[1], ms[1] / ms[0]);
      const std::string name = "transformer x" + std::to_string(blocks);
      record("checkpoint", name, label, "peak_MiB", peak_mib[0]);
      record("checkpoint", name, label, "checkpointed_peak_MiB", peak_mib[1]);
      record("checkpoint", name, label, "ms_per_step", ms[0]);
      record("checkpoint", name, label, "checkpointed_ms_per_step", ms[1]);
      record("checkpoint", name, label, "time_ratio", ms[1] / ms[0]);
    }
  }
  std::printf("\n");
}

// The precision policy's cost at O2 and O1 bf16: no fp32 islands; the last layer alone kept (every op of the
// forward then goes through the policy's dispatch key: on the tiny MLP, where per-op overhead decides the step,
// that is the key's bookkeeping cost); the transformer's LayerNorms and head kept (the islands' fp32 compute).
template <class Model>
void policy_for(const char* name, const std::vector<std::pair<const char*, std::vector<std::string>>>& configs) {
  for (const auto level : {amp::OptLevel::O2, amp::OptLevel::O1}) {
    torch::manual_seed(0);
    const auto x = bench::input_for(name);
    const auto y = torch::randint(10, {x.size(0)}, torch::kLong);
    std::vector<std::function<void()>> steps;
    std::vector<std::shared_ptr<void>> keep;
    for (const auto& [label, patterns] : configs) {
      torch::manual_seed(0);
      Model net;
      amp::Options options(level);
      options.low_precision_dtype(torch::kBFloat16).verbosity(0);
      if (!patterns.empty()) options.keep_fp32(patterns);
      auto initialized = amp::initialize(
          net, torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9)), options);
      auto run = std::make_shared<decltype(initialized)>(std::move(initialized));
      for (int i = 0; i < 3; ++i) bench::amp_step(run->model, run->optimizer, x, y);
      steps.push_back([run, &x, &y] { bench::amp_step(run->model, run->optimizer, x, y); });
      keep.push_back(run);
    }
    const auto times = time_alternating(steps);
    for (size_t i = 0; i < configs.size(); ++i) {
      const std::string config = amp::to_string(level) + " " + configs[i].first;
      std::printf("| %s | %s bf16 | %s | %.3f | %.3f |\n", name, amp::to_string(level).c_str(), configs[i].first,
                  1e3 * times[i], times[i] / times[0]);
      record("policy", name, config, "ms_per_step", 1e3 * times[i]);
      record("policy", name, config, "ratio", times[i] / times[0]);
    }
  }
}

void policy_section() {
  std::printf("## Precision policy\n\nbf16, SGD with momentum; keep_fp32 patterns as listed; interleaved "
              "repetitions.\n\n| model | level | islands | ms/step | / no islands |\n|---|---|---|---|---|\n");
  policy_for<bench::TinyMlp>("tiny_mlp", {{"none", {}}, {"fc3", {"fc3"}}});
  policy_for<bench::Transformer>("transformer", {{"none", {}}, {"head", {"head"}}, {"LayerNorms + head", {"*.ln1", "*.ln2", "head"}}});
  std::printf("\n");
}

// bench::Cnn's network written in TorchScript (functional ops on the module's own parameters and buffers), as
// torch::jit::load would return it, with bench::Cnn's initial weights.
torch::jit::Module jit_cnn(bench::Cnn& twin) {
  torch::jit::Module m("__torch__.JitCnn");
  m.register_attribute("training", c10::BoolType::get(), true);
  for (const auto& p : twin->named_parameters()) {
    std::string name = p.key();
    std::replace(name.begin(), name.end(), '.', '_');
    m.register_parameter(name, p.value().detach().clone().requires_grad_(true), false);
  }
  for (const auto& b : twin->named_buffers()) {
    std::string name = b.key();
    std::replace(name.begin(), name.end(), '.', '_');
    m.register_buffer(name, b.value().detach().clone());
  }
  m.define(R"(
def forward(self, x):
    h = torch.conv2d(x, self.conv1_weight, self.conv1_bias, [1, 1], [1, 1])
    h = torch.batch_norm(h, self.bn1_weight, self.bn1_bias, self.bn1_running_mean, self.bn1_running_var, self.training, 0.1, 1e-5, False)
    h = torch.max_pool2d(torch.relu(h), [2, 2])
    h = torch.conv2d(h, self.conv2_weight, self.conv2_bias, [1, 1], [1, 1])
    h = torch.batch_norm(h, self.bn2_weight, self.bn2_bias, self.bn2_running_mean, self.bn2_running_var, self.training, 0.1, 1e-5, False)
    h = torch.max_pool2d(torch.relu(h), [2, 2])
    return torch.linear(torch.flatten(h, 1), self.fc_weight, self.fc_bias)
)");
  m.train();
  return m;
}

void torchscript_section() {
  std::printf("## TorchScript models\n\nbench::Cnn (batch 32, 3x32x32) as a torch::nn::Module and as its TorchScript "
              "twin (one flat module, so its BatchNorm is cast at O2 like any parameter); SGD with momentum; a step is "
              "zero_grad, forward, cross-entropy, backward, step. amp's forward runs the graph op by op (NOTE "
              "[TorchScript runs op by op]); the plain rows show what the graph executor's optimization is worth here. "
              "Alternating repetitions; ratio to the nn::Module's plain fp32 step.\n\n"
              "| model | config | ms/step | / nn::Module fp32 |\n|---|---|---|---|\n");
  torch::manual_seed(0);
  const auto x = bench::input_for("cnn");
  const auto y = torch::randint(10, {x.size(0)}, torch::kLong);
  auto sgd_options = torch::optim::SGDOptions(0.01).momentum(0.9);
  bench::Cnn net;
  torch::optim::SGD net_sgd(net->parameters(), sgd_options);
  auto plain_jit = [&](bool optimize) {
    torch::jit::Module m = jit_cnn(net);
    auto sgd = std::make_shared<torch::optim::SGD>(amp::parameters(m), sgd_options);
    return [m, sgd, optimize, &x, &y]() mutable {
      const bool previous = torch::jit::getGraphExecutorOptimize();
      torch::jit::setGraphExecutorOptimize(optimize);
      sgd->zero_grad();
      torch::nn::functional::cross_entropy(m.forward({x}).toTensor(), y).backward();
      sgd->step();
      torch::jit::setGraphExecutorOptimize(previous);
    };
  };
  auto amp_jit = [&](const amp::Options& options) {
    torch::jit::Module m = jit_cnn(net);
    auto init = std::make_shared<amp::Initialized<torch::jit::Module, torch::optim::SGD>>(
        amp::initialize(m, torch::optim::SGD(amp::parameters(m), sgd_options), amp::Options(options).verbosity(0)));
    return [init, &x, &y] {
      init->optimizer.zero_grad();
      auto loss = torch::nn::functional::cross_entropy(init->model(x).toTensor(), y);
      {
        auto scaled_loss = amp::scale_loss(loss, init->optimizer);
        scaled_loss.backward();
      }
      init->optimizer.step();
    };
  };
  bench::Cnn amp_net;
  auto amp_module = std::make_shared<amp::Initialized<bench::Cnn, torch::optim::SGD>>(amp::initialize(
      amp_net, torch::optim::SGD(amp_net->parameters(), sgd_options), amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0)));
  const std::vector<std::pair<std::string, std::function<void()>>> rows = {
      {"nn::Module | plain fp32", [&] {
         net_sgd.zero_grad();
         torch::nn::functional::cross_entropy(net->forward(x), y).backward();
         net_sgd.step();
       }},
      {"TorchScript | plain fp32, executor optimizing", plain_jit(true)},
      {"TorchScript | plain fp32, op by op", plain_jit(false)},
      {"TorchScript | amp O0", amp_jit(amp::Options("O0"))},
      {"TorchScript | amp O1 bf16", amp_jit(amp::Options("O1").low_precision_dtype(torch::kBFloat16))},
      {"TorchScript | amp O2 bf16", amp_jit(amp::Options("O2").low_precision_dtype(torch::kBFloat16))},
      {"nn::Module | amp O2 bf16", [amp_module, &x, &y] { bench::amp_step(amp_module->model, amp_module->optimizer, x, y); }},
  };
  std::vector<std::function<void()>> fs;
  for (const auto& row : rows) fs.push_back(row.second);
  const auto t = time_alternating(fs);
  for (size_t i = 0; i < rows.size(); ++i) {
    std::printf("| %s | %.3f | %.2fx |\n", rows[i].first.c_str(), 1e3 * t[i], t[i] / t[0]);
    record("torchscript", "cnn", rows[i].first, "ms_per_step", 1e3 * t[i]);
  }
  std::printf("\n");
}

// FP8 Linear layers (Options::fp8) on the bench transformer: step time and the held-out loss after 50 steps against
// O2 bf16. On a CPU, at::_scaled_mm is emulated (dequantize, then an fp32 GEMM): the times are labelled so.
void fp8_section() {
  std::printf("## FP8 Linear layers\n\nbench::Transformer (batch 16, 64 tokens, d 256; the qkv, proj, ff1 and ff2 "
              "Linear layers in FP8, the head (10 outputs) in bf16), SGD with momentum. Step time: alternating "
              "repetitions. Loss: held-out cross-entropy after 50 steps of a learnable task (bench/fp8_task.h). "
              "%s\n\n| config | ms/step | / O2 bf16 | held-out loss after 50 steps |\n|---|---|---|---|\n",
              "On a CPU, at::_scaled_mm is emulated: FP8 is slower here than bf16 (CPU figures, emulated FP8).");
  std::vector<std::pair<std::string, amp::Options>> configs = {
      {"O2 bf16", amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0)},
      {"O2 bf16 + fp8 dynamic", amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0).fp8()},
      {"O2 bf16 + fp8 delayed", amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0)
                                    .fp8(amp::Fp8Options().scaling(amp::Fp8Options::Scaling::kDelayed))},
  };
  // The slice, tile and block recipes (docs/fp8.md): rowwise through _scaled_mm's emulation, blockwise and MXFP8
  // through dequantization and a bf16 GEMM.
  for (const auto& [name, scaling] : std::vector<std::pair<std::string, amp::Fp8Options::Scaling>>{
           {"rowwise", amp::Fp8Options::Scaling::kRowwise},
           {"rowwise_gw_hp", amp::Fp8Options::Scaling::kRowwiseGwHp},
           {"blockwise", amp::Fp8Options::Scaling::kBlockwise},
           {"mxfp8", amp::Fp8Options::Scaling::kMxfp8}}) {
    configs.push_back({"O2 bf16 + fp8 " + name,
                       amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0).fp8(amp::Fp8Options().scaling(scaling))});
  }
  std::vector<double> losses;
  for (const auto& [name, options] : configs) {
    torch::manual_seed(0);
    losses.push_back(bench::train_transformer_task(bench::Transformer(), options, 50).held_out_loss);
  }
  const auto [x, y] = bench::transformer_task_batch(7, 16, 64, bench::TransformerImpl::d, torch::kCPU);
  std::vector<std::function<void()>> steps;
  std::vector<std::shared_ptr<void>> keep;
  for (const auto& [name, options] : configs) {
    torch::manual_seed(0);
    bench::Transformer net;
    auto run = std::make_shared<amp::Initialized<bench::Transformer, torch::optim::SGD>>(amp::initialize(
        net, torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9)), options));
    steps.push_back([run, x = x, y = y] { bench::amp_step(run->model, run->optimizer, x, y); });
    keep.push_back(run);
  }
  const auto t = time_alternating(steps);
  for (size_t i = 0; i < configs.size(); ++i) {
    std::printf("| %s | %.3f | %.2fx | %.4f |\n", configs[i].first.c_str(), 1e3 * t[i], t[i] / t[0], losses[i]);
    record("fp8", "transformer", configs[i].first, "ms_per_step", 1e3 * t[i]);
    record("fp8", "transformer", configs[i].first, "held_out_loss", losses[i]);
  }
  std::printf("\n");
}

}  // namespace

int main(int argc, char** argv) {
  std::string section = "all", csv_path;
  amp::ProgramFlags flags("amp_bench: step times, amp's overhead and the unscale pass, as markdown tables");
  flags.add("section", &section, "all | steps | overhead | unscale | fused | clip | lamb | checkpoint | o1 | o1_profile | o1_dispatch | versus_python | masters | policy | torchscript | fp8 | state_formats").add("reps", &reps, "repetitions per measurement");
  flags.add("csv", &csv_path, "also write one CSV row per measurement to this file");
  try {
    if (!amp::parse_command_line(argc, argv, flags)) return 0;
    if (!csv_path.empty()) {
      csv.open(csv_path);
      csv << "section,name,config,metric,value\n";
    }
    MemoryMeter& meter = MemoryMeter::install();
    print_environment();
    if (section == "all" || section == "steps") {
      std::printf("## Step time per level and dtype\n\nSGD with momentum; a step is zero_grad, forward, cross-entropy, scale_loss backward, step. Bytes per parameter are counted from tensor allocations: model state (parameters, gradients, fp32 masters, momentum) between steps, and everything including activations at the peak of a step.\n\n");
      steps_for<bench::TinyMlp>("tiny_mlp", meter);
      steps_for<bench::Mlp>("mlp", meter);
      steps_for<bench::Cnn>("cnn", meter);
      steps_for<bench::Transformer>("transformer", meter);
    }
    if (section == "all" || section == "overhead") {
      std::printf("## amp's overhead\n\nThe same step written by hand against LibTorch (same casts, loss scaling, ATen's fused unscale, one host read, conditional step, masters copied back); interleaved repetitions.\n\n"
                  "| model | level | amp ms | hand ms | amp / hand | host syncs per amp step |\n|---|---|---|---|---|---|\n");
      overhead_for<bench::TinyMlp>("tiny_mlp");
      overhead_for<bench::Mlp>("mlp");
      overhead_for<bench::Cnn>("cnn");
      overhead_for<bench::Transformer>("transformer");
      std::printf("\n");
    }
    if (section == "all" || section == "unscale") unscale_section();
    if (section == "all" || section == "fused") fused_section();
    if (section == "all" || section == "clip") clip_section();
    if (section == "all" || section == "lamb") lamb_section();
    if (section == "all" || section == "checkpoint") checkpoint_section(meter);
    if (section == "all" || section == "o1") o1_lists_section();
    if (section == "all" || section == "o1_profile") o1_profile_section();
    if (section == "versus_python") versus_python_section();  // bench/versus_python.py runs it, in alternation with Python
    if (section == "all" || section == "o1_dispatch") o1_dispatch_section();
    if (section == "all" || section == "masters") masters_section(meter);
    if (section == "all" || section == "policy") policy_section();
    if (section == "all" || section == "torchscript") torchscript_section();
    if (section == "all" || section == "fp8") fp8_section();
    if (section == "all" || section == "state_formats") state_formats_section();
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return 1;
  }
  return 0;
}
