// DataParallel on virtual CPU devices: the multi-device run equals the single-device run.
#include <atomic>
#include <mutex>
#include <thread>

#include "data_parallel_util.hpp"

using namespace chorus;
using chorus::testing::all_close;
using chorus::testing::block_of;
using chorus::testing::cpus;
using chorus::testing::expect_grads_equal;
using chorus::testing::Net;
using chorus::testing::throws_with;
namespace F = chorus::nn::functional;

namespace {
// These tests exercise the threaded path (every replica on its device's worker), also for
// their small models; the inline path (Note [inline small steps]) has its own tests below.
const bool kThreaded = [] {
  parallel::set_inline_work_default(0);
  return true;
}();

}  // namespace

template <class T>
class DataParallelTyped : public ::testing::Test {};
TYPED_TEST_SUITE(DataParallelTyped, chorus::testing::FloatTypes);

TYPED_TEST(DataParallelTyped, OutputsAndGradientsEqualTheSingleDeviceRun) {
  using T = TypeParam;
  const double rtol = chorus::testing::tol<T>();
  for (int k = 1; k <= 8; ++k) {
    manual_seed(static_cast<std::uint64_t>(k));
    Net<T> reference;
    DataParallel<Net<T>> dp(nn::clone(reference, Device::cpu(0)), cpus(k));
    for (int batch = 0; batch <= 3 * k + 1; ++batch) {
      const std::string what = std::to_string(k) + " devices, batch " + std::to_string(batch);
      auto x = randn<T>({batch, 6});
      auto w = randn<T>({batch, 3});
      reference.zero_grad();
      dp.zero_grad();
      auto ref_out = reference.forward(x);
      auto out = dp(x);
      ASSERT_EQ(out.device(), Device::cpu(0)) << what;
      EXPECT_TRUE(all_close(out, ref_out, rtol, rtol)) << what;
      (ref_out * w).sum().backward();
      (out * w).sum().backward();
      expect_grads_equal<T>(reference, dp.module(), rtol, what);
    }
  }
}

TYPED_TEST(DataParallelTyped, TenSgdStepsMatchSingleDeviceTraining) {
  using T = TypeParam;
  manual_seed(11);
  Net<T> single;
  DataParallel<Net<T>> dp(nn::clone(single, Device::cpu(0)), cpus(3));
  optim::SGD opt_single(single.parameters(), {.lr = 0.1, .momentum = 0.9});
  optim::SGD opt_dp(dp.parameters(), {.lr = 0.1, .momentum = 0.9});
  for (int step = 0; step < 10; ++step) {
    auto x = randn<T>({20, 6});
    auto y = randn<T>({20, 3});
    auto l1 = F::mse_loss(single.forward(x), y);
    opt_single.zero_grad();
    l1.backward();
    opt_single.step();
    auto l2 = F::mse_loss(dp(x), y);
    opt_dp.zero_grad();
    l2.backward();
    opt_dp.step();
    EXPECT_NEAR(l1.item(), l2.item(), 10 * chorus::testing::tol<T>() * (1 + std::abs(l1.item())));
  }
  auto a = single.named_parameters(), b = dp.named_parameters();
  for (std::size_t i = 0; i < a.size(); ++i)
    EXPECT_TRUE(all_close(b[i].tensor.template as<T>(), a[i].tensor.template as<T>(), 10 * chorus::testing::tol<T>(),
                          10 * chorus::testing::tol<T>()))
        << a[i].name;
}

TEST(DataParallel, RepeatedDevicesGetTheirOwnStreams) {
  set_cpu_device_count(2);
  manual_seed(5);
  Net<double> reference;
  DataParallel<Net<double>> dp(nn::clone(reference, Device::cpu(0)), {Device::cpu(0), Device::cpu(0), Device::cpu(1)});
  auto x = randn<double>({7, 6});
  auto out = dp(x);
  auto ref = reference.forward(x);
  EXPECT_TRUE(all_close(out, ref, 1e-12, 1e-12));
  out.sum().backward();
  ref.sum().backward();
  expect_grads_equal<double>(reference, dp.module(), 1e-12, "repeated devices");
}

// Every bucket size gives the same gradients: one bucket per parameter (the CPU default), a few
// parameters per bucket, and all in one (the GPU default, 8 MB).
TEST(DataParallel, AnyBucketSizeGivesTheSameGradients) {
  for (std::size_t bytes : {kDefaultCpuBucketBytes, std::size_t{64}, kDefaultBucketBytes}) {
    manual_seed(6);
    Net<double> reference;
    DataParallel<Net<double>> dp(nn::clone(reference, Device::cpu(0)), cpus(4), std::nullopt, 0, bytes);
    auto x = randn<double>({13, 6});
    for (int step = 0; step < 2; ++step) {  // the second step accumulates onto the first
      (dp(x) * 2.0).sum().backward();
      (reference.forward(x) * 2.0).sum().backward();
    }
    expect_grads_equal<double>(reference, dp.module(), 1e-12, std::to_string(bytes) + "-byte buckets");
  }
}

