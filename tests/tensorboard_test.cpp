// amp::SummaryWriter: TFRecord framing and CRC-32C, then whole runs read back by Python's `tensorboard`
// package (tests/python/read_tensorboard.py: TensorBoard's own EventAccumulator and record reader),
// corrupted and truncated files, and the errors.

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <limits>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "support/models.h"
#include "support/support.h"

namespace fs = std::filesystem;

namespace {

// A fresh directory per test, removed at the end.
class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::temp_directory_path() /
            ("amp_tensorboard_" + std::to_string(::getpid()) + "_" + info->test_suite_name() + "_" + info->name());
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ignored;
    fs::remove_all(path_, ignored);
  }
  std::string str() const { return path_.string(); }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

uint64_t le(const std::string& bytes, size_t offset, int count) {
  uint64_t value = 0;
  for (int i = count - 1; i >= 0; --i) value = (value << 8) | static_cast<unsigned char>(bytes[offset + i]);
  return value;
}

// Offsets of each record's start in a TFRecord file (trusting the lengths).
std::vector<size_t> record_offsets(const std::string& bytes) {
  std::vector<size_t> offsets;
  for (size_t at = 0; at + 12 <= bytes.size(); at += 16 + le(bytes, at, 8)) offsets.push_back(at);
  return offsets;
}

std::vector<std::string> split(const std::string& line, char sep = '\t') {
  std::vector<std::string> parts;
  std::stringstream in(line);
  for (std::string part; std::getline(in, part, sep);) parts.push_back(part);
  return parts;
}

const char* const kReader = AMP_SOURCE_DIR "/tests/python/read_tensorboard.py";

// Returns why Python's tensorboard package can't be used here, or "" if it can.
std::string tensorboard_missing() {
  static const std::string why = [] {
    if (std::system("python3 -c 'import tensorboard' > /dev/null 2>&1") == 0) return std::string();
    return std::string("Python's tensorboard package is not installed (scripts/setup.sh installs it): "
                       "python3 -c 'import tensorboard' failed");
  }();
  return why;
}

#define SKIP_WITHOUT_PYTHON_TENSORBOARD()                              \
  do {                                                                 \
    if (const auto why = tensorboard_missing(); !why.empty()) GTEST_SKIP() << why; \
  } while (0)

// Runs read_tensorboard.py MODE PATH and returns its output lines.
std::vector<std::string> read_back(const std::string& mode, const std::string& path) {
  const std::string command = "python3 '" + std::string(kReader) + "' " + mode + " '" + path + "' 2>&1";
  FILE* pipe = ::popen(command.c_str(), "r");
  EXPECT_NE(pipe, nullptr) << command;
  std::string output;
  char buffer[4096];
  while (pipe && std::fgets(buffer, sizeof buffer, pipe)) output += buffer;
  const int status = pipe ? ::pclose(pipe) : -1;
  EXPECT_EQ(status, 0) << command << "\n" << output;
  std::vector<std::string> lines;
  std::stringstream in(output);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

struct Scalar {
  std::string tag;
  int64_t step;
  double value;
  double wall_time;
};

std::vector<Scalar> scalars_of(const std::vector<std::string>& lines) {
  std::vector<Scalar> out;
  for (const auto& line : lines) {
    const auto f = split(line);
    if (f.size() == 5 && f[0] == "scalar") out.push_back({f[1], std::stoll(f[2]), std::stod(f[3]), std::stod(f[4])});
  }
  return out;
}

std::string only_event_file(const std::string& dir) {
  std::vector<std::string> files;
  for (const auto& entry : fs::directory_iterator(dir)) files.push_back(entry.path().string());
  EXPECT_EQ(files.size(), 1u) << dir;
  return files.empty() ? std::string() : files[0];
}

// Captures std::cerr while alive.
class CerrCapture {
 public:
  CerrCapture() : old_(std::cerr.rdbuf(captured_.rdbuf())) {}
  ~CerrCapture() { std::cerr.rdbuf(old_); }
  std::string text() const { return captured_.str(); }

 private:
  std::stringstream captured_;
  std::streambuf* old_;
};

// ---- CRC-32C and TFRecord framing ----

TEST(TensorBoardTest, Crc32cMatchesKnownVectors) {
  using amp::detail::crc32c;
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);  // the CRC catalogue's check value
  EXPECT_EQ(crc32c("", 0), 0u);
  // RFC 3720 (iSCSI), appendix B.4.
  const std::string zeros(32, '\0'), ones(32, '\xFF');
  std::string ascending, descending;
  for (int i = 0; i < 32; ++i) {
    ascending.push_back(static_cast<char>(i));
    descending.push_back(static_cast<char>(31 - i));
  }
  EXPECT_EQ(crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);
  EXPECT_EQ(crc32c(ones.data(), ones.size()), 0x62A8AB43u);
  EXPECT_EQ(crc32c(ascending.data(), ascending.size()), 0x46DD794Eu);
  EXPECT_EQ(crc32c(descending.data(), descending.size()), 0x113FDB5Cu);
  // Continuing a CRC over a second piece equals the CRC of the whole.
  EXPECT_EQ(crc32c("56789", 5, crc32c("1234", 4)), 0xE3069283u);
}

