// The benchmarks' round logic (Note [paired rounds] in bench_util.hpp): medians, spreads, ratios
// taken round by round, the alternating order, and the records and ratios written as JSON.
// Nothing here is timed.
#include <gtest/gtest.h>

#include <stdexcept>

#include "bench_util.hpp"
#include "peer.hpp"

TEST(BenchRounds, MedianOfOddAndEvenCounts) {
  EXPECT_DOUBLE_EQ(bench::median({3, 1, 2}), 2);
  EXPECT_DOUBLE_EQ(bench::median({4, 1, 3, 2}), 2.5);
  EXPECT_THROW(bench::median({}), std::invalid_argument);
}

TEST(BenchRounds, RatiosArePairedRoundByRoundNotMediansOfEachSide) {
  // The machine got twice as slow in rounds 2 and 3: per round chorus is 0.5x the peer
  // throughout, while the two sides' own spreads (1-2 ms, 2-4 ms) would allow 0.25x-1x.
  const std::vector<double> chorus = {1, 1, 2, 2, 1}, peer = {2, 2, 4, 4, 2};
  const auto r = bench::paired_ratios(chorus, peer);
  ASSERT_EQ(r.size(), 5u);
  for (double x : r) EXPECT_DOUBLE_EQ(x, 0.5);
  const auto s = bench::spread(r);
  EXPECT_DOUBLE_EQ(s.median, 0.5);
  EXPECT_DOUBLE_EQ(s.min, 0.5);
  EXPECT_DOUBLE_EQ(s.max, 0.5);
  // Pairs, not sorted values: round 1's slow chorus step against round 1's fast peer step.
  const auto q = bench::paired_ratios({1, 4, 4}, {2, 2, 8});
  EXPECT_EQ(q, (std::vector<double>{0.5, 2, 0.5}));
}

TEST(BenchRounds, SpreadIsTheMinAndMaxOfThePerRoundRatios) {
  const auto s = bench::spread(bench::paired_ratios({1, 3, 2}, {2, 2, 2}));
  EXPECT_DOUBLE_EQ(s.median, 1.0);
  EXPECT_DOUBLE_EQ(s.min, 0.5);
  EXPECT_DOUBLE_EQ(s.max, 1.5);
  EXPECT_EQ(s.n, 3u);
}

TEST(BenchRounds, PairingRefusesUnequalRoundsAndNonPositiveTimes) {
  EXPECT_THROW(bench::paired_ratios({1, 2}, {1}), std::invalid_argument);
  EXPECT_THROW(bench::paired_ratios({}, {}), std::invalid_argument);
  EXPECT_THROW(bench::paired_ratios({1}, {0}), std::invalid_argument);
}

TEST(BenchRounds, OrderAlternatesSidesAndReversesEveryOtherRound) {
  using V = std::vector<std::size_t>;
  // 4 chorus configurations (0-3) and 3 peer ones (4-6).
  EXPECT_EQ(bench::round_order(4, 3, 0), (V{0, 4, 1, 5, 2, 6, 3}));
  EXPECT_EQ(bench::round_order(4, 3, 1), (V{3, 6, 2, 5, 1, 4, 0}));
  EXPECT_EQ(bench::round_order(4, 3, 2), bench::round_order(4, 3, 0));
  EXPECT_EQ(bench::round_order(1, 3, 0), (V{0, 1, 2, 3}));
  EXPECT_EQ(bench::round_order(2, 0, 0), (V{0, 1}));
}

TEST(BenchRounds, RunRoundsAlternatesTheSides) {
  std::vector<std::string> log;
  auto entry = [&](std::string name, double ms) {
    return bench::Entry{{{"config", name}}, [&log, name, ms](int reps) {
                          log.push_back(name);
                          return std::vector<double>(reps, ms);
                        }};
  };
  const auto samples = bench::run_rounds({entry("a0", 1), entry("a1", 2)}, {entry("b0", 3)}, 3, 2);
  EXPECT_EQ(log, (std::vector<std::string>{"a0", "b0", "a1", "a1", "b0", "a0", "a0", "b0", "a1"}));
  ASSERT_EQ(samples.size(), 3u);
  EXPECT_EQ(samples[2], (std::vector<std::vector<double>>(3, std::vector<double>{3, 3})));
}

