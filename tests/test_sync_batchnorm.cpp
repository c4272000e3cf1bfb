// BatchNorm under DataParallel: SyncBatchNorm's statistics cover the whole batch across the
// replicas (equal to BatchNorm on one device with the whole batch), plain BatchNorm keeps
// nn.DataParallel's semantics (each replica normalises its chunk; replica 0's running
// statistics end in the primary's buffers).
#include <atomic>
#include <chrono>
#include <thread>

#include "test_util.hpp"

using namespace chorus;
using chorus::testing::all_close;
using chorus::testing::throws_with;

namespace {
std::vector<Device> cpus(int k) {
  set_cpu_device_count(std::max(cpu_device_count(), k));
  std::vector<Device> d;
  for (int i = 0; i < k; ++i) d.push_back(Device::cpu(i));
  return d;
}

template <class BN>
struct Block : nn::Module {
  nn::Conv2dT<double> conv;
  BN bn;
  explicit Block(std::uint64_t seed)
      : conv(register_module("conv", nn::Conv2dT<double>(3, 4, 3, {.padding = 1}))),
        bn(register_module("bn", BN(4))) {
    Generator g(seed);  // a non-trivial affine map, the same in every copy
    nn::init::uniform_(bn->weight, 0.5, 1.5, g);
    nn::init::uniform_(bn->bias, -0.5, 0.5, g);
  }
  Tensor<double> forward(const Tensor<double>& x) { return relu(bn(conv(x))); }
};

constexpr double kTol = 1e-10;

void expect_same_state(const nn::Module& a, const nn::Module& b, const std::string& what) {
  auto ta = a.named_tensors(), tb = b.named_tensors();
  ASSERT_EQ(ta.size(), tb.size());
  for (std::size_t i = 0; i < ta.size(); ++i) {
    ASSERT_EQ(ta[i].name, tb[i].name);
    if (ta[i].tensor.dtype() == DType::Int64) {
      EXPECT_EQ(ta[i].tensor.as<std::int64_t>().item(), tb[i].tensor.as<std::int64_t>().item()) << what << ta[i].name;
      continue;
    }
    auto x = ta[i].tensor.as<double>(), y = tb[i].tensor.as<double>();
    EXPECT_TRUE(all_close(x, y, kTol, kTol)) << what << " " << ta[i].name;
    if (x.grad().defined() || y.grad().defined()) {
      ASSERT_TRUE(x.grad().defined() && y.grad().defined()) << what << " grad of " << ta[i].name;
      EXPECT_TRUE(all_close(x.grad(), y.grad(), kTol, kTol)) << what << " grad of " << ta[i].name;
    }
  }
}
}  // namespace

TEST(SyncBatchNorm, EqualsBatchNormOverTheWholeBatchOn1To3Devices) {
  for (int k = 1; k <= 3; ++k) {
    for (std::int64_t batch : {6, 7}) {
      const std::string what = std::to_string(k) + " devices, batch " + std::to_string(batch) + ":";
      manual_seed(3);
      Block<nn::BatchNorm2dT<double>> reference(9);
      manual_seed(3);
      DataParallel<Block<nn::SyncBatchNormT<double>>> dp(Block<nn::SyncBatchNormT<double>>(9), cpus(k));
      expect_same_state(reference, dp.module(), what + " initial");
      for (int step = 0; step < 2; ++step) {
        Generator g(100 + step);
        auto x = rand<double>({batch, 3, 5, 4}, Device::cpu(), -1, 2, g);
        auto w = randn<double>({batch, 4, 5, 4}, Device::cpu(), 0, 1, g);
        auto xr = x.detach().requires_grad_(true), xd = x.detach().requires_grad_(true);
        reference.zero_grad();
        dp.zero_grad();
        auto yr = reference.forward(xr);
        auto yd = dp(xd);
        EXPECT_TRUE(all_close(yd, yr, kTol, kTol)) << what << " output, step " << step;
        (yr * w).sum().backward();
        (yd * w).sum().backward();
        EXPECT_TRUE(all_close(xd.grad(), xr.grad(), kTol, kTol)) << what << " input gradient, step " << step;
        expect_same_state(reference, dp.module(), what + " step " + std::to_string(step));
      }
      // eval(): the (synchronised) running statistics.
      reference.eval();
      dp.eval();
      auto x = randn<double>({batch, 3, 5, 4});
      EXPECT_TRUE(all_close(dp(x), reference.forward(x), kTol, kTol)) << what << " eval";
    }
  }
}

