// The distributed layer on GPUs (compiled by nvcc; every test skips without a GPU). Run by
// scripts/gpu-check-distributed.sh under `mpirun -np 1` and under torchrun's environment: with a
// launcher, CUDA tensors go through NCCL even in a world of one process, so one GPU exercises
// the NCCL path (communicator, stream ordering, watchdog polling) that a large job uses.
#include <chorus/distributed.hpp>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <thread>

using namespace chorus;

namespace {

#define REQUIRE_GPU()                                                       \
  do {                                                                      \
    if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine"; \
  } while (0)

/// Keeps `stream` busy for about `ms` milliseconds (to observe what waits for what).
__global__ void spin_kernel(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}
void spin(cudaStream_t stream, int device, double ms) {
  cuda::DeviceGuard g(device);
  int khz = 0;
  CHORUS_CUDA_CHECK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, device));
  if (khz <= 0) khz = 2'000'000;  // not reported: assume 2 GHz (an H200 boosts to 1.98)
  spin_kernel<<<1, 1, 0, stream>>>(static_cast<long long>(ms * khz));
  CHORUS_CUDA_CHECK(cudaGetLastError());
}
void spin(Device d, double ms) { spin(current_stream(d).handle(), d.index, ms); }

double ms_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}

struct Mlp : nn::Module {
  nn::Linear fc1, fc2;
  Mlp() : fc1(register_module("fc1", nn::Linear(16, 64))), fc2(register_module("fc2", nn::Linear(64, 4))) {}
  Tensor<float> forward(const Tensor<float>& x) { return fc2(relu(fc1(x))); }
};

TEST(DistributedCuda, CollectivesOnCudaTensors) {
  REQUIRE_GPU();
  auto& pg = dist::group();
  const int w = pg.world_size(), r = pg.rank();
  const Device dev = pg.default_device();
  ASSERT_TRUE(dev.is_cuda());
  auto t = from_vector(std::vector<float>{float(r + 1), 2.0f}).to(dev);
  pg.all_reduce(t, dist::ReduceOp::Sum);
  EXPECT_EQ(t.to(Device::cpu()).to_vector(), (std::vector<float>{float(w * (w + 1) / 2), float(2 * w)}));
  auto a = full<double>({1000}, 3.0, dev);
  pg.all_reduce(a, dist::ReduceOp::Avg);
  EXPECT_EQ(a.to(Device::cpu()).to_vector()[999], 3.0);
  auto b = full<float>({8}, float(r), dev);
  pg.broadcast(b, 0);
  EXPECT_EQ(b.to(Device::cpu()).to_vector()[7], 0.0f);
  auto g = pg.all_gather(full<float>({3}, float(r), dev));
  ASSERT_EQ(g.shape(), Shape({w, 3}));
  EXPECT_EQ(g.to(Device::cpu()).to_vector()[3 * w - 1], float(w - 1));
  // CPU tensors in the same job (MPI, or staged through the GPU under torchrun).
  auto c = full<float>({2}, 1.0f);
  pg.all_reduce(c, dist::ReduceOp::Sum);
  EXPECT_EQ(c.to_vector()[0], float(w));
  pg.barrier();
}

