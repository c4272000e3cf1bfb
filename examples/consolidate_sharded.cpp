// Converts a sharded checkpoint (FullyShardedDataParallel::save_sharded, written by any number
// of processes) into one plain safetensors file of the whole model, under the module's names:
// what chorus::load and PyTorch's load_state_dict (safetensors.torch.load_file) read.
//   consolidate_sharded DIR OUT.safetensors
#include <chorus/distributed.hpp>

#include <cstdio>

int main(int argc, char** argv) try {
  if (argc != 3) {
    std::fprintf(stderr, "usage: consolidate_sharded DIR OUT.safetensors\n");
    return 2;
  }
  chorus::dist::consolidate_sharded(argv[1], argv[2]);
  std::printf("wrote %s\n", argv[2]);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "consolidate_sharded: %s\n", e.what());
  return 1;
}