TEST(SyncBatchNorm, PlainBatchNormUnderDataParallelKeepsReplicaZerosStatistics) {
  manual_seed(4);
  Block<nn::BatchNorm2dT<double>> reference(5);  // replays what each replica does to its chunk
  manual_seed(4);
  DataParallel<Block<nn::BatchNorm2dT<double>>> dp(Block<nn::BatchNorm2dT<double>>(5), cpus(2));
  auto x = randn<double>({6, 3, 4, 4});
  auto y = dp(x);
  // Each replica normalises its own chunk of 3 (torch.chunk plan) with its own statistics.
  auto chunk0 = x.narrow(0, 0, 3), chunk1 = x.narrow(0, 3, 3);
  auto replica1 = nn::clone(reference, Device::cpu());
  auto y1 = replica1.forward(chunk1);
  auto y0 = reference.forward(chunk0);  // updates reference's running stats from chunk 0 only
  EXPECT_TRUE(all_close(y, cat(std::vector<Tensor<double>>{y0, y1}), kTol, kTol));
  // The primary's running statistics are replica 0's (chunk 0), not the whole batch's.
  const auto& bn = dp.module().bn;
  EXPECT_TRUE(all_close(bn->running_mean, reference.bn->running_mean, kTol, kTol));
  EXPECT_TRUE(all_close(bn->running_var, reference.bn->running_var, kTol, kTol));
  EXPECT_EQ(bn->num_batches_tracked.item(), 1);
  Block<nn::BatchNorm2dT<double>> whole = nn::clone(dp.module(), Device::cpu());
  manual_seed(4);
  Block<nn::BatchNorm2dT<double>> fresh(5);
  fresh.forward(x);
  EXPECT_FALSE(all_close(bn->running_mean, fresh.bn->running_mean, 1e-6, 1e-6));
  // A second step: replica 1 starts again from the primary's statistics.
  dp(x);
  reference.forward(chunk0);
  EXPECT_TRUE(all_close(bn->running_mean, reference.bn->running_mean, kTol, kTol));
  EXPECT_EQ(bn->num_batches_tracked.item(), 2);
  EXPECT_EQ(dp.replica(1).bn->num_batches_tracked.item(), 2);
}

TEST(SyncBatchNorm, AloneItIsABatchNorm) {
  manual_seed(6);
  nn::SyncBatchNormT<double> sync(3);
  nn::BatchNorm1dT<double> plain(3);
  auto x = randn<double>({8, 3, 5});
  EXPECT_TRUE(all_close(sync(x), plain(x), kTol, kTol));
  EXPECT_TRUE(all_close(sync->running_var, plain->running_var, kTol, kTol));
  EXPECT_EQ(sync->name(), "SyncBatchNorm(3)");
  EXPECT_TRUE(throws_with([&] { sync(randn<double>({8})); }, {"SyncBatchNorm", "[N, C, *]", "[8]"}));
}

TEST(SyncBatchNorm, AMissingReplicaFailsInsteadOfHanging) {
  auto group = std::make_shared<parallel::ReplicaStatsGroup>(2, std::chrono::milliseconds(50));
  auto t = ones<double>({3});
  auto reducer = group->member(0);
  EXPECT_TRUE(throws_with([&] { reducer->all_reduce_sum(t); }, {"replica 0 waited", "1 of 2 replicas"}));
  EXPECT_TRUE(throws_with([&] { group->member(2); }, {"rank 2 out of range"}));
  // Two participants on two threads: each gets the sum.
  auto ok = std::make_shared<parallel::ReplicaStatsGroup>(2);
  auto a = from_vector<double>({1, 2}), b = from_vector<double>({10, 20});
  std::int64_t ca = 0;
  std::thread other([&] { ok->member(1)->all_reduce_sum(b); });
  ok->member(0)->all_reduce_sum(a);
  other.join();
  std::thread other2([&] { ok->member(1)->all_reduce_sum(std::int64_t{5}); });
  ca = ok->member(0)->all_reduce_sum(std::int64_t{3});
  other2.join();
  EXPECT_TRUE(chorus::testing::values_are(a, {11, 22}));
  EXPECT_TRUE(chorus::testing::values_are(b, {11, 22}));
  EXPECT_EQ(ca, 8);
}

// Issue 16, item 4 (Note [cancelled reductions]): a replica that fails before its statistics
// reduction (a bad index in its chunk) cancels it: the others stop waiting at once instead of
// after the 5-minute timeout, and the error reported is that replica's own, not a timeout.
namespace {
struct Tagger : nn::Module {
  nn::Embedding emb;
  nn::SyncBatchNorm bn;
  Tagger() : emb(register_module("emb", nn::Embedding(10, 4))), bn(register_module("bn", nn::SyncBatchNorm(1))) {}
  Tensor<float> forward(const Tensor<std::int64_t>& idx) { return bn(emb(idx)); }  // [N, 1] -> [N, 1, 4]
};

template <class F>
double seconds_of(F&& f) {
  const auto start = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}
}  // namespace

