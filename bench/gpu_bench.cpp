// amp on a GPU: O0 in fp32 (TF32 off) against O1/O2/O3 in fp16 and bf16 on two GPU-sized models, and amp's
// O1/O2 step against the same step written by hand in LibTorch. Run by scripts/gpu-check.sh, which adds the
// Python torch.amp + GradScaler twin (bench/python_amp.py --device cuda) on the same torch.
//   amp_gpu_bench [--device cuda] [--steps 20] [--reps 3] [--csv FILE] [--models gpu_cnn,gpu_transformer] [--batch N]
//                 [--configs all|"O0 fp32,O1 bf16,..."] [--section levels|fp8|fp8_shapes|graph|all] [--fp8-steps 100]
// --device cpu (with tiny --steps, --batch and bf16 --configs) checks the program's logic without a GPU; its figures mean nothing.
// Steps per second: the median of --reps timed runs of --steps steps each, synchronized at both ends, amp's
// and the hand-written loop's runs taking turns. Peak
// memory: the CUDA caching allocator's peak of allocated bytes over one step, with the model already trained
// one step (so optimizer state is included).

#include <amp/amp.h>
#include <torch/torch.h>
#include <torch/version.h>

#ifdef AMP_BENCH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <optional>
#include <sstream>

#include "../examples/common/memory_meter.h"
#include "fp8_task.h"
#include "models.h"
#include "training_steps.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Settings {
  torch::Device device = torch::kCUDA;
  int steps = 20, reps = 3;
  int64_t batch = 0;  // 0: the model's own batch
  std::string configs = "all";
  std::ofstream csv;
};

void record(Settings& s, const std::string& name, const std::string& config, const std::string& metric, double value) {
  if (s.csv) s.csv << "gpu," << name << "," << config << "," << metric << "," << value << "\n";
}

void synchronize(const torch::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize();
}

// Seconds per call of each of `steps`: up to three warm-up calls each, then `reps` timed runs of `s.steps`
// calls, the callables taking turns run by run (so drift hits them alike); the median run of each.
std::vector<double> seconds_per_step(const Settings& s, const std::vector<std::function<void()>>& steps) {
  for (const auto& step : steps) {
    for (int i = 0; i < std::min(3, s.steps); ++i) step();
  }
  synchronize(s.device);
  std::vector<std::vector<double>> samples(steps.size());
  for (int r = 0; r < s.reps; ++r) {
    for (size_t j = 0; j < steps.size(); ++j) {
      const auto start = Clock::now();
      for (int i = 0; i < s.steps; ++i) steps[j]();
      synchronize(s.device);
      samples[j].push_back(std::chrono::duration<double>(Clock::now() - start).count() / s.steps);
    }
  }
  std::vector<double> out;
  for (auto& runs : samples) {
    std::sort(runs.begin(), runs.end());
    out.push_back(runs[runs.size() / 2]);
  }
  return out;
}

// Peak bytes allocated on the device during `step`, above what was allocated before it.
template <class F>
double peak_bytes_of(const Settings& s, F&& step) {
  synchronize(s.device);
#ifdef AMP_BENCH_CUDA
  if (s.device.is_cuda()) {
    namespace alloc = c10::cuda::CUDACachingAllocator;
    const auto index = s.device.has_index() ? s.device.index() : c10::DeviceIndex{0};
    const size_t aggregate = 0;  // StatType::AGGREGATE, whose namespace moved between releases
    const auto before = alloc::getDeviceStats(index).allocated_bytes[aggregate].current;
    alloc::resetPeakStats(index);
    step();
    synchronize(s.device);
    return static_cast<double>(alloc::getDeviceStats(index).allocated_bytes[aggregate].peak - before);
  }
#endif
  TORCH_CHECK(s.device.is_cpu(), "amp_gpu_bench: this build has no CUDA memory statistics (built without AMP_BENCH_CUDA)");
  MemoryMeter& meter = MemoryMeter::install();
  const size_t before = meter.current_bytes();
  meter.reset_peak();
  step();
  return static_cast<double>(meter.peak_bytes() - before);
}

