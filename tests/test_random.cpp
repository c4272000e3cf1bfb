// Philox and dropout's random numbers (Note [dropout random numbers]): the generator against
// the published Philox4x32-10 answers, the mask as a function of (seed, offset, stream index),
// the CUDA kernel's thread mapping run on the CPU, and the same mask for a batch on 1 or k
// (virtual CPU) devices under DataParallel.
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <set>

#include "test_util.hpp"

using namespace chorus;
using chorus::testing::throws_with;

namespace {

std::vector<Device> cpus(int k) {
  set_cpu_device_count(std::max(cpu_device_count(), k));
  std::vector<Device> d;
  for (int i = 0; i < k; ++i) d.push_back(Device::cpu(i));
  return d;
}

std::array<std::uint32_t, 4> philox(std::array<std::uint32_t, 4> ctr, std::array<std::uint32_t, 2> key) {
  std::array<std::uint32_t, 4> out{};
  philox4x32_10(ctr.data(), key.data(), out.data());
  return out;
}

}  // namespace

// Random123's known-answer vectors (Salmon et al. 2011, kat_vectors).
TEST(Philox, KnownAnswers) {
  EXPECT_EQ(philox({0, 0, 0, 0}, {0, 0}),
            (std::array<std::uint32_t, 4>{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}));
  EXPECT_EQ(philox({0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff}),
            (std::array<std::uint32_t, 4>{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}));
  EXPECT_EQ(philox({0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0}),
            (std::array<std::uint32_t, 4>{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}));
}

// cuRAND's / PyTorch's layout: key = seed, counter = (offset / 4, subsequence) as 64-bit halves.
TEST(Philox, BlockLayoutOfSeedSubsequenceOffset) {
  const std::uint64_t seed = 0x0123456789abcdefULL, sub = 0x3edcba9876543210ULL, offset = 4 * 0x1122334455ULL;
  std::uint32_t got[4];
  philox_block(seed, sub, offset, got);
  const auto want = philox({0x22334455u, 0x11u, 0x76543210u, 0x3edcba98u}, {0x89abcdefu, 0x01234567u});
  for (int i = 0; i < 4; ++i) EXPECT_EQ(got[i], want[i]) << i;
  PhiloxLayout l;
  l.seed = seed;
  l.offset = offset;
  EXPECT_EQ(philox_number(l, 4 * sub + 2), want[2]);  // stream index s: word s % 4 of subsequence s / 4
}

TEST(Philox, GeneratorOffsetAdvancesByFourPerCall) {
  Generator g(11);
  EXPECT_EQ(g.initial_seed(), 11u);
  EXPECT_EQ(g.get_offset(), 0u);
  auto s = g.philox_engine_inputs(1);
  EXPECT_EQ(s.seed, 11u);
  EXPECT_EQ(s.offset, 0u);
  EXPECT_EQ(g.get_offset(), 4u);  // rounded up to whole blocks
  dropout(ones<float>({1000}), 0.5, true, g);
  EXPECT_EQ(g.get_offset(), 8u);  // one call: 4 of every subsequence, whatever the size
  dropout(ones<float>({3}), 0.5, false, g);
  EXPECT_EQ(g.get_offset(), 8u);  // eval: no draw
  g.manual_seed(12);
  EXPECT_EQ(g.get_offset(), 0u);
  EXPECT_EQ(g.initial_seed(), 12u);
  EXPECT_TRUE(throws_with([&] { g.set_offset(3); }, {"multiple of 4", "3"}));
  // set_state checks the offset as set_offset does (a dropout mask would repeat an earlier one),
  // and a refused state changes nothing.
  auto state = g.get_state();
  auto bad = state;
  bad[1] = 6;
  (void)g.philox_engine_inputs(1);
  EXPECT_TRUE(throws_with([&] { g.set_state(bad); }, {"set_state", "multiple of 4", "6"}));
  EXPECT_EQ(g.get_offset(), 4u);
  g.set_state(state);
  EXPECT_EQ(g.get_offset(), 0u);
  EXPECT_EQ(g.get_state(), state);
}

TEST(Philox, KeepThreshold) {
  EXPECT_EQ(keep_threshold(0.0), 0u);
  EXPECT_EQ(keep_threshold(1.0), std::uint64_t{1} << 32);  // every 32-bit number is below: all kept
  EXPECT_EQ(keep_threshold(0.5), std::uint64_t{1} << 31);
  EXPECT_EQ(keep_threshold(0.75), std::uint64_t{3} << 30);
  EXPECT_THROW(keep_threshold(1.5), Error);
}

