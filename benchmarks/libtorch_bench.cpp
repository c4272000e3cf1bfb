// The same workloads as chorus_bench, in LibTorch (the CPU peer). chorus_bench starts one per
// thread split and runs its rounds between its own (Note [peer protocol] in peer.hpp):
//   libtorch_bench --serve --threads T [--omp-threads O]
// Alone, it runs its own rounds and writes JSON records:
//   libtorch_bench --threads T [--omp-threads O] [--workloads ...] [--rounds R] [--repeats N] [--json FILE]
#include <torch/torch.h>

#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "bench_util.hpp"
#include "peer.hpp"

namespace {
// ResNet-20 as examples/resnet.hpp builds it (option-A shortcuts: subsample and zero-pad).
struct BasicBlockImpl : torch::nn::Module {
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr}, bn2{nullptr};
  int64_t in_planes, planes, stride;
  BasicBlockImpl(int64_t in, int64_t out, int64_t s) : in_planes(in), planes(out), stride(s) {
    conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3).stride(s).padding(1).bias(false)));
    bn1 = register_module("bn1", torch::nn::BatchNorm2d(out));
    conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(out, out, 3).padding(1).bias(false)));
    bn2 = register_module("bn2", torch::nn::BatchNorm2d(out));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto out = torch::relu(bn1(conv1(x)));
    out = bn2(conv2(out));
    torch::Tensor sc = x;
    if (stride != 1 || in_planes != planes) {
      const int64_t pad = (planes - in_planes) / 2;
      sc = torch::nn::functional::pad(x.slice(2, 0, c10::nullopt, stride).slice(3, 0, c10::nullopt, stride),
                                      torch::nn::functional::PadFuncOptions({0, 0, 0, 0, pad, pad}));
    }
    return torch::relu(out + sc);
  }
};
TORCH_MODULE(BasicBlock);

struct ResNet20Impl : torch::nn::Module {
  torch::nn::Conv2d conv1{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr};
  torch::nn::Sequential layer1, layer2, layer3;
  torch::nn::Linear fc{nullptr};
  ResNet20Impl() {
    conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 16, 3).padding(1).bias(false)));
    bn1 = register_module("bn1", torch::nn::BatchNorm2d(16));
    layer1 = register_module("layer1", stage(16, 16, 1));
    layer2 = register_module("layer2", stage(16, 32, 2));
    layer3 = register_module("layer3", stage(32, 64, 2));
    fc = register_module("fc", torch::nn::Linear(64, 10));
  }
  static torch::nn::Sequential stage(int64_t in, int64_t out, int64_t s) {
    return torch::nn::Sequential(BasicBlock(in, out, s), BasicBlock(out, out, 1), BasicBlock(out, out, 1));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto out = torch::relu(bn1(conv1(x)));
    out = layer3->forward(layer2->forward(layer1->forward(out)));
    return fc(torch::adaptive_avg_pool2d(out, {1, 1}).flatten(1));
  }
};
TORCH_MODULE(ResNet20);

// The language models as chorus_bench.cpp defines them (benchmarks/README.md): tokens [B, L] of a
// 96-symbol vocabulary -> Embedding(96, 256) -> the model -> Linear(256, 96), cross-entropy over
// all B*L positions, Adam.
constexpr int64_t kLmVocab = 96, kLmWidth = 256;

struct LstmLmImpl : torch::nn::Module {
  torch::nn::Embedding embed{nullptr};
  torch::nn::LSTM lstm{nullptr};
  torch::nn::Linear head{nullptr};
  LstmLmImpl() {
    embed = register_module("embed", torch::nn::Embedding(kLmVocab, kLmWidth));
    lstm = register_module("lstm", torch::nn::LSTM(torch::nn::LSTMOptions(kLmWidth, kLmWidth).num_layers(2).batch_first(true)));
    head = register_module("head", torch::nn::Linear(kLmWidth, kLmVocab));
  }
  torch::Tensor forward(const torch::Tensor& tokens) { return head(std::get<0>(lstm(embed(tokens)))); }
};
TORCH_MODULE(LstmLm);