struct Config {
  std::string name;
  const char* level;
  c10::ScalarType dtype;
};

const std::vector<Config> kConfigs = {{"O0 fp32", "O0", torch::kFloat},  {"O1 fp16", "O1", torch::kHalf},
                                      {"O2 fp16", "O2", torch::kHalf},   {"O3 fp16", "O3", torch::kHalf},
                                      {"O1 bf16", "O1", torch::kBFloat16}, {"O2 bf16", "O2", torch::kBFloat16},
                                      {"O3 bf16", "O3", torch::kBFloat16}};

// The model's batch (cut to --batch) and its labels, on the device.
std::pair<torch::Tensor, torch::Tensor> batch_for(const Settings& s, const std::string& name) {
  torch::manual_seed(0);
  auto x = bench::input_for(name);
  x = x.narrow(0, 0, s.batch > 0 ? std::min(s.batch, x.size(0)) : x.size(0)).to(s.device);
  return {x, torch::randint(10, {x.size(0)}, torch::kLong).to(s.device)};
}

// Whether --configs selects `config`.
bool selected(const Settings& s, const Config& config) {
  return s.configs == "all" || ("," + s.configs + ",").find("," + config.name + ",") != std::string::npos;
}

template <class Net>
void bench_model(Settings& s, const std::string& name) {
  const auto batch = batch_for(s, name);
  const torch::Tensor &x = batch.first, &y = batch.second;
  double o0_s = 0;
  for (const auto& config : kConfigs) {
    if (!selected(s, config)) continue;
    torch::manual_seed(0);
    Net net;
    net->to(s.device);
    const auto options = amp::Options(config.level).verbosity(0).low_precision_dtype(
        config.dtype == torch::kFloat ? torch::kHalf : config.dtype);  // O0 ignores the dtype
    auto [model, optimizer] =
        amp::initialize(net, torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9)), options);
    auto step = [&, &model = model, &optimizer = optimizer] { bench::amp_step(model, optimizer, x, y); };
    step();
    const double peak = peak_bytes_of(s, step);
    // O1 and O2 are also written by hand (bench::HandWritten), timed in turns with amp's step.
    const bool hand_written = std::string(config.level) == "O1" || std::string(config.level) == "O2";
    torch::manual_seed(0);
    std::optional<bench::HandWritten<Net>> hand;
    if (hand_written) hand.emplace(std::string(config.level) == "O2", /*adam=*/false, config.dtype, s.device);
    const auto times = hand ? seconds_per_step(s, {step, [&] { hand->step(x, y); }}) : seconds_per_step(s, {step});
    const double amp_s = times[0];
    if (config.name == "O0 fp32") o0_s = amp_s;
    std::string hand_ms = "", ratio = "";
    if (hand) {
      const double hand_s = times[1];
      char buffer[64];
      std::snprintf(buffer, sizeof buffer, "%.3f", 1e3 * hand_s);
      hand_ms = buffer;
      std::snprintf(buffer, sizeof buffer, "%.3f", amp_s / hand_s);
      ratio = buffer;
      record(s, name, config.name, "hand_ms_per_step", 1e3 * hand_s);
      record(s, name, config.name, "amp_over_hand", amp_s / hand_s);
    }
    char speedup[32] = "";
    if (o0_s > 0) std::snprintf(speedup, sizeof speedup, "%.2fx", o0_s / amp_s);
    std::printf("| %s | %s | %.3f | %.1f | %s | %.0f | %s | %s |\n", name.c_str(), config.name.c_str(), 1e3 * amp_s,
                1.0 / amp_s, speedup, peak / (1 << 20), hand_ms.c_str(), ratio.c_str());
    std::fflush(stdout);
    record(s, name, config.name, "ms_per_step", 1e3 * amp_s);
    record(s, name, config.name, "steps_per_s", 1.0 / amp_s);
    if (o0_s > 0) record(s, name, config.name, "speedup_vs_O0", o0_s / amp_s);
    record(s, name, config.name, "peak_MiB", peak / (1 << 20));
  }
}