TEST(DataParallel, ReplicasAreBuiltOnceAndLiveOnTheirDevices) {
  manual_seed(7);
  DataParallel<Net<float>> dp(Net<float>(), cpus(3));
  const auto* r1 = &dp.replica(1);
  for (int i = 0; i < 3; ++i) dp(randn<float>({9, 6})).sum().backward();
  EXPECT_EQ(&dp.replica(1), r1);
  auto ps = dp.replica(2).named_tensors();
  for (auto& p : ps) EXPECT_EQ(p.tensor.device(), Device::cpu(2)) << p.name;
  // Parameters share one flat buffer per dtype, buffers another (one broadcast, or none,
  // refreshes each group); each tensor is a slice of it (Note [storage slices]). The primary's
  // tensors were re-seated into flat buffers too, keeping their identity; on CPU devices a
  // replica's parameters alias the primary's (Note [host aliases]), its buffers are its own.
  const auto& m = dp.module();
  const auto& rep = dp.replica(2);
  EXPECT_EQ(block_of(m.fc1->weight), block_of(m.fc2->bias));
  EXPECT_NE(block_of(m.fc1->weight), block_of(m.scale));
  EXPECT_EQ(block_of(rep.fc1->weight), block_of(m.fc1->weight));
  EXPECT_EQ(block_of(rep.fc2->bias), block_of(m.fc1->weight));
  EXPECT_NE(block_of(rep.scale), block_of(m.scale));
  EXPECT_EQ(block_of(rep.scale)->device(), Device::cpu(2));
  EXPECT_FALSE(m.fc1->weight.same_storage(m.fc2->bias));  // a counter each (Note [storage slices])
  // Replicas see the primary's current values at every step.
  {
    NoGradGuard g;
    dp.module().fc2->bias.fill_(7);
  }
  dp(randn<float>({9, 6}));
  EXPECT_EQ(dp.replica(2).fc2->bias.to_vector(), std::vector<float>(3, 7.0f));
  // Every tensor, whichever thread copied its part (Note [shared broadcast]), equals the primary's.
  auto primary = dp.module().named_tensors();
  for (std::size_t r = 1; r < 3; ++r) {
    auto rep = dp.replica(r).named_tensors();
    ASSERT_EQ(rep.size(), primary.size());
    for (std::size_t i = 0; i < rep.size(); ++i)
      EXPECT_TRUE(all_close(rep[i].tensor.as<float>().to(Device::cpu(0)), primary[i].tensor.as<float>(), 0))
          << "replica " << r << " " << rep[i].name;
  }
}

// Note [host aliases]: on CPU devices the replicas read the primary's parameters in place (a
// step copies no parameter), keep buffers of their own, and see the primary's values, also
// after the user replaced a parameter's storage.
TEST(DataParallel, CpuReplicasAliasThePrimarysParametersAndCopyItsBuffers) {
  manual_seed(17);
  Net<float> reference;
  auto devs = cpus(3);
  const auto before = memory_stats(Device::cpu(2)).allocated;
  DataParallel<Net<float>> dp(nn::clone(reference, Device::cpu(0)), devs);
  std::int64_t param_bytes = 0;
  for (auto& p : dp.parameters()) param_bytes += p.numel() * 4;
  // Device 2 holds the replica's buffer group (3 floats, padded), not a copy of the parameters.
  EXPECT_LT(memory_stats(Device::cpu(2)).allocated - before, param_bytes);
  for (std::size_t r = 1; r < 3; ++r) {
    const auto& rep = dp.replica(r);
    EXPECT_EQ(rep.fc1->weight.device(), Device::cpu(static_cast<int>(r)));
    EXPECT_EQ(rep.fc1->weight.data(), dp.module().fc1->weight.data()) << "replica " << r;
    EXPECT_EQ(rep.fc2->bias.data(), dp.module().fc2->bias.data()) << "replica " << r;
    EXPECT_NE(rep.scale.data(), dp.module().scale.data()) << "replica " << r;
  }
  // The user re-seats a parameter (not flat any more): the primary is flattened again and the
  // replicas follow the new memory.
  {
    NoGradGuard g;
    dp.module().fc1->weight.impl()->storage = full<float>({16, 6}, 0.25f).impl()->storage;
    dp.module().fc1->weight.impl()->offset = 0;
  }
  auto x = randn<float>({9, 6});
  auto y = dp(x);
  for (std::size_t r = 1; r < 3; ++r)
    EXPECT_EQ(dp.replica(r).fc1->weight.data(), dp.module().fc1->weight.data()) << "replica " << r;
  {
    NoGradGuard g;
    reference.fc1->weight.fill_(0.25f);
  }
  EXPECT_TRUE(all_close(y, reference.forward(x), 1e-6, 1e-6));
  // A write to the primary's parameters between forward and backward is seen by every
  // replica's saved tensors (one version counter).
  auto loss = dp(x).sum();
  {
    NoGradGuard g;
    dp.module().fc2->weight.fill_(2.0f);
  }
  EXPECT_TRUE(throws_with([&] { loss.backward(); }, {"modified by an inplace operation"}));
}

