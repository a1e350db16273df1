// The main job: the C++ port of an Apex ImageNet-style `main_amp.py`, scaled to scikit-learn's 8x8
// handwritten digits (generated digits-like images if the file is absent): a conv + BatchNorm
// classifier, a data loader, SGD with a step LR schedule, amp at the opt level a config file picks,
// validation each epoch, a live progress bar, a metrics CSV, and checkpoints that resume bitwise, in
// amp's format (--checkpoint, --resume) or Python's (--save-python, --resume-python: torch.load reads it).
//
//   build/torch-2.13/examples/train --config examples/configs/O2_bf16.ini --data build/data/digits.csv

#include <amp/amp.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

#include "../common/digits.h"
#include "../common/progress.h"
#include "../common/report_error.h"

namespace {

// `hidden` > 0 adds a Linear layer of that width before the classifier: FP8 (fp8 = true) runs it, while the
// 10-way classifier, whose dimensions are no multiple of 16, stays bf16.
struct DigitsNetImpl : torch::nn::Module {
  explicit DigitsNetImpl(int64_t hidden = 0)
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 16, 3).padding(1)))),
        bn1(register_module("bn1", torch::nn::BatchNorm2d(16))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 32, 3).padding(1)))),
        bn2(register_module("bn2", torch::nn::BatchNorm2d(32))),
        fc(register_module("fc", torch::nn::Linear(hidden > 0 ? hidden : 32 * 4 * 4, 10))) {
    if (hidden > 0) fc_hidden = register_module("fc_hidden", torch::nn::Linear(32 * 4 * 4, hidden));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::relu(bn1(conv1(x)));
    h = torch::max_pool2d(torch::relu(bn2(conv2(h))), 2).flatten(1);
    if (fc_hidden) h = torch::relu(fc_hidden(h));
    return fc(h);
  }
  torch::nn::Linear fc_hidden{nullptr};
  torch::nn::Conv2d conv1;
  torch::nn::BatchNorm2d bn1;
  torch::nn::Conv2d conv2;
  torch::nn::BatchNorm2d bn2;
  torch::nn::Linear fc;
};
TORCH_MODULE(DigitsNet);

// The images and labels as a torch::data dataset, so the standard DataLoader batches and shuffles them.
class DigitsDataset : public torch::data::datasets::Dataset<DigitsDataset> {
 public:
  DigitsDataset(torch::Tensor images, torch::Tensor labels) : images_(std::move(images)), labels_(std::move(labels)) {}
  torch::data::Example<> get(size_t i) override {
    const auto index = static_cast<int64_t>(i);
    return {images_[index], labels_[index]};
  }
  torch::optional<size_t> size() const override { return static_cast<size_t>(images_.size(0)); }

 private:
  torch::Tensor images_, labels_;
};

