// The CUDA kernels of the CNN layers (convolution, pooling, normalisation, embedding) against
// the CPU backend: forward outputs and the gradients of every input, float and double, new
// GPU allocations poisoned. Every test skips where no GPU is present.
#include <functional>
#include <limits>
#include <thread>

#include <chorus/amp.hpp>

#include "cuda_test_util.cuh"

using namespace chorus;
using chorus::testing::all_close;

using chorus::testing::check_op;
using chorus::testing::kGpu;
using chorus::testing::op_tol;
using chorus::testing::r;

#if CHORUS_HAS_CUDNN
TEST(CudaCudnn, EachThreadHasItsOwnHandleForAStreamAndGivesItBack) {
  REQUIRE_GPU();
  // Note [cuDNN handles]: two threads on one stream never share a handle; a thread's handles go
  // back to the pool when it ends, and the next thread takes one from there.
  namespace cudnn = backend::cuda::cudnn;
  const cudaStream_t s = current_stream(kGpu).handle();
  const cudnnHandle_t mine = cudnn::handle_for(kGpu, s);
  EXPECT_EQ(cudnn::handle_for(kGpu, s), mine);  // the same thread: the same handle
  cudnnHandle_t first = nullptr, second = nullptr;
  std::thread([&] { first = cudnn::handle_for(kGpu, s); }).join();
  EXPECT_NE(first, nullptr);
  EXPECT_NE(first, mine);
  std::thread([&] { second = cudnn::handle_for(kGpu, s); }).join();
  EXPECT_EQ(second, first);  // reused from the pool
  cudaStream_t used = nullptr;
  CHORUS_CUDNN_CHECK(cudnnGetStream(second, &used));
  EXPECT_EQ(used, s);
}
#endif

template <class T>
class CudaLayers : public ::testing::Test {};
TYPED_TEST_SUITE(CudaLayers, chorus::testing::FloatTypes);