TEST(TensorBoardTest, MaskedCrcRotatesRightBy15AndAddsTheTfRecordConstant) {
  const uint32_t crc = 0xE3069283u;
  const uint32_t masked = ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
  EXPECT_EQ(amp::detail::masked_crc32c("123456789", 9), masked);
  EXPECT_EQ(masked, 0xC78AB0E5u);  // = tensorboard.compat.tensorflow_stub masked_crc32c(b"123456789")
  EXPECT_EQ(amp::detail::masked_crc32c("", 0), 0xa282ead8u);
}

TEST(TensorBoardTest, FramesRecordsAsTfRecords) {
  const std::string payload = "event bytes";
  const std::string record = amp::detail::tfrecord(payload);
  ASSERT_EQ(record.size(), 8 + 4 + payload.size() + 4);
  EXPECT_EQ(le(record, 0, 8), payload.size());
  EXPECT_EQ(le(record, 8, 4), amp::detail::masked_crc32c(record.data(), 8));
  EXPECT_EQ(record.substr(12, payload.size()), payload);
  EXPECT_EQ(le(record, 12 + payload.size(), 4), amp::detail::masked_crc32c(payload.data(), payload.size()));
}

TEST(TensorBoardTest, WritesTensorBoardsFileNameAndFileVersionFirst) {
  TempDir dir;
  std::string path;
  {
    amp::SummaryWriter writer(amp::SummaryWriterOptions(dir / "run").filename_suffix(".amp"));
    path = writer.file_path();
    EXPECT_TRUE(writer.logging());
    EXPECT_EQ(writer.log_dir(), dir / "run");
  }
  const std::string name = fs::path(path).filename().string();
  EXPECT_TRUE(std::regex_match(name, std::regex(R"(events\.out\.tfevents\.\d{10}\.[^/]+\.)" +
                                                std::to_string(::getpid()) + R"(\.\d+\.amp)")))
      << name;
  const std::string bytes = read_bytes(path);
  ASSERT_EQ(record_offsets(bytes).size(), 1u);
  // Event { wall_time (field 1, fixed64), step 0 (field 2, varint), file_version (field 3) = "brain.Event:2" }
  const std::string event = bytes.substr(12, le(bytes, 0, 8));
  ASSERT_EQ(event.size(), 1 + 8 + 2 + 2 + 13u);
  EXPECT_EQ(event[0], '\x09');
  EXPECT_EQ(event.substr(9), std::string("\x10\x00\x1a\x0d", 4) + "brain.Event:2");
  double wall_time;
  const uint64_t bits = le(event, 1, 8);
  std::memcpy(&wall_time, &bits, sizeof wall_time);
  EXPECT_NEAR(wall_time, static_cast<double>(std::time(nullptr)), 60.0);
  // Two writers in one process and second never share a file.
  amp::SummaryWriter a(dir / "run"), b(dir / "run");
  EXPECT_NE(a.file_path(), b.file_path());
}

// ---- Read back by TensorBoard ----