TEST(DistributedCuda, DdpOnTheGpuEqualsPlainTraining) {
  REQUIRE_GPU();
  auto& pg = dist::group();
  const Device dev = pg.default_device();
  const int w = pg.world_size(), r = pg.rank();
  manual_seed(1);
  auto x = randn<float>({8 * w, 16}).to(dev);
  auto y = randn<float>({8 * w, 4}).to(dev);
  manual_seed(2);
  Mlp plain;
  plain.to(dev);
  manual_seed(2);
  Mlp wrapped;
  wrapped.to(dev);
  DistributedDataParallel<Mlp> ddp(std::move(wrapped), {.first_bucket_bytes = 1024});
  optim::SGD opt(ddp.parameters(), {.lr = 0.05, .momentum = 0.9});
  optim::SGD ref_opt(plain.parameters(), {.lr = 0.05, .momentum = 0.9});
  for (int step = 0; step < 4; ++step) {
    auto loss = nn::functional::mse_loss(ddp(x.narrow(0, 8 * r, 8)), y.narrow(0, 8 * r, 8));
    opt.zero_grad();
    loss.backward();
    opt.step();
    auto ref = nn::functional::mse_loss(plain.forward(x), y);
    ref_opt.zero_grad();
    ref.backward();
    ref_opt.step();
  }
  EXPECT_TRUE(ddp.buckets_rebuilt());
  auto a = ddp.parameters(), b = plain.parameters();
  for (std::size_t i = 0; i < a.size(); ++i) {
    auto u = a[i].as<float>().to(Device::cpu()).to_vector(), v = b[i].as<float>().to(Device::cpu()).to_vector();
    for (std::size_t k = 0; k < u.size(); ++k) ASSERT_NEAR(u[k], v[k], 1e-4) << "parameter " << i;
  }
}

// PyTorch's fp16_compress / bf16_compress hooks over NCCL: each float32 bucket goes over the wire
// in 16 bits, divided by the world size first, and comes back into the float32 bucket; every
// rank's gradient is the 16-bit sum of the others' (computed here from all ranks' local
// gradients, gathered), rounded as NCCL's 16-bit sums round (to within one rounding per rank).
template <class Wire>
void check_compress_hook_on_gpu(dist::CommHook hook) {
  auto& pg = dist::group();
  const Device dev = pg.default_device();
  const int w = pg.world_size(), r = pg.rank();
  manual_seed(3);
  Mlp plain;
  plain.to(dev);
  manual_seed(3);
  Mlp wrapped;
  wrapped.to(dev);
  DistributedDataParallel<Mlp> ddp(std::move(wrapped), {.first_bucket_bytes = 1024});
  ddp.register_comm_hook(hook);
  manual_seed(40 + r);
  auto x = randn<float>({8, 16}).to(dev), y = randn<float>({8, 4}).to(dev);
  nn::functional::mse_loss(plain.forward(x), y).backward();
  nn::functional::mse_loss(ddp(x), y).backward();
  auto a = ddp.parameters(), b = plain.parameters();
  ASSERT_EQ(a.size(), b.size());
  const double eps = std::ldexp(1.0, 1 - std::numeric_limits<Wire>::digits);
  for (std::size_t i = 0; i < a.size(); ++i) {
    auto local = b[i].as<float>().grad();
    auto every = pg.all_gather(local);  // [w, ...] float32: the reference's inputs
    auto got = a[i].as<float>().grad().to(Device::cpu()).to_vector();
    auto all = every.to(Device::cpu()).to_vector();
    const std::size_t n = got.size();
    double scale = 0;
    for (float v : all) scale = std::max(scale, std::abs(double(v)));
    for (std::size_t k = 0; k < n; ++k) {
      double exact = 0;
      for (int q = 0; q < w; ++q) exact += all[q * n + k] / w;
      if (w == 1) {  // one rank: the value divided by 1, rounded once to 16 bits and back
        ASSERT_EQ(got[k], static_cast<float>(Wire(all[k]))) << "parameter " << i << " [" << k << "]";
      }
      ASSERT_NEAR(got[k], exact, (w + 1) * eps * scale) << "parameter " << i << " [" << k << "]";
    }
  }
}

TEST(DistributedCuda, Fp16CompressHookOverNccl) {
  REQUIRE_GPU();
  check_compress_hook_on_gpu<chorus::half>(dist::CommHook::fp16_compress);  // cuda_fp16.h has a global `half`
}
TEST(DistributedCuda, Bf16CompressHookOverNccl) {
  REQUIRE_GPU();
  check_compress_hook_on_gpu<bfloat16>(dist::CommHook::bf16_compress);
}

