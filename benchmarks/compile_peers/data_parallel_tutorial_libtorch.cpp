// PyTorch's DataParallel tutorial written for LibTorch: the peer of scripts/compile-times.sh for
// examples/data_parallel_tutorial.cpp (compiled, not run). Debian's CPU-only libtorch-dev cannot
// include torch/nn/parallel/data_parallel.h (it needs CUDA headers), so the model runs whole.
#include <torch/torch.h>

#include <iostream>

struct RandomDataset : torch::data::datasets::Dataset<RandomDataset> {
  torch::Tensor data;
  RandomDataset(int size, int length) : data(torch::randn({length, size})) {}
  torch::data::Example<> get(size_t i) override { return {data[static_cast<int64_t>(i)], torch::zeros({})}; }
  torch::optional<size_t> size() const override { return static_cast<size_t>(data.size(0)); }
};

struct ModelImpl : torch::nn::Cloneable<ModelImpl> {
  torch::nn::Linear fc{nullptr};
  int in, out;
  ModelImpl(int input_size, int output_size) : in(input_size), out(output_size) { reset(); }
  void reset() override { fc = register_module("fc", torch::nn::Linear(in, out)); }
  torch::Tensor forward(const torch::Tensor& input) {
    auto output = fc(input);
    std::cout << "\tIn Model: input size " << input.sizes() << " output size " << output.sizes() << "\n";
    return output;
  }
};
TORCH_MODULE(Model);

int main() {
  const int input_size = 5, output_size = 2, batch_size = 30, data_size = 100;
  auto loader = torch::data::make_data_loader(RandomDataset(input_size, data_size).map(torch::data::transforms::Stack<>()),
                                              torch::data::DataLoaderOptions(batch_size));
  Model model(input_size, output_size);
  for (auto& batch : *loader) {
    auto input = batch.data;
    auto output = model(input);
    std::cout << "Outside: input size " << input.sizes() << " output_size " << output.sizes() << "\n";
  }
  return 0;
}
