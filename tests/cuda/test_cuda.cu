// The CUDA backend against the CPU backend, its allocator, streams, communicators, and
// DataParallel on repeated-GPU sets. Every test skips where no GPU is present.
#include <cmath>
#include <limits>
#include <map>
#include <atomic>
#include <functional>
#include <iostream>
#include <thread>

#include "cuda_test_util.cuh"

using namespace chorus;
using chorus::testing::all_close;
using chorus::testing::throws_with;
namespace F = chorus::nn::functional;

using chorus::testing::check_op;
using chorus::testing::kGpu;
using chorus::testing::r;

namespace {

// Every sticky or stray error shows at the end: a final device-wide sync and the last-error
// slot must both be clean (a test that leaves a tolerated code behind fails here).
class CudaTeardown : public ::testing::Environment {
 public:
  void TearDown() override {
    if (cuda_device_count() == 0) return;
    for (int d = 0; d < cuda_device_count(); ++d) {
      cuda::DeviceGuard g(d);
      const cudaError_t sync = cudaDeviceSynchronize();
      EXPECT_EQ(sync, cudaSuccess) << "cudaDeviceSynchronize at teardown on cuda:" << d << ": "
                                   << cudaGetErrorString(sync);
      const cudaError_t last = cudaGetLastError();
      EXPECT_EQ(last, cudaSuccess) << "cudaGetLastError at teardown on cuda:" << d << ": " << cudaGetErrorString(last);
    }
  }
};
[[maybe_unused]] auto* const kTeardown = ::testing::AddGlobalTestEnvironment(new CudaTeardown);

/// Keeps `stream` busy for about `ms` milliseconds (to observe what waits for what).
__global__ void spin_kernel(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}
void spin(Stream& stream, double ms) {
  cuda::DeviceGuard g(stream.device().index);  // a kernel goes to a stream of the current device
  int khz = 0;
  CHORUS_CUDA_CHECK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, stream.device().index));
  if (khz <= 0) khz = 2'000'000;  // not reported: assume 2 GHz (an H200 boosts to 1.98)
  spin_kernel<<<1, 1, 0, stream.handle()>>>(static_cast<long long>(ms * khz));
  CHORUS_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

template <class T>
class CudaOps : public ::testing::Test {};
TYPED_TEST_SUITE(CudaOps, chorus::testing::FloatTypes);

TYPED_TEST(CudaOps, ElementwiseAndActivations) {
  REQUIRE_GPU();
  using T = TypeParam;
  using L = std::vector<Tensor<T>>;
  check_op<T>("add", [](const L& x) { return x[0] + x[1]; }, {r<T>({33, 17}, 1), r<T>({17}, 2)});
  check_op<T>("sub", [](const L& x) { return x[0] - x[1]; }, {r<T>({5, 1, 4}, 3), r<T>({3, 1}, 4)});
  check_op<T>("mul", [](const L& x) { return x[0] * x[1]; }, {r<T>({1000}, 5), r<T>({1000}, 6)});
  check_op<T>("div", [](const L& x) { return x[0] / x[1]; }, {r<T>({40, 3}, 7), r<T>({40, 1}, 8, 0.5, 2)});
  check_op<T>("strided", [](const L& x) { return x[0].t() * 2.0 + 1.0; }, {r<T>({6, 9}, 9)});
  check_op<T>("neg-rdiv", [](const L& x) { return 3.0 / (-x[0]); }, {r<T>({50}, 10, 0.5, 2)});
  check_op<T>("exp", [](const L& x) { return chorus::exp(x[0]); }, {r<T>({300}, 11)});
  check_op<T>("log", [](const L& x) { return chorus::log(x[0]); }, {r<T>({300}, 12, 0.1, 3)});
  check_op<T>("sqrt", [](const L& x) { return chorus::sqrt(x[0]); }, {r<T>({300}, 13, 0.1, 3)});
  check_op<T>("pow", [](const L& x) { return chorus::pow(x[0], 3.0); }, {r<T>({300}, 14)});
  check_op<T>("relu", [](const L& x) { return relu(x[0]); }, {r<T>({300}, 15)});
  check_op<T>("gelu", [](const L& x) { return gelu(x[0]); }, {r<T>({300}, 16, -3, 3)});
  check_op<T>("tanh", [](const L& x) { return chorus::tanh(x[0]); }, {r<T>({300}, 17)});
  check_op<T>("sigmoid", [](const L& x) { return sigmoid(x[0]); }, {r<T>({300}, 18, -4, 4)});
}

TYPED_TEST(CudaOps, ReductionsAndSoftmax) {
  REQUIRE_GPU();
  using T = TypeParam;
  using L = std::vector<Tensor<T>>;
  check_op<T>("sum", [](const L& x) { return x[0].sum(); }, {r<T>({1000, 300}, 1)}, 1e-3);
  check_op<T>("mean", [](const L& x) { return x[0].mean(); }, {r<T>({77, 33}, 2)});
  check_op<T>("sum0", [](const L& x) { return x[0].sum(0); }, {r<T>({513, 65}, 3)});
  check_op<T>("sum1", [](const L& x) { return x[0].sum(1, true); }, {r<T>({65, 513}, 4)});
  check_op<T>("mean-mid", [](const L& x) { return x[0].mean(1); }, {r<T>({4, 5, 6}, 5)});
  check_op<T>("softmax", [](const L& x) { return softmax(x[0], 1); }, {r<T>({64, 1000}, 6, -5, 5)});
  check_op<T>("softmax0", [](const L& x) { return softmax(x[0], 0); }, {r<T>({37, 5}, 7)});
  check_op<T>("log_softmax", [](const L& x) { return log_softmax(x[0], 1); }, {r<T>({64, 10}, 8, -5, 5)});
}