// With parameters read in place by every replica, a forward that writes one would race: refused.
struct WritesItsWeight : nn::Module {
  nn::Linear fc;
  WritesItsWeight() : fc(register_module("fc", nn::Linear(4, 2))) {}
  Tensor<float> forward(const Tensor<float>& x) {
    {
      NoGradGuard g;
      fc->bias.fill_(0);
    }
    return fc(x);
  }
};

TEST(DataParallel, AForwardThatWritesAParameterIsRefusedOnCpuDevices) {
  DataParallel<WritesItsWeight> dp(WritesItsWeight(), cpus(2));
#if !defined(__SANITIZE_THREAD__)  // the threaded run races (that is the point); TSan would stop on it
  EXPECT_TRUE(throws_with([&] { dp(randn<float>({8, 4})); }, {"a parameter was written in place during forward"}));
#endif
  dp.set_inline_work(1 << 20);  // the small-step path checks too (its replicas run one after another)
  EXPECT_TRUE(throws_with([&] { dp(randn<float>({8, 4})); }, {"a parameter was written in place during forward"}));
  // Only the replicas' shared reads make it a race: one device runs it as a plain module.
  DataParallel<WritesItsWeight> one(WritesItsWeight(), cpus(1));
  EXPECT_NO_THROW(one(randn<float>({8, 4})));
}

// Note [idle workers help]: each step lends the replicas' workers to the primary's large
// elementwise loops (the optimizer step) for about two step periods.
TEST(DataParallel, StepsLendTheReplicasIdleWorkers) {
  auto devs = cpus(2, 4);
  DataParallel<Net<float>> dp(nn::clone(Net<float>(), Device::cpu(4)), devs);
  Stream& s5 = get_stream(Device::cpu(5));
  auto step = [&] {
    dp(randn<float>({64, 6}, Device::cpu(4))).sum().backward();
    s5.synchronize();
  };
  step();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  step();  // period 200 ms: lent until about 400 ms from its forward
  // (the worker may not be back in its wait loop yet when synchronize returns)
  for (int i = 0; i < 100 && !s5.idle_and_lent(); ++i) std::this_thread::sleep_for(std::chrono::microseconds(500));
  EXPECT_TRUE(s5.idle_and_lent());
}