// FP8 Linear layers (Options::fp8) on GpuTransformer: O2 bf16 against O2 bf16 + fp8 (each recipe), step time in
// turns, peak memory, and the held-out loss after `fp8_steps` steps of bench/fp8_task.h's task.
void bench_fp8(Settings& s, int fp8_steps) {
  const int64_t batch = s.batch > 0 ? s.batch : bench::batch_of("gpu_transformer");
  const int64_t seq = s.batch > 0 ? 16 : 256;  // a small --batch is a logic check: short sequences too
  const auto base = amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0);
  const std::vector<std::pair<std::string, amp::Options>> configs = {
      {"O2 bf16", base},
      {"O2 bf16 + fp8 dynamic", amp::Options(base).fp8()},
      {"O2 bf16 + fp8 delayed", amp::Options(base).fp8(amp::Fp8Options().scaling(amp::Fp8Options::Scaling::kDelayed))},
      {"O2 bf16 + fp8 rowwise", amp::Options(base).fp8(amp::Fp8Options().scaling(amp::Fp8Options::Scaling::kRowwise))},
      {"O2 bf16 + fp8 rowwise_gw_hp",
       amp::Options(base).fp8(amp::Fp8Options().scaling(amp::Fp8Options::Scaling::kRowwiseGwHp))},
      {"O2 bf16 + fp8 blockwise (emulated)",
       amp::Options(base).fp8(amp::Fp8Options().scaling(amp::Fp8Options::Scaling::kBlockwise))},
      {"O2 bf16 + fp8 mxfp8 (emulated)", amp::Options(base).fp8(amp::Fp8Options().scaling(amp::Fp8Options::Scaling::kMxfp8))},
  };
  std::printf("\n## FP8 Linear layers on %s\n\nGpuTransformer (4 blocks, d 512, ff 2048; batch %lld x %lld tokens; its "
              "Linear layers in FP8 but the 10-way head), SGD with momentum; held-out loss after %d steps of "
              "bench/fp8_task.h's task.%s\n\n| config | ms/step | / O2 bf16 | peak MiB | held-out loss |\n"
              "|---|---|---|---|---|\n", s.device.str().c_str(), static_cast<long long>(batch),
              static_cast<long long>(seq), fp8_steps,
              s.device.is_cpu() ? " On a CPU, at::_scaled_mm is emulated: these figures are emulated FP8." : "");
  std::vector<double> losses, peaks;
  std::vector<std::function<void()>> steps;
  std::vector<std::shared_ptr<void>> keep;
  for (const auto& [name, options] : configs) {
    torch::manual_seed(0);
    losses.push_back(
        bench::train_transformer_task(bench::GpuTransformer(), options, fp8_steps, s.device, batch, seq).held_out_loss);
    torch::manual_seed(0);
    bench::GpuTransformer net;
    net->to(s.device);
    auto run = std::make_shared<amp::Initialized<bench::GpuTransformer, torch::optim::SGD>>(amp::initialize(
        net, torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9)), options));
    const auto [x, y] = bench::transformer_task_batch(7, batch, seq, 512, s.device);
    auto step = [run, x = x, y = y] { bench::amp_step(run->model, run->optimizer, x, y); };
    step();
    peaks.push_back(peak_bytes_of(s, step));
    steps.push_back(step);
    keep.push_back(run);
  }
  const auto t = seconds_per_step(s, steps);
  for (size_t i = 0; i < configs.size(); ++i) {
    std::printf("| %s | %.3f | %.2fx | %.0f | %.4f |\n", configs[i].first.c_str(), 1e3 * t[i], t[i] / t[0],
                peaks[i] / (1 << 20), losses[i]);
    record(s, "gpu_transformer", configs[i].first, "fp8_ms_per_step", 1e3 * t[i]);
    record(s, "gpu_transformer", configs[i].first, "fp8_peak_MiB", peaks[i] / (1 << 20));
    record(s, "gpu_transformer", configs[i].first, "fp8_held_out_loss", losses[i]);
  }
  std::fflush(stdout);
}

