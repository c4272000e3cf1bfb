// The CUDA backend against the CPU backend, its allocator, streams, communicators, and
// DataParallel on repeated-GPU sets. Every test skips where no GPU is present.
#include <functional>

#include "../test_util.hpp"

using namespace chorus;
using chorus::testing::all_close;
using chorus::testing::throws_with;
namespace F = chorus::nn::functional;

#define REQUIRE_GPU()                                                                         \
  do {                                                                                        \
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device visible (CUDA tests need a GPU)"; \
  } while (0)

namespace {
const Device kGpu = Device::cuda(0);

template <class T>
double op_tol() {
  return std::is_same_v<T, float> ? 2e-4 : 1e-10;
}

/// Runs `f` on CPU inputs and on their copies on cuda:0 (new allocations poisoned), compares
/// the outputs and the gradients of every input.
template <class T>
void check_op(const char* name, const std::function<Tensor<T>(const std::vector<Tensor<T>>&)>& f,
              std::vector<Tensor<T>> cpu_in, double tol = op_tol<T>()) {
  SCOPED_TRACE(name);
  cuda::set_poison_allocations(true);
  std::vector<Tensor<T>> gpu_in;
  for (auto& x : cpu_in) {
    x.requires_grad_(true);
    gpu_in.push_back(x.detach().to(kGpu).requires_grad_(true));
  }
  auto out_c = f(cpu_in);
  auto out_g = f(gpu_in);
  ASSERT_EQ(out_g.device(), kGpu);
  EXPECT_TRUE(all_close(out_g.to(Device::cpu()), out_c, tol, tol)) << name << " forward";
  Generator gen(7);
  auto w = randn<T>(out_c.shape(), Device::cpu(), 0, 1, gen);
  sum(out_c * w).backward();
  sum(out_g * w.to(kGpu)).backward();
  for (std::size_t i = 0; i < cpu_in.size(); ++i) {
    if (!cpu_in[i].grad().defined()) continue;
    ASSERT_TRUE(gpu_in[i].grad().defined()) << name << " input " << i;
    EXPECT_TRUE(all_close(gpu_in[i].grad().to(Device::cpu()), cpu_in[i].grad(), tol, tol))
        << name << " gradient of input " << i;
  }
  cuda::set_poison_allocations(false);
}

template <class T>
Tensor<T> r(const Shape& s, std::uint64_t seed, double lo = -1, double hi = 1) {
  Generator g(seed);
  return rand<T>(s, Device::cpu(), lo, hi, g);
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
  auto bad = from_vector<std::int64_t>({0, 12}).to(kGpu);
  EXPECT_TRUE(throws_with([&] { F::cross_entropy(zeros<T>({2, 10}, kGpu), bad); }, {"target 12", "index 1"}));
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
  EXPECT_TRUE(throws_with([&] { a.to(Device::cuda(cuda_device_count())); }, {"not available"}));
}

TEST(Cuda, LinearWithCublasLtMatchesTheCpuAlsoWithTf32) {
  REQUIRE_GPU();
  auto x = r<float>({512, 256}, 1), w = r<float>({128, 256}, 2), b = r<float>({128}, 3);
  auto cpu = linear(x, w, b);
  auto gpu = linear(x.to(kGpu), w.to(kGpu), b.to(kGpu)).to(Device::cpu());
  EXPECT_TRUE(all_close(gpu, cpu, 1e-4, 1e-4));
  cuda::set_allow_tf32(true);
  auto tf32 = linear(x.to(kGpu), w.to(kGpu), b.to(kGpu)).to(Device::cpu());
  cuda::set_allow_tf32(false);
  EXPECT_TRUE(all_close(tf32, cpu, 2e-2, 2e-2));
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

TEST(Cuda, TheCachingAllocatorReusesMemoryInTheSteadyState) {
  REQUIRE_GPU();
  const auto base = memory_stats(kGpu);
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
    for (int i = 0; i < 5; ++i) step();
    synchronize(kGpu);
    const auto after = memory_stats(kGpu);
    EXPECT_EQ(after.num_system_allocs, warm.num_system_allocs) << "the pool grew in the steady state";
    EXPECT_EQ(after.reserved, warm.reserved);
    EXPECT_GT(after.num_allocs, warm.num_allocs);
    EXPECT_GE(after.peak_allocated, after.allocated);
    EXPECT_GE(after.reserved, after.allocated);
  }
  EXPECT_EQ(memory_stats(kGpu).allocated, base.allocated);
}

TEST(Cuda, EventsOrderWorkAcrossStreams) {
  REQUIRE_GPU();
  Stream& s1 = get_stream(kGpu, 1);
  auto big = zeros<float>({1 << 22}, kGpu);
  Tensor<float> out;
  s1.async([&] {
      auto t = full<float>({1 << 22}, 3.0f, kGpu);  // on stream 1
      big.copy_(t);
    }).get();
  Event e;
  e.record(s1);
  e.block(current_stream(kGpu));
  EXPECT_EQ(big.sum().item(), 3.0f * (1 << 22));
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
