#pragma once
// amp: Apex-style opt-level mixed precision training (O0..O3) for LibTorch.
//
//   Net net;
//   torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
//   auto [model, optimizer] = amp::initialize(net, std::move(sgd), amp::Options("O2"));
//   for (auto& batch : *loader) {
//     optimizer.zero_grad();
//     auto loss = torch::nll_loss(model(batch.data), batch.target);
//     {
//       auto scaled_loss = amp::scale_loss(loss, optimizer);
//       scaled_loss.backward();
//     }
//     optimizer.step();
//   }
//
// One concept per header; this one only includes them.

#include "amp/autocast_guard.h"
#include "amp/batchnorm.h"
#include "amp/cast_policy.h"
#include "amp/checkpoint.h"
#include "amp/clip_grad.h"
#include "amp/config.h"
#include "amp/custom_function.h"
#include "amp/fp8.h"
#include "amp/fused_optimizers.h"
#include "amp/grad_scaler.h"
#include "amp/graph_capture.h"
#include "amp/initialize.h"
#include "amp/load_weights.h"
#include "amp/loss_scale.h"
#include "amp/loss_scaler.h"
#include "amp/master_weights.h"
#include "amp/memory.h"
#include "amp/model.h"
#include "amp/opt_level.h"
#include "amp/option_fields.h"
#include "amp/optimizer.h"
#include "amp/options.h"
#include "amp/overflow_report.h"
#include "amp/parallel.h"
#include "amp/properties.h"
#include "amp/python_checkpoint.h"
#include "amp/scale_loss.h"
#include "amp/tensorboard.h"
#include "amp/torchscript.h"
