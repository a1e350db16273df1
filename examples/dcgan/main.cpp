// Apex's multi-model, multi-loss pattern (its DCGAN example): a generator and a discriminator, two
// optimizers and three losses, each loss with its own loss scaler (num_losses = 3, loss_id 0..2),
// initialized together like
//   [netD, netG], [optimizerD, optimizerG] = amp.initialize([netD, netG], [optimizerD, optimizerG], num_losses=3)
// The data is the classic 2-D GAN benchmark: a ring of 8 Gaussians; the generator should learn to
// put its samples on the modes.
//
//   build/torch-2.13/examples/dcgan --config examples/configs/O1_bf16.ini --steps 3000

#include <amp/amp.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <iostream>

#include "../common/report_error.h"

namespace {

constexpr double kPi = 3.14159265358979323846;

torch::Tensor ring_of_gaussians(int64_t n) {
  auto mode = torch::randint(8, {n}, torch::kLong).to(torch::kFloat) * (2 * kPi / 8);
  auto centers = torch::stack({torch::cos(mode), torch::sin(mode)}, 1) * 2.0;
  return centers + 0.05 * torch::randn({n, 2});
}

// Fraction of samples within 0.25 of a mode, and how many of the 8 modes hold at least 2% of them.
std::pair<double, int> mode_quality(const torch::Tensor& samples) {
  auto angles = torch::arange(8, torch::kFloat) * (2 * kPi / 8);
  auto centers = torch::stack({torch::cos(angles), torch::sin(angles)}, 1) * 2.0;
  auto distances = torch::cdist(samples.to(torch::kFloat), centers);  // [n, 8]
  auto [nearest, index] = distances.min(1);
  auto close = nearest.lt(0.25);
  int covered = 0;
  for (int64_t m = 0; m < 8; ++m) {
    covered += (close & index.eq(m)).to(torch::kFloat).mean().item<double>() > 0.02 ? 1 : 0;
  }
  return {close.to(torch::kFloat).mean().item<double>(), covered};
}

torch::nn::Sequential mlp(int64_t in, int64_t out) {
  return torch::nn::Sequential(torch::nn::Linear(in, 128), torch::nn::LeakyReLU(torch::nn::LeakyReLUOptions().negative_slope(0.2)),
                               torch::nn::Linear(128, 128), torch::nn::LeakyReLU(torch::nn::LeakyReLUOptions().negative_slope(0.2)),
                               torch::nn::Linear(128, out));
}

}  // namespace

