#include "amp/parallel/zero.h"

// ZeRO over amp::parallel: the layout (NOTE [ZeRO layout]), the sharded step (NOTE [Sharded optimizers] in
// src/optim/sharding.h), stage 2's reduce-scatter, and the archives: one rank's shard, or the consolidated one.

#include <ATen/Functions.h>
#include <c10/core/GradMode.h>
#include <torch/serialize.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "amp/fused_optimizers.h"
#include "amp/optimizer.h"
#include "core/host_sync.h"
#include "collectives.h"
#include "group_state.h"
#include "optim/fused_step_context.h"
#include "optim/lean_masters.h"
#include "optim/master_weights.h"
#include "optim/optimizer_access.h"
#include "optim/optimizer_state_key.h"
#include "optim/param_index.h"
#include "optim/sharding.h"
#include "optim/state_format.h"
#include "optim/optimizer_kinds.h"
#include "scaling/multi_tensor.h"
#include "zero_units.h"

// NOTE [ZeRO layout]
// Each param group's tensors (fp32 masters or the parameters stepped directly), in group order (model order for
// groups built from model->parameters()), are one flat run of T elements cut into N slices of S = ceil(T / N); rank r
// owns [r S, min((r + 1) S, T)), the last slice short (the padding is on the wire only). A *piece* is the part of one
// tensor inside a rank's slice: its own storage (fp32 for masters), the state the optimizer keeps for it, and at stage
// 2 its gradient. ShardPieces travel by *lane*: the elements of one group whose model parameters share a dtype, packed rank
// by rank in that order, every rank padded to the longest rank's count, so one all-gather (updated values, in the
// model's dtype, as bytes: bitwise) or one reduce-scatter (gradients, averaged as the all-reduce averages them) moves
// every rank's part at once, bucket by bucket. With 8-bit optimizer states (NOTE [Optimizer state formats]) each
// quantized tensor starts at a multiple of 256 in the run and S is one too, so no piece splits a block of 256 values:
// a piece's codes and scales are its whole tensor's, the step quantizes them as the unsharded step does.
// An optimizer whose step needs each whole tensor (FusedMuon orthogonalizes each gradient matrix; NOTE [Optimizer
// kinds]) gets slices that end between tensors instead: rank r's slice ends at the tensor end nearest (r + 1) T / N,
// so its pieces are whole tensors (some ranks may hold none), which the step sees in their shapes (ShardSums::whole_shape).
// A bf16 parameter with a lean master (NOTE [Lean masters] in src/optim/lean_masters.h) has a piece that is a view of
// its part of the weight (stage 3: a copy, the only one the rank keeps) and the aux of that part alone (the lean
// table keeps no whole aux once sharded): the step stores each piece's fp32 value through a table of these slices,
// drawing stochastic rounding's bits by the whole tensor's place, and only the weights are all-gathered. Whole aux
// travel only for the consolidated archive and fp32 values (gather_aux); load_weights and archives hand each rank its
// slices (keep_aux, and at stage 3 keep_weight).
// At stage 3 a group's run is cut per unit instead (NOTE [Stage 3 units] in zero_units.cpp): the tensors of each unit
// in the group, in group order, are a run of their own cut into N slices as above, and lanes are per unit, so that
// gathering one unit moves its values only and each rank holds about 1/N of every unit.

