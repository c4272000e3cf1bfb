// The 16-bit types under nvcc (issue 19): the device conversions give the host's bits and
// CUDA's own (__float2bfloat16_rn, __float2half_rn) for every pattern; 16-bit tensors move
// to a GPU and back bit for bit; the operators with CUDA 16-bit paths match the CPU's within one
// rounding, and a CUDA kernel without one refuses clearly (Note [16-bit kernels]). A
// mixed-precision training run on the GPU tracks the CPU's. Included by test_cuda_ops.cu.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace {
/// out[i] = T(float of pattern i), cuda[i] = CUDA's own rounding, back[i] = float(T::from_bits(i)).
template <class T>
__global__ void lowp_conversions(const float* in, std::uint16_t* ours, std::uint16_t* cuda, float* back, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  ours[i] = T(in[i]).bits();
  if constexpr (std::is_same_v<T, bfloat16>) {
    const __nv_bfloat16 c = __float2bfloat16_rn(in[i]);
    cuda[i] = __bfloat16_as_ushort(c);
  } else {
    const __half c = __float2half_rn(in[i]);
    cuda[i] = __half_as_ushort(c);
  }
  back[i] = static_cast<float>(T::from_bits(static_cast<std::uint16_t>(i & 0xffff)) +
                               T::from_bits(0));  // an operator on the device too
}

template <class T>
void check_device_conversions() {
  // Every 16-bit pattern's float value, the ties between neighbours, and a stride of floats.
  std::vector<float> in;
  for (std::uint32_t b = 0; b < 0x10000; ++b) in.push_back(static_cast<float>(T::from_bits(static_cast<std::uint16_t>(b))));
  for (std::uint32_t b = 0; b + 1 < 0x7f80; ++b)
    in.push_back((static_cast<float>(T::from_bits(static_cast<std::uint16_t>(b))) +
                  static_cast<float>(T::from_bits(static_cast<std::uint16_t>(b + 1)))) / 2);
  for (std::uint64_t u = 0; u < (1ull << 32); u += 4099) in.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(u)));
  const int n = static_cast<int>(in.size());
  auto din = from_vector(in, kGpu);
  auto ours = Tensor<std::int64_t>::empty({n}, kGpu), cuda = Tensor<std::int64_t>::empty({n}, kGpu);
  auto back = Tensor<float>::empty({n}, kGpu);
  auto* po = reinterpret_cast<std::uint16_t*>(ours.data());
  auto* pc = reinterpret_cast<std::uint16_t*>(cuda.data());
  {
    backend::cuda::Launch launch(kGpu);
    lowp_conversions<T><<<(n + 255) / 256, 256, 0, launch.stream>>>(din.data(), po, pc, back.data(), n);
  }
  CHORUS_CUDA_CHECK(cudaGetLastError());
  std::vector<std::uint16_t> o(n), c(n);
  std::vector<float> bk(n);
  copy_bytes(o.data(), Device::cpu(), po, kGpu, n * 2);
  copy_bytes(c.data(), Device::cpu(), pc, kGpu, n * 2);
  copy_bytes(bk.data(), Device::cpu(), back.data(), kGpu, n * 4);
  for (int i = 0; i < n; ++i) {
    const bool nan = std::isnan(in[i]);
    ASSERT_EQ(o[i], T(in[i]).bits()) << i << " " << in[i];  // device == host
    if (!nan) ASSERT_EQ(o[i], c[i]) << i << " " << in[i];     // == CUDA's (NaN payloads may differ)
    const float want = static_cast<float>(T::from_bits(static_cast<std::uint16_t>(i & 0xffff)));
    if (!std::isnan(want)) ASSERT_EQ(bk[i], want) << i;
  }
}
}  // namespace

TEST(CudaLowp, DeviceConversionsMatchTheHostAndCuda) {
  REQUIRE_GPU();
  check_device_conversions<bfloat16>();
  check_device_conversions<chorus::half>();  // cuda_fp16.h declares a global `half` too
}