// One Linear layer's forward and backward at each square shape, bf16 against FP8 dynamic and rowwise: the table
// Fp8Options::min_gemm_size is read from (docs/fp8.md).
void bench_fp8_shapes(Settings& s) {
  const bool tiny = s.batch > 0;  // a logic check
  const int64_t tokens = tiny ? 64 : 8192;
  const std::vector<int64_t> sizes = tiny ? std::vector<int64_t>{128, 256} : std::vector<int64_t>{512, 1024, 2048, 4096, 8192};
  const auto base = amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0);
  const std::vector<std::pair<std::string, amp::Options>> configs = {
      {"bf16", base},
      {"fp8 dynamic", amp::Options(base).fp8()},
      {"fp8 rowwise", amp::Options(base).fp8(amp::Fp8Options().scaling(amp::Fp8Options::Scaling::kRowwise))},
  };
  std::printf("\n## FP8 per GEMM shape on %s\n\nOne Linear(n, n) on %lld tokens, forward and backward (3 GEMMs of "
              "%lld x n x n), median of %d runs of %d.%s\n\n| n | in*out | bf16 ms | fp8 dynamic ms | / bf16 | fp8 "
              "rowwise ms | / bf16 |\n|---|---|---|---|---|---|---|\n",
              s.device.str().c_str(), static_cast<long long>(tokens), static_cast<long long>(tokens), s.reps, s.steps,
              s.device.is_cpu() ? " On a CPU, at::_scaled_mm is emulated: these figures are emulated FP8." : "");
  for (const int64_t n : sizes) {
    std::vector<std::function<void()>> steps;
    std::vector<std::shared_ptr<void>> keep;
    torch::manual_seed(0);
    const torch::Tensor x = torch::randn({tokens, n}, torch::TensorOptions().device(s.device));
    for (const auto& [name, options] : configs) {
      torch::manual_seed(0);
      torch::nn::Linear layer(n, n);
      layer->to(s.device);
      auto model = std::make_shared<amp::Model<torch::nn::Linear>>(amp::initialize(layer, options));
      const torch::Tensor input = x.clone().requires_grad_(true);
      steps.push_back([model, input, layer]() mutable {
        layer->zero_grad();
        (*model)(input).sum().backward();
      });
      keep.push_back(model);
    }
    const auto t = seconds_per_step(s, steps);
    std::printf("| %lld | %lld | %.3f | %.3f | %.2fx | %.3f | %.2fx |\n", static_cast<long long>(n),
                static_cast<long long>(n * n), 1e3 * t[0], 1e3 * t[1], t[0] / t[1], 1e3 * t[2], t[0] / t[2]);
    for (size_t i = 0; i < configs.size(); ++i) {
      record(s, "linear_" + std::to_string(n), configs[i].first, "fp8_shape_ms", 1e3 * t[i]);
    }
  }
  std::printf("\n(/ bf16: bf16's time over this one's; above 1.00x FP8 is faster.)\n");
  std::fflush(stdout);
}

