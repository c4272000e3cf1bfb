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

// ---- Parameter groups ------------------------------------------------------------------

TEST(ParamGroups, EachGroupUsesItsOwnOptions) {
  auto w = from_vector<double>({1.0, 2.0}, Shape{1, 2}).requires_grad_();
  auto b = from_vector<double>({0.5}).requires_grad_();
  auto groups = optim::weight_decay_groups<optim::SGDOptions>({w, b}, {.lr = 0.1, .momentum = 0.9, .weight_decay = 0.5});
  ASSERT_EQ(groups.size(), 2u);
  ASSERT_EQ(groups[0].params.size(), 1u);  // the matrix decays
  ASSERT_EQ(groups[1].params.size(), 1u);  // the bias does not
  EXPECT_EQ(groups[1].options.weight_decay, 0.0);
  groups[1].options.lr = 0.01;
  optim::SGD opt(groups);
  EXPECT_EQ(opt.num_groups(), 2u);
  EXPECT_EQ(opt.group_of(1), 1u);
  w.set_grad(from_vector<double>({1.0, -1.0}, Shape{1, 2}));
  b.set_grad(from_vector<double>({2.0}));
  opt.step();
  EXPECT_NEAR(w.to_vector()[0], 1.0 - 0.1 * (1.0 + 0.5 * 1.0), 1e-15);
  EXPECT_NEAR(w.to_vector()[1], 2.0 - 0.1 * (-1.0 + 0.5 * 2.0), 1e-15);
  EXPECT_NEAR(b.item(), 0.5 - 0.01 * 2.0, 1e-15);
  EXPECT_TRUE(throws_with([&] { optim::SGD({{{w}, {.lr = 0.1}}, {{w}, {.lr = 0.2}}}); }, {"more than once"}));
  EXPECT_TRUE(throws_with([&] { optim::SGD({{{w}, {.lr = 0.1}}, {{b}, {.lr = -1}}}); }, {"learning rate", "group 1"}));
}

TEST(ParamGroups, AdamWDecaysOnlyItsDecayGroup) {
  auto w = from_vector<double>({1.0}, Shape{1, 1}).requires_grad_();
  auto b = from_vector<double>({1.0}).requires_grad_();
  optim::AdamW opt(optim::weight_decay_groups<optim::AdamWOptions>({w, b}, {.lr = 0.1, .weight_decay = 0.1}));
  w.set_grad(from_vector<double>({0.5}, Shape{1, 1}));
  b.set_grad(from_vector<double>({0.5}));
  opt.step();
  auto with = adam_reference(1.0, {0.5}, 0.1, 0.9, 0.999, 1e-8, 0.1, true, false);
  auto without = adam_reference(1.0, {0.5}, 0.1, 0.9, 0.999, 1e-8, 0.0, true, false);
  EXPECT_NEAR(w.item(), with[0], 1e-15);
  EXPECT_NEAR(b.item(), without[0], 1e-15);
  EXPECT_NE(with[0], without[0]);
  EXPECT_EQ(opt.momentum(0), 0.9);  // beta1
}

// ---- Learning-rate schedulers (PyTorch's closed forms and recurrences, by hand) ---------

namespace {
template <class Opt>
struct OneParam {
  Tensor<double> p = from_vector<double>({1.0}).requires_grad_();
  Opt opt;
  template <class Options>
  explicit OneParam(Options o) : opt(std::vector<AnyTensor>{p}, o) {}
};
}  // namespace

TEST(LRScheduler, StepLR) {
  OneParam<optim::SGD> m(optim::SGDOptions{.lr = 0.1});
  optim::StepLR s(m.opt, 3, 0.5);
  for (int e = 0; e < 10; ++e) {
    EXPECT_EQ(s.last_epoch(), e);
    EXPECT_DOUBLE_EQ(m.opt.lr(0), 0.1 * std::pow(0.5, e / 3)) << "epoch " << e;
    s.step();
  }
  EXPECT_TRUE(throws_with([&] { optim::StepLR(m.opt, 0); }, {"step_size", "0"}));
}

