// Mixed-precision training (Note [the form of mixed precision]): a 16-bit model, a float32 loss,
// float32 master weights stepped by the optimizer; on one device and through DataParallel.
#include <chorus/amp.hpp>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <memory>
#include <vector>

#include "data_parallel_util.hpp"
#include "resnet_block.hpp"

using namespace chorus;
using chorus::testing::cpus;
using chorus::testing::throws_with;
namespace F = chorus::nn::functional;

namespace {

template <class T>
struct Mlp : nn::Module {
  nn::LinearT<T> fc1, fc2, fc3;
  Mlp()
      : fc1(register_module("fc1", nn::LinearT<T>(16, 64))),
        fc2(register_module("fc2", nn::LinearT<T>(64, 64))),
        fc3(register_module("fc3", nn::LinearT<T>(64, 4))) {}
  Tensor<T> forward(const Tensor<T>& x) { return fc3(relu(fc2(relu(fc1(x))))); }
};

/// Writes src's parameters into dst's (same structure), each rounded once to dst's dtype.
void copy_rounded(nn::Module& dst, const nn::Module& src) {
  auto d = dst.named_parameters();
  auto s = src.named_parameters();
  ASSERT_EQ(d.size(), s.size());
  NoGradGuard g;
  for (std::size_t i = 0; i < d.size(); ++i) {
    ASSERT_EQ(d[i].name, s[i].name);
    d[i].tensor.visit([&](const auto& dt) {
      s[i].tensor.visit([&](const auto& st) {
        using D = typename std::decay_t<decltype(dt)>::value_type;
        if constexpr (is_floating_v<D>) backend::convert(dt, st.contiguous());
      });
    });
  }
}

/// A fixed regression problem: 64 rows of 16 features, 4 smooth targets.
std::pair<Tensor<float>, Tensor<float>> problem() {
  manual_seed(42);
  auto x = randn<float>({64, 16});
  auto w = randn<float>({16, 4}) * 0.3;
  return {x, sin(x.matmul(w))};
}

float relative_gap(float a, float b) { return std::abs(a - b) / std::max(std::abs(b), 1e-6f); }

/// The 16-bit run's loss is the float run's within 15%, or both are at bfloat16's resolution of
/// unit-sized outputs ((2^-8)^2 = 1.5e-5: below it the float run keeps descending alone).
bool tracks(float b, float f) { return std::abs(b - f) <= 0.15f * f + 2e-5f; }

/// Trains side by side for 200 steps: the float model with `opt_f` on `float_loss()`, the 16-bit
/// model's float32 masters with `opt_b` on `bf16_loss()` (each returns the step's float32 loss
/// tensor). The first losses agree within 2%, every 50 steps the 16-bit run tracks the float
/// one, and both end below `learned` times the first loss.
template <class FloatLoss, class Bf16Loss>
void expect_tracks_for_200_steps(optim::Optimizer& opt_f, FloatLoss&& float_loss, optim::Optimizer& opt_b,
                                 amp::MasterWeights& master, Bf16Loss&& bf16_loss, float learned) {
  float first = 0, last_f = 0, last_b = 0;
  for (int s = 0; s < 200; ++s) {
    opt_f.zero_grad();
    auto lf = float_loss();
    lf.backward();
    opt_f.step();
    last_f = lf.item();
    opt_b.zero_grad();
    auto lb = bf16_loss();
    lb.backward();
    master.step(opt_b);
    last_b = lb.item();
    if (s == 0) {
      first = last_f;
      EXPECT_LT(relative_gap(last_b, last_f), 0.02f);
    }
    if (s % 50 == 49) {
      EXPECT_TRUE(tracks(last_b, last_f)) << "step " << s << ": " << last_b << " against " << last_f;
    }
  }
  EXPECT_LT(last_f, learned * first);  // it learned
  EXPECT_LT(last_b, learned * first);
}

}  // namespace