TYPED_TEST(CudaLayers, Convolution) {
  REQUIRE_GPU();
  using T = TypeParam;
  using V = std::vector<Tensor<T>>;
#if CHORUS_HAS_CUDNN
  for (bool use_cudnn : {true, false}) {  // cuDNN, then the im2col + cuBLAS kernels
    SCOPED_TRACE(use_cudnn ? "cuDNN" : "im2col");
    backend::cuda::cudnn::set_enabled(use_cudnn);
#else
  {
#endif
  check_op<T>("conv2d 3x3 pad 1", [](const V& x) { return conv2d(x[0], x[1], x[2], {1, 1}, {1, 1}); },
              {r<T>({4, 3, 9, 8}, 1), r<T>({5, 3, 3, 3}, 2), r<T>({5}, 3)});
  check_op<T>("conv2d strided dilated grouped",
              [](const V& x) { return conv2d(x[0], x[1], x[2], {2, 1}, {1, 2}, {2, 1}, 2); },
              {r<T>({2, 4, 11, 9}, 4), r<T>({6, 2, 3, 3}, 5), r<T>({6}, 6)});
  check_op<T>("conv2d 1x1", [](const V& x) { return conv2d(x[0], x[1]); }, {r<T>({3, 8, 5, 5}, 7), r<T>({4, 8, 1, 1}, 8)});
  check_op<T>("conv2d 1x1 stride 2", [](const V& x) { return conv2d(x[0], x[1], Tensor<T>(), {2, 2}); },
              {r<T>({3, 8, 6, 6}, 9), r<T>({4, 8, 1, 1}, 10)});
  check_op<T>("conv2d depthwise", [](const V& x) { return conv2d(x[0], x[1], x[2], {1, 1}, {1, 1}, {1, 1}, 4); },
              {r<T>({2, 4, 7, 7}, 11), r<T>({4, 1, 3, 3}, 12), r<T>({4}, 13)});
  // One shape, dilations (1, 1001) then (2, 1): the cuDNN plan cache keyed both as dh*1000 + dw
  // = 2001, so the second ran with the first's descriptors (output 2x1 instead of 1x1001).
  check_op<T>("conv2d dilation (1, 1001)", [](const V& x) { return conv2d(x[0], x[1], Tensor<T>(), 1, 0, {1, 1001}); },
              {r<T>({1, 2, 3, 1002}, 14), r<T>({2, 2, 2, 2}, 15)});
  check_op<T>("conv2d dilation (2, 1)", [](const V& x) { return conv2d(x[0], x[1], Tensor<T>(), 1, 0, {2, 1}); },
              {r<T>({1, 2, 3, 1002}, 14), r<T>({2, 2, 2, 2}, 15)});
  }
#if CHORUS_HAS_CUDNN
  backend::cuda::cudnn::set_enabled(true);
#endif
}

TYPED_TEST(CudaLayers, Pooling) {
  REQUIRE_GPU();
  using T = TypeParam;
  using V = std::vector<Tensor<T>>;
  check_op<T>("max_pool2d", [](const V& x) { return max_pool2d(x[0], {3, 3}, Pair{2, 2}, {1, 1}, {1, 1}, true); },
              {r<T>({2, 3, 9, 8}, 1)});
  check_op<T>("avg_pool2d", [](const V& x) { return avg_pool2d(x[0], {3, 2}, Pair{2, 1}, {1, 1}, false, false); },
              {r<T>({2, 3, 9, 8}, 2)});
  check_op<T>("avg_pool2d include pad", [](const V& x) { return avg_pool2d(x[0], {2, 2}, Pair{2, 2}, {1, 1}, true); },
              {r<T>({2, 3, 7, 7}, 3)});
  check_op<T>("adaptive_avg_pool2d", [](const V& x) { return adaptive_avg_pool2d(x[0], {3, 2}); },
              {r<T>({2, 3, 7, 5}, 4)});
  check_op<T>("adaptive_avg_pool2d 1x1", [](const V& x) { return adaptive_avg_pool2d(x[0], {1, 1}); },
              {r<T>({4, 16, 8, 8}, 5)});
}

TYPED_TEST(CudaLayers, Normalisation) {
  REQUIRE_GPU();
  using T = TypeParam;
  using V = std::vector<Tensor<T>>;
  check_op<T>("batch_norm train 4-D",
              [](const V& x) { return batch_norm(x[0], Tensor<T>(), Tensor<T>(), x[1], x[2], true, 0.1, 1e-5); },
              {r<T>({8, 5, 6, 7}, 1), r<T>({5}, 2), r<T>({5}, 3)});
  check_op<T>("batch_norm train 2-D",
              [](const V& x) { return batch_norm(x[0], Tensor<T>(), Tensor<T>(), x[1], x[2], true, 0.1, 1e-5); },
              {r<T>({33, 4}, 4), r<T>({4}, 5), r<T>({4}, 6)});
  check_op<T>("layer_norm", [](const V& x) { return layer_norm(x[0], Shape{6}, x[1], x[2]); },
              {r<T>({3, 4, 6}, 7), r<T>({6}, 8), r<T>({6}, 9)});
  check_op<T>("silu", [](const V& x) { return silu(x[0]); }, {r<T>({50}, 10, -4, 4)});
}

TYPED_TEST(CudaLayers, BatchNormModuleRunningStatsAndEmbedding) {
  REQUIRE_GPU();
  using T = TypeParam;
  nn::BatchNorm2dT<T> cpu_bn(3);
  auto gpu_bn = nn::clone(cpu_bn, kGpu);
  auto x = r<T>({6, 3, 4, 4}, 1, -1, 3);
  for (int step = 0; step < 3; ++step) {
    auto yc = cpu_bn(x);
    auto yg = gpu_bn(x.to(kGpu));
    EXPECT_TRUE(all_close(yg.to(Device::cpu()), yc, op_tol<T>(), op_tol<T>()));
  }
  EXPECT_TRUE(all_close(gpu_bn->running_mean.to(Device::cpu()), cpu_bn->running_mean, op_tol<T>(), op_tol<T>()));
  EXPECT_TRUE(all_close(gpu_bn->running_var.to(Device::cpu()), cpu_bn->running_var, op_tol<T>(), op_tol<T>()));
  EXPECT_EQ(gpu_bn->num_batches_tracked.to(Device::cpu()).item(), 3);
  cpu_bn->eval();
  gpu_bn->eval();
  EXPECT_TRUE(all_close(gpu_bn(x.to(kGpu)).to(Device::cpu()), cpu_bn(x), op_tol<T>(), op_tol<T>()));

  nn::EmbeddingT<T> emb(7, 4, nn::EmbeddingOptions{.padding_idx = 2});
  auto gemb = nn::clone(emb, kGpu);
  auto idx = from_vector<std::int64_t>({2, 1, 6, 1, 2, 0}, Shape{2, 3});
  emb(idx).sum().backward();
  gemb(idx.to(kGpu)).sum().backward();
  EXPECT_TRUE(all_close(gemb->weight.grad().to(Device::cpu()), emb->weight.grad(), 0, 0));
}

// ==== Issue 17: batch-norm statistics, dropout and clipping on the device, and no host syncs ====

namespace {

/// Holds streams behind a kernel that spins until open() (or ~2 s pass): an operation that
/// synchronises with the device while the gate is closed makes the spin time out, and then
/// closed() reads false. Operations that only queue work leave the streams busy.
__global__ void gate_kernel(const volatile int* flag, long long timeout) {
  const long long start = clock64();
  while (*flag == 0 && clock64() - start < timeout) {
  }
}

class Gate {
 public:
  explicit Gate(std::vector<cudaStream_t> streams) : streams_(std::move(streams)) {
    CHORUS_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host_), sizeof(int), cudaHostAllocMapped));
    *static_cast<volatile int*>(host_) = 0;
    CHORUS_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev_), host_, 0));
    for (auto s : streams_) {
      gate_kernel<<<1, 1, 0, s>>>(dev_, 4'000'000'000LL);
      CHORUS_CUDA_CHECK(cudaGetLastError());
    }
  }
  ~Gate() {
    open();
    (void)cuda::tolerate(cudaFreeHost(host_));
  }
  /// True while every stream is still held (no operation waited for the device meanwhile).
  bool closed() const {
    for (auto s : streams_)
      if (cuda::tolerate(cudaStreamQuery(s)) != cudaErrorNotReady) return false;
    return true;
  }
  void open() {
    *static_cast<volatile int*>(host_) = 1;
    for (auto s : streams_) CHORUS_CUDA_CHECK(cudaStreamSynchronize(s));
  }

 private:
  std::vector<cudaStream_t> streams_;
  int* host_ = nullptr;  // mapped pinned memory, written through volatile
  int* dev_ = nullptr;
};

