// chorus benchmarks: the fixed workloads on one device and through DataParallel, side by side
// with a peer (LibTorch on the CPU) run in the same invocation, in alternating rounds (Note
// [paired rounds] in bench_util.hpp): every ratio is the median of per-round ratios, with its
// min-max.
//
//   chorus_bench [--threads 1,2] [--devices 1,2] [--workloads tutorial,mlp-small,mlp-medium,resnet20-cifar,lstm-lm,transformer-lm]
//                [--rounds R (7)] [--repeats N (timed steps per round)] [--json FILE] [--peer LIBTORCH_BENCH]
//                [--bf16]  (mlp-medium and transformer-lm also in bfloat16 with float32 master weights)
//                [--sharded]  (DataParallel over k > 1 devices also with parallel::ShardedOptimizer)
//                [--profile FILE]  (after each workload's rounds, 5 steps of DataParallel over the most
//                 devices recorded by chorus::profiler: FILE.<workload>.json, and their summary in
//                 the JSON's "profiles": the devices' imbalance, copies, reductions, optimizer)
// Each DataParallel over k > 1 devices also gets its ceiling (class Ceiling): k threads each
// stepping a model of its own on 1/k of the batch, the computation alone. The run first names
// the CPU (model and vector extensions), the route of its matrix products (Note [which GEMM])
// and of chorus's own loops (Note [CPU capability]), and measures the `peak`: a 2048^3 float
// product through that route on 1, 2, ... threads; each GEMM-bound row shows its share of it.
//
// Workloads (see benchmarks/README.md): tutorial = Linear(5, 2) forward over 100 samples in
// batches of 30, data on the host, time per epoch; mlp-small = 784-512-512-10 ReLU MLP,
// batch 256, cross-entropy, SGD, time per step; mlp-medium = 4 x Linear(1024, 1024) with
// ReLU, batch 512, MSE, SGD, time per step; resnet20-cifar = ResNet-20 (examples/resnet.hpp),
// batch 128 of 3x32x32, cross-entropy, SGD with momentum, time per step; lstm-lm and
// transformer-lm = the language models of lm_models.hpp (Adam), time per step.
#include <chorus/chorus.hpp>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>

#include "../examples/profile_option.hpp"
#include "../examples/resnet.hpp"
#include "bench_util.hpp"
#include "lm_models.hpp"
#include "peer.hpp"

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

/// mlp-medium in bfloat16 (--bf16): the same four Linear(1024, 1024) layers.
struct MlpMediumBf16 : nn::Module {
  nn::LinearT<bfloat16> fc1, fc2, fc3, fc4;
  MlpMediumBf16()
      : fc1(register_module("fc1", nn::LinearT<bfloat16>(1024, 1024))),
        fc2(register_module("fc2", nn::LinearT<bfloat16>(1024, 1024))),
        fc3(register_module("fc3", nn::LinearT<bfloat16>(1024, 1024))),
        fc4(register_module("fc4", nn::LinearT<bfloat16>(1024, 1024))) {}
  Tensor<bfloat16> forward(const Tensor<bfloat16>& x) { return fc4(relu(fc3(relu(fc2(relu(fc1(x))))))); }
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
  template <class X>
  auto operator()(const X& x) {
    return plain ? plain->forward(x) : (*dp)(x);
  }
  std::vector<AnyTensor> parameters() const { return plain ? plain->parameters() : dp->parameters(); }
};

/// The workload's optimizer: O over the model's parameters, or (--sharded, through DataParallel)
/// parallel::ShardedOptimizer<O>, the step sharded over the devices (Note [sharded optimizer step]).
template <class O, class M>
std::shared_ptr<optim::Optimizer> make_optimizer(const Runner<M>& model, typename O::options_type options,
                                                 bool sharded) {
  if (sharded && model.dp) return std::make_shared<parallel::ShardedOptimizer<O>>(*model.dp, options);
  return std::make_shared<O>(model.parameters(), options);
}

