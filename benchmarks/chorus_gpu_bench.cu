// chorus GPU benchmarks (compiled by nvcc): the fixed workloads on cuda:0, through a one-GPU
// DataParallel, and through DataParallel over {cuda:0, cuda:0}; timed with CUDA events.
// benchmarks/pytorch_gpu_bench.py runs the same workloads in PyTorch; scripts/gpu-check.sh
// runs both and scripts/compare_benchmarks.py prints the ratios.
//
//   chorus_gpu_bench [--workloads tutorial,mlp-small,mlp-large,resnet20-cifar] [--repeats N] [--json FILE]
#include <chorus/chorus.hpp>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "../examples/resnet.hpp"
#include "bench_util.hpp"

using namespace chorus;
namespace F = chorus::nn::functional;

namespace {
const Device kGpu = Device::cuda(0);

struct Tutorial : nn::Module {
  nn::Linear fc;
  Tutorial() : fc(register_module("fc", nn::Linear(5, 2))) {}
  Tensor<float> forward(const Tensor<float>& x) { return fc(x); }
};

struct Mlp : nn::Module {
  nn::Sequential net;
  Mlp(int in, int hidden, int out, int layers) : net(nullptr) {
    nn::Sequential s;
    s->push_back(nn::Linear(in, hidden));
    for (int i = 1; i + 1 < layers; ++i) {
      s->push_back(nn::ReLU());
      s->push_back(nn::Linear(hidden, hidden));
    }
    s->push_back(nn::ReLU());
    s->push_back(nn::Linear(hidden, out));
    net = register_module("net", s);
  }
  Tensor<float> forward(const Tensor<float>& x) { return net(x); }
};

/// Milliseconds of one call, measured with CUDA events on the current stream of cuda:0.
double gpu_clock(const std::function<void()>& f) {
  cudaStream_t s = current_stream(kGpu).handle();
  cudaEvent_t a, b;
  CHORUS_CUDA_CHECK(cudaEventCreate(&a));
  CHORUS_CUDA_CHECK(cudaEventCreate(&b));
  CHORUS_CUDA_CHECK(cudaEventRecord(a, s));
  f();
  CHORUS_CUDA_CHECK(cudaEventRecord(b, s));
  CHORUS_CUDA_CHECK(cudaEventSynchronize(b));
  float ms = 0;
  CHORUS_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms;
}

template <class M>
std::function<void()> train_step(std::shared_ptr<M> model, Tensor<float> x, AnyTensor y, bool classify) {
  auto opt = std::make_shared<optim::SGD>(model->parameters(), optim::SGDOptions{.lr = 0.01});
  return [model, opt, x, y, classify] {
    auto out = (*model)(x);
    auto loss = classify ? F::cross_entropy(out, y.as<std::int64_t>()) : F::mse_loss(out, y.as<float>());
    opt->zero_grad();
    loss.backward();
    opt->step();
  };
}

// A module called like DataParallel (operator()) for the plain runs.
template <class M>
struct Plain {
  M m;
  template <class... A>
  explicit Plain(A&&... a) : m(std::forward<A>(a)...) {}
  Tensor<float> operator()(const Tensor<float>& x) { return m.forward(x); }
  std::vector<AnyTensor> parameters() const { return m.parameters(); }
};
/// resnet20-cifar: a ResNet-20 training step (batch 128, SGD with momentum) on one GPU, NCHW.
template <class Run>
void resnet20_workload(Run& run, int repeats) {
  auto model = std::make_shared<Plain<examples::ResNet20<float>>>();
  model->m.to(kGpu);
  auto x = randn<float>({128, 3, 32, 32}, kGpu);
  auto y = randint(0, 10, {128}, kGpu);
  auto opt = std::make_shared<optim::SGD>(model->parameters(), optim::SGDOptions{.lr = 0.01, .momentum = 0.9});
  run("resnet20-cifar", "1 GPU fp32", 1, bench::resnet20_step_flops(128), repeats ? repeats : 50, [model, opt, x, y] {
    auto loss = F::cross_entropy((*model)(x), y);
    opt->zero_grad();
    loss.backward();
    opt->step();
  });
}
}  // namespace