TEST(BenchRounds, RecordKeepsEveryRoundAndItsMedians) {
  const auto r =
      bench::make_record({{"impl", "chorus"}, {"flops", 2e9}}, {{1, 9, 2}, {4, 4, 5}, {3, 1, 3}}, "gflops", 1e6);
  EXPECT_EQ(r["round_ms"], (std::vector<double>{2, 4, 3}));
  EXPECT_DOUBLE_EQ(r["median_ms"].get<double>(), 3);
  EXPECT_DOUBLE_EQ(r["min_ms"].get<double>(), 2);
  EXPECT_DOUBLE_EQ(r["max_ms"].get<double>(), 4);
  EXPECT_EQ(r["rounds"], 3);
  EXPECT_EQ(r["repeats"], 3);
  EXPECT_EQ(r["samples_ms"][0], (std::vector<double>{1, 9, 2}));
  EXPECT_DOUBLE_EQ(r["gflops"].get<double>(), 2e9 / (3 * 1e6));
  EXPECT_FALSE(r.contains("flops"));
  const auto q = bench::paired_json(r, bench::make_record({}, {{4}, {8}, {12}}, "gflops", 1e6));
  EXPECT_DOUBLE_EQ(q["median"].get<double>(), 0.5);
  EXPECT_DOUBLE_EQ(q["min"].get<double>(), 0.25);
  EXPECT_DOUBLE_EQ(q["max"].get<double>(), 0.5);
}

TEST(BenchRounds, FirstRoundWarmsUpLaterRoundsOnce) {
  int calls = 0;
  int timed = 0;
  bench::Timed t([&] { ++calls; }, 5, [&](const std::function<void()>& f) {
    ++timed;
    f();
    return 1.0;
  });
  EXPECT_EQ(t.round(3).size(), 3u);
  EXPECT_EQ(calls, 5 + 3);  // a custom clock: warm-up by count only
  t.round(2);
  EXPECT_EQ(calls, 8 + 1 + 2);
  EXPECT_EQ(timed, 5);
}

// Note [peer protocol], end to end: this test binary, started again with BENCH_UTIL_SERVE=1,
// serves fake configurations (before gtest's main runs), and a PeerProcess drives it.
namespace {
const bool serving = [] {
  if (!std::getenv("BENCH_UTIL_SERVE")) return false;
  std::exit(bench::serve([](const std::string& w) {
    if (w != "w" && w != "ok") throw std::runtime_error("unknown workload '" + w + "'");
    auto meta = [&](const char* c) { return nlohmann::json{{"impl", "fake"}, {"workload", w}, {"config", c}}; };
    const bench::Offer chatty{
        meta("chatty"), [] { return [n = 0]() mutable { if (n++ == 0) std::printf("noise on stdout\n"); }; }, 1};
    if (w == "ok") return std::vector<bench::Offer>{chatty};  // (for benchmarks/test_bench_rounds.py)
    return std::vector<bench::Offer>{
        chatty,
        {meta("bad build"), []() -> std::function<void()> { throw std::runtime_error("cannot build"); }, 1},
        {meta("dies"), [] { return [] { std::_Exit(3); }; }, 1}};
  }));
}();
}  // namespace

TEST(BenchPeer, ServesRoundsAndReportsErrors) {
  ASSERT_FALSE(serving);
  bench::PeerProcess p({"/proc/self/exe"}, {"BENCH_UTIL_SERVE=1"});
  auto entries = p.entries("w");
  ASSERT_EQ(entries.size(), 3u);
  EXPECT_EQ(entries[0].meta["config"], "chatty");
  // What the step prints goes to stderr, not into the protocol.
  EXPECT_EQ(entries[0].round(4).size(), 4u);
  EXPECT_EQ(entries[0].round(2).size(), 2u);
  try {
    entries[1].round(1);
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot build"), std::string::npos) << e.what();
  }
  try {
    p.entries("other");
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown workload 'other'"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(p.release("w"));
  EXPECT_THROW(entries[0].round(1), std::runtime_error);  // released: the config is offered no more
  entries = p.entries("w");
  try {
    entries[2].round(1);
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("exited without answering"), std::string::npos) << e.what();
  }
}
