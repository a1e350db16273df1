#include "amp/tensorboard.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <iostream>
#include <mutex>
#include <stdexcept>
#include <system_error>

#include "amp/fp8.h"
#include "amp/precision_policy.h"
#include "amp/scale_loss.h"

namespace amp {
namespace detail {
namespace {

// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), one table lookup per byte: event files
// hold a few records per step, so this is never the cost.
constexpr std::array<uint32_t, 256> make_crc32c_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t crc = i;
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ ((crc & 1u) ? 0x82F63B78u : 0u);
    table[i] = crc;
  }
  return table;
}
constexpr std::array<uint32_t, 256> kCrc32cTable = make_crc32c_table();

}  // namespace

uint32_t crc32c(const void* data, size_t size, uint32_t crc) noexcept {
  const auto* bytes = static_cast<const unsigned char*>(data);
  crc = ~crc;
  for (size_t i = 0; i < size; ++i) crc = kCrc32cTable[(crc ^ bytes[i]) & 0xFFu] ^ (crc >> 8);
  return ~crc;
}

uint32_t masked_crc32c(const void* data, size_t size) noexcept {
  const uint32_t crc = crc32c(data, size);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

namespace {

void put_le(std::string& out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xFFu));
}

}  // namespace

std::string tfrecord(const std::string& payload) {
  std::string record;
  record.reserve(payload.size() + 16);
  put_le(record, payload.size(), 8);
  put_le(record, masked_crc32c(record.data(), 8), 4);
  record += payload;
  put_le(record, masked_crc32c(payload.data(), payload.size()), 4);
  return record;
}

}  // namespace detail

namespace {

// ---- The few protobuf fields TensorBoard's Event needs (tensorflow/core/util/event.proto, ----
// ---- summary.proto), encoded by hand: varint, fixed64/fixed32 and length-delimited.       ----

enum WireType { kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5 };

void put_varint(std::string& out, uint64_t value) {
  while (value >= 0x80) {
    out.push_back(static_cast<char>((value & 0x7F) | 0x80));
    value >>= 7;
  }
  out.push_back(static_cast<char>(value));
}
void put_key(std::string& out, int field, WireType type) { put_varint(out, (static_cast<uint64_t>(field) << 3) | type); }
void put_double(std::string& out, int field, double value) {
  uint64_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  put_key(out, field, kFixed64);
  detail::put_le(out, bits, 8);
}
void put_float(std::string& out, int field, float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  put_key(out, field, kFixed32);
  detail::put_le(out, bits, 4);
}
void put_int64(std::string& out, int field, int64_t value) {
  put_key(out, field, kVarint);
  put_varint(out, static_cast<uint64_t>(value));  // negative: ten bytes, as protobuf's int64
}
void put_bytes(std::string& out, int field, const std::string& bytes) {
  put_key(out, field, kLengthDelimited);
  put_varint(out, bytes.size());
  out += bytes;
}
void put_packed_doubles(std::string& out, int field, const std::vector<double>& values) {
  std::string packed;
  for (double v : values) {
    uint64_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    detail::put_le(packed, bits, 8);
  }
  put_bytes(out, field, packed);
}

// Event { double wall_time = 1; int64 step = 2; oneof { string file_version = 3; Summary summary = 5; } }
// Summary { repeated Value value = 1; }
// Summary.Value { string tag = 1; oneof { float simple_value = 2; HistogramProto histo = 5; } }
std::string event(double wall_time, int64_t step, int what_field, const std::string& what) {
  std::string out;
  put_double(out, 1, wall_time);
  put_int64(out, 2, step);
  put_bytes(out, what_field, what);
  return out;
}
std::string summary_with_value(const std::string& tag, int value_field, const std::string* message, float simple) {
  std::string value;
  put_bytes(value, 1, tag);
  if (message) put_bytes(value, value_field, *message);
  else put_float(value, value_field, simple);
  std::string summary;
  put_bytes(summary, 1, value);
  return summary;
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// A tag as the user can read it in a message: control characters and invalid bytes escaped.
std::string printable(const std::string& text) {
  std::string out;
  for (unsigned char c : text) {
    if (c == '\n') out += "\\n";
    else if (c == '\t') out += "\\t";
    else if (c == '\r') out += "\\r";
    else if (c < 0x20 || c == 0x7F) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "\\x%02X", c);
      out += hex;
    } else {
      out.push_back(static_cast<char>(c));
    }
  }
  return out;
}