/// One mixed-precision step (Note [the form of mixed precision]) of mlp-medium or transformer-lm:
/// a bfloat16 model, the loss in float32, Adam/SGD over float32 master weights.
std::function<void()> make_bf16_workload(const std::string& workload, const std::vector<Device>& devices) {
  if (workload == "mlp-medium") {
    auto model = std::make_shared<Runner<MlpMediumBf16>>(devices);
    auto master = std::make_shared<amp::MasterWeights>(model->parameters());
    auto opt = std::make_shared<optim::SGD>(master->parameters(), optim::SGDOptions{.lr = 0.01});
    auto x = randn<float>({512, 1024}).to<bfloat16>();
    auto y = randn<float>({512, 1024});
    return [model, master, opt, x, y] {
      auto loss = F::mse_loss((*model)(x).to<float>(), y);
      opt->zero_grad();
      loss.backward();
      master->step(*opt);
    };
  }
  if (workload == "transformer-lm") {
    using Lm = bench::TransformerLmT<bfloat16>;
    auto x = randint(0, bench::kLmVocab, {32, Lm::kSeq});
    auto y = randint(0, bench::kLmVocab, {32 * Lm::kSeq});
    auto model = std::make_shared<Runner<Lm>>(devices);
    auto master = std::make_shared<amp::MasterWeights>(model->parameters());
    auto opt = std::make_shared<optim::Adam>(master->parameters(), optim::AdamOptions{.lr = 1e-3});
    return [model, master, opt, x, y] {
      auto loss = F::cross_entropy((*model)(x).to<float>().reshape({y.shape()[0], bench::kLmVocab}), y);
      opt->zero_grad();
      loss.backward();
      master->step(*opt);
    };
  }
  CHORUS_FAIL("--bf16: no bfloat16 form of workload '", workload, "' (mlp-medium, transformer-lm)");
}

/// One step (or epoch, for the tutorial) of `workload`; the returned function runs it once.
/// `split` > 1: the step on 1/split of the batch (one device's share; class Ceiling).
std::function<void()> make_workload(const std::string& workload, const std::vector<Device>& devices,
                                    bool sharded = false, std::int64_t split = 1) {
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
    auto opt = make_optimizer<optim::SGD>(*model, {.lr = 0.01}, sharded);
    auto x = randn<float>({256 / split, 784});
    auto y = randint(0, 10, {256 / split});
    return [model, opt, x, y] {
      auto loss = F::cross_entropy((*model)(x), y);
      opt->zero_grad();
      loss.backward();
      opt->step();
    };
  }
  if (workload == "mlp-medium") {
    auto model = std::make_shared<Runner<MlpMedium>>(devices);
    auto opt = make_optimizer<optim::SGD>(*model, {.lr = 0.01}, sharded);
    auto x = randn<float>({512 / split, 1024});
    auto y = randn<float>({512 / split, 1024});
    return [model, opt, x, y] {
      auto loss = F::mse_loss((*model)(x), y);
      opt->zero_grad();
      loss.backward();
      opt->step();
    };
  }
  if (workload == "resnet20-cifar") {
    auto model = std::make_shared<Runner<examples::ResNet20<float>>>(devices);
    auto opt = make_optimizer<optim::SGD>(*model, {.lr = 0.01, .momentum = 0.9}, sharded);
    auto x = randn<float>({128 / split, 3, 32, 32});
    auto y = randint(0, 10, {128 / split});
    return [model, opt, x, y] {
      auto loss = F::cross_entropy((*model)(x), y);
      opt->zero_grad();
      loss.backward();
      opt->step();
    };
  }
  if (workload == "lstm-lm" || workload == "transformer-lm") {
    const bool lstm = workload == "lstm-lm";
    const std::int64_t batch = (lstm ? 64 : 32) / split, len = lstm ? 64 : bench::TransformerLm::kSeq;
    auto x = randint(0, bench::kLmVocab, {batch, len});
    auto y = randint(0, bench::kLmVocab, {batch * len});
    auto step = [x, y](auto model, auto opt) {
      return [model, opt, x, y] {
        auto loss = F::cross_entropy((*model)(x).reshape({y.shape()[0], bench::kLmVocab}), y);
        opt->zero_grad();
        loss.backward();
        opt->step();
      };
    };
    if (lstm) {
      auto model = std::make_shared<Runner<bench::LstmLm>>(devices);
      return step(model, make_optimizer<optim::Adam>(*model, {.lr = 1e-3}, sharded));
    }
    auto model = std::make_shared<Runner<bench::TransformerLm>>(devices);
    return step(model, make_optimizer<optim::Adam>(*model, {.lr = 1e-3}, sharded));
  }
  CHORUS_FAIL("unknown workload '", workload, "'");
}

