#pragma once
// Loading model weights after amp::initialize (Apex's documented order: initialize, then load).

#include <torch/nn/module.h>
#include <torch/serialize/input-archive.h>

#include <string>

namespace amp {

/// Loads a model checkpoint written by torch::save(module, path) into `module`, converting each tensor
/// to the dtype the parameter or buffer has now: an fp32 checkpoint into a model that amp::initialize
/// cast to float16/bfloat16 (O2, O3), or the reverse. Where a parameter has an fp32 master weight (O2),
/// the master receives the checkpoint's fp32 value exactly and the model its rounded copy, so the next
/// step starts from the loaded weights. A checkpoint in the model's own dtype (torch::save of the cast
/// model) holds the masters' roundings at most: a master that rounds to its loaded value keeps its low
/// bits, so a resume that loads the optimizer, then the model, continues bit for bit (as with torch::load).
/// Strict: a missing or unexpected key, or a shape mismatch, throws naming it, before anything is written.
///
/// (`torch::load(module, path)` on a cast model puts the fp32 bytes under the low-precision tensors
/// without converting them; amp detects that at the next forward or step and throws.)
///
/// Example:
///   auto [model, optimizer] = amp::initialize(net, std::move(sgd), amp::Options("O2"));
///   amp::load_weights(*model, "pretrained.pt");
void load_weights(torch::nn::Module& module, const std::string& path);
void load_weights(torch::nn::Module& module, torch::serialize::InputArchive& archive);

}  // namespace amp
