// The experiment every AMP tutorial shows, scaled to a 2-core CPU: one small ERFNet-style
// encoder-decoder trained on generated segmentation data at each opt level and dtype, compared on
// time per epoch, peak memory of model state and activations (counted from tensor allocations),
// final loss and pixel accuracy; the loss curves go to a PNG drawn by gnuplot.
//
//   build/torch-2.13/examples/segmentation --epochs 4 --plot build/segmentation.png

#include <amp/amp.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <optional>

#include "../common/memory_meter.h"
#include "../common/progress.h"
#include "../common/report_error.h"

namespace {

// ERFNet's blocks (Romera et al. 2017): a downsampler concatenating a strided conv with a max pool,
// the factorized "non-bottleneck-1d" residual block, and a transposed-conv upsampler.
struct DownsamplerImpl : torch::nn::Module {
  DownsamplerImpl(int64_t in, int64_t out)
      : conv(register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out - in, 3).stride(2).padding(1)))),
        bn(register_module("bn", torch::nn::BatchNorm2d(out))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return torch::relu(bn(torch::cat({conv(x), torch::max_pool2d(x, 2)}, 1)));
  }
  torch::nn::Conv2d conv;
  torch::nn::BatchNorm2d bn;
};
TORCH_MODULE(Downsampler);

struct NonBottleneck1dImpl : torch::nn::Module {
  NonBottleneck1dImpl(int64_t c, int64_t dilation)
      : conv3x1_1(register_module("conv3x1_1", torch::nn::Conv2d(torch::nn::Conv2dOptions(c, c, {3, 1}).padding({1, 0})))),
        conv1x3_1(register_module("conv1x3_1", torch::nn::Conv2d(torch::nn::Conv2dOptions(c, c, {1, 3}).padding({0, 1})))),
        bn1(register_module("bn1", torch::nn::BatchNorm2d(c))),
        conv3x1_2(register_module("conv3x1_2", torch::nn::Conv2d(
                                                   torch::nn::Conv2dOptions(c, c, {3, 1}).padding({dilation, 0}).dilation({dilation, 1})))),
        conv1x3_2(register_module("conv1x3_2", torch::nn::Conv2d(
                                                   torch::nn::Conv2dOptions(c, c, {1, 3}).padding({0, dilation}).dilation({1, dilation})))),
        bn2(register_module("bn2", torch::nn::BatchNorm2d(c))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::relu(bn1(conv1x3_1(torch::relu(conv3x1_1(x)))));
    h = bn2(conv1x3_2(torch::relu(conv3x1_2(h))));
    return torch::relu(h + x);
  }
  torch::nn::Conv2d conv3x1_1, conv1x3_1;
  torch::nn::BatchNorm2d bn1;
  torch::nn::Conv2d conv3x1_2, conv1x3_2;
  torch::nn::BatchNorm2d bn2;
};
TORCH_MODULE(NonBottleneck1d);

struct UpsamplerImpl : torch::nn::Module {
  UpsamplerImpl(int64_t in, int64_t out)
      : conv(register_module("conv", torch::nn::ConvTranspose2d(
                                         torch::nn::ConvTranspose2dOptions(in, out, 3).stride(2).padding(1).output_padding(1)))),
        bn(register_module("bn", torch::nn::BatchNorm2d(out))) {}
  torch::Tensor forward(const torch::Tensor& x) { return torch::relu(bn(conv(x))); }
  torch::nn::ConvTranspose2d conv;
  torch::nn::BatchNorm2d bn;
};
TORCH_MODULE(Upsampler);

struct ErfNetImpl : torch::nn::Module {
  explicit ErfNetImpl(int64_t classes) {
    layers = register_module("layers", torch::nn::Sequential(
        Downsampler(3, 16), Downsampler(16, 64), NonBottleneck1d(64, 1), NonBottleneck1d(64, 2),
        NonBottleneck1d(64, 4), Upsampler(64, 16), NonBottleneck1d(16, 1),
        torch::nn::ConvTranspose2d(torch::nn::ConvTranspose2dOptions(16, classes, 2).stride(2))));
  }
  torch::Tensor forward(const torch::Tensor& x) { return layers->forward(x); }
  torch::nn::Sequential layers{nullptr};
};
TORCH_MODULE(ErfNet);

