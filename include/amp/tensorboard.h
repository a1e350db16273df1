#pragma once
// TensorBoard event files from C++ training: torch.utils.tensorboard's SummaryWriter for scalars and
// histograms, plus amp's own signals (loss scale per loss_id, skipped steps).
//
//   amp::SummaryWriter writer(amp::SummaryWriterOptions("runs/O2"));
//   writer.add_scalar("train_loss", loss, epoch);
//   amp::add_amp_scalars(writer, optimizer, epoch);   // amp/loss_scale/0, amp/skipped_steps
//   writer.flush();                                   // each epoch; the destructor flushes too
//
// The files are what TensorBoard itself writes, read by `tensorboard --logdir runs`: one
// `events.out.tfevents.<seconds>.<hostname>.<pid>.<n>` file per writer, a sequence of TFRecords
// (uint64 length, masked CRC-32C of the length, an `Event` protobuf, masked CRC-32C of the event),
// the first one `file_version: "brain.Event:2"`. The few protobuf fields are encoded directly: no
// protobuf and no LibTorch in this header or its writer.
//
// NOTE [Crash safety]: records are only ever appended, each whole; flush() hands the pending records
// to the operating system in one append. A crash (or a kill) loses at most the records not yet flushed
// and can leave a truncated last record, which TensorBoard's reader skips without losing the earlier
// ones. After a failed write the writer never writes again, so it can't append after a torn record.

#include <torch/arg.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace amp {

class OptimizerBase;

/// Options of a SummaryWriter, named as torch.utils.tensorboard.SummaryWriter's arguments.
///
/// Example:
///   amp::SummaryWriter writer(amp::SummaryWriterOptions("runs/O2_bf16").on_error_continue(true));
struct SummaryWriterOptions {
  /// Writes into `log_dir` (created with its parents if missing): one run, one TensorBoard curve per tag.
  explicit SummaryWriterOptions(std::string log_dir) : log_dir_(std::move(log_dir)) {}

  /// The run's directory.
  TORCH_ARG(std::string, log_dir);
  /// Flushes by itself once this many records are pending (default 10, as torch's max_queue; 1: every record).
  TORCH_ARG(int, max_queue) = 10;
  /// Flushes by itself when a record arrives this many seconds after the last flush (default 120, as torch).
  TORCH_ARG(double, flush_secs) = 120.0;
  /// Appends this text to the event file's name (as torch's filename_suffix); no '/'.
  TORCH_ARG(std::string, filename_suffix);
  /// Keeps training going on a logging error (an unwritable directory, a full disk, a bad tag): the
  /// writer prints one warning to stderr and stops logging instead of throwing. Default false: throw.
  TORCH_ARG(bool, on_error_continue) = false;
};

/// Writes one TensorBoard run (torch.utils.tensorboard.SummaryWriter's scalar and histogram part).
/// The constructor creates the directory and the event file; errors throw (std::invalid_argument for
/// bad options and tags, std::runtime_error for the file system) with the value and the fix, unless
/// on_error_continue(true). Tags are non-empty UTF-8 text without control characters ("train_loss",
/// "amp/loss_scale/0"); a '/' groups tags into sections in TensorBoard. Thread-safe. Movable, not copyable.
class SummaryWriter {
 public:
  explicit SummaryWriter(const SummaryWriterOptions& options);
  /// Writes into `log_dir` with the default options.
  explicit SummaryWriter(const std::string& log_dir);
  /// Flushes and closes; never throws (a failure is printed to stderr).
  ~SummaryWriter();
  SummaryWriter(SummaryWriter&&) noexcept;
  SummaryWriter& operator=(SummaryWriter&&) noexcept;
  SummaryWriter(const SummaryWriter&) = delete;
  SummaryWriter& operator=(const SummaryWriter&) = delete;

  /// Records `value` (stored as float32, TensorBoard's simple_value) for `tag` at `step`; the wall
  /// time is now unless given (seconds since the Unix epoch).
  void add_scalar(const std::string& tag, double value, int64_t step,
                  std::optional<double> wall_time = std::nullopt);
  /// Records a histogram of `values` in `bins` equal-width buckets between their min and max.
  /// Non-finite values (an overflowed gradient) are left out; with no finite value nothing is written.
  void add_histogram(const std::string& tag, const std::vector<double>& values, int64_t step, int bins = 30,
                     std::optional<double> wall_time = std::nullopt);
  /// Hands every pending record to the operating system (whole records, appended).
  void flush();
  /// Flushes and closes the file; later add_* calls throw (or, with on_error_continue, do nothing).
  void close();

  /// Returns whether records are still being written (false after close() or an error under on_error_continue).
  bool logging() const noexcept;
  /// Returns the run's directory.
  const std::string& log_dir() const noexcept;
  /// Returns the event file's path (empty if it could not be created).
  const std::string& file_path() const noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Writes amp's signals of `optimizer` at `step`: `<prefix>loss_scale/<loss_id>` for each of its
/// num_losses loss scalers (amp::loss_scale) and `<prefix>skipped_steps` (steps skipped after an
/// overflow so far), with Options::auto_fp32 `<prefix>fp32_modules` (modules it moved to fp32 so far), and with
/// Fp8Options::auto_fallback `<prefix>fp8_fallbacks` (FP8 layers it moved to bfloat16 so far). Use
/// another prefix ("amp/G/") for a second optimizer.
void add_amp_scalars(SummaryWriter& writer, const OptimizerBase& optimizer, int64_t step,
                     const std::string& prefix = "amp/");

namespace detail {

/// Returns the CRC-32C (Castagnoli) of `size` bytes, continuing from `crc` (0 to start).
uint32_t crc32c(const void* data, size_t size, uint32_t crc = 0) noexcept;
/// Returns TFRecord's masked CRC: the CRC-32C rotated right by 15 bits plus 0xa282ead8.
uint32_t masked_crc32c(const void* data, size_t size) noexcept;
/// Returns `payload` framed as one TFRecord: length, masked CRC of the length, payload, masked CRC.
std::string tfrecord(const std::string& payload);

}  // namespace detail

}  // namespace amp
