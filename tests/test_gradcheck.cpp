// Every differentiable operation against float64 central differences.
#include "test_util.hpp"

using namespace chorus;
using chorus::testing::gradcheck;
using TL = std::vector<Tensor<double>>;
namespace F = chorus::nn::functional;

namespace {
Tensor<double> r(const Shape& s, std::uint64_t seed, double lo = -1, double hi = 1) {
  Generator g(seed);
  return rand<double>(s, Device::cpu(), lo, hi, g);
}
}  // namespace

// The checkers themselves: a NaN is a mismatch, never a match (NaN > tol is false).
TEST(Gradcheck, ANaNAnalyticGradientFailsTheCheck) {
  // sqrt(x * x) at 0: the value is 0 either side (numeric gradient 0), autograd gives
  // 0.5 / sqrt(0) * 2x = inf * 0 = NaN.
  EXPECT_FALSE(gradcheck([](const TL& x) { return sqrt(x[0] * x[0]); }, {zeros<double>({2})}));
  EXPECT_FALSE(chorus::testing::values_are(from_vector<double>({1.0, std::nan("")}, {2}), {1.0, 2.0}));
  EXPECT_FALSE(chorus::testing::all_close(from_vector<double>({std::nan("")}, {1}), from_vector<double>({1.0}, {1}), 1e-6));
  const double inf = std::numeric_limits<double>::infinity();
  EXPECT_TRUE(chorus::testing::values_are(from_vector<double>({1.0, -inf}, {2}), {1.0, -inf}));
  EXPECT_TRUE(chorus::testing::all_close(from_vector<double>({inf}, {1}), from_vector<double>({inf}, {1}), 1e-6));
}

TEST(Gradcheck, BinaryOpsWithBroadcasting) {
  EXPECT_TRUE(gradcheck([](const TL& x) { return x[0] + x[1]; }, {r({3, 4}, 1), r({4}, 2)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return x[0] - x[1]; }, {r({3, 1}, 3), r({1, 4}, 4)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return x[0] * x[1]; }, {r({2, 3, 4}, 5), r({3, 1}, 6)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return x[0] / x[1]; }, {r({3, 4}, 7), r({4}, 8, 0.5, 2)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return x[0] * x[1]; }, {r({3, 4}, 9), r({}, 10)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return x[0].t() * x[1]; }, {r({4, 3}, 11), r({3, 4}, 12)}));
}

TEST(Gradcheck, ScalarOps) {
  EXPECT_TRUE(gradcheck([](const TL& x) { return x[0] * 3.0 + 1.0; }, {r({5}, 1)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return 2.0 - x[0]; }, {r({5}, 2)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return 2.0 / x[0]; }, {r({5}, 3, 0.5, 2)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return -x[0] / 4.0; }, {r({5}, 4)}));
}

TEST(Gradcheck, UnaryOps) {
  EXPECT_TRUE(gradcheck([](const TL& x) { return chorus::exp(x[0]); }, {r({6}, 1)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return chorus::log(x[0]); }, {r({6}, 2, 0.5, 3)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return chorus::sqrt(x[0]); }, {r({6}, 3, 0.5, 3)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return chorus::pow(x[0], 3.0); }, {r({6}, 4)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return chorus::pow(x[0], 2.5); }, {r({6}, 5, 0.5, 2)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return square(x[0]); }, {r({6}, 6)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return relu(x[0]); }, {from_vector<double>({-1, -0.3, 0.2, 0.9})}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return gelu(x[0]); }, {r({6}, 7, -3, 3)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return chorus::tanh(x[0]); }, {r({6}, 8, -2, 2)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return sigmoid(x[0]); }, {r({6}, 9, -3, 3)}));
}

TEST(Gradcheck, DropoutWithAFixedMask) {
  EXPECT_TRUE(gradcheck(
      [](const TL& x) {
        Generator g(42);
        return dropout(x[0], 0.4, true, g);
      },
      {r({20}, 1)}));
}

TEST(Gradcheck, Reductions) {
  EXPECT_TRUE(gradcheck([](const TL& x) { return x[0].sum(); }, {r({3, 4}, 1)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return x[0].mean(); }, {r({3, 4}, 2)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return x[0].sum(0); }, {r({3, 4}, 3)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return x[0].sum(1, true); }, {r({3, 4}, 4)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return x[0].mean(1); }, {r({2, 3, 4}, 5)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return x[0].t().mean(0); }, {r({3, 4}, 6)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return softmax(x[0], 1); }, {r({3, 4}, 7)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return softmax(x[0], 0); }, {r({3, 4}, 8)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return log_softmax(x[0], 1); }, {r({3, 4}, 9)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return log_softmax(x[0], 1); }, {r({2, 3, 2}, 10)}));
}

TEST(Gradcheck, MatrixProducts) {
  EXPECT_TRUE(gradcheck([](const TL& x) { return matmul(x[0], x[1]); }, {r({3, 4}, 1), r({4, 2}, 2)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return matmul(x[0].t(), x[1]); }, {r({4, 3}, 3), r({4, 2}, 4)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return matmul(x[0], x[1]); }, {r({2, 3, 4}, 5), r({4, 2}, 6)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return matmul(x[0], x[1]); }, {r({2, 3, 4}, 7), r({2, 4, 2}, 8)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return linear(x[0], x[1], x[2]); }, {r({5, 3}, 9), r({2, 3}, 10), r({2}, 11)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return linear(x[0], x[1]); }, {r({5, 3}, 12), r({2, 3}, 13)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return linear(x[0], x[1], x[2]); }, {r({2, 2, 3}, 14), r({4, 3}, 15), r({4}, 16)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return linear(x[0], x[1], x[2]); }, {r({3}, 17), r({4, 3}, 18), r({4}, 19)}));
}