TEST(LRScheduler, MultiStepLR) {
  OneParam<optim::Adam> m(optim::AdamOptions{.lr = 0.1});
  optim::MultiStepLR s(m.opt, {2, 5}, 0.1);
  const double want[] = {0.1, 0.1, 0.01, 0.01, 0.01, 0.001, 0.001};
  for (double w : want) {
    EXPECT_NEAR(m.opt.lr(0), w, 1e-17);
    s.step();
  }
  EXPECT_TRUE(throws_with([&] { optim::MultiStepLR(m.opt, {5, 2}); }, {"increasing"}));
}

TEST(LRScheduler, CosineAnnealingFollowsPyTorchsRecurrence) {
  OneParam<optim::SGD> m(optim::SGDOptions{.lr = 0.5});
  const double eta_min = 0.01, T = 10;
  optim::CosineAnnealingLR s(m.opt, 10, eta_min);
  EXPECT_DOUBLE_EQ(m.opt.lr(0), 0.5);
  double lr = 0.5;
  for (int t = 1; t <= 10; ++t) {
    s.step();
    // torch's chainable form: lr_t = eta_min + (lr_{t-1} - eta_min) * (1 + cos(pi t / T)) / (1 + cos(pi (t-1) / T)).
    lr = eta_min + (lr - eta_min) * (1 + std::cos(M_PI * t / T)) / (1 + std::cos(M_PI * (t - 1) / T));
    EXPECT_NEAR(m.opt.lr(0), lr, 1e-12) << "epoch " << t;
  }
  EXPECT_NEAR(m.opt.lr(0), eta_min, 1e-15);
  // Past T_max PyTorch goes on (no end, no error): back up over the next T_max epochs, with its
  // special case where the ratio's denominator 1 + cos(pi) is 0.
  for (int t = 11; t <= 35; ++t) {
    s.step();
    if ((t - 1 - 10) % 20 == 0) lr = lr + (0.5 - eta_min) * (1 - std::cos(M_PI / T)) / 2;
    else lr = eta_min + (lr - eta_min) * (1 + std::cos(M_PI * t / T)) / (1 + std::cos(M_PI * (t - 1) / T));
    EXPECT_NEAR(m.opt.lr(0), lr, 1e-12) << "epoch " << t;
  }
  EXPECT_NEAR(m.opt.lr(0), eta_min + (0.5 - eta_min) * (1 + std::cos(M_PI * 35 / T)) / 2, 1e-12);
}

TEST(LRScheduler, LinearWarmupFollowsPyTorchsRecurrence) {
  OneParam<optim::AdamW> m(optim::AdamWOptions{.lr = 0.2});
  const double start = 0.25, end = 1.0;
  const int total = 4;
  optim::LinearLR s(m.opt, {.start_factor = start, .end_factor = end, .total_iters = total});
  double lr = 0.2 * start;
  EXPECT_NEAR(m.opt.lr(0), lr, 1e-15);
  for (int t = 1; t <= 7; ++t) {
    s.step();
    if (t <= total) lr *= 1 + (end - start) / (total * start + (t - 1) * (end - start));
    EXPECT_NEAR(m.opt.lr(0), lr, 1e-15) << "epoch " << t;
  }
  EXPECT_NEAR(m.opt.lr(0), 0.2, 1e-15);
  EXPECT_TRUE(throws_with([&] { optim::LinearLR(m.opt, {.start_factor = 0.0}); }, {"start_factor"}));
}

TEST(LRScheduler, OneCycleCosineAndMomentum) {
  OneParam<optim::SGD> m(optim::SGDOptions{.lr = 0.001, .momentum = 0.9});
  optim::OneCycleLR s(m.opt, {.max_lr = 1.0, .total_steps = 10});
  // initial = 1/25, min = initial/1e4; phase ends at steps 0.3*10-1 = 2 and 9.
  const double init = 0.04, mn = 0.04 / 1e4;
  auto cos_anneal = [](double a, double b, double pct) { return b + (a - b) / 2 * (std::cos(M_PI * pct) + 1); };
  for (int t = 0; t <= 10; ++t) {
    const double lr = t <= 2 ? cos_anneal(init, 1.0, t / 2.0) : cos_anneal(1.0, mn, (t - 2) / 7.0);
    const double mom = t <= 2 ? cos_anneal(0.95, 0.85, t / 2.0) : cos_anneal(0.85, 0.95, (t - 2) / 7.0);
    EXPECT_NEAR(m.opt.lr(0), lr, 1e-15) << "step " << t;
    EXPECT_NEAR(m.opt.momentum(0), mom, 1e-15) << "step " << t;
    if (t < 10) s.step();
  }
  EXPECT_NEAR(s.get_last_lr()[0], cos_anneal(1.0, mn, 8 / 7.0), 1e-15);
  EXPECT_TRUE(throws_with([&] { s.step(); }, {"OneCycleLR", "11", "total_steps = 10"}));
  EXPECT_EQ(s.last_epoch(), 10);  // the refused step changed nothing
}

