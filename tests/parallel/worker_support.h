#pragma once
// What every scenario of amp_parallel_worker uses: the report lines, cross-rank comparisons, the MLP and the
// batches most scenarios train on, and their loss.

#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/sgd.h>
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "amp/parallel/process_group.h"

namespace torch::jit {
struct Module;
}  // namespace torch::jit

namespace amp_worker {

using amp::parallel::ProcessGroup;

/// Names this process's rank in the report lines.
void set_rank(int rank);
/// This rank's failed checks so far.
int failures();

/// Prints "[rank R] ok|FAIL <name>: <details>" and counts a failure.
void report(bool ok, const std::string& name, const std::string& details = "");

/// `v` with six significant digits, for report details.
std::string str(double v);

/// Returns whether `tensors` hold the same bits on every rank (rank 0's copy is broadcast and compared).
bool same_on_all_ranks(const ProcessGroup& group, const std::vector<torch::Tensor>& tensors);

double max_abs_diff(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b);

/// Whether `a` and `b` hold the same tensors bit for bit.
bool equal_bits(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b);

/// The message `f` throws (amp's, without LibTorch's backtrace), or "" if it throws nothing.
std::string message_of(const std::function<void()>& f);

/// Detached copies.
std::vector<torch::Tensor> clones(const std::vector<torch::Tensor>& ts);

/// SGD momentum buffers, in parameter order; where a parameter has none yet, nothing or (`zeros_where_none`) zeros.
std::vector<torch::Tensor> momentum_of(torch::optim::SGD& sgd, bool zeros_where_none = false);

/// 12 -> 32 -> 32 -> 5 with ReLUs, its weights drawn from `seed`.
torch::nn::Sequential make_mlp(uint64_t seed);

/// make_mlp(seed) as a TorchScript module (torch::jit::Module::define: no Python needed), parameters w1, b1, ..., b3.
torch::jit::Module scripted_mlp(uint64_t seed);

struct Batch {
  torch::Tensor x, y;
};

constexpr int64_t kGlobal = 16;  // global batch; each of 2 ranks gets 8

/// The global batch of `step` (every rank draws the same one): `size` rows of 12 features, 5 classes.
Batch global_batch(int step, int64_t size);

/// Rows [start, start + count) of `b`.
Batch rows(const Batch& b, int64_t start, int64_t count);

/// The mean cross-entropy through per-sample weights: 1, or inf for the sample `inf_at` (an overflow that starts
/// on one rank only).
torch::Tensor loss_of(const torch::Tensor& logits, const torch::Tensor& y, int64_t inf_at = -1);

}  // namespace amp_worker