TYPED_TEST(CudaOps, MatrixProductsAndLosses) {
  REQUIRE_GPU();
  using T = TypeParam;
  using L = std::vector<Tensor<T>>;
  check_op<T>("matmul", [](const L& x) { return matmul(x[0], x[1]); }, {r<T>({64, 48}, 1), r<T>({48, 32}, 2)});
  check_op<T>("matmul-t", [](const L& x) { return matmul(x[0].t(), x[1]); }, {r<T>({48, 64}, 3), r<T>({48, 32}, 4)});
  check_op<T>("matmul-nd", [](const L& x) { return matmul(x[0], x[1]); }, {r<T>({3, 20, 16}, 5), r<T>({16, 8}, 6)});
  check_op<T>("bmm", [](const L& x) { return matmul(x[0], x[1]); }, {r<T>({3, 20, 16}, 7), r<T>({3, 16, 8}, 8)});
  check_op<T>("linear", [](const L& x) { return linear(x[0], x[1], x[2]); },
              {r<T>({256, 128}, 9), r<T>({64, 128}, 10), r<T>({64}, 11)});
  check_op<T>("linear-nobias", [](const L& x) { return linear(x[0], x[1]); }, {r<T>({7, 5}, 12), r<T>({3, 5}, 13)});
  for (auto red : {Reduction::Mean, Reduction::Sum, Reduction::None}) {
    check_op<T>("mse", [red](const L& x) { return F::mse_loss(x[0], x[1], red); }, {r<T>({300, 7}, 14), r<T>({300, 7}, 15)});
    auto target = randint(0, 10, {300}).to(kGpu);
    auto target_cpu = target.to(Device::cpu());
    check_op<T>("cross_entropy",
                [&](const L& x) { return F::cross_entropy(x[0], x[0].device().is_cuda() ? target : target_cpu, red); },
                {r<T>({300, 10}, 16, -3, 3)});
    check_op<T>("nll", [&](const L& x) { return F::nll_loss(x[0], x[0].device().is_cuda() ? target : target_cpu, red); },
                {r<T>({300, 10}, 17)});
  }
  // A bad target is found by the kernel and reported at the next synchronisation
  // (Note [device-side validation]); the next loss works again.
  auto bad = from_vector<std::int64_t>({0, 12}).to(kGpu);
  EXPECT_TRUE(throws_with([&] { F::cross_entropy(zeros<T>({2, 10}, kGpu), bad).item(); },
                          {"cross_entropy", "target 12", "index 1", "10 classes", "cuda:0"}));
  EXPECT_TRUE(throws_with([&] { F::nll_loss(zeros<T>({3, 4}, kGpu), from_vector<std::int64_t>({0, 1, -2}).to(kGpu))
                                    .to(Device::cpu()); },
                          {"nll_loss", "target -2", "index 2", "4 classes"}));
  auto good = from_vector<std::int64_t>({0, 9}).to(kGpu);
  EXPECT_NEAR(F::cross_entropy(zeros<T>({2, 10}, kGpu), good).item(), std::log(10.0), 1e-5);
  // ignore_index rows take no part in the mean, also when counted on the device.
  auto some_ignored = from_vector<std::int64_t>({3, -100, 1}).to(kGpu);
  auto logits = r<T>({3, 5}, 99);
  EXPECT_NEAR(F::cross_entropy(logits.to(kGpu), some_ignored).item(),
              F::cross_entropy(logits, some_ignored.to(Device::cpu())).item(), 1e-5);
  auto all_ignored = from_vector<std::int64_t>({-100, -100}).to(kGpu);
  EXPECT_TRUE(std::isnan(F::cross_entropy(zeros<T>({2, 3}, kGpu), all_ignored).item()));
}

TYPED_TEST(CudaOps, ViewsCopiesAndJoins) {
  REQUIRE_GPU();
  using T = TypeParam;
  using L = std::vector<Tensor<T>>;
  check_op<T>("narrow", [](const L& x) { return x[0].narrow(1, 2, 3) * 1.0; }, {r<T>({6, 7}, 1)});
  check_op<T>("select", [](const L& x) { return x[0].select(0, 4) * 1.0; }, {r<T>({6, 7}, 2)});
  check_op<T>("transpose", [](const L& x) { return x[0].transpose(0, 2).contiguous(); }, {r<T>({3, 4, 5}, 3)});
  check_op<T>("index_select", [](const L& x) {
    auto idx = from_vector<std::int64_t>({4, 0, 4, 2}, x[0].device());
    return x[0].index_select(0, idx);
  }, {r<T>({6, 7}, 4)});
  check_op<T>("cat", [](const L& x) { return cat<T>({x[0], x[1]}, 1); }, {r<T>({5, 2}, 5), r<T>({5, 3}, 6)});
  check_op<T>("stack", [](const L& x) { return stack<T>({x[0], x[1]}, 0); }, {r<T>({5, 2}, 7), r<T>({5, 2}, 8)});
  check_op<T>("roundtrip", [](const L& x) { return x[0].to(Device::cpu()).to(x[0].device()) * 2.0; }, {r<T>({9}, 9)});
  auto a = r<T>({1000}, 10);
  EXPECT_EQ(a.to(kGpu).to(Device::cpu()).to_vector(), a.to_vector());
  EXPECT_TRUE(throws_with([&] { (void)(a + a.to(kGpu)); }, {"cpu:0", "cuda:0"}));
  auto m = r<T>({6, 7}, 11).to(kGpu);
  EXPECT_TRUE(throws_with([&] { m.index_select(1, from_vector<std::int64_t>({0, 7}).to(kGpu)).to_vector(); },
                          {"index_select", "index 7", "position 1", "dimension 1", "size 7"}));
  EXPECT_EQ(m.index_select(1, from_vector<std::int64_t>({6}).to(kGpu)).to(Device::cpu()).to_vector(),
            m.to(Device::cpu()).index_select(1, from_vector<std::int64_t>({6})).to_vector());
  EXPECT_TRUE(throws_with([&] { a.to(Device::cuda(cuda_device_count())); }, {"not available"}));
}