TEST(Gradcheck, Losses) {
  for (auto red : {Reduction::Mean, Reduction::Sum, Reduction::None}) {
    EXPECT_TRUE(gradcheck([red](const TL& x) { return F::mse_loss(x[0], x[1], red); }, {r({3, 4}, 1), r({3, 4}, 2)}));
    auto target = from_vector<std::int64_t>({2, 0, 1, 2});
    EXPECT_TRUE(gradcheck([&](const TL& x) { return F::cross_entropy(x[0], target, red); }, {r({4, 3}, 3, -2, 2)}));
    EXPECT_TRUE(gradcheck([&](const TL& x) { return F::nll_loss(x[0], target, red); }, {r({4, 3}, 4)}));
  }
  auto ignore = from_vector<std::int64_t>({2, -100, 1});
  EXPECT_TRUE(gradcheck([&](const TL& x) { return F::cross_entropy(x[0], ignore); }, {r({3, 3}, 5)}));
  EXPECT_TRUE(gradcheck([&](const TL& x) { return F::nll_loss(log_softmax(x[0], 1), ignore); }, {r({3, 3}, 6)}));
}

TEST(Gradcheck, ViewsAndCopies) {
  EXPECT_TRUE(gradcheck([](const TL& x) { return x[0].narrow(0, 1, 2); }, {r({4, 3}, 1)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return x[0].narrow(1, 1, 2); }, {r({4, 3}, 2)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return x[0].slice(0, -2, 10); }, {r({4, 3}, 3)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return x[0].select(1, 2); }, {r({4, 3}, 4)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return x[0].reshape({2, 6}); }, {r({4, 3}, 5)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return x[0].t().reshape({12}); }, {r({4, 3}, 6)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return x[0].view({3, 4}); }, {r({4, 3}, 7)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return x[0].flatten(); }, {r({2, 2, 3}, 8)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return x[0].unsqueeze(1).squeeze(1); }, {r({4, 3}, 9)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return x[0].transpose(0, 2); }, {r({2, 3, 4}, 10)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return x[0].t().contiguous(); }, {r({4, 3}, 11)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return x[0].clone(); }, {r({4, 3}, 12)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return x[0].index_select(0, from_vector<std::int64_t>({3, 0, 3})); },
                        {r({4, 3}, 13)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return x[0].index_select(1, from_vector<std::int64_t>({2, 2})); },
                        {r({4, 3}, 14)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return cat<double>({x[0], x[1]}, 0); }, {r({2, 3}, 15), r({1, 3}, 16)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return cat<double>({x[0], x[1]}, 1); }, {r({2, 3}, 17), r({2, 1}, 18)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return stack<double>({x[0], x[1]}, 1); }, {r({2, 3}, 19), r({2, 3}, 20)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return chunk(x[0], 3)[2] * 2.0 + chunk(x[0], 3)[0]; }, {r({6, 2}, 21)}));
}

TEST(Gradcheck, CopiesBetweenDevices) {
  set_cpu_device_count(2);
  EXPECT_TRUE(gradcheck([](const TL& x) { return (x[0].to(Device::cpu(1)) * 2.0).to(Device::cpu(0)); }, {r({3, 2}, 1)}));
}

TEST(Gradcheck, GatherAcrossDevices) {
  set_cpu_device_count(3);
  EXPECT_TRUE(gradcheck(
      [](const TL& x) {
        return parallel::gather<double>({x[0].to(Device::cpu(1)) * 2.0, x[1].to(Device::cpu(2))}, 0, Device::cpu(0));
      },
      {r({2, 3}, 1), r({1, 3}, 2)}));
  EXPECT_TRUE(gradcheck(  // per-replica scalars are stacked
      [](const TL& x) { return parallel::gather<double>({x[0].sum(), x[1].to(Device::cpu(1)).mean()}, 0, Device::cpu(0)); },
      {r({2, 3}, 3), r({4}, 4)}));
}

TEST(Gradcheck, DataParallelScatterAndGather) {
  struct Square : nn::Module {
    Tensor<double> forward(const Tensor<double>& x) { return x * x; }
  };
  set_cpu_device_count(3);
  DataParallel<Square> dp(Square(), {Device::cpu(0), Device::cpu(1), Device::cpu(2)});
  EXPECT_TRUE(gradcheck([&](const TL& x) { return dp(x[0]); }, {r({7, 2}, 1)}));
}

TEST(Gradcheck, ACompositeNetwork) {
  EXPECT_TRUE(gradcheck(
      [](const TL& x) {
        auto h = gelu(linear(x[0], x[1], x[2]));
        return F::cross_entropy(linear(h, x[3]), from_vector<std::int64_t>({0, 2, 1}));
      },
      {r({3, 4}, 1), r({5, 4}, 2), r({5}, 3), r({3, 5}, 4)}));
}
