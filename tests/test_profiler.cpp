// The profiler: the trace of DataParallel steps over virtual CPU devices (every phase on every
// device, spans nested and ordered, reductions after their gradients, memory counters), the
// summary's figures on constructed steps, backward grouped per layer, the DataLoader's waits,
// nothing recorded while off, and misuse refused.
#include <algorithm>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "data_parallel_util.hpp"

using namespace chorus;
using chorus::testing::cpus;
using chorus::testing::Net;
using chorus::testing::throws_with;
using nlohmann::json;
using profiler::Category;
using profiler::Span;

namespace {

// Every replica on its device's worker, also for this small model (Note [inline small steps]).
const bool kThreaded = [] {
  parallel::set_inline_work_default(0);
  return true;
}();

constexpr std::int64_t kMs = 1'000'000;  // nanoseconds

Span span(const char* name, Category c, int track, double from_ms, double to_ms, std::string device = "",
          std::int64_t step = 0) {
  Span s;
  s.name = name;
  s.category = c;
  s.track = track;
  s.start_ns = static_cast<std::int64_t>(from_ms * kMs);
  s.end_ns = static_cast<std::int64_t>(to_ms * kMs);
  s.device = std::move(device);
  s.step = step;
  return s;
}

profiler::Records records(std::vector<Span> spans, int tracks) {
  profiler::Records r;
  for (int t = 0; t < tracks; ++t) r.tracks.push_back({"track " + std::to_string(t), ""});
  r.spans = std::move(spans);
  return r;
}

// The X events of a trace by name, and the name of each thread.
struct Trace {
  json j;
  std::vector<json> spans;
  std::map<int, std::string> threads;
  std::vector<json> counters;

  explicit Trace(const std::string& text) : j(json::parse(text)) {
    for (const auto& e : j.at("traceEvents")) {
      const std::string ph = e.at("ph");
      if (ph == "X") spans.push_back(e);
      if (ph == "C") counters.push_back(e);
      if (ph == "M" && e.at("name") == "thread_name") threads[e.at("tid").get<int>()] = e.at("args").at("name");
    }
  }
  std::vector<json> named(const std::string& name, std::int64_t step) const {
    std::vector<json> out;
    for (const auto& e : spans)
      if (e.at("name") == name && e.at("args").at("step") == step) out.push_back(e);
    return out;
  }
  std::vector<json> of(const std::string& cat, std::int64_t step) const {
    std::vector<json> out;
    for (const auto& e : spans)
      if (e.at("cat") == cat && e.at("args").at("step") == step) out.push_back(e);
    return out;
  }
};

double end_of(const json& e) { return e.at("ts").get<double>() + e.at("dur").get<double>(); }
std::string device_of(const json& e) { return e.at("args").value("device", std::string()); }

// Three DataParallel training steps over three devices, recorded.
const profiler::Profile& three_steps(profiler::Profiler& prof) {
  manual_seed(5);
  Net<float> net;
  DataParallel<Net<float>> dp(nn::clone(net, Device::cpu(0)), cpus(3));
  optim::SGD opt(dp.parameters(), {.lr = 0.01});
  const auto x = randn<float>({12, 6});
  const auto y = randn<float>({12, 3});
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    auto loss = nn::functional::mse_loss(dp(x), y);
    loss.backward();
    opt.step();
    prof.step();
  }
  return prof.stop();
}

}  // namespace