TEST(Cuda, LinearWithCublasLtMatchesTheCpuAlsoWithTf32) {
  REQUIRE_GPU();
  auto& stats = backend::cuda::lt_stats();
  auto x = r<float>({512, 256}, 1), w = r<float>({128, 256}, 2), b = r<float>({128}, 3);
  auto cpu = linear(x, w, b);
  auto xg = x.to(kGpu), wg = w.to(kGpu), bg = b.to(kGpu);
  const auto lt0 = stats.lt_calls.load(), fb0 = stats.fallbacks.load();
  auto fp32 = linear(xg, wg, bg).to(Device::cpu());
  EXPECT_EQ(stats.lt_calls.load(), lt0 + 1) << "the fused cuBLASLt path did not run";
  EXPECT_EQ(stats.fallbacks.load(), fb0);
  EXPECT_TRUE(all_close(fp32, cpu, 1e-4, 1e-4));
  cuda::set_allow_tf32(true);
  auto tf32 = linear(xg, wg, bg).to(Device::cpu());
  cuda::set_allow_tf32(false);
  EXPECT_EQ(stats.lt_calls.load(), lt0 + 2);
  EXPECT_TRUE(all_close(tf32, cpu, 2e-2, 2e-2));
  // TF32 really ran: its 10-bit mantissa products differ from FP32 somewhere in 65536 outputs of K = 256.
  EXPECT_FALSE(all_close(tf32, fp32, 0, 0)) << "TF32 gave bit-identical results: the flag was ignored";
  // Note [cuBLASLt plan cache]: the same shapes and alignments build no new plan.
  const auto plans = stats.plans_built.load();
  for (int i = 0; i < 5; ++i) (void)linear(xg, wg, bg);
  EXPECT_EQ(stats.plans_built.load(), plans);
}

TEST(Cuda, LinearOnMisalignedOperandsFallsBackOrRunsAligned) {
  REQUIRE_GPU();
  // Operands at element offsets inside one buffer, as DataParallel's flat layout had them before
  // its 256-byte padding (Note [cuBLASLt alignment]).
  auto& stats = backend::cuda::lt_stats();
  const std::int64_t M = 30, K = 5, N = 2;
  // (Inputs may overlap: b lies inside x.)
  auto flat = r<float>({1 + M * K + 1 + N * K + 8}, 21).to(kGpu);
  auto x = flat.narrow(0, 1, M * K).view({M, K});              // +4 bytes
  auto w = flat.narrow(0, 1 + M * K + 1, N * K).view({N, K});  // +608 bytes (32-byte aligned)
  auto b = flat.narrow(0, 10, N);                              // +40 bytes
  auto cpu = linear(x.to(Device::cpu()), w.to(Device::cpu()), b.to(Device::cpu()));
  const auto fb0 = stats.fallbacks.load();
  auto gpu = linear(x, w, b);
  EXPECT_GT(stats.fallbacks.load(), fb0) << "a bias at +40 bytes must not take the bias epilogue";
  EXPECT_TRUE(all_close(gpu.to(Device::cpu()), cpu, 1e-5, 1e-5));
  // Misaligned x and w with an aligned bias: cuBLASLt with the real alignments, or the fallback.
  auto b2 = r<float>({N}, 22).to(kGpu);
  auto cpu2 = linear(x.to(Device::cpu()), w.to(Device::cpu()), b2.to(Device::cpu()));
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(all_close(linear(x, w, b2).to(Device::cpu()), cpu2, 1e-5, 1e-5));
  synchronize(kGpu);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST(Cuda, TheTutorialsLinearUnderDataParallelOnTheGpu) {
  REQUIRE_GPU();
  struct Tutorial : nn::Module {
    nn::Linear fc;
    Tutorial() : fc(register_module("fc", nn::Linear(5, 2))) {}
    Tensor<float> forward(const Tensor<float>& x) { return fc(x); }
  };
  manual_seed(3);
  Tutorial single = nn::clone(Tutorial(), kGpu);
  std::vector<Device> devices = cuda_device_count() > 1 ? available_devices() : std::vector<Device>{kGpu, kGpu};
  DataParallel<Tutorial> dp(nn::clone(single, kGpu), devices);
  for (const auto& p : dp.module().named_parameters())  // Note [flat offsets are 256-byte aligned]
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p.tensor.as<float>().data()) % 256, 0u) << p.name;
  auto& stats = backend::cuda::lt_stats();
  for (int batch : {30, 10}) {
    auto x = randn<float>({batch, 5});
    single.zero_grad();
    dp.zero_grad();
    const auto lt0 = stats.lt_calls.load(), fb0 = stats.fallbacks.load();
    auto out = dp(x);
    synchronize(kGpu);
    // Which path the replicas' Linear took goes into the test's JSON (correctness is asserted
    // below; the Lt/TF32 test asserts the path on shapes cuBLASLt certainly takes).
    ::testing::Test::RecordProperty("batch" + std::to_string(batch) + "_lt_calls",
                                    std::to_string(stats.lt_calls.load() - lt0));
    ::testing::Test::RecordProperty("batch" + std::to_string(batch) + "_lt_fallbacks",
                                    std::to_string(stats.fallbacks.load() - fb0));
    auto ref = single.forward(x.to(kGpu));
    EXPECT_TRUE(all_close(out.to(Device::cpu()), ref.to(Device::cpu()), 1e-5, 1e-5)) << batch;
    out.sum().backward();
    ref.sum().backward();
    auto p = single.named_parameters(), q = dp.named_parameters();
    for (std::size_t i = 0; i < p.size(); ++i)
      EXPECT_TRUE(all_close(q[i].tensor.as<float>().grad().to(Device::cpu()),
                            p[i].tensor.as<float>().grad().to(Device::cpu()), 1e-5, 1e-5))
          << p[i].name << ", batch " << batch;
  }
  synchronize(kGpu);
}

