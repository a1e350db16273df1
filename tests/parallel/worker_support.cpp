#include "worker_support.h"

#include <torch/script.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>
#include <torch/utils.h>

#include <algorithm>
#include <iostream>
#include <limits>
#include <sstream>

#include "optim/optimizer_state_key.h"
#include "options/exception_message.h"

namespace amp_worker {

namespace {

int g_rank = 0;
int g_failures = 0;

}  // namespace

void set_rank(int rank) { g_rank = rank; }
int failures() { return g_failures; }

void report(bool ok, const std::string& name, const std::string& details) {
  if (!ok) ++g_failures;
  std::cout << "[rank " << g_rank << "] " << (ok ? "ok   " : "FAIL ") << name << (details.empty() ? "" : ": " + details)
            << std::endl;
}

std::string str(double v) {
  std::ostringstream s;
  s.precision(6);
  s << v;
  return s.str();
}

bool same_on_all_ranks(const ProcessGroup& group, const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> flat;
  for (const auto& t : tensors) flat.push_back(t.detach().to(torch::kDouble).reshape({-1}));
  auto mine = torch::cat(flat);
  std::vector<torch::Tensor> theirs{mine.clone()};
  c10d::BroadcastOptions from0;
  from0.rootRank = 0;
  group.c10d()->broadcast(theirs, from0)->wait();
  std::vector<torch::Tensor> flag{torch::full({1}, torch::equal(mine, theirs[0]) ? 1.0 : 0.0)};
  c10d::AllreduceOptions min;
  min.reduceOp = c10d::ReduceOp::MIN;
  group.c10d()->allreduce(flag, min)->wait();
  return flag[0].item<double>() == 1.0;
}

double max_abs_diff(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double d = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    d = std::max(d, (a[i].detach().to(torch::kDouble) - b[i].detach().to(torch::kDouble)).abs().max().item<double>());
  }
  return d;
}

bool equal_bits(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!torch::equal(a[i], b[i])) return false;
  }
  return true;
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return amp::detail::message_of(e);
  }
  return "";
}

std::vector<torch::Tensor> clones(const std::vector<torch::Tensor>& ts) {
  std::vector<torch::Tensor> out;
  for (const auto& t : ts) out.push_back(t.detach().clone());
  return out;
}

std::vector<torch::Tensor> momentum_of(torch::optim::SGD& sgd, bool zeros_where_none) {
  std::vector<torch::Tensor> out;
  auto& state = sgd.state();
  for (auto& group : sgd.param_groups()) {
    for (auto& p : group.params()) {
      auto it = state.find(amp::detail::state_key(state, p));
      if (it != state.end()) {
        out.push_back(static_cast<torch::optim::SGDParamState&>(*it->second).momentum_buffer());
      } else if (zeros_where_none) {
        out.push_back(torch::zeros_like(p));
      }
    }
  }
  return out;
}

torch::nn::Sequential make_mlp(uint64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(12, 32), torch::nn::ReLU(), torch::nn::Linear(32, 32),
                               torch::nn::ReLU(), torch::nn::Linear(32, 5));
}

Batch global_batch(int step, int64_t size) {
  torch::manual_seed(5000 + step);
  return {torch::randn({size, 12}), torch::randint(5, {size}, torch::kLong)};
}

Batch rows(const Batch& b, int64_t start, int64_t count) { return {b.x.narrow(0, start, count), b.y.narrow(0, start, count)}; }

torch::Tensor loss_of(const torch::Tensor& logits, const torch::Tensor& y, int64_t inf_at) {
  auto per_sample = torch::nn::functional::cross_entropy(
      logits, y, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
  if (inf_at >= 0) {
    auto w = torch::ones_like(per_sample);
    w[inf_at] = std::numeric_limits<float>::infinity();
    per_sample = per_sample * w;
  }
  return per_sample.mean();
}

torch::jit::Module scripted_mlp(uint64_t seed) {
  auto eager = make_mlp(seed);
  torch::jit::Module m("ScriptedMlp");
  const char* names[] = {"w1", "b1", "w2", "b2", "w3", "b3"};
  size_t i = 0;
  for (const auto& p : eager->parameters()) m.register_parameter(names[i++], p.detach().clone().requires_grad_(true), false);
  m.define(R"JIT(
def forward(self, x):
    h = torch.relu(torch.linear(x, self.w1, self.b1))
    h = torch.relu(torch.linear(h, self.w2, self.b2))
    return torch.linear(h, self.w3, self.b3)
)JIT");
  return m;
}

}  // namespace amp_worker
