// PyTorch's DataParallel tutorial in chorus: RandomDataset(5, 100), batches of 30, and a
// Linear(5, 2) model that reports the size of the input each replica sees.
//
// The replicas run forward concurrently, each on its device's thread: the model prints with
// chorus::println, which writes one whole line at a time (a chain of `std::cout << a << b`
// would interleave with the other replicas' lines).
//
//   data_parallel_tutorial            all GPUs, else the virtual CPU devices (CHORUS_CPU_DEVICES)
//   data_parallel_tutorial --cpu N    N virtual CPU devices
//   data_parallel_tutorial --gpus     all GPUs
#include <chorus/chorus.hpp>

#include <cstdlib>
#include <iostream>
#include <string>

#include "device_options.hpp"

using namespace chorus;

namespace {
struct RandomDataset {
  Tensor<float> data;
  RandomDataset(int size, int length) : data(randn<float>({length, size})) {}
  std::size_t size() const { return static_cast<std::size_t>(data.size(0)); }
  Tensor<float> get(std::size_t i) const { return data[static_cast<std::int64_t>(i)]; }
};

struct Model : nn::Module {
  nn::Linear fc;
  Model(int input_size, int output_size) : fc(register_module("fc", nn::Linear(input_size, output_size))) {}
  Tensor<float> forward(const Tensor<float>& input) {
    auto output = fc(input);
    println("\tIn Model: input size ", input.shape(), " output size ", output.shape());
    return output;
  }
};

[[noreturn]] void usage(const char* argv0) {
  std::cerr << "usage: " << argv0 << " [--cpu N | --gpus]\n";
  std::exit(2);
}
}  // namespace

int main(int argc, char** argv) try {
  std::vector<Device> devices;
  for (int i = 1; i < argc; ++i)
    if (!examples::parse_device_option(i, argc, argv, devices)) usage(argv[0]);
  if (devices.empty()) devices = available_devices();

  const int input_size = 5, output_size = 2, batch_size = 30, data_size = 100;
  data::DataLoader loader(RandomDataset(input_size, data_size), {.batch_size = batch_size, .shuffle = true});

  Model model(input_size, output_size);
  model.to(devices[0]);
  if (devices.size() > 1)
    std::cout << "Let's use " << devices.size() << (devices[0].is_cuda() ? " GPUs!" : " CPU devices!") << std::endl;
  DataParallel<Model> dp(std::move(model), devices);

  for (auto input : loader) {
    auto output = dp(input);
    println("Outside: input size ", input.shape(), " output_size ", output.shape());
  }
  return 0;
} catch (const std::exception& e) {
  std::cerr << "error: " << e.what() << "\n";
  return 1;
}
