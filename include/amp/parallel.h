#pragma once
// amp::parallel: data-parallel mixed precision on PyTorch's c10d (Apex's apex.parallel).
//
//   // torchrun --standalone --nproc-per-node 2 --no-python ./trainer --config O2_bf16.ini
//   auto group = amp::parallel::init_process_group();           // RANK, WORLD_SIZE, MASTER_ADDR/PORT
//   amp::parallel::convert_syncbn_model(*net, group);            // optional: BatchNorm over all ranks
//   auto [model, optimizer] = amp::initialize(net, std::move(sgd), amp::Options("O2"));
//   auto ddp = amp::parallel::make_distributed(model, group);    // Apex's order: initialize, then DDP
//   auto loss = torch::nll_loss(ddp(x), y);                      // each rank: its shard of the batch
//   { auto scaled_loss = amp::scale_loss(loss, optimizer); scaled_loss.backward(); }   // averaged, then unscaled
//   optimizer.step();
//
// One concept per header; this one only includes them. docs/distributed.md has the Apex -> amp mapping.

#include "amp/parallel/distributed_data_parallel.h"
#include "amp/parallel/gathered_parameters_guard.h"
#include "amp/parallel/process_group.h"
#include "amp/parallel/sync_batchnorm.h"
#include "amp/parallel/zero.h"