TEST(LRScheduler, OneCycleLinearThreePhaseOnAdam) {
  OneParam<optim::Adam> m(optim::AdamOptions{});
  optim::OneCycleLR s(m.opt, {.max_lr = 1.0, .total_steps = 10, .cos_anneal = false, .three_phase = true});
  // Phases end at 2, 4 and 9: initial -> max -> initial -> min, linearly.
  const double init = 0.04, mn = 0.04 / 1e4;
  const double want[] = {init, 0.52, 1.0, 0.52, init, init + (mn - init) * 0.2, init + (mn - init) * 0.4};
  for (double w : want) {
    EXPECT_NEAR(m.opt.lr(0), w, 1e-15);
    s.step();
  }
  EXPECT_NEAR(m.opt.momentum(0), 0.95, 1e-15);  // beta1 at step 7 (third phase): max momentum
  // A warm-up phase of no steps (0.25 * 4 - 1 = 0): the peak at once, then the anneal; never NaN.
  OneParam<optim::SGD> short_cycle(optim::SGDOptions{.lr = 0.1, .momentum = 0.9});
  optim::OneCycleLR sc(short_cycle.opt, {.max_lr = 1.0, .total_steps = 4, .pct_start = 0.25});
  EXPECT_EQ(short_cycle.opt.lr(0), 1.0);
  sc.step();
  EXPECT_NEAR(short_cycle.opt.lr(0), 0.04 / 1e4 + (1.0 - 0.04 / 1e4) / 2 * (std::cos(M_PI / 3) + 1), 1e-15);
  OneParam<optim::SGD> plain(optim::SGDOptions{.lr = 0.1});
  optim::OneCycleLR ok(plain.opt, {.max_lr = 1.0, .total_steps = 5});  // SGD has a momentum, even if 0
  EXPECT_TRUE(throws_with([&] { optim::OneCycleLR(plain.opt, {.total_steps = 0}); }, {"total_steps"}));
}

// Issue 16: PyTorch's loop (optimizer.step(); scheduler.step(); total_steps times) with the
// linear anneal died at its last scheduler step: epoch total_steps extrapolated the lr below the
// final one, negative, and set_lr refused it. Step total_steps + 1 still raises, as in PyTorch
// (Note [one-cycle end]).
TEST(LRScheduler, OneCycleLinearRunsPyTorchsLoopToTheEnd) {
  OneParam<optim::SGD> m(optim::SGDOptions{.lr = 0.001, .momentum = 0.9});
  optim::OneCycleLR s(m.opt, {.max_lr = 1.0, .total_steps = 10, .cos_anneal = false});
  // Phases end at steps 2 and 9; initial 0.04, final 0.04 / 1e4.
  const double init = 0.04, mn = 0.04 / 1e4;
  auto linear = [](double a, double b, double pct) { return (b - a) * pct + a; };
  for (int t = 0; t < 10; ++t) {
    const double lr = t <= 2 ? linear(init, 1.0, t / 2.0) : linear(1.0, mn, (t - 2) / 7.0);  // PyTorch's values
    const double mom = t <= 2 ? linear(0.95, 0.85, t / 2.0) : linear(0.85, 0.95, (t - 2) / 7.0);
    EXPECT_NEAR(m.opt.lr(0), lr, 1e-15) << "step " << t;
    EXPECT_NEAR(m.opt.momentum(0), mom, 1e-15) << "step " << t;
    m.p.set_grad(from_vector<double>({1.0}));
    m.opt.step();
    EXPECT_NO_THROW(s.step()) << "scheduler step " << t + 1;
  }
  EXPECT_EQ(s.last_epoch(), 10);
  EXPECT_NEAR(m.opt.lr(0), mn, 1e-15);  // PyTorch: 1 + (mn - 1) * 8 / 7 < 0; the anneal holds its end instead
  EXPECT_NEAR(m.opt.momentum(0), 0.95, 1e-15);
  EXPECT_TRUE(throws_with([&] { s.step(); }, {"OneCycleLR", "stepped 11 times", "total_steps = 10"}));

  // Adam, two steps: PyTorch's beta1 at step 2 would be 0.85 + 0.1 * 2.4 / 1.4 > 1, and the
  // three-phase cycle's last phase overshoots the same way.
  for (bool three : {false, true}) {
    OneParam<optim::Adam> a(optim::AdamOptions{});
    optim::OneCycleLR sa(a.opt, {.max_lr = 0.5, .total_steps = 2, .cos_anneal = false, .three_phase = three});
    EXPECT_NO_THROW(sa.step());
    EXPECT_NO_THROW(sa.step());
    EXPECT_NEAR(a.opt.lr(0), 0.5 / 25 / 1e4, 1e-16) << three;
    EXPECT_NEAR(a.opt.momentum(0), 0.95, 1e-15) << three;
    EXPECT_TRUE(throws_with([&] { sa.step(); }, {"stepped 3 times"}));
  }
}

