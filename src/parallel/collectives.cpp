#include "collectives.h"

#include <ATen/Functions.h>
#include <c10/core/GradMode.h>
#include <torch/version.h>

#include <algorithm>
#include <limits>
#include <map>
#include <sstream>

namespace amp::parallel::detail {

c10::ScalarType wire_dtype(c10::ScalarType dtype, const AverageSettings& settings) {
  const bool low = dtype == at::kHalf || dtype == at::kBFloat16;
  if (low && settings.always_fp32) return at::kFloat;
#if TORCH_VERSION_MAJOR < 2
  if (dtype == at::kBFloat16) return at::kFloat;  // 1.13's Gloo: "Invalid scalar type" for bfloat16
#endif
  return dtype;
}

c10::intrusive_ptr<c10::ivalue::Future> average_async(const GroupState& group, const at::Tensor& flat,
                                                      const AverageSettings& settings,
                                                      std::function<void(const at::Tensor&)> wide) {
  c10::NoGradGuard no_grad;
  const c10::ScalarType wire = wire_dtype(flat.scalar_type(), settings);
  at::Tensor send = wire == flat.scalar_type() ? flat : flat.to(wire);
  if (settings.predivide != 1.0) send.div_(settings.predivide);
  std::vector<at::Tensor> tensors{send};
  auto future = group.group->allreduce(tensors)->getFuture();  // SUM; NOTE: never allreduce({a, b}) (sums a and b)
  const double post = static_cast<double>(group.world_size) / settings.predivide;
  const GroupState* state = &group;  // the group outlives its reductions (DistributedCore holds it)
  if (!settings.always_fp32 || send.is_same(flat)) wide = nullptr;
  return future->then(
      [flat, send, post, state, wide = std::move(wide)](c10::ivalue::Future& done) -> c10::IValue {
        if (done.hasError()) rethrow_collective_failure(done.exception_ptr(), *state, "the gradient all-reduce");
        c10::NoGradGuard no_grad;
        if (post != 1.0) send.div_(post);
        if (wide) wide(send);
        if (!send.is_same(flat)) flat.copy_(send);
        return c10::IValue(flat);
      },
      c10::TensorType::get());
}

int64_t broadcast_from_rank0(const GroupState& group, const std::vector<at::Tensor>& tensors, int64_t bucket_bytes,
                             const std::string& what) {
  if (group.world_size == 1 || tensors.empty()) return 0;
  c10::NoGradGuard no_grad;
  // Broadcast moves bits: every tensor travels as bytes (Gloo broadcasts no int16, and 1.13's no bfloat16), in
  // buckets of one device each, in the tensors' order.
  std::map<std::string, std::vector<std::vector<size_t>>> buckets;
  std::map<std::string, int64_t> filled;
  std::vector<at::Tensor> bytes(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    bytes[i] = tensors[i].contiguous().reshape({-1}).view(at::kByte);
    const std::string key = tensors[i].device().str();
    auto& list = buckets[key];
    if (list.empty() || filled[key] + bytes[i].numel() > bucket_bytes) {
      list.emplace_back();
      filled[key] = 0;
    }
    list.back().push_back(i);
    filled[key] += bytes[i].numel();
  }
  int64_t sent = 0;
  for (auto& [key, list] : buckets) {
    for (const auto& bucket : list) {
      std::vector<at::Tensor> pieces;
      for (size_t i : bucket) pieces.push_back(bytes[i]);
      std::vector<at::Tensor> flat{at::cat(pieces)};
      c10d::BroadcastOptions options;
      options.rootRank = 0;
      wait(group.group->broadcast(flat, options), group, what);
      sent += flat[0].numel();
      if (group.rank == 0) continue;
      int64_t offset = 0;
      for (size_t i : bucket) {
        const at::Tensor& t = tensors[i];
        const int64_t n = bytes[i].numel();
        // clone(): a fresh storage at offset 0, which view(dtype) needs for wider elements.
        t.copy_(flat[0].narrow(0, offset, n).clone().view(t.scalar_type()).view(t.sizes()));
        offset += n;
      }
    }
  }
  return sent;
}

namespace {

constexpr int64_t kRow = 11;  // count | dtype | dim | 8 sizes (the 8th folds the rest)

std::vector<int64_t> describe(const at::Tensor& t) {
  std::vector<int64_t> row(kRow - 1, 0);
  row[0] = static_cast<int64_t>(t.scalar_type());
  row[1] = t.dim();
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (d < 7) {
      row[2 + d] = t.size(d);
    } else {
      row[9] = row[9] * 1000003 + t.size(d);
    }
  }
  return row;
}

std::string shape_text(const std::vector<int64_t>& row) {
  std::ostringstream s;
  s << "[";
  for (int64_t d = 0; d < std::min<int64_t>(row[1], 7); ++d) s << (d ? ", " : "") << row[2 + d];
  if (row[1] > 7) s << ", ...";
  s << "] (" << c10::toString(static_cast<c10::ScalarType>(row[0])) << ")";
  return s.str();
}

}  // namespace

