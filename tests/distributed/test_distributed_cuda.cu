// The distributed layer on GPUs (compiled by nvcc; every test skips without a GPU). Run by
// scripts/gpu-check-distributed.sh under `mpirun -np 1` and under torchrun's environment: with a
// launcher, CUDA tensors go through NCCL even in a world of one process, so one GPU exercises
// the NCCL path (communicator, stream ordering, watchdog polling) that a large job uses.
#include <chorus/distributed.hpp>
#include <gtest/gtest.h>

#include <cstdio>

using namespace chorus;

namespace {

#define REQUIRE_GPU()                                                       \
  do {                                                                      \
    if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine"; \
  } while (0)

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

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  auto& g = dist::init();
  std::printf("rank %d of %d, backend %s\n", g.rank(), g.world_size(), g.backend().c_str());
  return RUN_ALL_TESTS();
}
