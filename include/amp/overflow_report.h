#pragma once
// Which parameters overflowed: the answer to "why does my loss scale keep dropping?" (apex #318, #834, #1135).

#include <string>
#include <vector>

namespace amp {

/// The last backward whose gradients held inf/NaN, for one optimizer: which loss, at what scale, and the
/// qualified names of the optimizer's parameters whose gradients were non-finite, in model order.
/// Computed only on overflowing backward passes; clean ones cost nothing.
///
/// Example:
///   if (auto report = amp::last_overflow(optimizer)) std::cerr << report->parameters.front() << "\n";
struct OverflowReport {
  int loss_id = 0;
  double loss_scale = 0.0;               // the scale that overflowed
  std::vector<std::string> parameters;   // qualified names ("encoder.0.weight"), model order
  std::vector<std::string> fp8_layers;   // FP8 layers (Options::fp8) whose input, weight or gradient amax was inf/NaN
};

}  // namespace amp
