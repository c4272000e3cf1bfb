#pragma once
// Helpers of the DataParallel tests: a small model with a buffer, device lists, gradient checks.
#include <algorithm>
#include <string>
#include <vector>

#include "test_util.hpp"

namespace chorus::testing {

template <class T>
struct Net : nn::Module {
  nn::LinearT<T> fc1, fc2;
  Tensor<T> scale;
  Net() : fc1(register_module("fc1", nn::LinearT<T>(6, 16))), fc2(register_module("fc2", nn::LinearT<T>(16, 3))) {
    scale = register_buffer("scale", full<T>({3}, T(0.5)));
  }
  Tensor<T> forward(const Tensor<T>& x) { return fc2(chorus::tanh(fc1(x))) * scale; }
};

inline std::vector<Device> cpus(int k, int first = 0) {
  set_cpu_device_count(std::max(cpu_device_count(), first + k));
  std::vector<Device> d;
  for (int i = 0; i < k; ++i) d.push_back(Device::cpu(first + i));
  return d;
}

/// The storage that owns a tensor's memory (its flat buffer, for DataParallel's tensors).
template <class T>
const StorageImpl* block_of(const Tensor<T>& t) {
  const StorageImpl* s = t.impl()->storage.get();
  while (const auto* owner = s->memory_owner()) s = owner->get();
  return s;
}

template <class T>
void expect_grads_equal(const nn::Module& a, const nn::Module& b, double rtol, const std::string& what) {
  auto pa = a.named_parameters(), pb = b.named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (std::size_t i = 0; i < pa.size(); ++i) {
    auto ga = pa[i].tensor.template as<T>().grad(), gb = pb[i].tensor.template as<T>().grad();
    ASSERT_TRUE(ga.defined() && gb.defined()) << what << " " << pa[i].name;
    EXPECT_TRUE(all_close(ga, gb, rtol, rtol)) << what << " grad of " << pa[i].name;
  }
}
}  // namespace chorus::testing
