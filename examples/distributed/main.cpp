// Data-parallel mixed precision: examples/train's digits classifier on several processes, the C++ port of
// Apex's distributed ImageNet script (apex.parallel.DistributedDataParallel + convert_syncbn_model, launched by
// torch.distributed.launch, now torchrun):
//
//   torchrun --standalone --nproc-per-node 2 --no-python build/torch-2.13/examples/distributed \
//       --config examples/configs/O2_bf16.ini --data build/data/digits.csv
//
// Each rank trains on its share of every epoch (torch::data::samplers::DistributedRandomSampler), gradients are
// averaged across ranks in bf16 during backward, BatchNorm statistics cover the global batch (SyncBatchNorm), and
// rank 0 prints one line per epoch and writes the checkpoint; `--resume true` loads it on every rank.
// `--zero-stage 1|2|3` shards the fp32 masters, the momentum (at 2 the gradients, at 3 the parameters too) across the
// ranks (ZeRO, amp::parallel::shard_optimizer); the checkpoint is then the consolidated one
// (amp::parallel::save_consolidated). At stage 3, `--zero-units` names the modules gathered together and
// `--zero-prefetch` how many are gathered ahead; reading the weights outside the forward takes a
// GatheredParametersGuard (the checkpoint, the checksum).

#include <amp/amp.h>
#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>

#include "../common/digits.h"
#include "../common/report_error.h"

namespace {

torch::nn::Sequential make_net() {
  return torch::nn::Sequential(torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 16, 3).padding(1)),
                               torch::nn::BatchNorm2d(16), torch::nn::ReLU(),
                               torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 32, 3).padding(1)),
                               torch::nn::BatchNorm2d(32), torch::nn::ReLU(), torch::nn::MaxPool2d(2),
                               torch::nn::Flatten(), torch::nn::Linear(32 * 4 * 4, 10));
}

// Sums `values` over the ranks (in double).
std::vector<double> sum_over_ranks(const amp::parallel::ProcessGroup& group, const std::vector<double>& values) {
  std::vector<torch::Tensor> t{torch::tensor(values, torch::kDouble)};
  group.c10d()->allreduce(t)->wait();
  return std::vector<double>(t[0].data_ptr<double>(), t[0].data_ptr<double>() + values.size());
}

}  // namespace

