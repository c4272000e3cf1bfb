// The CUDA backend's host-side decisions, checked with g++ on any machine (no GPU, no CUDA
// headers): cuBLASLt alignment rules and plan-cache key, checked narrowing to int, the stream-use
// bookkeeping of the allocator (which device each using stream belongs to), and the messages of
// device-side validation.
#include <gtest/gtest.h>

#include <chorus/backend/cuda/host_policy.hpp>
#include <chorus/core/block_table.hpp>
#include <chorus/core/device_assert.hpp>
#include <climits>
#include <string>
#include <unordered_set>

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
