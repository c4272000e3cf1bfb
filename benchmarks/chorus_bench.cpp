// chorus benchmarks: the fixed workloads on one device and through DataParallel, side by side
// with a peer (LibTorch on the CPU) run in the same invocation.
//
//   chorus_bench [--threads 1,2] [--devices 1,2] [--workloads tutorial,mlp-small,mlp-medium,resnet20-cifar]
//                [--repeats N] [--json FILE] [--peer LIBTORCH_BENCH]
//
// Workloads (see benchmarks/README.md): tutorial = Linear(5, 2) forward over 100 samples in
// batches of 30, data on the host, time per epoch; mlp-small = 784-512-512-10 ReLU MLP,
// batch 256, cross-entropy, SGD, time per step; mlp-medium = 4 x Linear(1024, 1024) with
// ReLU, batch 512, MSE, SGD, time per step; resnet20-cifar = ResNet-20 (examples/resnet.hpp),
// batch 128 of 3x32x32, cross-entropy, SGD with momentum, time per step.
#include <chorus/chorus.hpp>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "../examples/resnet.hpp"
#include "bench_util.hpp"

using namespace chorus;
namespace F = chorus::nn::functional;

namespace {

struct MlpSmall : nn::Module {
  nn::Sequential net;
  MlpSmall()
      : net(register_module("net", nn::Sequential(nn::Linear(784, 512), nn::ReLU(), nn::Linear(512, 512), nn::ReLU(),
                                                  nn::Linear(512, 10)))) {}
  Tensor<float> forward(const Tensor<float>& x) { return net(x); }
};

struct MlpMedium : nn::Module {
  nn::Sequential net;
  MlpMedium()
      : net(register_module("net", nn::Sequential(nn::Linear(1024, 1024), nn::ReLU(), nn::Linear(1024, 1024),
                                                  nn::ReLU(), nn::Linear(1024, 1024), nn::ReLU(),
                                                  nn::Linear(1024, 1024)))) {}
  Tensor<float> forward(const Tensor<float>& x) { return net(x); }
};

struct Tutorial : nn::Module {
  nn::Linear fc;
  Tutorial() : fc(register_module("fc", nn::Linear(5, 2))) {}
  Tensor<float> forward(const Tensor<float>& x) { return fc(x); }
};

/// Calls the model either directly (devices empty: one device, no wrapper) or through DataParallel.
template <class M>
struct Runner {
  std::unique_ptr<M> plain;
  std::unique_ptr<DataParallel<M>> dp;
  Runner(const std::vector<Device>& devices) {
    if (devices.empty()) plain = std::make_unique<M>();
    else dp = std::make_unique<DataParallel<M>>(M(), devices);
  }
  Tensor<float> operator()(const Tensor<float>& x) { return plain ? plain->forward(x) : (*dp)(x); }
  std::vector<AnyTensor> parameters() const { return plain ? plain->parameters() : dp->parameters(); }
};

/// One step (or epoch, for the tutorial) of `workload`; the returned function runs it once.
std::function<void()> make_workload(const std::string& workload, const std::vector<Device>& devices) {
  if (workload == "tutorial") {
    auto model = std::make_shared<Runner<Tutorial>>(devices);
    auto loader = std::make_shared<data::DataLoader<data::TensorDataset<float, float>>>(
        data::TensorDataset<float, float>(randn<float>({100, 5}), zeros<float>({100})),
        data::DataLoaderOptions{.batch_size = 30, .shuffle = true, .seed = 1});
    return [model, loader] {
      for (auto batch : *loader) (void)(*model)(batch.data);
    };
  }
  if (workload == "mlp-small") {
    auto model = std::make_shared<Runner<MlpSmall>>(devices);
    auto opt = std::make_shared<optim::SGD>(model->parameters(), optim::SGDOptions{.lr = 0.01});
    auto x = randn<float>({256, 784});
    auto y = randint(0, 10, {256});
    return [model, opt, x, y] {
      auto loss = F::cross_entropy((*model)(x), y);
      opt->zero_grad();
      loss.backward();
      opt->step();
    };
  }
  if (workload == "mlp-medium") {
    auto model = std::make_shared<Runner<MlpMedium>>(devices);
    auto opt = std::make_shared<optim::SGD>(model->parameters(), optim::SGDOptions{.lr = 0.01});
    auto x = randn<float>({512, 1024});
    auto y = randn<float>({512, 1024});
    return [model, opt, x, y] {
      auto loss = F::mse_loss((*model)(x), y);
      opt->zero_grad();
      loss.backward();
      opt->step();
    };
  }
  if (workload == "resnet20-cifar") {
    auto model = std::make_shared<Runner<examples::ResNet20<float>>>(devices);
    auto opt = std::make_shared<optim::SGD>(model->parameters(), optim::SGDOptions{.lr = 0.01, .momentum = 0.9});
    auto x = randn<float>({128, 3, 32, 32});
    auto y = randint(0, 10, {128});
    return [model, opt, x, y] {
      auto loss = F::cross_entropy((*model)(x), y);
      opt->zero_grad();
      loss.backward();
      opt->step();
    };
  }
  CHORUS_FAIL("unknown workload '", workload, "'");
}

double workload_flops(const std::string& w) {
  if (w == "mlp-small") return bench::mlp_step_flops(256, {{784, 512}, {512, 512}, {512, 10}});
  if (w == "mlp-medium") return bench::mlp_step_flops(512, {{1024, 1024}, {1024, 1024}, {1024, 1024}, {1024, 1024}});
  if (w == "resnet20-cifar") return bench::resnet20_step_flops(128);
  return 0;
}

int repeats_for(const std::string& w, int requested) {
  if (requested > 0) return requested;
  return w == "tutorial" ? 200 : w == "mlp-small" ? 30 : w == "resnet20-cifar" ? 5 : 15;
}

}  // namespace