// The CPU communicator sums gradients without copying between devices: a source nothing else
// holds becomes the sum's memory (Note [host aliases]); a shared one is only read.
TEST(DataParallel, CpuReductionHandsAnUnsharedGradientOverWithoutACopy) {
  auto devs = cpus(3);
  std::vector<Stream*> streams;
  for (auto d : devs) streams.push_back(&get_stream(d));
  parallel::CopyCommunicator comm(streams);
  {  // one source, held by nobody else: the sum is its memory, as a tensor of the root
    auto g = full<float>({4, 5}, 1.5f, Device::cpu(1));
    const float* mem = g.data();
    std::vector<std::vector<AnyTensor>> srcs(1);
    srcs[0].push_back(AnyTensor(std::move(g)));
    auto out = comm.reduce(std::move(srcs));
    ASSERT_EQ(out.size(), 1u);
    EXPECT_EQ(out[0].device(), Device::cpu(0));
    EXPECT_EQ(out[0].as<float>().data(), mem);
    EXPECT_EQ(out[0].as<float>().to_vector(), std::vector<float>(20, 1.5f));
  }
  {  // a lone shared source is handed over as it is (read, never written: whoever adds into
     // the sum sees that it is shared, autograd::detail::exclusively_owned)
    auto g = full<float>({4, 5}, 1.5f, Device::cpu(1));
    std::vector<std::vector<AnyTensor>> srcs(1);
    srcs[0].push_back(AnyTensor(g));
    auto out = comm.reduce(std::move(srcs));
    EXPECT_EQ(out[0].device(), Device::cpu(0));
    EXPECT_EQ(out[0].as<float>().to_vector(), std::vector<float>(20, 1.5f));
    EXPECT_FALSE(autograd::detail::exclusively_owned(out[0].as<float>()));
    EXPECT_EQ(g.to_vector(), std::vector<float>(20, 1.5f));
  }
  {  // two shared sources: the sum gets memory of its own, and neither is written
    auto a = full<float>({3}, 1.0f, Device::cpu(1)), b = full<float>({3}, 2.0f, Device::cpu(2));
    std::vector<std::vector<AnyTensor>> srcs(2);
    srcs[0].push_back(AnyTensor(a));
    srcs[1].push_back(AnyTensor(b));
    auto out = comm.reduce(std::move(srcs));
    EXPECT_NE(out[0].as<float>().data(), a.data());
    EXPECT_NE(out[0].as<float>().data(), b.data());
    EXPECT_EQ(out[0].as<float>().to_vector(), std::vector<float>(3, 3.0f));
    EXPECT_EQ(a.to_vector(), std::vector<float>(3, 1.0f));
    EXPECT_EQ(b.to_vector(), std::vector<float>(3, 2.0f));
  }
  {  // a lone strided source: a contiguous sum
    auto t = arange<float>(0, 6, 1, Device::cpu(1)).view({2, 3}).transpose(0, 1);
    std::vector<std::vector<AnyTensor>> srcs(1);
    srcs[0].push_back(AnyTensor(t));
    auto out = comm.reduce(std::move(srcs));
    EXPECT_TRUE(out[0].as<float>().is_contiguous());
    EXPECT_EQ(out[0].as<float>().to_vector(), (std::vector<float>{0, 3, 1, 4, 2, 5}));
  }
  {  // two sources (three devices), one shared and one not, and a non-contiguous one
    auto shared = arange<double>(0, 6, 1, Device::cpu(1)).view({2, 3});
    auto t = arange<double>(0, 6, 1, Device::cpu(2)).view({3, 2}).transpose(0, 1);
    std::vector<std::vector<AnyTensor>> srcs(2);
    srcs[0].push_back(AnyTensor(shared));
    srcs[1].push_back(AnyTensor(t.contiguous()));
    srcs[0].push_back(AnyTensor(full<double>({2}, 1.0, Device::cpu(1))));
    srcs[1].push_back(AnyTensor(t.select(1, 0)));
    auto out = comm.reduce(std::move(srcs));
    ASSERT_EQ(out.size(), 2u);
    EXPECT_EQ(out[0].as<double>().to_vector(), (std::vector<double>{0, 3, 6, 4, 7, 10}));
    EXPECT_EQ(out[1].as<double>().to_vector(), (std::vector<double>{1, 2}));
    EXPECT_EQ(shared.to_vector(), (std::vector<double>{0, 1, 2, 3, 4, 5}));
    EXPECT_EQ(out[0].device(), Device::cpu(0));
  }
  {  // sources that disagree are refused
    std::vector<std::vector<AnyTensor>> srcs(2);
    srcs[0].push_back(AnyTensor(zeros<float>({3}, Device::cpu(1))));
    srcs[1].push_back(AnyTensor(zeros<float>({4}, Device::cpu(2))));
    EXPECT_TRUE(throws_with([&] { comm.reduce(std::move(srcs)); }, {"reduce: sources disagree on tensor 0"}));
  }
}

TEST(DataParallel, OutputDeviceDimAndMultipleArguments) {
  struct TwoInputs : nn::Module {
    nn::Linear fc;
    TwoInputs() : fc(register_module("fc", nn::Linear(4, 2))) {}
    std::tuple<Tensor<float>, Tensor<float>> forward(const Tensor<float>& a, const Tensor<float>& b, double scale,
                                                     const std::string& tag) {
      EXPECT_EQ(tag, "tag");
      auto y = fc(a) * scale;
      return {y, y + b};
    }
  };
  manual_seed(8);
  TwoInputs single;
  DataParallel<TwoInputs> dp(nn::clone(single, Device::cpu(0)), cpus(3), Device::cpu(2));
  auto a = randn<float>({10, 4}), b = randn<float>({10, 2});
  auto [y, z] = dp(a, b, 3.0, std::string("tag"));
  EXPECT_EQ(y.device(), Device::cpu(2));
  auto [ry, rz] = single.forward(a, b, 3.0, "tag");
  EXPECT_TRUE(all_close(y.to(Device::cpu(0)), ry, 1e-5, 1e-6));
  EXPECT_TRUE(all_close(z.to(Device::cpu(0)), rz, 1e-5, 1e-6));
  EXPECT_TRUE(throws_with([&] { dp(a, randn<float>({9, 2}), 1.0, std::string("tag")); },
                          {"disagree", "argument 0 has 10", "argument 1 has 9"}));

  // Splitting along dimension 1.
  struct Cols : nn::Module {
    Tensor<float> forward(const Tensor<float>& x) { return x * 2.0; }
  };
  DataParallel<Cols> by_col(Cols(), cpus(2), std::nullopt, 1);
  auto m = randn<float>({3, 5});
  EXPECT_TRUE(all_close(by_col(m), m * 2.0, 0));
}

