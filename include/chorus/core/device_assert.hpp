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
#include <atomic>
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

/// Note [re-arming device-side validation]
/// The host side of a check, for the devices in bit mask `devices` (bit d: `records[d]`, whose
/// guard word `rearm(d)` resets): every record that holds an error is copied, cleared and only
/// then re-armed. The order matters: the guard, claimed by the reporting kernel, keeps every
/// other kernel away from the record until it is re-armed; a record cleared after re-arming
/// could erase the report of a kernel that ran in between, leaving the guard claimed for good
/// and every later bad index unreported. Returns the messages (empty when no device reported);
/// the caller serialises checks (two checks clearing one record would race the same way).
template <class Rearm>
std::string take_device_asserts(DeviceAssert* records, std::uint64_t devices, Rearm&& rearm) {
  std::string out;
  for (int d = 0; d < 64; ++d) {
    if (!((devices >> d) & 1u)) continue;
    DeviceAssert* r = records + d;
    volatile int* code = &r->code;
    if (*code == kAssertNone) continue;
    std::atomic_thread_fence(std::memory_order_acquire);  // the kernel wrote the fields before the code
    DeviceAssert copy;
    copy.code = *code;
    copy.extra = *static_cast<volatile int*>(&r->extra);
    copy.value = *static_cast<volatile std::int64_t*>(&r->value);
    copy.index = *static_cast<volatile std::int64_t*>(&r->index);
    copy.bound = *static_cast<volatile std::int64_t*>(&r->bound);
    *code = kAssertNone;                                  // cleared first ...
    std::atomic_thread_fence(std::memory_order_seq_cst);  // ... and visible before the guard is reset
    rearm(d);
    if (!out.empty()) out += "; ";
    out += describe(copy, "cuda:" + std::to_string(d));
  }
  return out;
}

}  // namespace detail
CHORUS_NAMESPACE_END