int main(int argc, char** argv) try {
  std::vector<int> threads = {1, 2}, devices = {1, 2};
  std::vector<std::string> workloads = {"tutorial", "mlp-small", "mlp-medium", "resnet20-cifar"};
  int repeats = 0;
  std::string json_path = "chorus_bench.json", peer;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::runtime_error("missing value after " + a);
      return argv[++i];
    };
    if (a == "--threads") {
      threads.clear();
      for (auto& t : bench::split(next())) threads.push_back(std::stoi(t));
    } else if (a == "--devices") {
      devices.clear();
      for (auto& d : bench::split(next())) devices.push_back(std::stoi(d));
    } else if (a == "--workloads") {
      workloads = bench::split(next());
    } else if (a == "--repeats") {
      repeats = std::stoi(next());
    } else if (a == "--json") {
      json_path = next();
    } else if (a == "--peer") {
      peer = next();
    } else {
      std::cerr << "usage: chorus_bench [--threads 1,2] [--devices 1,2]"
                   " [--workloads tutorial,mlp-small,mlp-medium,resnet20-cifar]"
                   " [--repeats N] [--json FILE] [--peer LIBTORCH_BENCH]\n";
      return 2;
    }
  }
  int max_dev = 1;
  for (int d : devices) max_dev = std::max(max_dev, d);
  set_cpu_device_count(max_dev);

  nlohmann::json records = nlohmann::json::array();
  auto record = [&](const std::string& impl, const std::string& w, const std::string& config, int ndev, int nthreads,
                    const bench::Stats& s) {
    nlohmann::json r = {{"impl", impl},          {"workload", w},        {"config", config},
                        {"devices", ndev},       {"threads", nthreads},  {"median_ms", s.median_ms},
                        {"min_ms", s.min_ms},    {"max_ms", s.max_ms},   {"repeats", s.repeats}};
    if (double f = workload_flops(w); f > 0) r["gflops"] = f / (s.median_ms * 1e6);
    records.push_back(r);
    std::fprintf(stderr, "  %-10s %-10s %-28s median %9.3f ms\n", impl.c_str(), w.c_str(), config.c_str(), s.median_ms);
  };

  for (const auto& w : workloads) {
    const int reps = repeats_for(w, repeats), warm = std::max(2, reps / 10);
    for (int t : threads) {  // one device, no wrapper, t BLAS threads
      backend::cpu::set_blas_threads(t);
      auto step = make_workload(w, {});
      record("chorus", w, std::to_string(t) + " thread(s)", 1, t, bench::measure(step, warm, reps));
    }
    backend::cpu::set_blas_threads(1);  // DataParallel: one BLAS thread per device
    for (int k : devices) {
      std::vector<Device> devs;
      for (int d = 0; d < k; ++d) devs.push_back(Device::cpu(d));
      auto step = make_workload(w, devs);
      record("chorus", w, "DataParallel " + std::to_string(k) + " dev x 1 thread", k, k,
             bench::measure(step, warm, reps));
    }
  }

  if (!peer.empty()) {
    // The peer at each thread count, run in this invocation. LibTorch splits threads between
    // OpenMP (intra-op) and its BLAS; both splits are tried and the faster one is kept per
    // workload, so chorus is compared with the peer's best at that thread count.
    std::string ws;
    for (auto& w : workloads) ws += (ws.empty() ? "" : ",") + w;
    for (int t : threads) {
      std::map<std::string, nlohmann::json> best;
      for (int omp : {t, 1}) {
        const std::string out = json_path + ".peer.json";
        std::string cmd = "OMP_NUM_THREADS=" + std::to_string(omp) + " OPENBLAS_NUM_THREADS=" + std::to_string(t) +
                          " '" + peer + "' --threads " + std::to_string(t) + " --omp-threads " + std::to_string(omp) +
                          " --workloads " + ws + " --json '" + out + "'";
        if (repeats > 0) cmd += " --repeats " + std::to_string(repeats);
        CHORUS_CHECK(std::system(cmd.c_str()) == 0, "peer benchmark failed: ", cmd);
        std::ifstream in(out);
        for (auto& r : nlohmann::json::parse(in)) {
          auto& b = best[r["workload"].get<std::string>()];
          if (b.is_null() || r["median_ms"].get<double>() < b["median_ms"].get<double>()) b = r;
        }
        std::remove(out.c_str());
        if (t == 1) break;
      }
      for (auto& [w, r] : best) records.push_back(r);
    }
  }

  // The table: each chorus configuration against the peer at the same total thread count.
  std::printf("\n%-11s %-30s %12s %12s %8s %9s\n", "workload", "chorus configuration", "chorus ms", "peer ms",
              "ratio", "GFLOP/s");
  for (const auto& r : records) {
    if (r["impl"] != "chorus") continue;
    double peer_ms = 0;
    for (const auto& p : records)
      if (p["impl"] != "chorus" && p["workload"] == r["workload"] && p["threads"] == r["threads"])
        peer_ms = p["median_ms"].get<double>();
    const double ms = r["median_ms"].get<double>();
    std::printf("%-11s %-30s %12.3f ", r["workload"].get<std::string>().c_str(), r["config"].get<std::string>().c_str(),
                ms);
    if (peer_ms > 0) std::printf("%12.3f %7.2fx", peer_ms, ms / peer_ms);
    else std::printf("%12s %8s", "-", "-");
    if (r.contains("gflops")) std::printf(" %9.1f", r["gflops"].get<double>());
    std::printf("\n");
  }
  // DataParallel scaling on each workload: time on 1 device / time on k devices.
  for (const auto& w : workloads) {
    double one = 0;
    for (const auto& r : records)
      if (r["impl"] == "chorus" && r["workload"] == w && r["config"].get<std::string>().rfind("DataParallel 1 ", 0) == 0)
        one = r["median_ms"].get<double>();
    for (const auto& r : records)
      if (one > 0 && r["impl"] == "chorus" && r["workload"] == w && r["devices"].get<int>() > 1)
        std::printf("scaling %-10s DataParallel %d devices: %.2fx faster than 1 device\n", w.c_str(),
                    r["devices"].get<int>(), one / r["median_ms"].get<double>());
  }
  nlohmann::json doc = {{"machine", {{"cores", std::thread::hardware_concurrency()}}}, {"records", records}};
  std::ofstream(json_path) << doc.dump(2) << "\n";
  std::printf("wrote %s\n", json_path.c_str());
  return 0;
} catch (const std::exception& e) {
  std::cerr << "error: " << e.what() << "\n";
  return 1;
}