TEST(CudaLowp, TensorsMoveBitForBitAndKernelsWithoutA16BitPathRefuse) {
  REQUIRE_GPU();
  auto x = from_vector(std::vector<bfloat16>{bfloat16(0.1f), bfloat16(-3.0f), std::numeric_limits<bfloat16>::infinity()});
  auto g = x.to(kGpu);
  EXPECT_EQ(g.device(), kGpu);
  const auto back = g.to(Device::cpu()).to_vector();
  for (std::size_t i = 0; i < back.size(); ++i) EXPECT_EQ(back[i].bits(), x.to_vector()[i].bits());
  EXPECT_TRUE(throws_with([&] { (void)chorus::max(g, 0); }, {"bfloat16", "CUDA"}));
  EXPECT_TRUE(throws_with([&] { (void)chorus::topk(g, 2); }, {"topk", "bfloat16", "CUDA"}));
}

namespace {
/// Within one rounding of T of each other (the two backends may sum or take exp in another order).
template <class T>
::testing::AssertionResult near_in(const Tensor<T>& got_gpu, const Tensor<T>& want_cpu, const char* what) {
  const auto g = got_gpu.to(Device::cpu()).to_vector();
  const auto w = want_cpu.to_vector();
  if (g.size() != w.size()) return ::testing::AssertionFailure() << what << ": sizes " << g.size() << " and " << w.size();
  const float eps = std::ldexp(1.0f, 1 - std::numeric_limits<T>::digits);
  float scale = 0;
  for (auto v : w) scale = std::max(scale, std::abs(static_cast<float>(v)));
  for (std::size_t i = 0; i < g.size(); ++i) {
    const float a = static_cast<float>(g[i]), b = static_cast<float>(w[i]);
    if (!(std::abs(a - b) <= 2 * eps * std::abs(b) + eps * 1e-2f * scale + 1e-6f))
      return ::testing::AssertionFailure() << what << "[" << i << "]: GPU " << a << ", CPU " << b;
  }
  return ::testing::AssertionSuccess();
}

template <class T>
void check_ops_against_cpu() {
  manual_seed(31);
  auto x = randn<T>({8, 33}), y = randn<T>({8, 33}), v = randn<T>({33});
  auto gx = x.to(kGpu), gy = y.to(kGpu), gv = v.to(kGpu);
  EXPECT_TRUE(near_in(gx + gy, x + y, "add"));
  EXPECT_TRUE(near_in(gx * gy, x * y, "mul"));
  EXPECT_TRUE(near_in(gx / (gy * gy + 1.0), x / (y * y + 1.0), "div"));
  EXPECT_TRUE(near_in(gx + gv, x + v, "broadcast add"));
  EXPECT_TRUE(near_in(exp(gx * 0.5), exp(x * 0.5), "exp"));
  EXPECT_TRUE(near_in(gelu(gx), gelu(x), "gelu"));
  EXPECT_TRUE(near_in(relu(gx), relu(x), "relu"));
  EXPECT_TRUE(near_in(gx.sum(), x.sum(), "sum"));
  EXPECT_TRUE(near_in(gx.sum(1), x.sum(1), "sum(1)"));
  EXPECT_TRUE(near_in(gx.sum(0), x.sum(0), "sum(0)"));
  EXPECT_TRUE(near_in(gx.mean(), x.mean(), "mean"));
  EXPECT_TRUE(near_in(gx.t().contiguous(), x.t().contiguous(), "strided copy"));
  EXPECT_TRUE(near_in(softmax(gx, 1), softmax(x, 1), "softmax"));
  EXPECT_TRUE(near_in(log_softmax(gx, 0), log_softmax(x, 0), "log_softmax"));
  EXPECT_TRUE(near_in(gx.cumsum(1), x.cumsum(1), "cumsum"));
  auto w = randn<T>({33, 5});
  EXPECT_TRUE(near_in(gx.matmul(w.to(kGpu)), x.matmul(w), "matmul (cublasGemmEx)"));
  auto a = randn<T>({3, 4, 6}), b = randn<T>({3, 6, 2});
  EXPECT_TRUE(near_in(a.to(kGpu).matmul(b.to(kGpu)), a.matmul(b), "batched matmul"));
  // Conversions: 16 bits <-> float/double on the GPU give the CPU's bits.
  const auto f = gx.template to<float>().to(Device::cpu()).to_vector(), fc = x.template to<float>().to_vector();
  EXPECT_EQ(f, fc);
  auto d = randn<double>({257});
  const auto r = d.to(kGpu).template to<T>().to(Device::cpu()).to_vector(), rc = d.template to<T>().to_vector();
  for (std::size_t i = 0; i < r.size(); ++i) EXPECT_EQ(r[i].bits(), rc[i].bits()) << i;
  // Note [vectorised 16-bit loads]: pairs where every pointer is aligned, the odd last element,
  // and views starting at an odd element (the scalar loop) all give the CPU's bits (relu, add
  // and mul are exact in float, then rounded once on both sides).
  auto u = randn<T>({259}), v2 = randn<T>({259});
  auto gu = u.to(kGpu), gv2 = v2.to(kGpu);
  for (std::int64_t off : {0, 1, 2}) {
    for (std::int64_t len : {256, 257}) {
      SCOPED_TRACE("offset " + std::to_string(off) + ", length " + std::to_string(len));
      auto cu = u.narrow(0, off, len), cv = v2.narrow(0, off, len);
      auto ga = gu.narrow(0, off, len), gb = gv2.narrow(0, off, len);
      auto same = [](const Tensor<T>& g, const Tensor<T>& c) {
        const auto a = g.to(Device::cpu()).to_vector(), b = c.to_vector();
        if (a.size() != b.size()) return false;
        for (std::size_t i = 0; i < a.size(); ++i)
          if (a[i].bits() != b[i].bits()) return false;
        return true;
      };
      EXPECT_TRUE(same(relu(ga), relu(cu))) << "unary";
      EXPECT_TRUE(same(ga + gb, cu + cv)) << "binary";
      EXPECT_TRUE(same(ga * gb, cu * cv)) << "binary";
      EXPECT_EQ(ga.template to<float>().to(Device::cpu()).to_vector(), cu.template to<float>().to_vector());
      auto fl = randn<float>({len});
      EXPECT_TRUE(same(fl.to(kGpu).template to<T>(), fl.template to<T>())) << "float to 16 bits";
    }
  }
  // Backward through a broadcast (the bias gradient: atomics in float) and an embedding-like
  // index_select (index_add in float).
  auto bias = v.to(kGpu).detach().requires_grad_();
  auto cb = v.detach().requires_grad_();
  (gx + bias).sum().backward();
  (x + cb).sum().backward();
  EXPECT_TRUE(near_in(bias.grad(), cb.grad(), "broadcast backward"));
  auto idx = from_vector<std::int64_t>({0, 2, 2, 5});
  auto table = x.detach().requires_grad_();
  auto gtable = gx.detach().requires_grad_();
  table.index_select(0, idx).sum().backward();
  gtable.index_select(0, idx.to(kGpu)).sum().backward();
  EXPECT_TRUE(near_in(gtable.grad(), table.grad(), "index_select backward"));
  // The CNN operators (Note [16-bit CNN operators]). conv2d: cuDNN convolves the 16-bit tensors
  // (float32 accumulation), then the bias is added in 16 bits: against the CPU's float32 route,
  // rounded once without the bias, plus the bias. Without cuDNN: the float32 route on the GPU.
  auto img = randn<T>({2, 4, 7, 7}), ker = randn<T>({6, 2, 3, 3}), kb = randn<T>({6});
  auto gimg = img.to(kGpu), gker = ker.to(kGpu), gkb = kb.to(kGpu);
  const auto conv_cpu = conv2d(img, ker, Tensor<T>(), 2, 1, 1, 2) + kb.view({1, 6, 1, 1});
#if CHORUS_HAS_CUDNN
  for (bool use_cudnn : {true, false}) {
    backend::cuda::cudnn::set_enabled(use_cudnn);
    SCOPED_TRACE(use_cudnn ? "cuDNN in 16 bits" : "float32 route");
#else
  for (bool use_cudnn : {false}) {
#endif
    EXPECT_TRUE(near_in(conv2d(gimg, gker, gkb, 2, 1, 1, 2),
                        use_cudnn ? conv_cpu : conv2d(img, ker, kb, 2, 1, 1, 2), "conv2d"));
    auto cimg = img.detach().requires_grad_(), cgimg = gimg.detach().requires_grad_();
    auto cker = ker.detach().requires_grad_(), cgker = gker.detach().requires_grad_();
    auto ckb = kb.detach().requires_grad_(), cgkb = gkb.detach().requires_grad_();
    auto gout = conv2d(cgimg, cgker, cgkb, 2, 1, 1, 2);
    // The node tells the route: the 16-bit convolution itself, or the conversion after float32.
    EXPECT_EQ(gout.grad_fn()->name(), use_cudnn ? "Conv2dBackward" : "ToCopyBackward");
    conv2d(cimg, cker, ckb, 2, 1, 1, 2).sum().backward();
    gout.sum().backward();
    EXPECT_TRUE(near_in(cgimg.grad(), cimg.grad(), "conv2d grad input"));
    EXPECT_TRUE(near_in(cgker.grad(), cker.grad(), "conv2d grad weight"));
    EXPECT_TRUE(near_in(cgkb.grad(), ckb.grad(), "conv2d grad bias"));
  }
#if CHORUS_HAS_CUDNN
  backend::cuda::cudnn::set_enabled(true);
#endif
  EXPECT_TRUE(near_in(max_pool2d(gimg, 3, 2, 1), max_pool2d(img, 3, 2, 1), "max_pool2d"));
  EXPECT_TRUE(near_in(avg_pool2d(gimg, 2), avg_pool2d(img, 2), "avg_pool2d"));
  EXPECT_TRUE(near_in(adaptive_avg_pool2d(gimg, {1, 1}), adaptive_avg_pool2d(img, {1, 1}), "adaptive_avg_pool2d"));
  auto rm = zeros<T>({4}), rv = ones<T>({4});
  auto grm = rm.to(kGpu), grv = rv.to(kGpu);
  EXPECT_TRUE(near_in(batch_norm(gimg, grm, grv), batch_norm(img, rm, rv), "batch_norm"));
  EXPECT_TRUE(near_in(grm, rm, "batch_norm running_mean"));
  EXPECT_TRUE(near_in(grv, rv, "batch_norm running_var"));
}
}  // namespace

TEST(CudaLowp, OperatorsMatchTheCpuWithinOneRounding) {
  REQUIRE_GPU();
  check_ops_against_cpu<bfloat16>();
  check_ops_against_cpu<chorus::half>();
}

// Note [the form of mixed precision] on a GPU: a bfloat16 MLP, float32 loss, float32 masters
// under AdamW; ten steps track the same run on the CPU.
TEST(CudaLowp, MixedPrecisionStepsTrackTheCpu) {
  REQUIRE_GPU();
  struct Mlp : nn::Module {
    nn::LinearT<bfloat16> fc1, fc2;
    Mlp() : fc1(register_module("fc1", nn::LinearT<bfloat16>(16, 64))), fc2(register_module("fc2", nn::LinearT<bfloat16>(64, 4))) {}
    Tensor<bfloat16> forward(const Tensor<bfloat16>& x) { return fc2(relu(fc1(x))); }
  };
  manual_seed(5);
  Mlp cpu_model;
  manual_seed(5);
  Mlp gpu_model;
  gpu_model.to(kGpu);
  amp::MasterWeights mc(cpu_model.parameters()), mg(gpu_model.parameters());
  optim::AdamW oc(mc.parameters(), {.lr = 1e-2}), og(mg.parameters(), {.lr = 1e-2});
  manual_seed(6);
  auto x = randn<bfloat16>({32, 16});
  auto y = randn<float>({32, 4});
  auto gxx = x.to(kGpu);
  auto gyy = y.to(kGpu);
  for (int s = 0; s < 10; ++s) {
    oc.zero_grad();
    og.zero_grad();
    auto lc = nn::functional::mse_loss(cpu_model.forward(x).to<float>(), y);
    auto lg = nn::functional::mse_loss(gpu_model.forward(gxx).to<float>(), gyy);
    lc.backward();
    lg.backward();
    mc.step(oc);
    mg.step(og);
    EXPECT_NEAR(lg.item(), lc.item(), 2e-2 * lc.item()) << "step " << s;
  }
}
