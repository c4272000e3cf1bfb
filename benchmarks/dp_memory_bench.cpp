// DataParallel's sharded forms on CPU devices: what each device holds and the step time of plain
// Adam, ZeRO-1 in one process (parallel::ShardedOptimizer<Adam>), ZeRO-2 in one process (the same
// with DataParallel::shard_gradients) and ZeRO-3 in one process (parallel::FullyShardedDataParallel
// with each Linear a unit, and Adam over the shards; mlp workloads), in rounds whose order rotates
// (Note [paired rounds] in bench_util.hpp). One JSON line per form and round:
//   step_ms        median of the round's timed steps (forward, backward, Adam)
//   param_bytes    4 Psi: the model's float32 parameters
//   held_bytes     [device]: what each device holds after the timed steps (parameters, gradients,
//                  optimizer state), against its allocation before the DataParallel was built
//   grad_bytes     [device]: of that, the gradients kept there
//   state_bytes    [device]: of that, the optimizer state kept there
// benchmarks/zero_memory.sh --data-parallel prints them beside the ZeRO formulas.
//
//   dp_memory_bench [--workload mlp-medium|mlp-large|transformer-lm] [--devices N (2)] [--rounds R (3)]
//                   [--steps S (3)] [--batch B] [--forms adam,zero1,zero2,zero3]
// mlp-medium: 4 x Linear(1024, 1024), batch 512; mlp-large: 4 x Linear(4096, 4096), batch 64 (the
// GPU workload's layers, a CPU-sized batch); transformer-lm: benchmarks/lm_models.hpp, batch 8.
#include <chorus/chorus.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "lm_models.hpp"

using namespace chorus;