int main(int argc, char** argv) {
  std::string data, checkpoint;
  int epochs = 4;
  int64_t batch_size = 32;
  double lr = 0.05;
  bool resume = false, syncbn = true, delay_allreduce = false;
  int zero_stage = 0, zero_prefetch = 1;
  std::string zero_units;
  amp::ProgramFlags flags(
      "distributed: trains the digits classifier on every rank of a torchrun job (torchrun --standalone "
      "--nproc-per-node 2 --no-python ./distributed --config O2_bf16.ini)");
  flags.add("data", &data, "digits.csv from scikit-learn (empty or missing: generated data)")
      .add("epochs", &epochs, "passes over the training set")
      .add("batch_size", &batch_size, "images per rank per step (the global batch is world_size times this)")
      .add("lr", &lr, "SGD learning rate (momentum 0.9)")
      .add("syncbn", &syncbn, "BatchNorm statistics over the global batch (amp::parallel::convert_syncbn_model)")
      .add("delay_allreduce", &delay_allreduce, "reduce gradients once after backward instead of during it")
      .add("checkpoint", &checkpoint, "rank 0 saves CHECKPOINT.{model,optimizer,epoch} after every epoch")
      .add("resume", &resume, "every rank loads --checkpoint and continues from its epoch")
      .add("zero_stage", &zero_stage, "0: off; 1: ZeRO-shard the masters and momentum; 2: and the gradients; 3: and "
           "the parameters")
      .add("zero_units", &zero_units, "stage 3: comma-separated module patterns gathered together (empty: each child)")
      .add("zero_prefetch", &zero_prefetch, "stage 3: units all-gathered ahead of the one in use");
  try {
    const auto options = amp::parse_command_line(argc, argv, flags);
    if (!options) return 0;
    torch::set_num_threads(1);
    const auto group = amp::parallel::init_process_group();
    const int rank = group.rank(), world = group.world_size();
    const bool leader = rank == 0;

    torch::manual_seed(0);
    torch::Tensor images, labels;
    const std::string source = load_digits(data, images, labels);
    const auto order = torch::randperm(images.size(0));
    const int64_t n_val = images.size(0) / 5;
    const auto val_x = images.index_select(0, order.narrow(0, 0, n_val));
    const auto val_y = labels.index_select(0, order.narrow(0, 0, n_val));
    const auto train_x = images.index_select(0, order.narrow(0, n_val, images.size(0) - n_val));
    const auto train_y = labels.index_select(0, order.narrow(0, n_val, images.size(0) - n_val));

    torch::manual_seed(1);
    auto net = make_net();
    if (syncbn) amp::parallel::convert_syncbn_model(*net, group);  // before initialize, as Apex
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(lr).momentum(0.9));
    auto [model, optimizer] = amp::initialize(net, std::move(sgd), amp::Options(*options).verbosity(leader ? options->resolve().verbosity : 0));
    int first_epoch = 0;
    TORCH_CHECK(!resume || !checkpoint.empty(), "distributed: --resume true needs --checkpoint PATH");
    if (resume) torch::load(net, checkpoint + ".model");  // after initialize: the model holds its amp dtypes
    auto ddp = amp::parallel::make_distributed(model, group,
                                               amp::parallel::DistributedDataParallelOptions().delay_allreduce(delay_allreduce));
    if (zero_stage > 0) {
      amp::parallel::ZeroOptions zero = amp::parallel::ZeroOptions().stage(zero_stage);
      if (zero_stage == 3) {
        std::vector<std::string> units;
        for (size_t at = 0; at < zero_units.size();) {
          const size_t comma = std::min(zero_units.find(',', at), zero_units.size());
          units.push_back(zero_units.substr(at, comma - at));
          at = comma + 1;
        }
        zero.units(units).prefetch(zero_prefetch);
      }
      amp::parallel::shard_optimizer(ddp, optimizer, zero);
    }
    if (resume) {
      torch::load(optimizer, checkpoint + ".optimizer");  // every rank; a sharded one keeps its slice
      std::ifstream(checkpoint + ".epoch") >> first_epoch;
    }
    if (leader) {
      std::printf("data: %s, %lld training images over %d ranks (%lld per rank per step), syncbn %s\n", source.c_str(),
                  static_cast<long long>(train_x.size(0)), world, static_cast<long long>(batch_size), syncbn ? "on" : "off");
      std::printf("epoch        lr train_loss   val_acc  loss_scale skipped     sec     img/s\n");
    }

    torch::data::samplers::DistributedRandomSampler sampler(static_cast<size_t>(train_x.size(0)),
                                                           static_cast<size_t>(world), static_cast<size_t>(rank));
    for (int epoch = first_epoch; epoch < epochs; ++epoch) {
      const auto start = std::chrono::steady_clock::now();
      ddp.train();
      sampler.set_epoch(static_cast<size_t>(epoch));
      sampler.reset();
      double loss_sum = 0, seen = 0;
      while (auto indices = sampler.next(static_cast<size_t>(batch_size))) {
        const auto index = torch::tensor(std::vector<int64_t>(indices->begin(), indices->end()), torch::kLong);
        const auto x = train_x.index_select(0, index), y = train_y.index_select(0, index);
        optimizer.zero_grad();
        auto loss = torch::nn::functional::cross_entropy(ddp(x), y);
        {
          auto scaled_loss = amp::scale_loss(loss, optimizer);
          scaled_loss.backward();
        }
        optimizer.step();
        loss_sum += loss.item<double>() * static_cast<double>(x.size(0));
        seen += static_cast<double>(x.size(0));
      }
      // Every rank evaluates its half of the validation set; the counts are summed.
      ddp.eval();
      double correct = 0;
      {
        torch::NoGradGuard no_grad;
        const int64_t per_rank = (n_val + world - 1) / world, begin = std::min<int64_t>(rank * per_rank, n_val);
        const int64_t count = std::min<int64_t>(per_rank, n_val - begin);
        // Through ddp: at ZeRO stage 3 its forward gathers each unit's parameters (every rank runs it, even on none).
        const auto predicted = ddp(val_x.narrow(0, begin, count)).argmax(1);
        if (count > 0) correct = predicted.eq(val_y.narrow(0, begin, count)).sum().item<double>();
      }
      const auto totals = sum_over_ranks(group, {loss_sum, seen, correct});
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (leader) {
        std::printf("%5d %9.5f %10.4f %8.2f%% %11.1f %7lld %7.2f %9.0f\n", epoch + 1, lr, totals[0] / totals[1],
                    100.0 * totals[2] / static_cast<double>(n_val), amp::loss_scale(optimizer),
                    static_cast<long long>(optimizer.skipped_steps()), seconds, totals[1] / seconds);
        std::fflush(stdout);
      }
      if (!checkpoint.empty()) {
        if (zero_stage > 0) amp::parallel::save_consolidated(optimizer, checkpoint + ".optimizer");  // every rank
        amp::parallel::GatheredParametersGuard whole(ddp);  // stage 3: the weights whole (every rank); else nothing
        if (leader) {
          torch::save(net, checkpoint + ".model");
          if (zero_stage == 0) torch::save(optimizer, checkpoint + ".optimizer");
          std::ofstream(checkpoint + ".epoch") << epoch + 1;
        }
      }
      group.barrier();  // the checkpoint is complete before any rank could stop
    }

    // Every rank holds the same weights: the checksum of the fp32 masters (sharded: of the model, as each rank holds
    // only its slice of the masters) has the same bits everywhere.
    double checksum = 0;
    {
      amp::parallel::GatheredParametersGuard whole(ddp);
      for (const auto& p : zero_stage > 0 ? net->parameters() : amp::master_params(optimizer)) {
        checksum += p.to(torch::kDouble).abs().sum().item<double>();
      }
    }
    std::vector<torch::Tensor> low{torch::tensor({checksum}, torch::kDouble)}, high{low[0].clone()};
    c10d::AllreduceOptions min_op, max_op;
    min_op.reduceOp = c10d::ReduceOp::MIN;
    max_op.reduceOp = c10d::ReduceOp::MAX;
    group.c10d()->allreduce(low, min_op)->wait();
    group.c10d()->allreduce(high, max_op)->wait();
    const bool agree = low[0].item<double>() == high[0].item<double>();
    const auto stats = ddp.communication_stats();
    if (leader) {
      std::printf("ranks agree on the weights: %s; all-reduced %.1f KiB of %s gradients in %lld buckets\n",
                  agree ? "yes" : "NO", static_cast<double>(stats.allreduce_bytes) / 1024.0,
                  amp::dtype_name(optimizer.properties().opt_level == amp::OptLevel::O0 ||
                                          optimizer.properties().opt_level == amp::OptLevel::O1
                                      ? torch::kFloat
                                      : optimizer.properties().low_precision_dtype)
                      .c_str(),
                  static_cast<long long>(stats.allreduce_calls));
      if (zero_stage > 0) {
        const amp::StateBytes bytes = amp::state_bytes(optimizer);
        std::printf("ZeRO stage %d: reduce-scattered %.1f KiB, all-gathered %.1f KiB; rank 0 holds %.1f KiB of masters, "
                    "%.1f KiB of optimizer state, %.1f KiB of parameters\n", zero_stage, static_cast<double>(stats.reduce_scatter_bytes) / 1024.0,
                    static_cast<double>(stats.allgather_bytes) / 1024.0, static_cast<double>(bytes.masters) / 1024.0,
                    static_cast<double>(bytes.optimizer_state) / 1024.0, static_cast<double>(bytes.params) / 1024.0);
      }
    }
    return agree ? 0 : 2;
  } catch (const std::exception& e) {
    return report_error(e);
  }
}