constexpr const char* kTagRule =
    "Tags are non-empty UTF-8 text without control characters, such as 'train_loss' or 'amp/loss_scale/0'.";

// Returns why `tag` can't be a TensorBoard tag, or "" if it can. Protobuf readers reject a string
// field that is not UTF-8 (the whole file would become unreadable); control characters break
// TensorBoard's tag lists and filters.
std::string tag_problem(const std::string& tag) {
  if (tag.empty()) return "the tag is empty. " + std::string(kTagRule);
  const auto* s = reinterpret_cast<const unsigned char*>(tag.data());
  const size_t n = tag.size();
  for (size_t i = 0; i < n;) {
    const unsigned char c = s[i];
    uint32_t code;
    size_t length;
    if (c < 0x80) { code = c; length = 1; }
    else if ((c & 0xE0) == 0xC0) { code = c & 0x1Fu; length = 2; }
    else if ((c & 0xF0) == 0xE0) { code = c & 0x0Fu; length = 3; }
    else if ((c & 0xF8) == 0xF0) { code = c & 0x07u; length = 4; }
    else { code = 0; length = 0; }
    bool valid = length > 0 && i + length <= n;
    for (size_t k = 1; valid && k < length; ++k) {
      if ((s[i + k] & 0xC0) != 0x80) valid = false;
      else code = (code << 6) | (s[i + k] & 0x3Fu);
    }
    static constexpr uint32_t kSmallest[] = {0, 0, 0x80, 0x800, 0x10000};
    if (valid && (code < kSmallest[length] || code > 0x10FFFF || (code >= 0xD800 && code <= 0xDFFF))) valid = false;
    if (!valid) {
      char byte[8];
      std::snprintf(byte, sizeof byte, "0x%02X", c);
      return "the tag '" + printable(tag) + "' is not valid UTF-8 (byte " + byte + " at offset " +
             std::to_string(i) + "). " + kTagRule;
    }
    if (code < 0x20 || (code >= 0x7F && code <= 0x9F)) {
      char name[16];
      std::snprintf(name, sizeof name, "U+%04X", static_cast<unsigned>(code));
      return "the tag '" + printable(tag) + "' holds the control character " + name + " at byte " +
             std::to_string(i) + ". " + kTagRule;
    }
    i += length;
  }
  return {};
}

std::string hostname() {
  char name[256] = {};
  if (gethostname(name, sizeof name - 1) != 0 || name[0] == '\0') return "localhost";
  std::string host(name);
  for (char& c : host) if (c == '/') c = '_';
  return host;
}

std::atomic<uint64_t> g_writer_count{0};

}  // namespace

// ---- SummaryWriter ----

struct SummaryWriter::Impl {
  SummaryWriterOptions options;
  std::string file_path;
  int fd = -1;
  std::mutex mutex;
  std::string pending;  // whole records not yet written
  int pending_records = 0;
  std::chrono::steady_clock::time_point last_flush = std::chrono::steady_clock::now();
  bool stopped = false;  // closed, or a write failed: never write again
  std::string stop_reason;

  explicit Impl(SummaryWriterOptions o) : options(std::move(o)) {}
  ~Impl() {
    if (fd >= 0) ::close(fd);
  }