struct TransformerLmImpl : torch::nn::Module {
  static constexpr int64_t kSeq = 128;
  torch::nn::Embedding embed{nullptr}, pos{nullptr};
  torch::nn::TransformerEncoder encoder{nullptr};
  torch::nn::Linear head{nullptr};
  TransformerLmImpl() {
    embed = register_module("embed", torch::nn::Embedding(kLmVocab, kLmWidth));
    pos = register_module("pos", torch::nn::Embedding(kSeq, kLmWidth));
    encoder = register_module(
        "encoder", torch::nn::TransformerEncoder(torch::nn::TransformerEncoderOptions(
                       torch::nn::TransformerEncoderLayerOptions(kLmWidth, 4).dim_feedforward(1024).dropout(0.0), 4)));
    head = register_module("head", torch::nn::Linear(kLmWidth, kLmVocab));
  }
  torch::Tensor forward(const torch::Tensor& tokens) {
    const int64_t len = tokens.size(1);
    auto x = embed(tokens) + pos(torch::arange(len, torch::kLong));  // [B, L, E]
    auto mask = torch::nn::TransformerImpl::generate_square_subsequent_mask(len);
    return head(encoder(x.transpose(0, 1), mask).transpose(0, 1));
  }
};
TORCH_MODULE(TransformerLm);

std::function<void()> make_workload(const std::string& w) {
  if (w == "tutorial") {
    auto model = std::make_shared<torch::nn::Linear>(5, 2);
    auto data = torch::randn({100, 5});
    return [model, data] {
      auto perm = torch::randperm(100, torch::kLong);
      for (int64_t s = 0; s < 100; s += 30) {
        auto idx = perm.slice(0, s, std::min<int64_t>(s + 30, 100));
        (void)(*model)->forward(data.index_select(0, idx));
      }
    };
  }
  if (w == "mlp-small") {
    auto model = std::make_shared<torch::nn::Sequential>(torch::nn::Linear(784, 512), torch::nn::ReLU(),
                                                         torch::nn::Linear(512, 512), torch::nn::ReLU(),
                                                         torch::nn::Linear(512, 10));
    auto opt = std::make_shared<torch::optim::SGD>((*model)->parameters(), torch::optim::SGDOptions(0.01));
    auto x = torch::randn({256, 784});
    auto y = torch::randint(0, 10, {256}, torch::kLong);
    return [model, opt, x, y] {
      auto loss = torch::nn::functional::cross_entropy((*model)->forward(x), y);
      opt->zero_grad();
      loss.backward();
      opt->step();
    };
  }
  if (w == "mlp-medium") {
    auto model = std::make_shared<torch::nn::Sequential>(
        torch::nn::Linear(1024, 1024), torch::nn::ReLU(), torch::nn::Linear(1024, 1024), torch::nn::ReLU(),
        torch::nn::Linear(1024, 1024), torch::nn::ReLU(), torch::nn::Linear(1024, 1024));
    auto opt = std::make_shared<torch::optim::SGD>((*model)->parameters(), torch::optim::SGDOptions(0.01));
    auto x = torch::randn({512, 1024});
    auto y = torch::randn({512, 1024});
    return [model, opt, x, y] {
      auto loss = torch::mse_loss((*model)->forward(x), y);
      opt->zero_grad();
      loss.backward();
      opt->step();
    };
  }
  if (w == "resnet20-cifar") {
    auto model = std::make_shared<ResNet20>();
    auto opt = std::make_shared<torch::optim::SGD>((*model)->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
    auto x = torch::randn({128, 3, 32, 32});
    auto y = torch::randint(0, 10, {128}, torch::kLong);
    return [model, opt, x, y] {
      auto loss = torch::nn::functional::cross_entropy((*model)->forward(x), y);
      opt->zero_grad();
      loss.backward();
      opt->step();
    };
  }
  if (w == "lstm-lm" || w == "transformer-lm") {
    const bool lstm = w == "lstm-lm";
    const int64_t batch = lstm ? 64 : 32, len = lstm ? 64 : TransformerLmImpl::kSeq;
    auto x = torch::randint(0, kLmVocab, {batch, len}, torch::kLong);
    auto y = torch::randint(0, kLmVocab, {batch * len}, torch::kLong);
    auto step = [x, y](auto model) {
      auto opt = std::make_shared<torch::optim::Adam>((*model)->parameters(), torch::optim::AdamOptions(1e-3));
      return std::function<void()>([model, opt, x, y] {
        auto loss = torch::nn::functional::cross_entropy((*model)->forward(x).reshape({y.size(0), kLmVocab}), y);
        opt->zero_grad();
        loss.backward();
        opt->step();
      });
    };
    if (lstm) return step(std::make_shared<LstmLm>());
    return step(std::make_shared<TransformerLm>());
  }
  throw std::runtime_error("unknown workload " + w);
}
}  // namespace