TEST(TensorBoardTest, PythonReadsBackEveryScalarTagAndStepExactly) {
  SKIP_WITHOUT_PYTHON_TENSORBOARD();
  TempDir dir;
  const std::vector<std::string> tags = {"train_loss", "val/acc", "amp/loss_scale/0", "損失 (fp16)", "with space"};
  const std::vector<int64_t> steps = {0, 1, 7, int64_t{1} << 40, -3};
  const std::vector<double> values = {0.1, 65536.0, 1e-8, -3.5, 1e30, 1e39 /* float32: inf */, -0.0, 3.4028234663852886e38};
  std::vector<Scalar> written;
  {
    amp::SummaryWriter writer(amp::SummaryWriterOptions(dir.str()).max_queue(3));
    size_t k = 0;
    for (const auto& tag : tags) {
      for (int64_t step : steps) {
        const double value = values[k++ % values.size()] * (1 + static_cast<double>(k) / 7);
        const double wall_time = 1700000000.25 + static_cast<double>(k);
        writer.add_scalar(tag, value, step, wall_time);
        written.push_back({tag, step, static_cast<double>(static_cast<float>(value)), wall_time});
      }
    }
  }
  const auto lines = read_back("scalars", dir.str());
  ASSERT_FALSE(lines.empty());
  EXPECT_EQ(lines[0], "file_version\t2.0");
  auto read = scalars_of(lines);
  ASSERT_EQ(read.size(), written.size());
  // The reader lists tags sorted and each tag's events in the order written.
  std::stable_sort(written.begin(), written.end(), [](const Scalar& a, const Scalar& b) { return a.tag < b.tag; });
  for (size_t i = 0; i < read.size(); ++i) {
    EXPECT_EQ(read[i].tag, written[i].tag) << i;
    EXPECT_EQ(read[i].step, written[i].step) << read[i].tag;
    EXPECT_EQ(std::signbit(read[i].value), std::signbit(written[i].value)) << read[i].tag;
    EXPECT_EQ(read[i].value, written[i].value) << read[i].tag << " step " << read[i].step;
    EXPECT_EQ(read[i].wall_time, written[i].wall_time) << read[i].tag;
  }
  // Every CRC checks out in TensorBoard's record reader.
  const auto records = read_back("records", only_event_file(dir.str()));
  ASSERT_FALSE(records.empty());
  EXPECT_EQ(records.back(), "end\tok");
  EXPECT_EQ(records.size(), 1 + 1 + written.size());  // file_version, the scalars, "end"
}

TEST(TensorBoardTest, PythonReadsHistogramsWithTheirBuckets) {
  SKIP_WITHOUT_PYTHON_TENSORBOARD();
  TempDir dir;
  {
    amp::SummaryWriter writer(dir.str());
    writer.add_histogram("grad_magnitude", {0.0, 1.0, 1.0, 2.0, 3.0, 4.0, INFINITY, NAN}, 5, 4);
    writer.add_histogram("constant", {2.5, 2.5}, 6);
    writer.add_histogram("all_inf", {INFINITY, -INFINITY}, 7);  // nothing finite: not written
  }
  std::vector<std::vector<std::string>> rows;
  for (const auto& line : read_back("scalars", dir.str())) {
    if (line.rfind("histogram\t", 0) == 0) rows.push_back(split(line));
  }
  ASSERT_EQ(rows.size(), 2u);
  // constant: one bucket ending at the value.
  EXPECT_EQ(rows[0], (std::vector<std::string>{"histogram", "constant", "6", "2.5", "2.5", "2.0", "5.0", "12.5", "2.5", "2.0"}));
  // grad_magnitude: the six finite values in 4 buckets (0, 1], (1, 2], (2, 3], (3, 4], the first from min.
  EXPECT_EQ(rows[1], (std::vector<std::string>{"histogram", "grad_magnitude", "5", "0.0", "4.0", "6.0", "11.0", "31.0",
                                               "1.0,2.0,3.0,4.0", "3.0,1.0,1.0,1.0"}));
}

