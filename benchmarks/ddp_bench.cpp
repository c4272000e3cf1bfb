// DistributedDataParallel on the CPU: one mlp-medium training step (4 x Linear(1024, 1024), ReLU,
// MSE, SGD) with a fixed global batch of 512 split over the processes, one BLAS thread each
// (--width 4096: mlp-large's layers, 4 x Linear(4096, 4096), with a CPU-sized --batch;
// --workload transformer-lm: train_lm's Transformer with transformer-lm's sizes, 4 layers of
// width 256, 4 heads, 128 tokens of a 96-symbol vocabulary, cross-entropy, global batch --batch).
// Run under mpirun with 1 and 2 processes (benchmarks/ddp_scaling.sh does both and prints the
// speedup). Rank 0 prints one JSON line:
//   step_ms   median time of a DDP step (forward, backward with bucketed all-reduces, SGD)
//   local_ms  the same step under no_sync(): the computation alone
//   comm_ms   all-reducing the same buckets with nothing else running
//   hidden    share of comm_ms that the overlap with backward hides: 1 - (step - local) / comm
//   plain_ms  (1 process) the plain module's step without DistributedDataParallel: the baseline
//   held_bytes  what rank 0 holds after the timed steps (parameters, gradients, optimizer state)
//   grad_bytes  of that, its gradients
//   profiled_hidden_percent, profiled_comm_ms  (--profile FILE) from chorus::profiler over 5
//               more steps: the share of the all-reduces' time during which backward computed,
//               and their time, medians over the steps; each rank writes FILE.rank<R>.json
//
//   mpirun -np N ddp_bench [--steps S] [--warmup W] [--batch B] [--bucket-mb MB (default 25)]
//                          [--optimizer sgd|adam|zero1|zero2|zero3] [--width W (1024)]
//                          [--workload mlp|transformer-lm] [--profile FILE]
// zero1: ZeroRedundancyOptimizer<Adam>; zero2: the same with DistributedDataParallel::shard_gradients;
// zero3: dist::FullyShardedDataParallel with each Linear a unit, and Adam over the shards (its
// line has step_ms and the bytes only: no buckets, no no_sync).
#include <chorus/distributed.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "../examples/lm_models.hpp"
#include "../examples/profile_option.hpp"

using namespace chorus;

