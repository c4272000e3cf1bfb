// Trains ResNet-20 on CIFAR-10 with DataParallel over the available devices: SGD with
// momentum (no weight decay on batch norms and biases) under a one-cycle learning-rate schedule,
// random crops and flips from DataLoader worker threads, a progress bar with samples/s, the test
// accuracy after each epoch, and a checkpoint (model, optimizer and schedule) after each epoch.
//
//   train_resnet [--cpu N | --gpus] [--data DIR] [--out DIR] [--resume] [--epochs E] [--batch B]
//                [--lr LR] [--steps S] [--workers W] [--train-size N] [--test-size N]
//                [--expect-accuracy PCT]
//
// --data DIR reads the binary version of CIFAR-10 (cifar-10-batches-bin, from
// https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz); without it a CIFAR-like set is
// generated in the same binary format under OUT/generated (class-specific coloured stripes
// plus noise, learnable in a few epochs). --steps limits the steps per epoch (for smoke tests).
// --resume continues from OUT's checkpoint. --expect-accuracy makes the exit status 1 when the
// final test accuracy is below PCT.
#include <chorus/chorus.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <numbers>
#include <random>
#include <string>
#include <unistd.h>

#include "device_options.hpp"
#include "resnet.hpp"

using namespace chorus;
namespace fs = std::filesystem;

namespace {

// Class c: stripes at angle c*18° with a class colour, a random phase (so position does not
// identify it), a random brightness and per-pixel noise. A horizontal flip turns angle a into
// 180° - a, which the colour still tells apart.
data::ImageSet generate(std::size_t n, std::uint64_t seed) {
  data::ImageSet set{3, 32, 32, {}, {}};
  set.pixels.resize(n * 3072);
  std::mt19937_64 class_rng(1234);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  double colour[10][3], freq[10];
  for (int c = 0; c < 10; ++c) {
    for (auto& k : colour[c]) k = 0.25 + 0.75 * u(class_rng);
    freq[c] = 0.35 + 0.25 * u(class_rng);
  }
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> noise(0.0, 28.0);
  for (std::size_t i = 0; i < n; ++i) {
    const int c = static_cast<int>(rng() % 10);
    set.labels.push_back(c);
    const double a = c * std::numbers::pi / 10, ca = std::cos(a), sa = std::sin(a);
    const double phase = 2 * std::numbers::pi * u(rng), bright = 0.7 + 0.3 * u(rng);
    for (int ch = 0; ch < 3; ++ch)
      for (int y = 0; y < 32; ++y)
        for (int x = 0; x < 32; ++x) {
          const double s = std::sin(freq[c] * (x * ca + y * sa) + phase);
          const double v = 128 + bright * 90 * colour[c][ch] * s + noise(rng);
          set.pixels[i * 3072 + (ch * 32 + y) * 32 + x] = static_cast<std::uint8_t>(std::clamp(v, 0.0, 255.0));
        }
  }
  return set;
}

// Writes a generated set in CIFAR-10's binary layout (5 training files, 1 test file).
void write_generated(const fs::path& dir, std::size_t train, std::size_t test) {
  fs::create_directories(dir);
  auto all = generate(train, 1);
  for (std::size_t f = 0; f < 5; ++f) {
    const std::size_t b = train * f / 5, e = train * (f + 1) / 5;
    data::ImageSet part{3, 32, 32, {}, {}};
    part.pixels.assign(all.pixels.begin() + static_cast<std::ptrdiff_t>(b * 3072),
                       all.pixels.begin() + static_cast<std::ptrdiff_t>(e * 3072));
    part.labels.assign(all.labels.begin() + static_cast<std::ptrdiff_t>(b), all.labels.begin() + static_cast<std::ptrdiff_t>(e));
    data::write_cifar10_file((dir / ("data_batch_" + std::to_string(f + 1) + ".bin")).string(), part);
  }
  data::write_cifar10_file((dir / "test_batch.bin").string(), generate(test, 2));
}

void progress(int epoch, int epochs, std::size_t done, std::size_t total, double loss, double acc, double rate,
              double lr) {
  static const bool tty = isatty(fileno(stdout));
  if (!tty && done != total) return;
  const int width = 24;
  const int filled = total ? static_cast<int>(width * done / total) : width;
  std::printf("\repoch %d/%d [%s%s] %zu/%zu loss %.4f train acc %5.1f%% lr %.4f %.0f samples/s", epoch, epochs,
              std::string(filled, '#').c_str(), std::string(width - filled, '.').c_str(), done, total, loss, acc, lr,
              rate);
  std::fflush(stdout);
}

/// Correct predictions in a batch: the argmax of each row against its label, counted where the
/// logits are (one scalar crosses to the host).
std::size_t count_correct(const Tensor<float>& logits, const Tensor<std::int64_t>& labels) {
  auto right = eq(argmax(logits.detach(), 1), labels.to(logits.device()));
  return static_cast<std::size_t>(right.sum().item());
}

void usage(const char* argv0) {
  std::cerr << "usage: " << argv0
            << " [--cpu N | --gpus] [--data DIR] [--out DIR] [--resume] [--epochs E] [--batch B] [--lr LR]"
               " [--steps S] [--workers W] [--train-size N] [--test-size N] [--expect-accuracy PCT]\n";
}

}  // namespace

