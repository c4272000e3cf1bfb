// The distributed layer under a real MPI launcher: CTest runs this binary with mpirun -np 1 … 4.
// Every rank runs every test; only rank 0 prints GoogleTest's report, and a failure on any
// rank makes mpirun fail.
#include <chorus/distributed/watchdog.hpp>

#include "dist_test_util.hpp"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <mutex>
#include <set>
#include <thread>

using namespace chorus;
using namespace dist_test;

namespace {

// ---- process group ----

TEST(ProcessGroup, RanksAreConsistent) {
  const int w = pg().world_size(), r = pg().rank();
  ASSERT_GE(w, 1);
  ASSERT_GE(r, 0);
  ASSERT_LT(r, w);
  EXPECT_GE(pg().local_rank(), 0);
  EXPECT_LT(pg().local_rank(), pg().local_world_size());
  EXPECT_EQ(pg().backend(), "mpi");
  auto ranks = pg().all_gather(from_vector(std::vector<std::int64_t>{r}));
  for (int k = 0; k < w; ++k) EXPECT_EQ(ranks.to_vector()[k], k);
}

#ifdef OPEN_MPI
// Note [ring all-reduce]: chorus initialised MPI here, so Open MPI's non-blocking all-reduce
// runs the ring, unless the environment chose or the release's ring is wrong in place.
TEST(ProcessGroup, OpenMpiRunsTheRingAllReduce) {
  EXPECT_TRUE(dist::detail::ring_allreduce_in_place_fixed({4, 1, 2}));
  EXPECT_TRUE(dist::detail::ring_allreduce_in_place_fixed({4, 0, 7}));
  EXPECT_TRUE(dist::detail::ring_allreduce_in_place_fixed({5, 0, 0}));
  EXPECT_FALSE(dist::detail::ring_allreduce_in_place_fixed({4, 1, 1}));
  EXPECT_FALSE(dist::detail::ring_allreduce_in_place_fixed({4, 0, 6}));
  EXPECT_FALSE(dist::detail::ring_allreduce_in_place_fixed({3, 1, 6}));
  const std::string choice = dist::detail::iallreduce_choice();
  if (choice != "ring") GTEST_SKIP() << "chorus did not choose: " << choice;
  int provided = 0;
  ASSERT_EQ(MPI_T_init_thread(MPI_THREAD_MULTIPLE, &provided), MPI_SUCCESS);
  int index = -1;
  ASSERT_EQ(MPI_T_cvar_get_index("coll_libnbc_iallreduce_algorithm", &index), MPI_SUCCESS);
  MPI_T_cvar_handle handle;
  int count = 0;
  ASSERT_EQ(MPI_T_cvar_handle_alloc(index, nullptr, &handle, &count), MPI_SUCCESS);
  int algorithm = -1;
  EXPECT_EQ(MPI_T_cvar_read(handle, &algorithm), MPI_SUCCESS);
  EXPECT_EQ(algorithm, 1) << "1 is the ring";
  MPI_T_cvar_handle_free(&handle);
  MPI_T_finalize();
}
#endif

template <class T>
class Collectives : public ::testing::Test {};
using Scalars = ::testing::Types<float, double, std::int64_t>;
TYPED_TEST_SUITE(Collectives, Scalars);

TYPED_TEST(Collectives, AllReduceBroadcastAllGather) {
  using T = TypeParam;
  const int w = pg().world_size(), r = pg().rank();
  auto t = from_vector(std::vector<T>{T(r + 1), T(2 * r), T(3)});
  pg().all_reduce(t, dist::ReduceOp::Sum);
  EXPECT_EQ(t.to_vector(), (std::vector<T>{T(w * (w + 1) / 2), T(w * (w - 1)), T(3 * w)}));
  auto a = from_vector(std::vector<T>{T(4 * w), T(8 * r)});
  pg().all_reduce(a, dist::ReduceOp::Avg);
  EXPECT_EQ(a.to_vector(), (std::vector<T>{T(4 * w), T(4 * (w - 1))}));
  auto b = from_vector(std::vector<T>{T(r), T(-r)});
  pg().broadcast(b, w - 1);
  EXPECT_EQ(b.to_vector(), (std::vector<T>{T(w - 1), T(1 - w)}));
  auto g = pg().all_gather(from_vector(std::vector<T>{T(r), T(10 * r)}).view({1, 2}));
  ASSERT_EQ(g.shape(), Shape({w, 1, 2}));
  for (int k = 0; k < w; ++k) {
    EXPECT_EQ(g.to_vector()[2 * k], T(k));
    EXPECT_EQ(g.to_vector()[2 * k + 1], T(10 * k));
  }
  pg().barrier();
}

TEST(ProcessGroup, ManyCollectivesInFlight) {
  // Several asynchronous collectives at once complete in issue order, each with its result.
  const int w = pg().world_size();
  std::vector<Tensor<double>> ts;
  std::vector<std::shared_ptr<dist::Work>> works;
  for (int k = 0; k < 16; ++k) {
    ts.push_back(full<double>({1000}, double(k + pg().rank())));
    works.push_back(pg().all_reduce_async(ts.back(), dist::ReduceOp::Sum));
  }
  for (auto& wk : works) wk->wait(pg().timeout());
  for (int k = 0; k < 16; ++k) EXPECT_EQ(ts[k].to_vector()[999], double(k * w + w * (w - 1) / 2));
}

TEST(ProcessGroup, BadArgumentsAreRefused) {
  auto t = zeros<float>({4, 4}).t();
  try {
    pg().all_reduce(t);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("contiguous"), std::string::npos) << e.what();
  }
  auto ok = zeros<float>({2});
  EXPECT_THROW(pg().broadcast(ok, pg().world_size()), Error);
}