TEST(Profiler, DataParallelTraceHasEveryPhaseOnEveryDevice) {
  auto prof = profiler::start();
  const Trace trace(three_steps(prof).chrome_trace());
  EXPECT_EQ(trace.j.at("otherData").at("steps"), 3);
  // A track per thread: the caller ("main", replica 0) and the workers of cpu:1 and cpu:2.
  std::set<std::string> names;
  for (const auto& [tid, name] : trace.threads) names.insert(name);
  EXPECT_TRUE(names.count("main") && names.count("cpu:1 stream 0") && names.count("cpu:2 stream 0"))
      << ::testing::PrintToString(names);

  for (std::int64_t step = 0; step < 3; ++step) {
    const std::string at = "step " + std::to_string(step);
    EXPECT_EQ(trace.named("replicate", step).size(), 1u) << at;
    EXPECT_EQ(trace.named("gather", step).size(), 1u) << at;
    EXPECT_EQ(trace.named("scatter", step).size(), 3u) << at;
    std::vector<json> backward = trace.of("backward", step);
    for (int r = 0; r < 3; ++r) {
      const std::string dev = "cpu:" + std::to_string(r);
      const auto fwd = trace.named("forward replica " + std::to_string(r), step);
      ASSERT_EQ(fwd.size(), 1u) << at << " replica " << r;
      EXPECT_EQ(device_of(fwd[0]), dev);
      EXPECT_EQ(trace.threads.at(fwd[0].at("tid")), r == 0 ? "main" : dev + " stream 0");
      // The layers' forward, by their dotted names, inside the replica's span.
      for (const char* layer : {"fc1", "fc2"}) {
        int inside = 0;
        for (const auto& e : trace.named(layer, step))
          if (e.at("cat") == "forward" && e.at("tid") == fwd[0].at("tid") && e.at("ts") >= fwd[0].at("ts") &&
              end_of(e) <= end_of(fwd[0]) + 1e-3)
            ++inside;
        EXPECT_EQ(inside, 1) << at << " replica " << r << " " << layer;
      }
      // Backward, grouped per layer, on every device.
      for (const char* layer : {"fc1", "fc2"}) {
        const auto it = std::find_if(backward.begin(), backward.end(), [&](const json& e) {
          return e.at("name") == layer && device_of(e) == dev;
        });
        ASSERT_NE(it, backward.end()) << at << " " << dev << " " << layer;
        EXPECT_NE(it->at("args").at("detail").get<std::string>().find("Backward"), std::string::npos);
      }
    }
    // Each bucket's reduction after its gradients: every replica device has finished a backward
    // span of the step before it starts; the optimizer steps after every reduction.
    const auto reductions = trace.named("reduce gradients", step);
    ASSERT_FALSE(reductions.empty()) << at;
    const auto opt = trace.named("SGD.step", step);
    ASSERT_EQ(opt.size(), 1u) << at;
    for (const auto& red : reductions) {
      EXPECT_GT(red.at("args").at("bytes").get<std::int64_t>(), 0);
      EXPECT_EQ(red.at("cat"), "communication");
      for (int r = 1; r < 3; ++r) {
        const std::string dev = "cpu:" + std::to_string(r);
        EXPECT_TRUE(std::any_of(backward.begin(), backward.end(), [&](const json& e) {
          return device_of(e) == dev && end_of(e) <= red.at("ts").get<double>() + 1e-3;
        })) << at << ": a reduction began before any backward of " << dev << " ended";
      }
      EXPECT_LE(end_of(red), opt[0].at("ts").get<double>() + 1e-3) << at;
    }
  }

  // Spans on one thread nest or follow each other, and the step numbers never go back.
  std::map<int, std::vector<json>> by_thread;
  for (const auto& e : trace.spans) by_thread[e.at("tid").get<int>()].push_back(e);
  for (auto& [tid, evs] : by_thread) {
    std::stable_sort(evs.begin(), evs.end(), [](const json& a, const json& b) { return a.at("ts") < b.at("ts"); });
    std::vector<double> open;  // ends of the enclosing spans
    std::int64_t last_step = 0;
    for (const auto& e : evs) {
      const double ts = e.at("ts");
      while (!open.empty() && open.back() <= ts + 1e-3) open.pop_back();
      if (!open.empty()) {
        EXPECT_LE(end_of(e), open.back() + 1e-3) << trace.threads.at(tid) << ": " << e.dump() << " overlaps its parent";
      }
      open.push_back(end_of(e));
      const std::int64_t step = e.at("args").at("step");
      EXPECT_GE(step, last_step) << trace.threads.at(tid) << ": " << e.dump();
      last_step = step;
    }
  }

  // A memory counter per device, each sample of some bytes.
  std::set<std::string> counters;
  for (const auto& c : trace.counters) {
    counters.insert(c.at("name"));
    EXPECT_GT(c.at("args").at("bytes").get<double>(), 0) << c.dump();
  }
  EXPECT_EQ(counters, (std::set<std::string>{"allocated cpu:0", "allocated cpu:1", "allocated cpu:2"}));
}

