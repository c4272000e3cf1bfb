// Activation checkpointing (Note [activation checkpointing] in autograd/checkpoint.hpp):
// nn::utils::checkpoint and nn::Checkpoint give the plain run's gradients bit for bit — alone,
// nested, under DataParallel and the sharded optimizer, with dropout and batch norm — keep less
// memory, and refuse what cannot be recomputed alike.
#include <string>
#include <tuple>
#include <vector>

#include "data_parallel_util.hpp"

using namespace chorus;
using chorus::testing::cpus;
using chorus::testing::throws_with;

namespace {

// A pre-norm residual MLP block with dropout (a Transformer block's feed-forward half).
template <class T>
struct BlockImpl : nn::Module {
  nn::LayerNormT<T> norm;
  nn::LinearT<T> fc1, fc2;
  nn::Dropout drop;
  explicit BlockImpl(std::int64_t d)
      : norm(register_module("norm", nn::LayerNormT<T>(d))),
        fc1(register_module("fc1", nn::LinearT<T>(d, 4 * d))),
        fc2(register_module("fc2", nn::LinearT<T>(4 * d, d))),
        drop(register_module("drop", nn::Dropout(0.25))) {}
  Tensor<T> forward(const Tensor<T>& x) { return x + drop(fc2(chorus::gelu(fc1(norm(x))))); }
  std::string name() const override { return "Block"; }
};
template <class T>
using Block = nn::ModuleHolder<BlockImpl<T>>;

enum class Mode { plain, function, module };

// `n` blocks, each run plainly, through nn::utils::checkpoint, or wrapped in nn::Checkpoint.
template <class T>
struct StackImpl : nn::Module {
  std::vector<Block<T>> plain;
  std::vector<nn::Checkpoint<Block<T>>> wrapped;
  Mode mode;
  StackImpl(std::int64_t d, int n, Mode mode) : mode(mode) {
    for (int i = 0; i < n; ++i) {
      Block<T> b(d);
      if (mode == Mode::module) wrapped.push_back(register_module("b" + std::to_string(i), nn::Checkpoint(b)));
      else plain.push_back(register_module("b" + std::to_string(i), b));
    }
  }
  Tensor<T> forward(const Tensor<T>& x) {
    Tensor<T> h = x;
    for (auto& b : plain) h = mode == Mode::function ? nn::utils::checkpoint(b, h) : b(h);
    for (auto& b : wrapped) h = b(h);
    return h;
  }
};
template <class T>
using Stack = nn::ModuleHolder<StackImpl<T>>;

template <class T>
void expect_same_bits(const Tensor<T>& a, const Tensor<T>& b, const std::string& what) {
  ASSERT_TRUE(a.defined() && b.defined()) << what;
  ASSERT_EQ(a.shape(), b.shape()) << what;
  const auto va = a.to_vector(), vb = b.to_vector();
  std::size_t differ = 0;
  for (std::size_t i = 0; i < va.size(); ++i) differ += !(va[i] == vb[i]);
  EXPECT_EQ(differ, 0u) << what << ": " << differ << " of " << va.size() << " values differ";
}

template <class T>
void expect_same_grads(const nn::Module& a, const nn::Module& b, const std::string& what) {
  auto pa = a.named_parameters(), pb = b.named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (std::size_t i = 0; i < pa.size(); ++i) {
    EXPECT_EQ(pa[i].name, pb[i].name);
    expect_same_bits(pa[i].tensor.template as<T>().grad(), pb[i].tensor.template as<T>().grad(),
                     what + " " + pa[i].name);
  }
}

// One training step's gradients: the loss, the input's gradient; the model's in its grads.
template <class T, class M>
std::pair<Tensor<T>, Tensor<T>> step(M& model, std::uint64_t seed) {
  manual_seed(seed);
  auto x = randn<T>({12, 8}).requires_grad_();
  auto w = randn<T>({12, 8});
  manual_seed(seed + 1);  // the dropout masks
  auto loss = (model(x) * w).sum();
  loss.backward();
  return {loss.detach(), x.grad()};
}

template <class T>
class Checkpointing : public ::testing::Test {};
TYPED_TEST_SUITE(Checkpointing, chorus::testing::FloatTypes);

TYPED_TEST(Checkpointing, FunctionAndModuleGiveThePlainGradientsBitForBit) {
  using T = TypeParam;
  manual_seed(3);
  Stack<T> plain(8, 3, Mode::plain);
  manual_seed(3);
  Stack<T> function(8, 3, Mode::function);
  manual_seed(3);
  Stack<T> module(8, 3, Mode::module);
  auto [lp, gp] = step<T>(plain, 11);
  auto [lf, gf] = step<T>(function, 11);
  auto [lm, gm] = step<T>(module, 11);
  expect_same_bits(lf, lp, "loss (function)");
  expect_same_bits(lm, lp, "loss (module)");
  expect_same_bits(gf, gp, "input grad (function)");
  expect_same_bits(gm, gp, "input grad (module)");
  expect_same_grads<T>(*function, *plain, "function");
  expect_same_grads<T>(*module, *plain, "module");  // and the same names: nn::Checkpoint adds none
  EXPECT_EQ(module->wrapped[0]->name(), "Checkpoint(Block)");
}

TYPED_TEST(Checkpointing, NestedCheckpointsGiveThePlainGradients) {
  using T = TypeParam;
  manual_seed(5);
  Stack<T> plain(8, 2, Mode::plain);
  manual_seed(5);
  Stack<T> nested(8, 2, Mode::plain);
  auto run = [](Stack<T>& s, bool ckpt, const Tensor<T>& x) {
    auto both = [s, ckpt](const Tensor<T>& in) {  // by value: backward calls it after run returns
      auto h = ckpt ? nn::utils::checkpoint(s->plain[0], in) : s->plain[0](in);
      return s->plain[1](h);
    };
    return ckpt ? nn::utils::checkpoint(both, x) : both(x);
  };
  for (bool ckpt : {false, true}) {
    manual_seed(1);
    auto x = randn<T>({6, 8}).requires_grad_();
    manual_seed(2);
    auto& s = ckpt ? nested : plain;
    run(s, ckpt, x).pow(2.0).sum().backward();
    if (ckpt) expect_same_grads<T>(*nested, *plain, "nested");
  }
}

TEST(Checkpointing, ArgumentsOutputsAndCapturedTensors) {
  // Several outputs (a tuple), arguments that are not tracked (a double, int64 indices, a tensor
  // without grad), an output that is an input, and a tensor captured by the function.
  manual_seed(9);
  auto a0 = randn<double>({4, 3}).requires_grad_(), b0 = randn<double>({4, 3}).requires_grad_();
  auto c0 = randn<double>({3}).requires_grad_();  // captured
  auto k = randn<double>({4, 3});                 // no grad
  auto ids = from_vector(std::vector<std::int64_t>{2, 0, 1, 1, 1, 0, 0, 2, 2, 2, 1, 0}).reshape({4, 3});
  auto f = [&](const Tensor<double>& a, double s, const Tensor<std::int64_t>& idx, const Tensor<double>& b,
               const Tensor<double>& kk) {
    auto y = chorus::tanh(a * s + b * kk) * c0;
    return std::make_tuple(gather(y, 1, idx), b, (a * b).sum());
  };
  std::vector<std::vector<double>> grads[2];
  for (int ckpt = 0; ckpt < 2; ++ckpt) {
    auto a = a0.detach().requires_grad_(), b = b0.detach().requires_grad_();
    c0.set_grad({});
    auto [y, bb, s] = ckpt ? nn::utils::checkpoint(f, a, 0.5, ids, b, k) : f(a, 0.5, ids, b, k);
    ((y * y).sum() + (bb * 3.0).sum() + s).backward();
    grads[ckpt] = {a.grad().to_vector(), b.grad().to_vector(), c0.grad().to_vector()};
  }
  EXPECT_EQ(grads[1], grads[0]);
}

TEST(Checkpointing, KeepsLessMemory) {
  // Eight blocks of 256 rows: plainly, every block's activations live until backward; checkpointed,
  // only the blocks' inputs and one block's activations at a time.
  auto peak = [](Mode mode) {
    manual_seed(4);
    Stack<float> s(64, 8, mode);
    auto x = randn<float>({256, 64}).requires_grad_();
    auto& alloc = allocator_of(Device::cpu(0));
    alloc.reset_peak();
    const auto before = alloc.stats().allocated;
    s(x).sum().backward();
    return alloc.stats().peak_allocated - before;
  };
  const auto plain = peak(Mode::plain), ckpt = peak(Mode::module);
  EXPECT_LT(ckpt * 2, plain) << "peak above the start: checkpointed " << ckpt << " bytes, plain " << plain;
}

TEST(Checkpointing, AStackThatDoesNotFitADevicesMemoryLimitTrainsCheckpointed) {
  // The same stack on a virtual device capped between the checkpointed peak and the plain one:
  // plainly it runs out of memory (a chorus::Error naming the device), checkpointed it trains.
  const Device d = cpus(6).back();  // cpu:5, nothing else on it
  auto run = [&](Mode mode) {
    manual_seed(4);
    Stack<float> s(64, 8, mode);
    s->to(d);
    auto x = randn<float>({256, 64}, d).requires_grad_();
    s(x).sum().backward();
  };
  auto peak = [&](Mode mode) {
    auto& alloc = allocator_of(d);
    alloc.reset_peak();
    const auto before = alloc.stats().allocated;
    run(mode);
    return alloc.stats().peak_allocated - before;
  };
  const auto plain = peak(Mode::plain), ckpt = peak(Mode::module);
  struct Lift {
    Device d;
    ~Lift() { set_memory_limit(d, 0); }
  } lift{d};
  set_memory_limit(d, memory_stats(d).allocated + (plain + ckpt) / 2);
  EXPECT_TRUE(throws_with([&] { run(Mode::plain); }, {"out of memory on cpu:5", "set_memory_limit"}));
  EXPECT_NO_THROW(run(Mode::module));
  EXPECT_TRUE(throws_with([&] { set_memory_limit(d, -1); }, {"set_memory_limit", "-1 bytes"}));
}

TEST(Checkpointing, BatchNormMovesItsRunningStatisticsOnce) {
  auto make = [] {
    manual_seed(2);
    return nn::Sequential(nn::Linear(5, 6), nn::BatchNorm1d(6, {.momentum = std::nullopt}), nn::Tanh());
  };
  auto plain = make(), ckpt = make();
  for (int it = 0; it < 2; ++it) {
    manual_seed(10 + it);
    auto x = randn<float>({7, 5});
    plain(x).pow(2.0).sum().backward();
    nn::utils::checkpoint(ckpt, x).pow(2.0).sum().backward();
  }
  auto bp = plain->named_buffers(), bc = ckpt->named_buffers();
  ASSERT_EQ(bp.size(), 3u);
  for (std::size_t i = 0; i < 2; ++i) expect_same_bits(bc[i].tensor.as<float>(), bp[i].tensor.as<float>(), bp[i].name);
  EXPECT_EQ(bc[2].tensor.as<std::int64_t>().item(), 2);
  expect_same_grads<float>(*ckpt, *plain, "batch norm");
}

TEST(Checkpointing, RetainGraphRecomputesAgainAndAReleasedNodeSaysSo) {
  manual_seed(6);
  Block<double> b(4);
  auto x = randn<double>({3, 4}).requires_grad_();
  manual_seed(7);
  auto y = nn::utils::checkpoint(b, x);
  const auto g = ones<double>({3, 4});
  y.backward(g, /*retain_graph=*/true);
  const auto once = x.grad().to_vector();
  y.backward(g);
  auto twice = x.grad().to_vector();
  for (std::size_t i = 0; i < once.size(); ++i) EXPECT_EQ(twice[i], once[i] + once[i]);
  EXPECT_TRUE(throws_with([&] { y.backward(g); }, {"CheckpointBackward a second time"}));
}

TEST(Checkpointing, RefusesWhatCannotBeRecomputedAlike) {
  manual_seed(1);
  nn::Linear fc(3, 3);
  auto x = randn<float>({2, 3}).requires_grad_();
  // Host random numbers inside.
  auto noisy = [&](const Tensor<float>& a) { return fc(a) + randn<float>({2, 3}); };
  EXPECT_TRUE(throws_with([&] { nn::utils::checkpoint(noisy, x); }, {"randn inside a checkpointed function"}));
  // SyncBatchNorm in training.
  nn::SyncBatchNorm sbn(3);
  EXPECT_TRUE(throws_with([&] { nn::utils::checkpoint(sbn, x); }, {"cannot train inside a checkpointed function"}));
  sbn->eval();
  EXPECT_NO_THROW(nn::utils::checkpoint(sbn, x).sum().backward());
  // An input changed in place after forward.
  auto z = randn<float>({2, 3}).requires_grad_();
  auto in = z * 2.0f;
  auto out = nn::utils::checkpoint(fc, in);
  in.detach().add_(1.0f);
  EXPECT_TRUE(throws_with([&] { out.sum().backward(); }, {"modified by an inplace operation", "checkpointed"}));
  // A parameter changed in place after forward (an optimizer step before backward).
  auto out2 = nn::utils::checkpoint(fc, x);
  {
    NoGradGuard g;
    fc->weight.add_(1.0f);
  }
  EXPECT_TRUE(throws_with([&] { out2.sum().backward(); }, {"modified by an inplace operation"}));
  // A function that does something else the second time.
  nn::Linear other(3, 3);
  int runs = 0;
  auto swaps = [&](const Tensor<float>& a) { return ++runs == 1 ? fc(a) : other(a); };
  auto out3 = nn::utils::checkpoint(swaps, x);
  EXPECT_TRUE(throws_with([&] { out3.sum().backward(); }, {"which its forward did not"}));
  int draws = 0;
  auto dropper = [&](const Tensor<float>& a) { return ++draws == 1 ? dropout(a, 0.5, true) : a * 1.0f; };
  auto out4 = nn::utils::checkpoint(dropper, x);
  EXPECT_TRUE(throws_with([&] { out4.sum().backward(); }, {"forward drew 1 times"}));
}

TEST(Checkpointing, AModuleDestroyedBeforeBackwardIsAnError) {
  auto x = randn<float>({2, 4}).requires_grad_();
  Tensor<float> y;
  {
    nn::Checkpoint b(Block<float>(4));
    y = b(x).sum();
  }
  EXPECT_TRUE(throws_with([&] { y.backward(); }, {"was destroyed before backward"}));
}

TEST(Checkpointing, WithoutGradModeItJustRuns) {
  Block<float> b(4);
  auto x = randn<float>({2, 4}).requires_grad_();
  NoGradGuard g;
  auto y = nn::utils::checkpoint(b, x);
  EXPECT_FALSE(y.requires_grad());
}

// DataParallel over 3 devices: each replica checkpoints its own blocks; gradients (and two SGD
// steps, plain and with the sharded optimizer) equal the plain DataParallel run's bit for bit.
template <class T>
class CheckpointDataParallel : public ::testing::Test {};
TYPED_TEST_SUITE(CheckpointDataParallel, chorus::testing::FloatTypes);

TYPED_TEST(CheckpointDataParallel, ReplicasGiveThePlainGradientsAndSteps) {
  using T = TypeParam;
  auto devices = cpus(3);
  auto train = [&](Mode mode, bool sharded) {
    manual_seed(8);
    DataParallel<Stack<T>> dp(Stack<T>(8, 2, mode), devices);
    std::unique_ptr<optim::Optimizer> opt;
    const optim::SGDOptions o{.lr = 0.1, .momentum = 0.9};
    if (sharded) opt = std::make_unique<parallel::ShardedOptimizer<optim::SGD>>(dp, o);
    else opt = std::make_unique<optim::SGD>(dp.parameters(), o);
    std::vector<Tensor<T>> grads;
    for (int it = 0; it < 2; ++it) {
      opt->zero_grad();
      manual_seed(20 + it);
      auto x = randn<T>({10, 8});
      (dp(x).pow(2.0)).mean().backward();
      if (it == 0)
        for (auto& p : dp.parameters()) grads.push_back(p.template as<T>().grad().clone());
      opt->step();
    }
    std::vector<Tensor<T>> params;
    for (auto& p : dp.parameters()) params.push_back(p.template as<T>().detach().clone());
    return std::make_pair(grads, params);
  };
  for (bool sharded : {false, true}) {
    auto [gp, pp] = train(Mode::plain, sharded);
    auto [gm, pm] = train(Mode::module, sharded);
    auto [gf, pf] = train(Mode::function, sharded);
    for (std::size_t i = 0; i < gp.size(); ++i) {
      expect_same_bits(gm[i], gp[i], "grad " + std::to_string(i) + " (module)");
      expect_same_bits(gf[i], gp[i], "grad " + std::to_string(i) + " (function)");
      expect_same_bits(pm[i], pp[i], "parameter " + std::to_string(i) + " after 2 steps (module)");
    }
  }
}

}  // namespace
