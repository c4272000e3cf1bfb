// SGD and Adam/AdamW against their documented update rules, computed by hand.
#include <cmath>

#include "test_util.hpp"

using namespace chorus;
using chorus::testing::throws_with;
using chorus::testing::values_are;

namespace {
// Runs `steps` optimizer steps on p with fixed gradients, returning p after each step.
template <class Opt, class Options>
std::vector<double> run(Options o, std::vector<std::vector<double>> grads, double p0) {
  auto p = from_vector<double>({p0}).requires_grad_();
  Opt opt({p}, o);
  std::vector<double> out;
  for (auto& g : grads) {
    p.set_grad(from_vector<double>(g));
    opt.step();
    out.push_back(p.item());
  }
  return out;
}
}  // namespace

TEST(SGD, PlainStep) {
  auto r = run<optim::SGD>(optim::SGDOptions{.lr = 0.1}, {{2.0}, {-1.0}}, 1.0);
  EXPECT_DOUBLE_EQ(r[0], 1.0 - 0.1 * 2.0);
  EXPECT_DOUBLE_EQ(r[1], 0.8 + 0.1);
}

TEST(SGD, MomentumDampeningWeightDecay) {
  const double lr = 0.1, mu = 0.9, damp = 0.3, wd = 0.01;
  auto r = run<optim::SGD>(optim::SGDOptions{.lr = lr, .momentum = mu, .dampening = damp, .weight_decay = wd},
                           {{1.0}, {2.0}, {-0.5}}, 1.0);
  double p = 1.0, b = 0;
  std::vector<double> g = {1.0, 2.0, -0.5};
  for (int t = 0; t < 3; ++t) {
    double d = g[t] + wd * p;
    b = t == 0 ? d : mu * b + (1 - damp) * d;
    p -= lr * b;
    EXPECT_NEAR(r[t], p, 1e-15) << "step " << t;
  }
}

TEST(SGD, NesterovAndMaximize) {
  const double lr = 0.05, mu = 0.8;
  auto r = run<optim::SGD>(optim::SGDOptions{.lr = lr, .momentum = mu, .nesterov = true, .maximize = true},
                           {{1.0}, {3.0}}, 0.5);
  double p = 0.5, b = 0;
  std::vector<double> g = {1.0, 3.0};
  for (int t = 0; t < 2; ++t) {
    double d = -g[t];
    b = t == 0 ? d : mu * b + d;
    d = d + mu * b;
    p -= lr * d;
    EXPECT_NEAR(r[t], p, 1e-15);
  }
}

TEST(SGD, OptionsAreValidated) {
  auto p = ones<double>({1}).requires_grad_();
  EXPECT_TRUE(throws_with([&] { optim::SGD({p}, {.lr = -1}); }, {"learning rate"}));
  EXPECT_TRUE(throws_with([&] { optim::SGD({p}, {.lr = 0.1, .nesterov = true}); }, {"Nesterov"}));
  EXPECT_TRUE(throws_with([&] { optim::SGD({p, p}, {.lr = 0.1}); }, {"more than once"}));
  EXPECT_TRUE(throws_with([&] { optim::SGD({p * 2.0}, {.lr = 0.1}); }, {"not a leaf"}));
}

TEST(SGD, SkipsParametersWithoutGradAndZeroGradClears) {
  auto a = ones<float>({2}).requires_grad_();
  auto b = ones<float>({2}).requires_grad_();
  optim::SGD opt({a, b}, {.lr = 1});
  (a * 3.0).sum().backward();
  opt.step();
  EXPECT_TRUE(values_are(a, {-2, -2}));
  EXPECT_TRUE(values_are(b, {1, 1}));
  opt.zero_grad();
  EXPECT_FALSE(a.grad().defined());
  (a * 3.0).sum().backward();
  opt.zero_grad(false);
  EXPECT_TRUE(values_are(a.grad(), {0, 0}));
}

namespace {
std::vector<double> adam_reference(double p, const std::vector<double>& g, double lr, double b1, double b2, double eps,
                                   double wd, bool decoupled, bool amsgrad) {
  double m = 0, v = 0, vmax = 0;
  std::vector<double> out;
  for (std::size_t i = 0; i < g.size(); ++i) {
    const double t = double(i + 1);
    double gi = g[i];
    if (decoupled) p *= 1 - lr * wd;
    else gi += wd * p;
    m = b1 * m + (1 - b1) * gi;
    v = b2 * v + (1 - b2) * gi * gi;
    vmax = std::max(vmax, v);
    const double vhat = amsgrad ? vmax : v;
    const double bc1 = 1 - std::pow(b1, t), bc2 = 1 - std::pow(b2, t);
    p -= lr / bc1 * m / (std::sqrt(vhat) / std::sqrt(bc2) + eps);
    out.push_back(p);
  }
  return out;
}
}  // namespace

TEST(Adam, MatchesTheDocumentedRule) {
  std::vector<double> g = {0.5, -1.0, 2.0, 0.1};
  auto r = run<optim::Adam>(optim::AdamOptions{.lr = 0.01, .beta1 = 0.8, .beta2 = 0.99, .eps = 1e-6,
                                               .weight_decay = 0.1},
                            {{0.5}, {-1.0}, {2.0}, {0.1}}, 1.0);
  auto ref = adam_reference(1.0, g, 0.01, 0.8, 0.99, 1e-6, 0.1, false, false);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(r[i], ref[i], 1e-14) << "step " << i;
}

TEST(Adam, AmsgradAndAdamW) {
  std::vector<double> g = {2.0, 0.1, 0.1, 3.0};
  auto r = run<optim::Adam>(optim::AdamOptions{.lr = 0.1, .amsgrad = true}, {{2.0}, {0.1}, {0.1}, {3.0}}, -1.0);
  auto ref = adam_reference(-1.0, g, 0.1, 0.9, 0.999, 1e-8, 0.0, false, true);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(r[i], ref[i], 1e-14);
  auto rw = run<optim::AdamW>(optim::AdamWOptions{.lr = 0.1}, {{2.0}, {0.1}, {0.1}, {3.0}}, -1.0);
  auto refw = adam_reference(-1.0, g, 0.1, 0.9, 0.999, 1e-8, 0.01, true, false);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(rw[i], refw[i], 1e-14);
  auto p = ones<double>({1}).requires_grad_();
  EXPECT_TRUE(throws_with([&] { optim::Adam({p}, {.beta1 = 1.0}); }, {"beta1"}));
  EXPECT_TRUE(throws_with([&] { optim::AdamW({p}, {.eps = -1}); }, {"epsilon"}));
}

TEST(Adam, StateHoldsStepAndMoments) {
  auto p = ones<float>({3}).requires_grad_();
  optim::Adam opt({p});
  p.set_grad(ones<float>({3}));
  opt.step();
  opt.step();
  const auto& s = opt.state()[0];
  EXPECT_EQ(s.at("step").as<double>().item(), 2.0);
  EXPECT_EQ(s.at("exp_avg").shape(), (Shape{3}));
  EXPECT_TRUE(throws_with([&] { opt.load_state({{{"exp_avg", AnyTensor(zeros<float>({2}))}}}); }, {"exp_avg", "[2]"}));
  EXPECT_TRUE(throws_with([&] { opt.load_state({{{"bogus", AnyTensor(zeros<float>({3}))}}}); }, {"bogus"}));
}