int main(int argc, char** argv) try {
  int threads = 1, omp_threads = 0, repeats = 0, rounds = 7;
  bool serve = false;
  std::vector<std::string> workloads = {"tutorial", "mlp-small", "mlp-medium", "resnet20-cifar", "lstm-lm", "transformer-lm"};
  std::string json_path = "libtorch_bench.json";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--serve") {
      serve = true;
      continue;
    }
    if (i + 1 >= argc) throw std::runtime_error("missing value after " + a);
    const std::string v = argv[++i];
    if (a == "--threads") threads = std::stoi(v);
    else if (a == "--omp-threads") omp_threads = std::stoi(v);
    else if (a == "--workloads") workloads = bench::split(v);
    else if (a == "--rounds") rounds = std::stoi(v);
    else if (a == "--repeats") repeats = std::stoi(v);
    else if (a == "--json") json_path = v;
    else throw std::runtime_error("unknown option " + a);
  }
  // Intra-op threads (OpenMP); the BLAS threads come from OPENBLAS_NUM_THREADS (set by the driver).
  if (omp_threads == 0) omp_threads = threads;
  torch::set_num_threads(omp_threads);
  torch::manual_seed(0);
  auto offers = [&](const std::string& w) {
    nlohmann::json meta = {{"impl", "libtorch"},
                           {"workload", w},
                           {"config", std::to_string(threads) + " thread(s), " + std::to_string(omp_threads) +
                                          " intra-op"},
                           {"devices", 1},
                           {"threads", threads},
                           {"omp_threads", omp_threads},
                           {"version", TORCH_VERSION}};
    make_workload(w);  // an unknown workload fails here, when it is offered
    return std::vector<bench::Offer>{{meta, [w] { return make_workload(w); }, 2}};
  };
  if (serve) return bench::serve(offers);
  nlohmann::json records = nlohmann::json::array();
  for (const auto& w : workloads) {
    const int reps =
        repeats > 0 ? repeats
                    : (w == "tutorial"                               ? 200
                       : w == "mlp-small"                            ? 10
                       : w == "resnet20-cifar" || w == "lstm-lm"     ? 3
                       : w == "transformer-lm"                       ? 2
                                                                     : 5);
    std::vector<bench::Entry> entries;
    for (auto& o : offers(w)) {
      auto timed = std::make_shared<bench::Timed>(o.make(), o.warmup);
      entries.push_back({o.meta, [timed](int n) { return timed->round(n); }});
    }
    const auto samples = bench::run_rounds(entries, {}, rounds, reps);
    for (std::size_t i = 0; i < entries.size(); ++i) {
      auto r = bench::make_record(entries[i].meta, samples[i], "gflops", 1e6);
      std::fprintf(stderr, "  %-10s %-14s %-28s median %9.3f ms\n", "libtorch", w.c_str(),
                   r["config"].get<std::string>().c_str(), r["median_ms"].get<double>());
      records.push_back(r);
    }
  }
  std::ofstream(json_path) << records.dump(2) << "\n";
  return 0;
} catch (const std::exception& e) {
  std::cerr << "error: " << e.what() << "\n";
  return 1;
}
