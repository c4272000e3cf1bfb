// End to end: a 2-layer MLP learns a synthetic regression problem.
#include "test_util.hpp"

using namespace chorus;

namespace {
struct Mlp : nn::Module {
  nn::Linear fc1, fc2;
  Mlp(int in, int hidden, int out)
      : fc1(register_module("fc1", nn::Linear(in, hidden))), fc2(register_module("fc2", nn::Linear(hidden, out))) {}
  Tensor<float> forward(const Tensor<float>& x) { return fc2(relu(fc1(x))); }
};
}  // namespace

TEST(Training, MlpWithSgdBringsTheLossUnderOnePercent) {
  manual_seed(0);
  const int n = 512;
  auto x = randn<float>({n, 8});
  auto w_true = randn<float>({8, 1});
  auto y = matmul(x, w_true) + chorus::tanh(x.narrow(1, 0, 1)) * 2.0;  // a nonlinear target
  data::DataLoader loader(data::TensorDataset<float, float>(x, y), {.batch_size = 64, .shuffle = true, .seed = 1});
  Mlp model(8, 64, 1);
  optim::SGD opt(model.parameters(), {.lr = 0.05, .momentum = 0.9});
  auto full_loss = [&] {
    NoGradGuard g;
    return nn::functional::mse_loss(model.forward(x), y).item();
  };
  const double start = full_loss();
  for (int epoch = 0; epoch < 60; ++epoch) {
    for (auto batch : loader) {
      auto loss = nn::functional::mse_loss(model.forward(batch.data), batch.target);
      opt.zero_grad();
      loss.backward();
      opt.step();
    }
  }
  const double end = full_loss();
  EXPECT_LT(end, 0.01 * start) << "start " << start << " end " << end;
}

TEST(Training, ClassifierWithAdamAndCrossEntropy) {
  manual_seed(3);
  auto x = randn<double>({300, 2});
  auto xs = x.to_vector();
  std::vector<std::int64_t> labels;
  for (int i = 0; i < 300; ++i) labels.push_back(xs[2 * i] * xs[2 * i + 1] > 0 ? 1 : 0);  // XOR-like quadrants
  auto y = from_vector<std::int64_t>(labels);
  nn::SequentialT<double> model(nn::LinearT<double>(2, 32), nn::GELU(), nn::LinearT<double>(32, 2));
  optim::Adam opt(model->parameters(), {.lr = 0.02});
  for (int step = 0; step < 400; ++step) {
    auto loss = nn::functional::cross_entropy(model(x), y);
    opt.zero_grad();
    loss.backward();
    opt.step();
  }
  NoGradGuard g;
  auto logits = model(x).to_vector();
  int correct = 0;
  for (int i = 0; i < 300; ++i) correct += (logits[2 * i + 1] > logits[2 * i]) == (labels[i] == 1);
  EXPECT_GT(correct, 285);
}
