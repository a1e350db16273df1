#pragma once
// The training loop that scenario_train (an MLP) and scenario_unused (routed heads) share: 2 ranks on their halves
// of each global batch through make_distributed, or one process on the whole batch as their reference, with an
// inf in one sample, no_sync accumulation or a second loss where the scenario asks.

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "amp/model.h"
#include "amp/parallel/distributed_data_parallel.h"
#include "amp/scale_loss.h"
#include "worker_support.h"

namespace amp_worker {

/// What one run of run_steps does at each step.
struct StepLoop {
  int steps = 8;
  /// Two micro-batches per step, the first under no_sync (delay_unscale): A = the first half of each rank's rows,
  /// B = the second; one process runs the same two micro-batches over the whole batch (A = both ranks' first halves).
  bool accumulate = false;
  /// A second loss (loss_id 1) after the first, with a backward of its own.
  bool two_losses = false;
  /// The global batch of `step`: every rank draws the same one.
  std::function<Batch(int step)> batch;
  /// The row of the global batch whose loss is inf at `step` (an overflow on one rank only), or -1.
  std::function<int64_t(int step)> inf_row = [](int) { return int64_t{-1}; };
  /// Runs after each synchronized backward, while its ScaledLoss is alive (the gradients are not yet consumed).
  std::function<void(int step)> after_backward = [](int) {};
  /// What must be bit-identical on every rank after every step.
  std::function<std::vector<torch::Tensor>()> state;
};

/// Trains `loop.steps` steps: through `ddp` on this rank's half of each global batch with a `group`, on the whole
/// batch without. Returns whether loop.state() was bit-identical on all ranks after every step (true without).
template <class Net, class Optimizer>
bool run_steps(const StepLoop& loop, amp::Model<Net>& model, Optimizer& optimizer,
               std::optional<amp::parallel::DistributedDataParallel<Net>>& ddp, const ProcessGroup* group) {
  const int rank = group ? group->rank() : 0;
  const int64_t local = kGlobal / (group ? group->world_size() : 1);
  auto forward = [&](const torch::Tensor& x) { return ddp ? (*ddp)(x) : model(x); };
  bool equal_every_step = true;
  for (int step = 0; step < loop.steps; ++step) {
    const Batch global = loop.batch(step);
    const int64_t inf_global = loop.inf_row(step);
    const int64_t inf_local = inf_global - rank * local;
    const int64_t inf_here = inf_global >= 0 && inf_local >= 0 && inf_local < local ? inf_local : -1;
    optimizer.zero_grad();
    if (loop.accumulate) {
      for (int micro = 0; micro < 2; ++micro) {
        Batch mine;
        int64_t inf_micro = -1;
        if (group) {
          mine = rows(global, rank * local + micro * local / 2, local / 2);
          if (inf_here >= 0 && inf_here / (local / 2) == micro) inf_micro = inf_here % (local / 2);
        } else {
          const int64_t half = kGlobal / 2, quarter = kGlobal / 4;  // the 2-rank run's shard and micro-batch
          auto a = rows(global, micro * quarter, quarter), b = rows(global, half + micro * quarter, quarter);
          mine = {torch::cat({a.x, b.x}), torch::cat({a.y, b.y})};
          if (inf_global >= 0 && (inf_global % half) / quarter == micro) {
            inf_micro = (inf_global / half) * quarter + inf_global % quarter;
          }
        }
        if (micro == 0 && ddp) {
          auto no_sync = ddp->no_sync();
          auto loss = loss_of(forward(mine.x), mine.y, inf_micro);
          auto scaled = amp::scale_loss(loss, optimizer, amp::ScaleLossOptions().delay_unscale(true));
          scaled.backward();
        } else {
          auto loss = loss_of(forward(mine.x), mine.y, inf_micro);
          auto scaled = amp::scale_loss(loss, optimizer, amp::ScaleLossOptions().delay_unscale(micro == 0));
          scaled.backward();
          loop.after_backward(step);
        }
      }
    } else {
      const Batch mine = group ? rows(global, rank * local, local) : global;
      auto loss = loss_of(forward(mine.x), mine.y, group ? inf_here : inf_global);
      {
        auto scaled = amp::scale_loss(loss, optimizer);
        scaled.backward();
        loop.after_backward(step);
      }
      if (loop.two_losses) {
        auto second = forward(mine.x).pow(2).mean() * 0.1;
        auto scaled = amp::scale_loss(second, optimizer, amp::ScaleLossOptions().loss_id(1));
        scaled.backward();
      }
    }
    optimizer.step();
    if (group) equal_every_step = same_on_all_ranks(*group, loop.state()) && equal_every_step;
  }
  return equal_every_step;
}

}  // namespace amp_worker