TEST(DataParallel, InputsThatRequireGradGetGradients) {
  manual_seed(9);
  Net<double> reference;
  DataParallel<Net<double>> dp(nn::clone(reference, Device::cpu(0)), cpus(3));
  auto x = randn<double>({8, 6}).requires_grad_();
  auto x2 = x.detach().clone().requires_grad_();
  dp(x).sum().backward();
  reference.forward(x2).sum().backward();
  EXPECT_TRUE(all_close(x.grad(), x2.grad(), 1e-12, 1e-12));
}

TEST(DataParallel, AnExceptionInAReplicaIsReportedAndTheNextStepWorks) {
  struct Flaky : nn::Module {
    nn::Linear fc;
    std::shared_ptr<std::atomic<bool>> fail = std::make_shared<std::atomic<bool>>(false);
    Flaky() : fc(register_module("fc", nn::Linear(3, 3))) {}
    Tensor<float> forward(const Tensor<float>& x) {
      if (*fail && x.device() == Device::cpu(2)) throw std::runtime_error("replica blew up");
      return fc(x);
    }
  };
  DataParallel<Flaky> dp(Flaky(), cpus(3));
  dp.module().fail->store(true);
  EXPECT_TRUE(throws_with([&] { dp(randn<float>({9, 3})); }, {"replica 2", "cpu:2", "replica blew up"}));
  dp.module().fail->store(false);
  auto out = dp(randn<float>({9, 3}));
  out.sum().backward();
  EXPECT_EQ(out.shape(), (Shape{9, 3}));
  EXPECT_TRUE(dp.module().fc->weight.grad().defined());
}

TEST(DataParallel, EvalModeNoGradAndPassthrough) {
  struct Drop : nn::Module {
    nn::Dropout drop;
    Drop() : drop(register_module("drop", nn::Dropout(0.5))) {}
    Tensor<float> forward(const Tensor<float>& x) { return drop(x); }
  };
  DataParallel<Drop> dp(Drop(), cpus(4));
  dp.eval();
  auto x = randn<float>({12, 5});
  EXPECT_TRUE(all_close(dp(x), x, 0));
  EXPECT_FALSE(dp.replica(3).drop->is_training());
  dp.train();
  auto y = dp(ones<float>({400, 5})).to_vector();
  int zeros_n = 0;
  for (auto v : y) zeros_n += v == 0;
  EXPECT_GT(zeros_n, 600);  // every replica applies dropout in training mode
  {
    NoGradGuard g;
    EXPECT_FALSE(dp(x).requires_grad());
  }
  // One device: a passthrough, the very same tensor flows in.
  struct Identity : nn::Module {
    Tensor<float> forward(const Tensor<float>& x) { return x; }
  };
  DataParallel<Identity> one(Identity(), {Device::cpu(0)});
  EXPECT_TRUE(is_same(one(x), x));
}

TEST(DataParallel, ParametersMustBeOnThePrimary) {
  set_cpu_device_count(3);
  Net<float> net;
  net.to(Device::cpu(1));
  // As PyTorch's: building it is fine (to(devices[0]) would move it), its forward is not.
  EXPECT_TRUE(throws_with([&] { DataParallel<Net<float>> dp(std::move(net), cpus(2)); dp(randn<float>({4, 6})); },
                          {"fc1.weight", "cpu:1", "primary device is cpu:0"}));
  DataParallel<Net<float>> dp(Net<float>(), cpus(2));
  dp.module().to(Device::cpu(2));
  EXPECT_TRUE(throws_with([&] { dp(randn<float>({4, 6})); }, {"cpu:2", "primary"}));
  dp.module().to(Device::cpu(0));  // back on the primary: it works again
  EXPECT_EQ(dp(randn<float>({4, 6})).shape(), (Shape{4, 3}));
  EXPECT_TRUE(throws_with([] { DataParallel<Net<float>>(Net<float>(), {Device::cpu(0), Device::cpu(9)}); },
                          {"cpu:9"}));
}