namespace amp::parallel::detail {
namespace {

using amp::detail::OptimizerAccess;
using ShardStateMap = std::remove_reference_t<decltype(std::declval<torch::optim::Optimizer&>().state())>;
constexpr const char* kShard = "amp::parallel::shard_optimizer";

struct ShardEntry {
  at::Tensor stepped;  // what the param group holds: an fp32 master (a placeholder once sharded) or the parameter
  at::Tensor model;    // the model's parameter
  std::string name;
  bool mastered = false;
  size_t master_index = 0;  // in the MasterWeights table (the archives' "master/<i>")
  bool lean = false;        // a bf16 parameter with a lean master
  size_t lean_index = 0;    // in the optimizer's LeanMasters table
  int64_t offset = 0;       // in the group's flat run
  int64_t whole_offset = 0; // in the optimizer's numbering (StateFormat::Place)
  int64_t numel = 0;
  int64_t version = 0;  // the model parameter's, when it and the pieces last agreed
  const void* storage = nullptr;
  int unit = -1;               // stage 3: its unit (NOTE [Stage 3 units])
  size_t storage_bytes = 0;    // stage 3: its storage's size when whole
};

struct ShardPiece {
  size_t group = 0, entry = 0;
  int64_t begin = 0, length = 0;  // in the flattened tensor
  at::Tensor value;               // this rank's part of the stepped tensor
  at::Tensor grad;                // stage 2: its gradient (undefined: none since zero_grad)
  int lean_slot = -1;             // its entry in the table of lean slices (a view of the weight, not a copy)
};

struct ShardSpan {
  size_t entry = 0;
  int64_t begin = 0, length = 0, pos = 0;  // pos: in the rank's packed lane
  int piece = -1;                          // this rank's piece, for its own spans
};

struct ShardLane {
  size_t group = 0;
  int unit = -1;                         // stage 3: lanes are per unit (NOTE [ZeRO layout])
  c10::ScalarType dtype = at::kFloat;    // of the model parameters
  bool mastered = false;                 // its tensors are fp32 masters of them
  std::vector<std::vector<ShardSpan>> spans;  // by rank
  int64_t width = 0;                     // the longest rank's element count
  at::Tensor incoming;                   // stage 2: this rank's reduced slice since the last unscale
};

std::string shard_sizes_text(const std::vector<int64_t>& v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
  return out + "]";
}

// Every rank's `send` bytes, rank by rank (each rank sends as many), in chunks of at most `bucket_bytes` received.
at::Tensor shard_all_gather_bytes(const GroupState& state, const at::Tensor& send, int64_t bucket_bytes, const std::string& what) {
  const int64_t width = send.numel(), n_ranks = state.world_size;
  at::Tensor recv = at::empty({n_ranks * width}, send.options());
  if (n_ranks == 1 || width == 0) return n_ranks == 1 ? send.clone() : recv;
  const int64_t chunk = std::max<int64_t>(1, bucket_bytes / n_ranks);
  for (int64_t c0 = 0; c0 < width; c0 += chunk) {
    const int64_t n = std::min(chunk, width - c0);
    std::vector<at::Tensor> in{send.narrow(0, c0, n).contiguous()};
    std::vector<std::vector<at::Tensor>> out(1);
    for (int64_t r = 0; r < n_ranks; ++r) out[0].push_back(at::empty({n}, send.options()));
    wait(state.group->allgather(out, in), state, what);
    for (int64_t r = 0; r < n_ranks; ++r) recv.narrow(0, r * width + c0, n).copy_(out[0][static_cast<size_t>(r)]);
  }
  return recv;
}

// The sum over the ranks of `input` (world_size parts of `width`), this rank's part, started (start_reduce_scatter)
// and waited for (finish_reduce_scatter) apart, so that backward can go on in between (NOTE [Overlapped
// reduce-scatter]); sent in chunks of at most the bucket size. Gloo builds without a reduce-scatter (LibTorch 1.13)
// all-reduce the whole input instead: the same sums, twice the traffic.
struct ScatterInFlight {
  at::Tensor input;
  int64_t width = 0;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::vector<std::vector<std::vector<at::Tensor>>> inputs;  // each chunk's, alive until its work is done
  std::vector<at::Tensor> pieces;                           // each chunk's slice of this rank
  bool all_reduced = false;
};

ScatterInFlight start_reduce_scatter(const GroupState& state, const at::Tensor& input, int64_t width, int64_t bucket_bytes) {
  ScatterInFlight f;
  f.input = input;
  f.width = width;
  const int64_t n_ranks = state.world_size;
  if (n_ranks == 1) return f;
  static bool has_reduce_scatter = true;
  const int64_t chunk = std::max<int64_t>(1, bucket_bytes / (n_ranks * static_cast<int64_t>(input.element_size())));
  for (int64_t c0 = 0; c0 < width && has_reduce_scatter; c0 += chunk) {
    const int64_t n = std::min(chunk, width - c0);
    std::vector<std::vector<at::Tensor>> in(1);
    for (int64_t r = 0; r < n_ranks; ++r) in[0].push_back(input.narrow(0, r * width + c0, n).clone());
    std::vector<at::Tensor> piece{at::empty({n}, input.options())};
    try {
      f.works.push_back(state.group->reduce_scatter(piece, in));
    } catch (const c10::Error& e) {
      if (std::string(e.what()).find("does not support") == std::string::npos) throw;
      has_reduce_scatter = false;  // every rank's backend says so alike, at its first reduce-scatter
      break;
    }
    f.inputs.push_back(std::move(in));
    f.pieces.push_back(piece[0]);
  }
  if (has_reduce_scatter) return f;
  std::vector<at::Tensor> all{input};
  f.works.assign(1, state.group->allreduce(all));
  f.all_reduced = true;
  return f;
}

// Waits for `f` and returns this rank's slice.
at::Tensor finish_reduce_scatter(const GroupState& state, ScatterInFlight& f, const std::string& what) {
  if (state.world_size == 1) return f.input;
  for (const auto& work : f.works) wait(work, state, what);
  if (f.all_reduced) return f.input.narrow(0, static_cast<int64_t>(state.rank) * f.width, f.width).clone();
  at::Tensor out = at::empty({f.width}, f.input.options());
  int64_t c0 = 0;
  for (const auto& piece : f.pieces) {
    out.narrow(0, c0, piece.numel()).copy_(piece);
    c0 += piece.numel();
  }
  return out;
}

// A piece of a lean weight: elements [begin, begin + length) of its flattening, sharing its storage (not a view in
// autograd's sense, so that it can follow the weight to new storage with set_).
at::Tensor alias_of(const at::Tensor& weight, int64_t begin, int64_t length) {
  at::Tensor out = at::empty({0}, weight.options().requires_grad(false));
  out.set_(weight.storage(), weight.storage_offset() + begin, {length}, {1});
  return out;
}

// A piece's state, cut out of its whole tensor's (`full`); 8-bit moments by whole blocks (NOTE [ZeRO layout]), or
// decoded where the layout was not made for them (the moments then convert at the next step).
std::unique_ptr<torch::optim::OptimizerParamState> slice_piece_state(torch::optim::OptimizerParamState& full, int64_t begin,
                                                               int64_t length) {
  auto out = full.clone();
  const auto fields = amp::detail::state_fields(*out).tensors;
  for (size_t f = 0; f < fields.size(); ++f) {
    at::Tensor& t = *fields[f];
    if (!t.defined()) continue;
    const int64_t block = amp::detail::slice_alignment(t);
    if (begin % block != 0 || length % block != 0) {
      t = amp::detail::decode_moment(t, {-1}, amp::detail::moment_of_field(f));
    }
    t = amp::detail::slice_moment(t, begin, length);
  }
  return out;
}

class Zero final : public amp::detail::Sharding,
                   public amp::detail::MasterWeights::Shards,
                   public amp::detail::LeanMasters::Shards,
                   public UnitGatherer,
                   public DistributedCore::ShardedParameters,
                   public std::enable_shared_from_this<Zero> {
 public:
  Zero(std::shared_ptr<DistributedCore> core, OptimizerBase& optimizer, const ZeroOptions& options);
  ~Zero() override {
    if (stage_ == 3) amp::detail::count_stage3_shardings(-1);
  }

  std::vector<bool> reduce(const std::vector<at::Tensor>& params, const std::vector<bool>& used_anywhere,
                           bool closes_window);
  // Every rank's pieces and state, whole: on rank 0 (`everywhere`: on every rank), for an unsharded archive.
  void gather_consolidated(OptimizerBase& optimizer, bool everywhere);
  void end_consolidated() {
    full_state_.reset();
    full_masters_.clear();
    full_aux_.reset();
    full_weights_.reset();
  }
  const GroupState& group() const { return state_; }

  void on_shard(torch::optim::Optimizer& opt, Use use, const std::function<void()>& fn) override;
  void refresh_changed() override { refresh(/*all=*/false); }
  void refresh_all() override { refresh(/*all=*/true); }
  void after_step() override;
  bool owns_unscale() const override { return stage_ >= 2; }
  void unscale(bool delay_unscale, const amp::detail::InvScale& inv_scale, amp::detail::FoundInf& found_inf) override;
  void zero_grad(bool set_to_none) override;
  std::vector<at::Tensor> grads() override;
  at::Tensor global_norm(const std::vector<at::Tensor>& grads, double norm_type) override;
  std::vector<at::Tensor> pieces() const override;
  void save(torch::serialize::OutputArchive& amp_archive) const override;
  const std::vector<at::Tensor>* consolidated_masters() const override {
    return full_state_ ? &full_masters_ : nullptr;
  }
  void check_shard_archive(torch::serialize::InputArchive& archive, const char* where) override;
  std::function<void()> load(OptimizerBase& optimizer, torch::serialize::InputArchive& amp_archive,
                             const std::vector<at::Tensor>& full_masters, const char* where) override;
  void held(std::vector<at::Tensor>& params, std::vector<at::Tensor>& masters, std::vector<at::Tensor>& master_grads,
            std::vector<at::Tensor>& grads) const override;
  void with_full_state(OptimizerBase& optimizer, const std::function<void()>& fn) override;
  void with_whole(OptimizerBase& optimizer, const std::function<void()>& fn) override;
  void adopt_loaded_state(OptimizerBase& optimizer) override {
    adopt_full_state(OptimizerAccess::torch_optimizer(optimizer), 0);
  }
  void check_groups(const torch::optim::Optimizer& opt) const override;
  void adopt_groups(OptimizerBase& optimizer) override {
    add_groups(optimizer);
    register_whole_scopes();
    OptimizerAccess::index(optimizer).masters().mark_sharded(weak_from_this());
  }
  void write_master(size_t i, const at::Tensor& value) override;
  std::vector<at::Tensor> gather_masters() override;
  void keep_aux(size_t i, const at::Tensor& aux, const at::Tensor& loaded_weight) override;
  std::vector<at::Tensor> gather_aux() override;
  const std::vector<at::Tensor>* consolidated_aux() const override { return full_aux_ ? &*full_aux_ : nullptr; }
  bool holds_weights() const override { return stage_ == 3; }
  void keep_weight(size_t i, const at::Tensor& weight) override;
  const std::vector<at::Tensor>* consolidated_weights() const override {
    return full_weights_ ? &*full_weights_ : nullptr;
  }

  // Stage 3 (NOTE [Stage 3 units]).
  int unit_of(const c10::StorageImpl* storage) const override {
    const auto it = unit_of_storage_.find(storage);
    return it == unit_of_storage_.end() ? -1 : it->second;
  }
  void gather(int unit, bool backward) override;
  void keep_for_backward(int unit) override {
    if (forward_records_grad_) kept_[static_cast<size_t>(unit)] = 1;
  }
  std::shared_ptr<void> forward() override;
  std::shared_ptr<void> gather_all() override;

 private:
  struct Run {
    int unit = -1;
    int64_t begin = 0, end = 0;  // in the group's flat run
  };
  struct UnitInFlight {
    std::vector<std::pair<size_t, c10::intrusive_ptr<c10d::Work>>> works;  // (lane, its all-gather)
    std::vector<std::vector<std::vector<at::Tensor>>> outputs;
  };
  void start_gather(int unit);
  void wait_gather(int unit, const UnitInFlight& flight);
  void finish_gather(int unit);
  void gather_every_unit();
  void release(int unit);
  void release_all();
  void end_forward();
 public:
  // Stage 3: what amp's collective readers call to make a sharded parameter whole (src/core/released_parameters.h).
  void register_whole_scopes();

 private:
  bool released(const ShardEntry& e) const { return stage_ == 3 && is_released(e.model); }
  void refresh(bool all);
  void follow_storages();
  std::vector<int64_t> layout() const;
  std::vector<ShardSpan> slice_spans(size_t g, int64_t r) const;
  void record_versions();
  void settle(const amp::detail::InvScale& inv_scale, amp::detail::FoundInf* found_inf);
  void stash_unreduced();
  void reduce_unreduced(ShardLane& lane);
  void scatter_into(ShardLane& lane, at::Tensor input, c10::ScalarType dtype, const std::string& what);
  ScatterInFlight start_scatter(at::Tensor input, bool during_backward = false);
  void finish_scatter(ShardLane& lane, ScatterInFlight& flight, c10::ScalarType dtype, const std::string& what);
  at::Tensor lane_input(const ShardLane& lane, const std::function<bool(const ShardEntry&)>& used) const;
  c10::ScalarType lane_output_dtype(const ShardLane& lane) const;
  void index_lanes();
  void gather_into_model();
  void index_lean();
  bool lean_stale() const;
  std::vector<at::Tensor> gather_lean(c10::ScalarType dtype, const std::function<at::Tensor(const ShardPiece&)>& part,
                                      const std::string& what);
  void add_groups(OptimizerBase& optimizer);
  void adopt_full_state(torch::optim::Optimizer& opt, size_t first_piece);
  double sum_over_ranks(double value);
  void sum_per_tensor(std::vector<double>& per_piece);
  at::Tensor full_grad(const ShardEntry& e) const { return e.mastered ? e.stepped.grad() : e.model.grad(); }

  std::shared_ptr<DistributedCore> core_;
  const GroupState& state_;
  int stage_;
  int64_t bucket_bytes_;
  bool fast_path_;  // O0/O3 without a loss scale: scale_loss never unscales
  AverageSettings average_;
  std::vector<std::vector<ShardEntry>> groups_;
  std::vector<int64_t> group_numel_;
  std::shared_ptr<amp::detail::StateFormat> format_;  // the optimizer's state format
  int64_t slice_multiple_ = 1;  // the state format's (NOTE [ZeRO layout])
  bool whole_tensors_ = false;  // slices end between tensors (FusedMuon: NOTE [ZeRO layout])
  int64_t whole_numel_ = 0;     // every stepped tensor's values, the state format's numbering
  std::unordered_map<const c10::TensorImpl*, amp::detail::StateFormat::Place> piece_places_;  // by piece value
  std::vector<ShardPiece> pieces_;
  std::vector<ShardLane> lanes_;
  std::vector<std::vector<char>> used_;  // stage 2: [group][entry] has a reduced gradient in its lane's incoming
  // Stage 2, NOTE [fp32 accumulation under no_sync]: [group][entry] this rank's fp32 sum of the still-scaled
  // gradients of no_sync() micro-batches (masters' parameters), reduce-scattered when the window closes.
  std::vector<std::vector<at::Tensor>> unreduced_;
  std::optional<ShardStateMap> full_state_;  // while gathered (save_consolidated, with_full_state): the whole state
  std::vector<at::Tensor> full_masters_;
  std::shared_ptr<amp::detail::LeanMasters> lean_;         // the optimizer's lean masters (null: none)
  std::shared_ptr<amp::detail::LeanMasters> lean_pieces_;  // this rank's pieces of them, in lean_'s numbering
  std::optional<std::vector<at::Tensor>> full_aux_;        // while gathered (save_consolidated): the whole aux
  std::optional<std::vector<at::Tensor>> full_weights_;    // the same, stage 3: the whole lean weights
  // NOTE [Overlapped reduce-scatter]: this synchronized backward's lanes, started as their gradients came in.
  bool overlap_ = false;
  std::unordered_map<const c10::TensorImpl*, std::vector<size_t>> lanes_of_;  // by model parameter
  size_t lanes_indexed_ = 0;  // lanes_.size() when lanes_of_ was built
  std::vector<int64_t> waiting_;  // per lane: its parameters without a gradient yet
  std::vector<bool> never_ready_;  // per lane: it holds frozen parameters only
  std::vector<std::optional<ScatterInFlight>> in_flight_;
  size_t started_ = 0;  // lanes started, the last first
  // Stage 3 (NOTE [Stage 3 units]).
  std::vector<std::vector<Run>> runs_;                                // per group, by unit
  std::vector<ZeroUnit> units_;                                       // as resolved at shard_optimizer
  std::unordered_map<const c10::TensorImpl*, int> unit_of_param_;     // every model parameter's unit
  std::unordered_map<const c10::StorageImpl*, int> unit_of_storage_;  // the sharded ones', by storage
  std::vector<std::vector<size_t>> unit_lanes_;
  std::vector<char> unit_whole_;
  std::vector<std::optional<UnitInFlight>> unit_in_flight_;
  int prefetch_ = 1;
  int whole_guards_ = 0;                  // GatheredParametersGuards alive
  bool forward_records_grad_ = false;     // the forward in flight records gradients
  std::vector<char> kept_;                // units whole until backward ends (keep_for_backward)
  std::vector<int> order_[2], this_order_[2];  // units in the order the last forward [0] / backward [1] gathered them

 public:
  void on_grad_ready(size_t i);  // core_->params()[i]'s gradient is in
};

Zero::Zero(std::shared_ptr<DistributedCore> core, OptimizerBase& optimizer, const ZeroOptions& options)
    : core_(std::move(core)),
      state_(state_of(core_->group())),
      stage_(options.stage()),
      bucket_bytes_(std::max<int64_t>(1, static_cast<int64_t>(options.bucket_cap_mb() * 1024 * 1024))),
      fast_path_(OptimizerAccess::unscaled_fast_path(optimizer)) {
  overlap_ = options.overlap() && options.stage() >= 2;
  average_.always_fp32 = core_->options().allreduce_always_fp32();
  average_.predivide = core_->options().gradient_predivide_factor();
  format_ = OptimizerAccess::index(optimizer).state_format();
  if (format_) slice_multiple_ = format_->slice_alignment();
  const amp::detail::OptimizerKind* kind = amp::detail::kind_of(OptimizerAccess::torch_optimizer(optimizer));
  whole_tensors_ = kind != nullptr && kind->shards_whole_tensors;
  if (stage_ == 3) {
    amp::detail::count_stage3_shardings(1);
    prefetch_ = options.prefetch();
    units_ = resolve_units(*core_->module(), options.units(), kShard);
    for (size_t u = 0; u < units_.size(); ++u) {
      for (const auto& param : units_[u].params) unit_of_param_.emplace(param.unsafeGetTensorImpl(), static_cast<int>(u));
    }
    unit_lanes_.resize(units_.size());
    unit_whole_.assign(units_.size(), 1);
    unit_in_flight_.resize(units_.size());
    kept_.assign(units_.size(), 0);
  }
  add_groups(optimizer);
}

// Lays out the param groups this object does not hold yet (all of them at shard_optimizer; later, the groups
// add_param_group appended): their entries, this rank's pieces with any state the whole tensors had, every rank's
// lanes; then the fp32 masters give their memory back.
void Zero::add_groups(OptimizerBase& optimizer) {
  torch::optim::Optimizer& opt = OptimizerAccess::torch_optimizer(optimizer);
  amp::detail::ParamIndex& index = OptimizerAccess::index(optimizer);
  amp::detail::MasterWeights& masters = index.masters();
  std::unordered_map<const c10::TensorImpl*, size_t> master_of;
  for (size_t i = 0; i < masters.size(); ++i) master_of.emplace(masters.master()[i].unsafeGetTensorImpl(), i);
  const auto names = index.names();
  std::unordered_set<const c10::TensorImpl*> trained;
  for (const auto& p : core_->params()) trained.insert(p.unsafeGetTensorImpl());
  const size_t first = groups_.size();
  const auto& param_groups = opt.param_groups();
  for (size_t g = first; g < param_groups.size(); ++g) {
    std::vector<ShardEntry> entries;
    int64_t total = 0;
    for (const auto& t : param_groups[g].params()) {
      ShardEntry e;
      e.stepped = t;
      const auto m = master_of.find(t.unsafeGetTensorImpl());
      e.mastered = m != master_of.end();
      e.master_index = e.mastered ? m->second : 0;
      e.model = e.mastered ? masters.model()[m->second] : t;
      if (!e.mastered) {
        const auto lean = amp::detail::find_lean(t);
        e.lean = lean && lean->first == index.lean();
      }
      const auto n = names.find(t.unsafeGetTensorImpl());
      e.name = n == names.end() ? "<unnamed>" : n->second;
      TORCH_CHECK(!e.model.requires_grad() || trained.count(e.model.unsafeGetTensorImpl()), kShard, ": the optimizer "
                  "trains parameter '", e.name, "', which the DistributedDataParallel's model does not reduce. Shard the "
                  "optimizer of the model you passed to make_distributed.");
      TORCH_CHECK(e.model.is_contiguous() && t.is_contiguous(), kShard, ": parameter '", e.name, "' is not contiguous, "
                  "so its slices can't be views of it. Make it contiguous before amp::initialize.");
      if (stage_ == 3) {  // NOTE [Stage 3 units]: each sharded parameter owns its storage, which is freed
        const auto unit = unit_of_param_.find(e.model.unsafeGetTensorImpl());
        TORCH_CHECK(unit != unit_of_param_.end(), kShard, ": the optimizer trains '", e.name, "', which is no parameter "
                    "of the DistributedDataParallel's model, so stage 3 can't gather it with a unit. Shard the optimizer "
                    "of the model you passed to make_distributed.");
        e.unit = unit->second;
        e.storage_bytes = e.model.storage().nbytes();
        TORCH_CHECK(e.model.storage_offset() == 0 && e.storage_bytes == static_cast<size_t>(e.model.numel()) * e.model.element_size(),
                    kShard, ": parameter '", e.name, "' shares its storage with other tensors (a view of a larger "
                    "buffer), so stage 3 can't free it alone. Give each parameter its own storage, or use stage 2.");
        TORCH_CHECK(!unit_of_storage_.count(e.model.storage().unsafeGetStorageImpl()), kShard, ": parameter '", e.name,
                    "' shares its storage with another parameter, so stage 3 can't free it alone. Give each parameter "
                    "its own storage, or use stage 2.");
        unit_of_storage_.emplace(e.model.storage().unsafeGetStorageImpl(), e.unit);
      }
      e.numel = t.numel();
      e.whole_offset = whole_numel_;
      whole_numel_ += e.numel;
      entries.push_back(std::move(e));
    }
    // NOTE [ZeRO layout]: one run for the group, or at stage 3 one per unit, each starting on a slice multiple.
    std::vector<int> run_units{-1};
    if (stage_ == 3) {
      run_units.clear();
      for (int u = 0; u < static_cast<int>(units_.size()); ++u) {
        if (std::any_of(entries.begin(), entries.end(), [u](const ShardEntry& e) { return e.unit == u; })) run_units.push_back(u);
      }
    }
    std::vector<Run> runs;
    for (int u : run_units) {
      total = (total + slice_multiple_ - 1) / slice_multiple_ * slice_multiple_;
      Run run{u, total, total};
      for (auto& e : entries) {
        if (e.unit != u) continue;
        const int64_t align = format_ ? format_->alignment(e.numel) : 1;  // a tensor's 8-bit blocks stay whole
        total = (total + align - 1) / align * align;
        e.offset = total;
        total += e.numel;
      }
      run.end = total;
      runs.push_back(run);
    }
    groups_.push_back(std::move(entries));
    group_numel_.push_back(total);
    runs_.push_back(std::move(runs));
  }
  // This rank's pieces, the lanes every rank's pieces travel in.
  const int64_t n_ranks = state_.world_size;
  const size_t first_piece = pieces_.size();
  for (size_t g = first; g < groups_.size(); ++g) {
    std::vector<std::pair<int, c10::ScalarType>> dtypes;  // a lane's unit (stage 3) and dtype
    for (const auto& run : runs_[g]) {
      for (const auto& e : groups_[g]) {
        const std::pair<int, c10::ScalarType> key{e.unit, e.model.scalar_type()};
        if (e.unit == run.unit && std::find(dtypes.begin(), dtypes.end(), key) == dtypes.end()) dtypes.push_back(key);
      }
    }
    std::vector<ShardLane> lanes(dtypes.size());
    for (size_t d = 0; d < dtypes.size(); ++d) {
      lanes[d].group = g;
      lanes[d].unit = dtypes[d].first;
      lanes[d].dtype = dtypes[d].second;
      lanes[d].spans.resize(static_cast<size_t>(n_ranks));
    }
    for (int64_t r = 0; r < n_ranks; ++r) {
      for (ShardSpan span : slice_spans(g, r)) {
        const size_t i = span.entry;
        const ShardEntry& e = groups_[g][i];
        const std::pair<int, c10::ScalarType> key{e.unit, e.model.scalar_type()};
        const size_t d = static_cast<size_t>(std::find(dtypes.begin(), dtypes.end(), key) - dtypes.begin());
        for (const auto& s : lanes[d].spans[static_cast<size_t>(r)]) span.pos += s.length;
        if (r == state_.rank) {
          c10::NoGradGuard no_grad;
          ShardPiece p;
          p.group = g;
          p.entry = i;
          p.begin = span.begin;
          p.length = span.length;
          // (stage 3: a lean piece holds its values, as the weight it follows has none between uses)
          p.value = e.lean && stage_ != 3 ? alias_of(e.model, p.begin, p.length)
                                          : e.stepped.detach().reshape({-1}).narrow(0, p.begin, p.length).clone();
          span.piece = static_cast<int>(pieces_.size());
          piece_places_.emplace(p.value.unsafeGetTensorImpl(),
                                amp::detail::StateFormat::Place{e.whole_offset + p.begin, e.numel});
          pieces_.push_back(std::move(p));
        }
        lanes[d].mastered = lanes[d].mastered || e.mastered;
        lanes[d].spans[static_cast<size_t>(r)].push_back(span);
      }
    }
    for (auto& lane : lanes) {
      for (const auto& spans : lane.spans) {
        int64_t n = 0;
        for (const auto& s : spans) n += s.length;
        lane.width = std::max(lane.width, n);
      }
      if (lane.unit >= 0) unit_lanes_[static_cast<size_t>(lane.unit)].push_back(lanes_.size());
      lanes_.push_back(std::move(lane));
    }
    used_.emplace_back(groups_[g].size(), 0);
    unreduced_.emplace_back(groups_[g].size());
  }
  adopt_full_state(opt, first_piece);  // a checkpoint torch::load-ed before sharding; state of an added group's tensors
  // The full masters give their memory back: a placeholder of their shape that refuses writes.
  for (size_t g = first; g < groups_.size(); ++g) {
    for (auto& e : groups_[g]) {
      if (!e.mastered) continue;
      e.stepped.set_data(at::zeros({}, e.stepped.options()).expand(e.stepped.sizes()));
    }
  }
  index_lean();
  record_versions();
  // Stage 3: the pieces hold every value now; the parameters give their memory back until a unit is gathered.
  for (size_t g = first; g < groups_.size() && stage_ == 3; ++g) {
    for (const auto& e : groups_[g]) {
      if (!is_released(e.model)) release_storage(e.model);
      unit_whole_[static_cast<size_t>(e.unit)] = 0;
    }
  }
}

bool Zero::lean_stale() const {
  for (const auto& entries : groups_) {
    for (const auto& e : entries) {
      if (!e.lean) continue;
      const auto found = amp::detail::find_lean(e.model);
      if (!found || found->first != lean_ || found->second != e.lean_index) return true;
    }
  }
  return false;
}

// Finds the lean entries in the optimizer's table (rebuilt when param groups change) and makes this rank's table of
// their pieces, which a sharded step steps in place of the whole table; the pieces keep their aux across rebuilds,
// and the whole table gives its aux up.
void Zero::index_lean() {
  std::shared_ptr<amp::detail::LeanMasters> table;
  for (auto& entries : groups_) {
    for (auto& e : entries) {
      if (!e.lean) continue;
      const auto found = amp::detail::find_lean(e.model);
      TORCH_INTERNAL_ASSERT(found && (!table || found->first == table), "amp: a sharded lean master left its table");
      table = found->first;
      e.lean_index = found->second;
    }
  }
  const std::shared_ptr<amp::detail::LeanMasters> replaced = std::move(lean_pieces_);
  std::unordered_map<const c10::TensorImpl*, at::Tensor> kept;  // the previous table's aux, by piece
  for (const auto& p : pieces_) {
    if (replaced && p.lean_slot >= 0) kept.emplace(p.value.unsafeGetTensorImpl(), replaced->aux(static_cast<size_t>(p.lean_slot)));
  }
  lean_ = table;
  if (!table) return;
  lean_pieces_ = std::make_shared<amp::detail::LeanMasters>(table->format(), table->seed(), table->counter());
  for (auto& p : pieces_) {
    const ShardEntry& e = groups_[p.group][p.entry];
    if (!e.lean) continue;
    const auto it = kept.find(p.value.unsafeGetTensorImpl());
    at::Tensor aux = it != kept.end() ? it->second : table->aux(e.lean_index);
    if (it == kept.end() && aux.defined()) aux = aux.reshape({-1}).narrow(0, p.begin, p.length).clone();
    p.lean_slot = static_cast<int>(lean_pieces_->size());
    lean_pieces_->add_slice(*table, e.lean_index, p.value, p.begin, std::move(aux));
  }
  amp::detail::register_lean(lean_pieces_, replaced.get());
  if (!weak_from_this().expired()) table->mark_sharded(weak_from_this());  // (shard() marks a new Zero's)
}

// What may change in the optimizer under a sharding: groups appended (adopted by add_groups) and any group's options
// (lr schedules: the step reads them where they are). Refused, before anything changes: a held group's tensors
// replaced, added or removed, or a group removed, since every rank's slices, lanes and state were cut from them.
void Zero::check_groups(const torch::optim::Optimizer& opt) const {
  const auto& param_groups = opt.param_groups();
  TORCH_CHECK(param_groups.size() >= groups_.size(), kShard, ": the optimizer had ", groups_.size(), " param groups "
              "when it was sharded and now has ", param_groups.size(), ". A sharded optimizer's groups can't be removed: "
              "every rank's slices of them are laid out. Leave the group in place (set its lr to 0 to stop it), or shard "
              "a new optimizer.");
  for (size_t g = 0; g < groups_.size(); ++g) {
    const auto& params = param_groups[g].params();
    bool same = params.size() == groups_[g].size();
    for (size_t i = 0; same && i < params.size(); ++i) {
      same = params[i].unsafeGetTensorImpl() == groups_[g][i].stepped.unsafeGetTensorImpl();
    }
    TORCH_CHECK(same, kShard, ": param group ", g, " held ", groups_[g].size(), " tensors when it was laid out and now "
                "holds ", params.size(), (params.size() == groups_[g].size() ? " others" : ""), ". A sharded group's "
                "tensors can't be replaced, added or removed: every rank's slices of them are laid out. Add new "
                "parameters as a new group (optimizer.add_param_group: it is sharded from its first step).");
  }
}

// NOTE [ZeRO layout]: the parts of group g's tensors inside rank r's slice of each run, in group order (pos left 0).
std::vector<ShardSpan> Zero::slice_spans(size_t g, int64_t r) const {
  std::vector<ShardSpan> out;
  for (const Run& run : runs_[g]) {
    const int64_t total = run.end - run.begin;
    int64_t lo = 0, hi = 0;  // relative to the run
    if (whole_tensors_) {
      // Whole tensors: rank r's slice ends at the tensor end nearest r + 1 equal shares (never before the last rank's).
      auto boundary = [&](int64_t rank) {
        if (rank <= 0) return int64_t{0};
        if (rank >= state_.world_size) return total;
        const double target = static_cast<double>(total) * static_cast<double>(rank) / static_cast<double>(state_.world_size);
        int64_t best = 0;
        for (const ShardEntry& e : groups_[g]) {
          if (e.unit != run.unit) continue;
          const int64_t end = e.offset + e.numel - run.begin;
          if (std::abs(static_cast<double>(end) - target) < std::abs(static_cast<double>(best) - target)) best = end;
        }
        return best;
      };
      int64_t previous = 0;
      for (int64_t k = 1; k <= r; ++k) previous = std::max(previous, boundary(k));
      lo = previous;
      hi = std::max(lo, boundary(r + 1));
    } else {
      const int64_t slice = ((total + state_.world_size - 1) / state_.world_size + slice_multiple_ - 1) / slice_multiple_ *
                            slice_multiple_;
      lo = std::min(total, r * slice);
      hi = std::min(total, lo + slice);
    }
    lo += run.begin;
    hi += run.begin;
    for (size_t i = 0; i < groups_[g].size(); ++i) {
      const ShardEntry& e = groups_[g][i];
      if (e.unit != run.unit) continue;
      const int64_t a = std::max(e.offset, lo), b = std::min(e.offset + e.numel, hi);
      if (a < b) out.push_back(ShardSpan{i, a - e.offset, b - a, 0, -1});
    }
  }
  return out;
}

std::vector<int64_t> Zero::layout() const {
  std::vector<int64_t> out;
  for (size_t g = 0; g < groups_.size(); ++g) {
    out.push_back(static_cast<int64_t>(groups_[g].size()));
    out.push_back(group_numel_[g]);
    for (size_t k = 0; stage_ == 3 && k < runs_[g].size(); ++k) out.push_back(runs_[g][k].end);  // by unit
  }
  return out;
}

void Zero::record_versions() {
  for (auto& entries : groups_) {
    for (auto& e : entries) {
      e.version = e.model._version();
      e.storage = e.model.storage().unsafeGetStorageImpl();
    }
  }
}

// The state of pieces [first_piece, end) from whole tensors' state (keyed by the stepped tensors), which then leaves
// the map.
void Zero::adopt_full_state(torch::optim::Optimizer& opt, size_t first_piece) {
  auto& state = opt.state();
  for (size_t k = first_piece; k < pieces_.size(); ++k) {
    const ShardPiece& p = pieces_[k];
    const ShardEntry& e = groups_[p.group][p.entry];
    const auto it = state.find(amp::detail::state_key(state, e.stepped));
    if (it == state.end() || !it->second) continue;
    state[amp::detail::state_key(state, p.value)] = slice_piece_state(*it->second, p.begin, p.length);
  }
  for (const auto& entries : groups_) {
    for (const auto& e : entries) state.erase(amp::detail::state_key(state, e.stepped));
  }
}

void Zero::refresh(bool all) {
  c10::NoGradGuard no_grad;
  if (stage_ == 3) follow_storages();
  if (lean_) lean_->refresh_changed();  // (its aux are the slices': this checks the weights are usable)
  for (const auto& entries : groups_) {  // every rank alike, pieces here or not
    for (const auto& e : entries) {
      if (!e.lean || e.model.storage().unsafeGetStorageImpl() == e.storage) continue;
      TORCH_CHECK(e.model.is_contiguous() && e.model.numel() == e.numel, kShard, ": parameter '", e.name, "' is ",
                  e.model.numel() == e.numel ? "not contiguous" : "of another size", " since something replaced its "
                  "data, so its slices can't alias it. Write weights in place (amp::load_weights, or copy_ under "
                  "torch::NoGradGuard).");
    }
  }
  for (auto& p : pieces_) {
    ShardEntry& e = groups_[p.group][p.entry];
    if (released(e)) continue;  // stage 3: nothing can have written it
    const bool changed = e.model._version() != e.version || e.model.storage().unsafeGetStorageImpl() != e.storage;
    if (!all && !changed) continue;
    if (e.lean) {  // the piece sees the write (an alias of the weight; stage 3: a copy), its aux follows it
      if (!changed) continue;
      if (stage_ == 3) {
        p.value.copy_(e.model.detach().reshape({-1}).narrow(0, p.begin, p.length));
      } else if (e.model.storage().unsafeGetStorageImpl() != e.storage) {
        p.value.set_(e.model.storage(), e.model.storage_offset() + p.begin, {p.length}, {1});
      }
      lean_pieces_->follow_write(static_cast<size_t>(p.lean_slot));
      continue;
    }
    const at::Tensor written = e.model.detach().reshape({-1}).narrow(0, p.begin, p.length);
    // NOTE [Masters follow the model]: a master keeps the low bits the model's rounding can't see.
    if (e.mastered) amp::detail::keep_where_rounded_equal(p.value, written);
    else p.value.copy_(written);
  }
  record_versions();
}

// Stage 3: a parameter whose data something replaced while it was whole (set_data under a GatheredParametersGuard, as
// loaders that swap loaded tensors in do) is gathered into and freed from its new storage from now on, which must
// hold exactly its elements, as at shard_optimizer.
void Zero::follow_storages() {
  bool moved = false;
  for (auto& entries : groups_) {
    for (auto& e : entries) {
      const c10::StorageImpl* now = e.model.storage().unsafeGetStorageImpl();
      if (now == e.storage) continue;
      moved = true;
      const size_t bytes = static_cast<size_t>(e.model.numel()) * e.model.element_size();
      TORCH_CHECK(e.model.is_contiguous() && e.model.storage_offset() == 0 && e.model.storage().nbytes() == bytes &&
                      e.model.numel() == e.numel,
                  "amp::parallel (ZeRO stage 3): parameter '", e.name, "' now holds ", e.model.storage().nbytes(),
                  " bytes at offset ", e.model.storage_offset(), " for ", bytes, " bytes of values (something replaced "
                  "its data: a checkpoint of another dtype or shape, or a view), so stage 3 can't free it alone. Write "
                  "weights in place instead: amp::load_weights, or copy_ under GatheredParametersGuard.");
      unit_of_storage_.erase(static_cast<const c10::StorageImpl*>(e.storage));
      unit_of_storage_.emplace(now, e.unit);
      e.storage_bytes = bytes;
    }
  }
  if (moved) register_whole_scopes();
}

void Zero::gather_into_model() {
  c10::NoGradGuard no_grad;
  for (const auto& lane : lanes_) {
    if (lane.width == 0) continue;
    const std::vector<ShardEntry>& entries = groups_[lane.group];
    at::Tensor send = at::zeros({lane.width}, entries.front().model.options().dtype(lane.dtype));
    for (const auto& s : lane.spans[static_cast<size_t>(state_.rank)]) {
      send.narrow(0, s.pos, s.length).copy_(pieces_[static_cast<size_t>(s.piece)].value);  // rounded as the fused copy
    }
    const at::Tensor recv = shard_all_gather_bytes(state_, send.view(at::kByte), bucket_bytes_,
                                             std::string(kShard) + " (all-gathering the updated parameters)")
                                .view(lane.dtype);
    core_->count_zero_bytes(0, recv.numel() * static_cast<int64_t>(send.element_size()));
    for (size_t r = 0; r < lane.spans.size(); ++r) {
      for (const auto& s : lane.spans[r]) {
        entries[s.entry].model.detach().view({-1}).narrow(0, s.begin, s.length)
            .copy_(recv.narrow(0, static_cast<int64_t>(r) * lane.width + s.pos, s.length));
      }
    }
  }
  record_versions();
  for (const auto& entries : groups_) {
    for (const auto& e : entries) {
      if (e.lean) lean_->mark_synced(e.lean_index);  // the weight is its pieces' again, the aux still completes it
    }
  }
}

void Zero::after_step() {
  if (stage_ != 3) return gather_into_model();
  if (whole_guards_ == 0) return release_all();  // the next forward gathers the updated values unit by unit
  for (size_t u = 0; u < units_.size(); ++u) {     // a step under GatheredParametersGuard: whole, and updated
    unit_whole_[u] = 0;
    finish_gather(static_cast<int>(u));
  }
  record_versions();
}

namespace {
// Runs `fn` when the last copy of the returned pointer dies (never throwing: a failed collective fails the next one).
std::shared_ptr<void> on_release(std::function<void()> fn) {
  struct Release {
    std::function<void()> fn;
    ~Release() {
      try {
        if (fn) fn();
      } catch (...) {
      }
    }
  };
  auto release = std::make_shared<Release>();
  release->fn = std::move(fn);
  return release;
}
}  // namespace

// NOTE [Stage 3 units] (zero_units.cpp). Every rank first agrees on the unit (8 bytes), so that ranks whose forwards
// took different branches fail here, naming the units, instead of exchanging the values of different units; then
// each lane of the unit is all-gathered in the model's dtype as bytes, in the background until finish_gather.
void Zero::start_gather(int unit) {
  const size_t u = static_cast<size_t>(unit);
  if (unit_whole_[u] || unit_in_flight_[u]) return;
  const int64_t n_ranks = state_.world_size;
  if (n_ranks > 1) {
    std::vector<at::Tensor> in{at::full({1}, static_cast<int64_t>(unit), at::TensorOptions().dtype(at::kLong))};
    std::vector<std::vector<at::Tensor>> out(1);
    for (int64_t r = 0; r < n_ranks; ++r) out[0].push_back(at::empty({1}, in[0].options()));
    wait(state_.group->allgather(out, in), state_, std::string(kShard) + " (stage 3: agreeing on the unit to gather)");
    for (int64_t r = 0; r < n_ranks; ++r) {
      const int64_t theirs = out[0][static_cast<size_t>(r)].item<int64_t>();
      TORCH_CHECK(theirs == unit, "amp::parallel (ZeRO stage 3): rank ", state_.rank, " gathers unit '", units_[u].name, "' while "
                  "rank ", r, " gathers unit '", theirs >= 0 && theirs < static_cast<int64_t>(units_.size())
                      ? units_[static_cast<size_t>(theirs)].name : std::string("?"),
                  "': their forwards (or backwards) read different units. At stage 3 every rank must run the same "
                  "modules in the same order (as FSDP's); route batches to different branches only at stage 1 or 2.");
    }
  }
  c10::NoGradGuard no_grad;
  UnitInFlight flight;
  for (size_t l : unit_lanes_[u]) {
    const ShardLane& lane = lanes_[l];
    if (lane.width == 0) continue;
    const std::vector<ShardEntry>& entries = groups_[lane.group];
    at::Tensor send = at::zeros({lane.width}, entries.front().model.options().dtype(lane.dtype));
    for (const auto& s : lane.spans[static_cast<size_t>(state_.rank)]) {
      send.narrow(0, s.pos, s.length).copy_(pieces_[static_cast<size_t>(s.piece)].value);  // rounded as the fused copy
    }
    std::vector<std::vector<at::Tensor>> out(1);
    c10::intrusive_ptr<c10d::Work> work;
    if (n_ranks == 1) {
      out[0].push_back(send.view(at::kByte));
    } else {
      std::vector<at::Tensor> in{send.view(at::kByte)};
      for (int64_t r = 0; r < n_ranks; ++r) out[0].push_back(at::empty({in[0].numel()}, in[0].options()));
      work = state_.group->allgather(out, in);
    }
    core_->count_zero_bytes(0, n_ranks * lane.width * static_cast<int64_t>(send.element_size()));
    flight.works.emplace_back(l, std::move(work));
    flight.outputs.push_back(std::move(out));
  }
  unit_in_flight_[u] = std::move(flight);
}

void Zero::wait_gather(int unit, const UnitInFlight& flight) {
  const std::string what = std::string(kShard) + " (stage 3: all-gathering unit '" + units_[static_cast<size_t>(unit)].name + "')";
  for (const auto& lane_work : flight.works) {
    if (lane_work.second) wait(lane_work.second, state_, what);
  }
}

void Zero::finish_gather(int unit) {
  const size_t u = static_cast<size_t>(unit);
  if (unit_whole_[u]) return;
  start_gather(unit);
  UnitInFlight flight = std::move(*unit_in_flight_[u]);
  unit_in_flight_[u].reset();
  wait_gather(unit, flight);
  c10::NoGradGuard no_grad;
  for (const auto& entries : groups_) {
    for (const auto& e : entries) {
      if (e.unit == unit && is_released(e.model)) materialize_storage(e.model, e.storage_bytes);
    }
  }
  for (size_t k = 0; k < flight.works.size(); ++k) {
    const ShardLane& lane = lanes_[flight.works[k].first];
    const std::vector<ShardEntry>& entries = groups_[lane.group];
    for (size_t r = 0; r < lane.spans.size(); ++r) {
      const at::Tensor recv = flight.outputs[k][0][r].view(lane.dtype);
      for (const auto& s : lane.spans[r]) {
        // variable_data: a write autograd does not count, since backward may read this parameter's saved alias
        entries[s.entry].model.variable_data().view({-1}).narrow(0, s.begin, s.length).copy_(recv.narrow(0, s.pos, s.length));
      }
    }
  }
  unit_whole_[u] = 1;
}

void Zero::gather_every_unit() {
  for (size_t u = 0; u < units_.size(); ++u) start_gather(static_cast<int>(u));  // all in flight, then each waited for
  for (size_t u = 0; u < units_.size(); ++u) finish_gather(static_cast<int>(u));
}

void Zero::gather(int unit, bool backward) {
  const size_t u = static_cast<size_t>(unit);
  if (unit_whole_[u]) return;
  std::vector<int>& order = this_order_[backward ? 1 : 0];
  order.push_back(unit);
  finish_gather(unit);
  // Prefetch: the units that followed this one in the last pass of the same kind, while this one computes.
  const std::vector<int>& last = order_[backward ? 1 : 0];
  const size_t at = order.size() - 1;
  if (at >= last.size() || last[at] != unit) return;
  for (size_t k = at + 1; k < last.size() && k <= at + static_cast<size_t>(prefetch_); ++k) start_gather(last[k]);
}

void Zero::release(int unit) {
  const size_t u = static_cast<size_t>(unit);
  if (auto& flight = unit_in_flight_[u]) {  // every rank started it: wait, and drop what it brought
    wait_gather(unit, *flight);
    flight.reset();
  }
  if (!unit_whole_[u]) return;
  for (const auto& entries : groups_) {
    for (const auto& e : entries) {
      if (e.unit == unit && !is_released(e.model)) release_storage(e.model);
    }
  }
  unit_whole_[u] = 0;
}

void Zero::release_all() {
  if (whole_guards_ > 0) return;
  for (size_t u = 0; u < units_.size(); ++u) release(static_cast<int>(u));
  std::fill(kept_.begin(), kept_.end(), 0);
}

std::shared_ptr<void> Zero::forward() {
  follow_storages();  // data replaced under a guard (which can't throw when it ends)
  release_all();      // what a no_sync() backward or an evaluation left whole
  if (!this_order_[1].empty()) order_[1] = std::move(this_order_[1]);
  this_order_[0].clear();
  this_order_[1].clear();
  forward_records_grad_ = c10::GradMode::is_enabled();
  std::weak_ptr<Zero> weak = weak_from_this();
  return gather_in_forward(shared_from_this(), [weak] {
    if (const auto zero = weak.lock()) zero->end_forward();
  });
}

void Zero::end_forward() {
  order_[0] = this_order_[0];
  if (whole_guards_ > 0) return;
  for (size_t u = 0; u < units_.size(); ++u) {
    if (!kept_[u]) release(static_cast<int>(u));
  }
}

void Zero::register_whole_scopes() {
  if (stage_ != 3) return;
  std::weak_ptr<Zero> weak = weak_from_this();
  const amp::detail::WholeScope scope = [weak]() -> std::shared_ptr<void> {
    const auto zero = weak.lock();
    return zero ? zero->gather_all() : nullptr;
  };
  for (const auto& entries : groups_) {
    for (const auto& e : entries) amp::detail::register_whole_scope(e.model.storage().unsafeGetStorageImpl(), {this, scope});
  }
}

std::shared_ptr<void> Zero::gather_all() {
  ++whole_guards_;
  try {
    gather_every_unit();
  } catch (...) {
    --whole_guards_;
    throw;
  }
  record_versions();
  std::weak_ptr<Zero> weak = weak_from_this();
  return on_release([weak] {
    const auto zero = weak.lock();
    if (!zero) return;
    --zero->whole_guards_;
    zero->refresh_changed();  // what was written meanwhile reaches the pieces
    zero->release_all();
  });
}

double Zero::sum_over_ranks(double value) {
  if (state_.world_size == 1) return value;
  std::vector<at::Tensor> tensors{at::full({1}, value, at::TensorOptions().dtype(at::kDouble))};
  wait(state_.group->allreduce(tensors), state_, std::string(kShard) + " (a norm over every rank's pieces)");
  return tensors[0].item<double>();
}

// Each piece's value becomes the sum over its whole tensor's pieces, every rank's.
void Zero::sum_per_tensor(std::vector<double>& per_piece) {
  TORCH_INTERNAL_ASSERT(per_piece.size() == pieces_.size(), "amp: a sharded step summed ", per_piece.size(),
                        " values for ", pieces_.size(), " pieces");
  std::vector<size_t> base(groups_.size(), 0);
  size_t total = 0;
  for (size_t g = 0; g < groups_.size(); ++g) {
    base[g] = total;
    total += groups_[g].size();
  }
  at::Tensor sums = at::zeros({static_cast<int64_t>(total)}, at::TensorOptions().dtype(at::kDouble));
  double* s = sums.data_ptr<double>();
  for (size_t k = 0; k < pieces_.size(); ++k) s[base[pieces_[k].group] + pieces_[k].entry] += per_piece[k];
  if (state_.world_size > 1) {
    std::vector<at::Tensor> tensors{sums};
    wait(state_.group->allreduce(tensors), state_, std::string(kShard) + " (per-tensor norms over every rank's pieces)");
    s = sums.data_ptr<double>();
  }
  for (size_t k = 0; k < pieces_.size(); ++k) per_piece[k] = s[base[pieces_[k].group] + pieces_[k].entry];
}

std::vector<bool> Zero::reduce(const std::vector<at::Tensor>& params, const std::vector<bool>& used_anywhere,
                               bool closes_window) {
  c10::NoGradGuard no_grad;
  std::unordered_map<const c10::TensorImpl*, size_t> where;
  for (size_t i = 0; i < params.size(); ++i) where.emplace(params[i].unsafeGetTensorImpl(), i);
  auto used = [&](const ShardEntry& e) {
    const auto it = where.find(e.model.unsafeGetTensorImpl());
    return it != where.end() && used_anywhere[it->second];
  };
  std::vector<std::optional<ScatterInFlight>> started = std::exchange(in_flight_, {});
  started_ = 0;
  waiting_.clear();
  for (size_t l = 0; l < lanes_.size(); ++l) {
    ShardLane& lane = lanes_[l];
    const std::vector<ShardEntry>& entries = groups_[lane.group];
    if (closes_window) reduce_unreduced(lane);  // first, as the unsharded unscale adds the last micro-batch to them
    const bool started_here = l < started.size() && started[l];
    if (started_here) {  // started during backward: every trainable parameter of it has a gradient
      finish_scatter(lane, *started[l], lane_output_dtype(lane), "reduce-scattering the gradients");
    } else {
      bool any = false;
      for (const auto& spans : lane.spans) {
        for (const auto& s : spans) any = any || used(entries[s.entry]);
      }
      if (!any) continue;  // the same on every rank: used_anywhere is agreed
      scatter_into(lane, lane_input(lane, used), lane_output_dtype(lane), "reduce-scattering the gradients");
    }
    for (const auto& s : lane.spans[static_cast<size_t>(state_.rank)]) {
      // Stage 3 dropped a started lane's gradients once they were on their way (on_grad_ready): its trainable
      // parameters all had one.
      const bool stage3_started = stage_ == 3 && started_here && entries[s.entry].model.requires_grad();
      if (stage3_started || used(entries[s.entry])) used_[lane.group][s.entry] = 1;
    }
  }
  std::vector<bool> handled(params.size(), false);
  for (const auto& entries : groups_) {
    for (const auto& e : entries) {
      const auto it = where.find(e.model.unsafeGetTensorImpl());
      if (it == where.end()) continue;
      handled[it->second] = true;
      e.model.mutable_grad() = at::Tensor();  // reduced into the slices: a rank keeps no full gradient
    }
  }
  if (stage_ == 3) release_all();  // what backward gathered
  return handled;
}

// Every rank's piece of `lane` from the model's gradients of the entries `used` says reached some rank, in the wire
// dtype (as DistributedCore's average), zeros elsewhere.
at::Tensor Zero::lane_input(const ShardLane& lane, const std::function<bool(const ShardEntry&)>& used) const {
  const std::vector<ShardEntry>& entries = groups_[lane.group];
  const c10::ScalarType wire = wire_dtype(lane.dtype, average_);
  at::Tensor input = at::zeros({state_.world_size * lane.width}, entries.front().model.options().dtype(wire));
  for (size_t r = 0; r < lane.spans.size(); ++r) {
    for (const auto& s : lane.spans[r]) {
      const at::Tensor& grad = entries[s.entry].model.grad();
      if (!grad.defined() || !used(entries[s.entry])) continue;
      input.narrow(0, static_cast<int64_t>(r) * lane.width + s.pos, s.length).copy_(grad.reshape({-1}).narrow(0, s.begin, s.length));
    }
  }
  return input;
}

// NOTE [fp32 reductions reach the masters] (distributed_data_parallel.cpp): fp32 sums of masters stay fp32.
c10::ScalarType Zero::lane_output_dtype(const ShardLane& lane) const {
  const bool to_masters = wire_dtype(lane.dtype, average_) == at::kFloat && average_.always_fp32 && lane.mastered;
  return to_masters ? at::kFloat : lane.dtype;
}

// NOTE [Overlapped reduce-scatter]
// At stage 2 with ZeroOptions::overlap, where every synchronized backward reaches every trainable parameter (the
// DistributedDataParallel's contract unless it was made with delay_allreduce), a lane starts its reduce-scatter as
// soon as the last gradient in it is accumulated (the accumulator's post hook, DistributedCore::add_ready_listener),
// while backward goes on: DeepSpeed's average_tensor, FSDP's post-backward reduce-scatter. Lanes start in one order
// on every rank, the last lane first (gradients arrive from the last layers), each only after the lanes behind it,
// so the ranks issue their collectives alike; frozen parameters are not waited for, and a lane of frozen parameters
// only (or one whose gradients are not all in) and every lane in front of it start after backward, as without
// overlap. zero_grad drops what a backward that failed midway left started. reduce() waits for them, in lane order
// after the window's no_sync() sums, as the sums come out the same in either order. The reduced values are those of
// the reduction after backward, bit for bit (the same inputs, chunks and collectives).
void Zero::index_lanes() {
  lanes_of_.clear();
  never_ready_.assign(lanes_.size(), true);
  for (size_t l = 0; l < lanes_.size(); ++l) {
    std::vector<const c10::TensorImpl*> seen;
    for (const auto& spans : lanes_[l].spans) {
      for (const auto& s : spans) {
        const at::Tensor& model = groups_[lanes_[l].group][s.entry].model;
        if (!model.requires_grad()) continue;  // frozen: no gradient to wait for
        if (std::find(seen.begin(), seen.end(), model.unsafeGetTensorImpl()) != seen.end()) continue;
        seen.push_back(model.unsafeGetTensorImpl());
        lanes_of_[model.unsafeGetTensorImpl()].push_back(l);
        never_ready_[l] = false;
      }
    }
  }
  lanes_indexed_ = lanes_.size();
}

void Zero::on_grad_ready(size_t i) {
  if (!overlap_) return;
  const at::Tensor& param = core_->params()[i];
  if (lanes_indexed_ != lanes_.size()) index_lanes();
  if (waiting_.size() != lanes_.size()) {  // the first gradient of this backward
    waiting_.assign(lanes_.size(), 0);
    for (const auto& [impl, lanes] : lanes_of_) {
      for (size_t l : lanes) ++waiting_[l];
    }
    for (size_t l = 0; l < lanes_.size(); ++l) waiting_[l] += never_ready_[l] ? 1 : 0;  // only frozen: reduced after
    in_flight_.assign(lanes_.size(), std::nullopt);
    started_ = 0;
  }
  const auto it = lanes_of_.find(param.unsafeGetTensorImpl());
  if (it == lanes_of_.end()) return;
  for (size_t l : it->second) --waiting_[l];
  c10::NoGradGuard no_grad;
  while (started_ < lanes_.size()) {
    const size_t l = lanes_.size() - 1 - started_;
    if (waiting_[l] > 0) break;
    in_flight_[l] = start_scatter(lane_input(lanes_[l], [](const ShardEntry&) { return true; }), /*during_backward=*/true);
    ++started_;
    if (stage_ == 3) {  // the lane's gradients are in the scatter's input: a rank keeps no full gradient
      for (const auto& spans : lanes_[l].spans) {
        for (const auto& s : spans) groups_[lanes_[l].group][s.entry].model.mutable_grad() = at::Tensor();
      }
    }
    // Stage 3: a unit whose gradients are all on their way is freed (a later backward that reads it gathers again).
    const int unit = lanes_[l].unit;
    if (unit < 0 || whole_guards_ > 0 || kept_[static_cast<size_t>(unit)]) continue;
    const auto& lanes = unit_lanes_[static_cast<size_t>(unit)];
    if (std::all_of(lanes.begin(), lanes.end(), [&](size_t k) { return k >= lanes_.size() - started_; })) release(unit);
  }
}

// NOTE [fp32 accumulation under no_sync] (src/parallel/distributed_data_parallel.cpp), at stage 2: a delay_unscale
// backward inside no_sync() leaves its masters' low-precision gradients in the model's .grad (nothing was reduced):
// they move into this rank's fp32 sums, as the unsharded unscale moves them beside the masters.
void Zero::stash_unreduced() {
  c10::NoGradGuard no_grad;
  for (size_t g = 0; g < groups_.size(); ++g) {
    for (size_t i = 0; i < groups_[g].size(); ++i) {
      const ShardEntry& e = groups_[g][i];
      at::Tensor& grad = e.model.mutable_grad();
      if (!e.mastered || !grad.defined()) continue;
      at::Tensor& sum = unreduced_[g][i];
      if (sum.defined()) sum.add_(grad);
      else sum = grad.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
      grad = at::Tensor();
    }
  }
}

// The window's fp32 sums of `lane`'s masters, reduce-scattered in fp32 (the unsharded run all-reduces them in fp32
// too), become the start of its incoming slice; every master of the lane then has a gradient, as unsharded.
void Zero::reduce_unreduced(ShardLane& lane) {
  std::vector<ShardEntry>& entries = groups_[lane.group];
  std::vector<at::Tensor>& sums = unreduced_[lane.group];
  bool mastered = false;
  for (const auto& spans : lane.spans) {
    for (const auto& s : spans) mastered = mastered || entries[s.entry].mastered;
  }
  if (!mastered) return;  // the same on every rank: the layout is
  const int64_t n_ranks = state_.world_size;
  at::Tensor input = at::zeros({n_ranks * lane.width}, entries.front().model.options().dtype(at::kFloat));
  for (size_t r = 0; r < lane.spans.size(); ++r) {
    for (const auto& s : lane.spans[r]) {
      const at::Tensor& sum = sums[s.entry];
      if (!entries[s.entry].mastered || !sum.defined()) continue;
      input.narrow(0, static_cast<int64_t>(r) * lane.width + s.pos, s.length).copy_(sum.reshape({-1}).narrow(0, s.begin, s.length));
    }
  }
  scatter_into(lane, input, at::kFloat, "reduce-scattering the no_sync() gradient sums");
  for (const auto& s : lane.spans[static_cast<size_t>(state_.rank)]) {
    if (entries[s.entry].mastered) used_[lane.group][s.entry] = 1;
  }
  for (const auto& spans : lane.spans) {
    for (const auto& s : spans) sums[s.entry] = at::Tensor();
  }
}

// `input` holds every rank's piece of the lane; averaged as DistributedCore's average (predivide, sum in the input's
// dtype, divide by world_size / predivide), this rank's slice, in `dtype`, starts the lane's incoming gradient or, after
// a second backward before the unscale (delay_unscale, several losses), is added to it in fp32, as amp's pending sums.
void Zero::scatter_into(ShardLane& lane, at::Tensor input, c10::ScalarType dtype, const std::string& what) {
  ScatterInFlight flight = start_scatter(std::move(input));
  finish_scatter(lane, flight, dtype, what);
}

ScatterInFlight Zero::start_scatter(at::Tensor input, bool during_backward) {
  if (average_.predivide != 1.0) input.div_(average_.predivide);
  core_->count_zero_bytes(input.numel() * static_cast<int64_t>(input.element_size()), 0, during_backward);
  return start_reduce_scatter(state_, input, input.numel() / state_.world_size, bucket_bytes_);
}

void Zero::finish_scatter(ShardLane& lane, ScatterInFlight& flight, c10::ScalarType dtype, const std::string& what) {
  at::Tensor mine = finish_reduce_scatter(state_, flight, std::string(kShard) + " (" + what + ")");
  const double post = static_cast<double>(state_.world_size) / average_.predivide;
  if (post != 1.0) mine.div_(post);
  if (mine.scalar_type() != dtype) mine = mine.to(dtype);
  if (!lane.incoming.defined()) {
    lane.incoming = mine;
    return;
  }
  if (lane.incoming.scalar_type() != at::kFloat) lane.incoming = lane.incoming.to(at::kFloat);
  lane.incoming.add_(mine);
}

// Moves the reduced slices into the pieces' gradients, unscaled (found_inf: checked), adding to what they hold.
void Zero::settle(const amp::detail::InvScale& inv_scale, amp::detail::FoundInf* found_inf) {
  std::vector<at::Tensor> fresh_in, fresh_out, acc_in, acc_out;
  for (const auto& lane : lanes_) {
    if (!lane.incoming.defined()) continue;
    for (const auto& s : lane.spans[static_cast<size_t>(state_.rank)]) {
      if (!used_[lane.group][s.entry]) continue;
      ShardPiece& p = pieces_[static_cast<size_t>(s.piece)];
      const at::Tensor in = lane.incoming.narrow(0, s.pos, s.length);
      if (p.grad.defined()) {
        acc_in.push_back(in);
        acc_out.push_back(p.grad);
      } else {
        p.grad = at::empty({s.length}, p.value.options());
        fresh_in.push_back(in);
        fresh_out.push_back(p.grad);
      }
    }
  }
  amp::detail::FoundInf unchecked;
  amp::detail::FoundInf& found = found_inf ? *found_inf : unchecked;
  amp::detail::unscale_into(fresh_in, fresh_out, /*accumulate=*/false, inv_scale, found);
  amp::detail::unscale_into(acc_in, acc_out, /*accumulate=*/true, inv_scale, found);
  for (auto& lane : lanes_) lane.incoming = at::Tensor();
  for (auto& flags : used_) std::fill(flags.begin(), flags.end(), 0);
}

void Zero::unscale(bool delay_unscale, const amp::detail::InvScale& inv_scale, amp::detail::FoundInf& found_inf) {
  if (delay_unscale) {  // the slices stay scaled in the lanes; the next reduce adds to them
    stash_unreduced();  // what no_sync() left unreduced in the model's .grad
    return;
  }
  settle(inv_scale, &found_inf);
  // Each rank checked its own slices: the overflow decision is every rank's together.
  const c10::Device device = groups_.empty() || groups_.front().empty() ? c10::Device(at::kCPU)
                                                                          : groups_.front().front().model.device();
  at::Tensor& flag = found_inf.on(device);
  if (state_.world_size > 1) {
    std::vector<at::Tensor> tensors{flag};
    c10d::AllreduceOptions max;
    max.reduceOp = c10d::ReduceOp::MAX;
    wait(state_.group->allreduce(tensors, max), state_, std::string(kShard) + " (agreeing on a gradient overflow)");
  }
}

void Zero::zero_grad(bool set_to_none) {
  in_flight_.clear();  // (the backend finishes what was started; every rank started the same)
  waiting_.clear();
  started_ = 0;
  for (auto& p : pieces_) {
    if (!p.grad.defined()) continue;
    if (set_to_none) p.grad = at::Tensor();
    else p.grad.zero_();
  }
  for (auto& lane : lanes_) lane.incoming = at::Tensor();
  for (auto& flags : used_) std::fill(flags.begin(), flags.end(), 0);
  for (auto& sums : unreduced_) std::fill(sums.begin(), sums.end(), at::Tensor());
}

std::vector<at::Tensor> Zero::grads() {
  std::vector<at::Tensor> out;
  if (stage_ == 1) {
    for (const auto& entries : groups_) {
      for (const auto& e : entries) {
        if (full_grad(e).defined()) out.push_back(full_grad(e));
      }
    }
    return out;
  }
  bool pending = false;
  for (const auto& lane : lanes_) pending = pending || lane.incoming.defined();
  if (pending) {
    TORCH_CHECK(fast_path_, kShard, ": a backward's reduced gradients were never unscaled: run the backward through "
                "amp::scale_loss (stage 2 unscales the slices there).");
    settle(1.0, nullptr);
  }
  for (const auto& p : pieces_) {
    if (p.grad.defined()) out.push_back(p.grad);
  }
  return out;
}

at::Tensor Zero::global_norm(const std::vector<at::Tensor>& grads, double norm_type) {
  if (stage_ == 1) return amp::detail::total_norm(grads, norm_type);  // every rank holds the whole gradients
  // Stage 2: each rank's slices, in double, summed (or maxed) over the ranks, rounded once.
  const bool inf = std::isinf(norm_type);
  at::Tensor local = at::zeros({1}, at::TensorOptions().dtype(at::kDouble));
  for (const auto& g : grads) {
    const at::Tensor a = g.detach().to(at::kDouble).abs();
    amp::detail::count_host_sync();  // the .cpu() below
    if (inf) local = at::maximum(local, a.max().reshape({1}).cpu());
    else local.add_((norm_type == 1.0 ? a.sum() : a.mul(a).sum()).reshape({1}).cpu());
  }
  if (state_.world_size > 1) {
    std::vector<at::Tensor> tensors{local};
    c10d::AllreduceOptions options;
    options.reduceOp = inf ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM;
    wait(state_.group->allreduce(tensors, options), state_, "amp::clip_grad_norm_ (the norm over every rank's shard)");
  }
  at::Tensor norm = norm_type == 2.0 ? local.sqrt() : local;
  const c10::Device device = grads.empty() ? c10::Device(at::kCPU) : grads.front().device();
  return norm.to(at::kFloat).reshape({}).to(device);
}

std::vector<at::Tensor> Zero::pieces() const {
  std::vector<at::Tensor> out;
  for (const auto& p : pieces_) out.push_back(p.value);
  return out;
}

void Zero::on_shard(torch::optim::Optimizer& opt, Use use, const std::function<void()>& fn) {
  if (use == Use::kSave && full_state_) {  // save_consolidated: the whole tensors' state, as an unsharded run keeps it
    std::swap(opt.state(), *full_state_);
    try {
      fn();
    } catch (...) {
      std::swap(opt.state(), *full_state_);
      throw;
    }
    std::swap(opt.state(), *full_state_);
    return;
  }
  std::vector<at::Tensor> piece_grads(pieces_.size());
  if (use == Use::kStep) {
    if (stage_ == 1) {
      for (size_t k = 0; k < pieces_.size(); ++k) {
        const ShardPiece& p = pieces_[k];
        const at::Tensor g = full_grad(groups_[p.group][p.entry]);
        if (g.defined()) piece_grads[k] = g.reshape({-1}).narrow(0, p.begin, p.length);
      }
    } else {
      (void)grads();  // a fast-path backward's slices become the gradients
      for (size_t k = 0; k < pieces_.size(); ++k) piece_grads[k] = pieces_[k].grad;
    }
  }
  if (use != Use::kLoad) refresh_changed();
  std::vector<std::vector<at::Tensor>> saved;
  auto& groups = opt.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    std::vector<at::Tensor> mine;
    for (size_t k = 0; k < pieces_.size(); ++k) {
      if (pieces_[k].group != g) continue;
      mine.push_back(pieces_[k].value);
      pieces_[k].value.mutable_grad() = piece_grads[k];
    }
    saved.push_back(std::exchange(groups[g].params(), std::move(mine)));
  }
  // NOTE [Sharded LAMB] in src/optim/fused_optimizers.cpp: its norms are summed over the ranks' pieces.
  auto* fused = use == Use::kStep ? dynamic_cast<amp::optim::FusedOptimizer*>(&opt) : nullptr;
  std::unordered_map<const c10::TensorImpl*, const ShardPiece*> piece_of;  // ShardSums::whole_shape's lookup
  for (const auto& p : pieces_) piece_of.emplace(p.value.unsafeGetTensorImpl(), &p);
  const amp::detail::ShardSums sums{
      [this](double v) { return sum_over_ranks(v); }, [this](std::vector<double>& v) { sum_per_tensor(v); },
      [this, &piece_of](const at::Tensor& piece) -> std::optional<std::vector<int64_t>> {
        const auto it = piece_of.find(piece.unsafeGetTensorImpl());
        if (it == piece_of.end()) return std::nullopt;
        const ShardPiece& p = *it->second;
        const ShardEntry& e = groups_[p.group][p.entry];
        if (p.begin != 0 || p.length != e.numel) return std::nullopt;
        return e.stepped.sizes().vec();
      }};
  if (fused) fused->step_context().set_shard_sums(&sums);
  // The step stores lean masters through this rank's slices of them, drawing in the whole table's numbering.
  std::shared_ptr<amp::detail::LeanMasters> whole_lean;
  if (fused && lean_) {
    if (lean_stale()) index_lean();  // the optimizer re-indexed its parameters (a param group added)
    lean_pieces_->set_generator(lean_->seed(), lean_->counter());
    whole_lean = fused->step_context().lean_masters();
    fused->step_context().set_lean_masters(lean_pieces_);
  }
  // The state format numbers a piece's elements as its whole tensor's (NOTE [Optimizer state formats]).
  const bool placed = use == Use::kStep && format_ && format_->format() != amp::OptimizerStateFormat::kFp32;
  if (placed) {
    format_->set_placement(
        [this](const at::Tensor& t) -> std::optional<amp::detail::StateFormat::Place> {
          const auto it = piece_places_.find(t.unsafeGetTensorImpl());
          if (it == piece_places_.end()) return std::nullopt;
          return it->second;
        },
        whole_numel_);
  }
  auto restore = [&] {
    if (whole_lean) {
      fused->step_context().set_lean_masters(whole_lean);
      lean_->set_generator(lean_->seed(), lean_pieces_->counter());
    }
    if (placed) format_->set_placement(nullptr, 0);
    if (fused) fused->step_context().set_shard_sums(nullptr);
    for (size_t g = 0; g < groups.size() && g < saved.size(); ++g) groups[g].params() = std::move(saved[g]);
    for (auto& p : pieces_) p.value.mutable_grad() = at::Tensor();
  };
  try {
    fn();
  } catch (...) {
    restore();
    throw;
  }
  restore();
}

void Zero::save(torch::serialize::OutputArchive& amp_archive) const {
  amp_archive.write("zero/world_size", c10::IValue(static_cast<int64_t>(state_.world_size)));
  amp_archive.write("zero/rank", c10::IValue(static_cast<int64_t>(state_.rank)));
  amp_archive.write("zero/stage", c10::IValue(static_cast<int64_t>(stage_)));
  amp_archive.write("zero/layout", c10::IValue(layout()));
  for (size_t k = 0; k < pieces_.size(); ++k) {
    if (groups_[pieces_[k].group][pieces_[k].entry].mastered) amp_archive.write("zero/piece/" + std::to_string(k), pieces_[k].value);
    const int slot = pieces_[k].lean_slot;
    if (slot >= 0 && lean_pieces_->aux(static_cast<size_t>(slot)).defined()) {
      amp_archive.write("zero/lean_aux/" + std::to_string(k), lean_pieces_->aux(static_cast<size_t>(slot)));
    }
    if (slot >= 0 && stage_ == 3) amp_archive.write("zero/lean_piece/" + std::to_string(k), pieces_[k].value);
  }
}

void Zero::check_shard_archive(torch::serialize::InputArchive& archive, const char* where) {
  torch::serialize::InputArchive amp_archive;
  archive.read("amp", amp_archive);
  c10::IValue world, rank, saved_layout;
  amp_archive.read("zero/world_size", world);
  amp_archive.read("zero/rank", rank);
  TORCH_CHECK(world.isInt() && rank.isInt() && amp_archive.try_read("zero/layout", saved_layout) && saved_layout.isIntList(),
              where, ": the checkpoint's ZeRO shard description is damaged (zero/world_size, zero/rank, zero/layout).");
  TORCH_CHECK(world.toInt() == state_.world_size, where, ": the checkpoint is rank ", rank.toInt(), "'s shard of a ZeRO "
              "world of ", world.toInt(), " ranks, this run has ", state_.world_size, ". A shard loads only at the world "
              "size it was saved with; to change world size, save with amp::parallel::save_consolidated and torch::load "
              "that on every rank after shard_optimizer (each rank keeps its slice).");
  TORCH_CHECK(rank.toInt() == state_.rank, where, ": the checkpoint is rank ", rank.toInt(), "'s shard, this is rank ",
              state_.rank, ". Each rank loads the file it saved (name it by rank, e.g. optimizer.rank<N>.pt).");
  c10::IValue saved_stage;
  const int64_t theirs_stage = amp_archive.try_read("zero/stage", saved_stage) && saved_stage.isInt() ? saved_stage.toInt() : 1;
  TORCH_CHECK((theirs_stage == 3) == (stage_ == 3), where, ": the checkpoint is a shard of ZeRO stage ", theirs_stage,
              ", this optimizer is sharded at stage ", stage_, ", and stage 3 cuts every unit into slices of its own. "
              "Resume a rank's shard at the stage it was saved at, or save with amp::parallel::save_consolidated, which "
              "any stage loads.");
  const std::vector<int64_t> theirs = saved_layout.toIntVector();
  TORCH_CHECK(theirs == layout(), where, ": the checkpoint's param groups hold (tensors, elements) ",
              shard_sizes_text(theirs), ", this optimizer's ", shard_sizes_text(layout()), ". Resume with the same model and param "
              "groups.");
}

std::function<void()> Zero::load(OptimizerBase& optimizer, torch::serialize::InputArchive& amp_archive,
                                 const std::vector<at::Tensor>& full_masters, const char* where) {
  torch::optim::Optimizer& opt = OptimizerAccess::torch_optimizer(optimizer);
  if (full_masters.empty() && amp::detail::Sharding::is_shard_amp_archive(amp_archive)) {
    std::vector<std::pair<size_t, at::Tensor>> values;
    for (size_t k = 0; k < pieces_.size(); ++k) {
      if (!groups_[pieces_[k].group][pieces_[k].entry].mastered) continue;
      at::Tensor v;
      TORCH_CHECK(amp_archive.try_read("zero/piece/" + std::to_string(k), v) && v.sizes() == pieces_[k].value.sizes(),
                  where, ": the checkpoint's shard lacks master piece ", k, " (of '",
                  groups_[pieces_[k].group][pieces_[k].entry].name, "') or it has another size; the file is damaged.");
      values.emplace_back(k, std::move(v));
    }
    std::vector<std::pair<size_t, at::Tensor>> lean_aux;  // this rank's slices of the lean aux
    for (size_t k = 0; lean_pieces_ && lean_pieces_->aux_dtype() && k < pieces_.size(); ++k) {
      if (pieces_[k].lean_slot < 0) continue;
      at::Tensor v;
      TORCH_CHECK(amp_archive.try_read("zero/lean_aux/" + std::to_string(k), v) && v.sizes() == pieces_[k].value.sizes() &&
                      v.scalar_type() == *lean_pieces_->aux_dtype(),
                  where, ": the checkpoint's shard lacks the low bits of piece ", k, " (of '",
                  groups_[pieces_[k].group][pieces_[k].entry].name, "') or they have another size or dtype; the file "
                  "is damaged.");
      lean_aux.emplace_back(k, std::move(v));
    }
    for (size_t k = 0; stage_ == 3 && k < pieces_.size(); ++k) {  // stage 3: the lean weights' slices are the shard's
      if (pieces_[k].lean_slot < 0) continue;
      at::Tensor v;
      TORCH_CHECK(amp_archive.try_read("zero/lean_piece/" + std::to_string(k), v) && v.sizes() == pieces_[k].value.sizes() &&
                      v.scalar_type() == pieces_[k].value.scalar_type(),
                  where, ": the checkpoint's shard lacks the weights of piece ", k, " (of '",
                  groups_[pieces_[k].group][pieces_[k].entry].name, "') or they have another size or dtype; the file "
                  "is damaged.");
      values.emplace_back(k, std::move(v));
    }
    return [this, values, lean_aux] {
      c10::NoGradGuard no_grad;
      refresh_changed();  // direct pieces: the model's values
      for (const auto& [k, v] : values) pieces_[k].value.copy_(v);
      for (const auto& [k, v] : lean_aux) {  // paired with the weights the lean archive restored (NOTE [Lean masters])
        lean_pieces_->restore(static_cast<size_t>(pieces_[k].lean_slot), v, pieces_[k].value);
      }
      if (stage_ == 3) release_all();  // the next gathers bring the loaded values
      else gather_into_model();       // collective: every rank loads its shard
    };
  }
  return [this, &opt, full_masters] {
    c10::NoGradGuard no_grad;
    for (const auto& entries : groups_) {
      for (const auto& e : entries) {
        if (e.mastered && !released(e)) e.model.copy_(full_masters[e.master_index]);  // the model follows the masters
      }
    }
    for (auto& p : pieces_) {
      const ShardEntry& e = groups_[p.group][p.entry];
      if (e.lean || (!e.mastered && released(e))) continue;  // lean: an alias of the restored weight, its aux came with
                                                             // the lean archive (keep_aux); stage 3: the piece is the value
      const at::Tensor& source = e.mastered ? full_masters[e.master_index] : e.model;
      p.value.copy_(source.reshape({-1}).narrow(0, p.begin, p.length));
    }
    adopt_full_state(opt, 0);
    record_versions();
    if (stage_ == 3) release_all();  // the next gathers bring the restored values
  };
}

void Zero::with_full_state(OptimizerBase& optimizer, const std::function<void()>& fn) {
  gather_consolidated(optimizer, /*everywhere=*/true);
  auto& state = OptimizerAccess::torch_optimizer(optimizer).state();
  std::swap(state, *full_state_);
  try {
    fn();
  } catch (...) {
    std::swap(state, *full_state_);
    end_consolidated();
    throw;
  }
  std::swap(state, *full_state_);
  end_consolidated();
}

void Zero::with_whole(OptimizerBase& optimizer, const std::function<void()>& fn) {
  torch::optim::Optimizer& opt = OptimizerAccess::torch_optimizer(optimizer);
  if (stage_ == 3) gather_every_unit();  // fn reads and replaces whole parameters; the new layout frees them
  gather_consolidated(optimizer, /*everywhere=*/true);
  auto& state = opt.state();
  // State keyed by a whole tensor (a checkpoint torch::load-ed, not sliced yet) is newer than its pieces'.
  std::set<ShardStateMap::key_type> piece_keys;
  for (const auto& p : pieces_) piece_keys.insert(amp::detail::state_key(state, p.value));
  for (auto& [key, slot] : state) {
    if (slot && !piece_keys.count(key)) (*full_state_)[key] = std::move(slot);
  }
  state = std::move(*full_state_);
  for (auto& entries : groups_) {
    for (auto& e : entries) {
      if (e.mastered) e.stepped.set_data(full_masters_[e.master_index]);
    }
  }
  amp::detail::ParamIndex& index = OptimizerAccess::index(optimizer);
  index.masters().mark_sharded({});
  if (lean_) lean_->mark_whole(full_aux_ ? std::move(*full_aux_) : std::vector<at::Tensor>(lean_->size()));
  end_consolidated();
  // Nothing laid out: the param-group sync lays every group out again (adopt_groups), or, if fn changed nothing the
  // sync sees, the lines below do.
  groups_.clear();
  group_numel_.clear();
  pieces_.clear();
  lanes_.clear();
  runs_.clear();
  used_.clear();
  unreduced_.clear();
  piece_places_.clear();
  whole_numel_ = 0;
  lean_pieces_.reset();
  lean_.reset();
  unit_of_storage_.clear();  // stage 3: a parameter moved to fp32 has another storage
  for (auto& lanes : unit_lanes_) lanes.clear();
  auto lay_out = [&] {
    if (groups_.empty()) adopt_groups(optimizer);
  };
  try {
    fn();
  } catch (...) {
    lay_out();
    throw;
  }
  lay_out();
}

void Zero::write_master(size_t i, const at::Tensor& value) {
  c10::NoGradGuard no_grad;
  for (auto& p : pieces_) {
    ShardEntry& e = groups_[p.group][p.entry];
    if (!e.mastered || e.master_index != i) continue;
    const at::Tensor slice = value.reshape({-1}).narrow(0, p.begin, p.length);
    if (value.scalar_type() == at::kFloat) p.value.copy_(slice);
    else amp::detail::keep_where_rounded_equal(p.value, slice.to(p.value.device()));  // the model's dtype
  }
  for (auto& entries : groups_) {
    for (auto& e : entries) {
      if (!e.mastered || e.master_index != i || released(e)) continue;  // stage 3: the next gather brings it
      e.model.copy_(value);  // the rounded copy: every rank loads the same weights
      e.version = e.model._version();
      e.storage = e.model.storage().unsafeGetStorageImpl();
    }
  }
}

std::vector<at::Tensor> Zero::gather_masters() {
  refresh_changed();
  const int64_t n_ranks = state_.world_size;
  size_t n_masters = 0;
  for (const auto& entries : groups_) {
    for (const auto& e : entries) n_masters = std::max(n_masters, e.mastered ? e.master_index + 1 : 0);
  }
  auto mastered_spans = [&](int64_t r) {  // (group, span) of rank r's master pieces, in its order
    std::vector<std::pair<size_t, ShardSpan>> out;
    for (size_t g = 0; g < groups_.size(); ++g) {
      for (const auto& span : slice_spans(g, r)) {
        if (groups_[g][span.entry].mastered) out.emplace_back(g, span);
      }
    }
    return out;
  };
  int64_t width = 0;
  std::vector<std::vector<std::pair<size_t, ShardSpan>>> spans;
  for (int64_t r = 0; r < n_ranks; ++r) {
    spans.push_back(mastered_spans(r));
    int64_t n = 0;
    for (const auto& [g, span] : spans.back()) n += span.length;
    width = std::max(width, n);
  }
  at::Tensor send = at::zeros({width}, at::TensorOptions().dtype(at::kFloat));
  int64_t offset = 0;
  for (const auto& p : pieces_) {
    if (!groups_[p.group][p.entry].mastered) continue;
    send.narrow(0, offset, p.length).copy_(p.value);
    offset += p.length;
  }
  const at::Tensor recv = shard_all_gather_bytes(state_, send.view(at::kByte), bucket_bytes_,
                                                 std::string(kShard) + " (gathering the fp32 masters)").view(at::kFloat);
  std::vector<at::Tensor> out(n_masters);
  for (const auto& entries : groups_) {
    for (const auto& e : entries) {
      if (e.mastered) out[e.master_index] = at::empty(e.stepped.sizes(), e.stepped.options());
    }
  }
  for (int64_t r = 0; r < n_ranks; ++r) {
    int64_t pos = r * width;
    for (const auto& [g, span] : spans[static_cast<size_t>(r)]) {
      out[groups_[g][span.entry].master_index].view({-1}).narrow(0, span.begin, span.length)
          .copy_(recv.narrow(0, pos, span.length));
      pos += span.length;
    }
  }
  return out;
}

void Zero::keep_aux(size_t i, const at::Tensor& aux, const at::Tensor& loaded_weight) {
  for (auto& p : pieces_) {
    const ShardEntry& e = groups_[p.group][p.entry];
    if (!e.lean || e.lean_index != i) continue;
    auto part = [&](const at::Tensor& t) { return t.defined() ? t.reshape({-1}).narrow(0, p.begin, p.length) : at::Tensor(); };
    lean_pieces_->restore(static_cast<size_t>(p.lean_slot), part(aux), part(loaded_weight));
  }
  for (auto& entries : groups_) {
    for (auto& e : entries) {
      if (!e.lean || e.lean_index != i) continue;
      e.version = e.model._version();  // the write that came with this aux: nothing for refresh to follow
      e.storage = e.model.storage().unsafeGetStorageImpl();
    }
  }
}

void Zero::keep_weight(size_t i, const at::Tensor& weight) {
  c10::NoGradGuard no_grad;
  for (auto& p : pieces_) {
    const ShardEntry& e = groups_[p.group][p.entry];
    if (e.lean && e.lean_index == i) p.value.copy_(weight.reshape({-1}).narrow(0, p.begin, p.length));
  }
  for (auto& entries : groups_) {
    for (auto& e : entries) {
      if (!e.lean || e.lean_index != i || released(e)) continue;  // released: the next gather brings it
      if (!weight.is_same(e.model)) e.model.copy_(weight);       // whole (a guard): it shows the value at once
      e.version = e.model._version();
      e.storage = e.model.storage().unsafeGetStorageImpl();
      lean_->mark_synced(i);
    }
  }
}

// Every rank's slices of the lean aux, lane by lane as the weights travel, whole in the lean table's order.
std::vector<at::Tensor> Zero::gather_aux() {
  refresh_changed();
  const auto dtype = lean_ ? lean_->aux_dtype() : std::nullopt;
  if (!dtype) return std::vector<at::Tensor>(lean_ ? lean_->size() : 0);
  return gather_lean(*dtype, [this](const ShardPiece& p) { return lean_pieces_->aux(static_cast<size_t>(p.lean_slot)); },
                     "the lean masters' low bits");
}

// Every rank's `part` of each lean piece (its aux, or at stage 3 its weight), lane by lane as the weights travel,
// whole in the lean table's order.
std::vector<at::Tensor> Zero::gather_lean(c10::ScalarType dtype, const std::function<at::Tensor(const ShardPiece&)>& part,
                                          const std::string& what) {
  std::vector<at::Tensor> out(lean_ ? lean_->size() : 0);
  c10::NoGradGuard no_grad;
  for (const auto& lane : lanes_) {
    const std::vector<ShardEntry>& entries = groups_[lane.group];
    int64_t width = 0;
    for (const auto& spans : lane.spans) {
      int64_t n = 0;
      for (const auto& s : spans) n += entries[s.entry].lean ? s.length : 0;
      width = std::max(width, n);
    }
    if (width == 0) continue;  // the same on every rank: the layout is
    at::Tensor send = at::zeros({width}, entries.front().model.options().dtype(dtype));
    int64_t pos = 0;
    for (const auto& s : lane.spans[static_cast<size_t>(state_.rank)]) {
      if (!entries[s.entry].lean) continue;
      send.narrow(0, pos, s.length).copy_(part(pieces_[static_cast<size_t>(s.piece)]));
      pos += s.length;
    }
    const at::Tensor recv = shard_all_gather_bytes(state_, send.view(at::kByte), bucket_bytes_,
                                                   std::string(kShard) + " (gathering " + what + ")")
                                .view(dtype);
    for (size_t r = 0; r < lane.spans.size(); ++r) {
      pos = static_cast<int64_t>(r) * width;
      for (const auto& s : lane.spans[r]) {
        const ShardEntry& e = entries[s.entry];
        if (!e.lean) continue;
        at::Tensor& whole = out[e.lean_index];
        if (!whole.defined()) whole = at::empty(e.model.sizes(), send.options());
        whole.view({-1}).narrow(0, s.begin, s.length).copy_(recv.narrow(0, pos, s.length));
        pos += s.length;
      }
    }
  }
  return out;
}

void Zero::held(std::vector<at::Tensor>& params, std::vector<at::Tensor>& masters, std::vector<at::Tensor>& master_grads,
                std::vector<at::Tensor>& grads) const {
  for (const auto& p : pieces_) {
    // Stage 3: a piece of a parameter stepped directly or through a lean master is the parameter's only values.
    (stage_ == 3 && !groups_[p.group][p.entry].mastered ? params : masters).push_back(p.value);
    if (groups_[p.group][p.entry].mastered) master_grads.push_back(p.grad);
    else grads.push_back(p.grad);
  }
  for (const auto& lane : lanes_) grads.push_back(lane.incoming);
  for (size_t k = 0; lean_pieces_ && k < lean_pieces_->size(); ++k) masters.push_back(lean_pieces_->aux(k));
  for (const auto& sums : unreduced_) master_grads.insert(master_grads.end(), sums.begin(), sums.end());
}

// Every rank's pieces (values and state), so that rank 0 holds what an unsharded optimizer would.
void Zero::gather_consolidated(OptimizerBase& optimizer, bool everywhere) {
  torch::optim::Optimizer& opt = OptimizerAccess::torch_optimizer(optimizer);
  refresh_changed();
  auto& state = opt.state();
  const auto prototype = amp::detail::new_state_for(opt);
  const size_t n_fields = amp::detail::state_fields(*prototype).tensors.size();
  const int64_t n_ranks = state_.world_size;
  // Every rank's pieces, in the order each rank keeps them (group, then entry).
  std::vector<std::vector<ShardSpan>> rank_pieces(static_cast<size_t>(n_ranks));
  std::vector<std::vector<size_t>> rank_groups(static_cast<size_t>(n_ranks));
  for (size_t g = 0; g < groups_.size(); ++g) {
    for (int64_t r = 0; r < n_ranks; ++r) {
      for (const ShardSpan& span : slice_spans(g, r)) {
        rank_pieces[static_cast<size_t>(r)].push_back(span);
        rank_groups[static_cast<size_t>(r)].push_back(g);
      }
    }
  }
  // 1. What each piece has: state or not, its step count, which fields are defined, and each field's dtype and size
  // (a state format stores moments in bf16 or packed 8-bit blocks: NOTE [Optimizer state formats]).
  const int64_t n_desc = 3 + 2 * static_cast<int64_t>(n_fields);
  int64_t max_pieces = 0;
  for (const auto& list : rank_pieces) max_pieces = std::max<int64_t>(max_pieces, static_cast<int64_t>(list.size()));
  at::Tensor desc = at::zeros({max_pieces * n_desc}, at::TensorOptions().dtype(at::kLong));
  for (size_t k = 0; k < pieces_.size(); ++k) {
    const auto it = state.find(amp::detail::state_key(state, pieces_[k].value));
    if (it == state.end() || !it->second) continue;
    const auto fields = amp::detail::state_fields(*it->second);
    const int64_t at_desc = static_cast<int64_t>(k) * n_desc;
    int64_t mask = 0;
    for (size_t f = 0; f < fields.tensors.size(); ++f) {
      const at::Tensor& t = *fields.tensors[f];
      if (!t.defined()) continue;
      mask |= int64_t{1} << f;
      desc[at_desc + 3 + static_cast<int64_t>(f)] = static_cast<int64_t>(t.scalar_type());
      desc[at_desc + 3 + static_cast<int64_t>(n_fields + f)] = t.numel();
    }
    desc[at_desc] = 1;
    desc[at_desc + 1] = fields.step ? *fields.step : 0;
    desc[at_desc + 2] = mask;
  }
  const std::string what = "amp::parallel::save_consolidated (gathering the shards)";
  const at::Tensor descs = shard_all_gather_bytes(state_, desc.view(at::kByte), bucket_bytes_, what).view(at::kLong);
  auto info = [&](size_t r, size_t j, int64_t f) {
    return descs[static_cast<int64_t>(r) * max_pieces * n_desc + static_cast<int64_t>(j) * n_desc + f].item<int64_t>();
  };
  auto field_dtype = [&](size_t r, size_t j, size_t f) { return static_cast<at::ScalarType>(info(r, j, 3 + static_cast<int64_t>(f))); };
  auto field_numel = [&](size_t r, size_t j, size_t f) { return info(r, j, 3 + static_cast<int64_t>(n_fields + f)); };
  // 2. The bytes: each piece's master value (mastered tensors), then its defined state fields.
  auto piece_bytes = [&](size_t r, size_t j) {
    const ShardSpan& s = rank_pieces[r][j];
    const ShardEntry& e = groups_[rank_groups[r][j]][s.entry];
    int64_t count = e.mastered ? s.length * static_cast<int64_t>(c10::elementSize(e.stepped.scalar_type())) : 0;
    const int64_t mask = info(r, j, 2);
    for (size_t f = 0; f < n_fields; ++f) {
      if ((mask >> f) & 1) count += field_numel(r, j, f) * static_cast<int64_t>(c10::elementSize(field_dtype(r, j, f)));
    }
    return count;
  };
  int64_t width = 0;
  for (size_t r = 0; r < rank_pieces.size(); ++r) {
    int64_t n = 0;
    for (size_t j = 0; j < rank_pieces[r].size(); ++j) n += piece_bytes(r, j);
    width = std::max(width, n);
  }
  at::Tensor send = at::zeros({width}, at::TensorOptions().dtype(at::kByte));
  int64_t at_byte = 0;
  auto put = [&](const at::Tensor& t) {
    const at::Tensor bytes = t.contiguous().view({-1}).view(at::kByte);
    send.narrow(0, at_byte, bytes.numel()).copy_(bytes);
    at_byte += bytes.numel();
  };
  for (size_t k = 0; k < pieces_.size(); ++k) {
    const ShardEntry& e = groups_[pieces_[k].group][pieces_[k].entry];
    if (e.mastered) put(pieces_[k].value);
    const auto it = state.find(amp::detail::state_key(state, pieces_[k].value));
    if (it == state.end() || !it->second) continue;
    for (at::Tensor* t : amp::detail::state_fields(*it->second).tensors) {
      if (t->defined()) put(*t);
    }
  }
  const at::Tensor recv = shard_all_gather_bytes(state_, send, bucket_bytes_, what);
  std::vector<at::Tensor> aux = gather_aux();  // collective: the lean masters' archive writes them whole
  std::optional<std::vector<at::Tensor>> lean_weights;  // stage 3: and the weights, which no parameter holds
  if (lean_ && stage_ == 3) {
    lean_weights = gather_lean(at::kBFloat16, [](const ShardPiece& p) { return p.value; }, "the lean weights");
  }
  if (state_.rank != 0 && !everywhere) return;
  // 3. Rank 0 assembles the whole tensors: masters slice by slice, each state field from its pieces in order.
  ShardStateMap full;
  std::vector<at::Tensor> masters(OptimizerAccess::index(optimizer).masters().size());
  std::unordered_map<const ShardEntry*, std::unique_ptr<torch::optim::OptimizerParamState>> states;
  std::unordered_map<const ShardEntry*, std::vector<std::vector<at::Tensor>>> parts;  // [field] -> pieces, in order
  for (const auto& entries : groups_) {
    for (const auto& e : entries) {
      if (e.mastered) masters[e.master_index] = at::empty(e.stepped.sizes(), e.stepped.options());
    }
  }
  for (size_t r = 0; r < rank_pieces.size(); ++r) {
    int64_t offset = static_cast<int64_t>(r) * width;
    auto take = [&](int64_t numel, at::ScalarType dtype) {
      const int64_t n_bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
      at::Tensor out = recv.narrow(0, offset, n_bytes).clone().view(dtype);
      offset += n_bytes;
      return out;
    };
    for (size_t j = 0; j < rank_pieces[r].size(); ++j) {
      const ShardSpan& s = rank_pieces[r][j];
      const ShardEntry& e = groups_[rank_groups[r][j]][s.entry];
      if (e.mastered) masters[e.master_index].view({-1}).narrow(0, s.begin, s.length).copy_(take(s.length, e.stepped.scalar_type()));
      if (!info(r, j, 0)) continue;
      auto& slot = states[&e];
      auto& fields_parts = parts[&e];
      const int64_t mask = info(r, j, 2);
      if (!slot) {
        slot = prototype->clone();
        if (auto* step = amp::detail::state_fields(*slot).step) *step = info(r, j, 1);
        fields_parts.resize(n_fields);
      }
      for (size_t f = 0; f < n_fields; ++f) {
        if ((mask >> f) & 1) fields_parts[f].push_back(take(field_numel(r, j, f), field_dtype(r, j, f)));
      }
    }
  }
  for (auto& [entry, slot] : states) {
    const auto fields = amp::detail::state_fields(*slot).tensors;
    const auto& fields_parts = parts[entry];
    for (size_t f = 0; f < n_fields; ++f) {
      if (fields_parts[f].empty()) {
        *fields[f] = at::Tensor();
        continue;
      }
      const at::Tensor whole = amp::detail::join_moments(fields_parts[f]);
      *fields[f] = amp::detail::is_packed(whole) ? whole : whole.view(entry->stepped.sizes());
    }
  }
  for (auto& [entry, slot] : states) full[amp::detail::state_key(full, entry->stepped)] = std::move(slot);
  full_state_ = std::move(full);
  full_masters_ = std::move(masters);
  if (lean_) full_aux_ = std::move(aux);
  full_weights_ = std::move(lean_weights);
}

}  // namespace