// Issue 17, item 1: waiting for a collective whose GPU work is still queued must not leave
// cudaErrorNotReady in the last-error slot (the next check_launch would throw "device not
// ready"): the device stays busy behind a spin while each kind of wait happens.
TEST(DistributedCuda, WaitingLeavesNoErrorInTheLastErrorSlot) {
  REQUIRE_GPU();
  auto& pg = dist::group();
  const Device dev = pg.default_device();
  const int w = pg.world_size();
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  auto t = full<float>({256}, 1.0f, dev);
  spin(dev, 100);
  pg.all_reduce(t, dist::ReduceOp::Sum);  // CUDA tensor: the stream waits
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  spin(dev, 100);
  auto c = full<float>({4}, 2.0f);
  pg.all_reduce(c, dist::ReduceOp::Sum);  // CPU tensor: MPI, or staged through the GPU and waited for on the host
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  spin(dev, 100);
  pg.barrier();
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_NO_THROW(cuda::check_launch("the launch after the collectives"));
  auto after = full<double>({8}, 3.0, dev);  // the first DDP step's next allocation and kernel
  EXPECT_EQ(t.to(Device::cpu()).to_vector()[255], float(w));
  EXPECT_EQ(c.to_vector()[3], 2.0f * w);
  EXPECT_EQ(after.to(Device::cpu()).to_vector()[7], 3.0);
}

// Predicted slow (issue 17): wait() on a CUDA collective orders the stream and returns; it does
// not spin on the host until the GPU is done, and makes no CUDA event per collective.
TEST(DistributedCuda, WaitOrdersTheStreamWithoutHoldingTheHost) {
  REQUIRE_GPU();
  auto& pg = dist::group();
  const Device dev = pg.default_device();
  const int w = pg.world_size();
  auto t = full<float>({1024}, 1.0f, dev);
  pg.all_reduce(t);  // the communicator exists
  spin(dev, 400);
  const auto t0 = std::chrono::steady_clock::now();
  auto work = pg.all_reduce_async(t, dist::ReduceOp::Sum);
  work->wait(pg.timeout());
  EXPECT_LT(ms_since(t0), 200.0) << "wait() held the host until the GPU finished";
  Event e;
  e.record(current_stream(dev));
  EXPECT_FALSE(e.query()) << "the stream was not kept busy: the timing above proves nothing";
  EXPECT_EQ(t.to(Device::cpu()).to_vector()[1023], float(w * w)) << "the result is ordered on the stream";
  // The steady state creates no events (they come from the pool; the watchdog hands each back
  // once it saw it complete, so the measured loop lets it catch up every time).
  auto step = [&] {
    pg.all_reduce_async(t)->wait(pg.timeout());
    synchronize(dev);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  };
  for (int k = 0; k < 5; ++k) step();
  const auto created = cuda::EventPool::get().created();
  for (int k = 0; k < 20; ++k) step();
  EXPECT_EQ(cuda::EventPool::get().created(), created);
}