// The mask is a function of (seed, offset, stream index) only: the CPU loop against the
// per-element definition. The CUDA kernel runs the same host/device functions (and the GPU test
// compares its mask with this one bit for bit).
TYPED_TEST_SUITE_P(DropoutPhilox);
template <class T>
class DropoutPhilox : public ::testing::Test {};

TYPED_TEST_P(DropoutPhilox, MaskIsThePhiloxNumberOfEachElement) {
  using T = TypeParam;
  Generator g(2024);
  g.set_offset(40);
  auto y = dropout(ones<T>({7, 13}), 0.3, true, g).to_vector();
  PhiloxLayout l;
  l.seed = 2024;
  l.offset = 40;
  const auto thr = keep_threshold(0.7);
  const T scale = static_cast<T>(1.0 / 0.7);
  for (std::size_t i = 0; i < y.size(); ++i) EXPECT_EQ(y[i], philox_number(l, i) < thr ? scale : T(0)) << i;
}

TYPED_TEST_P(DropoutPhilox, RunsAndTheKernelsThreadMappingAgreeWithTheDefinition) {
  using T = TypeParam;
  const auto thr = keep_threshold(0.6);
  const T scale = T(2.5);
  for (std::int64_t run : {1, 3, 4, 7, 21})
    for (std::uint64_t base : {0u, 1u, 3u, 6u})
      for (std::uint64_t stride : {0u, 21u, 50u}) {
        if (stride != 0 && stride < static_cast<std::uint64_t>(run)) continue;  // runs must not overlap
        PhiloxLayout l;
        l.seed = 5;
        l.offset = 8;
        l.run = run;
        l.base = base;
        l.stride = stride == 0 ? static_cast<std::uint64_t>(run) : stride;
        const std::int64_t n = 21;
        std::vector<T> in(n), loop(n, T(-1)), threads(n, T(-1));
        for (std::int64_t i = 0; i < n; ++i) in[i] = T(i + 1);
        backend::cpu::dropout_apply(in.data(), loop.data(), n, l, thr, scale);
        const auto grid = backend::cpu::dropout_grid(n, l);
        for (std::int64_t t = 0; t < grid.threads; ++t)
          backend::cpu::dropout_thread(in.data(), threads.data(), n, l, grid.gpr, t, thr, scale);
        for (std::int64_t i = 0; i < n; ++i) {
          const T want = in[i] * (philox_number(l, stream_index(l, i)) < thr ? scale : T(0));
          ASSERT_EQ(loop[i], want) << "run " << run << " base " << base << " stride " << stride << " i " << i;
          ASSERT_EQ(threads[i], want) << "kernel mapping: run " << run << " base " << base << " i " << i;
        }
      }
}

TYPED_TEST_P(DropoutPhilox, KeepsTheRightFractionAndPropagatesNaN) {
  using T = TypeParam;
  Generator g(1);
  auto y = dropout(ones<T>({100000}), 0.25, true, g).to_vector();
  std::int64_t zeros_n = 0;
  for (auto v : y) {
    if (v == 0) ++zeros_n;
    else ASSERT_EQ(v, static_cast<T>(1.0 / 0.75));
  }
  EXPECT_NEAR(zeros_n / 100000.0, 0.25, 0.01);
  EXPECT_TRUE(chorus::testing::values_are(dropout(ones<T>({5}), 1.0, true, g), {0, 0, 0, 0, 0}));
  // y = x · mask / (1 - p), as PyTorch: a NaN stays NaN where it is dropped too.
  auto nan = full<T>({64}, std::numeric_limits<T>::quiet_NaN());
  for (auto v : dropout(nan, 0.5, true, g).to_vector()) EXPECT_TRUE(std::isnan(v));
}

TYPED_TEST_P(DropoutPhilox, BackwardRecomputesTheForwardsMask) {
  using T = TypeParam;
  Generator g(77);
  auto x = full<T>({9, 5}, T(2)).requires_grad_();
  auto y = dropout(x, 0.4, true, g);
  y.sum().backward();
  auto yv = y.to_vector(), gv = x.grad().to_vector();
  for (std::size_t i = 0; i < yv.size(); ++i) EXPECT_EQ(gv[i], yv[i] / T(2)) << i;  // d(x·m)/dx = m
  // A non-contiguous input: the mask follows the logical (row-major) order.
  Generator g1(3), g2(3);
  auto base = rand<T>({5, 9}, Device::cpu(), -1, 1, g1);
  auto a = dropout(base.t(), 0.5, true, g2);
  Generator g3(3);
  auto b = dropout(base.t().contiguous(), 0.5, true, g3);
  EXPECT_TRUE(chorus::testing::all_close(a, b, 0));
}

