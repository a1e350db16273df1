// Fine-tuning torchvision's own architectures in C++: torchvision_models.py builds resnet18, mobilenet_v3_small and a
// small VisionTransformer with torchvision, pretrains them briefly in Python and saves them with torch.jit.script;
// this program loads one, freezes its BatchNorm, fine-tunes it at the config's opt level with SGD (momentum 0.9) or
// AdamW, logs the loss of every step, checks that the pretrained statistics came through unchanged and saves it with
// fp32 weights for Python's torch.jit.load. compare.py trains the same model the same way in Python, side by side.
//
//   python3 examples/finetune_torchvision/torchvision_models.py prepare build/torchvision
//   build/torch-2.13/examples/finetune_torchvision --config examples/configs/O2_bf16.ini \
//       --model build/torchvision/resnet18.pt --data build/torchvision/data.pt --optimizer adamw \
//       --loss-log build/torchvision/resnet18_O2.csv --out build/torchvision/resnet18_O2.pt

#include <amp/amp.h>
#include <torch/script.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>

#include "../common/memory_meter.h"
#include "../common/report_error.h"

namespace {

// Runs `fine_tune` with the optimizer named: SGD with momentum 0.9 or AdamW (LibTorch's defaults otherwise, which are
// Python's), or amp's fused twins.
template <class FineTune>
int with_optimizer(const std::string& name, const std::vector<torch::Tensor>& params, double lr, FineTune fine_tune) {
  if (name == "sgd") return fine_tune(torch::optim::SGD(params, torch::optim::SGDOptions(lr).momentum(0.9)));
  if (name == "adamw") return fine_tune(torch::optim::AdamW(params, torch::optim::AdamWOptions(lr)));
  if (name == "fused_sgd") return fine_tune(amp::optim::FusedSGD(params, torch::optim::SGDOptions(lr).momentum(0.9)));
  if (name == "fused_adamw") return fine_tune(amp::optim::FusedAdamW(params, torch::optim::AdamWOptions(lr)));
  throw std::invalid_argument("finetune_torchvision: --optimizer '" + name +
                              "' is not one of sgd, adamw, fused_sgd, fused_adamw");
}

template <class Opt>
int fine_tune(torch::jit::Module& net, Opt sgd_or_adamw, const amp::Options& options,
              const torch::Tensor& images, const torch::Tensor& labels, int steps, int64_t batch,
              const std::string& loss_log, const std::string& out_path) {
  std::vector<torch::Tensor> statistics;
  for (const auto& b : net.buffers()) statistics.push_back(b.clone());
  auto [model, optimizer] = amp::initialize(net, std::move(sgd_or_adamw), options);
  std::ofstream log(loss_log.empty() ? "/dev/null" : loss_log);
  log << "step,loss,loss_scale\n";
  log.precision(17);
  MemoryMeter& meter = MemoryMeter::install();
  meter.reset_peak();
  torch::manual_seed(0);  // dropout's draws, as torchvision_models.py seeds them
  model.train();
  const auto start = std::chrono::steady_clock::now();
  double last = 0.0;
  for (int step = 0; step < steps; ++step) {
    const auto index = torch::arange(step * batch, step * batch + batch) % images.size(0);
    optimizer.zero_grad();
    const torch::Tensor logits = model(images.index_select(0, index)).toTensor();
    const torch::Tensor loss = torch::nn::functional::cross_entropy(logits.to(torch::kFloat), labels.index_select(0, index));
    {
      auto scaled_loss = amp::scale_loss(loss, optimizer);
      scaled_loss.backward();
    }
    optimizer.step();
    last = loss.item<double>();
    log << step << "," << last << "," << amp::loss_scale(optimizer) << "\n";
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const auto& properties = optimizer.properties();
  std::printf("fine-tuned at %s (%s): loss %.6f after %d steps, %.2f ms/step, peak tensor memory %.1f MiB, %lld "
              "skipped steps\n",
              amp::to_string(properties.opt_level).c_str(),
              properties.opt_level == amp::OptLevel::O0 ? "fp32" : amp::dtype_name(properties.low_precision_dtype).c_str(),
              last, steps, 1e3 * seconds / steps, static_cast<double>(meter.peak_bytes()) / (1 << 20),
              static_cast<long long>(optimizer.skipped_steps()));
  bool unchanged = true;
  size_t i = 0;
  for (const auto& b : net.buffers()) {
    unchanged = unchanged && torch::equal(b.to(statistics[i].scalar_type()), statistics[i]);
    ++i;
  }
  std::printf("BatchNorm statistics unchanged: %s\n", unchanged ? "yes" : "NO");
  if (!out_path.empty()) {
    model.save(out_path);
    std::printf("saved for Python's torch.jit.load (fp32 weights): %s\n", out_path.c_str());
  }
  return unchanged ? 0 : 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_path, data_path, optimizer_name = "sgd", loss_log, out_path;
  int steps = 50;
  int64_t batch = 16;
  double lr = 0.0;
  amp::ProgramFlags flags("finetune_torchvision: fine-tune a torchvision model scripted in Python, BatchNorm frozen");
  flags.add("model", &model_path, "the module torchvision_models.py prepare saved (resnet18.pt, ...)")
      .add("data", &data_path, "data.pt from torchvision_models.py prepare (images and labels)")
      .add("optimizer", &optimizer_name, "sgd (momentum 0.9), adamw, or amp's fused_sgd / fused_adamw")
      .add("lr", &lr, "learning rate (0: 0.002 for SGD, 3e-4 for AdamW, as torchvision_models.py)")
      .add("steps", &steps, "fine-tuning steps (batch b of step k: images [k * b, k * b + b) modulo their count)")
      .add("batch", &batch, "images per step")
      .add("loss_log", &loss_log, "write step,loss,loss_scale of every step here (CSV)")
      .add("out", &out_path, "save the fine-tuned module here (fp32 weights)");
  try {
    const auto options = amp::parse_command_line(argc, argv, flags);
    if (!options) return 0;
    if (model_path.empty() || data_path.empty()) {
      throw std::invalid_argument("finetune_torchvision: give --model and --data (torchvision_models.py prepare DIR "
                                  "writes DIR/resnet18.pt, DIR/mobilenet_v3_small.pt, DIR/vit.pt and DIR/data.pt)");
    }
    if (steps < 1 || batch < 1) {
      throw std::invalid_argument("finetune_torchvision: --steps (" + std::to_string(steps) + ") and --batch (" +
                                  std::to_string(batch) + ") must be at least 1");
    }
    torch::set_num_threads(1);
    const torch::jit::Module data = torch::jit::load(data_path);
    const auto images = data.attr("images").toTensor(), labels = data.attr("labels").toTensor();
    torch::jit::Module net = torch::jit::load(model_path);
    amp::freeze_batchnorm(net);  // eval mode, no gradients; amp::Model::train() keeps them so
    if (lr == 0.0) lr = optimizer_name.find("sgd") != std::string::npos ? 0.002 : 3e-4;
    std::printf("%s: %lld images, %s (lr %g), LibTorch %s\n", model_path.c_str(),
                static_cast<long long>(images.size(0)), optimizer_name.c_str(), lr, TORCH_VERSION);
    return with_optimizer(optimizer_name, amp::parameters(net), lr, [&](auto optimizer) {
      return fine_tune(net, std::move(optimizer), *options, images, labels, steps, batch, loss_log, out_path);
    });
  } catch (const std::exception& e) {
    return report_error(e);
  }
}