/// DataParallel's ceiling over k CPU devices: the computation alone, as k devices would do it
/// with nothing to share. k threads (the caller and k - 1 others, woken for each step) each run
/// the plain step on 1/k of the batch with a model and optimizer of their own, one BLAS thread
/// each: no scatter, no gather, no gradient sum, each optimizer step on its own thread. It and
/// DataParallel over k devices share the machine's memory bandwidth and caches alike, which the
/// one-device baseline does not.
class Ceiling {
 public:
  Ceiling(const std::string& workload, int k) {
    for (int i = 0; i < k; ++i) parts_.push_back(make_workload(workload, {}, false, k));
    for (int i = 1; i < k; ++i)
      threads_.emplace_back([this, i] {
        set_num_threads(1);
        for (std::uint64_t seen = 0;;) {
          {
            std::unique_lock<std::mutex> lk(m_);
            cv_.wait(lk, [&] { return stop_ || step_ != seen; });
            if (stop_) return;
            seen = step_;
          }
          parts_[static_cast<std::size_t>(i)]();
          std::lock_guard<std::mutex> lk(m_);
          if (++done_ == threads_.size()) cv_.notify_all();
        }
      });
  }
  ~Ceiling() {
    {
      std::lock_guard<std::mutex> lk(m_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  Ceiling(const Ceiling&) = delete;
  Ceiling& operator=(const Ceiling&) = delete;
  void operator()() {
    {
      std::lock_guard<std::mutex> lk(m_);
      done_ = 0;
      ++step_;
    }
    cv_.notify_all();
    parts_[0]();
    std::unique_lock<std::mutex> lk(m_);
    cv_.wait(lk, [&] { return done_ == threads_.size(); });
  }

 private:
  std::vector<std::function<void()>> parts_;
  std::mutex m_;
  std::condition_variable cv_;
  std::uint64_t step_ = 0;
  std::size_t done_ = 0;
  bool stop_ = false;
  std::vector<std::thread> threads_;  // last: they start with everything above in place
};

double workload_flops(const std::string& w) {
  if (w == "mlp-small") return bench::mlp_step_flops(256, {{784, 512}, {512, 512}, {512, 10}});
  if (w == "mlp-medium") return bench::mlp_step_flops(512, {{1024, 1024}, {1024, 1024}, {1024, 1024}, {1024, 1024}});
  if (w == "resnet20-cifar") return bench::resnet20_step_flops(128);
  if (w == "lstm-lm") return bench::lstm_lm_step_flops(64, 64, bench::kLmWidth, bench::kLmWidth, 2, bench::kLmVocab);
  if (w == "transformer-lm") return bench::transformer_lm_step_flops(32, 128, bench::kLmWidth, 1024, 4, bench::kLmVocab);
  return 0;
}

/// Timed steps per round (Note [paired rounds]): about 0.05-1.5 s of work per configuration and round.
int repeats_for(const std::string& w, int requested) {
  if (requested > 0) return requested;
  return w == "tutorial" ? 200 : w == "mlp-small" ? 10 : w == "resnet20-cifar" || w == "lstm-lm" ? 3 : w == "transformer-lm" ? 2 : 5;
}

std::string fmt_spread(const nlohmann::json& s) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2fx [%.2f-%.2f]", s["median"].get<double>(), s["min"].get<double>(),
                s["max"].get<double>());
  return buf;
}

/// The CPU's model name and the vector extensions that decide its kernels (from /proc/cpuinfo).
std::string cpu_description() {
  std::ifstream in("/proc/cpuinfo");
  std::string line, model = "unknown CPU", flags;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0 && model == "unknown CPU") model = line.substr(line.find(':') + 2);
    if (line.rfind("flags", 0) == 0 && flags.empty()) flags = line + " ";
  }
  std::string out = model + ";";
  for (const char* f : {"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_bf16"})
    if (flags.find(std::string(" ") + f + " ") != std::string::npos) out += std::string(" ") + f;
  return out;
}