int main(int argc, char** argv) {
  int steps = 3000;
  int64_t batch_size = 256;
  int64_t seed = 0;
  int report_every = 500;
  std::string tensorboard;
  amp::ProgramFlags flags("dcgan: a generator and a discriminator trained with three amp loss scalers");
  flags.add("steps", &steps, "training steps (one discriminator and one generator update each)")
      .add("batch_size", &batch_size, "samples per step")
      .add("seed", &seed, "random seed")
      .add("report_every", &report_every, "print a line every this many steps");
  flags.add("tensorboard", &tensorboard, "TensorBoard run directory: losses and loss scales per step, modes per report");
  try {
    auto options = amp::parse_command_line(argc, argv, flags);
    if (!options) return 0;
    const int configured_losses = options->resolve().num_losses;
    if (configured_losses != 1 && configured_losses != 3) {
      throw std::invalid_argument("dcgan: this program scales 3 losses; the config asks for num_losses = " +
                                  std::to_string(configured_losses) + ". Remove the key or set it to 3.");
    }
    options->num_losses(3);  // errD_real, errD_fake, errG: one scaler each, as in Apex's DCGAN
    torch::manual_seed(static_cast<uint64_t>(seed));

    constexpr int64_t kLatent = 8;
    auto netD = mlp(2, 1), netG = mlp(kLatent, 2);
    torch::optim::Adam optD(netD->parameters(), torch::optim::AdamOptions(2e-4).betas({0.5, 0.999}));
    torch::optim::Adam optG(netG->parameters(), torch::optim::AdamOptions(2e-4).betas({0.5, 0.999}));
    auto [models, optimizers] = amp::initialize(std::tuple(netD, netG), std::tuple(std::move(optD), std::move(optG)), *options);
    auto& [modelD, modelG] = models;
    auto& [optimizerD, optimizerG] = optimizers;
    const auto bce = [](const torch::Tensor& logits, double target) {
      return torch::binary_cross_entropy_with_logits(logits, torch::full_like(logits, target));
    };
    const auto fixed_noise = torch::randn({2000, kLatent});
    std::optional<amp::SummaryWriter> writer;  // --tensorboard
    if (!tensorboard.empty()) writer.emplace(tensorboard);

    double start_close;
    int start_modes;
    {
      torch::NoGradGuard no_grad;
      std::tie(start_close, start_modes) = mode_quality(modelG(fixed_noise));
    }
    std::printf("%6s %8s %8s %8s %8s %9s %9s %9s %8s\n", "step", "errD", "errG", "D(x)", "near", "modes", "scale0",
                "scale1", "scale2");
    std::printf("%6d %8s %8s %8s %7.1f%% %9d\n", 0, "-", "-", "-", 100 * start_close, start_modes);
    double errD_sum = 0, errG_sum = 0, dx_sum = 0;
    for (int step = 1; step <= steps; ++step) {
      // (1) Update D: maximize log(D(x)) + log(1 - D(G(z))), one scaler per term.
      optimizerD.zero_grad();
      const auto real = ring_of_gaussians(batch_size);
      const auto real_logits = modelD(real);
      const auto errD_real = bce(real_logits, 1.0);
      {
        auto scaled = amp::scale_loss(errD_real, optimizerD, amp::ScaleLossOptions().loss_id(0));
        scaled.backward();
      }
      const auto fake = modelG(torch::randn({batch_size, kLatent}));
      const auto errD_fake = bce(modelD(fake.detach()), 0.0);
      {
        auto scaled = amp::scale_loss(errD_fake, optimizerD, amp::ScaleLossOptions().loss_id(1));
        scaled.backward();
      }
      optimizerD.step();
      // (2) Update G: maximize log(D(G(z))).
      optimizerG.zero_grad();
      const auto errG = bce(modelD(fake), 1.0);
      {
        auto scaled = amp::scale_loss(errG, optimizerG, amp::ScaleLossOptions().loss_id(2));
        scaled.backward();
      }
      optimizerG.step();

      errD_sum += (errD_real + errD_fake).item<double>();
      errG_sum += errG.item<double>();
      dx_sum += torch::sigmoid(real_logits).mean().item<double>();
      if (writer) {  // Apex DCGAN's losses and D(x), then amp's: one loss scale per loss_id, skipped steps per optimizer
        writer->add_scalar("errD", (errD_real + errD_fake).item<double>(), step);
        writer->add_scalar("errG", errG.item<double>(), step);
        writer->add_scalar("D_x", torch::sigmoid(real_logits).mean().item<double>(), step);
        writer->add_scalar("amp/loss_scale/0", amp::loss_scale(optimizerD, 0), step);
        writer->add_scalar("amp/loss_scale/1", amp::loss_scale(optimizerD, 1), step);
        writer->add_scalar("amp/loss_scale/2", amp::loss_scale(optimizerG, 2), step);
        writer->add_scalar("amp/skipped_steps/D", static_cast<double>(optimizerD.skipped_steps()), step);
        writer->add_scalar("amp/skipped_steps/G", static_cast<double>(optimizerG.skipped_steps()), step);
      }
      if (step % report_every == 0 || step == steps) {
        const int n = step % report_every == 0 ? report_every : step % report_every;
        torch::NoGradGuard no_grad;
        auto [close, modes] = mode_quality(modelG(fixed_noise));
        std::printf("%6d %8.4f %8.4f %8.4f %7.1f%% %9d %9.1f %9.1f %9.1f\n", step, errD_sum / n, errG_sum / n,
                    dx_sum / n, 100 * close, modes, amp::loss_scale(optimizerD, 0), amp::loss_scale(optimizerD, 1),
                    amp::loss_scale(optimizerG, 2));
        std::fflush(stdout);
        if (writer) {
          writer->add_scalar("near_mode", close, step);
          writer->add_scalar("modes_covered", modes, step);
          writer->add_scalar("lr/D", static_cast<torch::optim::AdamOptions&>(optimizerD.param_groups()[0].options()).lr(), step);
          writer->add_scalar("lr/G", static_cast<torch::optim::AdamOptions&>(optimizerG.param_groups()[0].options()).lr(), step);
          writer->flush();
        }
        errD_sum = errG_sum = dx_sum = 0;
      }
    }
  } catch (const std::exception& e) {
    return report_error(e);
  }
  return 0;
}
