#pragma once
// The definitions of core/runtime.hpp that are not hot paths (device checks, the slow paths
// creating allocators and streams, the device count from the environment): compiled into
// chorus::compiled (src/core/runtime.cpp), included by runtime.hpp itself only in the
// header-only form (Note [compiled chorus]).
#include "runtime.hpp"

CHORUS_NAMESPACE_BEGIN

namespace detail {

CHORUS_INLINE void Runtime::set_cpu_device_count(int n) {
  CHORUS_CHECK(n >= 1 && n <= kMaxCpuDevices, "set_cpu_device_count(", n,
               "): the number of virtual CPU devices must be in [1, ", kMaxCpuDevices, "]");
  cpu_count_.store(n, std::memory_order_release);
}

CHORUS_INLINE void Runtime::check(Device d) {
  if (d.is_cpu()) {
    int n = cpu_device_count();
    CHORUS_CHECK(d.index >= 0 && d.index < n, d, " is not available: there ",
                 n == 1 ? "is 1 virtual CPU device" : "are " + std::to_string(n) + " virtual CPU devices",
                 " (set CHORUS_CPU_DEVICES or call chorus::set_cpu_device_count)");
  } else {
#if CHORUS_CUDA
    int n = cuda_device_count();
    CHORUS_CHECK(d.index >= 0 && d.index < n, d, " is not available: ", n, " CUDA device(s) visible");
#else
    CHORUS_FAIL(d, " is not available: this translation unit was compiled without CUDA "
                   "(compile it with nvcc to use the CUDA backend)");
#endif
  }
}

CHORUS_INLINE Allocator& Runtime::create_allocator(Device d) {
  if (d.is_cpu()) {
    check(d);
    std::lock_guard<std::mutex> lk(m_);
    auto* a = cpu_alloc_[d.index].load();
    if (!a) {
      a = new CpuAllocator(d.index);  // lives as long as the runtime
      cpu_alloc_[d.index].store(a, std::memory_order_release);
    }
    return *a;
  }
#if CHORUS_CUDA
  check(d);
  CHORUS_CHECK(d.index < kMaxCudaDevices, d, ": chorus supports at most ", kMaxCudaDevices, " GPUs");
  std::lock_guard<std::mutex> lk(m_);
  auto* a = cuda_alloc_[d.index].load();
  if (!a) {
    a = new CudaCachingAllocator(d.index);  // lives as long as the runtime
    for (auto& other : cuda_alloc_)  // peer access between the devices in use (Note [peer access])
      if (auto* o = other.load()) a->connect(*o);
    cuda_alloc_[d.index].store(a, std::memory_order_release);
  }
  return *a;
#else
  check(d);
  CHORUS_FAIL("unreachable");
#endif
}

CHORUS_INLINE Stream& Runtime::create_stream(Device d, int slot) {
  check(d);
  std::lock_guard<std::mutex> lk(m_);
  auto& p = streams_[{d, slot}];
  if (!p) {
    p = std::make_unique<Stream>(d, slot);
    if (d.is_cpu() && slot == 0) cpu_default_[d.index].store(p.get(), std::memory_order_release);
#if CHORUS_CUDA
    if (d.is_cuda() && d.index < kMaxCudaDevices)
      cuda_streams_[d.index * kSlots + slot].store(p.get(), std::memory_order_release);
#endif
  }
  return *p;
}

CHORUS_INLINE int Runtime::count_from_env() {
  const char* v = std::getenv("CHORUS_CPU_DEVICES");
  if (!v || !*v) return 1;
  char* end = nullptr;
  long n = std::strtol(v, &end, 10);
  CHORUS_CHECK(end && *end == '\0' && n >= 1 && n <= kMaxCpuDevices, "CHORUS_CPU_DEVICES='", v,
               "' is not a device count in [1, ", kMaxCpuDevices, "]");
  return static_cast<int>(n);
}

}  // namespace detail

CHORUS_INLINE std::vector<Device> available_devices() {
  std::vector<Device> out;
  if (int n = cuda_device_count(); n > 0) {
    for (int i = 0; i < n; ++i) out.push_back(Device::cuda(i));
  } else {
    for (int i = 0, n2 = cpu_device_count(); i < n2; ++i) out.push_back(Device::cpu(i));
  }
  return out;
}

CHORUS_NAMESPACE_END