TEST(MasterWeights, StepsTheFloatCopiesAndRoundsOnceIntoTheModel) {
  // A bfloat16 parameter of 1.0 under SGD(lr 1e-4) with gradient 1: stepped in bfloat16 it
  // would never move (1e-4 is below half its ulp, 2^-9); its float32 master moves every step
  // and the model follows it, rounded once.
  auto w = full<bfloat16>({3}, bfloat16(1.0f)).requires_grad_();
  auto f = full<float>({2}, 0.5f).requires_grad_();  // a float parameter is its own master
  amp::MasterWeights master({w, f});
  ASSERT_EQ(master.size(), 2u);
  const auto ps = master.parameters();
  EXPECT_EQ(ps[0].dtype(), DType::Float32);
  EXPECT_EQ(ps[1].impl_key(), AnyTensor(f).impl_key());
  optim::SGD opt(ps, {.lr = 1e-4});
  float want = 1.0f;
  for (int s = 0; s < 40; ++s) {
    opt.zero_grad();
    (w.to<float>().sum() + f.sum()).backward();
    EXPECT_EQ(w.grad().dtype(), DType::BFloat16);
    master.step(opt);
    EXPECT_FALSE(w.grad().defined());  // moved into the master
    want -= 1e-4f;
  }
  const auto m = ps[0].as<float>().to_vector();
  for (float v : m) EXPECT_NEAR(v, want, 1e-6f);
  for (auto v : w.to_vector()) EXPECT_EQ(v.bits(), bfloat16(m[0]).bits());
  EXPECT_LT(static_cast<float>(w.to_vector()[0]), 1.0f);
  EXPECT_NEAR(f.to_vector()[0], 0.5f - 40e-4f, 1e-6f);
}

// Clipping with master weights: one option of the step, on the masters' float32 gradients (the
// 16-bit model's own cannot be clipped, and say where to clip instead); with a scaler they are
// unscaled first, as PyTorch's unscale_, clip, step.
TEST(MasterWeights, ClipsTheMastersGradientsInTheStep) {
  auto run = [](bool scaled, bool by_hand) {
    auto w = from_vector<bfloat16>({bfloat16(1.0f), bfloat16(-2.0f), bfloat16(0.5f)}).requires_grad_();
    amp::MasterWeights master({w});
    optim::SGD opt(master.parameters(), {.lr = 0.1});
    amp::GradScaler scaler({.init_scale = 256.0});
    auto loss = (w.to<float>() * from_vector<float>({3, 4, 12})).sum();  // gradient norm 13
    if (scaled) scaler.scale(loss).backward();
    else loss.backward();
    if (by_hand) {
      master.grads_to_master();
      if (scaled) scaler.unscale_(opt);
      EXPECT_NEAR(static_cast<double>(nn::utils::clip_grad_norm_(master.parameters(), 1.0)), 13.0, 1e-9);
      if (scaled) EXPECT_TRUE(scaler.step(opt));
      else opt.step();
      master.master_to_model();
    } else if (scaled) {
      EXPECT_TRUE(master.step(scaler, opt, {.max_norm = 1.0}));
    } else {
      master.step(opt, {.max_norm = 1.0});
    }
    return master.parameters()[0].as<float>().to_vector();
  };
  for (bool scaled : {false, true}) {
    const auto got = run(scaled, false);
    EXPECT_EQ(got, run(scaled, true)) << "scaled " << scaled;
    EXPECT_NEAR(got[2], 0.5f - 0.1f * 12.0f / 13.0f, 1e-5f);  // the gradient clipped to norm 1
  }
  auto v = from_vector<bfloat16>({bfloat16(1.0f)}).requires_grad_();
  (v.to<float>() * 2.0f).sum().backward();
  EXPECT_TRUE(throws_with([&] { nn::utils::clip_grad_norm_({v}, 1.0); },
                          {"bfloat16 gradients", "master.step(opt, {.max_norm"}));
}

TEST(MasterWeights, AccumulatesGradientsInFloatAndMapsParameterGroups) {
  auto a = full<bfloat16>({2}, bfloat16(0.0f)).requires_grad_();
  auto b = full<bfloat16>({2}, bfloat16(0.0f)).requires_grad_();
  amp::MasterWeights master({a, b});
  // Two micro-batches: each gradient moves into the master, where they add up in float.
  for (int k = 0; k < 2; ++k) {
    (a.to<float>() * 0.3f).sum().backward();
    master.grads_to_master();
  }
  const auto ga = master.parameters()[0].as<float>().grad().to_vector();
  EXPECT_NEAR(ga[0], 2 * static_cast<float>(bfloat16(0.3f)), 1e-7f);
  EXPECT_FALSE(master.parameters()[1].as<float>().grad().defined());
  // Groups: of() gives the masters of a subset, in its order.
  const auto g = master.of({b});
  ASSERT_EQ(g.size(), 1u);
  EXPECT_EQ(g[0].impl_key(), master.parameters()[1].impl_key());
  auto stranger = zeros<bfloat16>({2}).requires_grad_();
  EXPECT_TRUE(throws_with([&] { master.of({stranger}); }, {"not one of the model parameters"}));
  auto made = (a * a);  // not a leaf
  EXPECT_TRUE(throws_with([&] { amp::MasterWeights bad({made}); }, {"not a leaf"}));
}

