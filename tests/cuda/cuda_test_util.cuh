#pragma once
// What the CUDA test programs share (compiled by nvcc only): the GPU-skip macro and the
// CPU-against-GPU op check with poisoned allocations.
#include <functional>
#include <vector>

#include "../test_util.hpp"

#define REQUIRE_GPU()                                                                              \
  do {                                                                                             \
    if (chorus::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device visible (CUDA tests need a GPU)"; \
  } while (0)

namespace chorus::testing {
inline const Device kGpu = Device::cuda(0);

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
}  // namespace chorus::testing