  // A failure: throws `what` + `fix`, or (on_error_continue) prints one warning and stops logging.
  template <class Exception>
  void fail(const std::string& what, const std::string& fix, bool stop_writing) {
    if (options.on_error_continue()) {
      if (!stopped) {
        std::cerr << "amp::SummaryWriter: warning: " << what << " TensorBoard logging to '" << options.log_dir()
                  << "' stops here; training continues (on_error_continue).\n";
      }
      stopped = true;
      stop_reason = what;
      return;
    }
    if (stop_writing) {
      stopped = true;
      stop_reason = what;
    }
    throw Exception("amp::SummaryWriter: " + what + " " + fix +
                    " Or set SummaryWriterOptions::on_error_continue(true) to keep training without TensorBoard logging.");
  }

  // Returns false if nothing may be written (stopped); throws when stopped in throwing mode.
  bool usable(const char* function) {
    if (!stopped) return true;
    if (options.on_error_continue()) return false;
    throw std::runtime_error(std::string("amp::SummaryWriter::") + function + ": the writer of '" + options.log_dir() +
                             "' has stopped (" + stop_reason + "); nothing more is written to " + file_path + ".");
  }

  void append(const std::string& payload) {
    pending += detail::tfrecord(payload);
    ++pending_records;
    const double since_flush =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - last_flush).count();
    if (pending_records >= options.max_queue() || since_flush >= options.flush_secs()) write_pending();
  }

  void write_pending() {
    last_flush = std::chrono::steady_clock::now();
    if (pending.empty() || fd < 0) return;
    const char* data = pending.data();
    size_t left = pending.size();
    while (left > 0) {
      const ssize_t n = ::write(fd, data, left);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const std::string reason = n < 0 ? std::strerror(errno) : "nothing was written";
        pending.clear();
        pending_records = 0;
        fail<std::runtime_error>("writing the event file '" + file_path + "' failed: " + reason + ".",
                                 "Free space or fix the permissions of '" + options.log_dir() + "'.", true);
        return;
      }
      data += n;
      left -= static_cast<size_t>(n);
    }
    pending.clear();
    pending_records = 0;
  }

  void close_file() {
    if (fd < 0) return;
    const int result = ::close(fd);
    fd = -1;
    if (result != 0) {
      fail<std::runtime_error>("closing the event file '" + file_path + "' failed: " + std::strerror(errno) + ".",
                               "Check the disk holding '" + options.log_dir() + "'.", true);
    }
  }
};

namespace {

void validate(const SummaryWriterOptions& options) {
  if (options.log_dir().empty()) {
    throw std::invalid_argument(
        "amp::SummaryWriter: log_dir is empty. Give the run's directory, such as 'runs/O2' (TensorBoard shows one "
        "curve per run directory under its --logdir).");
  }
  if (options.max_queue() < 1) {
    throw std::invalid_argument("amp::SummaryWriter: max_queue must be 1 or more (1 writes every record at once), got " +
                                std::to_string(options.max_queue()) + ".");
  }
  if (!(options.flush_secs() >= 0) || !std::isfinite(options.flush_secs())) {
    throw std::invalid_argument("amp::SummaryWriter: flush_secs must be 0 or more seconds and finite, got " +
                                std::to_string(options.flush_secs()) + ".");
  }
  if (options.filename_suffix().find('/') != std::string::npos) {
    throw std::invalid_argument("amp::SummaryWriter: filename_suffix '" + options.filename_suffix() +
                                "' holds a '/'; it is appended to the event file's name. Put directories in log_dir.");
  }
}

}  // namespace

SummaryWriter::SummaryWriter(const std::string& log_dir) : SummaryWriter(SummaryWriterOptions(log_dir)) {}

