// Must not compile (issue 16, item 13; Note [nested arguments]): a tensor inside a tuple
// argument would reach every DataParallel replica whole, unsplit. The test that builds this
// file passes when the build fails with DataParallel's message.
#include <chorus/chorus.hpp>
#include <tuple>

struct Pairwise : chorus::nn::Module {
  chorus::Tensor<float> forward(const std::tuple<chorus::Tensor<float>, chorus::Tensor<float>>& ab) {
    return std::get<0>(ab) + std::get<1>(ab);
  }
};

int main() {
  chorus::DataParallel<Pairwise> dp(Pairwise{}, {chorus::Device::cpu(0)});
  auto x = chorus::ones<float>({4, 2});
  return static_cast<int>(dp(std::make_tuple(x, x)).numel());
}
