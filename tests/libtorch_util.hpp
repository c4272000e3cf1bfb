#pragma once
// For the tests that check chorus against LibTorch (Debian libtorch-dev): tensors converted both
// ways, and, where LibTorch was not found or the build is sanitized, the reason the test skips.
#include "test_util.hpp"

#if CHORUS_HAVE_LIBTORCH
#include <torch/torch.h>

#include <type_traits>
#include <vector>

namespace chorus::testing {

inline std::vector<int64_t> sizes_of(const Shape& s) { return {s.begin(), s.end()}; }

/// A LibTorch copy of a float64 or int64 chorus tensor.
template <class T>
torch::Tensor to_torch(const Tensor<T>& t) {
  static_assert(std::is_same_v<T, double> || std::is_same_v<T, std::int64_t>, "to_torch: float64 or int64 tensors");
  auto v = t.to_vector();
  return torch::from_blob(v.data(), sizes_of(t.shape()), std::is_same_v<T, double> ? torch::kFloat64 : torch::kLong)
      .clone();
}

/// A float64 chorus copy of a LibTorch tensor (any dtype, layout or autograd state).
inline Tensor<double> from_torch(const torch::Tensor& t) {
  auto c = t.detach().contiguous().to(torch::kFloat64);
  Shape s;
  for (auto d : c.sizes()) s.push_back(d);
  return from_vector<double>(std::vector<double>(c.data_ptr<double>(), c.data_ptr<double>() + c.numel()), s);
}

}  // namespace chorus::testing

#elif CHORUS_LIBTORCH_SANITIZED
#define CHORUS_LIBTORCH_SKIP "LibTorch is not built with sanitizers: this test runs in the unsanitized build"
#else
#define CHORUS_LIBTORCH_SKIP \
  "LibTorch was not found when this test was configured (apt-get install libtorch-dev, then reconfigure)"
#endif