TEST(TensorBoardTest, PythonDetectsACorruptedCrc) {
  SKIP_WITHOUT_PYTHON_TENSORBOARD();
  TempDir dir;
  std::string path;
  {
    amp::SummaryWriter writer(dir / "run");
    for (int step = 0; step < 5; ++step) writer.add_scalar("loss", 1.0 / (step + 1), step);
    path = writer.file_path();
  }
  const std::string good = read_bytes(path);
  const auto offsets = record_offsets(good);
  ASSERT_EQ(offsets.size(), 6u);

  // One flipped bit in the third scalar's event bytes.
  std::string bad = good;
  bad[offsets[3] + 12 + 5] ^= 0x01;
  write_bytes(path, bad);
  auto records = read_back("records", path);
  ASSERT_EQ(records.size(), 4u);  // file_version, two scalars, then the error
  EXPECT_NE(records.back().find("failed event crc32 check"), std::string::npos) << records.back();
  auto scalars = scalars_of(read_back("scalars", dir / "run"));
  ASSERT_EQ(scalars.size(), 2u);  // TensorBoard stops at the bad record and keeps the ones before
  EXPECT_EQ(scalars[1].value, static_cast<double>(0.5f));

  // One flipped bit in the fourth scalar's length.
  bad = good;
  bad[offsets[4]] ^= 0x01;
  write_bytes(path, bad);
  records = read_back("records", path);
  ASSERT_EQ(records.size(), 5u);
  EXPECT_NE(records.back().find("failed header crc32 check"), std::string::npos) << records.back();
}

TEST(TensorBoardTest, PythonSkipsATruncatedLastRecordAndKeepsTheEarlierOnes) {
  SKIP_WITHOUT_PYTHON_TENSORBOARD();
  TempDir dir;
  std::string path;
  {
    amp::SummaryWriter writer(dir / "run");
    for (int step = 0; step < 4; ++step) writer.add_scalar("loss", step + 0.5, step);
    path = writer.file_path();
  }
  const std::string bytes = read_bytes(path);
  const auto offsets = record_offsets(bytes);
  ASSERT_EQ(offsets.size(), 5u);
  // Cut inside the last record's CRC, inside its event, and inside its length: what a crash mid-write leaves.
  for (const size_t cut : {bytes.size() - 2, offsets[4] + 15, offsets[4] + 3}) {
    write_bytes(path, bytes.substr(0, cut));
    const auto records = read_back("records", path);
    ASSERT_EQ(records.size(), 5u) << cut;
    EXPECT_NE(records.back().find("truncated record"), std::string::npos) << records.back();
    const auto scalars = scalars_of(read_back("scalars", dir / "run"));
    ASSERT_EQ(scalars.size(), 3u) << cut;
    for (int step = 0; step < 3; ++step) {
      EXPECT_EQ(scalars[step].step, step);
      EXPECT_EQ(scalars[step].value, step + 0.5);
    }
  }
}

TEST(TensorBoardTest, FlushedRecordsAreWholeOnDiskWhileTheWriterIsOpen) {
  TempDir dir;
  amp::SummaryWriter writer(amp::SummaryWriterOptions(dir.str()).max_queue(3).flush_secs(3600));
  const std::string path = writer.file_path();
  EXPECT_EQ(record_offsets(read_bytes(path)).size(), 1u);  // file_version is written at once
  writer.add_scalar("loss", 1.0, 1);
  writer.add_scalar("loss", 2.0, 2);
  EXPECT_EQ(record_offsets(read_bytes(path)).size(), 1u);  // two pending: below max_queue
  writer.add_scalar("loss", 3.0, 3);                         // the third flushes all three
  EXPECT_EQ(record_offsets(read_bytes(path)).size(), 4u);
  writer.add_scalar("loss", 4.0, 4);
  writer.flush();  // what the examples do each epoch
  const std::string bytes = read_bytes(path);
  const auto offsets = record_offsets(bytes);
  ASSERT_EQ(offsets.size(), 5u);
  EXPECT_EQ(offsets.back() + 16 + le(bytes, offsets.back(), 8), bytes.size());  // no partial record
  for (size_t at : offsets) {
    const size_t n = le(bytes, at, 8);
    EXPECT_EQ(le(bytes, at + 8, 4), amp::detail::masked_crc32c(bytes.data() + at, 8));
    EXPECT_EQ(le(bytes, at + 12 + n, 4), amp::detail::masked_crc32c(bytes.data() + at + 12, n));
  }
  // A writer that is never destroyed (a crash) leaves exactly the flushed records.
  auto* leaked = new amp::SummaryWriter(amp::SummaryWriterOptions(dir / "crash").max_queue(100));
  leaked->add_scalar("loss", 1.0, 1);
  leaked->flush();
  leaked->add_scalar("loss", 2.0, 2);  // pending when the process "dies"
  EXPECT_EQ(record_offsets(read_bytes(leaked->file_path())).size(), 2u);
  delete leaked;  // (a test must not leak; the check above is what a crash leaves)
}