// ---- the watchdog of collectives the host does not wait for (Note [NCCL watchdog]) ----
// Generic over "done", so that what the NCCL backend relies on runs here (and under TSan).

struct FakeCollective final : dist::detail::Watchdog::Entry {
  FakeCollective(std::string what, std::chrono::milliseconds limit)
      : Entry(std::move(what), std::chrono::steady_clock::now() + limit) {}
  std::atomic<int> state{0};  // 0 running, 1 done, 2 failed
  std::atomic<int> polls{0};
  dist::detail::Watchdog::Poll poll(std::string& error) override {
    ++polls;
    if (state == 2) error = "device-side failure";
    return state == 0 ? dist::detail::Watchdog::Poll::Running
                      : state == 1 ? dist::detail::Watchdog::Poll::Done : dist::detail::Watchdog::Poll::Failed;
  }
};

template <class F>
bool eventually(F&& f, std::chrono::milliseconds limit = std::chrono::seconds(10)) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    if (f()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return f();
}

struct Fired {
  std::mutex m;
  std::vector<std::string> reasons;
  void add(const std::string& r) {
    std::lock_guard<std::mutex> lk(m);
    reasons.push_back(r);
  }
  std::vector<std::string> get() {
    std::lock_guard<std::mutex> lk(m);
    return reasons;
  }
};

TEST(Watchdog, DropsCompletedWorkAndFiresOnceForAStall) {
  Fired fired;
  dist::detail::Watchdog wd([] { return std::string(); }, [&](const std::string& r) { fired.add(r); },
                            std::chrono::milliseconds(1));
  auto quick = std::make_shared<FakeCollective>("all_reduce of bucket 0", std::chrono::seconds(60));
  wd.watch(quick);
  ASSERT_TRUE(eventually([&] { return quick->polls > 0; }));
  quick->state = 1;
  ASSERT_TRUE(eventually([&] { return wd.in_flight() == 0; })) << "a completed collective is dropped";
  EXPECT_TRUE(fired.get().empty());
  EXPECT_TRUE(quick->failure().empty());
  // A stalled collective fires once; what else is in flight is failed with the same reason.
  auto stuck = std::make_shared<FakeCollective>("all_reduce of bucket 1", std::chrono::milliseconds(30));
  auto later = std::make_shared<FakeCollective>("all_reduce of bucket 2", std::chrono::seconds(60));
  wd.watch(stuck);
  wd.watch(later);
  ASSERT_TRUE(eventually([&] { return !fired.get().empty(); }));
  EXPECT_NE(fired.get()[0].find("all_reduce of bucket 1 timed out"), std::string::npos) << fired.get()[0];
  EXPECT_NE(later->failure().find("bucket 1 timed out"), std::string::npos) << later->failure();
  EXPECT_NE(stuck->failure().find("timed out"), std::string::npos);
  EXPECT_EQ(wd.in_flight(), 0u);
  auto again = std::make_shared<FakeCollective>("all_reduce of bucket 3", std::chrono::milliseconds(1));
  wd.watch(again);
  ASSERT_TRUE(eventually([&] { return !again->failure().empty(); }));
  EXPECT_EQ(fired.get().size(), 1u) << "the group breaks once";
}

