// Must not compile (Note [nested arguments]): DataParallel scatters the tensors inside tuples,
// pairs, arrays, vectors, optionals, variants and string-keyed maps, but cannot see into a
// std::list (nor an AnyTensor or a pointer): its tensors would reach every replica whole, unsplit.
// The test that builds this file passes when the build fails with DataParallel's message.
#include <chorus/chorus.hpp>
#include <list>

struct Pairwise : chorus::nn::Module {
  chorus::Tensor<float> forward(const std::list<chorus::Tensor<float>>& ab) { return ab.front() + ab.back(); }
};

int main() {
  chorus::DataParallel<Pairwise> dp(Pairwise{}, {chorus::Device::cpu(0)});
  auto x = chorus::ones<float>({4, 2});
  return static_cast<int>(dp(std::list<chorus::Tensor<float>>{x, x}).numel());
}
