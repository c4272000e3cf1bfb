#pragma once
// Timing helpers shared by the benchmark programs (chorus and its peers): warm-up, rounds,
// paired ratios with their spread. No JSON and no processes here (benchmarks/peer.hpp), so
// benchmarks/test_bench_util.cpp tests this logic alone.
//
// Note [paired rounds]: on a shared machine the speed available to a process drifts by tens of
// percent within a minute, so a comparison of "all of A, then all of B" measures the drift as
// much as A and B. Every comparison is therefore made of rounds: per workload, each round runs
// every configuration (chorus's and the peer's) once, A B A B … (reversed every other round, so
// a steady drift favours neither side), and each ratio is taken within a round, pair by pair.
// The figure reported is the median of those per-round ratios, with their min–max.
// benchmarks/bench_rounds.py is the same logic for the Python side.
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <functional>
#include <sstream>
#include <stdexcept>
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

/// The median (the mean of the middle two for an even count); throws for no values.
inline double median(std::vector<double> v) {
  if (v.empty()) throw std::invalid_argument("median of no values");
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/// A figure with its spread: the median of some values, and their min and max.
struct Spread {
  double median = 0, min = 0, max = 0;
  std::size_t n = 0;
};

inline Spread spread(const std::vector<double>& v) {
  Spread s;
  s.median = median(v);
  s.min = *std::min_element(v.begin(), v.end());
  s.max = *std::max_element(v.begin(), v.end());
  s.n = v.size();
  return s;
}

/// num[i] / den[i] for each round i (Note [paired rounds]): both sides must have the same rounds,
/// and a time must be positive.
inline std::vector<double> paired_ratios(const std::vector<double>& num, const std::vector<double>& den) {
  if (num.size() != den.size() || num.empty())
    throw std::invalid_argument("paired ratios need the same number of rounds on both sides (got " +
                                std::to_string(num.size()) + " and " + std::to_string(den.size()) + ")");
  std::vector<double> r;
  for (std::size_t i = 0; i < num.size(); ++i) {
    if (!(num[i] > 0) || !(den[i] > 0)) throw std::invalid_argument("paired ratios of a non-positive time");
    r.push_back(num[i] / den[i]);
  }
  return r;
}

/// The order in which round `round` runs a + b configurations: indices 0..a-1 are one side
/// (chorus), a..a+b-1 the other (the peer), alternating a0 b0 a1 b1 … with the longer side's
/// rest at the end; every odd round runs the same order backwards (Note [paired rounds]).
inline std::vector<std::size_t> round_order(std::size_t a, std::size_t b, int round) {
  std::vector<std::size_t> order;
  for (std::size_t i = 0; i < std::max(a, b); ++i) {
    if (i < a) order.push_back(i);
    if (i < b) order.push_back(a + i);
  }
  if (round % 2) std::reverse(order.begin(), order.end());
  return order;
}

/// Milliseconds one call of `f` took; the default times the host's steady clock (a GPU
/// benchmark passes one that times CUDA events).
using Clock = std::function<double(const std::function<void()>&)>;

inline double wall_ms(const std::function<void()>& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

/// The first round's warm-up lasts at least this long (and at least `warmup` calls): a workload
/// of microseconds (the tutorial: 200 epochs in 3 ms) measured right after the process started
/// caught start-up transients, every row of one run in four 1.6x slower.
inline constexpr double kMinWarmupMs = 200;
/// Every later round warms up for at least one call and this long: the configuration that ran
/// just before (another process's, maybe) leaves its BLAS threads spinning for a while, and
/// caches full of its own data.
inline constexpr double kRoundWarmupMs = 100;

/// One configuration measured in rounds (Note [paired rounds]).
class Timed {
 public:
  /// `warmup`: untimed calls before the first round. With a custom clock (a GPU's) the minimum
  /// warm-up durations do not apply: the caller paces its own warm-up by `warmup`.
  explicit Timed(std::function<void()> step, int warmup = 2, Clock clock = {})
      : step_(std::move(step)), warmup_(warmup), wall_(!clock), clock_(clock ? std::move(clock) : Clock(wall_ms)) {}

  /// Warms up, then returns the times of `reps` calls in the order they ran.
  std::vector<double> round(int reps) {
    const int calls = first_ ? std::max(1, warmup_) : 1;
    const double min_ms = !wall_ ? 0 : first_ ? kMinWarmupMs : kRoundWarmupMs;
    first_ = false;
    const auto start = std::chrono::steady_clock::now();
    auto elapsed_ms = [&] {
      return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    };
    for (int i = 0; i < calls || elapsed_ms() < min_ms; ++i) step_();
    std::vector<double> t;
    for (int i = 0; i < reps; ++i) t.push_back(clock_(step_));
    return t;
  }

 private:
  std::function<void()> step_;
  int warmup_;
  bool wall_, first_ = true;
  Clock clock_;
};

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

/// FLOPs of one training step of the LSTM language model: per layer and position 4·hidden·(in +
/// hidden) multiply-adds (input projection and recurrence), the head hidden·vocab; times 2 FLOPs,
/// times 3 (forward, input gradient, weight gradient). Gates, embedding and softmax not counted.
inline double lstm_lm_step_flops(double batch, double seq, double in, double hidden, int layers, double vocab) {
  double mac = 0;
  for (int l = 0; l < layers; ++l) mac += 4 * hidden * ((l == 0 ? in : hidden) + hidden);
  return 6.0 * batch * seq * (mac + hidden * vocab);
}

/// FLOPs of one training step of the transformer language model: per layer and position
/// d·3d (q, k, v) + d·d (output projection) + 2·d·ff (feed-forward) multiply-adds, plus 2·L·d for
/// the scores and the weighted values (the whole L x L, masked or not), the head d·vocab; times
/// 2 FLOPs, times 3. Softmax, layer norms and embeddings are not counted.
inline double transformer_lm_step_flops(double batch, double seq, double d, double ff, int layers, double vocab) {
  const double per_layer = 4 * d * d + 2 * d * ff + 2 * seq * d;
  return 6.0 * batch * seq * (layers * per_layer + d * vocab);
}

}  // namespace bench
