// The 16-bit types under nvcc (issue 19): the device conversions give the host's bits and
// CUDA's own (__float2bfloat16_rn, __float2half_rn) for every pattern; 16-bit tensors move
// to a GPU and back bit for bit, and a CUDA kernel without a 16-bit instantiation refuses
// clearly (Note [16-bit kernels]). Included by test_cuda_ops.cu.
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

TEST(CudaLowp, TensorsMoveBitForBitAndKernelsRefuse) {
  REQUIRE_GPU();
  auto x = from_vector(std::vector<bfloat16>{bfloat16(0.1f), bfloat16(-3.0f), std::numeric_limits<bfloat16>::infinity()});
  auto g = x.to(kGpu);
  EXPECT_EQ(g.device(), kGpu);
  const auto back = g.to(Device::cpu()).to_vector();
  for (std::size_t i = 0; i < back.size(); ++i) EXPECT_EQ(back[i].bits(), x.to_vector()[i].bits());
  EXPECT_TRUE(throws_with([&] { (void)(g + g); }, {"bfloat16", "CUDA"}));
  EXPECT_TRUE(throws_with([&] { (void)g.to<float>(); }, {"convert", "bfloat16", "CUDA"}));
}