// A bfloat16 MLP with float32 masters tracks the float32 run's loss for 200 Adam steps (the
// gap stays at bfloat16's noise: the products round their inputs to 8 bits).
TEST(MixedPrecision, Bf16MlpTracksTheFloatRunFor200Steps) {
  auto [x, y] = problem();
  manual_seed(7);
  Mlp<float> fp;
  Mlp<bfloat16> bf;
  copy_rounded(bf, fp);
  copy_rounded(fp, bf);  // both start from the same (bfloat16-representable) weights
  optim::Adam opt_f(fp.parameters(), {.lr = 2e-3});
  amp::MasterWeights master(bf.parameters());
  optim::Adam opt_b(master.parameters(), {.lr = 2e-3});
  const auto xb = x.to<bfloat16>();
  expect_tracks_for_200_steps(
      opt_f, [&] { return F::mse_loss(fp.forward(x), y); }, opt_b, master,
      [&] { return F::mse_loss(bf.forward(xb).to<float>(), y); },
      0.1f);
}

TEST(MixedPrecision, Bf16TransformerLayerTracksTheFloatRunFor200Steps) {
  manual_seed(11);
  auto x = randn<float>({4, 8, 32});
  auto y = tanh(x.cumsum(1) * 0.3) * 0.5;  // prefix sums over the sequence: attention has to mix it
  nn::TransformerEncoderLayerT<float> fp(32, 4, {.dim_feedforward = 64, .dropout = 0.0, .batch_first = true});
  nn::TransformerEncoderLayerT<bfloat16> bf(32, 4, {.dim_feedforward = 64, .dropout = 0.0, .batch_first = true});
  copy_rounded(*bf, *fp);
  copy_rounded(*fp, *bf);
  optim::AdamW opt_f(fp->parameters(), {.lr = 1e-3});
  amp::MasterWeights master(bf->parameters());
  optim::AdamW opt_b(master.parameters(), {.lr = 1e-3});
  const auto xb = x.to<bfloat16>();
  expect_tracks_for_200_steps(
      opt_f, [&] { return F::mse_loss(fp(x), y); }, opt_b, master,
      [&] { return F::mse_loss(bf(xb).to<float>(), y); },  // softmax and norms in float inside
      0.5f);
}

// A bfloat16 ResNet basic block (3x3 convolutions, batch norm, the shortcut's strided 1x1
// convolution) under max and average pooling, with float32 masters, tracks the float32 run for
// 200 Adam steps (Note [16-bit CNN operators]: the convolutions accumulate in float32).
TEST(MixedPrecision, Bf16ResNetBlockTracksTheFloatRunFor200Steps) {
  manual_seed(13);
  auto x = randn<float>({8, 4, 8, 8});
  auto y = sigmoid(F::adaptive_avg_pool2d(x, {1, 1}).reshape({8, 4}).matmul(randn<float>({4, 8})) * 4.0);
  chorus::testing::BasicBlock<float> fp(4, 8, 2);
  chorus::testing::BasicBlock<bfloat16> bf(4, 8, 2);
  copy_rounded(bf, fp);
  copy_rounded(fp, bf);
  auto head = [](const auto& out) { return F::adaptive_avg_pool2d(F::max_pool2d(out, 2), {1, 1}).reshape({8, 8}); };
  optim::Adam opt_f(fp.parameters(), {.lr = 5e-3});
  amp::MasterWeights master(bf.parameters());
  optim::Adam opt_b(master.parameters(), {.lr = 5e-3});
  const auto xb = x.to<bfloat16>();
  expect_tracks_for_200_steps(
      opt_f, [&] { return F::mse_loss(head(fp.forward(x)), y); }, opt_b, master,
      [&] { return F::mse_loss(head(bf.forward(xb)).to<float>(), y); },
      0.5f);
  // The running statistics were updated in float32 and rounded once into the bfloat16 buffers.
  const auto rf = fp.bn1->running_mean.to_vector();
  const auto rb = bf.bn1->running_mean.to_vector();
  ASSERT_EQ(rf.size(), rb.size());
  for (std::size_t i = 0; i < rf.size(); ++i)
    EXPECT_NEAR(static_cast<float>(rb[i]), rf[i], 0.05f + 0.05f * std::abs(rf[i])) << i;
}

