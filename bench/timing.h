#pragma once
// How the benchmarks time: medians of repetitions after warm-up, callables in alternation so drift on a noisy VM hits
// them alike (amp_bench, amp_muon_bench).

#include <algorithm>
#include <chrono>
#include <functional>
#include <vector>

namespace bench {

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

/// Seconds per call of each callable, timed A B C A B C ...: after two warm-up rounds, the median of `reps` repetitions
/// of K calls each (K sized to ~rep_seconds for the first, at most 2000).
inline std::vector<double> time_alternating(const std::vector<std::function<void()>>& fs, int reps,
                                            double rep_seconds = 0.3) {
  using Clock = std::chrono::steady_clock;
  for (int warm = 0; warm < 2; ++warm) {
    for (const auto& f : fs) f();
  }
  auto start = Clock::now();
  fs.front()();
  const double once = std::chrono::duration<double>(Clock::now() - start).count();
  const int k = std::max(1, std::min(2000, static_cast<int>(rep_seconds / std::max(once, 1e-7))));
  std::vector<std::vector<double>> samples(fs.size());
  for (int r = 0; r < reps; ++r) {
    for (size_t j = 0; j < fs.size(); ++j) {
      start = Clock::now();
      for (int i = 0; i < k; ++i) fs[j]();
      samples[j].push_back(std::chrono::duration<double>(Clock::now() - start).count() / k);
    }
  }
  std::vector<double> out;
  for (auto& s : samples) out.push_back(median(std::move(s)));
  return out;
}

}  // namespace bench