int main(int argc, char** argv) try {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // epoch lines reach a log as they happen
  std::vector<Device> devices;
  std::string data_dir, out_dir = "train_resnet_out";
  bool resume = false;
  int epochs = 30, batch = 128, workers = 2;
  double lr = 0.1, expect_accuracy = -1;
  std::size_t max_steps = 0, train_size = 10000, test_size = 2000;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&] {
      if (i + 1 >= argc) throw Error(a + " needs a value");
      return std::string(argv[++i]);
    };
    if (examples::parse_device_option(i, argc, argv, devices)) continue;
    if (a == "--data") data_dir = value();
    else if (a == "--out") out_dir = value();
    else if (a == "--resume") resume = true;
    else if (a == "--epochs") epochs = std::stoi(value());
    else if (a == "--batch") batch = std::stoi(value());
    else if (a == "--lr") lr = std::stod(value());
    else if (a == "--steps") max_steps = std::stoul(value());
    else if (a == "--workers") workers = std::stoi(value());
    else if (a == "--train-size") train_size = std::stoul(value());
    else if (a == "--test-size") test_size = std::stoul(value());
    else if (a == "--expect-accuracy") expect_accuracy = std::stod(value());
    else {
      usage(argv[0]);
      return 2;
    }
  }
  CHORUS_CHECK(epochs > 0 && batch > 0 && workers >= 0, "--epochs and --batch must be positive, --workers >= 0");
  if (devices.empty()) devices = available_devices();
  fs::create_directories(out_dir);

  if (data_dir.empty()) {
    data_dir = (fs::path(out_dir) / "generated").string();
    write_generated(data_dir, train_size, test_size);
    std::cout << "generated a CIFAR-like set (" << train_size << " training, " << test_size << " test images) in "
              << data_dir << "\n";
  }
  // The torchvision recipe: pad-4 random crops and flips for training, per-channel normalisation.
  data::transforms::Normalize normalize({0.4914f, 0.4822f, 0.4465f}, {0.2470f, 0.2435f, 0.2616f});
  data::ImageDataset train(data::read_cifar10(data_dir, true),
                           data::transforms::Compose{{data::transforms::RandomCrop(32, 4),
                                                      data::transforms::RandomHorizontalFlip{}, normalize}},
                           /*seed=*/7);
  data::ImageDataset test(data::read_cifar10(data_dir, false), normalize);
  const bool gpu = devices[0].is_cuda();
  data::DataLoader loader(std::move(train), {.batch_size = batch, .shuffle = true, .seed = 3,
                                             .drop_last = true, .num_workers = workers,
                                             .pin_memory = gpu});
  data::DataLoader test_loader(std::move(test), {.batch_size = 500, .num_workers = workers,
                                                 .pin_memory = gpu});
  const std::size_t steps_per_epoch = max_steps ? std::min(max_steps, loader.num_batches()) : loader.num_batches();
  CHORUS_CHECK(steps_per_epoch > 0, "the training set (", loader.dataset().size(), " images) has no full batch of ",
               batch);

  manual_seed(0);
  examples::ResNet20<float> model;
  model.to(devices[0]);
  std::size_t nparams = 0;
  for (auto& p : model.parameters()) nparams += static_cast<std::size_t>(p.numel());
  DataParallel<examples::ResNet20<float>> dp(std::move(model), devices);
  optim::SGD opt(optim::weight_decay_groups<optim::SGDOptions>(
      dp.parameters(), {.lr = lr, .momentum = 0.9, .weight_decay = 5e-4, .nesterov = true}));
  optim::OneCycleLR sched(opt, {.max_lr = lr,
                                .total_steps = static_cast<std::int64_t>(epochs * steps_per_epoch),
                                .pct_start = 0.25});
  std::cout << "ResNet-20 (" << nparams << " parameters, option-A shortcuts) on " << devices.size() << " device(s):";
  for (auto& d : devices) std::cout << " " << d;
  std::cout << "\n";

  const auto model_path = (fs::path(out_dir) / "model.safetensors").string();
  const auto optim_path = (fs::path(out_dir) / "optimizer.safetensors").string();
  int start_epoch = 1;
  if (resume) {
    load(dp, model_path);
    load(opt, optim_path, {.scheduler = &sched});
    const auto meta = io::read(model_path).metadata;
    CHORUS_CHECK(meta.count("epoch"), "--resume: '", model_path, "' records no epoch");
    start_epoch = std::stoi(meta.at("epoch")) + 1;
    // Replay the loader's earlier epochs so the shuffles and augmentations continue as they would have.
    for (int e = 1; e < start_epoch; ++e) (void)loader.begin();
    std::cout << "resumed after epoch " << start_epoch - 1 << " (step " << sched.last_epoch() << ")\n";
  }

  double accuracy = 0;
  for (int epoch = start_epoch; epoch <= epochs; ++epoch) {
    dp.train();
    const auto start = std::chrono::steady_clock::now();
    std::size_t seen = 0, step = 0, correct = 0;
    double loss_avg = 0;
    for (auto it = loader.begin(); step < steps_per_epoch; ++it) {
      const auto& b = *it;
      auto target = b.target.to(dp.output_device());
      auto logits = dp(b.data);
      auto loss = nn::functional::cross_entropy(logits, target);
      opt.zero_grad();
      loss.backward();
      opt.step();
      sched.step();
      seen += static_cast<std::size_t>(b.data.size(0));
      correct += count_correct(logits, target);
      loss_avg = step++ == 0 ? loss.item() : 0.95 * loss_avg + 0.05 * loss.item();
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      progress(epoch, epochs, step, steps_per_epoch, loss_avg, 100.0 * correct / seen, seen / std::max(secs, 1e-9),
               opt.lr(0));
    }
    std::printf("\n");

    dp.eval();
    {
      NoGradGuard no_grad;
      std::size_t right = 0, total = 0;
      for (const auto& b : test_loader) {
        right += count_correct(dp(b.data), b.target);
        total += static_cast<std::size_t>(b.target.numel());
      }
      accuracy = 100.0 * right / std::max<std::size_t>(total, 1);
    }
    std::printf("epoch %d: test accuracy %.2f%% (%zu images)\n", epoch, accuracy, test_loader.dataset().size());
    save(dp, model_path, {{"epoch", std::to_string(epoch)}, {"test_accuracy", std::to_string(accuracy)}});
    save(opt, optim_path, {.scheduler = &sched});
  }
  if (expect_accuracy >= 0 && accuracy < expect_accuracy) {
    std::cerr << "test accuracy " << accuracy << "% is below the expected " << expect_accuracy << "%\n";
    return 1;
  }
  return 0;
} catch (const std::exception& e) {
  std::cerr << "error: " << e.what() << "\n";
  return 1;
}
