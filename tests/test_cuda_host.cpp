// The CUDA backend's host-side decisions, checked with g++ on any machine (no GPU, no CUDA
// headers): cuBLASLt alignment rules and plan-cache key, cuDNN's algorithm and math-type choice,
// checked narrowing to int, the allocators' bookkeeping (which device each using stream belongs
// to, the host-side cache of freed device blocks, pinned blocks that wait for their copies), and
// device-side validation (its messages, and the order in which a check clears and re-arms).
#include <gtest/gtest.h>

#include <chorus/backend/cuda/host_policy.hpp>
#include <chorus/core/block_table.hpp>
#include <chorus/core/device_assert.hpp>
#include <algorithm>
#include <climits>
#include <string>
#include <unordered_set>
#include <vector>

#include "test_util.hpp"

using namespace chorus;
using chorus::testing::throws_with;
namespace bc = chorus::backend::cuda;

TEST(CudaHostPolicy, LtAlignmentIsTheLargestPowerOfTwoUpTo256) {
  EXPECT_EQ(bc::lt_alignment(0), 256u);
  EXPECT_EQ(bc::lt_alignment(0x7f0000000000), 256u);
  EXPECT_EQ(bc::lt_alignment(0x7f0000000000 + 512), 256u);
  EXPECT_EQ(bc::lt_alignment(0x7f0000000000 + 128), 128u);
  EXPECT_EQ(bc::lt_alignment(0x7f0000000000 + 40), 8u);  // Linear(5, 2)'s bias at raw offset 10 floats
  EXPECT_EQ(bc::lt_alignment(0x7f0000000000 + 4), 4u);
  EXPECT_EQ(bc::lt_alignment(0x7f0000000000 + 2), 2u);
  EXPECT_EQ(bc::lt_alignment(0x7f0000000000 + 1), 1u);
  for (std::uintptr_t a = 1; a < 4096; ++a) {
    const auto al = bc::lt_alignment(a);
    ASSERT_EQ(a % al, 0u) << a;
    ASSERT_TRUE(al == 256 || a % (2 * al) != 0) << a << " could be " << 2 * al << "-byte aligned";
  }
}

TEST(CudaHostPolicy, TheBiasEpilogueNeedsA16ByteAlignedBiasAndSeveralRows) {
  EXPECT_TRUE(bc::lt_bias_epilogue_ok(0x1000, 30));
  EXPECT_TRUE(bc::lt_bias_epilogue_ok(0x1010, 2));
  EXPECT_FALSE(bc::lt_bias_epilogue_ok(0x1000 + 40, 30));  // the unpadded flat layout's bias
  EXPECT_FALSE(bc::lt_bias_epilogue_ok(0x1008, 30));
  EXPECT_FALSE(bc::lt_bias_epilogue_ok(0x1000, 1));
}

TEST(CudaHostPolicy, ThePlanCacheKeySeparatesEveryField) {
  bc::LtKey base;
  base.device = 0;
  base.m = 30;
  base.n = 2;
  base.k = 5;
  base.dtype = 0;
  base.tf32 = false;
  base.align_a = base.align_b = base.align_c = base.align_d = 256;
  base.epilogue = 1;
  std::vector<bc::LtKey> keys{base};
  auto vary = [&](auto change) {
    bc::LtKey k = base;
    change(k);
    keys.push_back(k);
  };
  vary([](bc::LtKey& k) { k.device = 1; });
  vary([](bc::LtKey& k) { k.m = 31; });
  vary([](bc::LtKey& k) { k.n = 3; });
  vary([](bc::LtKey& k) { k.k = 6; });
  vary([](bc::LtKey& k) { k.dtype = 1; });
  vary([](bc::LtKey& k) { k.tf32 = true; });
  vary([](bc::LtKey& k) { k.align_a = 8; });
  vary([](bc::LtKey& k) { k.align_b = 8; });
  vary([](bc::LtKey& k) { k.align_c = 8; });
  vary([](bc::LtKey& k) { k.align_d = 8; });
  vary([](bc::LtKey& k) { k.epilogue = 0; });
  vary([](bc::LtKey& k) { std::swap(k.m, k.n); });
  std::unordered_set<bc::LtKey, bc::LtKeyHash> set(keys.begin(), keys.end());
  EXPECT_EQ(set.size(), keys.size()) << "two different plans would share a cache entry";
  for (std::size_t i = 0; i < keys.size(); ++i)
    for (std::size_t j = 0; j < keys.size(); ++j) EXPECT_EQ(keys[i] == keys[j], i == j) << i << ", " << j;
  bc::LtKey same = base;
  EXPECT_EQ(bc::LtKeyHash{}(same), bc::LtKeyHash{}(base));
  EXPECT_TRUE(set.count(same));
}

