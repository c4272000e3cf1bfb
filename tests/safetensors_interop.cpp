// Helper of the safetensors interoperability test (safetensors_interop.py).
//   safetensors_interop write FILE   saves the reference model (deterministic values)
//   safetensors_interop check FILE   loads FILE and checks it holds the reference values + 1
#include <chorus/chorus.hpp>

#include <cmath>
#include <iostream>
#include <string>

using namespace chorus;

namespace {
// fc1.weight[i] = 0.5 * i - 3 (float32 [4, 3]), fc1.bias[i] = i (float32 [4]),
// head.weight[i] = 0.25 * i (float64 [2, 4]), steps = [10, 20, 30] (int64 buffer).
struct Reference : nn::Module {
  nn::Linear fc1;
  nn::LinearT<double> head;
  Tensor<std::int64_t> steps;
  Reference()
      : fc1(register_module("fc1", nn::Linear(3, 4))),
        head(register_module("head", nn::LinearT<double>(4, 2, nn::LinearOptions{.bias = false}))) {
    steps = register_buffer("steps", from_vector<std::int64_t>({10, 20, 30}));
    NoGradGuard g;
    fc1->weight.copy_(arange<float>(12).reshape({4, 3}) * 0.5 - 3.0);
    fc1->bias.copy_(arange<float>(4));
    head->weight.copy_(arange<double>(8).reshape({2, 4}) * 0.25);
  }
};
}  // namespace

int main(int argc, char** argv) try {
  if (argc != 3) {
    std::cerr << "usage: safetensors_interop write|check FILE\n";
    return 2;
  }
  const std::string mode = argv[1], path = argv[2];
  if (mode == "write") {
    save(Reference(), path, {{"producer", "chorus"}});
    return 0;
  }
  Reference expected;
  Reference m;
  load(m, path);
  bool ok = true;
  auto check = [&](const auto& got, const auto& want, double add, const char* name) {
    auto g = got.to_vector();
    auto w = want.to_vector();
    for (std::size_t i = 0; i < g.size(); ++i)
      if (std::abs(double(g[i]) - (double(w[i]) + add)) > 1e-12) {
        std::cerr << name << "[" << i << "] = " << g[i] << ", expected " << double(w[i]) + add << "\n";
        ok = false;
      }
  };
  check(m.fc1->weight, expected.fc1->weight, 1, "fc1.weight");
  check(m.fc1->bias, expected.fc1->bias, 1, "fc1.bias");
  check(m.head->weight, expected.head->weight, 1, "head.weight");
  check(m.steps, expected.steps, 1, "steps");
  return ok ? 0 : 1;
} catch (const std::exception& e) {
  std::cerr << "error: " << e.what() << "\n";
  return 1;
}
