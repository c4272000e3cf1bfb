// Virtual CPU devices: device counts, streams (worker threads), events, per-device memory.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <sstream>
#include <thread>

#include "test_util.hpp"

using namespace chorus;
using chorus::testing::throws_with;

TEST(Devices, CountComesFromTheApiAndAvailableDevicesListsThem) {
  set_cpu_device_count(3);
  EXPECT_EQ(cpu_device_count(), 3);
  if (cuda_device_count() == 0) {
    EXPECT_EQ(available_devices(), (std::vector<Device>{Device::cpu(0), Device::cpu(1), Device::cpu(2)}));
  }
  EXPECT_TRUE(throws_with([] { check_device(Device::cpu(3)); }, {"cpu:3", "3 virtual CPU devices"}));
  EXPECT_TRUE(throws_with([] { set_cpu_device_count(0); }, {"[1, 256]"}));
  if (!kCudaEnabled) {
    EXPECT_TRUE(throws_with([] { zeros<float>({1}, Device::cuda(0)); }, {"cuda:0", "without CUDA"}));
  }
}

TEST(Devices, StreamsRunInOrderOnTheirOwnThread) {
  set_cpu_device_count(2);
  Stream& s = get_stream(Device::cpu(1));
  std::vector<int> order;
  std::thread::id worker;
  for (int i = 0; i < 100; ++i) s.post([&, i] { order.push_back(i); worker = std::this_thread::get_id(); });
  s.synchronize();
  ASSERT_EQ(order.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(order[i], i);
  EXPECT_NE(worker, std::this_thread::get_id());
  EXPECT_EQ(s.async([] { return 41 + 1; }).get(), 42);
  auto f = s.async([]() -> int { CHORUS_FAIL("inside the worker"); });
  EXPECT_TRUE(throws_with([&] { f.get(); }, {"inside the worker"}));
  EXPECT_TRUE(s.async([&] { return s.is_worker_thread() && &current_stream(Device::cpu(1)) == &s; }).get());
  EXPECT_FALSE(s.is_worker_thread());
  // Distinct slots are distinct streams with distinct threads.
  Stream& s2 = get_stream(Device::cpu(1), 1);
  EXPECT_NE(&s2, &s);
  EXPECT_NE(s2.async([] { return std::this_thread::get_id(); }).get(), worker);
}

TEST(Devices, AnExceptionEscapingAPostedTaskIsRethrownBySynchronize) {
  Stream& s = get_stream(Device::cpu(0), 3);
  s.post([] { CHORUS_FAIL("lost?"); });
  EXPECT_TRUE(throws_with([&] { s.synchronize(); }, {"lost?"}));
  s.synchronize();  // reported once
}

TEST(Devices, EventsOrderWorkBetweenStreams) {
  set_cpu_device_count(2);
  Stream& a = get_stream(Device::cpu(0), 1);
  Stream& b = get_stream(Device::cpu(1), 1);
  std::atomic<int> stage{0};
  a.post([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    stage = 1;
  });
  Event e;
  e.record(a);
  e.block(b);  // b's next task waits for a's work
  auto seen = b.async([&] { return stage.load(); });
  EXPECT_EQ(seen.get(), 1);
  e.synchronize();
  EXPECT_TRUE(e.query());
  Event never;
  EXPECT_TRUE(never.query());
}

TEST(Devices, AllocationsAreCountedPerDevice) {
  set_cpu_device_count(2);
  auto d1 = memory_stats(Device::cpu(1));
  auto d0 = memory_stats(Device::cpu(0));
  {
    auto t = zeros<double>({1000}, Device::cpu(1));
    auto s = memory_stats(Device::cpu(1));
    EXPECT_EQ(s.allocated, d1.allocated + 8000);
    EXPECT_GE(s.peak_allocated, s.allocated);
    EXPECT_EQ(memory_stats(Device::cpu(0)).allocated, d0.allocated);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(t.data()) % 64, 0u);
  }
  EXPECT_EQ(memory_stats(Device::cpu(1)).allocated, d1.allocated);
}