TEST(TensorBoardTest, AmpScalarsHoldTheLossScalePerLossAndSkippedSteps) {
  SKIP_WITHOUT_PYTHON_TENSORBOARD();
  TempDir dir;
  torch::manual_seed(0);
  amp_test::Mlp net;
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  auto [model, optimizer] = amp::initialize(net, std::move(sgd), amp::Options("O1").low_precision_dtype(torch::kBFloat16).num_losses(2).verbosity(0));
  const auto x = torch::randn({4, 8});
  optimizer.zero_grad();
  {
    auto scaled = amp::scale_loss(model(x).sum() * std::numeric_limits<float>::infinity(), optimizer,
                                  amp::ScaleLossOptions().loss_id(1));
    scaled.backward();
  }
  optimizer.step();  // skipped: loss 1 overflowed
  {
    amp::SummaryWriter writer(dir.str());
    amp::add_amp_scalars(writer, optimizer, 1);
  }
  std::map<std::string, double> got;
  for (const auto& s : scalars_of(read_back("scalars", dir.str()))) got[s.tag] = s.value;
  EXPECT_EQ(got, (std::map<std::string, double>{
                     {"amp/loss_scale/0", 65536.0}, {"amp/loss_scale/1", 32768.0}, {"amp/skipped_steps", 1.0}}));
}

// ---- Errors ----

TEST(TensorBoardErrorsTest, UnwritableDirectoryNamesItAndTheFix) {
  TempDir dir;
  write_bytes(dir / "file", "not a directory");
  const std::string log_dir = dir / "file/run";
  ASSERT_THROWS_WITH(amp::SummaryWriter{log_dir}, "amp::SummaryWriter: cannot create the log directory '" + log_dir + "'");
  ASSERT_THROWS_WITH(amp::SummaryWriter{log_dir}, "Give a directory you can write to (log_dir, or --tensorboard DIR");
  ASSERT_THROWS_WITH(amp::SummaryWriter{log_dir}, "on_error_continue(true)");
  ASSERT_THROWS_WITH(amp::SummaryWriter{dir / "file"}, "cannot create the log directory '" + (dir / "file") + "'");
  if (::geteuid() != 0) {  // root writes anywhere
    fs::create_directories(dir / "read_only");
    fs::permissions(dir / "read_only", fs::perms::owner_read | fs::perms::owner_exec);
    ASSERT_THROWS_WITH(amp::SummaryWriter{dir / "read_only"}, "cannot create the event file");
  }
}

TEST(TensorBoardErrorsTest, BadTagsNameTheTagAndTheRule) {
  TempDir dir;
  amp::SummaryWriter writer(dir.str());
  ASSERT_THROWS_WITH(writer.add_scalar("", 1.0, 0), "amp::SummaryWriter: add_scalar: the tag is empty. Tags are non-empty UTF-8");
  ASSERT_THROWS_WITH(writer.add_scalar("train\nloss", 1.0, 0),
                     "the tag 'train\\nloss' holds the control character U+000A at byte 5. Tags are non-empty UTF-8 text "
                     "without control characters, such as 'train_loss' or 'amp/loss_scale/0'. Rename the tag.");
  ASSERT_THROWS_WITH(writer.add_scalar("a\tb", 1.0, 0), "control character U+0009");
  ASSERT_THROWS_WITH(writer.add_scalar("del\x7f", 1.0, 0), "'del\\x7F' holds the control character U+007F");
  ASSERT_THROWS_WITH(writer.add_scalar("c1\xc2\x85", 1.0, 0), "control character U+0085 at byte 2");
  ASSERT_THROWS_WITH(writer.add_scalar("latin1 \xe9t\xe9", 1.0, 0), "is not valid UTF-8 (byte 0xE9 at offset 7)");
  ASSERT_THROWS_WITH(writer.add_scalar("overlong \xc0\xaf", 1.0, 0), "is not valid UTF-8 (byte 0xC0 at offset 9)");
  ASSERT_THROWS_WITH(writer.add_scalar("surrogate \xed\xa0\x80", 1.0, 0), "is not valid UTF-8");
  ASSERT_THROWS_WITH(writer.add_histogram("", {1.0}, 0), "add_histogram: the tag is empty");
  ASSERT_THROWS_WITH(writer.add_histogram("h", {1.0}, 0, 0), "add_histogram('h'): bins must be in [1, 10000], got 0.");
  // A bad tag stops nothing: the writer goes on.
  EXPECT_TRUE(writer.logging());
  writer.add_scalar("unicode/損失 ok", 1.0, 0);
  writer.close();
  EXPECT_FALSE(writer.logging());
  ASSERT_THROWS_WITH(writer.add_scalar("late", 1.0, 1), "add_scalar: the writer of '" + dir.str() + "' has stopped (it was closed)");
}