SummaryWriter::SummaryWriter(const SummaryWriterOptions& options) : impl_(std::make_unique<Impl>(options)) {
  validate(options);
  Impl& w = *impl_;
  const std::string fix = "Give a directory you can write to (log_dir, or --tensorboard DIR in the examples).";
  std::error_code error;
  std::filesystem::create_directories(options.log_dir(), error);
  if (!error && !std::filesystem::is_directory(options.log_dir(), error) && !error) {
    error = std::make_error_code(std::errc::not_a_directory);
  }
  if (error) {
    w.fail<std::runtime_error>("cannot create the log directory '" + options.log_dir() + "': " + error.message() + ".",
                               fix, true);
    return;
  }
  // torch.utils.tensorboard's name: events.out.tfevents.<seconds, 10 digits>.<hostname>.<pid>.<n><suffix>.
  char seconds[32];
  std::snprintf(seconds, sizeof seconds, "%010lld", static_cast<long long>(std::time(nullptr)));
  const std::string name = std::string("events.out.tfevents.") + seconds + "." + hostname() + "." +
                           std::to_string(::getpid()) + "." + std::to_string(g_writer_count++) +
                           options.filename_suffix();
  w.file_path = (std::filesystem::path(options.log_dir()) / name).string();
  w.fd = ::open(w.file_path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_APPEND | O_CLOEXEC, 0644);
  if (w.fd < 0) {
    w.fail<std::runtime_error>("cannot create the event file '" + w.file_path + "': " + std::strerror(errno) + ".",
                               fix, true);
    return;
  }
  std::lock_guard<std::mutex> lock(w.mutex);
  w.pending += detail::tfrecord(event(now_seconds(), 0, 3, "brain.Event:2"));
  ++w.pending_records;
  w.write_pending();  // the file is a valid, empty run from the start
}

SummaryWriter::~SummaryWriter() {
  if (!impl_) return;
  try {
    close();
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
  }
}

SummaryWriter::SummaryWriter(SummaryWriter&&) noexcept = default;
SummaryWriter& SummaryWriter::operator=(SummaryWriter&& other) noexcept {
  if (this != &other) {
    if (impl_) {
      try {
        close();
      } catch (const std::exception& e) {
        std::cerr << e.what() << "\n";
      }
    }
    impl_ = std::move(other.impl_);
  }
  return *this;
}

void SummaryWriter::add_scalar(const std::string& tag, double value, int64_t step, std::optional<double> wall_time) {
  if (!impl_) throw std::logic_error("amp::SummaryWriter::add_scalar: this writer was moved from.");
  Impl& w = *impl_;
  std::lock_guard<std::mutex> lock(w.mutex);
  if (!w.usable("add_scalar")) return;
  if (const auto problem = tag_problem(tag); !problem.empty()) {
    w.fail<std::invalid_argument>("add_scalar: " + problem, "Rename the tag.", false);
    return;
  }
  const std::string summary = summary_with_value(tag, 2, nullptr, static_cast<float>(value));
  w.append(event(wall_time ? *wall_time : now_seconds(), step, 5, summary));
}