TEST(Profiler, SummaryOfRecordedSteps) {
  auto prof = profiler::start();
  three_steps(prof);
  const auto summary = prof.summary();
  ASSERT_EQ(summary.steps.size(), 3u);
  for (const auto& s : summary.steps) {
    EXPECT_EQ(s.devices, 3);
    EXPECT_GE(s.imbalance, 1.0);
    EXPECT_GT(s.compute_ms, 0);
    EXPECT_GT(s.communication_ms, 0);
    EXPECT_GT(s.communication_bytes, 0);
    EXPECT_GT(s.optimizer_ms, 0);
    EXPECT_GE(s.wall_ms, s.compute_ms);
    EXPECT_LE(s.hidden_ms, s.communication_ms + 1e-9);
  }
  EXPECT_NE(summary.table().find("median"), std::string::npos);
  const json j = json::parse(summary.json());
  ASSERT_EQ(j.at("steps").size(), 3u);
  EXPECT_EQ(j.at("steps")[2].at("step"), 2);
  EXPECT_EQ(j.at("steps")[0].at("devices"), 3);
}

TEST(Profiler, SummaryOfAConstructedStepWithKnownOverlap) {
  // Track 0 computes 0–100 ms (cpu:0); track 1 computes 0–50 ms (cpu:1); track 2 reduces 50–150 ms.
  // Communication 100 ms, of which 50 ms while track 0 computes: 50 % hidden. A reduction nested in
  // a backward span of track 1 (60–80 ms) hides nothing of itself. Imbalance: cpu:0 100 ms, cpu:1
  // 50 + 20 (its backward around the nested reduction) = 70 ms: 100 / 85.
  std::vector<Span> spans = {
      span("forward replica 0", Category::forward, 0, 0, 100, "cpu:0"),
      span("forward replica 1", Category::forward, 1, 0, 50, "cpu:1"),
      span("reduce gradients", Category::communication, 2, 50, 150),
      span("fc1", Category::backward, 1, 60, 100, "cpu:1"),
      span("reduce gradients", Category::communication, 1, 70, 90),
      span("SGD.step", Category::optimizer, 0, 150, 160),
      span("batch 0", Category::data, 0, 160, 170),
      span("forward replica 0", Category::forward, 0, 200, 210, "cpu:0", 1),
  };
  spans[2].bytes = 4096;
  const profiler::Profile p(records(spans, 3));
  const auto s = p.summary();
  ASSERT_EQ(s.steps.size(), 2u);
  const auto& a = s.steps[0];
  EXPECT_DOUBLE_EQ(a.wall_ms, 170);
  EXPECT_DOUBLE_EQ(a.communication_ms, 100);  // 50–150 (the nested 70–90 inside it)
  EXPECT_DOUBLE_EQ(a.compute_ms, 100);        // 0–100 on track 0 covers track 1's
  EXPECT_DOUBLE_EQ(a.hidden_ms, 50);
  EXPECT_DOUBLE_EQ(a.hidden_percent, 50);
  EXPECT_DOUBLE_EQ(a.optimizer_ms, 10);
  EXPECT_DOUBLE_EQ(a.data_wait_ms, 10);
  EXPECT_EQ(a.communication_bytes, 4096);
  EXPECT_EQ(a.devices, 2);
  EXPECT_DOUBLE_EQ(a.imbalance, 100.0 / 85.0);
  EXPECT_EQ(s.steps[1].step, 1);
  EXPECT_DOUBLE_EQ(s.steps[1].imbalance, 1.0);
  EXPECT_DOUBLE_EQ(s.steps[1].hidden_percent, 0.0);  // no communication
}

TEST(Profiler, CommunicationOnlyOnTheComputingTrackHidesNothing) {
  // One thread that computes and reduces in turn (backward nodes around a reduction): 0 % hidden.
  std::vector<Span> spans = {
      span("fc2", Category::backward, 0, 0, 30, "cpu:0"),
      span("reduce gradients", Category::communication, 0, 10, 20),
  };
  const auto s = profiler::Profile(records(spans, 1)).summary().steps.at(0);
  EXPECT_DOUBLE_EQ(s.compute_ms, 20);
  EXPECT_DOUBLE_EQ(s.communication_ms, 10);
  EXPECT_DOUBLE_EQ(s.hidden_percent, 0);
}

