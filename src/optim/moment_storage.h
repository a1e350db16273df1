#pragma once
// NOTE [Moment storage]
// How one stored moment holds its values (NOTE [Optimizer state formats] in state_format.h), one class per
// representation: PlainMoment (the tensor's own dtype: fp32 beside masters, fp16 for O3's parameters), Bf16Moment
// (bfloat16, rounded stochastically when the step gives it draws, to nearest otherwise) and CodesMoment (torchao's
// 8-bit blocks, packed). Each makes a zero moment, reads and writes its values (ATen ops anywhere, the CPU loops'
// view where it can), cuts a slice of its own for a ZeRO piece and joins slices back, and says where a slice may
// start. moment_storage_of(stored) is the class of a stored tensor; a StateFormat picks the one each tensor gets, so a
// new format is one class here and one case in StateFormat::storage_for.

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "optim/cpu_state_codec.h"

namespace amp::detail {

/// A bf16 moment's stochastic rounding draws: the generator's seed and the first draw's number, which a step on a
/// device's route counts there (`on_device`, a 0-dim int64 tensor; NOTE [Stored moments on the device] in
/// fused_optimizers.cpp) and the CPU loops on the host (`first`).
struct DrawStream {
  uint64_t seed = 0;
  uint64_t first = 0;
  at::Tensor on_device;  // undefined: `first`
};
using Draws = std::optional<DrawStream>;

/// Which map an 8-bit moment takes: exp_avg the signed one, the squares (exp_avg_sq, max_exp_avg_sq) the unsigned.
enum class Moment { kSigned, kUnsigned };
/// The map of field `f` of state_fields() (exp_avg first: Adam's, AdamW's and FusedLAMB's order; FusedMuon's one
/// momentum buffer is signed too).
inline Moment moment_of_field(size_t f) { return f == 0 ? Moment::kSigned : Moment::kUnsigned; }

/// torchao's create_dynamic_map(signed) as float32, computed with the same ATen ops (so the same values).
const std::array<float, 256>& quantization_map(Moment moment);

/// Whether a tensor of `numel` values gets 8-bit moments: at least 4096 values, a multiple of 256 (torchao's rule).
bool quantizes(int64_t numel);
/// Whether `stored` is a packed 8-bit moment.
bool is_packed(const at::Tensor& stored);
/// The multiple a slice of `stored` must start and end at to be a moment of its own (slice_moment): a packed
/// moment's block of 256, or 1.
int64_t slice_alignment(const at::Tensor& stored);

/// The values of a stored moment as a new fp32 tensor of `shape`.
at::Tensor decode_moment(const at::Tensor& stored, at::IntArrayRef shape, Moment moment);
/// Writes fp32 `values` into `stored`, which has the representation it keeps; bf16 with `draws` (seed, first draw)
/// rounds stochastically, without them to nearest.
void encode_moment(const at::Tensor& values, const at::Tensor& stored, Moment moment, Draws draws = std::nullopt);
/// A CPU loop's view of a contiguous CPU stored moment (nullopt: another device or layout; ATen ops then).
std::optional<cpu::StateView> cpu_view(const at::Tensor& stored, Moment moment, Draws draws = std::nullopt);
/// torchao's quantize_8bit_with_qmap on `scaled` (values divided by their block's scale), in ATen ops: the codes.
at::Tensor quantize_with_map(const at::Tensor& scaled, Moment moment);
/// Elements [begin, begin + length) of a 1-d stored moment (packed: whole blocks) as a tensor of their own.
at::Tensor slice_moment(const at::Tensor& stored, int64_t begin, int64_t length);
/// The stored moments of consecutive slices of one 1-d tensor, joined.
at::Tensor join_moments(const std::vector<at::Tensor>& parts);

class MomentStorage {
 public:
  virtual ~MomentStorage() = default;
  /// A zero moment of `like`'s values (the stepped tensor).
  virtual at::Tensor fresh(const at::Tensor& like) const = 0;
  /// How many values `stored` holds.
  virtual int64_t values(const at::Tensor& stored) const { return stored.numel(); }
  /// The values as a new fp32 tensor of `shape`.
  virtual at::Tensor decode(const at::Tensor& stored, at::IntArrayRef shape, Moment moment) const = 0;
  /// Writes `flat` (fp32, contiguous, 1-d) into `stored` with ATen ops (encode_moment takes the CPU loops' view
  /// first, where there is one).
  virtual void encode(const at::Tensor& flat, const at::Tensor& stored, Moment moment, Draws draws) const = 0;
  /// The CPU loops' view of `stored` (contiguous, on the CPU); nullopt where they can't read it.
  virtual std::optional<cpu::StateView> view(const at::Tensor& stored, Moment moment, Draws draws) const = 0;
  /// Values [begin, begin + length) of a 1-d `stored` as a moment of their own (multiples of alignment()).
  virtual at::Tensor slice(const at::Tensor& stored, int64_t begin, int64_t length) const;
  /// Consecutive slices of one tensor, joined.
  virtual at::Tensor join(const std::vector<at::Tensor>& parts) const;
  /// Where a slice may start and end.
  virtual int64_t alignment() const { return 1; }
};

/// The class of a stored moment.
const MomentStorage& moment_storage_of(const at::Tensor& stored);
/// The classes: the tensor's own dtype, bfloat16, 8-bit codes.
const MomentStorage& plain_moments();
const MomentStorage& bf16_moments();
const MomentStorage& codes_moments();

}  // namespace amp::detail