// Images of a noisy background with a disc (class 1) and a square (class 2) at random places.
std::pair<torch::Tensor, torch::Tensor> make_scenes(int64_t n, int64_t size) {
  auto images = 0.2 * torch::randn({n, 3, size, size});
  auto labels = torch::zeros({n, size, size}, torch::kLong);
  auto ys = torch::arange(size, torch::kFloat).view({size, 1}).expand({size, size});
  auto xs = torch::arange(size, torch::kFloat).view({1, size}).expand({size, size});
  for (int64_t i = 0; i < n; ++i) {
    const auto r = torch::randint(3, 7, {1}).item<int64_t>();
    const auto cy = torch::randint(r, size - r, {1}).item<int64_t>(), cx = torch::randint(r, size - r, {1}).item<int64_t>();
    auto disc = ((ys - cy).pow(2) + (xs - cx).pow(2)).le(r * r);
    const auto s = torch::randint(4, 10, {1}).item<int64_t>();
    const auto sy = torch::randint(0, size - s, {1}).item<int64_t>(), sx = torch::randint(0, size - s, {1}).item<int64_t>();
    auto square = ys.ge(sy) & ys.lt(sy + s) & xs.ge(sx) & xs.lt(sx + s);
    labels[i].masked_fill_(disc, 1).masked_fill_(square, 2);
    auto colors = torch::rand({2, 3}) + 0.5;
    for (int64_t c = 0; c < 3; ++c) {
      images[i][c].masked_fill_(disc, colors[0][c].item<float>()).masked_fill_(square, colors[1][c].item<float>());
    }
  }
  return {images, labels};
}

// Mean intersection over union over the classes present in the prediction or the labels.
double mean_iou(const torch::Tensor& predicted, const torch::Tensor& labels, int64_t classes) {
  double sum = 0;
  int present = 0;
  for (int64_t c = 0; c < classes; ++c) {
    const auto p = predicted.eq(c), l = labels.eq(c);
    const auto united = (p | l).sum().item<int64_t>();
    if (united == 0) continue;
    sum += static_cast<double>((p & l).sum().item<int64_t>()) / static_cast<double>(united);
    ++present;
  }
  return present ? sum / present : 0.0;
}

struct Result {
  std::string mode;
  bool ran = false;
  std::string why_not;
  double seconds_per_epoch = 0, peak_mib = 0, final_loss = 0, pixel_accuracy = 0;
  std::vector<double> losses;  // per step
};