#define REQUIRE_ASYNC_LAUNCHES()                                                                  \
  do {                                                                                            \
    if (cuda::debug_sync_enabled()) GTEST_SKIP() << "CHORUS_DEBUG_SYNC synchronises every launch"; \
  } while (0)

}  // namespace

TYPED_TEST(CudaLayers, BatchNormPlanarAndColumnLayouts) {
  REQUIRE_GPU();
  using T = TypeParam;
  using V = std::vector<Tensor<T>>;
  auto bn = [](const V& x) { return batch_norm(x[0], Tensor<T>(), Tensor<T>(), x[1], x[2], true, 0.1, 1e-5); };
  struct Case {
    Shape x;
    const char* what;
  };
  for (const auto& c : {Case{{4, 3, 40}, "planar, one block per channel"},
                        Case{{64, 16, 32, 32}, "planar, many blocks per channel (ResNet-20's first stage)"},
                        Case{{300, 5}, "columns, S = 1, several row chunks"},
                        Case{{50, 3, 7}, "columns, S = 7"},
                        Case{{3, 70000}, "columns, more channels than grid rows"},
                        Case{{2, 66000, 32}, "planar, more channels than gridDim.y"},
                        Case{{1, 2, 33}, "planar, fewer values than threads"}}) {
    const std::int64_t C = c.x[1];
    check_op<T>(c.what, bn, {r<T>(c.x, 1, -1, 3), r<T>({C}, 2), r<T>({C}, 3)});
  }
  // No affine parameters; a large mean (the Welford pivots keep the variance exact).
  check_op<T>("batch_norm, no affine, mean 1e3",
              [](const V& x) { return batch_norm(x[0], Tensor<T>(), Tensor<T>(), Tensor<T>(), Tensor<T>(), true); },
              {r<T>({16, 4, 9, 9}, 4, 1e3, 1e3 + 1)}, std::is_same_v<T, float> ? 2e-3 : 1e-9);
}

