// Must not compile (Note [nested arguments]): a forward that returns tensors behind a pointer
// cannot be gathered. The test that builds this file passes when the build fails with
// DataParallel's message.
#include <chorus/chorus.hpp>
#include <memory>

struct Shared : chorus::nn::Module {
  std::shared_ptr<chorus::Tensor<float>> forward(const chorus::Tensor<float>& x) {
    return std::make_shared<chorus::Tensor<float>>(x);
  }
};

int main() {
  chorus::DataParallel<Shared> dp(Shared{}, {chorus::Device::cpu(0)});
  return static_cast<int>(dp(chorus::ones<float>({4, 2}))->numel());
}
