// chorus GPU benchmarks (compiled by nvcc): the fixed workloads on cuda:0, through a one-GPU
// DataParallel, and through DataParallel over {cuda:0, cuda:0}; timed with CUDA events.
// benchmarks/pytorch_gpu_bench.py runs the same workloads in PyTorch and, given --chorus, drives
// this program as its server so that the two alternate round by round (Note [paired rounds] in
// bench_util.hpp); scripts/compare_benchmarks.py then prints the paired ratios.
//
//   chorus_gpu_bench --serve     (Note [peer protocol] in peer.hpp)
//   chorus_gpu_bench [--workloads tutorial,mlp-small,mlp-large,resnet20-cifar,lstm-lm,transformer-lm] [--rounds R] [--repeats N]
//                    [--json FILE]     (alone: its own rounds, no peer)
//
// TF32 is off in every row but those labelled tf32 (cuBLAS and cuDNN alike, one flag), as in
// pytorch_gpu_bench.py.
#include <chorus/chorus.hpp>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "../examples/resnet.hpp"
#include "bench_util.hpp"
#include "lm_models.hpp"
#include "peer.hpp"

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
std::function<void()> train_step(std::shared_ptr<M> model, Tensor<float> x, AnyTensor y, bool classify,
                                 double momentum = 0) {
  auto opt = std::make_shared<optim::SGD>(model->parameters(), optim::SGDOptions{.lr = 0.01, .momentum = momentum});
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
  template <class X>
  Tensor<float> operator()(const X& x) {
    return m.forward(x);
  }
  std::vector<AnyTensor> parameters() const { return m.parameters(); }
};

/// One language-model step (lstm-lm, transformer-lm): logits [B, L, vocab], cross-entropy over
/// all positions, Adam -- as chorus_bench's.
template <class M>
std::function<void()> lm_step(std::int64_t batch, std::int64_t len) {
  auto model = std::make_shared<Plain<M>>();
  model->m.to(kGpu);
  auto opt = std::make_shared<optim::Adam>(model->parameters(), optim::AdamOptions{.lr = 1e-3});
  auto x = randint(0, bench::kLmVocab, {batch, len}, kGpu);
  auto y = randint(0, bench::kLmVocab, {batch * len}, kGpu);
  return [model, opt, x, y] {
    auto loss = F::cross_entropy((*model)(x).reshape({y.shape()[0], bench::kLmVocab}), y);
    opt->zero_grad();
    loss.backward();
    opt->step();
  };
}

/// Timed steps per round (the same as pytorch_gpu_bench.py's REPEATS).
int repeats_for(const std::string& w) {
  return w == "tutorial" ? 40 : w == "mlp-small" ? 20 : w == "mlp-large" ? 4 : w == "transformer-lm" ? 20 : 10;
}