TYPED_TEST(CudaLayers, BatchNormMomentumNoneRunningStatistics) {
  REQUIRE_GPU();
  using T = TypeParam;
  nn::BatchNorm1dT<T> cpu_bn(5, nn::BatchNormOptions{.momentum = std::nullopt});
  auto gpu_bn = nn::clone(cpu_bn, kGpu);
  for (int step = 0; step < 4; ++step) {
    auto x = r<T>({37, 5, 3}, 10 + step, -2, 2);
    EXPECT_TRUE(all_close(gpu_bn(x.to(kGpu)).to(Device::cpu()), cpu_bn(x), op_tol<T>(), op_tol<T>()));
  }
  EXPECT_EQ(gpu_bn->num_batches_tracked.to(Device::cpu()).item(), 4);
  EXPECT_TRUE(all_close(gpu_bn->running_mean.to(Device::cpu()), cpu_bn->running_mean, op_tol<T>(), op_tol<T>()));
  EXPECT_TRUE(all_close(gpu_bn->running_var.to(Device::cpu()), cpu_bn->running_var, op_tol<T>(), op_tol<T>()));
}

TYPED_TEST(CudaLayers, DropoutMaskIsTheCpuMaskBitForBit) {
  REQUIRE_GPU();
  using T = TypeParam;
  for (const Shape& s : {Shape{7, 13}, Shape{1}, Shape{5, 3, 4, 4}, Shape{1000003}}) {
    SCOPED_TRACE(::testing::Message() << s);
    auto x = r<T>(s, 5, -2, 2);
    Generator gc(31), gg(31);
    auto xc = x.detach().requires_grad_(), xg = x.to(kGpu).requires_grad_();
    auto yc = dropout(xc, 0.35, true, gc), yg = dropout(xg, 0.35, true, gg);
    EXPECT_TRUE(all_close(yg.to(Device::cpu()), yc, 0, 0));
    EXPECT_EQ(gc.get_offset(), gg.get_offset());
    auto w = r<T>(s, 6);
    (yc * w).sum().backward();
    (yg * w.to(kGpu)).sum().backward();
    EXPECT_TRUE(all_close(xg.grad().to(Device::cpu()), xc.grad(), 0, 0));
  }
  Generator gc(2), gg(2);
  auto a = r<T>({6, 5}, 7);
  EXPECT_TRUE(all_close(dropout2d(a.to(kGpu), 0.5, true, gg).to(Device::cpu()), dropout2d(a, 0.5, true, gc), 0, 0));
  EXPECT_TRUE(all_close(dropout(a.to(kGpu).t(), 0.5, true, gg).to(Device::cpu()), dropout(a.t(), 0.5, true, gc), 0, 0));
}

TEST(CudaIssue17, DropoutUnderDataParallelOnOneGpuIsTheSingleDeviceMask) {
  REQUIRE_GPU();
  struct Drop : nn::Module {
    nn::Dropout drop;
    Drop() : drop(register_module("drop", nn::Dropout(0.4))) {}
    Tensor<float> forward(const Tensor<float>& x) { return drop(x); }
  };
  auto x = ones<float>({10, 33});
  manual_seed(4);
  auto ref = Drop().forward(x);  // on the CPU
  DataParallel<Drop> dp(nn::clone(Drop(), kGpu), {kGpu, kGpu, kGpu});
  manual_seed(4);
  EXPECT_TRUE(all_close(dp(x.to(kGpu)).to(Device::cpu()), ref, 0, 0));
}

/// Parameters with gradient g on the CPU and a copy on the GPU, pairwise: what the clipping
/// and loss-scaling tests compare.
template <class T>
struct CpuGpuParams {
  std::vector<Tensor<T>> pc, pg;
  std::vector<AnyTensor> ac, ag;
  void add(const Tensor<T>& g) {
    pc.push_back(zeros<T>(g.shape()).requires_grad_());
    pg.push_back(zeros<T>(g.shape(), kGpu).requires_grad_());
    pc.back().set_grad(g);
    pg.back().set_grad(g.to(kGpu));
    ac.push_back(pc.back());
    ag.push_back(pg.back());
  }
};