REGISTER_TYPED_TEST_SUITE_P(DropoutPhilox, MaskIsThePhiloxNumberOfEachElement,
                            RunsAndTheKernelsThreadMappingAgreeWithTheDefinition,
                            KeepsTheRightFractionAndPropagatesNaN, BackwardRecomputesTheForwardsMask);
INSTANTIATE_TYPED_TEST_SUITE_P(FloatAndDouble, DropoutPhilox, chorus::testing::FloatTypes);

// ---- device-count invariance (Note [dropout random numbers]) ----

namespace {
struct DropNet : nn::Module {
  nn::Linear fc;
  nn::Dropout drop;
  nn::Dropout2d drop2;
  DropNet() : fc(register_module("fc", nn::Linear(6, 12))), drop(register_module("drop", nn::Dropout(0.5))),
              drop2(register_module("drop2", nn::Dropout2d(0.3))) {}
  Tensor<float> forward(const Tensor<float>& x) {
    auto h = drop(fc(x));                                  // [B, 12]
    h = drop2(h.reshape({h.size(0), 3, 2, 2}));            // whole channels of [B, 3, 2, 2]
    return drop(h).reshape({h.size(0), 12});               // a second draw of the same layer
  }
};
}  // namespace

TEST(DropoutDevices, SameMaskOnOneOrManyDevices) {
  DropNet net;
  auto x = randn<float>({13, 6});
  manual_seed(99);
  auto ref1 = net.forward(x);
  auto ref2 = net.forward(x);  // the next forward draws the next numbers
  const auto ref_offset = default_generator().get_offset();
  EXPECT_EQ(ref_offset, 4u * 6);  // three calls (dropout2d draws once) per forward, twice
  for (int k : {1, 2, 3, 4, 5}) {
    for (std::int64_t inline_work : {std::int64_t{0}, std::int64_t{1} << 30}) {  // on the workers / on the caller
      SCOPED_TRACE(std::to_string(k) + " devices, inline work " + std::to_string(inline_work));
      DataParallel<DropNet> dp(nn::clone(net, Device::cpu(0)), cpus(k));
      dp.set_inline_work(inline_work);
      manual_seed(99);
      auto y1 = dp(x);
      auto y2 = dp(x);
      EXPECT_TRUE(chorus::testing::all_close(y1, ref1, 0)) << "first forward";
      EXPECT_TRUE(chorus::testing::all_close(y2, ref2, 0)) << "second forward";
      EXPECT_EQ(default_generator().get_offset(), ref_offset);
    }
  }
}

TEST(DropoutDevices, GradientsAgreeAcrossDeviceCounts) {
  DropNet net;
  auto x = randn<float>({10, 6});
  manual_seed(5);
  auto xr = x.detach().requires_grad_();
  net.forward(xr).sum().backward();
  auto ref = xr.grad();
  DataParallel<DropNet> dp(nn::clone(net, Device::cpu(0)), cpus(3));
  dp.set_inline_work(0);
  manual_seed(5);
  auto xd = x.detach().requires_grad_();
  dp(xd).sum().backward();
  EXPECT_TRUE(chorus::testing::all_close(xd.grad(), ref, 1e-6, 1e-6));
}

TEST(DropoutDevices, SplitAlongAnotherDimension) {
  struct Drop : nn::Module {
    nn::Dropout drop;
    Drop() : drop(register_module("drop", nn::Dropout(0.5))) {}
    Tensor<float> forward(const Tensor<float>& x) { return drop(x); }
  };
  auto x = ones<float>({3, 10, 4});
  manual_seed(8);
  auto ref = Drop().forward(x);
  DataParallel<Drop> dp(Drop(), cpus(4), std::nullopt, /*dim=*/1);
  dp.set_inline_work(0);
  manual_seed(8);
  EXPECT_TRUE(chorus::testing::all_close(dp(x), ref, 0));
}

// A tensor whose split dimension is not the replica's share cannot be mapped into the batch:
// it draws stream indices of its own per replica, so replicas never repeat each other's mask.
TEST(DropoutDevices, UnmappedTensorsGetDistinctNumbersPerReplica) {
  struct Flat : nn::Module {
    Tensor<float> forward(const Tensor<float>& x) {
      return dropout(x.reshape({x.numel()}), 0.5, true).reshape(x.shape());
    }
  };
  DataParallel<Flat> dp(Flat(), cpus(2));
  dp.set_inline_work(0);
  manual_seed(3);
  auto y = dp(ones<float>({2, 256}));
  auto a = y.narrow(0, 0, 1).to_vector(), b = y.narrow(0, 1, 1).to_vector();
  EXPECT_NE(a, b);
  manual_seed(3);
  EXPECT_TRUE(chorus::testing::all_close(dp(ones<float>({2, 256})), y, 0));  // still deterministic
}