// Note [GPU spans]: while a profiler records, the replicas' forward and backward spans are also
// timed by CUDA events and placed on their streams' GPU tracks, in stream order, after the host
// queued them.
TEST(Cuda, ProfilerPlacesTheReplicasSpansOnTheirStreamsGpuTracks) {
  REQUIRE_GPU();
  struct Net : nn::Module {
    nn::Linear fc1, fc2;
    Net() : fc1(register_module("fc1", nn::Linear(256, 256))), fc2(register_module("fc2", nn::Linear(256, 8))) {}
    Tensor<float> forward(const Tensor<float>& x) { return fc2(relu(fc1(x))); }
  };
  manual_seed(4);
  std::vector<Device> devices = cuda_device_count() > 1 ? available_devices() : std::vector<Device>{kGpu, kGpu};
  DataParallel<Net> dp(nn::clone(Net(), kGpu), devices);
  optim::SGD opt(dp.parameters(), {.lr = 0.01});
  const auto x = randn<float>({512, 256});
  auto prof = profiler::start();
  for (int step = 0; step < 2; ++step) {
    opt.zero_grad();
    dp(x).square().mean().backward();
    opt.step();
    prof.step();
  }
  const auto& p = prof.stop();
  std::map<int, std::vector<const profiler::Span*>> gpu;  // by track
  for (const auto& s : p.spans())
    if (p.tracks()[s.track].name.find("(GPU)") != std::string::npos) gpu[s.track].push_back(&s);
  ASSERT_FALSE(gpu.empty()) << "no span on a GPU track";
  for (std::size_t r = 0; r < devices.size(); ++r) {
    const std::string name = "forward replica " + std::to_string(r);
    const profiler::Span *host = nullptr, *on_gpu = nullptr;
    for (const auto& s : p.spans())
      if (s.name == name && s.step == 1) (p.tracks()[s.track].name.find("(GPU)") == std::string::npos ? host : on_gpu) = &s;
    ASSERT_TRUE(host && on_gpu) << name;
    EXPECT_EQ(on_gpu->device, devices[r].str());
    EXPECT_GE(on_gpu->end_ns, on_gpu->start_ns) << name;
    EXPECT_GE(on_gpu->start_ns, host->start_ns - 1'000'000) << name << ": ran on the GPU before it was queued";
  }
  bool backward = false;
  for (auto& [track, spans] : gpu) {
    std::sort(spans.begin(), spans.end(), [](auto* a, auto* b) { return a->start_ns < b->start_ns; });
    std::vector<std::int64_t> open;  // a stream runs in order: its spans nest or follow
    for (const auto* s : spans) {
      backward |= s->category == profiler::Category::backward;
      while (!open.empty() && open.back() <= s->start_ns) open.pop_back();
      if (!open.empty()) EXPECT_LE(s->end_ns, open.back() + 1000) << p.tracks()[track].name << ": " << s->name;
      open.push_back(s->end_ns);
    }
  }
  EXPECT_TRUE(backward) << "no backward span on a GPU track";
}

TEST(Cuda, MoreThan65535RowsAndTwoDimensionalReductions) {
  REQUIRE_GPU();
  using L = std::vector<Tensor<double>>;
  // Grids are capped at 65,535 blocks: rows beyond that are visited by the grid-stride loops.
  check_op<double>("sum1-70000", [](const L& x) { return x[0].sum(1); }, {r<double>({70000, 3}, 1)});
  check_op<double>("softmax-70000", [](const L& x) { return softmax(x[0], 1); }, {r<double>({70000, 5}, 2)});
  auto target = randint(0, 4, {70000});
  check_op<double>("ce-70000", [&](const L& x) {
    return F::cross_entropy(x[0], x[0].device().is_cuda() ? target.to(kGpu) : target, Reduction::Sum);
  }, {r<double>({70000, 4}, 3)}, 1e-8);
  // Note [2-D reductions]: column sums split over row chunks (the bias gradient of a wide
  // layer), few long rows split over blocks, and softmax over a non-last dimension.
  check_op<double>("sum0-wide", [](const L& x) { return x[0].sum(0); }, {r<double>({8193, 300}, 4)}, 1e-9);
  check_op<double>("sum1-long", [](const L& x) { return x[0].sum(1); }, {r<double>({3, 300001}, 5)}, 1e-9);
  check_op<double>("sum-mid", [](const L& x) { return x[0].sum(1); }, {r<double>({3, 2000, 70}, 6)}, 1e-9);
  check_op<double>("softmax-mid", [](const L& x) { return softmax(x[0], 1); }, {r<double>({4, 50, 40}, 7)});
  check_op<double>("log_softmax-mid", [](const L& x) { return log_softmax(x[0], 1); }, {r<double>({3, 20, 33}, 8)});
  // The backward of a broadcast (sum_to): a bias added to [rows, features], and a middle axis.
  check_op<double>("bias-add", [](const L& x) { return x[0] + x[1]; }, {r<double>({8192, 96}, 12), r<double>({96}, 13)},
                   1e-9);
  check_op<double>("mid-broadcast", [](const L& x) { return x[0] * x[1]; },
                   {r<double>({6, 700, 40}, 14), r<double>({6, 1, 40}, 15)}, 1e-9);
  using Lf = std::vector<Tensor<float>>;
  check_op<float>("linear-bias-grad", [](const Lf& x) { return linear(x[0], x[1], x[2]); },
                  {r<float>({4096, 64}, 9), r<float>({512, 64}, 10), r<float>({512}, 11)}, 2e-3);
}