TYPED_TEST(CudaLayers, ClipGradNormMatchesTheCpu) {
  REQUIRE_GPU();
  using T = TypeParam;
  for (double norm_type : {2.0, 1.0, 3.0, double(INFINITY)}) {
    SCOPED_TRACE(norm_type);
    CpuGpuParams<T> ps;
    auto& [pc, pg, ac, ag] = ps;
    for (int i = 0; i < 100; ++i) {  // more than one launch's worth of tensors, some over a block
      const std::int64_t n = (i % 7 == 0) ? 5000 + i : 1 + i;
      ps.add(r<T>({n}, 100 + i, -1, 1));
    }
    const double nc = nn::utils::clip_grad_norm_(ac, 0.5, norm_type);
    auto ng = nn::utils::clip_grad_norm_(ag, 0.5, norm_type);
    EXPECT_EQ(ng.tensor().device(), kGpu);
    EXPECT_NEAR(double(ng), nc, 1e-12 * nc);
    for (std::size_t i = 0; i < pc.size(); ++i)
      ASSERT_TRUE(all_close(pg[i].grad().to(Device::cpu()), pc[i].grad(), 1e-6, 1e-12)) << i;
    nn::utils::clip_grad_value_(ac, 0.001);
    nn::utils::clip_grad_value_(ag, 0.001);
    for (std::size_t i = 0; i < pc.size(); ++i)
      ASSERT_TRUE(all_close(pg[i].grad().to(Device::cpu()), pc[i].grad(), 1e-6, 1e-12)) << i;
  }
  auto a = zeros<T>({3}, kGpu).requires_grad_();
  a.set_grad(from_vector<T>({1, std::numeric_limits<T>::quiet_NaN(), 2}).to(kGpu));
  std::vector<AnyTensor> ps{a};
  EXPECT_THROW(nn::utils::clip_grad_norm_(ps, 1.0, 2.0, true), Error);
  EXPECT_EQ(a.grad().to(Device::cpu()).to_vector()[0], T(1));  // unchanged by the refusal
}

// amp::GradScaler on the GPU (Note [loss scaling]): the multi-tensor unscale equals the CPU's,
// its flag is set by an inf or NaN in any of more than one launch's worth of gradients, and a
// flagged step is skipped.
TYPED_TEST(CudaLayers, GradScalerUnscalesAndFindsNonFiniteGradients) {
  REQUIRE_GPU();
  using T = TypeParam;
  for (int bad : {-1, 3, 77}) {  // no bad element; one in the first launch; one in the second
    SCOPED_TRACE(bad);
    CpuGpuParams<T> ps;
    auto& [pc, pg, ac, ag] = ps;
    for (int i = 0; i < 100; ++i) {
      const std::int64_t n = (i % 7 == 0) ? 5000 + i : 1 + i;
      auto g = mul(r<T>({n}, 200 + i, -1, 1), 1024.0);
      if (i == bad) {
        auto v = g.to_vector();
        v[static_cast<std::size_t>(n - 1)] = i % 2 ? std::numeric_limits<T>::quiet_NaN() : std::numeric_limits<T>::infinity();
        g = from_vector<T>(v, {n});
      }
      ps.add(g);
    }
    optim::SGD oc(ac, {.lr = 1.0}), og(ag, {.lr = 1.0});
    amp::GradScaler sc({.init_scale = 1024.0}), sg({.init_scale = 1024.0});
    EXPECT_EQ(sg.step(og), bad < 0);
    EXPECT_EQ(sc.step(oc), bad < 0);
    for (std::size_t i = 0; i < pc.size(); ++i) {
      if (static_cast<int>(i) != bad)  // (a NaN never compares equal)
        ASSERT_TRUE(all_close(pg[i].grad().to(Device::cpu()), pc[i].grad(), 0, 0)) << i;  // 1/1024: exact
      ASSERT_TRUE(all_close(pg[i].to(Device::cpu()), pc[i], 0, 0)) << i;
    }
    sg.update();
    EXPECT_EQ(sg.get_scale(), bad < 0 ? 1024.0 : 512.0);
  }
}