namespace {
struct MlpMedium : nn::Module {
  nn::Sequential net;
  explicit MlpMedium(std::int64_t w)
      : net(register_module("net", nn::Sequential(nn::Linear(w, w), nn::ReLU(), nn::Linear(w, w), nn::ReLU(),
                                                  nn::Linear(w, w), nn::ReLU(), nn::Linear(w, w)))) {}
  Tensor<float> forward(const Tensor<float>& x) { return net(x); }
};

/// mlp-medium with each Linear a FullyShard unit (ZeRO-3).
struct MlpMediumUnits : nn::Module {
  std::vector<dist::FullyShard<nn::Linear>> layers;
  explicit MlpMediumUnits(std::int64_t w) {
    for (int i = 0; i < 4; ++i)
      layers.push_back(register_module("fc" + std::to_string(i), dist::FullyShard(nn::Linear(w, w))));
  }
  Tensor<float> forward(const Tensor<float>& x) {
    auto h = layers[0](x);
    for (std::size_t i = 1; i < layers.size(); ++i) h = layers[i](relu(h));
    return h;
  }
};

/// The JSON's workload: mlp-medium's or mlp-large's width, or another.
std::string workload_name(std::int64_t width) {
  return width == 1024 ? "mlp-medium" : width == 4096 ? "mlp-large" : "mlp-" + std::to_string(width);
}

/// Median of `steps` timed runs of f after `warmup` untimed ones; every run starts on all ranks
/// at once (a barrier), so rank 0's time is the step's.
double median_ms(dist::ProcessGroup& pg, int warmup, int steps, const std::function<void()>& f) {
  for (int i = 0; i < warmup; ++i) f();
  std::vector<double> t;
  for (int i = 0; i < steps; ++i) {
    pg.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

/// The zero3 form: the step and what rank 0 holds after it.
template <class Units, class In, class Loss>
int bench_zero3(dist::ProcessGroup& pg, int warmup, int steps, int batch, const std::string& workload,
                const std::function<Units()>& units, const In& x, const Loss& loss_of) {
  const auto held_before = memory_stats(Device::cpu(0)).allocated;  // the model is made after this
  dist::FullyShardedDataParallel<Units> fsdp{units()};
  optim::Adam opt(fsdp.parameters(), {.lr = 1e-4});
  const double step_ms = median_ms(pg, warmup, steps, [&] {
    auto loss = loss_of(fsdp(x));
    opt.zero_grad();
    loss.backward();
    opt.step();
  });
  pg.barrier();
  const auto held_bytes = memory_stats(Device::cpu(0)).allocated - held_before;
  std::size_t grad_bytes = 0;
  for (const auto& p : fsdp.parameters())
    if (p.grad().defined()) grad_bytes += p.grad().nbytes();
  if (pg.rank() == 0)
    std::printf("{\"workload\": \"%s\", \"processes\": %d, \"global_batch\": %d, \"step_ms\": %.2f, "
                "\"optimizer\": \"zero3\", \"held_bytes\": %lld, \"grad_bytes\": %zu}\n",
                workload.c_str(), pg.world_size(), batch, step_ms, static_cast<long long>(held_bytes), grad_bytes);
  return 0;
}

struct Options {
  int steps = 20, warmup = 3, batch = 512;
  double bucket_mb = 25;  // DistributedDataParallel's default cap
  std::string optimizer = "sgd";
  std::string profile;  // --profile FILE: a trace of 5 steps per rank
};

/// The median of `field` over the profile's steps.
double median_of(const profiler::Summary& s, double profiler::StepSummary::*field) {
  std::vector<double> v;
  for (const auto& step : s.steps) v.push_back(step.*field);
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

/// One form of one workload: `plain` and `units` build the model without and with FullyShard
/// units, `x` is this rank's input and `loss_of` maps the model's output to the loss.
template <class Plain, class Units, class In, class Loss>
int bench(dist::ProcessGroup& pg, const Options& o, const std::string& workload, const std::function<Plain()>& plain,
          const std::function<Units()>& units, const In& x, const Loss& loss_of) {
  const int world = pg.world_size();
  if (o.optimizer == "zero3") return bench_zero3(pg, o.warmup, o.steps, o.batch, workload, units, x, loss_of);
  const auto held_before = memory_stats(Device::cpu(0)).allocated;
  DistributedDataParallel<Plain> ddp(plain(), {.bucket_cap_bytes = static_cast<std::size_t>(o.bucket_mb * (1 << 20))});
  std::unique_ptr<optim::Optimizer> opt_owner;
  if (o.optimizer == "sgd") {
    opt_owner = std::make_unique<optim::SGD>(ddp.parameters(), optim::SGDOptions{.lr = 1e-4});
  } else if (o.optimizer == "adam") {
    opt_owner = std::make_unique<optim::Adam>(ddp.parameters(), optim::AdamOptions{.lr = 1e-4});
  } else {
    auto zero = std::make_unique<optim::ZeroRedundancyOptimizer<optim::Adam>>(ddp.parameters(),
                                                                              optim::AdamOptions{.lr = 1e-4});
    if (o.optimizer == "zero2") ddp.shard_gradients(*zero);
    opt_owner = std::move(zero);
  }
  optim::Optimizer& opt = *opt_owner;
  auto step = [&] {
    auto loss = loss_of(ddp(x));
    opt.zero_grad();
    loss.backward();
    opt.step();
  };
  auto run = [&](const std::function<void()>& f) { return median_ms(pg, o.warmup, o.steps, f); };
  const double step_ms = run(step);
  pg.barrier();  // (the communication thread lets go of finished collectives' tensors)
  const auto held_bytes = memory_stats(Device::cpu(0)).allocated - held_before;
  std::size_t grad_bytes = 0;
  for (const auto& p : ddp.parameters())
    if (p.grad().defined()) grad_bytes += p.grad().nbytes();
  const double local_ms = run([&] {
    auto guard = ddp.no_sync();
    step();
  });
  // The same buckets' all-reduces alone.
  std::vector<Tensor<float>> buckets;
  std::size_t bytes = 0;
  for (const auto& b : ddp.bucket_names()) {
    std::int64_t n = 0;
    for (const auto& name : b)
      for (const auto& p : ddp.named_parameters())
        if (p.name == name) n += p.tensor.numel();
    buckets.push_back(zeros<float>({n}));
    bytes += static_cast<std::size_t>(n) * sizeof(float);
  }
  const double comm_ms = world == 1 ? 0.0 : run([&] {
    std::vector<std::shared_ptr<dist::Work>> works;
    for (auto& b : buckets) works.push_back(pg.all_reduce_async(b, dist::ReduceOp::Avg));
    for (auto& w : works) w->wait(pg.timeout());
  });
  // The baseline of the scaling: the plain module's step, no wrapper (one process only).
  double plain_ms = 0;
  if (world == 1) {
    Plain model = plain();
    optim::SGD plain_opt(model.parameters(), {.lr = 1e-4});
    plain_ms = run([&] {
      auto loss = loss_of(model.forward(x));
      plain_opt.zero_grad();
      loss.backward();
      plain_opt.step();
    });
  }
  const double hidden = comm_ms > 0 ? std::clamp(1.0 - (step_ms - local_ms) / comm_ms, 0.0, 1.0) : 0.0;
  // The same steps seen by the profiler: how much of the all-reduces' time backward computed.
  double profiled_hidden = -1, profiled_comm = -1;
  if (!o.profile.empty()) {
    auto prof = profiler::start();
    for (int s = 0; s < 5; ++s) {
      step();
      prof.step();
    }
    const auto& p = prof.stop();
    p.save(examples::tagged_path(o.profile, "rank" + std::to_string(pg.rank())));
    const auto summary = p.summary();
    profiled_hidden = median_of(summary, &profiler::StepSummary::hidden_percent);
    profiled_comm = median_of(summary, &profiler::StepSummary::communication_ms);
    if (pg.rank() == 0) std::fprintf(stderr, "%s", summary.table().c_str());
  }
  if (pg.rank() == 0)
    std::printf(
        "{\"workload\": \"%s\", \"processes\": %d, \"global_batch\": %d, \"buckets\": %zu, "
        "\"gradient_bytes\": %zu, \"step_ms\": %.2f, \"local_ms\": %.2f, \"comm_ms\": %.2f, \"hidden\": %.2f, "
        "\"plain_ms\": %.2f, \"optimizer\": \"%s\", \"held_bytes\": %lld, \"grad_bytes\": %zu, "
        "\"profiled_hidden_percent\": %.1f, \"profiled_comm_ms\": %.2f}\n",
        workload.c_str(), world, o.batch, buckets.size(), bytes, step_ms, local_ms, comm_ms, hidden, plain_ms,
        o.optimizer.c_str(), static_cast<long long>(held_bytes), grad_bytes, profiled_hidden, profiled_comm);
  return 0;
}
}  // namespace

int main(int argc, char** argv) try {
  Options o;
  std::int64_t width = 1024;
  std::string workload = "mlp";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--steps") o.steps = std::stoi(argv[i + 1]);
    else if (a == "--warmup") o.warmup = std::stoi(argv[i + 1]);
    else if (a == "--batch") o.batch = std::stoi(argv[i + 1]);
    else if (a == "--bucket-mb") o.bucket_mb = std::stod(argv[i + 1]);
    else if (a == "--optimizer") o.optimizer = argv[i + 1];
    else if (a == "--width") width = std::stoll(argv[i + 1]);
    else if (a == "--workload") workload = argv[i + 1];
    else if (a == "--profile") o.profile = argv[i + 1];
    else {
      std::fprintf(stderr, "usage: ddp_bench [--steps S] [--warmup W] [--batch B] [--bucket-mb MB] "
                           "[--optimizer sgd|adam|zero1|zero2|zero3] [--width W] [--workload mlp|transformer-lm] "
                           "[--profile FILE]\n");
      return 2;
    }
  }
  auto& pg = dist::init();
  const int world = pg.world_size();
  CHORUS_CHECK(o.batch % world == 0, "batch ", o.batch, " is not a multiple of ", world);
  CHORUS_CHECK(o.optimizer == "sgd" || o.optimizer == "adam" || o.optimizer == "zero1" || o.optimizer == "zero2" ||
                   o.optimizer == "zero3",
               "--optimizer must be sgd, adam, zero1, zero2 or zero3, not '", o.optimizer, "'");
  backend::cpu::set_blas_threads(1);
  manual_seed(0);
  if (workload == "mlp") {
    auto x = randn<float>({o.batch / world, width});
    auto y = randn<float>({o.batch / world, width});
    return bench<MlpMedium, MlpMediumUnits>(
        pg, o, workload_name(width), [&] { return MlpMedium(width); }, [&] { return MlpMediumUnits(width); }, x,
        [&](const Tensor<float>& out) { return nn::functional::mse_loss(out, y); });
  }
  CHORUS_CHECK(workload == "transformer-lm", "--workload must be mlp or transformer-lm, not '", workload, "'");
  constexpr std::int64_t kVocab = 96, kSeq = 128, kWidth = 256, kHeads = 4, kLayers = 4;
  auto x = randint(0, kVocab, {o.batch / world, kSeq});
  auto y = randint(0, kVocab, {o.batch / world * kSeq});
  using Plain = examples::CharTransformerT<>;
  using Units = examples::CharTransformerT<dist::FullyShard>;
  return bench<Plain, Units>(
      pg, o, workload, [&] { return Plain(kVocab, kSeq, kWidth, kHeads, kLayers, 0.0); },
      [&] { return Units(kVocab, kSeq, kWidth, kHeads, kLayers, 0.0); }, x,
      [&](const Tensor<float>& out) { return nn::functional::cross_entropy(out.reshape({y.shape()[0], kVocab}), y); });
} catch (const std::exception& e) {
  std::fprintf(stderr, "ddp_bench: %s\n", e.what());
  return 1;
}