TEST(Profiler, BackwardNodesOfALayerAreGroupedIntoOneSpan) {
  auto a = span("fc2", Category::backward, 0, 0, 1, "cpu:0");
  a.detail = "AddmmBackward";
  auto b = span("fc2", Category::backward, 0, 1, 2, "cpu:0");
  b.detail = "TBackward";
  auto c = span("fc2", Category::backward, 0, 2, 3, "cpu:0");
  c.detail = "AddmmBackward";
  auto d = span("fc1", Category::backward, 0, 3, 4, "cpu:0");
  d.detail = "TanhBackward";
  auto e = span("fc2", Category::backward, 1, 0, 1, "cpu:1");  // another track: its own group
  e.detail = "AddmmBackward";
  const profiler::Profile p(records({d, c, a, e, b}, 2));
  ASSERT_EQ(p.spans().size(), 3u);
  EXPECT_EQ(p.spans()[0].name, "fc2");
  EXPECT_EQ(p.spans()[0].start_ns, 0);
  EXPECT_EQ(p.spans()[0].end_ns, 3 * kMs);
  EXPECT_EQ(p.spans()[0].detail, "AddmmBackward, TBackward");
  EXPECT_EQ(p.spans()[1].name, "fc1");
  EXPECT_EQ(p.spans()[1].detail, "TanhBackward");
  EXPECT_EQ(p.spans()[2].track, 1);
}

TEST(Profiler, DataLoaderWaitsAndWorkers) {
  auto data = randn<float>({40, 3});
  auto target = randn<float>({40, 1});
  data::DataLoader loader(data::TensorDataset(data, target), {.batch_size = 8, .num_workers = 2});
  auto prof = profiler::start();
  int batches = 0;
  for (const auto& batch : loader) {
    (void)batch;
    ++batches;
    prof.step();
  }
  const Trace trace(prof.stop().chrome_trace());
  EXPECT_EQ(batches, 5);
  int waits = 0, built = 0;
  for (const auto& e : trace.spans) {
    const std::string thread = trace.threads.at(e.at("tid"));
    if (e.at("cat") == "data") {
      ++waits;
      EXPECT_EQ(thread, "main");
    }
    if (std::string(e.at("name")).rfind("build batch", 0) == 0) {
      ++built;
      EXPECT_EQ(thread.rfind("loader worker ", 0), 0u) << thread;
    }
  }
  EXPECT_EQ(waits, 5);
  EXPECT_EQ(built, 5);
}

TEST(Profiler, NothingIsRecordedWhileOff) {
  { profiler::Profiler earlier; earlier.stop(); }  // the recorder idle, as after any recording
  manual_seed(2);
  Net<float> net;
  DataParallel<Net<float>> dp(nn::clone(net, Device::cpu(0)), cpus(3));
  auto out = dp(randn<float>({12, 6}));
  out.sum().backward();
  EXPECT_FALSE(profiler::enabled());
  EXPECT_EQ(out.grad_fn()->layer(), nullptr);
  auto& r = profiler::detail::recorder();
  std::lock_guard<std::mutex> lk(r.m);
  EXPECT_TRUE(r.buffers.empty()) << r.buffers.size() << " threads registered a buffer while off";
  EXPECT_TRUE(r.tracks.empty());
}

TEST(Profiler, SaveWritesTheTraceAndMisuseIsRefused) {
  const auto path = (std::filesystem::temp_directory_path() / "chorus_profiler_trace.json").string();
  {
    auto prof = profiler::start({.memory = false});
    EXPECT_TRUE(throws_with([] { profiler::start(); }, {"already records"}));
    { const profiler::Scope s(Category::other, "mark"); }
    EXPECT_TRUE(throws_with([&] { (void)prof.summary(); }, {"after stop()"}));
    prof.stop().save(path);
    EXPECT_TRUE(throws_with([&] { prof.stop(); }, {"not recording"}));
    EXPECT_TRUE(throws_with([&] { prof.profile().save("/nonexistent-dir/trace.json"); }, {"/nonexistent-dir/trace.json"}));
  }
  std::ifstream in(path);
  const Trace trace(std::string(std::istreambuf_iterator<char>(in), {}));
  ASSERT_EQ(trace.spans.size(), 1u);
  EXPECT_EQ(trace.spans[0].at("name"), "mark");
  EXPECT_TRUE(trace.counters.empty());  // memory off
  std::filesystem::remove(path);
  // A profiler that goes out of scope recording stops: the next one starts.
  { auto dropped = profiler::start(); }
  EXPECT_FALSE(profiler::enabled());
  auto next = profiler::start();
  EXPECT_TRUE(next.recording());
}