// One configuration's training. `options` is an Apex-style level, or nullopt for the AMP tutorials' own
// torch.amp loop (an fp32 model, autocast around forward and loss, GradScaler) in `autocast_dtype`.
Result run(const std::string& mode, const std::optional<amp::Options>& options, c10::ScalarType autocast_dtype,
           const torch::Tensor& x, const torch::Tensor& y, const torch::Tensor& val_x, const torch::Tensor& val_y,
           int epochs, int64_t batch_size, MemoryMeter& meter, const std::string& tensorboard_dir) {
  Result result;
  result.mode = mode;
  torch::manual_seed(1);
  const size_t baseline = meter.current_bytes();  // the data; everything above it is model state + activations
  meter.reset_peak();
  ErfNet net(3);
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(2e-3).eps(1e-4));  // fp16-safe at O3
  try {
    // The two front doors, behind one training step and one forward for validation.
    std::optional<amp::Initialized<ErfNet, torch::optim::Adam>> apex;
    std::optional<amp::GradScaler> scaler;
    std::function<double(const torch::Tensor&, const torch::Tensor&)> train_step;
    std::function<torch::Tensor(const torch::Tensor&)> forward;
    torch::optim::Optimizer* optimizer = &adam;
    if (options) {
      apex.emplace(amp::initialize(net, std::move(adam), amp::Options(*options).verbosity(0)));
      auto& [model, amp_optimizer] = *apex;
      optimizer = &amp_optimizer;
      train_step = [&model = model, &amp_optimizer = amp_optimizer](const torch::Tensor& xb, const torch::Tensor& yb) {
        amp_optimizer.zero_grad();
        auto loss = torch::nn::functional::cross_entropy(model(xb), yb);
        {
          auto scaled = amp::scale_loss(loss, amp_optimizer);
          scaled.backward();
        }
        amp_optimizer.step();
        return loss.item<double>();
      };
      forward = [&model = model](const torch::Tensor& xb) { return model(xb); };
    } else {
      scaler.emplace();
      train_step = [&](const torch::Tensor& xb, const torch::Tensor& yb) {
        adam.zero_grad();
        torch::Tensor loss;
        {
          amp::AutocastGuard autocast(torch::kCPU, autocast_dtype);
          loss = torch::nn::functional::cross_entropy(net(xb), yb);
        }
        scaler->scale(loss).backward();
        scaler->step(adam);
        scaler->update();
        return loss.item<double>();
      };
      forward = [&](const torch::Tensor& xb) {
        amp::AutocastGuard autocast(torch::kCPU, autocast_dtype);
        return net(xb).to(torch::kFloat);
      };
    }
    // --tensorboard: one run per configuration (DIR/O0, DIR/O2_bf16, ...), so TensorBoard overlays them.
    std::optional<amp::SummaryWriter> writer;
    if (!tensorboard_dir.empty()) writer.emplace(tensorboard_dir + "/" + mode);
    const int64_t steps = x.size(0) / batch_size;
    double total_seconds = 0;
    for (int epoch = 0; epoch < epochs; ++epoch) {
      net->train();
      if (apex) apex->model.train();  // keeps frozen BatchNorm frozen
      ProgressBar progress(mode + " epoch " + std::to_string(epoch + 1), steps);
      const auto order = torch::randperm(x.size(0));
      for (int64_t step = 0; step < steps; ++step) {
        const auto index = order.narrow(0, step * batch_size, batch_size);
        result.losses.push_back(train_step(x.index_select(0, index), y.index_select(0, index)));
        progress.step(batch_size, result.losses.back());
        if (writer) writer->add_scalar("train_loss_step", result.losses.back(), epoch * steps + step + 1);
      }
      progress.finish();
      total_seconds += progress.seconds();
      if (writer) {  // the tutorial's per-epoch curves (validation outside the timed loop), then amp's signals
        const int64_t logged_epoch = epoch + 1;
        net->eval();
        {
          torch::NoGradGuard no_grad;
          const auto logits = forward(val_x);
          const auto predicted = logits.argmax(1);
          writer->add_scalar("val_loss", torch::nn::functional::cross_entropy(logits, val_y).item<double>(), logged_epoch);
          writer->add_scalar("val_acc", predicted.eq(val_y).to(torch::kFloat).mean().item<double>(), logged_epoch);
          writer->add_scalar("val_miou", mean_iou(predicted, val_y, 3), logged_epoch);
        }
        writer->add_scalar("train_loss", progress.mean_loss(), logged_epoch);
        writer->add_scalar("lr", static_cast<torch::optim::AdamOptions&>(optimizer->param_groups()[0].options()).lr(),
                           logged_epoch);
        writer->add_scalar("seconds_per_epoch", progress.seconds(), logged_epoch);
        if (apex) {
          amp::add_amp_scalars(*writer, apex->optimizer, logged_epoch);
        } else {
          writer->add_scalar("amp/loss_scale/0", scaler->get_scale(), logged_epoch);
        }
        writer->flush();
      }
    }
    net->eval();
    torch::NoGradGuard no_grad;
    auto logits = forward(val_x);
    result.final_loss = torch::nn::functional::cross_entropy(logits, val_y).item<double>();
    result.pixel_accuracy = logits.argmax(1).eq(val_y).to(torch::kFloat).mean().item<double>();
    result.seconds_per_epoch = total_seconds / epochs;
    result.peak_mib = static_cast<double>(meter.peak_bytes() - baseline) / (1 << 20);
    result.ran = true;
  } catch (const c10::Error& e) {
    result.why_not = e.what_without_backtrace();
    result.why_not = result.why_not.substr(0, result.why_not.find('\n'));
  } catch (const std::invalid_argument& e) {  // e.g. LibTorch 1.13's CPU autocast refusing float16
    result.why_not = e.what();
  }
  return result;
}

void plot(const std::vector<Result>& results, const std::string& png) {
  const std::string data = png + ".dat", script = png + ".gp";
  std::ofstream out(data);
  std::ofstream gp(script);
  gp << "set terminal pngcairo size 900,540 noenhanced\nset output '" << png << "'\n"
     << "set title 'ERFNet-style segmentation: training loss per step'\nset xlabel 'step'\nset ylabel 'cross-entropy'\n"
     << "set logscale y\nset key top right\nplot ";
  int block = 0;
  for (const auto& r : results) {
    if (!r.ran) continue;
    out << "# " << r.mode << "\n";
    for (size_t i = 0; i < r.losses.size(); ++i) out << i << " " << r.losses[i] << "\n";
    out << "\n\n";
    gp << (block ? ", " : "") << "'" << data << "' index " << block << " with lines title '" << r.mode << "'";
    ++block;
  }
  gp << "\n";
  out.close();
  gp.close();
  const std::string command = "gnuplot '" + script + "'";
  if (std::system(command.c_str()) == 0) std::cout << "loss curves: " << png << "\n";
  else std::cout << "gnuplot failed or is missing (apt-get install gnuplot-nox); the curves are in " << data << "\n";
}

}  // namespace