TEST(CudaIssue17, SyncBatchNormOnOneGpuEqualsBatchNormOverTheBatch) {
  REQUIRE_GPU();
  nn::SyncBatchNormT<double> single(3);
  auto x = r<double>({12, 3, 5}, 21, -1, 4);
  auto xr = x.detach().requires_grad_();
  auto ref = single(xr);
  (ref * r<double>(ref.shape(), 22)).sum().backward();
  DataParallel<nn::SyncBatchNormT<double>> dp(nn::clone(nn::SyncBatchNormT<double>(3), kGpu), {kGpu, kGpu, kGpu});
  auto xg = x.to(kGpu).requires_grad_();
  auto y = dp(xg);
  (y * r<double>(ref.shape(), 22).to(kGpu)).sum().backward();
  EXPECT_TRUE(all_close(y.to(Device::cpu()), ref, 1e-10, 1e-10));
  EXPECT_TRUE(all_close(xg.grad().to(Device::cpu()), xr.grad(), 1e-10, 1e-10));
  EXPECT_TRUE(all_close(dp.module().running_var.to(Device::cpu()), single->running_var, 1e-10, 1e-10));
}

// The operations this issue moved onto the device queue their work and return while the GPU is
// still busy: none of them waits for the device.
TEST(CudaIssue17, NoHostSyncInBatchNormDropoutAndClipping) {
  REQUIRE_GPU();
  REQUIRE_ASYNC_LAUNCHES();
  nn::BatchNorm2dT<float> bn(8, nn::BatchNormOptions{.momentum = std::nullopt, .device = kGpu});
  auto x = r<float>({16, 8, 12, 12}, 1).to(kGpu);
  auto p = zeros<float>({300}, kGpu).requires_grad_();
  p.set_grad(r<float>({300}, 2).to(kGpu));
  std::vector<AnyTensor> ps{p};
  auto run = [&] {
    auto y = bn(x);
    auto d = dropout(y, 0.2, true);
    auto total = nn::utils::clip_grad_norm_(ps, 0.1);
    nn::utils::clip_grad_value_(ps, 0.01);
    return total;
  };
  run();  // warm-up: the allocator's pool holds the blocks
  current_stream(kGpu).synchronize();
  Gate gate({current_stream(kGpu).handle()});
  auto total = run();
  EXPECT_TRUE(gate.closed()) << "an operation waited for the device";
  gate.open();
  EXPECT_GT(double(total), 0.0);
}

TEST(CudaIssue17, NoHostSyncInSyncBatchNormReductions) {
  REQUIRE_GPU();
  REQUIRE_ASYNC_LAUNCHES();
  auto x = r<float>({8, 4, 6}, 3, -1, 2);
  auto x0 = x.narrow(0, 0, 4).contiguous().to(kGpu), x1 = x.narrow(0, 4, 4).contiguous().to(kGpu);
  Stream& s0 = get_stream(kGpu, 0);
  Stream& s1 = get_stream(kGpu, 1);
  synchronize(kGpu);
  std::vector<Tensor<float>> out(2);
  auto replicas = [&](parallel::ReplicaStatsGroup& group) {
    std::thread t1([&] {
      StreamGuard g(s1);
      out[1] = batch_norm(x1, Tensor<float>(), Tensor<float>(), Tensor<float>(), Tensor<float>(), true, 0.1, 1e-5,
                          group.member(1));
    });
    {
      StreamGuard g(s0);
      out[0] = batch_norm(x0, Tensor<float>(), Tensor<float>(), Tensor<float>(), Tensor<float>(), true, 0.1, 1e-5,
                          group.member(0));
    }
    t1.join();
  };
  auto warm = std::make_shared<parallel::ReplicaStatsGroup>(2);
  replicas(*warm);
  synchronize(kGpu);
  auto group = std::make_shared<parallel::ReplicaStatsGroup>(2);
  {
    Gate gate({s0.handle(), s1.handle()});
    replicas(*group);
    EXPECT_TRUE(gate.closed()) << "a SyncBatchNorm reduction waited for the device";
  }
  synchronize(kGpu);
  auto ref = batch_norm(x, Tensor<float>(), Tensor<float>(), Tensor<float>(), Tensor<float>(), true);
  EXPECT_TRUE(all_close(out[0].to(Device::cpu()), ref.narrow(0, 0, 4), 1e-4, 1e-4));
  EXPECT_TRUE(all_close(out[1].to(Device::cpu()), ref.narrow(0, 4, 4), 1e-4, 1e-4));
}
