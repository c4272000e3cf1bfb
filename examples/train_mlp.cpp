// Trains an MLP classifier on a synthetic task with DataParallel over the available devices,
// showing a progress bar with the loss and samples/s, and the final accuracy.
//
//   train_mlp [--cpu N | --gpus] [--epochs E] [--batch B] [--profile FILE [--profile-steps N]]
//   mpirun -np 2 train_mlp --distributed [--epochs E] [--batch B] [--profile FILE]
//
// --distributed: one process per device with DistributedDataParallel (see docs/distributed.md):
// B is the global batch, each of the W processes takes B / W samples
// of it through a DistributedSampler; rank 0 reports.
// --profile FILE: a Chrome trace of 5 steps after 2 warm-up steps, and their summary
// (examples/profile_option.hpp; under --distributed a file per rank).
#include <chorus/distributed.hpp>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <string>
#include <unistd.h>

#include "device_options.hpp"
#include "profile_option.hpp"

using namespace chorus;

namespace {
struct Mlp : nn::Module {
  nn::Sequential net;
  Mlp(int in, int hidden, int classes)
      : net(register_module("net", nn::Sequential(nn::Linear(in, hidden), nn::ReLU(), nn::Linear(hidden, hidden),
                                                  nn::ReLU(), nn::Linear(hidden, classes)))) {}
  Tensor<float> forward(const Tensor<float>& x) { return net(x); }
};

// Points in `features` dimensions; the class is the index of the largest of `classes`
// fixed random projections, which an MLP learns to high accuracy.
data::TensorDataset<float, std::int64_t> make_dataset(int n, int features, int classes, std::uint64_t seed) {
  Generator gen(seed);
  auto x = randn<float>({n, features}, Device::cpu(), 0, 1, gen);
  Generator proj_gen(99);
  auto proj = randn<float>({features, classes}, Device::cpu(), 0, 1, proj_gen);
  auto scores = matmul(x, proj).to_vector();
  std::vector<std::int64_t> labels(n);
  for (int i = 0; i < n; ++i) {
    int best = 0;
    for (int c = 1; c < classes; ++c)
      if (scores[i * classes + c] > scores[i * classes + best]) best = c;
    labels[i] = best;
  }
  return {x, from_vector(labels)};
}

// Redraws the bar in place on a terminal; elsewhere (logs, CI) prints it once per epoch.
void progress(int epoch, int epochs, std::size_t done, std::size_t total, double loss, double rate) {
  static const bool tty = isatty(fileno(stdout));
  if (!tty && done != total) return;
  const int width = 30;
  const int filled = total ? static_cast<int>(width * done / total) : width;
  if (!chorus::dist::is_initialized() || chorus::dist::rank() == 0)
    std::printf("\repoch %d/%d [%s%s] loss %.4f  %.0f samples/s", epoch, epochs, std::string(filled, '#').c_str(),
              std::string(width - filled, '.').c_str(), loss, rate);
  std::fflush(stdout);
}

/// The fraction (in %) of `test` that `model` classifies right.
template <class M>
double accuracy(M& model, const data::TensorDataset<float, std::int64_t>& test, int classes, Device device) {
  NoGradGuard no_grad;
  std::size_t correct = 0;
  data::DataLoader test_loader(test, {.batch_size = 1000});
  for (auto b : test_loader) {
    auto logits = model(b.data.to(device)).to(Device::cpu()).to_vector();
    auto labels = b.target.to_vector();
    for (std::size_t i = 0; i < labels.size(); ++i) {
      std::size_t best = 0;
      for (std::size_t c = 1; c < static_cast<std::size_t>(classes); ++c)
        if (logits[i * classes + c] > logits[i * classes + best]) best = c;
      correct += best == static_cast<std::size_t>(labels[i]);
    }
  }
  return 100.0 * correct / test.size();
}

/// --distributed: DistributedDataParallel, one process per device.
int train_distributed(int epochs, int batch, examples::ProfileOption& profile) {
  auto& pg = dist::init();
  const int world = pg.world_size(), rank = pg.rank();
  CHORUS_CHECK(batch % world == 0, "--batch ", batch, " is not a multiple of the ", world, " processes");
  const Device device = pg.default_device();
  manual_seed(0);
  const int features = 32, classes = 10;
  auto train = make_dataset(20000, features, classes, 1);
  auto test = make_dataset(4000, features, classes, 2);
  Mlp model(features, 256, classes);
  model.to(device);
  DistributedDataParallel<Mlp> ddp(std::move(model));  // rank 0's weights everywhere
  optim::SGD opt(ddp.parameters(), {.lr = 0.1, .momentum = 0.9});
  if (rank == 0)
    std::printf("training with %d process(es) (%s), global batch %d; rank 0 on %s\n", world, pg.backend().c_str(),
                batch, device.str().c_str());
  // Shared with the loader, so that set_epoch reaches it; rank and world from the process group.
  auto sampler = std::make_shared<data::DistributedSampler>(train, data::DistributedSamplerOptions{.seed = 3});
  data::DataLoader loader(train, {.batch_size = batch / world}, sampler);
  for (int epoch = 1; epoch <= epochs; ++epoch) {
    sampler->set_epoch(static_cast<std::uint64_t>(epoch));
    auto start = std::chrono::steady_clock::now();
    std::size_t seen = 0, step = 0;
    double loss_avg = 0;
    for (auto b : loader) {
      auto loss = nn::functional::cross_entropy(ddp(b.data), b.target.to(device));
      opt.zero_grad();
      loss.backward();
      opt.step();
      profile.after_step(rank);
      seen += static_cast<std::size_t>(b.data.size(0)) * world;
      loss_avg = step++ == 0 ? loss.item() : 0.9 * loss_avg + 0.1 * loss.item();
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      progress(epoch, epochs, step, loader.num_batches(), loss_avg, seen / std::max(secs, 1e-9));
    }
    if (rank == 0) std::printf("\n");
  }
  ddp.eval();
  const double acc = accuracy(ddp, test, classes, device);
  if (rank == 0) std::printf("test accuracy: %.2f%%\n", acc);
  return acc > 80.0 ? 0 : 1;
}
}  // namespace

