#pragma once
// DataParallelCore's definitions: data_parallel_core.hpp includes this only in the header-only
// form; src/parallel/data_parallel.cpp compiles it into chorus::compiled (Note [compiled chorus]).
#include <algorithm>
#include <string>

#include "../backend/cpu/blas.hpp"
#include "data_parallel_core.hpp"

CHORUS_NAMESPACE_BEGIN
namespace parallel {

CHORUS_INLINE DataParallelCore::DataParallelCore(DataParallelOptions options)
    : devices_(options.devices.empty() ? available_devices() : std::move(options.devices)),
      dim_(options.dim),
      scatter_dims_(std::move(options.scatter_dims)),
      gather_dims_(std::move(options.gather_dims)),
      bucket_bytes_(options.bucket_bytes) {
  CHORUS_CHECK(!devices_.empty(), "DataParallel: no devices");
  CHORUS_CHECK(dim_ >= 0, "DataParallel: dim must be non-negative, got ", dim_);
  for (const auto d : gather_dims_)
    CHORUS_CHECK(d != kBroadcast, "DataParallel: gather_dims holds kBroadcast, which is for arguments "
                 "(scatter_dims): every output is joined from the replicas'");
  for (const auto& d : devices_) {
    check_device(d);
    CHORUS_CHECK(d.kind == devices_[0].kind, "DataParallel: devices mix kinds (", devices_[0], " and ", d, ")");
  }
  output_device_ = options.output_device ? *options.output_device : devices_[0];
  check_device(output_device_);
  if (devices_[0].is_cpu()) {  // Note [BLAS threads shared by devices]
    std::vector<Device> distinct = devices_;
    std::sort(distinct.begin(), distinct.end(), [](Device a, Device b) { return a.index < b.index; });
    distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
    backend::cpu::share_blas_threads(static_cast<int>(distinct.size()));
  }
}

CHORUS_INLINE void DataParallelCore::set_name_prefix_core(std::string prefix) {
  CHORUS_CHECK(prefix.empty() || (prefix.back() == '.' && prefix.front() != '.' && prefix.find("..") == std::string::npos),
               "DataParallel::set_name_prefix: '", prefix, "' must be empty or dotted names ending in '.', such as "
               "\"module.\"");
  name_prefix_ = std::move(prefix);
}

CHORUS_INLINE void DataParallelCore::set_inline_work_core(std::int64_t work) {
  CHORUS_CHECK(work >= 0, "DataParallel::set_inline_work: work must be >= 0, got ", work);
  inline_work_ = work;
}

CHORUS_INLINE DataParallelCore::Links DataParallelCore::link(const std::vector<Device>& devices) {
  Links l;
  l.streams.push_back(&get_stream(devices[0], 0));
  for (std::size_t r = 1; r < devices.size(); ++r) {
    int slot = 0;
    for (std::size_t q = 0; q < r; ++q) slot += devices[q] == devices[r];
    l.streams.push_back(&get_stream(devices[r], slot));
  }
  l.comm = detail::make_communicator(devices, l.streams);
  return l;
}

CHORUS_INLINE std::size_t DataParallelCore::bucket_bytes_for(const std::vector<Device>& devices) const {
  return bucket_bytes_.value_or(devices[0].is_cpu() ? kDefaultCpuBucketBytes : kDefaultBucketBytes);
}

CHORUS_INLINE void DataParallelCore::install_links(Links&& links, bool has_buffers, bool meets_other_replicas) noexcept {
  streams_ = std::move(links.streams);
  comm_ = std::move(links.comm);
  has_buffers_ = has_buffers;
  meets_other_replicas_ = meets_other_replicas;
}

CHORUS_INLINE void DataParallelCore::check_move(Device device) const {
  check_device(device);
  CHORUS_CHECK(device.kind == devices_[0].kind, "DataParallel::to(", device, "): the primary device is ", devices_[0],
               "; a DataParallel cannot change device kind (build a new one for ", device, ")");
}

CHORUS_INLINE DataParallelCore::Moved DataParallelCore::moved_to(Device device) const {
  const auto moved = std::find(devices_.begin(), devices_.end(), device);
  const std::size_t dropped = moved == devices_.end() ? 0 : static_cast<std::size_t>(moved - devices_.begin());
  Moved m{{device}, output_device_ == devices_[0] ? device : output_device_};
  for (std::size_t r = 0; r < devices_.size(); ++r)
    if (r != dropped) m.devices.push_back(devices_[r]);
  return m;
}

CHORUS_INLINE void DataParallelCore::set_devices(std::vector<Device> devices, Device output) {
  devices_ = std::move(devices);
  output_device_ = output;
}

CHORUS_INLINE bool DataParallelCore::module_on(const nn::Module& root, Device device) {
  for (const auto& t : root.named_tensors())
    if (t.tensor.device() != device) return false;
  return true;
}

CHORUS_INLINE std::vector<DataParallelCore::SavedTensor> DataParallelCore::save_tensors(nn::Module& root) {
  std::vector<SavedTensor> saved;
  root.for_each_tensor([&](AnyTensor& t) {
    t.visit([&](auto& x) {
      saved.push_back({[impl = x.impl(), copy = *x.impl()] {
        impl->storage = copy.storage;
        impl->offset = copy.offset;
        impl->strides = copy.strides;
        impl->grad = copy.grad;
        impl->grad_accumulator = copy.grad_accumulator;
      }});
    });
  });
  return saved;
}

CHORUS_INLINE void DataParallelCore::restore_tensors(const std::vector<SavedTensor>& saved) {
  for (const auto& s : saved) s.restore();
}

CHORUS_INLINE std::vector<nn::Module::NamedTensor> DataParallelCore::prefixed(
    std::vector<nn::Module::NamedTensor> named) const {
  if (!name_prefix_.empty())
    for (auto& t : named) t.name = name_prefix_ + t.name;
  return named;
}

CHORUS_INLINE DataParallelCore::InUse::InUse(std::atomic<bool>& flag) : flag_(flag) {
  bool expected = false;
  CHORUS_CHECK(flag_.compare_exchange_strong(expected, true, std::memory_order_acquire),
               "DataParallel: forward (or to()) called while another thread is inside forward of the same "
               "DataParallel; one DataParallel serves one thread at a time (replicas and their autograd "
               "wiring are shared): use one DataParallel per thread, or a lock around the whole step");
}

CHORUS_INLINE void DataParallelCore::check_not_nested() const {
  if (devices_.size() == 1) return;  // the passthrough posts nothing
  if (const Stream* w = ::chorus::detail::worker_stream_of_thread()) {
    std::string uses;
    for (std::size_t r = 1; r < streams_.size() && uses.empty(); ++r)
      if (streams_[r] == w) uses = " (this DataParallel runs replica " + std::to_string(r) + " on that very stream)";
    CHORUS_FAIL("DataParallel: forward called on the worker thread of ", w->str(),
                ", i.e. inside a replica's forward (a DataParallel nested in a replicated module?)", uses,
                "; nested DataParallel is not supported: it would wait for work queued behind itself. Call the "
                "inner module directly inside the outer model");
  }
}

// Note [active window]
// A training step posts work to the replicas' workers in bursts: the forward, then the
// backward (after the loss), then nothing until the next forward (after the optimizer
// step). A worker that fell asleep in a gap costs a wake-up at the next burst (up to
// ~100 us on some VMs, per burst). So each forward keeps the used workers spinning for
// twice the time since the previous forward (the step period), capped at kMaxActiveWindow:
// short steps never sleep between bursts; a loop that pauses between steps (evaluation,
// I/O) lets them sleep again after the cap. Spinning workers yield to runnable threads.
// The same window, up to kMaxLendWindow, lends the idle workers to the primary's large
// elementwise loops (Note [idle workers help]).
CHORUS_INLINE void DataParallelCore::keep_workers_hot(std::size_t used) {
  constexpr auto kMaxActiveWindow = std::chrono::milliseconds(10);
  constexpr auto kMaxLendWindow = std::chrono::seconds(1);
  const auto now = std::chrono::steady_clock::now();
  const auto period = now - last_forward_;
  last_forward_ = now;
  if (period <= kMaxLendWindow && devices_[0].is_cpu())  // not after the first step
    for (std::size_t r = 1; r < used; ++r) streams_[r]->lend_until(now + 2 * period);
  if (period > kMaxActiveWindow) return;  // also the first step
  const auto until = now + std::min<std::chrono::steady_clock::duration>(2 * period, kMaxActiveWindow);
  for (std::size_t r = 1; r < used; ++r) streams_[r]->keep_hot_until(until);
}

// Note [buffers written in forward]
// The broadcast that refreshes replica r runs on replica r's stream and reads the primary's
// flat buffers, while replica 0 (the primary itself) starts its forward on the caller's
// stream — and a forward may write its buffers in place (BatchNorm's running statistics).
// When the module has buffers, replica 0 therefore starts after every broadcast has read
// the primary: CPU streams are drained; CUDA streams are joined by events.
// On CUDA the event is recorded by a marker task on the replica's worker, after the
// broadcast's posted work (a repeated-GPU set copies from the worker: an event recorded from
// the caller could precede a copy the worker has not launched yet; Note [idle replicas]).
CHORUS_INLINE void DataParallelCore::wait_for_broadcasts() {
  for (std::size_t r = 1; r < devices_.size(); ++r) {
    if (devices_[r].is_cuda()) {
      auto done = streams_[r]->async([s = streams_[r]] {
        Event e;
        e.record(*s);
        return e;
      });
      done.get().block(current_stream(devices_[0]));
    } else {
      streams_[r]->synchronize();
    }
  }
}

CHORUS_INLINE void DataParallelCore::fork_replica_streams() {
  if (!devices_[0].is_cuda()) return;
  Event fork;
  fork.record(current_stream(devices_[0]));
  for (std::size_t r = 1; r < devices_.size(); ++r) fork.block(*streams_[r]);
}

CHORUS_INLINE std::int64_t DataParallelCore::scatter_dim(std::size_t i) const {
  return detail::dim_at(scatter_dims_, i, dim_);
}

namespace detail {
CHORUS_INLINE std::shared_ptr<Communicator> make_communicator(const std::vector<Device>& devices,
                                                              const std::vector<Stream*>& streams) {
#if CHORUS_CUDA
  // Distinct GPUs: NCCL. A repeated GPU (NCCL refuses it) or CPU devices: copies.
  bool distinct = devices.size() > 1 && devices[0].is_cuda();
  for (std::size_t i = 0; i < devices.size() && distinct; ++i)
    for (std::size_t j = 0; j < i; ++j) distinct = distinct && devices[i] != devices[j];
  if (distinct) return std::make_shared<NcclCommunicator>(streams);
#else
  (void)devices;
#endif
  return std::make_shared<CopyCommunicator>(streams);
}
}  // namespace detail

}  // namespace parallel
CHORUS_NAMESPACE_END