TEST(TensorBoardErrorsTest, OnErrorContinueWarnsOnceAndStopsLogging) {
  TempDir dir;
  write_bytes(dir / "file", "not a directory");
  {
    CerrCapture cerr;
    amp::SummaryWriter writer(amp::SummaryWriterOptions(dir / "file/run").on_error_continue(true));
    EXPECT_FALSE(writer.logging());
    EXPECT_EQ(writer.file_path(), "");
    writer.add_scalar("loss", 1.0, 0);
    writer.add_histogram("h", {1.0}, 0);
    writer.flush();
    writer.close();
    const std::string text = cerr.text();
    EXPECT_NE(text.find("amp::SummaryWriter: warning: cannot create the log directory '" + (dir / "file/run") + "'"),
              std::string::npos)
        << text;
    EXPECT_NE(text.find("stops here; training continues (on_error_continue)."), std::string::npos) << text;
    EXPECT_EQ(text.find("warning", text.find("warning") + 1), std::string::npos) << "more than one warning: " << text;
  }
  {
    CerrCapture cerr;
    std::string path;
    {
      amp::SummaryWriter writer(amp::SummaryWriterOptions(dir / "run").on_error_continue(true).max_queue(1));
      path = writer.file_path();
      writer.add_scalar("loss", 1.0, 0);
      writer.add_scalar("bad\ntag", 1.0, 1);  // warns and stops logging
      writer.add_scalar("bad\ntag", 1.0, 2);
      writer.add_scalar("loss", 2.0, 3);       // not written
      EXPECT_FALSE(writer.logging());
    }
    EXPECT_EQ(record_offsets(read_bytes(path)).size(), 2u);  // file_version, the first loss
    const std::string text = cerr.text();
    EXPECT_NE(text.find("warning: add_scalar: the tag 'bad\\ntag' holds the control character U+000A"), std::string::npos)
        << text;
    EXPECT_EQ(text.find("warning", text.find("warning") + 1), std::string::npos) << "more than one warning: " << text;
  }
}

TEST(TensorBoardErrorsTest, BadOptionsAreRejected) {
  ASSERT_THROWS_WITH(amp::SummaryWriter{amp::SummaryWriterOptions("")}, "log_dir is empty. Give the run's directory");
  TempDir dir;
  ASSERT_THROWS_WITH(amp::SummaryWriter(amp::SummaryWriterOptions(dir.str()).max_queue(0)),
                     "max_queue must be 1 or more (1 writes every record at once), got 0.");
  ASSERT_THROWS_WITH(amp::SummaryWriter(amp::SummaryWriterOptions(dir.str()).flush_secs(-1)),
                     "flush_secs must be 0 or more seconds and finite");
  ASSERT_THROWS_WITH(amp::SummaryWriter(amp::SummaryWriterOptions(dir.str()).filename_suffix("a/b")),
                     "filename_suffix 'a/b' holds a '/'");
  EXPECT_TRUE(fs::is_empty(dir.str()));  // nothing created on a refused option
}

}  // namespace