TEST(Watchdog, AFailedCollectiveOrACommunicatorErrorFires) {
  Fired fired;
  std::atomic<bool> comm_failed{false};
  dist::detail::Watchdog wd([&] { return comm_failed ? std::string("remote process exited") : std::string(); },
                            [&](const std::string& r) { fired.add(r); }, std::chrono::milliseconds(1));
  auto bad = std::make_shared<FakeCollective>("broadcast of 'fc.weight'", std::chrono::seconds(60));
  bad->state = 2;
  wd.watch(bad);
  ASSERT_TRUE(eventually([&] { return !fired.get().empty(); }));
  EXPECT_NE(fired.get()[0].find("broadcast of 'fc.weight' failed: device-side failure"), std::string::npos)
      << fired.get()[0];

  Fired fired2;
  dist::detail::Watchdog wd2([&] { return comm_failed ? std::string("remote process exited") : std::string(); },
                             [&](const std::string& r) { fired2.add(r); }, std::chrono::milliseconds(1));
  auto running = std::make_shared<FakeCollective>("all_gather", std::chrono::seconds(60));
  wd2.watch(running);
  ASSERT_TRUE(eventually([&] { return running->polls > 2; }));
  EXPECT_TRUE(fired2.get().empty());
  comm_failed = true;
  ASSERT_TRUE(eventually([&] { return !fired2.get().empty(); }));
  EXPECT_NE(fired2.get()[0].find("remote process exited"), std::string::npos) << fired2.get()[0];
  EXPECT_NE(running->failure().find("remote process exited"), std::string::npos);
}

// Note [watchdog device]: the NCCL backend makes its GPU the watchdog thread's device in the
// start hook, which must run on that thread before its first poll.
struct ThreadRecordingCollective final : dist::detail::Watchdog::Entry {
  explicit ThreadRecordingCollective(std::atomic<bool>& started)
      : Entry("all_reduce", std::chrono::steady_clock::now() + std::chrono::seconds(60)), started_(started) {}
  dist::detail::Watchdog::Poll poll(std::string&) override {
    std::lock_guard<std::mutex> lk(m);
    poller = std::this_thread::get_id();
    started_at_first_poll = polls++ == 0 ? started_.load() : started_at_first_poll;
    return dist::detail::Watchdog::Poll::Running;
  }
  std::atomic<bool>& started_;
  std::mutex m;
  std::thread::id poller;
  int polls = 0;
  bool started_at_first_poll = false;
};

TEST(Watchdog, TheStartHookRunsOnTheWatchdogThreadBeforeAnyPoll) {
  std::atomic<bool> started{false};
  std::thread::id hook_thread;
  auto entry = std::make_shared<ThreadRecordingCollective>(started);
  {
    dist::detail::Watchdog wd([] { return std::string(); }, [](const std::string&) {}, std::chrono::milliseconds(1),
                              [&] {
                                hook_thread = std::this_thread::get_id();
                                started = true;
                              });
    wd.watch(entry);
    ASSERT_TRUE(eventually([&] {
      std::lock_guard<std::mutex> lk(entry->m);
      return entry->polls > 0;
    }));
  }
  std::lock_guard<std::mutex> lk(entry->m);
  EXPECT_TRUE(entry->started_at_first_poll) << "the first poll ran before the start hook";
  EXPECT_EQ(hook_thread, entry->poller) << "the start hook ran on another thread than the polls";
  EXPECT_NE(hook_thread, std::this_thread::get_id());
}

