// amp::GradScaler (Note [loss scaling]): PyTorch's semantics on one device and through
// DataParallel over 3 CPU devices, with inf/NaN injected into chosen steps.
#include <chorus/amp.hpp>

#include <cmath>
#include <limits>
#include <set>
#include <vector>

#include "data_parallel_util.hpp"

using namespace chorus;
using chorus::testing::all_close;
using chorus::testing::cpus;
using chorus::testing::Net;
using chorus::testing::throws_with;

namespace {

/// The batch of step `s`: 9 rows; on a step in `bad`, one element of row `row` becomes inf
/// (or NaN on odd steps), so that some gradients are inf/NaN.
Tensor<double> batch_of(int s, const std::set<int>& bad, std::int64_t row) {
  manual_seed(100 + s);
  auto x = randn<double>({9, 6});
  if (bad.count(s)) {
    auto v = x.to_vector();
    v[static_cast<std::size_t>(row * 6 + 2)] =
        s % 2 ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
    x = from_vector<double>(v, {9, 6});
  }
  return x;
}

std::vector<double> flat_params(const nn::Module& m) {
  std::vector<double> out;
  for (const auto& p : m.parameters())
    for (double v : p.as<double>().to_vector()) out.push_back(v);
  return out;
}

}  // namespace

TEST(GradScaler, ScaledGradientsUnscaleToThePlainOnes) {
  manual_seed(1);
  Net<double> a;
  auto b = nn::clone(a, Device::cpu());
  auto x = randn<double>({5, 6});
  a.forward(x).sum().backward();
  amp::GradScaler scaler;
  EXPECT_EQ(scaler.get_scale(), 65536.0);
  optim::SGD opt(b.parameters(), {.lr = 0.1});
  scaler.scale(b.forward(x).sum()).backward();
  const auto pa = a.parameters(), pb = b.parameters();
  EXPECT_TRUE(all_close(pb[0].as<double>().grad(), mul(pa[0].as<double>().grad(), 65536.0), 1e-12, 0));
  scaler.unscale_(opt);
  for (std::size_t i = 0; i < pa.size(); ++i)  // a power of two: exact
    EXPECT_TRUE(all_close(pb[i].as<double>().grad(), pa[i].as<double>().grad(), 0, 0));
}

// Steps with an inf or NaN gradient are skipped exactly, the scale backs off on them and grows
// after growth_interval good steps; the parameters equal a run that never saw the bad steps.
TEST(GradScaler, SkipsExactlyTheStepsWithNonFiniteGradients) {
  const std::set<int> bad = {2, 3, 7};
  manual_seed(2);
  Net<double> model;
  auto plain = nn::clone(model, Device::cpu());
  optim::Adam opt(model.parameters(), {.lr = 1e-2});
  optim::Adam opt_plain(plain.parameters(), {.lr = 1e-2});
  amp::GradScaler scaler({.init_scale = 1024.0, .growth_interval = 3});
  double want_scale = 1024.0;
  int good_run = 0;
  for (int s = 0; s < 12; ++s) {
    auto x = batch_of(s, bad, 4);
    opt.zero_grad();
    scaler.scale(square(model.forward(x)).mean()).backward();
    const auto before = flat_params(model);
    EXPECT_EQ(scaler.step(opt), !bad.count(s)) << "step " << s;
    if (bad.count(s)) {
      EXPECT_EQ(flat_params(model), before) << "a skipped step moved the parameters, step " << s;
    } else {
      opt_plain.zero_grad();
      square(plain.forward(x)).mean().backward();
      opt_plain.step();
    }
    scaler.update();
    if (bad.count(s)) {
      want_scale *= 0.5;
      good_run = 0;
    } else if (++good_run == 3) {
      want_scale *= 2.0;
      good_run = 0;
    }
    EXPECT_EQ(scaler.get_scale(), want_scale) << "step " << s;
  }
  const auto got = flat_params(model), want = flat_params(plain);
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-12);
}

// Through DataParallel over 3 CPU devices the inf reaches only the last replica's rows; the
// summed gradients carry it to the primary, and the run equals the single-device one.
TEST(GradScaler, DataParallelOverThreeDevicesSkipsTheSameSteps) {
  const std::set<int> bad = {1, 4};
  manual_seed(3);
  Net<double> single;
  DataParallel<Net<double>> dp(nn::clone(single, Device::cpu(0)), cpus(3));
  optim::SGD opt_single(single.parameters(), {.lr = 0.1, .momentum = 0.9});
  optim::SGD opt_dp(dp.parameters(), {.lr = 0.1, .momentum = 0.9});
  amp::GradScaler s1({.growth_interval = 2}), s3({.growth_interval = 2});
  for (int s = 0; s < 6; ++s) {
    auto x = batch_of(s, bad, 8);  // row 8: in the third chunk (3/3/3)
    opt_single.zero_grad();
    opt_dp.zero_grad();
    s1.scale(square(single.forward(x)).mean()).backward();
    s3.scale(square(dp(x)).mean()).backward();
    EXPECT_EQ(s1.step(opt_single), !bad.count(s)) << "step " << s;
    EXPECT_EQ(s3.step(opt_dp), !bad.count(s)) << "step " << s;
    s1.update();
    s3.update();
    EXPECT_EQ(s3.get_scale(), s1.get_scale());
  }
  const auto got = flat_params(dp.module()), want = flat_params(single);
  for (std::size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-10);
}