// SequentialLR did not ask the scheduler in charge whether its schedule goes on: a OneCycleLR
// after a warmup ran past its total_steps (PyTorch's SequentialLR steps it, and it raises).
TEST(LRScheduler, SequentialLRStopsWhereItsOneCycleStops) {
  OneParam<optim::SGD> m(optim::SGDOptions{.lr = 0.4});
  auto cycle = std::make_shared<optim::OneCycleLR>(
      m.opt, optim::OneCycleOptions{.max_lr = 0.4, .total_steps = 5, .cycle_momentum = false});
  // One scheduler moved in, one shared.
  optim::SequentialLR s(m.opt, {optim::LinearLR(m.opt, {.start_factor = 0.1, .total_iters = 3}), cycle}, {3});
  for (int e = 1; e <= 8; ++e) EXPECT_NO_THROW(s.step()) << "epoch " << e;  // the cycle's epochs 0..5
  EXPECT_TRUE(throws_with([&] { s.step(); }, {"OneCycleLR", "stepped 6 times", "total_steps = 5"}));
  EXPECT_EQ(s.last_epoch(), 8);
  EXPECT_TRUE(throws_with([&] { s.load_state(9, {0.4}); }, {"stepped 6 times"}));
}

TEST(LRScheduler, SequentialWarmupThenCosine) {
  OneParam<optim::SGD> m(optim::SGDOptions{.lr = 0.4});
  optim::SequentialLR s(
      m.opt, {optim::LinearLR(m.opt, {.start_factor = 0.1, .total_iters = 3}), optim::CosineAnnealingLR(m.opt, 5)}, {3});
  const double want[] = {0.04, 0.04 + 0.36 / 3, 0.04 + 0.72 / 3, 0.4, 0.2 * (1 + std::cos(M_PI / 5)),
                         0.2 * (1 + std::cos(2 * M_PI / 5))};
  for (double w : want) {
    EXPECT_NEAR(m.opt.lr(0), w, 1e-15);
    s.step();
  }
}

TEST(LRScheduler, SchedulesEveryGroupFromItsOwnBaseAndTheStepUsesIt) {
  auto a = from_vector<double>({1.0}).requires_grad_();
  auto b = from_vector<double>({1.0}).requires_grad_();
  optim::SGD opt({{{a}, {.lr = 0.1}}, {{b}, {.lr = 1.0}}});
  optim::StepLR s(opt, 1, 0.5);
  s.step();
  EXPECT_EQ(s.get_last_lr(), (std::vector<double>{0.05, 0.5}));
  a.set_grad(from_vector<double>({1.0}));
  b.set_grad(from_vector<double>({1.0}));
  opt.step();
  EXPECT_DOUBLE_EQ(a.item(), 0.95);
  EXPECT_DOUBLE_EQ(b.item(), 0.5);
}

// ---- Gradient clipping --------------------------------------------------------------------

template <class T>
class ClipGrad : public ::testing::Test {};
TYPED_TEST_SUITE(ClipGrad, chorus::testing::FloatTypes);