// DataParallel over 3 CPU devices of a bfloat16 model: the replicas hold bfloat16 copies,
// and the summed bfloat16 gradients equal the single-device bfloat16 run's within the
// roundings of three partial sums (each chunk's gradient is rounded once before the sum).
TEST(MixedPrecision, DataParallelBf16GradientsEqualTheSingleDeviceRun) {
  auto [x, y] = problem();
  manual_seed(9);
  Mlp<bfloat16> single;
  DataParallel<Mlp<bfloat16>> dp(nn::clone(single, Device::cpu(0)), cpus(3));
  const auto xb = x.to<bfloat16>();
  F::mse_loss(single.forward(xb).to<float>(), y, Reduction::Sum).backward();
  F::mse_loss(dp(xb).to<float>(), y, Reduction::Sum).backward();
  const auto ps = single.named_parameters(), pd = dp.module().named_parameters();
  ASSERT_EQ(ps.size(), pd.size());
  for (std::size_t i = 0; i < ps.size(); ++i) {
    const auto gs = ps[i].tensor.as<bfloat16>().grad().to_vector();
    const auto gd = pd[i].tensor.as<bfloat16>().grad().to_vector();
    ASSERT_EQ(gs.size(), gd.size()) << ps[i].name;
    double scale = 0;
    for (auto v : gs) scale = std::max(scale, std::abs(static_cast<double>(v)));
    for (std::size_t k = 0; k < gs.size(); ++k)  // 3 partial sums: a few bfloat16 ulps of the largest
      EXPECT_NEAR(static_cast<double>(gd[k]), static_cast<double>(gs[k]), 4 * 0x1p-8 * scale + 1e-6)
          << ps[i].name << "[" << k << "]";
  }
  // One step through the masters moves both the same way.
  amp::MasterWeights ms(single.parameters()), md(dp.parameters());
  optim::SGD os(ms.parameters(), {.lr = 0.01}), od(md.parameters(), {.lr = 0.01});
  ms.step(os);
  md.step(od);
  const auto ws = single.fc1->weight.to_vector(), wd = dp.module().fc1->weight.to_vector();
  int differ = 0;
  for (std::size_t k = 0; k < ws.size(); ++k) differ += ws[k].bits() != wd[k].bits();
  EXPECT_LT(differ, static_cast<int>(ws.size() / 20));  // ties of rounding only
}

// float16 with a GradScaler: the step whose gradients overflow is skipped, masters and model
// alike, and the scale backs off.
TEST(MixedPrecision, Fp16WithGradScalerSkipsTheOverflowingStep) {
  auto [x, y] = problem();
  manual_seed(13);
  Mlp<half> model;
  amp::MasterWeights master(model.parameters());
  optim::SGD opt(master.parameters(), {.lr = 1e-2});
  amp::GradScaler scaler;
  const auto xh = x.to<half>();
  for (int s = 0; s < 4; ++s) {
    const auto before = model.fc1->weight.to_vector();
    opt.zero_grad();
    auto xs = xh;
    if (s == 2) {  // an inf in the input: inf/NaN gradients
      auto v = xh.to_vector();
      v[5] = half(std::numeric_limits<float>::infinity());
      xs = from_vector<half>(v, xh.shape());
    }
    scaler.scale(F::mse_loss(model.forward(xs).to<float>(), y)).backward();
    const double scale = scaler.get_scale();
    const bool stepped = master.step(scaler, opt);
    scaler.update();
    EXPECT_EQ(stepped, s != 2) << "step " << s;
    const auto after = model.fc1->weight.to_vector();
    bool same = true;
    for (std::size_t k = 0; k < after.size(); ++k) same &= after[k].bits() == before[k].bits();
    EXPECT_EQ(same, s == 2) << "step " << s;
    EXPECT_EQ(scaler.get_scale(), s == 2 ? scale * 0.5 : scale);
    for (auto v : master.parameters()[0].as<float>().to_vector()) ASSERT_TRUE(std::isfinite(v));
  }
}

