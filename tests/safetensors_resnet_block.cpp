// Helper of the ResNet-block safetensors test (safetensors_resnet_block.py): a torchvision
// BasicBlock built from chorus's layers, its tensors named as PyTorch names them.
//   safetensors_resnet_block write FILE   saves the block with the pattern values (resnet_block.hpp)
//   safetensors_resnet_block check FILE   loads FILE and checks it holds the pattern values + 1
#include <cmath>
#include <iostream>
#include <string>

#include "resnet_block.hpp"

using namespace chorus;

int main(int argc, char** argv) try {
  if (argc != 3) {
    std::cerr << "usage: safetensors_resnet_block write|check FILE\n";
    return 2;
  }
  const std::string mode = argv[1], path = argv[2];
  testing::BasicBlock<float> block(4, 8, 2);  // float32 tensors, as a PyTorch model saves them by default
  if (mode == "write") {
    testing::fill_pattern(block);
    save(block, path, {{"producer", "chorus"}});
    return 0;
  }
  load(block, path);
  bool ok = true;
  for (auto& t : block.named_tensors()) {
    t.tensor.visit([&](auto& x) {
      using T = typename std::decay_t<decltype(x)>::value_type;
      auto v = x.to_vector();
      for (std::size_t j = 0; j < v.size(); ++j) {
        double want;
        if constexpr (std::is_same_v<T, std::int64_t>) want = double(testing::pattern_count(t.name) + 1);
        else want = double(static_cast<T>(testing::pattern_value(t.name, static_cast<std::int64_t>(j)))) + 1;
        if (std::abs(double(v[j]) - want) > 1e-6) {
          std::cerr << t.name << "[" << j << "] = " << v[j] << ", expected " << want << "\n";
          ok = false;
          return;
        }
      }
    });
  }
  return ok ? 0 : 1;
} catch (const std::exception& e) {
  std::cerr << "error: " << e.what() << "\n";
  return 1;
}