int main(int argc, char** argv) try {
  std::vector<Device> devices;
  int epochs = 5, batch = 256;
  bool distributed = false;
  examples::ProfileOption profile;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (examples::parse_device_option(i, argc, argv, devices) || profile.parse(i, argc, argv)) {
      continue;
    } else if (a == "--distributed") {
      distributed = true;
    } else if (a == "--epochs" && i + 1 < argc) {
      epochs = std::stoi(argv[++i]);
    } else if (a == "--batch" && i + 1 < argc) {
      batch = std::stoi(argv[++i]);
    } else {
      std::cerr << "usage: " << argv[0] << " [--cpu N | --gpus | --distributed] [--epochs E] [--batch B]"
                << examples::ProfileOption::usage() << "\n";
      return 2;
    }
  }
  if (distributed) {
    if (!devices.empty()) {
      std::cerr << "--distributed uses one device per process; leave out --cpu/--gpus\n";
      return 2;
    }
    return train_distributed(epochs, batch, profile);
  }
  if (devices.empty()) devices = available_devices();
  manual_seed(0);
  const int features = 32, classes = 10;
  auto train = make_dataset(20000, features, classes, 1);
  auto test = make_dataset(4000, features, classes, 2);

  Mlp model(features, 256, classes);
  model.to(devices[0]);
  DataParallel<Mlp> dp(std::move(model), devices);
  optim::SGD opt(dp.parameters(), {.lr = 0.1, .momentum = 0.9});
  std::cout << "training on " << devices.size() << " device(s):";
  for (auto& d : devices) std::cout << " " << d;
  std::cout << "\n";

  data::DataLoader loader(train, {.batch_size = batch, .shuffle = true, .seed = 3});
  for (int epoch = 1; epoch <= epochs; ++epoch) {
    auto start = std::chrono::steady_clock::now();
    std::size_t seen = 0, step = 0;
    double loss_avg = 0;
    for (auto b : loader) {
      auto loss = nn::functional::cross_entropy(dp(b.data), b.target.to(dp.output_device()));
      opt.zero_grad();
      loss.backward();
      opt.step();
      profile.after_step();
      seen += static_cast<std::size_t>(b.data.size(0));
      loss_avg = step++ == 0 ? loss.item() : 0.9 * loss_avg + 0.1 * loss.item();
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      progress(epoch, epochs, step, loader.num_batches(), loss_avg, seen / std::max(secs, 1e-9));
    }
    std::printf("\n");
  }

  dp.eval();
  const double acc = accuracy(dp, test, classes, devices[0]);
  std::printf("test accuracy: %.2f%%\n", acc);
  return acc > 80.0 ? 0 : 1;
} catch (const std::exception& e) {
  std::cerr << "error: " << e.what() << "\n";
  return 1;
}