TEST(CudaHostPolicy, NarrowingToIntIsChecked) {
  EXPECT_EQ(bc::checked_int(0, "n"), 0);
  EXPECT_EQ(bc::checked_int(INT_MAX, "n"), INT_MAX);
  EXPECT_EQ(bc::checked_int(INT_MIN, "n"), INT_MIN);
  EXPECT_TRUE(throws_with([] { bc::checked_int(std::int64_t{INT_MAX} + 1, "rows"); }, {"rows", "2147483648", "int"}));
  EXPECT_TRUE(throws_with([] { bc::checked_int(std::int64_t{1} << 40, "ldc"); }, {"ldc", "1099511627776"}));
}

TEST(CudaHostPolicy, StreamUsesRememberTheDeviceOfEachStream) {
  // Note [cross-device stream uses]: the block lives on device 0; a stream of device 1 (a peer
  // copy's destination stream) reads it. The free must record its event under device 1.
  detail::BlockTable<int> t;
  t.add(0x1000, /*stream=*/10, 256);
  t.add(0x2000, /*stream=*/10, 64);
  EXPECT_TRUE(t.record(0x1000 + 40, /*stream=*/21, /*device=*/1));  // interior address
  EXPECT_TRUE(t.record(0x1000, 21, 1));                              // the same use: once
  EXPECT_TRUE(t.record(0x1000, 10, 0));                              // its own stream: not a use
  EXPECT_TRUE(t.record(0x10ff, 22, 0));                              // another stream of device 0
  EXPECT_FALSE(t.record(0x1100, 23, 2));                             // past the end: no block
  EXPECT_FALSE(t.record(0x0fff, 23, 2));                             // before the first block
  auto b = t.take(0x1000);
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(b->stream, 10);
  EXPECT_EQ(b->size, 256u);
  ASSERT_EQ(b->used_on.size(), 2u);
  EXPECT_EQ(b->used_on[0].stream, 21);
  EXPECT_EQ(b->used_on[0].device, 1);
  EXPECT_EQ(b->used_on[1].stream, 22);
  EXPECT_EQ(b->used_on[1].device, 0);
  EXPECT_FALSE(t.take(0x1000).has_value());
  EXPECT_EQ(t.size(), 1u);
  // The same stream handle value on two devices is two uses.
  EXPECT_TRUE(t.record(0x2000, 30, 0));
  EXPECT_TRUE(t.record(0x2000, 30, 1));
  EXPECT_EQ(t.take(0x2000)->used_on.size(), 2u);
}

TEST(CudaHostPolicy, DeviceAssertMessagesNameTheValues) {
  detail::DeviceAssert a;
  EXPECT_EQ(detail::describe(a, "cuda:0"), "");
  a.code = detail::kAssertCrossEntropyTarget;
  a.value = 12;
  a.index = 1;
  a.bound = 10;
  auto m = detail::describe(a, "cuda:3");
  for (const char* part : {"cross_entropy", "target 12", "index 1", "10 classes", "cuda:3"})
    EXPECT_NE(m.find(part), std::string::npos) << part << " not in: " << m;
  a.code = detail::kAssertNllTarget;
  EXPECT_NE(detail::describe(a, "cuda:0").find("nll_loss: target 12"), std::string::npos);
  a.code = detail::kAssertIndexSelect;
  a.value = -1;
  a.index = 2;
  a.bound = 6;
  a.extra = 1;
  m = detail::describe(a, "cuda:0");
  for (const char* part : {"index_select", "index -1", "position 2", "dimension 1", "size 6"})
    EXPECT_NE(m.find(part), std::string::npos) << part << " not in: " << m;
}

