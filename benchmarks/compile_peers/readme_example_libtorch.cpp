// The README's example written for LibTorch: the peer of scripts/compile-times.sh (compiled,
// not run, by that script; it trains the same model the same way).
#include <torch/torch.h>

#include <iostream>

struct Model : torch::nn::Module {
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  Model(int in, int hidden, int out)
      : fc1(register_module("fc1", torch::nn::Linear(in, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, out))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(fc1(x))); }
};

int main() {
  torch::manual_seed(0);
  auto x = torch::randn({256, 4});
  auto y = torch::sum(x * x, 1, /*keepdim=*/true);  // learn the squared norm
  Model model(4, 32, 1);
  torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  float first = 0, last = 0;
  for (int step = 0; step < 200; ++step) {
    auto loss = torch::nn::functional::mse_loss(model.forward(x), y);
    opt.zero_grad();
    loss.backward();
    opt.step();
    (step == 0 ? first : last) = loss.item<float>();
  }
  std::cout << "loss " << first << " -> " << last << "\n";
  return last < 0.05f * first ? 0 : 1;
}
