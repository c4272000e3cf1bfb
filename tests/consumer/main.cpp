#include <chorus/chorus.hpp>
#include <iostream>

int main() {
  chorus::nn::Linear fc(5, 2);
  auto y = fc(chorus::ones<float>({3, 5}));
  std::cout << "consumer: output size " << y.shape() << "\n";
  return y.shape() == chorus::Shape{3, 2} ? 0 : 1;
}