// amp's whole step eager against the same step captured once in a CUDA graph and replayed (docs/cuda.md's recipe:
// amp::GraphCaptureGuard, FusedSGD with momentum), in turns, on the small models (where launches dominate) and the
// GPU-sized ones. Both start from the same weights; after the timed runs the two agree on the loss scale.
template <class Net>
void bench_graph_model(Settings& s, const std::string& name) {
  const auto batch = batch_for(s, name);
  const torch::Tensor &x = batch.first, &y = batch.second;
  for (const auto& config : kConfigs) {
    if (std::string(config.level) != "O1" && std::string(config.level) != "O2") continue;
    if (!selected(s, config)) continue;
    const auto options = amp::Options(config.level).verbosity(0).low_precision_dtype(config.dtype);
    auto make = [&](Net& net) {
      torch::manual_seed(0);
      net = Net();
      net->to(s.device);
      return amp::initialize(net, amp::optim::FusedSGD(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9)),
                             options);
    };
    Net eager_net{nullptr}, graph_net{nullptr};
    auto eager = make(eager_net);
    auto graphed = make(graph_net);
    auto eager_step = [&] { bench::amp_step(eager.model, eager.optimizer, x, y); };
    std::function<void()> graph_step;
    std::string note;
#ifdef AMP_BENCH_CUDA
    std::optional<at::cuda::CUDAGraph> graph;
    if (s.device.is_cuda()) {
      auto step = [&] { bench::amp_step(graphed.model, graphed.optimizer, x, y); };
      c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool();
      torch::cuda::synchronize();
      {
        c10::cuda::CUDAStreamGuard on_side(side);
        for (int i = 0; i < 3; ++i) step();
      }
      torch::cuda::synchronize();
      graph.emplace();
      {
        c10::cuda::CUDAStreamGuard on_side(side);
        amp::GraphCaptureGuard capture(graphed.optimizer);
        graph->capture_begin();
        step();
        graph->capture_end();
      }
      torch::cuda::synchronize();
      graph_step = [&] { graph->replay(); };
    }
#endif
    if (!graph_step) {  // no GPU: the eager step twice, to check the program (CUDA graphs need CUDA)
      graph_step = [&] { bench::amp_step(graphed.model, graphed.optimizer, x, y); };
      note = " (no graph: not CUDA)";
    }
    const auto t = seconds_per_step(s, {eager_step, graph_step});
    std::printf("| %s | %s | %.3f | %.3f%s | %.2fx | %g / %g |\n", name.c_str(), config.name.c_str(), 1e3 * t[0],
                1e3 * t[1], note.c_str(), t[0] / t[1], amp::loss_scale(eager.optimizer),
                amp::loss_scale(graphed.optimizer));
    std::fflush(stdout);
    record(s, name, config.name, "eager_ms_per_step", 1e3 * t[0]);
    record(s, name, config.name, "graphed_ms_per_step", 1e3 * t[1]);
    record(s, name, config.name, "graphed_speedup", t[0] / t[1]);
  }
}

