#pragma once
// Timing helpers shared by the benchmark programs (chorus and its peers): warm-up, repeats,
// median/min/max, and one JSON record per measurement.
#include <algorithm>
#include <chrono>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace bench {

/// "a,b,c" -> {"a", "b", "c"} (for the comma-separated command-line options).
inline std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

struct Stats {
  double median_ms = 0, min_ms = 0, max_ms = 0;
  int repeats = 0;
};

/// Warm-up lasts at least this long (and at least `warmup` calls): a workload of microseconds
/// (the tutorial: 200 epochs in 3 ms) measured right after the process started caught start-up
/// transients, every row of one run in four 1.6x slower.
inline constexpr double kMinWarmupMs = 200;

/// Runs `fn` untimed `warmup` times (and, with the default clock, for at least kMinWarmupMs), then
/// `repeats` times timed by `clock` (which returns the milliseconds one call took; the default
/// times the host wall clock).
inline Stats measure(const std::function<void()>& fn, int warmup, int repeats,
                     std::function<double(const std::function<void()>&)> clock = {}) {
  const double min_warmup_ms = clock ? 0 : kMinWarmupMs;  // a GPU clock's caller paces its own warm-up
  if (!clock) {
    clock = [](const std::function<void()>& f) {
      auto t0 = std::chrono::steady_clock::now();
      f();
      return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    };
  }
  const auto warm_start = std::chrono::steady_clock::now();
  for (int i = 0; i < warmup ||
                  std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - warm_start).count() <
                      min_warmup_ms;
       ++i)
    fn();
  std::vector<double> t;
  for (int i = 0; i < repeats; ++i) t.push_back(clock(fn));
  std::sort(t.begin(), t.end());
  Stats s;
  s.repeats = repeats;
  s.min_ms = t.front();
  s.max_ms = t.back();
  s.median_ms = t.size() % 2 ? t[t.size() / 2] : 0.5 * (t[t.size() / 2 - 1] + t[t.size() / 2]);
  return s;
}

/// FLOPs of one training step of an MLP whose input needs no gradient: forward 2·B·in·out per
/// layer, weight gradient the same, input gradient the same except for the first layer.
inline double mlp_step_flops(double batch, const std::vector<std::pair<int, int>>& layers) {
  double f = 0;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const double mac = batch * layers[i].first * layers[i].second;
    f += 2 * mac * (i == 0 ? 2 : 3);
  }
  return f;
}

/// FLOPs of one ResNet-20 (CIFAR, 32x32 input) training step: 40,551,040 multiply-adds per
/// image in the convolutions and the classifier, times 2 FLOPs, times 3 (forward, input
/// gradient, weight gradient). Batch norms, ReLUs and pooling are not counted.
inline double resnet20_step_flops(double batch) { return 6.0 * 40551040.0 * batch; }

}  // namespace bench
