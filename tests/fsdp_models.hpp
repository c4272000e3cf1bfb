#pragma once
// What both FullyShardedDataParallel test files use (tests/test_sharded_optimizer.cpp over one
// process's devices, tests/distributed/test_distributed_fsdp.cpp over ranks): the models and
// by_name.
#include <chorus/chorus.hpp>

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

}  // namespace chorus::testing