void shard(const std::shared_ptr<DistributedCore>& core, OptimizerBase& optimizer, const ZeroOptions& options) {
  TORCH_CHECK(core, kShard, ": the DistributedDataParallel is empty.");
  TORCH_CHECK(options.stage() >= 1 && options.stage() <= 3, kShard, ": stage must be 1 (masters and optimizer state "
              "sharded), 2 (and the gradients) or 3 (and the parameters), got ", options.stage(), ".");
  TORCH_CHECK(options.stage() == 3 || (options.units().empty() && options.prefetch() == 1), kShard, ": ZeroOptions::",
              options.units().empty() ? "prefetch" : "units", " applies to stage 3 only (it chooses how parameters are "
              "gathered), and this is stage ", options.stage(), ". Drop it, or use stage(3).");
  TORCH_CHECK(options.prefetch() >= 0, kShard, ": ZeroOptions::prefetch must be 0 (gather each unit when an op needs "
              "it) or more (units gathered ahead), got ", options.prefetch(), ".");
  TORCH_CHECK(options.bucket_cap_mb() > 0 && std::isfinite(options.bucket_cap_mb()), kShard, ": bucket_cap_mb must be "
              "positive, got ", options.bucket_cap_mb(), ".");
  TORCH_CHECK(!OptimizerAccess::sharding(optimizer), kShard, ": this optimizer is sharded already; call "
              "shard_optimizer once per optimizer.");
  TORCH_CHECK(OptimizerAccess::steps(optimizer) == 0, kShard, ": the optimizer has stepped ",
              OptimizerAccess::steps(optimizer), " time(s); shard it before the first step (a checkpoint torch::load-ed "
              "before shard_optimizer is sharded with it).");
  const Properties& p = optimizer.properties();
  TORCH_CHECK(p.enabled, kShard, ": amp is disabled for this optimizer (enabled = false); ZeRO shards amp's optimizer "
              "state. Enable amp, or use torch's own data parallelism.");
  torch::optim::Optimizer& opt = OptimizerAccess::synced_torch_optimizer(optimizer);
  // NOTE [Optimizer kinds]: the table says which types ZeRO can slice, and why not.
  const amp::detail::OptimizerKind* kind = amp::detail::kind_of(opt);
  const std::string why = kind ? std::string(kind->name) + " " + (kind->unshardable ? kind->unshardable : "")
                                : std::string("its per-parameter state is not one amp knows how to slice");
  TORCH_CHECK(kind && !kind->unshardable, kShard, ": this optimizer type can't be sharded (", why, "). Use "
              "amp::optim::FusedSGD, FusedAdam, FusedAdamW, FusedLAMB or FusedMuon, or LibTorch's SGD, Adam or AdamW.");
  auto zero = std::make_shared<Zero>(core, optimizer, options);
  if (options.stage() == 3) {
    core->set_sharded_parameters(zero);
    zero->register_whole_scopes();
  }
  if (options.stage() >= 2) {
    std::weak_ptr<Zero> weak = zero;
    if (options.overlap()) {  // NOTE [Overlapped reduce-scatter]
      core->add_ready_listener([weak](size_t i) {
        if (const auto z = weak.lock()) z->on_grad_ready(i);
      });
    }
    core->add_reduction([weak](const std::vector<at::Tensor>& params, const std::vector<bool>& used, bool closes_window) {
      if (const auto z = weak.lock()) return z->reduce(params, used, closes_window);
      return std::vector<bool>(params.size(), false);
    });
  }
  OptimizerAccess::index(optimizer).masters().mark_sharded(zero);
  if (const auto& lean = OptimizerAccess::index(optimizer).lean()) lean->mark_sharded(zero);
  OptimizerAccess::set_sharding(optimizer, std::move(zero));
}

}  // namespace amp::parallel::detail

namespace amp::parallel {

void save_consolidated(OptimizerBase& optimizer, const std::string& path) {
  using amp::detail::OptimizerAccess;
  auto* zero = dynamic_cast<detail::Zero*>(OptimizerAccess::sharding(optimizer));
  if (!zero) {
    torch::save(OptimizerAccess::torch_optimizer(optimizer), path);
    return;
  }
  zero->gather_consolidated(optimizer, /*everywhere=*/false);
  if (zero->group().rank == 0) {
    try {
      torch::save(OptimizerAccess::torch_optimizer(optimizer), path);
    } catch (...) {
      zero->end_consolidated();
      throw;
    }
    zero->end_consolidated();
  }
  // Nobody reads the file before rank 0 has written it.
  detail::wait(zero->group().group->barrier(), zero->group(), "amp::parallel::save_consolidated (waiting for rank 0)");
}

}  // namespace amp::parallel