TEST(Watchdog, StopsPromptlyWithWorkInFlight) {
  const auto t0 = std::chrono::steady_clock::now();
  {
    dist::detail::Watchdog wd([] { return std::string(); }, [](const std::string&) {},
                              std::chrono::milliseconds(50));
    wd.watch(std::make_shared<FakeCollective>("all_reduce", std::chrono::seconds(60)));
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
}

// ---- DistributedDataParallel ----

template <class T>
class Ddp : public ::testing::Test {};
using Floats = ::testing::Types<float, double>;
TYPED_TEST_SUITE(Ddp, Floats);

template <class T>
constexpr double tol() {
  return std::is_same_v<T, double> ? 1e-10 : 2e-5;
}

/// DDP over the world on rank slices of a batch equals one process on the whole batch.
template <class T>
void check_equals_single_process(DistributedDataParallelOptions options, int steps) {
  const int w = pg().world_size(), r = pg().rank();
  const int batch = 24, per = batch / w;
  ASSERT_EQ(batch % w, 0);
  manual_seed(7);
  auto x = randn<T>({batch, 5});
  auto y = randn<T>({batch, 3});
  manual_seed(1);
  Mlp<T> reference(5, 16, 3);
  // Every rank but 0 starts from other weights: DDP must copy rank 0's.
  manual_seed(r == 0 ? 1 : 100 + r);
  DistributedDataParallel<Mlp<T>> ddp(Mlp<T>(5, 16, 3), options);
  EXPECT_EQ(values<T>(ddp.parameters()), values<T>(reference.parameters()));

  optim::SGD opt(ddp.parameters(), {.lr = 0.05, .momentum = 0.9});
  optim::SGD ref_opt(reference.parameters(), {.lr = 0.05, .momentum = 0.9});
  for (int step = 0; step < steps; ++step) {
    // Odd steps zero the gradients in place (they are views of the buckets then), even steps drop them.
    auto loss = nn::functional::mse_loss(ddp(x.narrow(0, r * per, per)), y.narrow(0, r * per, per));
    opt.zero_grad(/*set_to_none=*/step % 2 == 0);
    loss.backward();
    opt.step();
    auto ref_loss = nn::functional::mse_loss(reference.forward(x), y);
    ref_opt.zero_grad(step % 2 == 0);
    ref_loss.backward();
    ref_opt.step();
  }
  auto got = values<T>(ddp.parameters()), want = values<T>(reference.parameters());
  for (std::size_t i = 0; i < got.size(); ++i)
    for (std::size_t k = 0; k < got[i].size(); ++k)
      ASSERT_NEAR(got[i][k], want[i][k], tol<T>()) << "parameter " << i << " element " << k << " on rank " << r;
  // Every rank holds bitwise the same parameters.
  auto mine = concat(got);
  auto all = gather_all(mine);
  for (int k = 1; k < w; ++k)
    ASSERT_EQ(std::memcmp(all[0].data(), all[k].data(), mine.size() * sizeof(T)), 0) << "rank " << k << " differs";
}

TYPED_TEST(Ddp, EqualsSingleProcessOnTheWholeBatch) { check_equals_single_process<TypeParam>({}, 4); }

TYPED_TEST(Ddp, EqualsSingleProcessWithSmallBuckets) {
  // Several buckets, rebuilt after the first step.
  check_equals_single_process<TypeParam>({.bucket_cap_bytes = 512, .first_bucket_bytes = 64}, 4);
}

// Tied weights under DDP (Note [tied parameters]): the tied tensor is reduced once, with the
// gradient of both uses, and DDP equals one process on the whole batch; tying after wrapping is
// refused at the next forward.
struct TiedLm : nn::Module {
  nn::EmbeddingT<double> emb;
  nn::LinearT<double> head;
  explicit TiedLm(bool tie = true)
      : emb(register_module("emb", nn::EmbeddingT<double>(9, 4))), head(register_module("head", nn::LinearT<double>(4, 9))) {
    if (tie) head->weight = emb->weight;
  }
  Tensor<double> forward(const Tensor<std::int64_t>& ids) { return head(chorus::tanh(emb(ids))); }
};

TEST(Ddp, TiedWeightsAreReducedOnceWithBothGradients) {
  const int w = pg().world_size(), r = pg().rank();
  const int batch = 12, per = batch / w;
  ASSERT_EQ(batch % w, 0);
  std::vector<std::int64_t> all_ids;
  for (int i = 0; i < batch; ++i) all_ids.push_back((i * 5 + 2) % 9);
  auto ids = from_vector(all_ids);
  manual_seed(3);
  TiedLm reference;
  manual_seed(r == 0 ? 3 : 50 + r);
  DistributedDataParallel<TiedLm> ddp{TiedLm()};
  EXPECT_EQ(ddp.parameters().size(), 2u);  // emb.weight (also head.weight), head.bias
  optim::SGD opt(ddp.parameters(), {.lr = 0.3});
  optim::SGD ref_opt(reference.parameters(), {.lr = 0.3});
  for (int step = 0; step < 3; ++step) {
    auto out = ddp(ids.narrow(0, r * per, per));
    opt.zero_grad();
    ((out * out).sum() * (1.0 / per)).backward();  // DDP averages the ranks' gradients
    opt.step();
    auto ref = reference.forward(ids);
    ref_opt.zero_grad();
    ((ref * ref).sum() * (1.0 / batch)).backward();
    ref_opt.step();
  }
  auto& m = ddp.module();
  EXPECT_EQ(m.head->weight.impl(), m.emb->weight.impl());
  const auto got = m.emb->weight.to_vector(), want = reference.emb->weight.to_vector();
  for (std::size_t k = 0; k < got.size(); ++k) ASSERT_NEAR(got[k], want[k], 1e-12) << "element " << k << " on rank " << r;
  m.head->weight = m.emb->weight.detach().clone().requires_grad_();
  EXPECT_TRUE(throws_with([&] { ddp(ids); }, {"DistributedDataParallel: 'head.weight' is not the tensor it was"}));
}

// amp::GradScaler under DDP (Note [loss scaling]): an inf in the last rank's slice only reaches
// every rank's gradients through the all-reduce, so every rank skips exactly those steps, and
// the result equals one process that steps on the good batches only.
TEST(Ddp, GradScalerSkipsTheSameStepsOnEveryRank) {
  const int w = pg().world_size(), r = pg().rank();
  const int batch = 24, per = batch / w;
  const std::set<int> bad = {1, 4};
  manual_seed(1);
  Mlp<double> reference(5, 16, 3);
  manual_seed(1);  // rank 0's weights (DDP broadcasts them) are the reference's
  DistributedDataParallel<Mlp<double>> ddp(Mlp<double>(5, 16, 3));
  optim::SGD opt(ddp.parameters(), {.lr = 0.05, .momentum = 0.9});
  optim::SGD ref_opt(reference.parameters(), {.lr = 0.05, .momentum = 0.9});
  amp::GradScaler scaler({.init_scale = 256.0, .growth_interval = 2});
  for (int step = 0; step < 6; ++step) {
    manual_seed(50 + step);
    auto x = randn<double>({batch, 5});
    auto y = randn<double>({batch, 3});
    if (bad.count(step)) {  // one element of the last rank's slice
      auto v = x.to_vector();
      v[static_cast<std::size_t>((batch - 1) * 5)] = std::numeric_limits<double>::infinity();
      x = from_vector<double>(v, {batch, 5});
    }
    opt.zero_grad();
    scaler.scale(nn::functional::mse_loss(ddp(x.narrow(0, r * per, per)), y.narrow(0, r * per, per))).backward();
    EXPECT_EQ(scaler.step(opt), !bad.count(step)) << "step " << step << " on rank " << r;
    scaler.update();
    if (!bad.count(step)) {
      ref_opt.zero_grad();
      nn::functional::mse_loss(reference.forward(x), y).backward();
      ref_opt.step();
    }
  }
  auto got = values<double>(ddp.parameters()), want = values<double>(reference.parameters());
  for (std::size_t i = 0; i < got.size(); ++i)
    for (std::size_t k = 0; k < got[i].size(); ++k)
      ASSERT_NEAR(got[i][k], want[i][k], 1e-10) << "parameter " << i << " element " << k << " on rank " << r;
}

TEST(Ddp, BucketsFollowReverseOrderThenTheObservedOrder) {
  manual_seed(3);
  DistributedDataParallel<Mlp<double>> ddp(Mlp<double>(5, 16, 3), {.bucket_cap_bytes = 1000, .first_bucket_bytes = 100});
  auto before = ddp.bucket_names();
  ASSERT_GE(before.size(), 3u);
  EXPECT_EQ(before.front().front(), "fc3.bias");  // reverse registration order
  EXPECT_EQ(before.back().back(), "fc1.weight");
  EXPECT_FALSE(ddp.buckets_rebuilt());
  auto x = randn<double>({4, 5});
  for (int step = 0; step < 2; ++step) {
    auto loss = sum(ddp(x));
    ddp.zero_grad();
    loss.backward();
  }
  EXPECT_TRUE(ddp.buckets_rebuilt());
  // Every bucket but the last started reducing while backward was still producing gradients.
  EXPECT_EQ(ddp.buckets_started_early(), ddp.bucket_names().size() - 1);
  std::set<std::string> names;
  for (auto& b : ddp.bucket_names())
    for (auto& n : b) names.insert(n);
  EXPECT_EQ(names.size(), 6u);
  // The first bucket holds the last layer's gradients, which backward produces first.
  EXPECT_EQ(ddp.bucket_names().front().front().substr(0, 3), "fc3");
}

TYPED_TEST(Ddp, NoSyncAccumulationEqualsTheLargeBatchStep) {
  using T = TypeParam;
  const int w = pg().world_size(), r = pg().rank();
  const int micro = 3, rows = 4;  // each rank: 3 micro-batches of 4 rows
  manual_seed(11);
  auto x = randn<T>({w * micro * rows, 5});
  auto y = randn<T>({w * micro * rows, 3});
  manual_seed(2);
  Mlp<T> reference(5, 8, 3);
  manual_seed(2);
  DistributedDataParallel<Mlp<T>> ddp(Mlp<T>(5, 8, 3));
  ddp.zero_grad();
  for (int m = 0; m < micro; ++m) {
    const auto start = (r * micro + m) * rows;
    auto step = [&] {
      auto loss = nn::functional::mse_loss(ddp(x.narrow(0, start, rows)), y.narrow(0, start, rows)) *
                  full<T>({}, T(1) / T(micro));
      loss.backward();
    };
    if (m + 1 < micro) {
      auto guard = ddp.no_sync();
      step();
    } else {
      step();
    }
  }
  auto ref_loss = nn::functional::mse_loss(reference.forward(x), y);
  ref_loss.backward();
  auto ps = ddp.parameters(), rs = reference.parameters();
  for (std::size_t i = 0; i < ps.size(); ++i) {
    auto g = ps[i].template as<T>().grad().to_vector(), want = rs[i].template as<T>().grad().to_vector();
    for (std::size_t k = 0; k < g.size(); ++k) ASSERT_NEAR(g[k], want[k], tol<T>()) << "parameter " << i;
  }
}

TEST(Ddp, UnusedParameterIsNamed) {
  manual_seed(5);
  DistributedDataParallel<WithUnused<double>> ddp(WithUnused<double>{});
  auto loss = sum(ddp(randn<double>({3, 4})));
  try {
    loss.backward();
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'unused.weight'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("'unused.bias'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("find_unused_parameters"), std::string::npos) << msg;
  }
}

TEST(Ddp, FindUnusedParametersReducesTheRest) {
  const int w = pg().world_size(), r = pg().rank();
  manual_seed(5);
  auto x = randn<double>({2 * w, 4});
  manual_seed(6);
  WithUnused<double> reference;
  manual_seed(6);
  DistributedDataParallel<WithUnused<double>> ddp(WithUnused<double>{}, {.find_unused_parameters = true});
  for (int step = 0; step < 2; ++step) {  // the second step uses the rebuilt buckets
    ddp.zero_grad();
    reference.zero_grad();
    sum(ddp(x.narrow(0, 2 * r, 2))).backward();
    (sum(reference.forward(x)) * full<double>({}, 1.0 / w)).backward();
    auto& m = ddp.module();
    EXPECT_FALSE(m.unused->weight.grad().defined());  // no rank used it: untouched
    auto g = m.fc1->weight.grad().to_vector(), want = reference.fc1->weight.grad().to_vector();
    for (std::size_t k = 0; k < g.size(); ++k) ASSERT_NEAR(g[k], want[k], 1e-10);
  }
}

TEST(Ddp, MismatchedModelsAreRefused) {
  if (pg().world_size() == 1) GTEST_SKIP() << "needs two ranks";
  const int r = pg().rank();
  try {
    DistributedDataParallel<Mlp<float>> ddp(Mlp<float>(5, r == 1 ? 9 : 8, 3));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'fc1.weight'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("[8, 5]"), std::string::npos) << msg;
    EXPECT_NE(msg.find("[9, 5]"), std::string::npos) << msg;
    EXPECT_NE(msg.find("rank 1"), std::string::npos) << msg;
  }
  pg().barrier();  // the group is still usable
}

TEST(Ddp, RankZeroSavesThePlainModuleFile) {
  manual_seed(4);
  DistributedDataParallel<Mlp<float>> ddp(Mlp<float>(5, 8, 3));
  const auto dir = std::filesystem::temp_directory_path() / ("chorus_ddp_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  if (pg().rank() == 0) {
    save(ddp, (dir / "ddp.safetensors").string());
    save(ddp.module(), (dir / "plain.safetensors").string());
    auto read = [](const std::filesystem::path& p) {
      std::ifstream f(p, std::ios::binary);
      return std::string(std::istreambuf_iterator<char>(f), {});
    };
    const auto a = read(dir / "ddp.safetensors"), b = read(dir / "plain.safetensors");
    EXPECT_EQ(a, b);
    EXPECT_NE(a.find("\"fc1.weight\""), std::string::npos);
    Mlp<float> fresh(5, 8, 3);
    load(fresh, (dir / "ddp.safetensors").string());
    EXPECT_EQ(values<float>(fresh.parameters()), values<float>(ddp.parameters()));
  }
  std::filesystem::remove_all(dir);
}

TEST(Ddp, BuffersComeFromRankZero) {
  struct WithBuffer : nn::Module {
    nn::LinearT<double> fc;
    Tensor<double> count;
    WithBuffer(double c)
        : fc(register_module("fc", nn::LinearT<double>(2, 2))), count(register_buffer("count", full<double>({1}, c))) {}
    Tensor<double> forward(const Tensor<double>& x) { return fc(x); }
  };
  DistributedDataParallel<WithBuffer> ddp(WithBuffer(pg().rank() + 1.0));
  EXPECT_EQ(ddp.module().count.to_vector()[0], 1.0);
  ddp.module().count.fill_(10.0 + pg().rank());
  (void)ddp(zeros<double>({1, 2}));  // broadcast_buffers: rank 0's again
  EXPECT_EQ(ddp.module().count.to_vector()[0], 10.0);
}

// ---- DistributedSampler ----

TEST(DistributedSampler, RanksCoverTheDatasetOncePerEpoch) {
  const int w = pg().world_size(), r = pg().rank();
  for (std::size_t n : {std::size_t(24), std::size_t(25), std::size_t(3)}) {
    data::DistributedSampler sampler(n, w, r, {.shuffle = true, .seed = 42});
    std::vector<std::int64_t> previous;
    for (std::uint64_t epoch = 0; epoch < 3; ++epoch) {
      sampler.set_epoch(epoch);
      std::vector<std::int64_t> mine;
      for (auto i : sampler.indices()) mine.push_back(static_cast<std::int64_t>(i));
      ASSERT_EQ(mine.size(), sampler.size());
      auto all = concat(gather_all(mine));
      ASSERT_EQ(all.size(), sampler.total_size());
      std::vector<int> count(n, 0);
      for (auto i : all) ++count[static_cast<std::size_t>(i)];
      int extra = 0;
      for (std::size_t i = 0; i < n; ++i) {
        ASSERT_GE(count[i], 1) << "index " << i << " missed in epoch " << epoch << " (n = " << n << ")";
        extra += count[i] - 1;
      }
      EXPECT_EQ(static_cast<std::size_t>(extra), sampler.total_size() - n);  // only the padding repeats
      if (epoch > 0 && n > 3) {
        EXPECT_NE(all, previous) << "set_epoch must reshuffle";
      }
      previous = all;
    }
  }
}

TEST(DistributedSampler, WorksWithDataLoader) {
  const int w = pg().world_size(), r = pg().rank();
  const int n = 20;
  std::vector<float> ids(n);
  std::iota(ids.begin(), ids.end(), 0.0f);
  data::TensorDataset<float, float> ds(from_vector(ids).view({n, 1}), from_vector(ids).view({n, 1}));
  auto sampler = std::make_shared<data::DistributedSampler>(ds.size(), w, r,
                                                            data::DistributedSamplerOptions{.seed = 1, .drop_last = true});
  data::DataLoader loader(ds, {.batch_size = 2}, sampler);
  std::vector<std::int64_t> seen;
  for (auto b : loader)
    for (auto v : b.data.to_vector()) seen.push_back(static_cast<std::int64_t>(v));
  std::vector<std::int64_t> want;
  for (auto i : sampler->indices()) want.push_back(static_cast<std::int64_t>(i));
  EXPECT_EQ(seen, want);
  auto all = concat(gather_all(seen));
  std::set<std::int64_t> distinct(all.begin(), all.end());
  EXPECT_EQ(distinct.size(), all.size());  // drop_last: no repeats
  EXPECT_EQ(all.size(), static_cast<std::size_t>(n / w * w));
}

// ---- Issue 16: DistributedSampler(dataset) takes num_replicas and rank from the default group ----

TEST(DistributedSamplerFromGroup, EqualsTheExplicitOneAndFeedsTheLoader) {
  const int w = pg().world_size(), r = pg().rank();
  const std::int64_t n = 23;
  data::TensorDataset<float, float> ds(arange<float>(n).view({n, 1}), zeros<float>({n, 1}));
  auto from_group = std::make_shared<data::DistributedSampler>(ds, data::DistributedSamplerOptions{.seed = 9});
  const data::DistributedSampler explicit_one(ds.size(), w, r, {.seed = 9});
  EXPECT_EQ(from_group->num_replicas(), w);
  EXPECT_EQ(from_group->rank(), r);
  data::DataLoader loader(ds, {.batch_size = 3, .num_workers = 2}, from_group);
  for (std::uint64_t epoch = 0; epoch < 2; ++epoch) {
    from_group->set_epoch(epoch);  // PyTorch's loop: the shared sampler, stepped by the caller
    data::DistributedSampler expected = explicit_one;
    expected.set_epoch(epoch);
    std::vector<std::int64_t> seen, want;
    for (const auto& b : loader)
      for (float v : b.data.to_vector()) seen.push_back(static_cast<std::int64_t>(v));
    for (auto i : expected.indices()) want.push_back(static_cast<std::int64_t>(i));
    EXPECT_EQ(seen, want) << "epoch " << epoch;
    auto all = concat(gather_all(seen));  // the ranks together: every index, padding aside
    std::set<std::int64_t> distinct(all.begin(), all.end());
    EXPECT_EQ(distinct.size(), static_cast<std::size_t>(n)) << "epoch " << epoch;
  }
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  auto& g = dist::init();
  if (g.rank() != 0) {  // one report: rank 0's (the others fail the job through their exit code)
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  const int rc = RUN_ALL_TESTS();
  std::printf("rank %d of %d: %s\n", g.rank(), g.world_size(), rc == 0 ? "passed" : "FAILED");
  return rc;
}
