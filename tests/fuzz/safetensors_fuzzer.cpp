// libFuzzer target for the safetensors loader: any input either loads or is refused with a
// chorus::Error; anything else (a crash, another exception, a sanitizer report) is a bug.
// Built and run by scripts/fuzz-safetensors.sh.
#include <chorus/chorus.hpp>

#include <cstdint>
#include <cstdlib>
#include <span>

namespace {
struct Target : chorus::nn::Module {
  chorus::Tensor<float> w;
  chorus::Tensor<double> b;
  chorus::Tensor<std::int64_t> n;
  Target() {
    w = register_parameter("w", chorus::zeros<float>({2, 2}));
    b = register_parameter("b", chorus::zeros<double>({3}));
    n = register_buffer("n", chorus::zeros<std::int64_t>({}));
  }
};
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static Target module;
  try {
    auto file = chorus::io::parse(std::span<const std::uint8_t>(data, size));
    chorus::io::load_into(module, file);
  } catch (const chorus::Error&) {
    // refused with a clear error: fine
  } catch (...) {
    std::abort();  // any other exception escaping the loader is a bug
  }
  return 0;
}