namespace {
struct TempDir {
  std::filesystem::path path;
  TempDir() {
    path = std::filesystem::temp_directory_path() / ("chorus_mp_" + std::to_string(::getpid()));
    std::filesystem::create_directories(path);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

/// One float16 training run of `steps` steps from `first`, with an overflowing input at step 3.
struct Fp16Run {
  Mlp<half> model;
  std::unique_ptr<amp::MasterWeights> masters;
  std::unique_ptr<optim::AdamW> optimizer;
  std::unique_ptr<optim::CosineAnnealingLR> schedule;
  amp::GradScaler scaler{{.init_scale = 1024, .growth_interval = 2}};
  explicit Fp16Run(const Mlp<float>& init) {
    copy_rounded(model, init);
    masters = std::make_unique<amp::MasterWeights>(model.parameters());
    optimizer = std::make_unique<optim::AdamW>(masters->parameters(), optim::AdamWOptions{.lr = 1e-2});
    schedule = std::make_unique<optim::CosineAnnealingLR>(*optimizer, 8);
  }
  amp::MasterWeights& master() { return *masters; }
  optim::AdamW& opt() { return *optimizer; }
  optim::CosineAnnealingLR& sched() { return *schedule; }
  void run(int first, int last) {
    auto [x, y] = problem();
    for (int s = first; s < last; ++s) {
      auto xs = x.to<half>();
      if (s == 3) {
        auto v = xs.to_vector();
        v[0] = half(std::numeric_limits<float>::infinity());
        xs = from_vector<half>(v, xs.shape());
      }
      opt().zero_grad();
      scaler.scale(F::mse_loss(model.forward(xs).to<float>(), y)).backward();
      master().step(scaler, opt());
      scaler.update();
      sched().step();
    }
  }
};
}  // namespace

// The optimizer file holds the scaler, the schedule and the float32 masters: a run resumed
// from it ends bitwise where the uninterrupted run ends (the masters are not recoverable from
// the 16-bit model file: they carry the bits the model's rounding dropped).
TEST(MixedPrecision, CheckpointWithScalerAndMastersResumesBitwise) {
  TempDir dir;
  manual_seed(17);
  Mlp<float> init;
  Fp16Run straight(init), first(init), resumed(init);
  straight.run(0, 8);
  first.run(0, 5);
  save(first.model, dir.file("model.safetensors"));
  save(first.opt(), dir.file("optim.safetensors"),
       {.scheduler = &first.sched(), .scaler = &first.scaler, .master = &first.master()});
  load(resumed.model, dir.file("model.safetensors"));
  load(resumed.opt(), dir.file("optim.safetensors"),
       {.scheduler = &resumed.sched(), .scaler = &resumed.scaler, .master = &resumed.master()});
  EXPECT_EQ(resumed.scaler.get_scale(), first.scaler.get_scale());
  EXPECT_EQ(resumed.scaler.state_dict(), first.scaler.state_dict());
  EXPECT_EQ(resumed.sched().last_epoch(), 5);
  resumed.run(5, 8);
  const auto a = straight.model.named_parameters(), b = resumed.model.named_parameters();
  for (std::size_t i = 0; i < a.size(); ++i) {
    const auto va = a[i].tensor.as<half>().to_vector(), vb = b[i].tensor.as<half>().to_vector();
    for (std::size_t k = 0; k < va.size(); ++k) ASSERT_EQ(va[k].bits(), vb[k].bits()) << a[i].name << "[" << k << "]";
  }
  const auto ma = straight.master().parameters(), mb = resumed.master().parameters();
  for (std::size_t i = 0; i < ma.size(); ++i)
    EXPECT_EQ(ma[i].as<float>().to_vector(), mb[i].as<float>().to_vector()) << i;

  // A file without a scaler's state or masters is refused for them, and nothing changes.
  save(first.opt(), dir.file("plain.safetensors"));
  const double scale = resumed.scaler.get_scale();
  const auto before = resumed.master().parameters()[0].as<float>().to_vector();
  EXPECT_TRUE(throws_with([&] { load(resumed.opt(), dir.file("plain.safetensors"), {.scaler = &resumed.scaler}); },
                          {"no GradScaler state"}));
  EXPECT_TRUE(throws_with([&] { load(resumed.opt(), dir.file("plain.safetensors"), {.master = &resumed.master()}); },
                          {"no master copy of parameter 0"}));
  EXPECT_EQ(resumed.scaler.get_scale(), scale);
  EXPECT_EQ(resumed.master().parameters()[0].as<float>().to_vector(), before);
  // A file with masters loaded without them: the stale masters would overwrite the model at
  // the next step, so it is refused, nothing loaded.
  const auto lr = resumed.opt().lr(0);
  EXPECT_TRUE(throws_with([&] { load(resumed.opt(), dir.file("optim.safetensors"), {.scheduler = &resumed.sched(),
                                                                                    .scaler = &resumed.scaler}); },
                          {"holds master weights", "{.master = &master}"}));
  EXPECT_EQ(resumed.opt().lr(0), lr);
}