/// The `peak` row: GFLOP/s of a 2048^3 float product through chorus's GEMM route on `threads`
/// threads (best of 5 calls after a warm-up): what the GEMM-bound workloads are measured against.
double sgemm_peak(int threads) {
  set_num_threads(threads);
  const std::int64_t n = 2048;
  std::vector<float> a(n * n, 0.5f), b(n * n, 0.25f), c(n * n);
  double best = 1e30;
  for (int i = 0; i < 6; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    backend::cpu::gemm<float>(false, false, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (i > 0) best = std::min(best, s);
  }
  set_num_threads(1);
  return 2.0 * n * n * n / best / 1e9;
}

}  // namespace

/// 5 steps of workload `w` under DataParallel over `k` devices (after 2 warm-up steps) recorded
/// by chorus::profiler: the trace in `path` tagged with the workload, the summary as JSON.
nlohmann::json profile_workload(const std::string& w, int k, const std::string& path) {
  set_num_threads(1);
  std::vector<Device> devs;
  for (int d = 0; d < k; ++d) devs.push_back(Device::cpu(d));
  auto step = make_workload(w, devs, false);
  step();
  step();
  auto prof = profiler::start();
  for (int s = 0; s < 5; ++s) {
    step();
    prof.step();
  }
  const auto& p = prof.stop();
  const std::string file = examples::tagged_path(path, w);
  p.save(file);
  const auto summary = p.summary();
  std::fprintf(stderr, "profile of %s, DataParallel over %d devices (%s):\n%s", w.c_str(), k, file.c_str(),
               summary.table().c_str());
  return {{"workload", w}, {"devices", k}, {"trace", file}, {"steps", nlohmann::json::parse(summary.json())["steps"]}};
}

