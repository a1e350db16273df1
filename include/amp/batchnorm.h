#pragma once
// BatchNorm under mixed precision: recognising BN layers and freezing them for fine-tuning.

#include <torch/nn/module.h>

#include <vector>

namespace amp {

/// Puts every BatchNorm layer under `module` (itself included) in eval mode, stops its parameters'
/// gradients and marks it frozen, so amp::Model::train() keeps it so. Running statistics then never
/// change. Call it before amp::initialize: layers frozen then stay fp32 at every level, O3 included
/// (unless Options::cast_frozen_batchnorm), so their pretrained statistics are not rounded.
///
/// Example:
///   amp::freeze_batchnorm(*backbone);   // fine-tune the head, keep pretrained BN statistics
void freeze_batchnorm(torch::nn::Module& module);

/// Returns whether `module` is a BatchNorm1d/2d/3d layer (or derives from one).
bool is_batchnorm(const torch::nn::Module& module);

/// Returns whether freeze_batchnorm marked `module` frozen.
bool is_frozen(const torch::nn::Module& module);

namespace detail {
/// Puts every frozen layer under `module` back in eval mode (after a recursive train()).
void keep_frozen_layers_frozen(torch::nn::Module& module);
/// Returns the running statistics of BatchNorm layers under `module` that are float16 (O3), which a
/// training forward can push past 65504.
std::vector<at::Tensor> float16_batchnorm_statistics(torch::nn::Module& module);
/// Throws, naming the fix, if a training forward overflowed float16 running statistics (pytorch #115500).
void check_batchnorm_statistics(const std::vector<at::Tensor>& statistics);
}  // namespace detail

}  // namespace amp