/// The configurations of workload `w`. Each is built under its TF32 setting and sets it again at
/// every step: the rounds interleave fp32 and tf32 configurations in this one process.
std::vector<bench::Offer> offers(const std::string& w) {
  auto meta = [&](const std::string& config, int devices, double flops, bool tf32) {
    return nlohmann::json{{"impl", "chorus"}, {"workload", w},   {"config", config},
                          {"devices", devices}, {"threads", 0}, {"flops", flops}, {"tf32", tf32}};
  };
  auto under = [](bool tf32, std::function<std::function<void()>()> build) {
    return [tf32, build]() -> std::function<void()> {
      cuda::set_allow_tf32(tf32);
      auto step = build();
      return [tf32, step] {
        cuda::set_allow_tf32(tf32);
        step();
      };
    };
  };
  if (w == "tutorial") {  // data on the host, through a one-GPU DataParallel, forward only
    return {{meta("DataParallel 1 GPU", 1, 0, false), under(false, [] {
               Tutorial m;
               m.to(kGpu);
               auto dp = std::make_shared<DataParallel<Tutorial>>(std::move(m), std::vector<Device>{kGpu});
               auto loader = std::make_shared<data::DataLoader<data::TensorDataset<float, float>>>(
                   data::TensorDataset<float, float>(randn<float>({100, 5}), zeros<float>({100})),
                   data::DataLoaderOptions{.batch_size = 30, .shuffle = true, .seed = 1});
               return std::function<void()>([dp, loader] {
                 for (auto batch : *loader) (void)(*dp)(batch.data);
               });
             }),
             20}};
  }
  if (w == "mlp-small") {
    return {{meta("1 GPU", 1, bench::mlp_step_flops(256, {{784, 512}, {512, 512}, {512, 10}}), false), under(false, [] {
               auto model = std::make_shared<Plain<Mlp>>(784, 512, 10, 3);
               model->m.to(kGpu);
               return train_step(model, randn<float>({256, 784}, kGpu), randint(0, 10, {256}, kGpu), true);
             }),
             10}};
  }
  if (w == "mlp-large") {
    const double flops = bench::mlp_step_flops(8192, {{4096, 4096}, {4096, 4096}, {4096, 4096}, {4096, 4096}});
    std::vector<bench::Offer> out;
    for (bool tf32 : {false, true})
      out.push_back({meta(std::string("1 GPU ") + (tf32 ? "tf32" : "fp32"), 1, flops, tf32), under(tf32, [] {
                       auto model = std::make_shared<Plain<Mlp>>(4096, 4096, 4096, 4);
                       model->m.to(kGpu);
                       return train_step(model, randn<float>({8192, 4096}, kGpu), randn<float>({8192, 4096}, kGpu),
                                         false);
                     }),
                     3});
    out.push_back({meta("DataParallel {cuda:0, cuda:0} fp32", 2, flops, false), under(false, [] {
                     Mlp m(4096, 4096, 4096, 4);
                     m.to(kGpu);
                     auto dp = std::make_shared<DataParallel<Mlp>>(std::move(m), std::vector<Device>{kGpu, kGpu});
                     return train_step(dp, randn<float>({8192, 4096}, kGpu), randn<float>({8192, 4096}, kGpu), false);
                   }),
                   3});
    return out;
  }
  if (w == "resnet20-cifar") {  // batch 128, SGD with momentum, NCHW
    return {{meta("1 GPU fp32", 1, bench::resnet20_step_flops(128), false), under(false, [] {
               auto model = std::make_shared<Plain<examples::ResNet20<float>>>();
               model->m.to(kGpu);
               return train_step(model, randn<float>({128, 3, 32, 32}, kGpu), randint(0, 10, {128}, kGpu), true, 0.9);
             }),
             10}};
  }
  if (w == "lstm-lm") {  // batch 64, sequence 64, Adam
    return {{meta("1 GPU fp32", 1, bench::lstm_lm_step_flops(64, 64, bench::kLmWidth, bench::kLmWidth, 2, bench::kLmVocab),
                  false),
             under(false, [] { return lm_step<bench::LstmLm>(64, 64); }), 5}};
  }
  if (w == "transformer-lm") {  // batch 32, sequence 128, Adam
    return {{meta("1 GPU fp32", 1, bench::transformer_lm_step_flops(32, 128, bench::kLmWidth, 1024, 4, bench::kLmVocab),
                  false),
             under(false, [] { return lm_step<bench::TransformerLm>(32, bench::TransformerLm::kSeq); }), 5}};
  }
  CHORUS_FAIL("unknown workload '", w, "'");
}
}  // namespace

int main(int argc, char** argv) try {
  std::vector<std::string> workloads = {"tutorial", "mlp-small", "mlp-large", "resnet20-cifar", "lstm-lm",
                                        "transformer-lm"};
  int repeats = 0, rounds = 5;
  bool serve = false;
  std::string json_path = "chorus_gpu_bench.json";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--serve") {
      serve = true;
      continue;
    }
    CHORUS_CHECK(i + 1 < argc, "missing value after ", a);
    const std::string v = argv[++i];
    if (a == "--workloads") workloads = bench::split(v);
    else if (a == "--rounds") rounds = std::stoi(v);
    else if (a == "--repeats") repeats = std::stoi(v);
    else if (a == "--json") json_path = v;
    else CHORUS_FAIL("unknown option ", a);
  }
  CHORUS_CHECK(rounds >= 1, "--rounds must be at least 1, got ", rounds);
  CHORUS_CHECK(cuda_device_count() > 0, "chorus_gpu_bench needs a GPU");
  manual_seed(0);
  if (serve) return bench::serve(offers, gpu_clock);
  nlohmann::json records = nlohmann::json::array();
  nlohmann::json errors = nlohmann::json::array();
  // The JSON is rewritten after every workload, so a crash or a timeout later still leaves
  // what was measured; a failing workload is recorded and the next one runs.
  auto write_json = [&] {
    const std::string tmp = json_path + ".tmp";
    std::ofstream(tmp) << nlohmann::json{{"records", records}, {"errors", errors}, {"rounds", rounds},
                                         {"interleaved_with", nullptr}}
                                  .dump(2)
                       << "\n";
    std::rename(tmp.c_str(), json_path.c_str());
  };
  for (const auto& w : workloads) try {
    std::vector<bench::Entry> entries;
    for (auto& o : offers(w)) {
      auto timed = std::make_shared<bench::Timed>(o.make(), o.warmup, gpu_clock);
      entries.push_back({o.meta, [timed](int n) { return timed->round(n); }});
    }
    const auto samples = bench::run_rounds(entries, {}, rounds, repeats > 0 ? repeats : repeats_for(w));
    for (std::size_t i = 0; i < entries.size(); ++i) {
      auto r = bench::make_record(entries[i].meta, samples[i], "tflops", 1e9);
      std::fprintf(stderr, "  chorus %-14s %-34s median %9.3f ms\n", w.c_str(), r["config"].get<std::string>().c_str(),
                   r["median_ms"].get<double>());
      records.push_back(r);
    }
    cuda::set_allow_tf32(false);
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
