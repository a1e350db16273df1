// amp::optim::FusedMuon's figures (bench/muon.sh runs them with torch.optim.Muon beside):
//   amp_muon_bench --section step   [--reps 5]   one step over the bench transformer's four hidden matrices (fp32):
//                                                 FusedMuon and FusedAdamW, alternating repetitions
//   amp_muon_bench --section bytes                amp::state_bytes per parameter of the Muon + AdamW pair at O2 bf16
//                                                 with each optimizer_state_format
//   amp_muon_bench --section train  [--steps 300] the bench transformer at O2 bf16 on a teacher's labels (fresh
//                                                 batches): Muon + AdamW against AdamW alone, every step's loss
// Every section prints CSV rows: section,name,config,metric,value.

#include <amp/amp.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "models.h"
#include "optim/state_format.h"
#include "timing.h"
#include "training_steps.h"

namespace {

// The bench transformer's matrices for Muon (qkv, proj, ff1, ff2) and the rest for AdamW (LayerNorms, biases, head).
void split_params(bench::Transformer& net, std::vector<torch::Tensor>& hidden, std::vector<torch::Tensor>& rest) {
  for (const auto& item : net->named_parameters()) {
    const bool matrix = item.value().dim() == 2 && item.key().rfind("head.", 0) != 0;
    (matrix ? hidden : rest).push_back(item.value());
  }
}

// The bench transformer at `options` with Muon's recipe: FusedMuon on its matrices, FusedAdamW on the rest, one loss.
// Calls body(muon, adamw, step), step(x, y) taking one step of both and returning the loss.
template <class Body>
void with_muon_pair(bench::Transformer& net, const amp::Options& options, Body body) {
  std::vector<torch::Tensor> hidden, rest;
  split_params(net, hidden, rest);
  auto [models, optimizers] = amp::initialize(
      std::make_tuple(net), std::make_tuple(amp::optim::FusedMuon(hidden, amp::optim::FusedMuonOptions(0.02)),
                                            amp::optim::FusedAdamW(rest, torch::optim::AdamWOptions(1e-3))),
      options);
  auto& model = std::get<0>(models);
  auto& muon = std::get<0>(optimizers);
  auto& adamw = std::get<1>(optimizers);
  auto step = [&](const torch::Tensor& x, const torch::Tensor& y) {
    muon.zero_grad();
    adamw.zero_grad();
    const auto loss = torch::nn::functional::cross_entropy(model(x), y);
    amp::scale_loss(loss, std::vector<amp::OptimizerBase*>{&muon, &adamw}).backward();
    muon.step();
    adamw.step();
    return loss.item<double>();
  };
  body(muon, adamw, step);
}

// The shapes bench/muon.sh's Python side steps too (torch.optim.Muon), with the same seeds.
std::vector<torch::Tensor> matrices_with_grads() {
  torch::manual_seed(0);
  std::vector<torch::Tensor> out;
  for (const auto& shape : std::vector<std::vector<int64_t>>{{768, 256}, {256, 256}, {1024, 256}, {256, 1024}}) {
    auto p = torch::randn(shape).mul_(0.02).requires_grad_();
    p.mutable_grad() = torch::randn(shape).mul_(1e-3);
    out.push_back(p);
  }
  return out;
}

void step_section(int reps) {
  auto muon_params = matrices_with_grads(), adamw_params = matrices_with_grads();
  amp::optim::FusedMuon muon(muon_params, amp::optim::FusedMuonOptions(0.02));
  amp::optim::FusedAdamW adamw(adamw_params, torch::optim::AdamWOptions(1e-3));
  const auto t = bench::time_alternating({[&] { muon.step(); }, [&] { adamw.step(); }}, reps);
  std::printf("muon_step,transformer matrices,FusedMuon,ms_per_step,%.6f\n", 1e3 * t[0]);
  std::printf("muon_step,transformer matrices,FusedAdamW,ms_per_step,%.6f\n", 1e3 * t[1]);
}

void bytes_section() {
  const auto x = bench::input_for("transformer");
  const auto y = torch::randint(10, {x.size(0)}, torch::kLong);
  for (const auto format : {amp::OptimizerStateFormat::kFp32, amp::OptimizerStateFormat::kBf16,
                            amp::OptimizerStateFormat::k8Bit}) {
    torch::manual_seed(1);
    bench::Transformer net;
    std::vector<torch::Tensor> hidden, rest;
    split_params(net, hidden, rest);
    double muon_numel = 0, all_numel = 0;
    for (const auto& p : hidden) muon_numel += static_cast<double>(p.numel());
    for (const auto& p : net->parameters()) all_numel += static_cast<double>(p.numel());
    const auto options = amp::Options("O2").low_precision_dtype(torch::kBFloat16).optimizer_state_format(format).verbosity(0);
    with_muon_pair(net, options, [&](auto& muon, auto& adamw, auto& step) {
      for (int i = 0; i < 3; ++i) step(x, y);
      const amp::StateBytes m = amp::state_bytes(muon), a = amp::state_bytes(adamw);
      const std::string config = amp::to_string(format);
      std::printf("muon_bytes,transformer,%s,muon_state_bytes_per_muon_param,%.4f\n", config.c_str(),
                  m.optimizer_state / muon_numel);
      std::printf("muon_bytes,transformer,%s,muon_total_bytes_per_muon_param,%.4f\n", config.c_str(), m.total() / muon_numel);
      std::printf("muon_bytes,transformer,%s,pair_total_bytes_per_param,%.4f\n", config.c_str(),
                  (m.total() + a.total()) / all_numel);
      std::printf("muon_bytes,transformer,%s,muon_share_of_params,%.4f\n", config.c_str(), muon_numel / all_numel);
    });
  }
}

// A task the transformer can learn and that needs no download: fresh random tokens each step, labelled by a fixed
// random teacher (argmax of the mean token times a 256 x 10 matrix); each step's loss is on a batch it never saw.
struct TeacherTask {
  torch::Tensor teacher;
  TeacherTask() {
    torch::manual_seed(42);
    teacher = torch::randn({bench::TransformerImpl::d, 10});
  }
  std::pair<torch::Tensor, torch::Tensor> batch(int step) const {
    torch::manual_seed(1000 + step);
    auto x = bench::input_for("transformer");
    return {x, x.mean(1).matmul(teacher).argmax(1)};
  }
};

void train_section(int steps) {
  const TeacherTask task;
  const auto options = amp::Options("O2").low_precision_dtype(torch::kBFloat16).verbosity(0);
  {
    torch::manual_seed(1);
    bench::Transformer net;
    auto [model, adamw] = amp::initialize(net, amp::optim::FusedAdamW(net->parameters(), torch::optim::AdamWOptions(1e-3)),
                                          options);
    for (int s = 0; s < steps; ++s) {
      const auto [x, y] = task.batch(s);
      std::printf("muon_train,transformer,AdamW,loss_step_%d,%.6f\n", s, bench::amp_step(model, adamw, x, y).item<double>());
    }
  }
  torch::manual_seed(1);
  bench::Transformer net;
  with_muon_pair(net, options, [&](auto&, auto&, auto& step) {
    for (int s = 0; s < steps; ++s) {
      const auto [x, y] = task.batch(s);
      std::printf("muon_train,transformer,Muon + AdamW,loss_step_%d,%.6f\n", s, step(x, y));
    }
  });
}

}  // namespace

int main(int argc, char** argv) {
  std::string section = "step";
  int reps = 5, steps = 300;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--section") {
      section = value;
    } else if (flag == "--reps") {
      reps = std::stoi(value);
    } else if (flag == "--steps") {
      steps = std::stoi(value);
    } else {
      std::fprintf(stderr, "amp_muon_bench: unknown flag %s (use --section step|bytes|train, --reps N, --steps N)\n",
                   flag.c_str());
      return 2;
    }
  }
  std::printf("section,name,config,metric,value\n");
  if (section == "step") {
    step_section(reps);
  } else if (section == "bytes") {
    bytes_section();
  } else if (section == "train") {
    train_section(steps);
  } else {
    std::fprintf(stderr, "amp_muon_bench: --section is step, bytes or train, got %s\n", section.c_str());
    return 2;
  }
  return 0;
}
