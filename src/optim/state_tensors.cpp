#include "optim/state_tensors.h"

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include "amp/fused_optimizers.h"

namespace amp::detail {

StateFields state_fields(torch::optim::OptimizerParamState& state) {
  StateFields f;
  if (auto* s = dynamic_cast<torch::optim::SGDParamState*>(&state)) {
    f.tensors = {&s->momentum_buffer()};
  } else if (auto* s = dynamic_cast<torch::optim::AdamParamState*>(&state)) {
    f.tensors = {&s->exp_avg(), &s->exp_avg_sq(), &s->max_exp_avg_sq()};
    f.step = &s->step();
  } else if (auto* s = dynamic_cast<torch::optim::AdamWParamState*>(&state)) {
    f.tensors = {&s->exp_avg(), &s->exp_avg_sq(), &s->max_exp_avg_sq()};
    f.step = &s->step();
  } else if (auto* s = dynamic_cast<amp::optim::FusedLAMBParamState*>(&state)) {
    f.tensors = {&s->exp_avg(), &s->exp_avg_sq()};
  } else if (auto* s = dynamic_cast<amp::optim::FusedMuonParamState*>(&state)) {
    f.tensors = {&s->momentum_buffer()};
  } else if (auto* s = dynamic_cast<torch::optim::AdagradParamState*>(&state)) {
    f.tensors = {&s->sum()};
    f.step = &s->step();
  } else if (auto* s = dynamic_cast<torch::optim::RMSpropParamState*>(&state)) {
    f.tensors = {&s->square_avg(), &s->momentum_buffer(), &s->grad_avg()};
    f.step = &s->step();
  }
  return f;
}

std::unique_ptr<torch::optim::OptimizerParamState> new_state_for(const torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<const torch::optim::SGD*>(&optimizer)) return std::make_unique<torch::optim::SGDParamState>();
  if (dynamic_cast<const torch::optim::Adam*>(&optimizer)) return std::make_unique<torch::optim::AdamParamState>();
  if (dynamic_cast<const torch::optim::AdamW*>(&optimizer)) return std::make_unique<torch::optim::AdamWParamState>();
  if (dynamic_cast<const amp::optim::FusedLAMB*>(&optimizer)) return std::make_unique<amp::optim::FusedLAMBParamState>();
  if (dynamic_cast<const amp::optim::FusedMuon*>(&optimizer)) return std::make_unique<amp::optim::FusedMuonParamState>();
  return nullptr;
}

}  // namespace amp::detail