TEST(SyncBatchNorm, AReplicaThatFailsBeforeTheReductionCancelsItAndIsTheOneReported) {
  DataParallel<Tagger> dp(Tagger(), cpus(3));
  std::vector<std::int64_t> rows = {1, 2, 3, 4, 5, 6, 7, 99, 8};  // row 7: replica 2's chunk (3, 3, 3)
  auto idx = from_vector<std::int64_t>(rows, {9, 1});
  const double took = seconds_of([&] {
    EXPECT_TRUE(throws_with([&] { dp(idx); }, {"in replica 2 on cpu:2", "99", "out of range"}));
  });
  EXPECT_LT(took, 60.0);
  try {
    dp(idx);
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.find("waited"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("more replica(s) failed"), std::string::npos) << msg;  // the waiters only gave up
    EXPECT_EQ(msg.find("stopped waiting"), std::string::npos) << msg;
  }
  // The next call with good indices trains as before.
  rows[7] = 0;
  auto out = dp(from_vector<std::int64_t>(rows, {9, 1}));
  EXPECT_EQ(out.shape(), (Shape{9, 1, 4}));
  out.sum().backward();
  EXPECT_TRUE(dp.module().emb->weight.grad().defined());
}

namespace {
template <class T>
struct FailingBackward final : autograd::Node<T> {
  std::string name() const override { return "FailingBackward"; }
  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&&) override {
    CHORUS_FAIL("boom in backward");
  }
};

// Replica 2's backward fails above its SyncBatchNorm, whose backward reduction then never runs.
struct FailsAboveTheNorm : nn::Module {
  nn::SyncBatchNormT<double> bn;
  std::shared_ptr<std::atomic<bool>> fail = std::make_shared<std::atomic<bool>>(true);
  FailsAboveTheNorm() : bn(register_module("bn", nn::SyncBatchNormT<double>(2))) {}
  Tensor<double> forward(const Tensor<double>& x) {
    auto y = bn(x);
    if (!*fail || x.device() != Device::cpu(2)) return y;
    auto out = y.detach().clone();
    auto node = autograd::make_node<FailingBackward<double>, double>({&y});
    autograd::set_history(out, std::shared_ptr<autograd::Node<double>>(node));
    return out;
  }
};
}  // namespace

// The sibling in backward (Note [giving up in backward]): the engine schedules nothing after a
// failure, so the other replicas' batch-norm backward gives up instead of waiting 5 minutes.
TEST(SyncBatchNorm, ABackwardThatFailsInOneReplicaDoesNotLeaveTheOthersWaiting) {
  DataParallel<FailsAboveTheNorm> dp(FailsAboveTheNorm(), cpus(3));
  auto loss = dp(randn<double>({9, 2, 3})).sum();
  const double took = seconds_of([&] {
    EXPECT_TRUE(throws_with([&] { loss.backward(); },
                            {"in backward of FailingBackward in replica 2 on cpu:2", "boom in backward"}));
  });
  EXPECT_LT(took, 60.0);
  // The next step works.
  dp.module().fail->store(false);
  dp.zero_grad();
  auto y = dp(randn<double>({9, 2, 3}));
  (y * y).sum().backward();
  EXPECT_TRUE(dp.module().bn->weight.grad().defined());
}

TEST(SyncBatchNorm, ACancelledGroupReleasesItsWaitersAtOnce) {
  auto group = std::make_shared<parallel::ReplicaStatsGroup>(3);  // the default 5-minute timeout
  std::vector<std::string> errors(2);
  std::vector<std::thread> waiters;
  for (int r = 0; r < 2; ++r)
    waiters.emplace_back([&, r] {
      auto t = ones<double>({2});
      try {
        group->member(r)->all_reduce_sum(t);
      } catch (const parallel::ReplicaCancelled& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
      }
    });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const double took = seconds_of([&] {
    group->cancel(2);
    for (auto& w : waiters) w.join();
  });
  EXPECT_LT(took, 30.0);
  for (const auto& e : errors) EXPECT_NE(e.find("replica 2 failed"), std::string::npos) << e;
  EXPECT_TRUE(group->cancelled());
  // A replica entering later gives up at once too.
  auto t = ones<double>({2});
  EXPECT_THROW(group->member(1)->all_reduce_sum(t), parallel::ReplicaCancelled);
}
