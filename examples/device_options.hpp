#pragma once
// The device options the examples share: --cpu N (N virtual CPU devices) and --gpus (all GPUs).
#include <chorus/chorus.hpp>

#include <string>
#include <vector>

namespace examples {

/// Consumes argv[i] (and its value) when it is a device option, appending the devices it
/// names; returns false for any other argument. Throws when --gpus finds no GPU.
inline bool parse_device_option(int& i, int argc, char** argv, std::vector<chorus::Device>& devices) {
  const std::string a = argv[i];
  if (a == "--cpu" && i + 1 < argc) {
    chorus::set_cpu_device_count(std::stoi(argv[++i]));
    for (int d = 0; d < chorus::cpu_device_count(); ++d) devices.push_back(chorus::Device::cpu(d));
    return true;
  }
  if (a == "--gpus") {
    for (int d = 0; d < chorus::cuda_device_count(); ++d) devices.push_back(chorus::Device::cuda(d));
    CHORUS_CHECK(!devices.empty(), "--gpus: no GPU found (a CPU-only build sees none; use the *_cuda build)");
    return true;
  }
  return false;
}

}  // namespace examples
