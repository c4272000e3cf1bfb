#pragma once
// What a kernel reports when it finds bad input (an index or a class target out of range),
// and the message the host makes of it.
//
// Note [device-side validation]
// Validating indices on the host costs a device-to-host copy and a synchronisation per call,
// which drains the GPU's queue every step (a loss's targets, index_select's indices). On CUDA
// the kernels check instead: the first thread that finds a bad value claims a guard word in
// device memory (an atomic there, never on host memory: atomics over PCIe are not portable),
// writes a DeviceAssert record into pinned host memory mapped into the device with plain
// stores, and skips the bad access; the host
// looks at the record at the next natural synchronisation (item(), to_vector(), a copy to the
// host, Stream/Event/device synchronize) and throws chorus::Error there, as PyTorch's
// device-side asserts do, but recoverably. CPU tensors are still validated eagerly.
#include <cstdint>
#include <string>

#include "../error.hpp"

CHORUS_NAMESPACE_BEGIN
namespace detail {

enum DeviceAssertCode : int {
  kAssertNone = 0,
  kAssertCrossEntropyTarget = 1,  // value = target, index = row, bound = classes
  kAssertNllTarget = 2,           // likewise
  kAssertIndexSelect = 3,         // value = index, index = position, bound = size, extra = dim
  kAssertGather = 4,              // likewise (position: the flat position in the index tensor)
  kAssertScatterAdd = 5,          // likewise
  kAssertOneHot = 6,              // value = class, index = position, bound = num_classes
};

struct DeviceAssert {
  int code = kAssertNone;
  int extra = 0;
  std::int64_t value = 0, index = 0, bound = 0;
};

/// Where a kernel reports (both device-accessible): the guard word it claims with atomicCAS
/// (device memory) and the record it then fills (mapped pinned host memory).
struct DeviceAssertSink {
  int* guard = nullptr;
  DeviceAssert* record = nullptr;
};

/// The error message for a record (empty when it holds none). `where` names the device.
inline std::string describe(const DeviceAssert& a, const std::string& where) {
  const std::string at = " (found by a kernel on " + where + ", reported at the next synchronisation)";
  switch (a.code) {
    case kAssertNone: return {};
    case kAssertCrossEntropyTarget:
    case kAssertNllTarget:
      return str_cat(a.code == kAssertNllTarget ? "nll_loss" : "cross_entropy", ": target ", a.value, " at index ",
                     a.index, " is out of range for ", a.bound, " classes", at);
    case kAssertIndexSelect:
      return str_cat("index_select: index ", a.value, " at position ", a.index, " is out of range for dimension ",
                     a.extra, " of size ", a.bound, at);
    case kAssertGather:
    case kAssertScatterAdd:
      return str_cat(a.code == kAssertGather ? "gather" : "scatter_add", ": index ", a.value, " at position ", a.index,
                     " is out of range for dimension ", a.extra, " of size ", a.bound, at);
    case kAssertOneHot:
      return str_cat("one_hot: class value ", a.value, " at position ", a.index, " is out of range for ", a.bound,
                     " classes", at);
    default: return str_cat("unknown device-side assertion ", a.code, at);
  }
}

}  // namespace detail
CHORUS_NAMESPACE_END