namespace {
struct Mlp : nn::Module {
  nn::Sequential net;
  explicit Mlp(std::int64_t w)
      : net(register_module("net", nn::Sequential(nn::Linear(w, w), nn::ReLU(), nn::Linear(w, w), nn::ReLU(),
                                                  nn::Linear(w, w), nn::ReLU(), nn::Linear(w, w)))) {}
  Tensor<float> forward(const Tensor<float>& x) { return net(x); }
};

struct Measured {
  double step_ms = 0;
  std::int64_t param_bytes = 0;
  std::vector<std::int64_t> held, grads, state;
};

/// mlp-medium / mlp-large with each Linear a FullyShard unit (ZeRO-3).
struct MlpUnits : nn::Module {
  std::vector<parallel::FullyShard<nn::Linear>> layers;
  explicit MlpUnits(std::int64_t w) {
    for (int i = 0; i < 4; ++i)
      layers.push_back(register_module("fc" + std::to_string(i), parallel::FullyShard(nn::Linear(w, w))));
  }
  Tensor<float> forward(const Tensor<float>& x) {
    auto h = x;
    for (std::size_t i = 0; i < layers.size(); ++i) h = i + 1 < layers.size() ? relu(layers[i](h)) : layers[i](h);
    return h;
  }
};

/// Runs `steps` timed steps of `model` and `opt` after one untimed, and measures what each
/// device holds against `before` (its allocation before the model was wrapped).
template <class Model, class Loss>
Measured time_and_measure(Model& model, optim::Optimizer& opt, const std::vector<Device>& devices,
                          const std::vector<std::int64_t>& before, int steps, const Loss& loss_of) {
  Measured out;
  auto step = [&] {
    opt.zero_grad();
    loss_of(model).backward();
    opt.step();
  };
  step();
  std::vector<double> t;
  for (int i = 0; i < steps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    step();
    t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  out.step_ms = t[t.size() / 2];
  auto slot = [&](Device d) {
    return static_cast<std::size_t>(std::find(devices.begin(), devices.end(), d) - devices.begin());
  };
  out.grads.assign(devices.size(), 0);
  out.state.assign(devices.size(), 0);
  for (const auto& p : model.parameters()) {
    out.param_bytes += static_cast<std::int64_t>(p.nbytes());
    const auto g = p.grad();
    if (g.defined()) out.grads[slot(g.device())] += static_cast<std::int64_t>(g.nbytes());
  }
  for (const auto& s : opt.state())
    for (const auto& [key, v] : s)
      if (key != "step") out.state[slot(v.device())] += static_cast<std::int64_t>(v.nbytes());
  for (std::size_t r = 0; r < devices.size(); ++r) out.held.push_back(memory_stats(devices[r]).allocated - before[r]);
  return out;
}

/// One form's round: builds the model's wrapper (DataParallel, or FullyShardedDataParallel over
/// the model with units for zero3) and the optimizer, and times and measures them.
template <class M, class U, class Loss>
Measured run_form(const std::string& form, const std::function<M()>& make, const std::function<U()>& make_units,
                  const std::vector<Device>& devices, int steps, const Loss& loss_of) {
  std::vector<std::int64_t> before;
  for (auto d : devices) before.push_back(memory_stats(d).allocated);
  if (form == "zero3") {
    parallel::FullyShardedDataParallel<U> model(make_units(), {.devices = devices});
    optim::Adam opt(model.parameters(), {.lr = 1e-4});
    auto m = time_and_measure(model, opt, devices, before, steps, loss_of);
    m.param_bytes = 0;  // the shards' padding is not the model's
    for (const auto& [name, n] : model.units()) m.param_bytes += n * 4;
    return m;
  }
  DataParallel<M> dp(make(), devices);
  std::unique_ptr<optim::Optimizer> opt;
  if (form == "adam") {
    opt = std::make_unique<optim::Adam>(dp.parameters(), optim::AdamOptions{.lr = 1e-4});
  } else {
    auto sharded = std::make_unique<parallel::ShardedOptimizer<optim::Adam>>(dp, optim::AdamOptions{.lr = 1e-4});
    if (form == "zero2") dp.shard_gradients(*sharded);
    opt = std::move(sharded);
  }
  return time_and_measure(dp, *opt, devices, before, steps, loss_of);
}

std::string json_list(const std::vector<std::int64_t>& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

template <class M, class U, class Loss>
void run_workload(const std::string& workload, const std::function<M()>& make, const std::function<U()>& make_units,
                  const std::vector<Device>& devices, const std::vector<std::string>& forms, int rounds, int steps,
                  int batch, const Loss& loss_of) {
  for (int r = 0; r < rounds; ++r)
    for (std::size_t k = 0; k < forms.size(); ++k) {
      const auto& form = forms[(k + static_cast<std::size_t>(r)) % forms.size()];
      const auto m = run_form<M, U>(form, make, make_units, devices, steps, loss_of);
      std::printf("{\"workload\": \"%s\", \"devices\": %zu, \"batch\": %d, \"round\": %d, \"form\": \"%s\", "
                  "\"step_ms\": %.2f, \"param_bytes\": %lld, \"held_bytes\": %s, \"grad_bytes\": %s, "
                  "\"state_bytes\": %s}\n",
                  workload.c_str(), devices.size(), batch, r, form.c_str(), m.step_ms,
                  static_cast<long long>(m.param_bytes), json_list(m.held).c_str(), json_list(m.grads).c_str(),
                  json_list(m.state).c_str());
      std::fflush(stdout);
    }
}
}  // namespace

int main(int argc, char** argv) try {
  std::string workload = "mlp-medium";
  int ndev = 2, rounds = 3, steps = 3, batch = 0;
  std::vector<std::string> forms = {"adam", "zero1", "zero2", "zero3"};
  bool forms_given = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--workload") workload = v;
    else if (a == "--devices") ndev = std::stoi(v);
    else if (a == "--rounds") rounds = std::stoi(v);
    else if (a == "--steps") steps = std::stoi(v);
    else if (a == "--batch") batch = std::stoi(v);
    else if (a == "--forms") forms = bench::split(v), forms_given = true;
    else {
      std::fprintf(stderr, "usage: dp_memory_bench [--workload mlp-medium|mlp-large|transformer-lm] [--devices N] "
                           "[--rounds R] [--steps S] [--batch B] [--forms adam,zero1,zero2,zero3]\n");
      return 2;
    }
  }
  CHORUS_CHECK(ndev >= 1 && rounds >= 1 && steps >= 1, "--devices, --rounds and --steps must be at least 1");
  for (const auto& f : forms)
    CHORUS_CHECK(f == "adam" || f == "zero1" || f == "zero2" || f == "zero3",
                 "--forms: adam, zero1, zero2 or zero3, not '", f, "'");
  set_cpu_device_count(ndev);
  std::vector<Device> devices;
  for (int i = 0; i < ndev; ++i) devices.push_back(Device::cpu(i));
  backend::cpu::set_blas_threads(1);  // DataParallel's devices are the threads
  manual_seed(0);
  if (workload == "mlp-medium" || workload == "mlp-large") {
    const std::int64_t w = workload == "mlp-medium" ? 1024 : 4096;
    if (batch == 0) batch = workload == "mlp-medium" ? 512 : 64;
    auto x = randn<float>({batch, w}), y = randn<float>({batch, w});
    run_workload<Mlp, MlpUnits>(workload, [w] { return Mlp(w); }, [w] { return MlpUnits(w); }, devices, forms, rounds,
                                steps, batch, [&](auto& model) { return nn::functional::mse_loss(model(x), y); });
  } else if (workload == "transformer-lm") {
    using Lm = bench::TransformerLmT<float>;
    if (batch == 0) batch = 8;
    auto x = randint(0, bench::kLmVocab, {batch, Lm::kSeq});
    auto y = randint(0, bench::kLmVocab, {batch * Lm::kSeq});
    if (!forms_given) forms.pop_back();  // zero3
    for (const auto& f : forms)
      CHORUS_CHECK(f != "zero3", "--forms: zero3 is measured on mlp-medium and mlp-large (ddp_bench has the "
                                 "transformer-lm with units, across processes)");
    run_workload<Lm, Lm>(workload, [] { return Lm(); }, [] { return Lm(); }, devices, forms, rounds, steps, batch,
                         [&](auto& model) {
                           return nn::functional::cross_entropy(model(x).reshape({y.shape()[0], bench::kLmVocab}), y);
                         });
  } else {
    CHORUS_FAIL("--workload: mlp-medium, mlp-large or transformer-lm, not '", workload, "'");
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "dp_memory_bench: %s\n", e.what());
  return 1;
}