TYPED_TEST(ClipGrad, NormOfAllGradientsTogether) {
  using T = TypeParam;
  auto a = zeros<T>({2}).requires_grad_();
  auto b = zeros<T>({1, 1}).requires_grad_();
  auto c = zeros<T>({3}).requires_grad_();  // no gradient: ignored
  std::vector<AnyTensor> ps{a, b, c};
  auto set = [&] {
    a.set_grad(from_vector<T>({3, -4}));
    b.set_grad(from_vector<T>({12}, Shape{1, 1}));
  };
  set();
  EXPECT_NEAR(nn::utils::grad_norm(ps), 13.0, 1e-12);
  EXPECT_NEAR(nn::utils::grad_norm(ps, 1.0), 19.0, 1e-12);
  EXPECT_NEAR(nn::utils::grad_norm(ps, 3.0), std::cbrt(27.0 + 64.0 + 1728.0), 1e-12);
  EXPECT_NEAR(nn::utils::grad_norm(ps, INFINITY), 12.0, 1e-12);
  // Below the limit: unchanged.
  EXPECT_NEAR(nn::utils::clip_grad_norm_(ps, 20.0), 13.0, 1e-12);
  EXPECT_TRUE(values_are(a.grad(), {3, -4}, 0));
  // Above: scaled by max_norm / (norm + 1e-6).
  const double coef = 6.5 / (13.0 + 1e-6);
  EXPECT_NEAR(nn::utils::clip_grad_norm_(ps, 6.5), 13.0, 1e-12);
  EXPECT_TRUE(values_are(a.grad(), {T(3 * coef), T(-4 * coef)}, chorus::testing::tol<T>()));
  EXPECT_TRUE(values_are(b.grad(), {T(12 * coef)}, chorus::testing::tol<T>()));
  set();
  const double coef_inf = 3.0 / (12.0 + 1e-6);
  EXPECT_NEAR(nn::utils::clip_grad_norm_(ps, 3.0, INFINITY), 12.0, 1e-12);
  EXPECT_TRUE(values_are(a.grad(), {T(3 * coef_inf), T(-4 * coef_inf)}, chorus::testing::tol<T>()));
  EXPECT_FALSE(c.grad().defined());
  EXPECT_TRUE(throws_with([&] { nn::utils::clip_grad_norm_(ps, 1.0, -2.0); }, {"norm_type", "-2"}));
  EXPECT_TRUE(throws_with([&] { nn::utils::clip_grad_norm_(ps, -1.0); }, {"max_norm", "-1"}));
}

TYPED_TEST(ClipGrad, NonFiniteNorm) {
  using T = TypeParam;
  auto a = zeros<T>({2}).requires_grad_();
  std::vector<AnyTensor> ps{a};
  a.set_grad(from_vector<T>({1, std::numeric_limits<T>::quiet_NaN()}));
  EXPECT_TRUE(throws_with([&] { nn::utils::clip_grad_norm_(ps, 1.0, 2.0, true); }, {"non-finite", "nan"}));
  EXPECT_EQ(a.grad().to_vector()[0], T(1));  // unchanged by the refusal
  a.set_grad(from_vector<T>({1, std::numeric_limits<T>::infinity()}));
  EXPECT_TRUE(throws_with([&] { nn::utils::clip_grad_norm_(ps, 1.0, INFINITY, true); }, {"non-finite", "inf"}));
  // Without error_if_nonfinite: PyTorch scales by the coefficient (0 for an infinite norm).
  EXPECT_TRUE(std::isinf(nn::utils::clip_grad_norm_(ps, 1.0)));
  EXPECT_EQ(a.grad().to_vector()[0], T(0));
  EXPECT_TRUE(std::isnan(a.grad().to_vector()[1]));  // inf * 0
}

TYPED_TEST(ClipGrad, Value) {
  using T = TypeParam;
  auto a = zeros<T>({4}).requires_grad_();
  a.set_grad(from_vector<T>({-3, 0.5, 2, -0.25}));
  nn::utils::clip_grad_value_({a}, 1.0);
  EXPECT_TRUE(values_are(a.grad(), {-1, 0.5, 1, -0.25}, 0));
  EXPECT_TRUE(throws_with([&] { nn::utils::clip_grad_value_({a}, -1.0); }, {"clip_value"}));
}