namespace {
struct Mlp : nn::Module {
  nn::Linear a, b;
  Mlp() : a(register_module("a", nn::Linear(32, 64))), b(register_module("b", nn::Linear(64, 4))) {}
  Tensor<float> forward(const Tensor<float>& x) { return b(relu(a(x))); }
};
}  // namespace

TEST(Cuda, AnMlpTrainingStepMatchesTheCpu) {
  REQUIRE_GPU();
  manual_seed(1);
  Mlp cpu;
  Mlp gpu = nn::clone(cpu, kGpu);
  optim::SGD opt_c(cpu.parameters(), {.lr = 0.1, .momentum = 0.9});
  optim::Adam opt_g(gpu.parameters(), {.lr = 0.1});
  optim::Adam opt_c2(cpu.parameters(), {.lr = 0.1});
  (void)opt_c;
  auto x = randn<float>({128, 32}), y = randn<float>({128, 4});
  for (int step = 0; step < 3; ++step) {
    auto lc = F::mse_loss(cpu.forward(x), y);
    opt_c2.zero_grad();
    lc.backward();
    opt_c2.step();
    auto lg = F::mse_loss(gpu.forward(x.to(kGpu)), y.to(kGpu));
    opt_g.zero_grad();
    lg.backward();
    opt_g.step();
    EXPECT_NEAR(lg.item(), lc.item(), 1e-4 * (1 + std::abs(lc.item())));
  }
  auto pc = cpu.named_parameters(), pg = gpu.named_parameters();
  for (std::size_t i = 0; i < pc.size(); ++i)
    EXPECT_TRUE(all_close(pg[i].tensor.as<float>().to(Device::cpu()), pc[i].tensor.as<float>(), 1e-4, 1e-5))
        << pc[i].name;
}

// Amsgrad's running max keeps a NaN on the GPU as on the CPU (torch.maximum); CUDA's max() drops it.
TEST(Cuda, AmsgradMaxKeepsNaN) {
  REQUIRE_GPU();
  auto p = zeros<float>({2}, kGpu).requires_grad_();
  optim::Adam opt({p}, {.lr = 0.1, .amsgrad = true});
  p.set_grad(from_vector<float>({std::numeric_limits<float>::quiet_NaN(), 1.0f}).to(kGpu));
  opt.step();
  auto vmax = opt.state()[0].at("max_exp_avg_sq").as<float>().to_vector();
  EXPECT_TRUE(std::isnan(vmax[0]));
  EXPECT_FALSE(std::isnan(vmax[1]));
}

TEST(Cuda, TheCachingAllocatorReusesMemoryInTheSteadyState) {
  REQUIRE_GPU();
  // With CHORUS_CUDA_CACHING_ALLOCATOR=0 (what gpu-check runs under compute-sanitizer) every
  // allocation is a system allocation: that is checked instead of the pool's reuse.
  const bool caching = chorus::detail::caching_allocator_enabled();
  const auto base = memory_stats(kGpu);
  const auto events_before = cuda::EventPool::get().created();
  {
    Mlp m = nn::clone(Mlp(), kGpu);
    optim::SGD opt(m.parameters(), {.lr = 0.01});
    auto x = randn<float>({256, 32}, kGpu), y = randn<float>({256, 4}, kGpu);
    auto step = [&] {
      auto loss = F::mse_loss(m.forward(x), y);
      opt.zero_grad();
      loss.backward();
      opt.step();
    };
    step();
    step();
    synchronize(kGpu);
    const auto warm = memory_stats(kGpu);
    const auto events_warm = cuda::EventPool::get().created();
    for (int i = 0; i < 5; ++i) step();
    synchronize(kGpu);
    const auto after = memory_stats(kGpu);
    EXPECT_GT(after.num_allocs, warm.num_allocs);
    if (caching) {
      EXPECT_EQ(after.num_system_allocs, warm.num_system_allocs) << "the pool grew in the steady state";
      EXPECT_EQ(after.reserved, warm.reserved);
    } else {
      EXPECT_EQ(after.num_system_allocs - warm.num_system_allocs, after.num_allocs - warm.num_allocs)
          << "without caching every allocation goes to cudaMalloc";
    }
    EXPECT_GE(after.peak_allocated, after.allocated);
    EXPECT_GE(after.reserved, after.allocated);
    // Events come from the pool: the steady state creates none (item: pooled events).
    EXPECT_EQ(cuda::EventPool::get().created(), events_warm);
  }
  (void)events_before;
  EXPECT_EQ(memory_stats(kGpu).allocated, base.allocated);
}