void verify_same_shapes(const GroupState& group, const std::vector<at::Tensor>& tensors,
                        const std::vector<std::string>& names, const std::vector<std::string>& kinds,
                        const std::string& where) {
  if (group.world_size == 1) return;
  const auto opts = at::TensorOptions().dtype(at::kLong);
  const int64_t n = static_cast<int64_t>(tensors.size());
  // Rank 0's count, then rank 0's descriptions of that many tensors.
  std::vector<at::Tensor> count{at::full({1}, n, opts)};
  c10d::BroadcastOptions from0;
  from0.rootRank = 0;
  wait(group.group->broadcast(count, from0), group, where + " (comparing models across ranks)");
  const int64_t n0 = count[0].item<int64_t>();
  std::vector<int64_t> rows(static_cast<size_t>(std::max<int64_t>(n0, 1) * (kRow - 1)), -1);
  for (int64_t i = 0; i < std::min(n, n0); ++i) {
    const auto row = describe(tensors[static_cast<size_t>(i)]);
    std::copy(row.begin(), row.end(), rows.begin() + i * (kRow - 1));
  }
  const at::Tensor mine = at::tensor(rows, opts).view({std::max<int64_t>(n0, 1), kRow - 1});
  std::vector<at::Tensor> reference{mine.clone()};
  wait(group.group->broadcast(reference, from0), group, where + " (comparing models across ranks)");
  int64_t first_bad = n != n0 ? std::min(n, n0) : std::numeric_limits<int32_t>::max();
  for (int64_t i = 0; i < std::min(n, n0); ++i) {
    if (!at::equal(mine[i], reference[0][i])) {
      first_bad = i;
      break;
    }
  }
  // The first mismatch over all ranks (index, then rank), known to every rank.
  const int64_t none = std::numeric_limits<int32_t>::max();
  std::vector<at::Tensor> code{at::full({1}, first_bad == none ? none * group.world_size : first_bad * group.world_size + group.rank, opts)};
  c10d::AllreduceOptions min_options;
  min_options.reduceOp = c10d::ReduceOp::MIN;
  wait(group.group->allreduce(code, min_options), group, where + " (comparing models across ranks)");
  const int64_t found = code[0].item<int64_t>();
  if (found >= none * group.world_size) return;
  const int64_t index = found / group.world_size;
  const int bad_rank = static_cast<int>(found % group.world_size);
  // The offending rank tells everyone its count and description of that tensor.
  std::vector<int64_t> theirs(kRow, -1);
  if (group.rank == bad_rank) {
    theirs[0] = n;
    if (index < n) {
      const auto row = describe(tensors[static_cast<size_t>(index)]);
      std::copy(row.begin(), row.end(), theirs.begin() + 1);
    }
  }
  std::vector<at::Tensor> message{at::tensor(theirs, opts)};
  c10d::BroadcastOptions from_bad;
  from_bad.rootRank = bad_rank;
  wait(group.group->broadcast(message, from_bad), group, where + " (comparing models across ranks)");
  const int64_t their_count = message[0][0].item<int64_t>();
  std::ostringstream s;
  s << where << ": the models differ across ranks: ";
  if (index < std::min(n0, their_count)) {
    const at::Tensor ref_row = reference[0][index].contiguous();
    std::vector<int64_t> row0(ref_row.data_ptr<int64_t>(), ref_row.data_ptr<int64_t>() + kRow - 1);
    std::vector<int64_t> row(message[0].data_ptr<int64_t>() + 1, message[0].data_ptr<int64_t>() + kRow);
    const std::string name = index < n ? "'" + names[static_cast<size_t>(index)] + "'" : "number " + std::to_string(index);
    const std::string kind = index < n ? kinds[static_cast<size_t>(index)] : "tensor";
    s << kind << " " << name << " is " << shape_text(row0) << " on rank 0 but " << shape_text(row) << " on rank "
      << bad_rank << ".";
  } else {
    s << "rank 0 has " << n0 << " parameters and buffers, rank " << bad_rank << " has " << their_count << ".";
  }
  s << " Every rank must build the same model (same layers and sizes) and pass it through amp::initialize with the "
       "same options before make_distributed.";
  TORCH_CHECK(false, s.str());
}

}  // namespace amp::parallel::detail