int main(int argc, char** argv) try {
  std::vector<std::string> workloads = {"tutorial", "mlp-small", "mlp-large", "resnet20-cifar"};
  int repeats = 0;
  std::string json_path = "chorus_gpu_bench.json";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--workloads") workloads = bench::split(v);
    else if (a == "--repeats") repeats = std::stoi(v);
    else if (a == "--json") json_path = v;
  }
  CHORUS_CHECK(cuda_device_count() > 0, "chorus_gpu_bench needs a GPU");
  nlohmann::json records = nlohmann::json::array();
  nlohmann::json errors = nlohmann::json::array();
  // The JSON is rewritten after every workload, so a crash or a timeout later still leaves
  // what was measured; a failing workload is recorded and the next one runs.
  auto write_json = [&] {
    const std::string tmp = json_path + ".tmp";
    std::ofstream(tmp) << nlohmann::json{{"records", records}, {"errors", errors}}.dump(2) << "\n";
    std::rename(tmp.c_str(), json_path.c_str());
  };
  auto run = [&](const std::string& w, const std::string& config, int devices, double flops, int reps,
                 const std::function<void()>& step) {
    auto s = bench::measure(step, std::max(3, reps / 5), reps, gpu_clock);
    nlohmann::json r = {{"impl", "chorus"},        {"workload", w},           {"config", config},
                        {"devices", devices},      {"threads", 0},            {"median_ms", s.median_ms},
                        {"min_ms", s.min_ms},      {"max_ms", s.max_ms},      {"repeats", s.repeats}};
    if (flops > 0) r["tflops"] = flops / (s.median_ms * 1e9);
    records.push_back(r);
    std::fprintf(stderr, "  chorus %-10s %-34s median %9.3f ms\n", w.c_str(), config.c_str(), s.median_ms);
  };
  manual_seed(0);
  for (const auto& w : workloads) try {
    if (w == "tutorial") {  // data on the host, through a one-GPU DataParallel, forward only
      const int reps = repeats ? repeats : 200;
      Tutorial m;
      m.to(kGpu);
      auto dp = std::make_shared<DataParallel<Tutorial>>(std::move(m), std::vector<Device>{kGpu});
      auto loader = std::make_shared<data::DataLoader<data::TensorDataset<float, float>>>(
          data::TensorDataset<float, float>(randn<float>({100, 5}), zeros<float>({100})),
          data::DataLoaderOptions{.batch_size = 30, .shuffle = true, .seed = 1});
      run(w, "DataParallel 1 GPU", 1, 0, reps, [dp, loader] {
        for (auto batch : *loader) (void)(*dp)(batch.data);
      });
    } else if (w == "mlp-small") {
      const int reps = repeats ? repeats : 100;
      auto model = std::make_shared<Plain<Mlp>>(784, 512, 10, 3);
      model->m.to(kGpu);
      auto x = randn<float>({256, 784}, kGpu);
      auto y = randint(0, 10, {256}, kGpu);
      run(w, "1 GPU", 1, bench::mlp_step_flops(256, {{784, 512}, {512, 512}, {512, 10}}), reps,
          train_step(model, x, y, true));
    } else if (w == "mlp-large") {
      const int reps = repeats ? repeats : 20;
      const double flops = bench::mlp_step_flops(8192, {{4096, 4096}, {4096, 4096}, {4096, 4096}, {4096, 4096}});
      auto x = randn<float>({8192, 4096}, kGpu);
      auto y = randn<float>({8192, 4096}, kGpu);
      for (bool tf32 : {false, true}) {
        cuda::set_allow_tf32(tf32);
        auto model = std::make_shared<Plain<Mlp>>(4096, 4096, 4096, 4);
        model->m.to(kGpu);
        run(w, std::string("1 GPU ") + (tf32 ? "tf32" : "fp32"), 1, flops, reps, train_step(model, x, y, false));
      }
      cuda::set_allow_tf32(false);
      Mlp m(4096, 4096, 4096, 4);
      m.to(kGpu);
      auto dp = std::make_shared<DataParallel<Mlp>>(std::move(m), std::vector<Device>{kGpu, kGpu});
      run(w, "DataParallel {cuda:0, cuda:0} fp32", 2, flops, reps, train_step(dp, x, y, false));
    } else if (w == "resnet20-cifar") {
      resnet20_workload(run, repeats);
    } else {
      CHORUS_FAIL("unknown workload '", w, "'");
    }
    write_json();
  } catch (const std::exception& e) {
    cuda::set_allow_tf32(false);
    std::cerr << "error in workload " << w << ": " << e.what() << "\n";
    errors.push_back({{"workload", w}, {"error", e.what()}});
    write_json();
  }
  write_json();
  std::printf("wrote %s (%zu records, %zu failed workloads)\n", json_path.c_str(), records.size(), errors.size());
  return errors.empty() ? 0 : 1;
} catch (const std::exception& e) {
  std::cerr << "error: " << e.what() << "\n";
  return 1;
}