TEST(Cuda, EventsOrderWorkAcrossStreams) {
  REQUIRE_GPU();
  Stream& s1 = get_stream(kGpu, 1);
  auto big = zeros<float>({1 << 22}, kGpu);  // filled on this thread's current stream...
  Event filled;
  filled.record(current_stream(kGpu));
  // ...which stream 1 must wait for before overwriting it; the zeros are kept busy behind a spin
  // so that an unordered copy would land first and be overwritten by them.
  spin(current_stream(kGpu), 50);
  (void)big.fill_(0.0f);
  filled.record(current_stream(kGpu));
  s1.async([&] {
      filled.block(s1);
      auto t = full<float>({1 << 22}, 3.0f, kGpu);  // on stream 1
      big.copy_(t);
    }).get();
  Event e;
  e.record(s1);
  e.block(current_stream(kGpu));
  EXPECT_EQ(big.sum().item(), 3.0f * (1 << 22));
}

TEST(Cuda, AQueryOfUnfinishedWorkLeavesNoErrorBehind) {
  REQUIRE_GPU();
  // Note [tolerated CUDA errors]: cudaEventQuery answers cudaErrorNotReady while work runs.
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  Stream& s = current_stream(kGpu);
  spin(s, 100);
  Event e;
  e.record(s);
  EXPECT_FALSE(e.query());
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "Event::query left cudaErrorNotReady in the last-error slot";
  e.synchronize();
  EXPECT_TRUE(e.query());
  // A block used by another stream and freed while that stream still runs: the free waits, and
  // leaves no error behind either.
  {
    auto t = zeros<float>({1024}, kGpu);
    Stream& other = get_stream(kGpu, 2);
    spin(other, 50);
    record_stream(t.data(), kGpu, other);
  }
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  synchronize(kGpu);
}

TEST(Cuda, ALossDoesNotWaitForTheDevice) {
  REQUIRE_GPU();
  // Item: no host synchronisation per loss (Note [device-side validation]). The stream is kept
  // busy; computing the losses and their backward must return while it still is.
  auto logits = randn<float>({256, 10}, kGpu).requires_grad_(true);
  auto target = randint(0, 10, {256}, kGpu);
  auto idx = from_vector<std::int64_t>({3, 1}, kGpu);
  auto step = [&] {
    for (auto red : {Reduction::Mean, Reduction::Sum}) {
      auto ce = F::cross_entropy(logits, target, red);
      auto nll = F::nll_loss(log_softmax(logits, 1), target, red);
      (ce + nll).backward();
    }
    (void)logits.detach().index_select(0, idx);
  };
  step();  // first use: handles, the assert record, pool growth
  synchronize(kGpu);
  Stream& s = current_stream(kGpu);
  spin(s, 300);
  Event busy;
  busy.record(s);
  step();
  // Without the caching allocator cudaFree synchronises, and CHORUS_DEBUG_SYNC syncs every
  // launch on purpose: only the normal configuration can show it.
  if (chorus::detail::caching_allocator_enabled() && !cuda::debug_sync_enabled())
    EXPECT_FALSE(busy.query()) << "a loss, its backward or index_select waited for the device";
  synchronize(kGpu);
  EXPECT_TRUE(logits.grad().defined());
}