// Issue 10, item 12: println writes whole lines, also from the replicas' worker threads at once
// (under ThreadSanitizer, an unlocked write to the shared stream is reported as a race).
// Note [host aliases]: an alias is memory of another CPU device over the same bytes; it shares
// the version counter, keeps the owner alive, and never joins other kinds of memory.
TEST(Devices, HostAliasesShareMemoryAndVersionAndKeepTheOwnerAlive) {
  set_cpu_device_count(std::max(cpu_device_count(), 2));
  Storage alias;
  Storage base = make_storage(Device::cpu(0), 64);
  static_cast<float*>(base->data())[3] = 2.5f;
  alias = make_alias_storage(Device::cpu(1), base, 12, 8);
  EXPECT_TRUE(alias->is_alias());
  EXPECT_EQ(alias->device(), Device::cpu(1));
  EXPECT_EQ(alias->nbytes(), 8u);
  EXPECT_EQ(static_cast<float*>(alias->data())[0], 2.5f);
  base->bump_version();
  EXPECT_EQ(alias->version(), base->version());
  alias->bump_version();
  EXPECT_EQ(base->version(), 2u);
  auto alias2 = make_alias_storage(Device::cpu(0), alias, 4, 4);  // an alias of an alias
  const auto allocated = memory_stats(Device::cpu(0)).allocated;
  base.reset();  // the aliases keep the memory
  EXPECT_EQ(memory_stats(Device::cpu(0)).allocated, allocated);
  EXPECT_EQ(alias2->version(), 2u);
  static_cast<float*>(alias2->data())[0] = 7.0f;
  EXPECT_EQ(static_cast<float*>(alias->data())[1], 7.0f);
  alias.reset();
  alias2.reset();
  EXPECT_EQ(memory_stats(Device::cpu(0)).allocated, allocated - 64);
  auto owner = make_storage(Device::cpu(0), 16);
  EXPECT_TRUE(throws_with([&] { make_alias_storage(Device::cpu(1), owner, 8, 12); }, {"of a 16-byte storage"}));
  EXPECT_TRUE(throws_with([&] { make_alias_storage(Device::cpu(1), nullptr, 0, 0); }, {"alias of a null storage"}));
}