// Issue 17, item 7: a Work dropped without wait() must not free buffers that NCCL's stream still
// uses: the free is ordered after the communicator's stream, not only the issuing stream.
TEST(DistributedCuda, AnUnwaitedCollectiveKeepsItsBuffersUntilNcclIsDone) {
  REQUIRE_GPU();
  if (!::chorus::detail::caching_allocator_enabled())
    GTEST_SKIP() << "CHORUS_CUDA_CACHING_ALLOCATOR=0: frees are synchronous, nothing to order";
  auto& pg = dist::group();
  const Device dev = pg.default_device();
  {
    auto warm = full<float>({4}, 1.0f, dev);
    pg.all_reduce(warm);
  }
  synchronize(dev);
  ASSERT_NE(pg.nccl_stream(), nullptr);
  spin(pg.nccl_stream(), dev.index, 300);  // NCCL's stream is busy; the current stream is not
  {
    auto t = full<float>({1 << 16}, 1.0f, dev);
    (void)pg.all_reduce_async(t, dist::ReduceOp::Sum);  // dropped at once, with t
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // what the current stream has runs meanwhile
  Event e;
  e.record(current_stream(dev));
  EXPECT_FALSE(e.query()) << "t's block was freed for reuse on the current stream while NCCL's stream still had it";
  synchronize(dev);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

// Issue 17, item 4: a non-blocking communicator is finalised, polled until done, then destroyed.
// A second group in the same process comes and goes twice, and the job's group still works.
TEST(DistributedCuda, AGroupTearsDownItsCommunicatorCleanly) {
  REQUIRE_GPU();
  auto& pg = dist::group();
  if (pg.world_size() != 1) GTEST_SKIP() << "a second communicator per process is tested in a world of one";
  for (int round = 0; round < 2; ++round) {
    dist::ProcessGroup second;
    auto t = full<float>({16}, 2.0f, second.default_device());
    second.all_reduce(t, dist::ReduceOp::Avg);
    EXPECT_EQ(t.to(Device::cpu()).to_vector()[15], 2.0f);
    second.barrier();
  }
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  auto t = full<float>({2}, 1.0f, pg.default_device());
  pg.all_reduce(t);
  EXPECT_EQ(t.to(Device::cpu()).to_vector()[0], 1.0f);
}

// Note [NCCL stream lifetime]: a buffer a collective used remembers the group's NCCL stream, and
// freeing it records an event there; a group destroyed first must leave that stream valid.
TEST(DistributedCuda, BuffersFreedAfterTheirGroupStillOrderOnItsStream) {
  REQUIRE_GPU();
  if (dist::group().world_size() != 1) GTEST_SKIP() << "a second communicator per process is tested in a world of one";
  const Device dev = dist::group().default_device();
  Tensor<float> kept;
  cudaStream_t nccl = nullptr;
  {
    dist::ProcessGroup second;
    kept = full<float>({1 << 16}, 3.0f, dev);
    second.all_reduce(kept, dist::ReduceOp::Sum);  // kept's block now names second's NCCL stream
    nccl = second.nccl_stream();
    ASSERT_NE(nccl, nullptr);
  }  // the group (communicator, watchdog) is gone; kept is not
  synchronize(dev);
  EXPECT_EQ(cuda::tolerate(cudaStreamQuery(nccl)), cudaSuccess) << "the group destroyed the stream its buffers name";
  kept = Tensor<float>();  // the free records an event on that stream
  auto next = full<float>({1 << 16}, 1.0f, dev);  // may take kept's block
  EXPECT_EQ(next.to(Device::cpu()).to_vector()[0], 1.0f);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

// Note [NCCL watchdog]: a CUDA collective that does not finish within the timeout breaks the group
// although no host thread waits for it. (Last: it leaves its own group broken, not the job's.)
TEST(DistributedCuda, TheWatchdogBreaksAGroupWhoseCollectiveStalls) {
  REQUIRE_GPU();
  if (dist::group().world_size() != 1) GTEST_SKIP() << "a second communicator per process is tested in a world of one";
  dist::ProcessGroup g;  // the job's timeout while the communicator is made: NCCL's setup may take longer than 300 ms
  const Device dev = g.default_device();
  auto t = full<float>({4}, 1.0f, dev);
  g.all_reduce(t);
  synchronize(dev);
  g.set_timeout(std::chrono::milliseconds(300));  // what the stalled collective below is given
  spin(dev, 1500);  // the next all-reduce (in place, Sum: no NCCL kernel in a world of one) waits behind it
  auto work = g.all_reduce_async(t, dist::ReduceOp::Sum);
  const auto t0 = std::chrono::steady_clock::now();
  work->wait(g.timeout());  // orders the stream; returns at once
  EXPECT_LT(ms_since(t0), 200.0);
  while (!g.broken() && ms_since(t0) < 1200) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_TRUE(g.broken()) << "the watchdog did not notice the stalled all_reduce";
  try {
    g.all_reduce(t);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("timed out"), std::string::npos) << e.what();
  }
  synchronize(dev);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  auto& g = dist::init();
  std::printf("rank %d of %d, backend %s\n", g.rank(), g.world_size(), g.backend().c_str());
  return RUN_ALL_TESTS();
}
