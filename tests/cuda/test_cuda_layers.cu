// The CUDA kernels of the CNN layers (convolution, pooling, normalisation, embedding) against
// the CPU backend: forward outputs and the gradients of every input, float and double, new
// GPU allocations poisoned. Every test skips where no GPU is present.
#include <functional>

#include "cuda_test_util.cuh"

using namespace chorus;
using chorus::testing::all_close;

using chorus::testing::check_op;
using chorus::testing::kGpu;
using chorus::testing::op_tol;
using chorus::testing::r;

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