namespace {
/// What a kernel's device_assert does (kernels.cuh), on the host: claim the guard, fill the
/// record, publish the code last.
bool fake_kernel_report(int& guard, detail::DeviceAssert& r, int code, std::int64_t value) {
  if (guard != 0) return false;  // another report holds the record: skip
  guard = 1;
  r.value = value;
  r.index = 0;
  r.bound = 10;
  r.code = code;
  return true;
}
}  // namespace

TEST(CudaHostPolicy, ADeviceAssertCheckReportsEveryDeviceWithASink) {
  // Note [device-side validation]: a loop that only synchronises cuda:0 (loss.item()) must also
  // hear of a bad target found by a replica's kernel on cuda:1.
  detail::DeviceAssert records[64];
  int guards[64] = {};
  ASSERT_TRUE(fake_kernel_report(guards[1], records[1], detail::kAssertCrossEntropyTarget, 12));
  ASSERT_TRUE(fake_kernel_report(guards[3], records[3], detail::kAssertNllTarget, 7));
  ASSERT_TRUE(fake_kernel_report(guards[5], records[5], detail::kAssertNllTarget, 9));  // no sink given there
  std::vector<int> rearmed;
  const std::uint64_t with_sinks = (1u << 0) | (1u << 1) | (1u << 3);
  const auto msg = detail::take_device_asserts(records, with_sinks, [&](int d) {
    rearmed.push_back(d);
    guards[d] = 0;
  });
  EXPECT_NE(msg.find("cross_entropy: target 12"), std::string::npos) << msg;
  EXPECT_NE(msg.find("cuda:1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("nll_loss: target 7"), std::string::npos) << msg;
  EXPECT_NE(msg.find("cuda:3"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("target 9"), std::string::npos) << "a device outside the mask was read: " << msg;
  EXPECT_EQ(rearmed, (std::vector<int>{1, 3}));
  EXPECT_EQ(records[1].code, detail::kAssertNone);
  EXPECT_EQ(records[3].code, detail::kAssertNone);
  EXPECT_EQ(detail::take_device_asserts(records, with_sinks, [](int) { FAIL() << "nothing to re-arm"; }), "");
}

TEST(CudaHostPolicy, ADeviceAssertRecordIsClearedBeforeItsGuardIsReArmed) {
  // Note [re-arming device-side validation]: a kernel that runs as soon as the guard is reset
  // (another stream's bad index) must keep its report. Cleared after re-arming, the record
  // would lose it while the guard stays claimed, and no bad index would be reported again.
  detail::DeviceAssert records[64];
  int guards[64] = {};
  ASSERT_TRUE(fake_kernel_report(guards[0], records[0], detail::kAssertIndexSelect, 5));
  bool cleared_first = false;
  auto msg = detail::take_device_asserts(records, 1u, [&](int d) {
    cleared_first = records[d].code == detail::kAssertNone;
    guards[d] = 0;
    // The concurrent kernel: it finds the guard armed and reports.
    EXPECT_TRUE(fake_kernel_report(guards[d], records[d], detail::kAssertCrossEntropyTarget, 42));
  });
  EXPECT_TRUE(cleared_first) << "the guard was re-armed while the record still held the old report";
  EXPECT_NE(msg.find("index_select: index 5"), std::string::npos) << msg;
  // The concurrent report survives and is taken by the next check ...
  EXPECT_EQ(records[0].code, detail::kAssertCrossEntropyTarget);
  msg = detail::take_device_asserts(records, 1u, [&](int d) { guards[d] = 0; });
  EXPECT_NE(msg.find("target 42"), std::string::npos) << msg;
  // ... and the device reports again after it.
  EXPECT_TRUE(fake_kernel_report(guards[0], records[0], detail::kAssertNllTarget, 3));
  EXPECT_NE(detail::take_device_asserts(records, 1u, [&](int d) { guards[d] = 0; }).find("target 3"),
            std::string::npos);
}

TEST(CudaHostPolicy, FreedDeviceBlocksAreReusedOnlyBySameStreamAndSize) {
  // Note [CUDA block cache]: reuse without a driver call is safe only in the stream order of
  // the stream the block was freed on.
  using Cache = detail::BlockCache<int>;
  EXPECT_EQ(Cache::round(1), 512u);
  EXPECT_EQ(Cache::round(512), 512u);
  EXPECT_EQ(Cache::round(513), 1024u);
  Cache c;
  int a = 0, b = 0, d = 0;
  c.put(/*stream=*/1, 512, &a);
  c.put(1, 1024, &b);
  c.put(2, 512, &d);
  EXPECT_EQ(c.bytes(), 2048u);
  EXPECT_EQ(c.take(3, 512), nullptr) << "a block of another stream";
  EXPECT_EQ(c.take(1, 1536), nullptr) << "a block of another size";
  EXPECT_EQ(c.take(1, 512), &a);
  EXPECT_EQ(c.take(1, 512), nullptr) << "taken twice";
  EXPECT_EQ(c.bytes(), 1536u);
  std::vector<std::pair<int, void*>> given_back;
  c.drain([&](int s, std::size_t size, void* p) {
    given_back.emplace_back(s, p);
    EXPECT_TRUE((p == &b && size == 1024 && s == 1) || (p == &d && size == 512 && s == 2));
  });
  EXPECT_EQ(given_back.size(), 2u);
  EXPECT_EQ(c.bytes(), 0u);
  EXPECT_EQ(c.take(2, 512), nullptr);

  // Past its limit the cache gives back the largest blocks first, down to what it keeps.
  int small[3], big[2];
  for (int& x : small) c.put(1, 512, &x);
  for (int& x : big) c.put(2, 4096, &x);
  EXPECT_EQ(c.bytes(), 3 * 512u + 2 * 4096u);
  std::vector<void*> freed;
  c.drain([&](int, std::size_t, void* p) { freed.push_back(p); }, /*keep=*/3 * 512 + 4096);
  EXPECT_EQ(freed, (std::vector<void*>{&big[0]}));  // the least recently freed big block
  EXPECT_EQ(c.bytes(), 3 * 512u + 4096u);
  c.drain([&](int, std::size_t, void* p) { freed.push_back(p); }, /*keep=*/1000);
  EXPECT_EQ(freed, (std::vector<void*>{&big[0], &big[1], &small[0], &small[1]}));
  EXPECT_EQ(c.bytes(), 512u);
  EXPECT_EQ(c.take(1, 512), &small[2]);  // what stays is still served
  c.drain([&](int, std::size_t, void* p) { freed.push_back(p); }, /*keep=*/4096);  // under the limit: nothing
  EXPECT_EQ(freed.size(), 4u);
}

TEST(CudaHostPolicy, APinnedBlockIsReusedOnlyAfterTheCopiesThatReadIt) {
  // Note [deferred host frees]: an asynchronous host-to-device copy may still read a batch's
  // pinned block after the batch is dropped.
  struct Ev {
    int id;
  };
  std::vector<int> done, released;
  auto is_done = [&](const Ev& e) { return std::find(done.begin(), done.end(), e.id) != done.end(); };
  auto release = [&](const Ev& e) { released.push_back(e.id); };
  detail::HostBlockPool<Ev> pool;
  alignas(64) static char mem[3][256];
  pool.add(mem[0], 256);
  pool.add(mem[1], 256);
  EXPECT_TRUE(pool.contains(mem[0] + 100));
  EXPECT_FALSE(pool.contains(mem[2]));
  EXPECT_TRUE(pool.record(mem[0] + 128, Ev{1}));  // a copy of the batch's second half (a chunk)
  EXPECT_TRUE(pool.record(mem[0], Ev{2}));        // and one of its first half, to another device
  EXPECT_FALSE(pool.record(mem[2], Ev{3})) << "pageable memory is not the pool's";
  EXPECT_TRUE(pool.free(mem[0]));
  EXPECT_TRUE(pool.free(mem[1]));  // never copied: free at once
  EXPECT_FALSE(pool.free(mem[2]));
  EXPECT_EQ(pool.pending(), 1u);
  EXPECT_EQ(pool.take(256, is_done, release), mem[1]);
  EXPECT_EQ(pool.take(256, is_done, release), nullptr) << "reused while a copy may still read it";
  done.push_back(1);
  EXPECT_EQ(pool.take(256, is_done, release), nullptr) << "reused while the second copy may still read it";
  EXPECT_TRUE(released.empty());
  done.push_back(2);
  EXPECT_EQ(pool.take(128, is_done, release), nullptr) << "another size";
  EXPECT_EQ(pool.pending(), 0u);
  EXPECT_EQ(released, (std::vector<int>{1, 2}));
  EXPECT_EQ(pool.take(256, is_done, release), mem[0]);
  EXPECT_EQ(pool.live(), 2u);
  EXPECT_FALSE(pool.record(mem[1] + 256, Ev{4})) << "one past the end of the last block";
}

TEST(CudaHostPolicy, APinnedBlockCopiedFromEveryStepKeepsOneEventPerStream) {
  // Note [deferred host frees]: a pinned staging buffer that stays alive and is copied to the GPU
  // every step used to keep every copy's event (one more pooled event per step, never freed).
  struct Ev {
    int stream, id;
  };
  auto same_stream = [](const Ev& later, const Ev& earlier) { return later.stream == earlier.stream; };
  std::vector<int> done, released;
  auto is_done = [&](const Ev& e) { return std::find(done.begin(), done.end(), e.id) != done.end(); };
  auto release = [&](const Ev& e) { released.push_back(e.id); };
  detail::HostBlockPool<Ev> pool;
  alignas(64) static char mem[256];
  pool.add(mem, 256);
  for (int step = 0; step < 1000; ++step) EXPECT_TRUE(pool.record(mem + step % 256, Ev{1, step}, same_stream, release));
  EXPECT_EQ(pool.events(mem), 1u) << "one event per copy";
  EXPECT_EQ(released.size(), 999u);
  EXPECT_EQ(released.back(), 998) << "the latest event of the stream stays";
  EXPECT_TRUE(pool.record(mem, Ev{2, 1000}, same_stream, release));  // another stream: its own event
  EXPECT_EQ(pool.events(mem), 2u);
  EXPECT_EQ(pool.events(mem + 256), 0u);
  released.clear();
  EXPECT_TRUE(pool.free(mem));
  done = {999};
  EXPECT_EQ(pool.take(256, is_done, release), nullptr) << "stream 2's copy may still read it";
  done = {999, 1000};
  EXPECT_EQ(pool.take(256, is_done, release), mem);
  EXPECT_EQ(released, (std::vector<int>{999, 1000}));
}

TEST(CudaHostPolicy, CudnnAlgorithmsRunUnderTheMathTypeChorusAllows) {
  // Note [cuDNN algorithm choice]
  using M = bc::ConvMath;
  const std::vector<bc::ConvAlgoPerf> perf = {
      {/*algo=*/6, /*ok=*/false, M::TensorOp, true},                 // failed: never
      {1, true, M::TensorOpAllowConversion, false},                  // fast, nondeterministic, converts to half
      {2, true, M::TensorOp, true},
      {0, true, M::Fma, true},
  };
  auto order = [&](bc::ConvMathPolicy p) {
    std::vector<std::pair<int, M>> out;
    for (const auto& c : bc::conv_algo_order(perf, p)) out.emplace_back(perf[c.index].algo, c.math);
    return out;
  };
  // float without TF32: every algorithm on FMA math.
  EXPECT_EQ(bc::conv_query_math({true, false, false}), M::Fma);
  EXPECT_EQ(order({true, false, false}),
            (std::vector<std::pair<int, M>>{{1, M::Fma}, {2, M::Fma}, {0, M::Fma}}));
  // float with TF32: the entry's own math type, never a conversion to half precision.
  EXPECT_EQ(bc::conv_query_math({true, true, false}), M::Default);
  EXPECT_EQ(order({true, true, false}),
            (std::vector<std::pair<int, M>>{{1, M::TensorOp}, {2, M::TensorOp}, {0, M::Fma}}));
  // double: the entry's own.
  EXPECT_EQ(bc::conv_query_math({false, false, false}), M::Default);
  EXPECT_EQ(order({false, false, false}),
            (std::vector<std::pair<int, M>>{{1, M::TensorOp}, {2, M::TensorOp}, {0, M::Fma}}));
  // deterministic: the nondeterministic entry is left out.
  EXPECT_EQ(order({true, false, true}), (std::vector<std::pair<int, M>>{{2, M::Fma}, {0, M::Fma}}));
  EXPECT_TRUE(bc::conv_algo_order({{3, true, M::Fma, false}}, {true, false, true}).empty());
}
