// Built when the consumer asks for chorus::distributed: a world of 1 without a launcher.
#include <chorus/distributed.hpp>
#include <iostream>

int main() {
  auto& pg = chorus::dist::init();
  std::cout << "consumer: rank " << pg.rank() << " of " << pg.world_size() << "\n";
  return pg.world_size() >= 1 && pg.rank() == 0 ? 0 : 1;
}