TEST(DropoutDevices, ReplicaGroupAdvancesByTheMostAnyReplicaUsed) {
  Generator g(4);
  g.set_offset(100);
  {
    auto group = std::make_shared<ReplicaRandomGroup>();
    {
      ReplicaRandomScope r0(group, 0, 0, 0, 2, 4);
      auto l0 = philox_layout(g, Shape{2, 3});
      auto l1 = philox_layout(g, Shape{2, 3});
      EXPECT_EQ(l0.offset, 100u);
      EXPECT_EQ(l1.offset, 104u);
      EXPECT_EQ(l0.base, 0u);
      EXPECT_EQ(l0.run, 6);
    }
    {
      ReplicaRandomScope r1(group, 1, 0, 2, 2, 4);
      auto l0 = philox_layout(g, Shape{2, 3});
      EXPECT_EQ(l0.offset, 100u);  // the same start as replica 0
      EXPECT_EQ(l0.base, 6u);      // rows 2, 3 of the batch
      auto odd = philox_layout(g, Shape{3, 2});  // not the replica's rows: a stream of its own
      EXPECT_EQ(odd.base, std::uint64_t{2} << kUnmappedStreamShift);
      EXPECT_EQ(philox_layout(g, Shape{2, 3}).offset, 108u);
    }
    EXPECT_EQ(g.get_offset(), 100u + Generator::kWindow);  // others draw past the open window meanwhile
  }
  EXPECT_EQ(g.get_offset(), 112u);  // replica 1 drew three times, replica 0 twice: as one device would
  EXPECT_TRUE(throws_with([&] { ReplicaRandomScope bad(std::make_shared<ReplicaRandomGroup>(), 0, 0, 3, 2, 4); },
                          {"ReplicaRandomScope", "[3, 5) of 4"}));
}

// Note [replica windows]: draws from elsewhere while a forward's window is open (another thread,
// another DataParallel) get numbers of their own, never the window's.
TEST(DropoutDevices, ConcurrentDrawsNeverReuseAnOpenWindowsNumbers) {
  Generator g(6);
  auto a = std::make_shared<ReplicaRandomGroup>(), b = std::make_shared<ReplicaRandomGroup>();
  PhiloxLayout la, lb, plain;
  {
    ReplicaRandomScope ra(a, 0, 0, 0, 1, 2);
    la = philox_layout(g, Shape{1, 5});
  }
  {
    ReplicaRandomScope rb(b, 0, 0, 0, 1, 2);
    lb = philox_layout(g, Shape{1, 5});
  }
  plain = philox_layout(g, Shape{5});
  EXPECT_EQ(la.offset, 0u);
  EXPECT_EQ(lb.offset, Generator::kWindow);
  EXPECT_EQ(plain.offset, 2 * Generator::kWindow);
  a->commit();  // others drew meanwhile: the offset stays past everything handed out
  EXPECT_EQ(g.get_offset(), 2 * Generator::kWindow + 4);
  b->commit();
  EXPECT_EQ(g.get_offset(), 2 * Generator::kWindow + 4);
  b.reset();  // committed already: destruction changes nothing
  EXPECT_EQ(g.get_offset(), 2 * Generator::kWindow + 4);
}

// Note [host engine]: HostEngine gives std::mt19937_64's numbers, through std::shuffle and the
// standard distributions too, and copies as the engine does.
TEST(HostEngine, IsStdMt19937_64BitForBit) {
  HostEngine e(42);
  std::mt19937_64 m(42);
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(e(), m()) << i;
  HostEngine copy = e;
  std::mt19937_64 mcopy = m;
  EXPECT_TRUE(copy == e);
  EXPECT_EQ(copy(), mcopy());
  EXPECT_FALSE(copy == e);  // the copy moved on alone
  EXPECT_EQ(e(), m());
  std::vector<int> a(50), b(50);
  std::iota(a.begin(), a.end(), 0);
  std::iota(b.begin(), b.end(), 0);
  std::shuffle(a.begin(), a.end(), e);
  std::shuffle(b.begin(), b.end(), m);
  EXPECT_EQ(a, b);
  for (std::uint64_t n : {1ull, 7ull, 1000ull, 1ull << 40})
    EXPECT_EQ(e.below(n), std::uniform_int_distribution<std::uint64_t>(0, n - 1)(m)) << n;
  e.seed(7);
  m.seed(7);
  EXPECT_EQ(std::uniform_real_distribution<double>(0, 1)(e), std::uniform_real_distribution<double>(0, 1)(m));
  EXPECT_TRUE(HostEngine() == HostEngine(5489u));
}