// log10 |gradient| of every fp32 master parameter after the epoch's last step (zeros left out), for
// TensorBoard: how far the gradients sit above float16's underflow (2^-24, about 10^-7.2).
std::vector<double> log10_grad_magnitudes(amp::OptimizerBase& optimizer) {
  std::vector<double> out;
  for (const auto& p : amp::master_params(optimizer)) {
    if (!p.grad().defined()) continue;
    const auto g = p.grad().detach().abs().log10().flatten().to(torch::kDouble).contiguous();
    out.insert(out.end(), g.data_ptr<double>(), g.data_ptr<double>() + g.numel());
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  int epochs = 6;
  int64_t batch_size = 64;
  double lr = 0.05;
  int64_t seed = 0;
  std::string data;
  std::string checkpoint;
  std::string metrics;
  std::string tensorboard;
  bool resume = false;
  bool fused = false;
  std::string optimizer_name = "sgd";
  double muon_lr = 0.02;
  double clip_grad_norm = 0.0;
  int64_t hidden = 0;
  std::string resume_python;
  std::string save_python;
  amp::ProgramFlags flags("train: a digits classifier trained with amp at the opt level from --config");
  flags.add("epochs", &epochs, "train until this epoch (counting resumed ones)")
      .add("batch_size", &batch_size, "examples per step")
      .add("lr", &lr, "initial learning rate, halved every 2 epochs")
      .add("seed", &seed, "random seed of the initial weights, the split and each epoch's shuffle")
      .add("data", &data, "digits.csv from scikit-learn (empty or missing: generated data)")
      .add("checkpoint", &checkpoint, "file saved after each epoch: model, optimizer, fp32 masters, loss scalers")
      .add("resume", &resume, "load --checkpoint and continue from its epoch")
      .add("fused", &fused, "step with amp::optim::FusedSGD (Apex's FusedSGD: one pass per tensor) instead of "
           "torch::optim::SGD; the same numbers, faster")
      .add("optimizer", &optimizer_name, "sgd (torch::optim::SGD), fused_sgd (amp::optim::FusedSGD, as --fused true) or "
           "muon: amp::optim::FusedMuon on the conv and hidden weights (flattened to [out, rest]) with "
           "amp::optim::FusedAdamW (lr --lr / 10) on BatchNorm, biases and the classifier, one loss")
      .add("muon_lr", &muon_lr, "FusedMuon's initial learning rate with --optimizer muon, halved with --lr")
      .add("clip_grad_norm", &clip_grad_norm, "clip the gradients' total norm to this value after amp unscaled them "
           "(amp::clip_grad_norm_; the fp32 masters' at O2); 0: no clipping")
      .add("hidden", &hidden, "width of a hidden Linear layer before the classifier (0: none); fp8 needs one, a "
           "multiple of 16")
      .add("metrics", &metrics, "CSV file with one row per epoch (appended to on --resume)")
      .add("resume_python", &resume_python, "continue a Python run: a torch.save'd dict with 'model', 'optimizer', "
           "'amp' (Apex) or 'scaler' (GradScaler), 'epoch'")
      .add("save_python", &save_python, "file saved after each epoch for Python's torch.load: 'model' (fp32), "
           "'optimizer', 'amp' (Apex's format), 'epoch'");
  flags.add("tensorboard", &tensorboard, "TensorBoard run directory: one point per epoch (tensorboard --logdir DIR)");
  try {
    const auto options = amp::parse_command_line(argc, argv, flags);
    if (!options) return 0;
    if (!(clip_grad_norm >= 0.0)) {
      std::ostringstream message;
      message << "train: --clip-grad-norm must be positive (or 0: no clipping), got " << clip_grad_norm;
      throw std::invalid_argument(message.str());
    }
    if (optimizer_name != "sgd" && optimizer_name != "fused_sgd" && optimizer_name != "muon") {
      throw std::invalid_argument("train: --optimizer must be sgd, fused_sgd or muon, got '" + optimizer_name + "'");
    }
    if (fused && optimizer_name != "sgd" && optimizer_name != "fused_sgd") {
      throw std::invalid_argument("train: --fused true steps FusedSGD, and --optimizer " + optimizer_name +
                                  " asks for another; give one of them");
    }
    if (fused) optimizer_name = "fused_sgd";
    if (optimizer_name == "muon" && clip_grad_norm > 0.0) {
      throw std::invalid_argument("train: --clip-grad-norm clips one optimizer's gradients, and --optimizer muon "
                                  "steps two (FusedMuon and FusedAdamW) on one loss; FusedMuon normalizes its update "
                                  "anyway. Leave --clip-grad-norm 0 with muon");
    }
    if (resume && checkpoint.empty()) throw std::invalid_argument("train: --resume true needs --checkpoint FILE");
    if (resume && !resume_python.empty()) {
      throw std::invalid_argument("train: --resume true and --resume-python both say where to continue from; give one");
    }
    torch::manual_seed(static_cast<uint64_t>(seed));

    torch::Tensor images, labels;
    const std::string source = load_digits(data, images, labels);
    if (!data.empty() && source != data) std::cout << "train: " << data << " not found; using generated digits\n";
    const auto permutation = torch::randperm(images.size(0));
    images = images.index_select(0, permutation);
    labels = labels.index_select(0, permutation);
    const int64_t n_train = images.size(0) * 4 / 5;
    auto val_x = images.narrow(0, n_train, images.size(0) - n_train);
    auto val_y = labels.narrow(0, n_train, images.size(0) - n_train);
    auto loader = torch::data::make_data_loader<torch::data::samplers::RandomSampler>(
        DigitsDataset(images.narrow(0, 0, n_train), labels.narrow(0, 0, n_train)).map(torch::data::transforms::Stack<>()),
        torch::data::DataLoaderOptions().batch_size(static_cast<size_t>(batch_size)));
    const int64_t steps_per_epoch = (n_train + batch_size - 1) / batch_size;
    std::cout << "data: " << source << ", " << n_train << " train / " << val_x.size(0) << " validation images\n";

    if (hidden < 0) throw std::invalid_argument("train: --hidden must be 0 (no hidden layer) or a width, got " + std::to_string(hidden));
    DigitsNet net(hidden);
    const auto sgd_options = torch::optim::SGDOptions(lr).momentum(0.9).weight_decay(1e-4);
    // The rest is written once for every optimizer choice (amp::initialize keeps the types): one optimizer, or
    // Muon's two on one loss, which share the loss scale. The first is the checkpoints' "optimizer", the second
    // "optimizer_1".
    auto train = [&](auto... optimizers_in) {
      auto [models, optimizers] = amp::initialize(std::make_tuple(net), std::make_tuple(std::move(optimizers_in)...),
                                                  *options);
      auto& model = std::get<0>(models);
      auto& optimizer = std::get<0>(optimizers);
      const std::vector<amp::OptimizerBase*> all =
          std::apply([](auto&... o) { return std::vector<amp::OptimizerBase*>{&o...}; }, optimizers);
      auto key_of = [](size_t i) { return i == 0 ? std::string("optimizer") : "optimizer_" + std::to_string(i); };
      // Each group's initial learning rate, which the schedule halves every 2 epochs.
      std::vector<std::vector<double>> initial_lr;
      std::apply([&](auto&... o) {
        (initial_lr.push_back([&] {
          std::vector<double> out;
          for (const auto& group : o.param_groups()) out.push_back(group.options().get_lr());
          return out;
        }()), ...);
      }, optimizers);
      int start_epoch = 0;
      if (resume) {
        torch::serialize::InputArchive archive, model_archive;
        archive.load_from(checkpoint);
        archive.read("model", model_archive);
        net->load(model_archive);
        size_t i = 0;
        auto load = [&](auto& o) {  // state, fp32 masters and loss scalers
          torch::serialize::InputArchive one;
          archive.read(key_of(i++), one);
          o.load(one);
        };
        std::apply([&](auto&... o) { (load(o), ...); }, optimizers);
        c10::IValue epoch;
        archive.read("epoch", epoch);
        start_epoch = static_cast<int>(epoch.toInt());
        std::cout << "resumed from " << checkpoint << " after epoch " << start_epoch << "\n";
      }
      if (!resume_python.empty()) {  // the keys of torch.save({'model': ..., 'optimizer': ..., 'amp': ..., 'epoch': ...})
        const auto python = amp::PythonCheckpoint::load(resume_python);
        python.load_model(*model);
        size_t i = 0;  // state (into the fp32 masters at O2) and hyperparameters
        std::apply([&](auto&... o) { (python.load_optimizer(o, key_of(i++)), ...); }, optimizers);
        if (python.contains("amp")) {
          python.load_amp(optimizer, "amp");  // Apex's amp.state_dict()
        } else if (python.contains("scaler")) {
          python.load_amp(optimizer, "scaler");  // torch.amp.GradScaler's state_dict()
        }
        start_epoch = python.contains("epoch") ? static_cast<int>(python.get("epoch").toInt()) : 0;
        std::cout << "resumed from Python checkpoint " << resume_python << " after epoch " << start_epoch << "\n";
        resume = true;  // append to --metrics
      }
      std::ofstream csv;
      if (!metrics.empty()) {
        csv.open(metrics, resume ? std::ios::app : std::ios::trunc);
        if (!csv) throw std::invalid_argument("train: cannot write --metrics file '" + metrics + "'");
        if (!resume) csv << "epoch,lr,train_loss,val_loss,val_accuracy,loss_scale,skipped_steps,seconds,images_per_second,grad_norm\n";
      }
      std::optional<amp::SummaryWriter> writer;  // --tensorboard; a resumed run adds a file to the same run
      if (!tensorboard.empty()) writer.emplace(tensorboard);

      std::printf("%5s %9s %10s %9s %8s %11s %7s %7s %9s\n", "epoch", "lr", "train_loss", "val_loss", "val_acc",
                  "loss_scale", "skipped", "sec", "img/s");
      for (int epoch = start_epoch; epoch < epochs; ++epoch) {
        // Apex main_amp's adjust_learning_rate, as a pure function of the epoch so that resuming needs
        // no scheduler state; the shuffle is seeded per epoch for the same reason.
        const double decay = std::pow(0.5, epoch / 2), epoch_lr = lr * decay;
        size_t index = 0;
        std::apply([&](auto&... o) {
          auto set_lr = [&](auto& opt, const std::vector<double>& initial) {
            for (size_t g = 0; g < initial.size(); ++g) opt.param_groups()[g].options().set_lr(initial[g] * decay);
          };
          (set_lr(o, initial_lr[index++]), ...);
        }, optimizers);
        torch::manual_seed(static_cast<uint64_t>(seed) * 1000 + static_cast<uint64_t>(epoch));
        model.train();
        ProgressBar progress("epoch " + std::to_string(epoch + 1) + "/" + std::to_string(epochs), steps_per_epoch);
        // The mean gradient norm (before clipping) over the epoch's steps that were not skipped, summed on the
        // tensors' device: reading each step's norm back would cost a host sync per step on a GPU.
        torch::Tensor norm_sum = torch::zeros({}), norm_steps = torch::zeros({});
        for (auto& batch : *loader) {
          std::apply([](auto&... o) { (o.zero_grad(), ...); }, optimizers);
          const torch::Tensor loss = torch::nn::functional::cross_entropy(model(batch.data), batch.target);
          {
            auto scaled_loss = amp::scale_loss(loss, all);
            scaled_loss.backward();
          }
          if (clip_grad_norm > 0.0) {  // inf after an overflow: the step is skipped and nothing was clipped
            const torch::Tensor norm = amp::clip_grad_norm_(optimizer, clip_grad_norm);
            const torch::Tensor finite = torch::isfinite(norm);
            norm_sum = norm_sum + torch::where(finite, norm, torch::zeros_like(norm));
            norm_steps = norm_steps + finite.to(torch::kFloat);
          }
          std::apply([](auto&... o) { (o.step(), ...); }, optimizers);
          progress.step(batch.data.size(0), loss.item<double>());
        }
        progress.finish();
        model.eval();
        double val_loss, accuracy;
        {
          torch::NoGradGuard no_grad;
          const torch::Tensor logits = model(val_x);
          val_loss = torch::nn::functional::cross_entropy(logits, val_y).item<double>();
          accuracy = logits.argmax(1).eq(val_y).to(torch::kFloat).mean().item<double>();
        }
        const double grad_norm = norm_steps.item<double>() > 0 ? (norm_sum / norm_steps).item<double>() : 0.0;
        std::printf("%5d %9.5f %10.4f %9.4f %7.2f%% %11.1f %7lld %7.2f %9.0f", epoch + 1, epoch_lr,
                    progress.mean_loss(), val_loss, 100.0 * accuracy, amp::loss_scale(optimizer),
                    static_cast<long long>(optimizer.skipped_steps()), progress.seconds(), progress.items_per_second());
        if (clip_grad_norm > 0.0) std::printf(" grad_norm %.4f", grad_norm);
        std::printf("\n");
        std::fflush(stdout);
        if (csv) {
          char row[512], norm_text[32] = "";
          if (clip_grad_norm > 0.0) std::snprintf(norm_text, sizeof(norm_text), "%.9g", grad_norm);
          std::snprintf(row, sizeof(row), "%d,%.9g,%.9g,%.9g,%.9g,%.9g,%lld,%.4f,%.1f,%s\n", epoch + 1, epoch_lr,
                        progress.mean_loss(), val_loss, accuracy, amp::loss_scale(optimizer),
                        static_cast<long long>(optimizer.skipped_steps()), progress.seconds(), progress.items_per_second(),
                        norm_text);
          csv << row << std::flush;
        }
        if (writer) {  // the tutorial's curves, then amp's: loss scale per loss_id, skipped steps
          const int64_t step = epoch + 1;
          writer->add_scalar("train_loss", progress.mean_loss(), step);
          writer->add_scalar("val_loss", val_loss, step);
          writer->add_scalar("val_acc", accuracy, step);
          writer->add_scalar("lr", epoch_lr, step);
          writer->add_scalar("images_per_second", progress.items_per_second(), step);
          amp::add_amp_scalars(*writer, optimizer, step);
          if (clip_grad_norm > 0.0) writer->add_scalar("amp/grad_norm", grad_norm, step);  // before clipping
          writer->add_histogram("grad_log10_magnitude", log10_grad_magnitudes(optimizer), step);
          writer->flush();
        }
        if (!checkpoint.empty()) {
          torch::serialize::OutputArchive archive, model_archive;
          net->save(model_archive);
          archive.write("model", model_archive);
          size_t i = 0;
          auto save = [&](auto& o) {
            torch::serialize::OutputArchive one;
            o.save(one);
            archive.write(key_of(i++), one);
          };
          std::apply([&](auto&... o) { (save(o), ...); }, optimizers);
          archive.write("epoch", c10::IValue(static_cast<int64_t>(epoch + 1)));
          archive.save_to(checkpoint);
        }
        if (!save_python.empty()) {
          amp::PythonCheckpoint python;
          python.put_model("model", *model);  // fp32: the masters' values at O2
          size_t i = 0;
          std::apply([&](auto&... o) { (python.put_optimizer(key_of(i++), o), ...); }, optimizers);
          python.put_amp("amp", optimizer);  // the loss scalers the optimizers share
          python.put("epoch", static_cast<int64_t>(epoch + 1));
          python.save(save_python);
        }
      }
    };
    if (optimizer_name == "muon") {
      // The usual split: Muon for the weights of the hidden layers, AdamW for the rest (and the classifier).
      std::vector<torch::Tensor> hidden_weights, rest;
      for (const auto& item : net->named_parameters()) {
        const bool hidden_weight = item.value().dim() >= 2 && item.key().rfind("fc.", 0) != 0;
        (hidden_weight ? hidden_weights : rest).push_back(item.value());
      }
      train(amp::optim::FusedMuon(hidden_weights, amp::optim::FusedMuonOptions(muon_lr).weight_decay(0).flatten(true)),
            amp::optim::FusedAdamW(rest, torch::optim::AdamWOptions(lr / 10).weight_decay(1e-4)));
    } else if (optimizer_name == "fused_sgd") {
      train(amp::optim::FusedSGD(net->parameters(), sgd_options));
    } else {
      train(torch::optim::SGD(net->parameters(), sgd_options));
    }
  } catch (const std::exception& e) {
    return report_error(e);
  }
  return 0;
}
