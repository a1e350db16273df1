#pragma once
// A live progress line for training loops (what tqdm gives Python users): a bar, the step count,
// the running loss and the throughput, redrawn in place on a terminal and silent otherwise.

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>

class ProgressBar {
 public:
  ProgressBar(std::string label, int64_t total_steps, bool enabled = isatty(fileno(stderr)) != 0)
      : label_(std::move(label)), total_(total_steps), enabled_(enabled), start_(std::chrono::steady_clock::now()) {}

  /// Records one finished step of `items` examples with loss `loss` and redraws.
  void step(int64_t items, double loss) {
    ++done_;
    items_ += items;
    loss_sum_ += loss;
    if (!enabled_) return;
    constexpr int kWidth = 28;
    const int filled = static_cast<int>(kWidth * done_ / std::max<int64_t>(total_, 1));
    std::fprintf(stderr, "\r%s [%s%s] %lld/%lld loss %.4f %.0f img/s ", label_.c_str(), std::string(filled, '#').c_str(),
                 std::string(kWidth - filled, '.').c_str(), static_cast<long long>(done_),
                 static_cast<long long>(total_), mean_loss(), items_per_second());
    std::fflush(stderr);
  }

  /// Clears the line (the caller prints the epoch's summary instead).
  void finish() {
    if (enabled_) std::fprintf(stderr, "\r%*s\r", 100, "");
  }

  double mean_loss() const { return done_ ? loss_sum_ / static_cast<double>(done_) : 0.0; }
  double seconds() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(); }
  double items_per_second() const { return static_cast<double>(items_) / std::max(seconds(), 1e-9); }

 private:
  std::string label_;
  int64_t total_;
  bool enabled_;
  std::chrono::steady_clock::time_point start_;
  int64_t done_ = 0;
  int64_t items_ = 0;
  double loss_sum_ = 0;
};
