#include "optim/state_dtype.h"

#include <c10/util/Type.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <typeinfo>

#include "amp/fused_optimizers.h"

namespace amp::detail {
namespace {

at::Tensor to_float(const at::Tensor& t) { return t.defined() ? t.to(at::kFloat) : t; }

}  // namespace

void cast_state_to_float(torch::optim::OptimizerParamState& state, const std::string& param) {
  if (auto* s = dynamic_cast<torch::optim::SGDParamState*>(&state)) {
    s->momentum_buffer(to_float(s->momentum_buffer()));
  } else if (auto* s = dynamic_cast<torch::optim::AdamParamState*>(&state)) {
    s->exp_avg(to_float(s->exp_avg())).exp_avg_sq(to_float(s->exp_avg_sq()));
    s->max_exp_avg_sq(to_float(s->max_exp_avg_sq()));
  } else if (auto* s = dynamic_cast<torch::optim::AdamWParamState*>(&state)) {
    s->exp_avg(to_float(s->exp_avg())).exp_avg_sq(to_float(s->exp_avg_sq()));
    s->max_exp_avg_sq(to_float(s->max_exp_avg_sq()));
  } else if (auto* s = dynamic_cast<torch::optim::RMSpropParamState*>(&state)) {
    s->square_avg(to_float(s->square_avg())).momentum_buffer(to_float(s->momentum_buffer()));
    s->grad_avg(to_float(s->grad_avg()));
  } else if (auto* s = dynamic_cast<torch::optim::AdagradParamState*>(&state)) {
    s->sum(to_float(s->sum()));
  } else if (auto* s = dynamic_cast<optim::FusedLAMBParamState*>(&state)) {
    s->exp_avg(to_float(s->exp_avg())).exp_avg_sq(to_float(s->exp_avg_sq()));
  } else if (auto* s = dynamic_cast<optim::FusedMuonParamState*>(&state)) {
    s->momentum_buffer(to_float(s->momentum_buffer()));
  } else {
    TORCH_CHECK(false, "amp::Optimizer: auto_fp32 moves parameter '", param, "' to fp32, but its optimizer state is a ",
                c10::demangle(typeid(state).name()), ", which amp cannot cast with it. Use one of torch::optim's SGD, "
                "Adam, AdamW, RMSprop, Adagrad or amp::optim's fused optimizers, master weights (O2), or keep the "
                "module in fp32 from the start (keep_fp32).");
  }
}

}  // namespace amp::detail