TEST(GradScaler, UnscaleBeforeClippingAndPyTorchsCallOrderRules) {
  manual_seed(4);
  Net<double> model;
  optim::SGD opt(model.parameters(), {.lr = 0.1});
  amp::GradScaler scaler;
  EXPECT_TRUE(throws_with([&] { scaler.update(); }, {"no inf checks"}));
  scaler.scale(model.forward(randn<double>({4, 6})).sum()).backward();
  scaler.unscale_(opt);
  EXPECT_TRUE(throws_with([&] { scaler.unscale_(opt); }, {"unscale_() has already been called"}));
  const double norm = nn::utils::clip_grad_norm_(model.parameters(), 1e-3);
  EXPECT_LT(norm, 1e3);  // the unscaled norm, not 65536 times it
  EXPECT_TRUE(scaler.step(opt));
  EXPECT_TRUE(throws_with([&] { scaler.step(opt); }, {"step() has already been called"}));
  EXPECT_TRUE(throws_with([&] { scaler.unscale_(opt); }, {"after step()"}));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 65536.0);  // one good step of 2000
  // unscale_ then update without step: the flags are read in update.
  scaler.scale(model.forward(full<double>({1, 6}, std::numeric_limits<double>::infinity())).sum()).backward();
  scaler.unscale_(opt);
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 32768.0);
}

TEST(GradScaler, StateDictRoundTripsAndBadInputIsRefused) {
  amp::GradScaler a({.init_scale = 8.0, .growth_interval = 5});
  Net<double> model;
  optim::SGD opt(model.parameters(), {.lr = 0.1});
  for (int s = 0; s < 3; ++s) {
    opt.zero_grad();
    a.scale(model.forward(randn<double>({2, 6})).sum()).backward();
    a.step(opt);
    a.update();
  }
  auto sd = a.state_dict();
  EXPECT_EQ(sd.at("scale"), 8.0);
  EXPECT_EQ(sd.at("_growth_tracker"), 3.0);
  EXPECT_EQ(sd.at("growth_interval"), 5.0);
  amp::GradScaler b;
  b.load_state_dict(sd);
  EXPECT_EQ(b.state_dict(), sd);
  sd["_growth_tracker"] = 7;
  EXPECT_TRUE(throws_with([&] { b.load_state_dict(sd); }, {"_growth_tracker", "7"}));
  EXPECT_TRUE(throws_with([&] { b.load_state_dict({{"scale", 1.0}}); }, {"growth_factor"}));
  EXPECT_TRUE(throws_with([] { amp::GradScaler({.backoff_factor = 1.5}); }, {"backoff_factor"}));
  EXPECT_TRUE(throws_with([] { amp::GradScaler({.init_scale = 0}); }, {"init_scale"}));
  // Disabled: scale() is the identity, step() always steps, the state is empty.
  amp::GradScaler off({.enabled = false});
  auto loss = model.forward(randn<double>({2, 6})).sum();
  EXPECT_EQ(off.scale(loss).impl(), loss.impl());
  EXPECT_EQ(off.get_scale(), 1.0);
  // A float16 loss is scaled in float32 (65536 times it would overflow float16), as PyTorch's
  // float32 scale promotes it; its gradient reaches the float16 graph.
  amp::GradScaler on;
  auto w = from_vector<half>({half(3.0f), half(-1.5f)}).requires_grad_(true);
  auto lh = (w * w).sum();  // 11.25 in float16
  Tensor<float> scaled = on.scale(lh);
  EXPECT_EQ(scaled.item(), 11.25f * 65536.0f);
  EXPECT_TRUE(std::isfinite(scaled.item()));
  amp::GradScaler half_scale({.init_scale = 1024.0});
  half_scale.scale(lh).backward();
  EXPECT_EQ(w.grad().to<float>().to_vector(), (std::vector<float>{6.0f * 1024, -3.0f * 1024}));
  EXPECT_EQ(off.scale(lh).dtype(), DType::Float32);
  EXPECT_TRUE(off.state_dict().empty());
  // A step without any gradient records no inf check: an error, as PyTorch's assertion.
  Net<double> fresh;
  optim::SGD opt_fresh(fresh.parameters(), {.lr = 0.1});
  amp::GradScaler e;
  EXPECT_TRUE(throws_with([&] { e.step(opt_fresh); }, {"no inf checks were recorded"}));
  // 16-bit gradients are refused: the optimizer's weights must be float32 masters.
  auto hp = zeros<half>({3});
  hp.requires_grad_(true);
  hp.set_grad(ones<half>({3}));
  optim::SGD opt_half(std::vector<AnyTensor>{AnyTensor(hp)}, {.lr = 0.1});
  amp::GradScaler h;
  EXPECT_TRUE(throws_with([&] { h.unscale_(opt_half); }, {"float16", "master weights"}));
}