void bench_graph(Settings& s, const std::string& models) {
  std::printf("\n## The whole step in one CUDA graph on %s\n\namp's step (zero_grad, forward, scale_loss backward, "
              "FusedSGD with momentum) eager against captured once and replayed; median of %d runs of %d steps, in "
              "turns. Goal: the graphed step at least 1.5x the eager one on the small models.\n\n| model | config | "
              "eager ms | graphed ms | speedup | loss scale eager / graphed |\n|---|---|---|---|---|---|\n",
              s.device.str().c_str(), s.reps, s.steps);
  std::stringstream list(models);
  for (std::string name; std::getline(list, name, ',');) {
    if (name == "mlp") bench_graph_model<bench::Mlp>(s, name);
    else if (name == "cnn") bench_graph_model<bench::Cnn>(s, name);
    else if (name == "gpu_cnn") bench_graph_model<bench::GpuCnn>(s, name);
    else if (name == "gpu_transformer") bench_graph_model<bench::GpuTransformer>(s, name);
    else TORCH_CHECK(false, "amp_gpu_bench: unknown model '", name, "' for --section graph; use mlp, cnn, gpu_cnn, gpu_transformer");
  }
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  std::string device = "cuda", csv_path, models, section = "levels";
  int fp8_steps = 100;
  amp::ProgramFlags flags("amp_gpu_bench: amp's levels and overhead on a GPU, as a markdown table");
  flags.add("device", &device, "cuda, or cpu to check the program's logic without a GPU")
      .add("steps", &s.steps, "steps per timed run")
      .add("reps", &s.reps, "timed runs per measurement (the median is reported)")
      .add("models", &models, "comma-separated: gpu_cnn, gpu_transformer (--section graph: also mlp, cnn)")
      .add("batch", &s.batch, "a smaller batch than the model's (logic checks on a CPU)")
      .add("configs", &s.configs, "all, or comma-separated: O0 fp32, O1 fp16, O2 fp16, O3 fp16, O1 bf16, O2 bf16, O3 bf16")
      .add("csv", &csv_path, "also write one CSV row per measurement to this file")
      .add("section", &section,
           "levels (the opt levels' table), fp8 (FP8 recipes on gpu_transformer), fp8_shapes (FP8 per GEMM shape), graph "
           "(eager against CUDA-graphed steps), or all")
      .add("fp8_steps", &fp8_steps, "training steps before the fp8 section's held-out loss");
  try {
    if (!amp::parse_command_line(argc, argv, flags)) return 0;
    TORCH_CHECK(device == "cuda" || device == "cpu", "amp_gpu_bench: --device must be cuda or cpu, got '", device, "'");
    TORCH_CHECK(s.steps >= 1 && s.reps >= 1, "amp_gpu_bench: --steps and --reps must be at least 1, got ", s.steps,
                " and ", s.reps);
    s.device = device == "cuda" ? torch::Device(torch::kCUDA) : torch::Device(torch::kCPU);
    TORCH_CHECK(!s.device.is_cuda() || torch::cuda::is_available(),
                "amp_gpu_bench: no CUDA device (torch::cuda::is_available() is false); on a machine without a GPU "
                "pass --device cpu to check the program, not to measure");
    if (!csv_path.empty()) {
      s.csv.open(csv_path);
      TORCH_CHECK(s.csv, "amp_gpu_bench: cannot write --csv ", csv_path);
      s.csv << "section,name,config,metric,value\n";
    }
    // O0's figures are fp32's: TF32 would round its GEMMs and convolutions to 10 mantissa bits.
    at::globalContext().setAllowTF32CuBLAS(false);
    at::globalContext().setAllowTF32CuDNN(false);
    at::globalContext().setBenchmarkCuDNN(true);
    TORCH_CHECK(fp8_steps >= 1, "amp_gpu_bench: --fp8-steps must be at least 1, got ", fp8_steps);
    TORCH_CHECK(section == "levels" || section == "fp8" || section == "fp8_shapes" || section == "graph" ||
                    section == "all",
                "amp_gpu_bench: --section must be levels, fp8, fp8_shapes, graph or all, got '", section, "'");
    if (section == "graph") {
      bench_graph(s, models.empty() ? "mlp,cnn,gpu_cnn,gpu_transformer" : models);
      return 0;
    }
    if (models.empty()) models = "gpu_cnn,gpu_transformer";
    if (section == "fp8") {
      bench_fp8(s, fp8_steps);
      return 0;
    }
    if (section == "fp8_shapes") {
      bench_fp8_shapes(s);
      return 0;
    }
    std::printf("## amp on %s\n\n- LibTorch %s; %d CUDA device(s); TF32 off; cuDNN autotuning on\n- SGD with momentum; "
                "median of %d runs of %d steps; peak: caching allocator's allocated bytes over one step\n\n",
                device.c_str(), TORCH_VERSION, static_cast<int>(torch::cuda::device_count()), s.reps, s.steps);
    std::printf("| model | config | amp ms/step | steps/s | speedup vs O0 | peak MiB | hand ms/step | amp / hand |\n"
                "|---|---|---|---|---|---|---|---|\n");
    std::stringstream list(models);
    for (std::string name; std::getline(list, name, ',');) {
      if (name == "gpu_cnn") bench_model<bench::GpuCnn>(s, name);
      else if (name == "gpu_transformer") bench_model<bench::GpuTransformer>(s, name);
      else TORCH_CHECK(false, "amp_gpu_bench: unknown model '", name, "' in --models; use gpu_cnn and/or gpu_transformer");
    }
    if (section == "all") {
      bench_fp8(s, fp8_steps);
      bench_fp8_shapes(s);
      bench_graph(s, "mlp,cnn,gpu_cnn,gpu_transformer");
    }
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return 1;
  }
  return 0;
}