int main(int argc, char** argv) try {
  std::vector<int> threads = {1, 2}, devices = {1, 2};
  std::vector<std::string> workloads = {"tutorial", "mlp-small", "mlp-medium", "resnet20-cifar", "lstm-lm", "transformer-lm"};
  int repeats = 0, rounds = 7;
  bool bf16 = false, sharded = false;
  std::string json_path = "chorus_bench.json", peer, profile_path;
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
    } else if (a == "--rounds") {
      rounds = std::stoi(next());
    } else if (a == "--repeats") {
      repeats = std::stoi(next());
    } else if (a == "--json") {
      json_path = next();
    } else if (a == "--peer") {
      peer = next();
    } else if (a == "--bf16") {
      bf16 = true;
    } else if (a == "--sharded") {
      sharded = true;
    } else if (a == "--profile") {
      profile_path = next();
    } else {
      std::cerr << "usage: chorus_bench [--threads 1,2] [--devices 1,2]"
                   " [--workloads tutorial,mlp-small,mlp-medium,resnet20-cifar,lstm-lm,transformer-lm]"
                   " [--rounds R] [--repeats N] [--json FILE] [--peer LIBTORCH_BENCH] [--bf16] [--sharded]"
                   " [--profile FILE]\n";
      return 2;
    }
  }
  CHORUS_CHECK(rounds >= 1, "--rounds must be at least 1, got ", rounds);
  int max_dev = 1;
  for (int d : devices) max_dev = std::max(max_dev, d);
  set_cpu_device_count(max_dev);

  // The peer: one server process per thread split (Note [peer protocol]). LibTorch splits its
  // threads between OpenMP (intra-op) and its BLAS; at 2 threads both splits run in the rounds
  // and each ratio is against the split that was faster on that workload, so chorus is compared
  // with the peer's best at the same total thread count.
  std::vector<std::unique_ptr<bench::PeerProcess>> peers;
  if (!peer.empty())
    for (int t : threads)
      for (int omp : {t, 1}) {
        peers.push_back(std::make_unique<bench::PeerProcess>(
            std::vector<std::string>{peer, "--serve", "--threads", std::to_string(t), "--omp-threads",
                                     std::to_string(omp)},
            std::vector<std::string>{"OMP_NUM_THREADS=" + std::to_string(omp),
                                     "OPENBLAS_NUM_THREADS=" + std::to_string(t)}));
        if (t == 1) break;
      }

  // The machine and the routes its products and loops take, then the peak the workloads are
  // measured against.
  const std::string cpu = cpu_description(), route = backend::cpu::gemm_route(),
                    capability = backend::cpu::cpu_capability_name(backend::cpu::get_cpu_capability());
  std::map<int, double> peak;
  for (int t : threads) peak[t] = sgemm_peak(t);
  for (int d : devices)
    if (!peak.count(d)) peak[d] = sgemm_peak(d);
  std::fprintf(stderr, "CPU: %s\nGEMM: %s\nchorus's loops: %s\n", cpu.c_str(), route.c_str(), capability.c_str());
  for (const auto& [t, g] : peak) std::fprintf(stderr, "peak: 2048^3 sgemm, %d thread(s): %.1f GFLOP/s\n", t, g);

  using nlohmann::json;
  json peaks = json::object();
  for (const auto& [t, g] : peak) peaks[std::to_string(t)] = g;
  json records = json::array(), ratios = json::array(), scaling = json::array(), mixed = json::array(),
       overhead = json::array(), profiles = json::array();
  auto write_json = [&] {  // after every workload: an interrupted run keeps what it measured
    json doc = {{"machine", {{"cores", std::thread::hardware_concurrency()}, {"cpu", cpu}, {"gemm", route},
                             {"cpu_capability", capability}, {"sgemm_peak_gflops", peaks}}},
                {"rounds", rounds},
                {"interleaved", !peers.empty()},
                {"records", records},
                {"ratios", ratios},
                {"scaling", scaling},
                {"over_ceiling", overhead},
                {"bf16_over_float32", mixed},
                {"profiles", profiles}};
    std::ofstream(json_path) << doc.dump(2) << "\n";
  };
  std::vector<std::string> table;
  for (const auto& w : workloads) {
    const int reps = repeats_for(w, repeats);
    std::vector<bench::Entry> mine, theirs;
    // kind: 0 plain, 1 bf16, 2 sharded optimizer step, 3 the ceiling of DataParallel (class Ceiling)
    auto add = [&](std::string config, int ndev, int nthreads, int blas, const std::vector<Device>& devs,
                   int kind = 0) {
      set_num_threads(blas);  // BLAS and this thread's oneDNN team (DataParallel: 1, its devices are the threads)
      std::function<void()> step;
      if (kind == 1) step = make_bf16_workload(w, devs);
      else if (kind == 3) step = [c = std::make_shared<Ceiling>(w, ndev)] { (*c)(); };
      else step = make_workload(w, devs, kind == 2);
      auto timed = std::make_shared<bench::Timed>(std::move(step), 2);
      json meta = {{"impl", "chorus"}, {"workload", w},         {"config", config},
                   {"devices", ndev},  {"threads", nthreads}, {"flops", workload_flops(w)}};
      mine.push_back({meta, [timed, blas](int n) {
                        set_num_threads(blas);
                        return timed->round(n);
                      }});
    };
    for (int t : threads) add(std::to_string(t) + " thread(s)", 1, t, t, {});  // one device, no wrapper
    const bool with_bf16 = bf16 && (w == "mlp-medium" || w == "transformer-lm");
    if (with_bf16)  // the same, mixed precision (bfloat16 model, float32 masters), in the same rounds
      for (int t : threads) add(std::to_string(t) + " thread(s) bf16", 1, t, t, {}, 1);
    for (int k : devices) {  // DataParallel: one BLAS thread per device
      std::vector<Device> devs;
      for (int d = 0; d < k; ++d) devs.push_back(Device::cpu(d));
      add("DataParallel " + std::to_string(k) + " dev x 1 thread", k, k, 1, devs);
      if (sharded && k > 1 && w != "tutorial")  // the same with the optimizer step sharded over the devices
        add("DataParallel " + std::to_string(k) + " dev x 1 thread sharded", k, k, 1, devs, 2);
      if (k > 1 && w != "tutorial")  // what k devices' computation alone takes: the scaling's ceiling
        add("ceiling: " + std::to_string(k) + " threads x 1/" + std::to_string(k) + " batch", k, k, 1, {}, 3);
    }
    for (auto& p : peers)
      for (auto& e : p->entries(w)) theirs.push_back(e);
    std::fprintf(stderr, "%s: %d rounds of %zu + %zu configurations, %d timed steps each\n", w.c_str(), rounds,
                 mine.size(), theirs.size(), reps);
    const auto samples = bench::run_rounds(mine, theirs, rounds, reps);
    for (auto& p : peers) p->release(w);
    set_num_threads(1);
    std::vector<json> ours, peer_records;
    for (std::size_t i = 0; i < samples.size(); ++i) {
      json r = bench::make_record(i < mine.size() ? mine[i].meta : theirs[i - mine.size()].meta, samples[i], "gflops",
                                  1e6);
      std::fprintf(stderr, "  %-8s %-14s %-30s median %9.3f ms (rounds %.3f-%.3f)\n",
                   r["impl"].get<std::string>().c_str(), w.c_str(), r["config"].get<std::string>().c_str(), r["median_ms"].get<double>(),
                   r["min_ms"].get<double>(), r["max_ms"].get<double>());
      (i < mine.size() ? ours : peer_records).push_back(r);
    }
    // The peer's faster split at each thread count.
    std::map<int, std::size_t> best;
    for (std::size_t i = 0; i < peer_records.size(); ++i) {
      const int t = peer_records[i]["threads"];
      if (!best.count(t) || peer_records[i]["median_ms"] < peer_records[best[t]]["median_ms"]) best[t] = i;
    }
    for (std::size_t i = 0; i < peer_records.size(); ++i)
      peer_records[i]["best_split"] = best[peer_records[i]["threads"].get<int>()] == i;
    // Each chorus configuration against the peer at the same total thread count, round by round.
    for (const auto& r : ours) {
      char row[256];
      std::snprintf(row, sizeof row, "%-14s %-30s %10.3f ", w.c_str(), r["config"].get<std::string>().c_str(),
                    r["median_ms"].get<double>());
      std::string line = row;
      const int t = r["threads"];
      if (best.count(t) && r["config"].get<std::string>().rfind("ceiling", 0) != 0) {  // the ceiling is no rival
        const json& p = peer_records[best[t]];
        json q = {{"workload", w},
                  {"config", r["config"]},
                  {"threads", t},
                  {"peer_config", p["config"]},
                  {"chorus_ms", r["median_ms"]},
                  {"peer_ms", p["median_ms"]},
                  {"ratio", bench::paired_json(r, p)}};
        std::snprintf(row, sizeof row, "%10.3f  %-20s", p["median_ms"].get<double>(), fmt_spread(q["ratio"]).c_str());
        line += row;
        ratios.push_back(q);
      } else {
        std::snprintf(row, sizeof row, "%10s  %-20s", "-", "-");
        line += row;
      }
      if (r.contains("gflops")) {  // and its share of the 2048^3 sgemm's rate on as many threads
        std::snprintf(row, sizeof row, " %8.1f %6.0f%%", r["gflops"].get<double>(),
                      peak.count(t) ? 100.0 * r["gflops"].get<double>() / peak[t] : 0.0);
        line += row;
      }
      table.push_back(line);
    }
    // DataParallel scaling: 1 device against k devices, round by round.
    const json* one = nullptr;
    for (const auto& r : ours)
      if (r["config"].get<std::string>().rfind("DataParallel 1 ", 0) == 0) one = &r;
    for (const auto& r : ours)
      if (one && r["devices"].get<int>() > 1 &&
          (r["config"].get<std::string>().rfind("DataParallel", 0) == 0 || r["config"].get<std::string>().rfind("ceiling", 0) == 0)) {
        json q = {{"workload", w},
                  {"devices", r["devices"]},
                  {"one_device_ms", (*one)["median_ms"]},
                  {"ms", r["median_ms"]},
                  {"speedup", bench::paired_json(*one, r)}};
        q["config"] = r["config"];
        table.push_back("scaling " + w + ": " + r["config"].get<std::string>() +
                        ", speed-up over DataParallel 1 device: " + fmt_spread(q["speedup"]));
        scaling.push_back(q);
      }
    // DataParallel against its ceiling at the same device count, round by round: what the
    // scatter, gather, gradient sums and the optimizer step on the caller add to the computation.
    for (const auto& r : ours)
      for (const auto& c : ours)
        if (r["devices"] == c["devices"] && r["config"].get<std::string>().rfind("DataParallel", 0) == 0 &&
            c["config"].get<std::string>().rfind("ceiling", 0) == 0) {
          json q = {{"workload", w}, {"devices", r["devices"]}, {"config", r["config"]}, {"ms", r["median_ms"]},
                    {"ceiling_ms", c["median_ms"]}, {"ratio", bench::paired_json(r, c)}};
          table.push_back("overhead " + w + ": " + r["config"].get<std::string>() +
                          " / its ceiling, step time: " + fmt_spread(q["ratio"]));
          overhead.push_back(q);
        }
    // bf16 against float32 at the same thread count, round by round (products in oneDNN's bf16
    // matmul where the CPU has bf16 instructions, widened to float elsewhere: Note [which GEMM]).
    for (const auto& r : ours) {
      const std::string c = r["config"];
      if (c.size() < 5 || c.substr(c.size() - 5) != " bf16") continue;
      for (const auto& f : ours)
        if (f["config"] == c.substr(0, c.size() - 5)) {
          json q = {{"workload", w}, {"threads", r["threads"]}, {"bf16_ms", r["median_ms"]},
                    {"float32_ms", f["median_ms"]}, {"ratio", bench::paired_json(r, f)}};
          table.push_back("bf16 " + w + ": " + c + " / float32 step time: " + fmt_spread(q["ratio"]));
          mixed.push_back(q);
        }
    }
    for (auto& r : ours) records.push_back(r);
    for (auto& r : peer_records) records.push_back(r);
    if (!profile_path.empty() && max_dev > 1 && w != "tutorial") profiles.push_back(profile_workload(w, max_dev, profile_path));
    write_json();
  }

  std::printf("\nCPU: %s\nGEMM: %s\nchorus's loops: %s\n", cpu.c_str(), route.c_str(), capability.c_str());
  for (const auto& [t, g] : peak) std::printf("peak: 2048^3 sgemm, %d thread(s): %.1f GFLOP/s\n", t, g);
  std::printf("\n%d rounds; ratio = chorus / peer per round: median [min-max]; the peer at the same total thread "
              "count (its faster thread split)\n",
              rounds);
  std::printf("%-14s %-30s %10s %10s  %-20s %8s %7s\n", "workload", "chorus configuration", "chorus ms", "peer ms",
              "ratio", "GFLOP/s", "of peak");
  for (const auto& line : table) std::printf("%s\n", line.c_str());
  write_json();
  std::printf("wrote %s\n", json_path.c_str());
  return 0;
} catch (const std::exception& e) {
  std::cerr << "error: " << e.what() << "\n";
  return 1;
}