// Note [flat offsets are 256-byte aligned]: Linear(5, 2)'s bias used to sit at +40 bytes in the
// flat buffer, which cuBLASLt's default heuristic (256-byte operands) cannot take on a GPU.
TEST(DataParallel, FlatBufferOffsetsAre256ByteAligned) {
  EXPECT_EQ(parallel::detail::aligned_flat_offset(0, 4), 0);
  EXPECT_EQ(parallel::detail::aligned_flat_offset(10, 4), 64);  // Linear(5, 2): the bias after 10 weights
  EXPECT_EQ(parallel::detail::aligned_flat_offset(64, 4), 64);
  EXPECT_EQ(parallel::detail::aligned_flat_offset(65, 4), 128);
  EXPECT_EQ(parallel::detail::aligned_flat_offset(33, 8), 64);

  struct Tutorial : nn::Module {
    nn::Linear fc;
    Tutorial() : fc(register_module("fc", nn::Linear(5, 2))) {}
    Tensor<float> forward(const Tensor<float>& x) { return fc(x); }
  };
  auto expect_aligned = [](const nn::Module& m, const std::string& what) {
    for (const auto& p : m.named_tensors()) {
      // Bytes from the start of the flat buffer (each tensor is a slice of it, Note [storage slices]).
      const auto offset = p.tensor.visit([](const auto& t) {
        return static_cast<const char*>(static_cast<const void*>(t.data())) - static_cast<const char*>(block_of(t)->data());
      });
      EXPECT_GE(offset, 0) << what << " '" << p.name << "'";
      EXPECT_EQ(static_cast<std::size_t>(offset) % 256, 0u) << what << " '" << p.name << "' at byte " << offset;
      if (p.name == "fc.bias") {
        EXPECT_EQ(offset, 256) << what;  // after the 10 weights, padded
      }
    }
  };
  manual_seed(11);
  Tutorial single;
  DataParallel<Tutorial> dp(nn::clone(single, Device::cpu(0)), cpus(3));
  for (std::size_t r = 0; r < 3; ++r) expect_aligned(nn::module_of(dp.replica(r)), "replica " + std::to_string(r));
  DataParallel<Net<double>> dp2(Net<double>(), cpus(2));  // doubles, and a buffer after the parameters
  for (std::size_t r = 0; r < 2; ++r) expect_aligned(nn::module_of(dp2.replica(r)), "double replica " + std::to_string(r));
  auto x = randn<float>({30, 5});
  auto out = dp(x);
  EXPECT_TRUE(all_close(out, single.forward(x), 1e-6, 1e-6));
  out.sum().backward();
  single.forward(x).sum().backward();
  expect_grads_equal<float>(single, dp.module(), 1e-5, "aligned flat layout");
}

// Issue 10, item 9: a batch smaller than the device count leaves replicas idle; their
// refresh must be joined before the optimizer writes the primary (TSan saw the race).
TEST(DataParallel, IdleReplicasAreJoinedBeforeTheOptimizerStep) {
  manual_seed(11);
  Net<double> reference;
  DataParallel<Net<double>> dp(nn::clone(reference, Device::cpu(0)), cpus(4));
  optim::SGD opt(dp.parameters(), {.lr = 0.1, .momentum = 0.5});
  optim::SGD ref_opt(reference.parameters(), {.lr = 0.1, .momentum = 0.5});
  for (int step = 0; step < 20; ++step) {
    auto x = randn<double>({step % 2 == 0 ? 2 : 3, 6});  // 2 or 3 of the 4 replicas work
    auto loss = dp(x).sum();
    // The idle replica saw this step's parameters, all of them.
    EXPECT_TRUE(all_close(dp.replica(3).fc1->weight, dp.module().fc1->weight.to(Device::cpu(3)), 0));
    opt.zero_grad();
    loss.backward();
    opt.step();  // writes the primary's flat buffer the idle replicas were refreshed from
    auto ref_loss = reference.forward(x).sum();
    ref_opt.zero_grad();
    ref_loss.backward();
    ref_opt.step();
    EXPECT_NEAR(loss.item(), ref_loss.item(), 1e-10) << "step " << step;
  }
  EXPECT_TRUE(all_close(dp.module().fc2->weight, reference.fc2->weight, 1e-10, 1e-10));
}