// Note [idle workers help]: a large elementwise loop shares its range with a lent, idle CPU
// worker (every index exactly once, some on the worker); a worker that is not lent, or busy, is
// never borrowed; small loops stay on the caller.
TEST(Devices, LargeLoopsShareTheirRangeWithALentIdleWorker) {
  set_cpu_device_count(std::max(cpu_device_count(), 4));
  Stream& s3 = get_stream(Device::cpu(3));  // a device no other test here lends
  std::thread::id worker;
  s3.async([&] { worker = std::this_thread::get_id(); }).get();
  const std::int64_t n = 40 * backend::cpu::kParallelGrain;
  // Runs a large loop; with `wait_for_helper` the caller's chunks wait (at most 2 s) until the
  // worker has taken one, so that a lent worker surely gets some however slowly it wakes.
  auto run = [&](bool wait_for_helper) {
    std::atomic<int> on_worker{0};
    std::vector<std::uint8_t> hits(static_cast<std::size_t>(n), 0);
    backend::cpu::parallel_for(n, [&](std::int64_t b, std::int64_t e) {
      if (std::this_thread::get_id() == worker) ++on_worker;
      else
        for (int i = 0; wait_for_helper && i < 2000 && on_worker.load() == 0; ++i)
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
      for (std::int64_t i = b; i < e; ++i) ++hits[static_cast<std::size_t>(i)];
    });
    EXPECT_TRUE(std::all_of(hits.begin(), hits.end(), [](std::uint8_t h) { return h == 1; }));
    return on_worker.load();
  };
  EXPECT_FALSE(s3.idle_and_lent());  // never lent: the caller does it all
  EXPECT_EQ(run(false), 0);
  s3.lend_until(std::chrono::steady_clock::now() + std::chrono::seconds(60));
  for (int i = 0; i < 2000 && !s3.idle_and_lent(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_TRUE(s3.idle_and_lent());
  std::atomic<int> small{0};  // a small loop is never shared
  backend::cpu::parallel_for(backend::cpu::kParallelGrain, [&](std::int64_t, std::int64_t) {
    small += std::this_thread::get_id() == worker;
  });
  EXPECT_EQ(small.load(), 0);
  EXPECT_GT(run(true), 0);  // lent and idle: shared
  std::atomic<bool> release{false};  // busy: not idle, not borrowed
  s3.post([&] {
    while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  for (int i = 0; i < 2000 && s3.idle_and_lent(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_FALSE(s3.idle_and_lent());
  EXPECT_EQ(run(false), 0);
  release = true;
  s3.synchronize();
}

TEST(Println, LinesFromConcurrentWorkersNeverInterleave) {
  set_cpu_device_count(std::max(cpu_device_count(), 4));
  std::ostringstream out;
  constexpr int kLines = 200;
  std::vector<Future<void>> done;
  for (int d = 0; d < 4; ++d)
    done.push_back(get_stream(Device::cpu(d), 7).async([&out, d] {
      for (int i = 0; i < kLines; ++i) println(out, "replica ", d, " line ", i, " shape ", Shape{d, i});
    }));
  for (auto& f : done) f.get();
  std::istringstream in(out.str());
  std::string line;
  std::vector<int> next(4, 0);
  int n = 0;
  while (std::getline(in, line)) {
    int d = -1, i = -1;
    ASSERT_EQ(std::sscanf(line.c_str(), "replica %d line %d", &d, &i), 2) << line;
    ASSERT_TRUE(d >= 0 && d < 4) << line;
    EXPECT_EQ(i, next[d]++) << line;  // each thread's lines whole and in its order
    EXPECT_EQ(line, "replica " + std::to_string(d) + " line " + std::to_string(i) + " shape [" + std::to_string(d) +
                        ", " + std::to_string(i) + "]");
    ++n;
  }
  EXPECT_EQ(n, 4 * kLines);
  std::ostringstream empty;
  println(empty);
  EXPECT_EQ(empty.str(), "\n");
}

// Issue 10, item 22 (Note [worker spin]): a worker kept hot for a step in flight still runs
// every task in order, and a stream destroyed in the middle of a (long) hot window stops at
// once instead of spinning to its end.
TEST(Devices, AHotWorkerRunsTasksInOrderAndStopsWhenDestroyed) {
  auto stream = std::make_unique<Stream>(Device::cpu(0), 61);
  std::vector<int> order;
  stream->post([&] { order.push_back(0); });
  stream->keep_hot_until(std::chrono::steady_clock::now() + std::chrono::hours(1));
  stream->keep_hot_until(std::chrono::steady_clock::now());  // an earlier time never shortens it
  for (int i = 1; i <= 50; ++i) {
    stream->post([&order, i] { order.push_back(i); });
    if (i % 10 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));  // gaps the worker spins through
  }
  EXPECT_EQ(stream->async([&] { return order.size(); }).get(), 51u);
  for (int i = 0; i <= 50; ++i) EXPECT_EQ(order[static_cast<std::size_t>(i)], i);
  stream.reset();  // with an hour left in the window: returns promptly, or the test times out
  SUCCEED();
}

// Note [storage slices]: a slice is memory of its block's device (any kind) with a version
// counter of its own; it keeps the block alive; a host alias of a slice shares the slice's
// counter. storage_unshared follows the owners.
TEST(Devices, SlicesCountTheirOwnVersionsAndKeepTheirBlockAlive) {
  set_cpu_device_count(std::max(cpu_device_count(), 2));
  Storage block = make_storage(Device::cpu(1), 64);
  static_cast<float*>(block->data())[5] = 3.5f;
  auto a = make_slice_storage(block, 16, 16), b = make_slice_storage(block, 32, 16);
  EXPECT_EQ(a->device(), Device::cpu(1));
  EXPECT_FALSE(a->is_alias());
  EXPECT_EQ(a->memory_owner()->get(), block.get());
  EXPECT_EQ(static_cast<float*>(a->data())[1], 3.5f);
  a->bump_version();
  EXPECT_EQ(a->version(), 1u);
  EXPECT_EQ(b->version(), 0u);
  EXPECT_EQ(block->version(), 0u);
  auto alias = make_alias_storage(Device::cpu(0), a, 0, 16);  // a replica's view of a parameter
  EXPECT_EQ(alias->memory_owner()->get(), a.get());
  alias->bump_version();
  EXPECT_EQ(a->version(), 2u);
  EXPECT_EQ(b->version(), 0u);
  EXPECT_FALSE(storage_unshared(a));      // the alias holds it
  EXPECT_FALSE(storage_unshared(alias));  // a is held by its own handle too
  const auto allocated = memory_stats(Device::cpu(1)).allocated;
  block.reset();
  b.reset();
  EXPECT_EQ(memory_stats(Device::cpu(1)).allocated, allocated);  // a keeps the block
  a.reset();
  EXPECT_TRUE(storage_unshared(alias));  // now nothing else sees the memory
  static_cast<float*>(alias->data())[0] = 1.0f;
  alias.reset();
  EXPECT_EQ(memory_stats(Device::cpu(1)).allocated, allocated - 64);
  auto owner = make_storage(Device::cpu(0), 16);
  EXPECT_TRUE(throws_with([&] { make_slice_storage(owner, 8, 12); }, {"of a 16-byte storage"}));
  EXPECT_TRUE(throws_with([&] { make_slice_storage(nullptr, 0, 0); }, {"slice of a null storage"}));
}