int main(int argc, char** argv) {
  int epochs = 4;
  int64_t images = 384, batch_size = 32, size = 32;
  std::string plot_file;
  std::string tensorboard;
  std::string levels = "O0,O1_bf16,O1_fp16,O2_bf16,O2_fp16,O3_bf16,O3_fp16,autocast_bf16,autocast_fp16";
  amp::ProgramFlags flags("segmentation: one network trained at every opt level and dtype, compared");
  flags.add("epochs", &epochs, "epochs per configuration")
      .add("images", &images, "training images (validation: a quarter as many)")
      .add("batch_size", &batch_size, "images per step")
      .add("size", &size, "image side in pixels (a multiple of 8)")
      .add("modes", &levels, "comma-separated configurations: LEVEL or LEVEL_bf16/LEVEL_fp16 (Apex-style amp::initialize), "
                             "autocast_bf16/autocast_fp16 (the torch.amp loop: AutocastGuard + GradScaler)")
      .add("plot", &plot_file, "PNG file for the loss curves (empty: no plot)");
  flags.add("tensorboard", &tensorboard, "TensorBoard log directory: one run per configuration (DIR/O0, DIR/O2_bf16, ...)");
  try {
    const auto base = amp::parse_command_line(argc, argv, flags);
    if (!base) return 0;
    MemoryMeter& meter = MemoryMeter::install();
    torch::manual_seed(0);
    auto [x, y] = make_scenes(images, size);
    auto [val_x, val_y] = make_scenes(images / 4, size);
    std::printf("threads %d, %lld train / %lld validation images of %lldx%lld, batch %lld, %d epochs\n",
                at::get_num_threads(), static_cast<long long>(images), static_cast<long long>(images / 4),
                static_cast<long long>(size), static_cast<long long>(size), static_cast<long long>(batch_size), epochs);
    std::vector<Result> results;
    std::stringstream list(levels);
    for (std::string mode; std::getline(list, mode, ',');) {
      const bool autocast = mode.rfind("autocast_", 0) == 0;
      const std::string dtype = autocast ? mode.substr(9) : (mode.size() > 2 ? mode.substr(3) : "bf16");
      if ((!autocast && mode.size() != 2 && mode.size() != 7) || (dtype != "bf16" && dtype != "fp16")) {
        throw std::invalid_argument("segmentation: bad mode '" + mode + "'; use O0..O3, O1_bf16 style or autocast_bf16");
      }
      const auto lp = dtype == "bf16" ? torch::kBFloat16 : torch::kHalf;
      std::optional<amp::Options> options;
      if (!autocast) {
        options = *base;
        options->opt_level(amp::parse_opt_level(mode.substr(0, 2)));
        if (mode.size() > 2) options->low_precision_dtype(lp);
      }
      results.push_back(run(mode, options, lp, x, y, val_x, val_y, epochs, batch_size, meter, tensorboard));
    }
    const Result* baseline = nullptr;
    for (const auto& r : results) if (r.ran && r.mode == "O0") baseline = &r;
    std::printf("\n%-13s %10s %9s %10s %11s %10s %10s\n", "mode", "s/epoch", "speedup", "peak MiB", "final loss",
                "pixel acc", "vs O0 MiB");
    for (const auto& r : results) {
      if (!r.ran) {
        std::printf("%-13s skipped: %s\n", r.mode.c_str(), r.why_not.c_str());
        continue;
      }
      std::printf("%-13s %10.3f %8.2fx %10.2f %11.4f %9.2f%% %9.2fx\n", r.mode.c_str(), r.seconds_per_epoch,
                  baseline ? baseline->seconds_per_epoch / r.seconds_per_epoch : 1.0, r.peak_mib, r.final_loss,
                  100 * r.pixel_accuracy, baseline ? r.peak_mib / baseline->peak_mib : 1.0);
    }
    if (!plot_file.empty()) plot(results, plot_file);
    if (!tensorboard.empty()) std::cout << "TensorBoard runs: " << tensorboard << " (tensorboard --logdir " << tensorboard << ")\n";
  } catch (const std::exception& e) {
    return report_error(e);
  }
  return 0;
}