// Item 10: a second thread entering forward of a DataParallel that is busy gets an error,
// not a race on the replicas' autograd wiring.
TEST(DataParallel, ConcurrentForwardFromTwoThreadsIsRefused) {
  struct Gate {
    std::atomic<bool> armed{false}, inside{false}, release{false};
  };
  struct Held : nn::Module {
    nn::Linear fc;
    std::shared_ptr<Gate> gate = std::make_shared<Gate>();
    Held() : fc(register_module("fc", nn::Linear(3, 2))) {}
    Tensor<float> forward(const Tensor<float>& x) {
      if (x.device() == Device::cpu(0) && gate->armed.exchange(false)) {  // replica 0, once
        gate->inside = true;
        while (!gate->release) std::this_thread::yield();
      }
      return fc(x);
    }
  };
  DataParallel<Held> dp(Held(), cpus(2));
  auto gate = dp.module().gate;
  gate->armed = true;
  auto x = randn<float>({4, 3});
  Tensor<float> first;
  std::thread other([&] {
    NoGradGuard g;
    first = dp(x);
  });
  while (!gate->inside) std::this_thread::yield();
  EXPECT_TRUE(throws_with(
      [&] {
        NoGradGuard g;
        dp(x);
      },
      {"another thread is inside forward", "one DataParallel per thread"}));
  gate->release = true;
  other.join();
  EXPECT_EQ(first.shape(), (Shape{4, 2}));
  // Once the first call has left, the same DataParallel works from this thread.
  NoGradGuard g;
  EXPECT_TRUE(all_close(dp(x), first, 0));
}

// Item 11: a DataParallel called inside a replica's forward on the same devices would wait
// for its own worker; it is refused with an error instead of hanging.
TEST(DataParallel, NestedDataParallelOnTheSameDevicesIsAnErrorNotADeadlock) {
  struct Inner : nn::Module {
    nn::Linear fc;
    Inner() : fc(register_module("fc", nn::Linear(3, 3))) {}
    Tensor<float> forward(const Tensor<float>& x) { return fc(x); }
  };
  auto inner = std::make_shared<DataParallel<Inner>>(Inner(), cpus(2));
  struct Outer : nn::Module {
    nn::Linear fc;
    std::shared_ptr<DataParallel<Inner>> inner;
    std::shared_ptr<std::atomic<bool>> nest = std::make_shared<std::atomic<bool>>(true);
    Outer() : fc(register_module("fc", nn::Linear(3, 3))) {}
    Tensor<float> forward(const Tensor<float>& x) {
      if (*nest) return fc((*inner)(x.to(Device::cpu(0))).to(x.device()));
      return fc(x);
    }
  };
  Outer o;
  o.inner = inner;
  DataParallel<Outer> dp(std::move(o), cpus(2));
  EXPECT_TRUE(throws_with([&] { dp(randn<float>({6, 3})); },
                          {"replica 1 on cpu:1", "worker thread of cpu:1/stream0", "nested DataParallel is not supported"}));
  dp.module().nest->store(false);
  EXPECT_EQ(dp(randn<float>({6, 3})).shape(), (Shape{6, 3}));
  // The inner DataParallel itself is unharmed.
  EXPECT_EQ((*inner)(randn<float>({6, 3})).shape(), (Shape{6, 3}));
}

// Item 19: DataParallel::to moves the primary and rebuilds the replicas.
TEST(DataParallel, ToMovesThePrimaryAndRebuildsTheReplicas) {
  manual_seed(12);
  Net<double> reference;
  DataParallel<Net<double>> dp(nn::clone(reference, Device::cpu(0)), cpus(3));
  optim::SGD opt(dp.parameters(), {.lr = 0.1});
  auto x = randn<double>({7, 6});
  dp.to(Device::cpu(2));  // one of the devices: it comes first
  EXPECT_EQ(dp.devices(), (std::vector<Device>{Device::cpu(2), Device::cpu(0), Device::cpu(1)}));
  EXPECT_EQ(dp.output_device(), Device::cpu(2));
  for (auto& p : dp.parameters()) EXPECT_EQ(p.device(), Device::cpu(2));
  EXPECT_EQ(dp.replica(1).fc1->weight.device(), Device::cpu(0));
  auto out = dp(x);
  EXPECT_EQ(out.device(), Device::cpu(2));
  EXPECT_TRUE(all_close(out.to(Device::cpu(0)), reference.forward(x), 1e-12, 1e-12));
  opt.zero_grad();
  out.sum().backward();
  opt.step();  // the optimizer's handles followed the move
  reference.forward(x).sum().backward();
  for (auto& p : reference.parameters()) {
    auto& t = p.as<double>();
    NoGradGuard g;
    t.copy_(t - t.grad() * 0.1);
  }
  EXPECT_TRUE(all_close(dp.module().fc1->weight.to(Device::cpu(0)), reference.fc1->weight, 1e-12, 1e-12));
  // A device outside the list replaces the primary; a different kind is refused.
  set_cpu_device_count(4);
  dp.to(Device::cpu(3));
  EXPECT_EQ(dp.devices(), (std::vector<Device>{Device::cpu(3), Device::cpu(0), Device::cpu(1)}));
  EXPECT_TRUE(all_close(dp(x).to(Device::cpu(0)), reference.forward(x), 1e-12, 1e-12));
  EXPECT_TRUE(throws_with([&] { dp.to(Device::cuda(0)); }, {"cuda:0"}));
}

