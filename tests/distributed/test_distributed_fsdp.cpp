// Fully sharded parameters across ranks (ZeRO-3: dist::FullyShardedDataParallel with
// dist::FullyShard units; Note [fully sharded parameters] in distributed/fsdp_unit.hpp): each
// rank keeps its shard of every unit, the training equals the plain one-process run over the
// whole batch (float64, 1e-12) for SGD with momentum, Adam and AdamW with clipping and
// accumulation, with and without prefetch; a bfloat16 module keeps float32 master shards; a model whose Adam training does not fit one
// device's memory trains over 4 ranks; misuse is refused. Part of the test_distributed binary
// (mpirun -np 1 … 4).
#include "dist_test_util.hpp"
#include "../fsdp_models.hpp"

#include <chorus/distributed/fsdp.hpp>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <vector>

using namespace chorus;
using namespace dist_test;
using chorus::testing::by_name;
using chorus::testing::Deep;
using chorus::testing::expect_float32_shards_keep_small_updates;
using chorus::testing::HalfNet;
using chorus::testing::MemoryLimits;

namespace {

/// Two FullyShard units and a head the root keeps.
struct Net : nn::Module {
  dist::FullyShard<nn::LinearT<double>> l1, l2;
  nn::LinearT<double> head;
  Net(int in, int hidden, int out)
      : l1(register_module("l1", dist::FullyShard(nn::LinearT<double>(in, hidden)))),
        l2(register_module("l2", dist::FullyShard(nn::LinearT<double>(hidden, hidden)))),
        head(register_module("head", nn::LinearT<double>(hidden, out))) {}
  Tensor<double> forward(const Tensor<double>& x) { return head(tanh(l2(tanh(l1(x))))); }
};


/// FSDP over the world, each rank on its `rows` of every step's batch, against the plain model
/// on the whole batch in this process: the same parameters (1e-12) after every step.
template <class O>
void check_fsdp_equals_plain(typename O::options_type options, bool clip, int micro, bool prefetch) {
  const int w = pg().world_size(), r = pg().rank();
  const int rows = 3;
  manual_seed(5);
  auto x = randn<double>({rows * micro * w * 4, 6});
  auto y = randn<double>({rows * micro * w * 4, 2});
  manual_seed(13);
  Net plain(6, 10, 2);
  manual_seed(13);
  dist::FullyShardedDataParallel<Net> fsdp(Net(6, 10, 2), {.prefetch = prefetch});
  ASSERT_EQ(fsdp.units().size(), 3u);
  O plain_opt(plain.parameters(), options);
  O fsdp_opt(fsdp.parameters(), options);
  for (int s = 0; s < 4; ++s) {
    plain_opt.zero_grad();
    fsdp_opt.zero_grad();
    for (int k = 0; k < micro; ++k) {
      // The plain model sees every rank's rows of this micro-batch at once: the mean over them
      // is the mean of the ranks' means.
      const auto all = (s * micro + k) * rows * w;
      nn::functional::mse_loss(plain.forward(x.narrow(0, all, rows * w)), y.narrow(0, all, rows * w)).backward();
      const auto mine = all + r * rows;
      nn::functional::mse_loss(fsdp(x.narrow(0, mine, rows)), y.narrow(0, mine, rows)).backward();
    }
    if (clip) {
      if (w > 1)
        EXPECT_TRUE(throws_with([&] { nn::utils::clip_grad_norm_(fsdp.parameters(), 0.05); },
                                {"shard of a FullyShardedDataParallel", "clip_grad_norm_"}));
      const double want = nn::utils::clip_grad_norm_(plain.parameters(), 0.05);
      const double got = fsdp.clip_grad_norm_(0.05);
      ASSERT_NEAR(got, want, 1e-12 * want) << "the global norm, step " << s;
    }
    plain_opt.step();
    fsdp_opt.step();
    const auto want = by_name(plain.named_parameters());
    const auto got = by_name(fsdp.full_state_dict());
    ASSERT_EQ(got.size(), want.size());
    for (const auto& [name, v] : want) {
      ASSERT_EQ(got.at(name).size(), v.size()) << name;
      for (std::size_t i = 0; i < v.size(); ++i)
        ASSERT_NEAR(got.at(name)[i], v[i], 1e-12) << name << "[" << i << "], step " << s << ", rank " << r;
    }
  }
  // Evaluation without grad mode gathers and frees as training does.
  NoGradGuard ng;
  const auto out = fsdp(x.narrow(0, 0, rows)).to_vector(), want = plain.forward(x.narrow(0, 0, rows)).to_vector();
  for (std::size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(out[i], want[i], 1e-12);
}

TEST(DistFsdp, SgdMomentumEqualsPlain) {
  check_fsdp_equals_plain<optim::SGD>({.lr = 0.1, .momentum = 0.9}, false, 1, true);
}
TEST(DistFsdp, AdamWithClippingEqualsPlain) {
  check_fsdp_equals_plain<optim::Adam>({.lr = 0.01}, true, 1, true);
}
TEST(DistFsdp, AdamWAccumulatedWithoutPrefetchEqualsPlain) {
  check_fsdp_equals_plain<optim::AdamW>({.lr = 0.01, .weight_decay = 0.1}, true, 2, false);
}

// The shards are what a rank keeps: 1/world of each unit (padded), and nothing of the full
// parameters between steps; destroying the wrapper hands the module its full parameters back.
TEST(DistFsdp, ShardsAndRelease) {
  const int w = pg().world_size();
  manual_seed(2);
  Net outside(6, 10, 2);  // shares its tensors with the copy the wrapper holds
  const auto before = by_name(outside.named_parameters());
  std::map<std::string, std::vector<double>> trained;
  {
    dist::FullyShardedDataParallel<Net> fsdp(outside);
    std::int64_t elements = 0;
    for (const auto& [name, n] : fsdp.units()) elements += n;
    EXPECT_EQ(elements, 6 * 10 + 10 + 10 * 10 + 10 + 10 * 2 + 2);
    for (const auto& [name, n] : fsdp.units()) {
      std::int64_t shard = 0;
      for (const auto& [pname, p] : fsdp.named_parameters())
        if (pname == (name.empty() ? "flat_param" : name + ".flat_param")) shard = p.numel();
      EXPECT_EQ(shard, (n + w - 1) / w) << name;
    }
    EXPECT_EQ(by_name(fsdp.full_state_dict()), before);  // every rank holds rank 0's model
    optim::SGD opt(fsdp.parameters(), {.lr = 0.5});
    auto x = randn<double>({4, 6});
    fsdp(x).sum().backward();
    opt.step();
    trained = by_name(fsdp.full_state_dict());
    EXPECT_NE(trained, before);
  }
  EXPECT_EQ(by_name(outside.named_parameters()), trained);
  auto y = outside.forward(randn<double>({2, 6}));  // the module works on its own again
  EXPECT_EQ(y.size(1), 2);
}

// A unit inside a unit, and a unit checkpointed inside another (its recomputation runs while its
// parameters are gathered for backward): the same training as the plain model.
struct OuterImpl : nn::Module {
  dist::FullyShard<nn::LinearT<double>> inner;
  nn::LinearT<double> own;
  OuterImpl()
      : inner(register_module("inner", dist::FullyShard(nn::LinearT<double>(6, 6)))),
        own(register_module("own", nn::LinearT<double>(6, 6))) {}
  Tensor<double> forward(const Tensor<double>& x) {
    auto h = nn::utils::checkpoint([inner = inner](const Tensor<double>& a) { return tanh(inner(a)); }, x);
    return own(h) + x;
  }
};
struct Outer : nn::ModuleHolder<OuterImpl> {
  using ModuleHolder::ModuleHolder;
  Outer() : ModuleHolder(std::make_shared<OuterImpl>()) {}
};
struct Nested : nn::Module {
  dist::FullyShard<Outer> outer;
  nn::LinearT<double> head;
  Nested() : outer(register_module("outer", dist::FullyShard(Outer()))), head(register_module("head", nn::LinearT<double>(6, 2))) {}
  Tensor<double> forward(const Tensor<double>& x) { return head(outer(x)); }
};
TEST(DistFsdp, NestedAndCheckpointedUnitsEqualPlain) {
  const int w = pg().world_size(), r = pg().rank(), rows = 2;
  manual_seed(6);
  auto x = randn<double>({rows * w * 3, 6});
  auto y = randn<double>({rows * w * 3, 2});
  manual_seed(9);
  Nested plain;
  manual_seed(9);
  dist::FullyShardedDataParallel<Nested> fsdp{Nested()};
  ASSERT_EQ(fsdp.units().size(), 3u);  // the root (head), outer (own), outer.inner
  optim::Adam plain_opt(plain.parameters(), {.lr = 0.02}), fsdp_opt(fsdp.parameters(), {.lr = 0.02});
  for (int s = 0; s < 3; ++s) {
    plain_opt.zero_grad();
    fsdp_opt.zero_grad();
    nn::functional::mse_loss(plain.forward(x.narrow(0, s * rows * w, rows * w)), y.narrow(0, s * rows * w, rows * w))
        .backward();
    const auto mine = s * rows * w + r * rows;
    nn::functional::mse_loss(fsdp(x.narrow(0, mine, rows)), y.narrow(0, mine, rows)).backward();
    plain_opt.step();
    fsdp_opt.step();
    const auto want = by_name(plain.named_parameters()), got = by_name(fsdp.full_state_dict());
    for (const auto& [name, v] : want)
      for (std::size_t i = 0; i < v.size(); ++i)
        ASSERT_NEAR(got.at(name)[i], v[i], 1e-12) << name << "[" << i << "], step " << s;
  }
}

// A weight tied between a unit and the root is refused at construction; so are a unit adopted
// twice, a backward pass after the wrapper is gone and a GradScaler over the shards.
struct Tied : nn::Module {
  nn::LinearT<double> shared;
  dist::FullyShard<nn::LinearT<double>> unit;
  Tied()
      : shared(register_module("shared", nn::LinearT<double>(4, 4))),
        unit(register_module("unit", dist::FullyShard(shared))) {}
  Tensor<double> forward(const Tensor<double>& x) { return shared(unit(x)); }
};
TEST(DistFsdp, Refusals) {
  EXPECT_TRUE(throws_with([] { dist::FullyShardedDataParallel<Tied> f{Tied()}; },
                          {"'shared.weight' is also 'unit.weight'", "tied weight"}));
  Tensor<double> loss;
  {
    dist::FullyShardedDataParallel<Net> gone{Net(3, 4, 2)};
    loss = gone(randn<double>({2, 3})).sum();
  }
  EXPECT_TRUE(throws_with([&] { loss.backward(); }, {"destroyed before this backward"}));
  {  // loss scaling would let each rank skip its shard's step alone
    dist::FullyShardedDataParallel<Net> f{Net(3, 4, 2)};
    optim::SGD opt(f.parameters(), {.lr = 0.1});
    amp::GradScaler scaler;
    scaler.scale(f(randn<double>({2, 3})).sum()).backward();
    EXPECT_TRUE(throws_with([&] { scaler.step(opt); }, {"FullyShardedDataParallel shard", "shard_dtype"}));
  }
  Net net(3, 4, 2);
  dist::FullyShardedDataParallel<Net> first(net);
  EXPECT_TRUE(throws_with([&] { dist::FullyShardedDataParallel<Net> second(net); },
                          {"'l1' is a unit of another FullyShardedDataParallel"}));
}

// Mixed precision: a bfloat16 module with float32 shards keeps the updates that bfloat16
// parameters would round away (expect_float32_shards_keep_small_updates, fsdp_models.hpp).
TEST(DistFsdp, Bfloat16ComputeWithFloat32Shards) {
  manual_seed(8);
  HalfNet init;
  dist::FullyShardedDataParallel<HalfNet> fsdp(nn::clone(init, Device::cpu()), {.shard_dtype = DType::Float32});
  expect_float32_shards_keep_small_updates(fsdp, by_name(init.named_parameters()));
}

// Sharded checkpoints (Note [resharding checkpoints]; resuming on other worlds is
// reshard_check.sh's): a round trip on this world restores the shards, the optimizer and the
// schedule; a checkpoint of another model, a directory without an index and an optimizer over
// other tensors are refused.
TEST(DistFsdp, ShardedCheckpointRoundTripAndRefusals) {
  auto id = Tensor<std::int64_t>::empty(Shape{1}, Device::cpu());
  backend::fill(id, static_cast<std::int64_t>(::getpid()));
  pg().broadcast(id, 0);  // a directory every rank names alike
  const auto dir = (std::filesystem::temp_directory_path() / ("chorus_fsdp_" + std::to_string(id.item()))).string();
  manual_seed(4);
  dist::FullyShardedDataParallel<Net> fsdp{Net(6, 10, 2)};
  optim::Adam opt(fsdp.parameters(), {.lr = 0.01});
  optim::StepLR sched(opt, 1, 0.5);
  auto x = randn<double>({4, 6});
  fsdp(x).sum().backward();
  opt.step();
  sched.step();
  fsdp.save_sharded(opt, dir, {.scheduler = &sched}, {{"step", "1"}});
  const auto saved = by_name(fsdp.full_state_dict());
  manual_seed(5);
  dist::FullyShardedDataParallel<Net> again{Net(6, 10, 2)};
  optim::Adam again_opt(again.parameters(), {.lr = 0.01});
  optim::StepLR again_sched(again_opt, 1, 0.5);
  EXPECT_NE(by_name(again.full_state_dict()), saved);
  EXPECT_EQ(again.load_sharded(again_opt, dir, {.scheduler = &again_sched}).at("step"), "1");
  EXPECT_EQ(by_name(again.full_state_dict()), saved);
  EXPECT_EQ(again_sched.last_epoch(), 1);
  EXPECT_EQ(again_opt.lr(0), opt.lr(0));
  // Both take the same next step.
  opt.zero_grad();
  for (auto* f : {&fsdp, &again}) (*f)(x).sum().backward();
  opt.step();
  again_opt.step();
  EXPECT_EQ(by_name(again.full_state_dict()), by_name(fsdp.full_state_dict()));

  dist::FullyShardedDataParallel<Net> other{Net(6, 11, 2)};
  optim::Adam other_opt(other.parameters(), {.lr = 0.01});
  EXPECT_TRUE(throws_with([&] { other.load_sharded(other_opt, dir); }, {"holds the root unit of 22 elements"}));
  EXPECT_TRUE(throws_with([&] { other.load_sharded(other_opt, dir + "/none"); }, {"index.json", "cannot be read"}));
  Net plain(6, 10, 2);
  optim::Adam plain_opt(plain.parameters(), {.lr = 0.01});
  EXPECT_TRUE(throws_with([&] { fsdp.save_sharded(plain_opt, dir); }, {"must step the wrapper's parameters()"}));
  pg().barrier();
  if (pg().rank() == 0) std::filesystem::remove_all(dir);
}

TEST(DistFsdp, ModelLargerThanOneDeviceTrainsOverFourRanks) {
  if (pg().world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  const Device d = Device::cpu(0);
  const std::int64_t params = 12 * (64 * 64 + 64), bytes = params * 8;
  const MemoryLimits lift{{d}};
  manual_seed(4);
  auto x = randn<double>({8, 64});
  auto train = [&](auto&& forward, std::vector<AnyTensor> ps) {
    optim::Adam opt(ps, {.lr = 1e-3});
    for (int s = 0; s < 2; ++s) {
      opt.zero_grad();
      forward(x).square().mean().backward();
      opt.step();
    }
  };
  // Room for the model twice (it is built whole before it is sharded): plain Adam needs four
  // times the model, sharded over 4 ranks once and a few blocks.
  set_memory_limit(d, memory_stats(d).allocated + bytes * 2);
  {
    Deep plain;
    EXPECT_TRUE(throws_with([&] { train([&](const Tensor<double>& in) { return plain.forward(in); }, plain.parameters()); }, {"out of memory on cpu:0"}));
  }
  dist::FullyShardedDataParallel<Deep> fsdp{Deep()};
  train([&](const Tensor<double>& in) { return fsdp(in); }, fsdp.parameters());
}

}  // namespace