TEST(Cuda, PeerAccessIsEnabledForEveryPairThatCan) {
  REQUIRE_GPU();
  // Note [peer access]: between the devices in use, each connected as the next one is used.
  const int n = cuda_device_count();
  for (int d = 0; d < n; ++d) (void)allocator_of(Device::cuda(d));
  for (int d = 0; d < n; ++d) {
    auto& alloc = static_cast<CudaCachingAllocator&>(allocator_of(Device::cuda(d)));
    std::vector<int> expected;
    for (int p = 0; p < n; ++p) {
      if (p == d) continue;
      int a = 0, b = 0;
      CHORUS_CUDA_CHECK(cudaDeviceCanAccessPeer(&a, d, p));
      CHORUS_CUDA_CHECK(cudaDeviceCanAccessPeer(&b, p, d));
      if (a || b) expected.push_back(p);
      if (b && chorus::detail::caching_allocator_enabled()) {  // the peer may use this device's pool
        cudaMemPool_t pool;
        CHORUS_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, d));
        cudaMemLocation loc{};
        loc.type = cudaMemLocationTypeDevice;
        loc.id = p;
        cudaMemAccessFlags flags{};
        CHORUS_CUDA_CHECK(cudaMemPoolGetAccess(&flags, pool, &loc));
        EXPECT_EQ(flags, cudaMemAccessFlagsProtReadWrite) << "cuda:" << p << " on cuda:" << d << "'s pool";
      }
    }
    EXPECT_EQ(alloc.peers(), expected) << "cuda:" << d;  // one GPU: none
  }
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST(Cuda, CrossDeviceCopiesRecordTheirStreamUnderItsOwnDevice) {
  REQUIRE_GPU();
  // Note [cross-device stream uses]: a peer copy's source is used by the destination device's
  // stream; freeing the source must record that use under the destination device. With one GPU
  // the same path runs between two streams of cuda:0.
  const Device other = cuda_device_count() > 1 ? Device::cuda(1) : kGpu;
  for (int i = 0; i < 20; ++i) {
    auto dst = Tensor<float>::empty({1 << 20}, other);
    Event allocated;  // dst belongs to slot 0; stream 3 writes it (Note [allocate on the stream that writes])
    allocated.record(current_stream(other));
    {
      auto src = full<float>({1 << 20}, static_cast<float>(i), kGpu);
      // With one GPU the guard below makes ds the source's current stream too, so the copy does
      // not order itself after the fill on slot 0 (with two it does): ds waits for it here.
      Event filled;
      filled.record(current_stream(kGpu));
      Stream& ds = get_stream(other, 3);
      StreamGuard g(ds);
      allocated.block(ds);
      filled.block(ds);
      spin(ds, 2);  // the copy stays queued while src is freed
      copy_bytes(dst.data(), other, src.data(), kGpu, sizeof(float) << 20);  // what src.to(other) does
      Event copied;
      copied.record(ds);
      copied.block(get_stream(other, 0));  // the sum below runs on slot 0 (current_stream is ds here)
    }  // src freed here, while the copy may still be reading it
    auto junk = full<float>({1 << 20}, -1.0f, kGpu);  // would reuse src's memory if the free did not wait
    EXPECT_EQ(dst.sum().item(), static_cast<float>(i) * (1 << 20)) << "iteration " << i;
  }
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST(Cuda, CommunicatorsOnOneGpuAndOnARepeatedGpuSet) {
  REQUIRE_GPU();
  {  // NCCL on a single GPU (one rank)
    backend::cuda::NcclComms comms({0});
    auto buf = arange<float>(8).to(kGpu);
    comms.all_reduce({buf.data()}, 8, DType::Float32, {current_stream(kGpu).handle()});
    EXPECT_EQ(buf.to_vector(), arange<float>(8).to_vector());
    EXPECT_TRUE(throws_with([] { backend::cuda::NcclComms({0, 0}); }, {"appears twice", "copy path"}));
  }
  {  // the copy path, {cuda:0, cuda:0, cuda:0}
    std::vector<Stream*> streams = {&get_stream(kGpu, 0), &get_stream(kGpu, 1), &get_stream(kGpu, 2)};
    parallel::CopyCommunicator comm(streams);
    auto src = arange<float>(100).to(kGpu);
    std::vector<AnyTensor> dsts = {zeros<float>({100}, kGpu), zeros<float>({100}, kGpu)};
    comm.broadcast(src, dsts);
    for (auto* s : streams) s->synchronize();
    for (auto& d : dsts) EXPECT_EQ(d.as<float>().to_vector(), src.to_vector());
    std::vector<std::vector<AnyTensor>> srcs = {{full<float>({3}, 1.0f, kGpu)}, {full<float>({3}, 2.0f, kGpu)}};
    std::vector<AnyTensor> out = {zeros<float>({3}, kGpu)};
    comm.reduce_add(srcs, out);
    EXPECT_EQ(out[0].as<float>().to_vector(), std::vector<float>(3, 3.0f));
  }
}

TEST(Cuda, NcclCollectivesFromManyThreadsAreIssuedOneAtATime) {
  REQUIRE_GPU();
  // Note [one NCCL issuer at a time]: buckets reduce from several worker threads. Every rank must
  // see one order; with one GPU this checks that concurrent issues are all serialised and right,
  // with several it also runs them across distinct GPUs (where an interleaving would hang).
  std::vector<int> devs;
  for (int d = 0; d < cuda_device_count(); ++d) devs.push_back(d);
  backend::cuda::NcclComms comms(devs);
  constexpr int kThreads = 8, kRounds = 20;
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      try {
        std::vector<Tensor<float>> bufs;
        std::vector<void*> ptrs;
        std::vector<cudaStream_t> streams;
        for (int d : devs) {
          bufs.push_back(full<float>({1000}, static_cast<float>(t + 1), Device::cuda(d)));
          ptrs.push_back(bufs.back().data());
          streams.push_back(get_stream(Device::cuda(d), 10 + t).handle());
        }
        for (int d : devs) synchronize(Device::cuda(d));
        for (int round = 0; round < kRounds; ++round) comms.all_reduce(ptrs, 1000, DType::Float32, streams);
        for (std::size_t i = 0; i < devs.size(); ++i) {
          CHORUS_CUDA_CHECK(cudaStreamSynchronize(streams[i]));
          const double expect = (t + 1) * std::pow(static_cast<double>(devs.size()), kRounds);
          for (float v : bufs[i].to(Device::cpu()).to_vector())
            if (std::abs(v - expect) > 1e-5 * expect) {
              ++failures;
              break;
            }
        }
      } catch (...) {
        ++failures;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(comms.issued(), kThreads * kRounds);
}

TEST(Cuda, NcclBroadcastOrdersTheRootsNextWriteAfterItsRead) {
  REQUIRE_GPU();
  // Item: the root's NCCL read of the primary is joined back into the root's stream. The
  // communication stream is kept busy, so the broadcast's read is still pending; work recorded
  // on the root's stream after broadcast() must not be complete before it.
  std::vector<Stream*> streams;
  for (int d = 0; d < cuda_device_count(); ++d) streams.push_back(&get_stream(Device::cuda(d), 0));
  parallel::NcclCommunicator comm(streams);
  auto src = arange<float>(64).to(kGpu);
  std::vector<AnyTensor> dsts;
  for (int d = 1; d < cuda_device_count(); ++d) dsts.push_back(zeros<float>({64}, Device::cuda(d)));
  synchronize(kGpu);
  spin(get_stream(kGpu, parallel::NcclCommunicator::kCommSlot), 200);
  comm.broadcast(src, dsts);
  Event after;
  after.record(current_stream(kGpu));
  EXPECT_FALSE(after.query()) << "the root's stream does not wait for the broadcast's read of the primary";
  (void)src.fill_(-1.0f);  // the root's next write: ordered after the read
  for (int d = 0; d < cuda_device_count(); ++d) synchronize(Device::cuda(d));
  for (auto& t : dsts) EXPECT_EQ(t.as<float>().to_vector(), arange<float>(64).to_vector());
}

template <class T>
class CudaDataParallel : public ::testing::Test {};
TYPED_TEST_SUITE(CudaDataParallel, chorus::testing::FloatTypes);

TYPED_TEST(CudaDataParallel, RepeatedGpuSetsEqualTheSingleGpuRun) {
  REQUIRE_GPU();
  using T = TypeParam;
  struct Net : nn::Module {
    nn::LinearT<T> a, b;
    Net() : a(register_module("a", nn::LinearT<T>(6, 16))), b(register_module("b", nn::LinearT<T>(16, 3))) {}
    Tensor<T> forward(const Tensor<T>& x) { return b(chorus::tanh(a(x))); }
  };
  const double tol = chorus::testing::tol<T>() * 10;
  for (int k : {2, 3}) {
    manual_seed(static_cast<std::uint64_t>(k));
    Net single = nn::clone(Net(), kGpu);
    std::vector<Device> devices(static_cast<std::size_t>(k), kGpu);
    DataParallel<Net> dp(nn::clone(single, kGpu), devices);
    for (int batch : {1, 7, 3 * k + 1}) {
      auto x = randn<T>({batch, 6}), w = randn<T>({batch, 3});
      single.zero_grad();
      dp.zero_grad();
      auto ref = single.forward(x.to(kGpu));
      auto out = dp(x);  // host input, copied chunk by chunk
      EXPECT_TRUE(all_close(out.to(Device::cpu()), ref.to(Device::cpu()), tol, tol)) << k << " x " << batch;
      (ref * w.to(kGpu)).sum().backward();
      (out * w.to(kGpu)).sum().backward();
      auto p = single.named_parameters(), q = dp.named_parameters();
      for (std::size_t i = 0; i < p.size(); ++i)
        EXPECT_TRUE(all_close(q[i].tensor.template as<T>().grad().to(Device::cpu()),
                              p[i].tensor.template as<T>().grad().to(Device::cpu()), tol, tol))
            << p[i].name << ", " << k << " replicas, batch " << batch;
    }
  }
}

// DataLoader pin_memory: batches land in page-locked host memory (cudaHostAlloc), hold the
// same values as unpinned ones, and copy to the GPU intact; the blocks are reused.
TEST(Cuda, DataLoaderPinsBatches) {
  REQUIRE_GPU();
  auto ds = data::TensorDataset<float, std::int64_t>(randn<float>({40, 3}), arange<std::int64_t>(40));
  data::DataLoader plain(ds, {.batch_size = 8, .num_workers = 2});
  data::DataLoader pinned(ds, {.batch_size = 8, .num_workers = 2, .pin_memory = true});
  std::vector<std::vector<float>> a, b;
  for (const auto& x : plain) a.push_back(x.data.to_vector());
  for (int epoch = 0; epoch < 2; ++epoch)
    for (const auto& x : pinned) {
      cudaPointerAttributes attr{};
      ASSERT_EQ(cudaPointerGetAttributes(&attr, x.data.data()), cudaSuccess);
      EXPECT_EQ(attr.type, cudaMemoryTypeHost);
      if (epoch == 0) b.push_back(x.data.to(kGpu).to(Device::cpu()).to_vector());
    }
  EXPECT_EQ(a, b);
  const auto stats = data::pinned_host_allocator().stats();
  EXPECT_LT(stats.num_system_allocs, stats.num_allocs);  // later batches reuse earlier blocks
}

// Note [pinning workers' device]: the workers pin (cudaHostAlloc) on the consumer's current
// device, not on device 0, where a first CUDA call from a new thread would create a context.
TEST(Cuda, DataLoaderWorkersRunOnTheConsumersDevice) {
  REQUIRE_GPU();
  // With one GPU the consumer's device is device 0, where a worker would land anyway: the test
  // then checks only that the workers run and pin there, and says so (a skip would read as a
  // test that did not run on a GPU machine).
  const int consumer = cuda_device_count() >= 2 ? 1 : 0;
  if (consumer == 0) std::cout << "[ one GPU  ] the consumer's device is device 0: checked on it alone\n";
  struct RecordsDevice {
    std::shared_ptr<std::atomic<int>> seen = std::make_shared<std::atomic<int>>(-1);
    std::size_t size() const { return 8; }
    Tensor<float> get(std::size_t i) const {
      int d = -1;
      if (cudaGetDevice(&d) == cudaSuccess) seen->store(d);
      return full<float>({2}, static_cast<float>(i));
    }
  };
  RecordsDevice ds;
  int prev = 0;
  ASSERT_EQ(cudaGetDevice(&prev), cudaSuccess);
  ASSERT_EQ(cudaSetDevice(consumer), cudaSuccess);
  {
    data::DataLoader loader(ds, {.batch_size = 4, .num_workers = 2, .pin_memory = true});
    for (const auto& b : loader) EXPECT_EQ(b.numel(), 8);
  }
  ASSERT_EQ(cudaSetDevice(prev), cudaSuccess);
  EXPECT_EQ(ds.seen->load(), consumer);
}

#include "test_cuda_ordering.cuh"
