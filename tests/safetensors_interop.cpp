// Helper of the safetensors interoperability test (safetensors_interop.py).
//   safetensors_interop write FILE   saves the reference model (deterministic values)
//   safetensors_interop check FILE   loads FILE and checks it holds the reference values + 1
//   safetensors_interop write-lowp FILE / check-lowp FILE: the same for the 16-bit reference
//   (check-lowp also loads FILE into a float32 module with LoadOptions::convert_dtype)
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

// w[i] = bfloat16((i - 7) / 3 + add) (bfloat16 [2, 3]), h[i] = half(1000.5 i + add) (float16 [4]):
// each a float rounded once to nearest even, as the Python side computes it from float32 bits.
template <class W, class H>
struct LowpReference : nn::Module {
  Tensor<W> w;
  Tensor<H> h;
  explicit LowpReference(float add = 0) {
    std::vector<W> wv;
    std::vector<H> hv;
    for (int i = 0; i < 6; ++i) wv.push_back(W(static_cast<float>(i - 7) / 3.0f + add));
    for (int i = 0; i < 4; ++i) hv.push_back(H(static_cast<float>(i) * 1000.5f + add));
    w = register_parameter("w", from_vector(wv, {2, 3}));
    h = register_parameter("h", from_vector(hv));
  }
};

int check_lowp(const std::string& path) {
  LowpReference<bfloat16, half> m, expected(1.0f);
  load(m, path);
  bool ok = true;
  auto same_bits = [&](const auto& got, const auto& want, const char* name) {
    auto g = got.to_vector();
    auto w = want.to_vector();
    for (std::size_t i = 0; i < g.size(); ++i)
      if (g[i].bits() != w[i].bits()) {
        std::cerr << name << "[" << i << "] has bits " << g[i].bits() << ", expected " << w[i].bits() << "\n";
        ok = false;
      }
  };
  same_bits(m.w, expected.w, "w");
  same_bits(m.h, expected.h, "h");
  // Into a float32 module: refused unless asked, then widened exactly.
  LowpReference<float, float> wide;
  try {
    load(wide, path);
    std::cerr << "a 16-bit file loaded into a float32 module without convert_dtype\n";
    ok = false;
  } catch (const Error& e) {
    if (std::string(e.what()).find("bfloat16") == std::string::npos) {
      std::cerr << "unexpected error: " << e.what() << "\n";
      ok = false;
    }
  }
  load(wide, path, io::LoadOptions{.convert_dtype = true});
  auto ww = wide.w.to_vector();
  auto ew = expected.w.to_vector();
  for (std::size_t i = 0; i < ww.size(); ++i)
    if (ww[i] != static_cast<float>(ew[i])) {
      std::cerr << "converted w[" << i << "] = " << ww[i] << ", expected " << static_cast<float>(ew[i]) << "\n";
      ok = false;
    }
  return ok ? 0 : 1;
}
}  // namespace

int main(int argc, char** argv) try {
  if (argc != 3) {
    std::cerr << "usage: safetensors_interop write|check|write-lowp|check-lowp FILE\n";
    return 2;
  }
  const std::string mode = argv[1], path = argv[2];
  if (mode == "write-lowp") {
    save(LowpReference<bfloat16, half>(), path);
    return 0;
  }
  if (mode == "check-lowp") return check_lowp(path);
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
