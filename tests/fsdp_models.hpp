#pragma once
// What both FullyShardedDataParallel test files use (tests/test_sharded_optimizer.cpp over one
// process's devices, tests/distributed/test_distributed_fsdp.cpp over ranks): the models and
// by_name.
#include <chorus/chorus.hpp>
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

namespace chorus::testing {

/// Each tensor's values as float64, by name.
inline std::map<std::string, std::vector<double>> by_name(const std::vector<nn::Module::NamedTensor>& ts) {
  std::map<std::string, std::vector<double>> out;
  for (const auto& [name, t] : ts)
    out[name] = t.visit([](const auto& x) { return x.contiguous().template to<double>().to_vector(); });
  return out;
}

/// Twelve blocks of 64x64: Adam over the whole model needs its parameters, gradients and two
/// moments (4 x 8 bytes a parameter, double); sharded over 4, a quarter of that on each and a few
/// blocks' gathered parameters and gradients.
struct Deep : nn::Module {
  std::vector<parallel::FullyShard<nn::LinearT<double>>> blocks;
  Deep() {
    for (int i = 0; i < 12; ++i)
      blocks.push_back(register_module("b" + std::to_string(i), parallel::FullyShard(nn::LinearT<double>(64, 64))));
  }
  Tensor<double> forward(const Tensor<double>& x) {
    auto h = x;
    for (auto& b : blocks) h = tanh(b(h));
    return h;
  }
};

/// A bfloat16 unit for mixed precision (Note [sharded master weights]).
struct HalfNet : nn::Module {
  parallel::FullyShard<nn::LinearT<bfloat16>> fc;
  HalfNet() : fc(register_module("fc", parallel::FullyShard(nn::LinearT<bfloat16>(8, 8)))) {}
  Tensor<bfloat16> forward(const Tensor<bfloat16>& x) { return fc(x); }
};

/// Lifts the memory limits of `devices` when the scope ends (set_memory_limit(d, 0)).
struct MemoryLimits {
  std::vector<Device> devices;
  ~MemoryLimits() {
    for (auto d : devices) set_memory_limit(d, 0);
  }
};

/// Mixed precision (Note [sharded master weights]): `fsdp`, over a HalfNet whose parameters were
/// `start` (by_name), keeps float32 shards; 40 SGD steps of out.sum() over 4 rows of ones move
/// every parameter by 2e-4, under half a bfloat16 step for weights from 0.25 up, so a bfloat16
/// update would leave those where they were; the gathered bfloat16 parameters are the rounded
/// float32 sums of all the steps.
template <class Fsdp>
void expect_float32_shards_keep_small_updates(Fsdp& fsdp, const std::map<std::string, std::vector<double>>& start) {
  const int steps = 40;
  const double lr = 5e-5;  // the gradient of out.sum() with 4 rows of ones is 4 for every parameter
  for (const auto& p : fsdp.parameters()) EXPECT_EQ(p.dtype(), DType::Float32);
  optim::SGD opt(fsdp.parameters(), {.lr = lr});
  auto x = ones<bfloat16>({4, 8});
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    fsdp(x).sum().backward();
    for (const auto& p : fsdp.parameters()) EXPECT_EQ(p.grad().dtype(), DType::Float32);
    opt.step();
  }
  const auto got = by_name(fsdp.full_state_dict());
  int large = 0, moved = 0;
  for (const auto& [name, v] : start)
    for (std::size_t i = 0; i < v.size(); ++i) {
      const double want = v[i] - steps * lr * 4;  // in float32, then rounded to bfloat16
      EXPECT_NEAR(got.at(name)[i], want, std::abs(want) / 256 + 1e-6) << name << "[" << i << "]";
      if (std::abs(v[i]) < 0.25) continue;  // from 0.25 up, one step is under half a bfloat16 step
      const double one_step = static_cast<double>(static_cast<float>(bfloat16(static_cast<float>(v[i] - lr * 4))));
      ASSERT_EQ(one_step, v[i]) << "one step rounds away in bfloat16";
      ++large;
      moved += got.at(name)[i] != v[i];
    }
  EXPECT_GE(large, 5);
  EXPECT_EQ(moved, large);
}

}  // namespace chorus::testing