void SummaryWriter::add_histogram(const std::string& tag, const std::vector<double>& values, int64_t step, int bins,
                                  std::optional<double> wall_time) {
  if (!impl_) throw std::logic_error("amp::SummaryWriter::add_histogram: this writer was moved from.");
  Impl& w = *impl_;
  std::lock_guard<std::mutex> lock(w.mutex);
  if (!w.usable("add_histogram")) return;
  if (const auto problem = tag_problem(tag); !problem.empty()) {
    w.fail<std::invalid_argument>("add_histogram: " + problem, "Rename the tag.", false);
    return;
  }
  if (bins < 1 || bins > 10000) {
    w.fail<std::invalid_argument>("add_histogram('" + printable(tag) + "'): bins must be in [1, 10000], got " +
                                      std::to_string(bins) + ".",
                                  "TensorBoard's own writers use about 30.", false);
    return;
  }
  double lo = INFINITY, hi = -INFINITY, num = 0, sum = 0, sum_squares = 0;
  for (double v : values) {
    if (!std::isfinite(v)) continue;
    lo = std::min(lo, v);
    hi = std::max(hi, v);
    num += 1;
    sum += v;
    sum_squares += v * v;
  }
  if (num == 0) return;
  // HistogramProto { double min = 1, max = 2, num = 3, sum = 4, sum_squares = 5;
  //                  repeated double bucket_limit = 6 [packed], bucket = 7 [packed]; }
  // Bucket i counts values in (limit[i-1], limit[i]], the first from min. long double keeps max - min finite.
  const int count = lo == hi ? 1 : bins;
  std::vector<double> limits(count), buckets(count, 0.0);
  const long double span = static_cast<long double>(hi) - static_cast<long double>(lo);
  for (int i = 0; i < count; ++i) {
    limits[i] = i + 1 == count ? hi : static_cast<double>(lo + span * (i + 1) / count);
  }
  for (double v : values) {
    if (!std::isfinite(v)) continue;
    int i = span > 0 ? static_cast<int>((static_cast<long double>(v) - lo) / span * count) : 0;
    i = std::min(std::max(i, 0), count - 1);
    while (i > 0 && v <= limits[i - 1]) --i;  // rounding at a bucket's edge
    while (i + 1 < count && v > limits[i]) ++i;
    buckets[i] += 1;
  }
  std::string histogram;
  put_double(histogram, 1, lo);
  put_double(histogram, 2, hi);
  put_double(histogram, 3, num);
  put_double(histogram, 4, sum);
  put_double(histogram, 5, sum_squares);
  put_packed_doubles(histogram, 6, limits);
  put_packed_doubles(histogram, 7, buckets);
  const std::string summary = summary_with_value(tag, 5, &histogram, 0.0f);
  w.append(event(wall_time ? *wall_time : now_seconds(), step, 5, summary));
}

void SummaryWriter::flush() {
  if (!impl_) return;
  std::lock_guard<std::mutex> lock(impl_->mutex);
  if (!impl_->stopped) impl_->write_pending();
}

void SummaryWriter::close() {
  if (!impl_) return;
  Impl& w = *impl_;
  std::lock_guard<std::mutex> lock(w.mutex);
  if (!w.stopped) w.write_pending();
  if (!w.stopped) {
    w.stopped = true;
    w.stop_reason = "it was closed";
  }
  w.close_file();
}

bool SummaryWriter::logging() const noexcept {
  if (!impl_) return false;
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return !impl_->stopped;
}

const std::string& SummaryWriter::log_dir() const noexcept {
  static const std::string empty;
  return impl_ ? impl_->options.log_dir() : empty;
}

const std::string& SummaryWriter::file_path() const noexcept {
  static const std::string empty;
  return impl_ ? impl_->file_path : empty;
}

void add_amp_scalars(SummaryWriter& writer, const OptimizerBase& optimizer, int64_t step, const std::string& prefix) {
  const int losses = optimizer.properties().num_losses;
  for (int loss_id = 0; loss_id < losses; ++loss_id) {
    writer.add_scalar(prefix + "loss_scale/" + std::to_string(loss_id), loss_scale(optimizer, loss_id), step);
  }
  writer.add_scalar(prefix + "skipped_steps", static_cast<double>(optimizer.skipped_steps()), step);
  if (optimizer.properties().auto_fp32 > 0) {  // modules auto_fp32 moved to fp32 so far
    double moved = 0;
    for (const auto& line : fp32_modules(optimizer)) moved += line.size() > 11 && line.compare(line.size() - 11, 11, "(auto_fp32)") == 0;
    writer.add_scalar(prefix + "fp32_modules", moved, step);
  }
  if (optimizer.properties().fp8 && optimizer.properties().fp8->auto_fallback()) {  // layers it moved so far
    writer.add_scalar(prefix + "fp8_fallbacks", static_cast<double>(fp8_fallbacks(optimizer).size()), step);
  }
}

}  // namespace amp