// Item 22: a step too small to pay for a hand-off runs every replica on the calling thread,
// each under its own stream, with the same results as the threaded and single-device runs.
TYPED_TEST(DataParallelTyped, SmallStepsRunOnTheCallerWithTheSameResults) {
  using T = TypeParam;
  ASSERT_TRUE(kThreaded);
  struct Where {
    std::mutex m;
    std::vector<std::pair<Device, std::thread::id>> seen;
  };
  struct Traced : Net<T> {
    std::shared_ptr<Where> where = std::make_shared<Where>();
    Tensor<T> forward(const Tensor<T>& x) {
      {
        std::lock_guard<std::mutex> lk(where->m);
        where->seen.emplace_back(x.device(), std::this_thread::get_id());
      }
      return Net<T>::forward(x);
    }
  };
  manual_seed(13);
  Traced reference;
  for (std::int64_t work : {std::int64_t{1} << 40, std::int64_t{0}}) {  // inline, then threaded
    DataParallel<Traced> dp(nn::clone(reference, Device::cpu(0)), cpus(3));
    dp.set_inline_work(work);
    EXPECT_EQ(dp.inline_work(), work);
    auto where = dp.module().where;
    for (auto& p : reference.parameters()) p.set_grad(AnyTensor());
    auto x = randn<T>({8, 6});
    auto ref = reference.forward(x);
    where->seen.clear();  // the clone shares the reference's record
    auto out = dp(x);
    EXPECT_TRUE(all_close(out, ref, chorus::testing::tol<T>(), chorus::testing::tol<T>()));
    (out * out).sum().backward();  // backward of replicas 1, 2 runs on their devices' workers
    (ref * ref).sum().backward();
    expect_grads_equal<T>(reference, dp.module(), 10 * chorus::testing::tol<T>(), "inline work " + std::to_string(work));
    ASSERT_EQ(where->seen.size(), 3u);
    int on_caller = 0;
    for (auto& [dev, id] : where->seen) on_caller += id == std::this_thread::get_id();
    EXPECT_EQ(on_caller, work > 0 ? 3 : 1);
    // Replicas see the primary's current values after an optimizer step, inline as threaded.
    optim::SGD opt(dp.parameters(), {.lr = 0.5});
    opt.step();
    dp(x);
    EXPECT_TRUE(all_close(dp.replica(2).fc1->weight, dp.module().fc1->weight.to(Device::cpu(2)), 0));
  }
  // The default threshold sends a tiny step inline and a big one to the workers.
  DataParallel<Traced> dp(Traced(), cpus(2));
  dp.set_inline_work(kDefaultInlineWork);
  auto where = dp.module().where;
  dp(randn<T>({4, 6}));
  EXPECT_EQ(where->seen.size(), 2u);
  EXPECT_EQ(where->seen[1].second, std::this_thread::get_id());
  where->seen.clear();
  dp(randn<T>({4096, 6}));  // 2048 rows x 2 x 163 parameters off the caller: threaded
  std::size_t on_caller = 0;
  for (auto& [dev, id] : where->seen) on_caller += id == std::this_thread::get_id();
  EXPECT_EQ(on_caller, 1u);
  EXPECT_TRUE(throws_with([&] { dp.set_inline_work(-1); }, {"-1"}));
}

TEST(DataParallel, AnExceptionInAnInlineReplicaNamesIt) {
  struct Flaky : nn::Module {
    nn::Linear fc;
    Flaky() : fc(register_module("fc", nn::Linear(3, 3))) {}
    Tensor<float> forward(const Tensor<float>& x) {
      if (x.device() == Device::cpu(1)) throw std::runtime_error("replica blew up");
      return fc(x);
    }
  };
  DataParallel<Flaky> dp(Flaky(), cpus(2));
  dp.set_inline_work(std::int64_t{1} << 40);
  EXPECT_TRUE(throws_with([&] { dp(randn<float>({4, 3})); }, {"replica 1", "cpu:1", "replica blew up"}));
}
