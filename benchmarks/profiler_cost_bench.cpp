// What chorus::profiler costs: DataParallel training steps over 2 CPU devices with the profiler
// compiled in and off (this program) against the same steps with it compiled out (the same
// source built with CHORUS_PROFILER=0, profiler_cost_bench_out, served as the peer: Note [peer
// protocol]), in alternating rounds (Note [paired rounds]); and, in the same rounds, the steps
// while a profiler records. Both programs are header-only builds, so that nothing of the
// compiled-out one is compiled with the instrumentation.
//
//   profiler_cost_bench --peer PATH/profiler_cost_bench_out [--rounds R (9)] [--reps N (40)]
//                       [--workloads mlp-tiny,mlp-small] [--json FILE]
//   profiler_cost_bench_out --peer PATH/profiler_cost_bench ...   (the roles swapped: no recording)
// mlp-tiny = 32-32-32-10 ReLU MLP, batch 64 (a step of tens of microseconds: the instrumentation's
// share is largest); mlp-small = 784-512-512-10, batch 256; both cross-entropy and SGD.
// benchmarks/profiler_cost.sh builds both programs and runs this.
#include <chorus/chorus.hpp>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <string>

#include "peer.hpp"

using namespace chorus;

namespace {

struct Mlp : nn::Module {
  nn::Sequential net;
  Mlp(int in, int hidden, int out)
      : net(register_module("net", nn::Sequential(nn::Linear(in, hidden), nn::ReLU(), nn::Linear(hidden, hidden),
                                                  nn::ReLU(), nn::Linear(hidden, out)))) {}
  Tensor<float> forward(const Tensor<float>& x) { return net(x); }
};

std::function<void()> make_step(const std::string& w) {
  CHORUS_CHECK(w == "mlp-tiny" || w == "mlp-small", "workload must be mlp-tiny or mlp-small, not '", w, "'");
  const bool tiny = w == "mlp-tiny";
  const int in = tiny ? 32 : 784, hidden = tiny ? 32 : 512, batch = tiny ? 64 : 256;
  manual_seed(0);
  auto dp = std::make_shared<DataParallel<Mlp>>(Mlp(in, hidden, 10), std::vector<Device>{Device::cpu(0), Device::cpu(1)});
  auto opt = std::make_shared<optim::SGD>(dp->parameters(), optim::SGDOptions{.lr = 0.01});
  const auto x = randn<float>({batch, in});
  const auto y = randint(0, 10, {batch});
  return [dp, opt, x, y] {
    opt->zero_grad();
    auto loss = nn::functional::cross_entropy((*dp)(x), y);
    loss.backward();
    opt->step();
  };
}

std::vector<bench::Offer> offers(const std::string& w) {
  const char* impl = CHORUS_PROFILER ? "chorus, profiler compiled in" : "chorus, profiler compiled out";
  return {{{{"impl", impl}, {"workload", w}, {"config", "DataParallel 2 dev"}, {"devices", 2}, {"threads", 2}},
           [w] { return make_step(w); }}};
}

std::string fmt(const nlohmann::json& s) {
  char buf[96];
  std::snprintf(buf, sizeof buf, "%.4f [%.4f-%.4f]", s["median"].get<double>(), s["min"].get<double>(),
                s["max"].get<double>());
  return buf;
}

}  // namespace

int main(int argc, char** argv) try {
  set_cpu_device_count(2);
  set_num_threads(1);  // DataParallel: the devices are the threads
  std::string peer_path, json_path = "profiler_cost.json";
  std::vector<std::string> workloads = {"mlp-tiny", "mlp-small"};
  int rounds = 9, reps = 40;
  bool serve = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::runtime_error("missing value after " + a);
      return argv[++i];
    };
    if (a == "--serve") serve = true;
    else if (a == "--peer") peer_path = next();
    else if (a == "--rounds") rounds = std::stoi(next());
    else if (a == "--reps") reps = std::stoi(next());
    else if (a == "--workloads") workloads = bench::split(next());
    else if (a == "--json") json_path = next();
    else {
      std::cerr << "usage: profiler_cost_bench --peer PROFILER_COST_BENCH_OUT [--rounds R] [--reps N] "
                   "[--workloads mlp-tiny,mlp-small] [--json FILE]\n";
      return 2;
    }
  }
  if (serve) return bench::serve(offers);
  CHORUS_CHECK(!peer_path.empty(), "--peer PATH is needed: the other build (profiler_cost_bench_out, or the reverse)");
  CHORUS_CHECK(rounds >= 1 && reps >= 1, "--rounds and --reps must be positive");
  bench::PeerProcess peer({peer_path, "--serve"}, {"OPENBLAS_NUM_THREADS=1"});
  nlohmann::json results = nlohmann::json::array();
  std::printf("%d rounds of %d steps; ratios of step times, per round: median [min-max]\n", rounds, reps);
  for (const auto& w : workloads) {
    std::vector<bench::Entry> mine;
    for (bool recording : {false, true}) {
      if (recording && !CHORUS_PROFILER) continue;  // the compiled-out build cannot record
      auto meta = offers(w)[0].meta;
      if (recording) meta["impl"] = "chorus, profiler recording";
      auto timed = std::make_shared<bench::Timed>(make_step(w), 2);
      mine.push_back({meta, [timed, recording](int n) {
                        if (!recording) return timed->round(n);
                        auto prof = profiler::start();
                        auto t = timed->round(n);
                        prof.stop();
                        return t;
                      }});
    }
    const auto theirs = peer.entries(w);
    const auto samples = bench::run_rounds(mine, theirs, rounds, reps);
    peer.release(w);
    // The records by what they ran, whichever side this program is.
    std::map<std::string, nlohmann::json> by;
    for (std::size_t i = 0; i < samples.size(); ++i) {
      const auto& meta = i < mine.size() ? mine[i].meta : theirs[i - mine.size()].meta;
      by[meta["impl"]] = bench::make_record(meta, samples[i], "gflops", 1e6);
    }
    const auto& out = by.at("chorus, profiler compiled out");
    const auto& off = by.at("chorus, profiler compiled in");
    const auto off_ratio = bench::paired_json(off, out);
    std::printf("%-10s compiled out %.4f ms (%s), compiled in and off %.4f ms (over out: %s)", w.c_str(),
                out["median_ms"].get<double>(), CHORUS_PROFILER ? "served" : "this program",
                off["median_ms"].get<double>(), fmt(off_ratio).c_str());
    nlohmann::json result = {{"workload", w}, {"off_over_out", off_ratio}, {"records", {off, out}}};
    if (by.count("chorus, profiler recording")) {
      const auto& on = by.at("chorus, profiler recording");
      result["recording_over_off"] = bench::paired_json(on, off);  // both in this process
      std::printf(", recording %.4f ms (over off: %s)", on["median_ms"].get<double>(),
                  fmt(result["recording_over_off"]).c_str());
      result["records"].push_back(on);
    }
    std::printf("\n");
    results.push_back(result);
  }
  std::ofstream(json_path) << nlohmann::json{{"rounds", rounds}, {"reps", reps}, {"results", results}}.dump(2) << "\n";
  std::printf("wrote %s\n", json_path.c_str());
  return 0;
} catch (const std::exception& e) {
  std::cerr << "profiler_cost_bench: " << e.what() << "\n";
  return 1;
}
