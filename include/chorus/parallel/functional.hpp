#pragma once
// The functional pieces of data parallelism, as torch.nn.parallel's: replicate, parallel_apply
// over modules, data_parallel (scatter and gather are in scatter.hpp and gather.hpp).
//
// Note [functional data parallelism]
//   PyTorch                                           chorus
//   replicas = replicate(module, devices)             auto replicas = parallel::replicate(module, devices);
//   inputs = scatter(x, devices)                      auto inputs = parallel::scatter(x, devices);
//   outs = parallel_apply(replicas[:n], inputs)       auto outs = parallel::parallel_apply(replicas, inputs);
//   y = gather(outs, output_device)                   auto y = parallel::gather(outs, output_device);
//   y = data_parallel(module, (x,), devices)          auto y = parallel::data_parallel(module, x, devices);
// replicate's replicas are wired into autograd like DataParallel's (their gradients are summed
// into the module's parameters), and replica 0 is the module itself. data_parallel is one
// DataParallel step over a shallow copy of the module (its tensors are the module's), so it
// has DataParallel's semantics, options and errors; like PyTorch's it replicates at every
// call (a DataParallel kept across steps replicates once).
#include <memory>
#include <tuple>
#include <type_traits>
#include <vector>

#include "data_parallel.hpp"

CHORUS_NAMESPACE_BEGIN
namespace parallel {
namespace detail {
template <class X>
struct is_std_tuple : std::false_type {};
template <class... Ts>
struct is_std_tuple<std::tuple<Ts...>> : std::true_type {};

/// Each device's stream for a replica: the caller's current stream for devices[0], the next
/// free slot of its device for the others (a repeated device gets a stream per replica).
inline std::vector<Stream*> replica_streams(const std::vector<Device>& devices, bool caller_first) {
  std::vector<Stream*> streams;
  for (std::size_t r = 0; r < devices.size(); ++r) {
    int slot = 0;
    for (std::size_t q = 0; q < r; ++q) slot += devices[q] == devices[r];
    streams.push_back(r == 0 && caller_first ? &current_stream(devices[0]) : &get_stream(devices[r], slot));
  }
  return streams;
}
}  // namespace detail

/// The replicas parallel::replicate makes: replica r lives on devices()[r]; replica 0 is the
/// module itself. Keep it while the replicas run forward (their graphs need nothing of it).
template <class M>
class Replicas {
 public:
  /// Replicates `module` (on devices[0]) onto `devices`, which must be of one kind.
  Replicas(M& module, std::vector<Device> devices) : devices_(std::move(devices)) {
    CHORUS_CHECK(!devices_.empty(), "replicate: no devices");
    for (const auto& d : devices_) {
      check_device(d);
      CHORUS_CHECK(d.kind == devices_[0].kind, "replicate: devices mix kinds (", devices_[0], " and ", d, ")");
    }
    auto streams = detail::replica_streams(devices_, false);
    auto comm = detail::make_communicator(devices_, streams);
    replicator_ = std::make_unique<Replicator<M>>(module, devices_, comm,
                                                  devices_[0].is_cpu() ? kDefaultCpuBucketBytes : kDefaultBucketBytes);
    modules_ = replicator_->prepare(devices_.size());
  }
  /// The number of replicas, one per device.
  std::size_t size() const { return modules_.size(); }
  /// Replica `r` (checked: std::out_of_range past size()).
  M& operator[](std::size_t r) { return *modules_.at(r); }
  /// The devices, replica r's at [r].
  const std::vector<Device>& devices() const { return devices_; }
  /// Iterators over pointers to the replicas (M*), replica 0 first.
  ///@{
  auto begin() { return modules_.begin(); }
  auto end() { return modules_.end(); }
  ///@}

 private:
  std::vector<Device> devices_;
  std::unique_ptr<Replicator<M>> replicator_;
  std::vector<M*> modules_;
};

/// torch.nn.parallel.replicate: `module` (on devices[0]) on every device of `devices`.
template <class M>
Replicas<M> replicate(M& module, std::vector<Device> devices) {
  return Replicas<M>(module, std::move(devices));
}

/// torch.nn.parallel.parallel_apply: replica r's forward on inputs[r] (a std::tuple is the
/// argument list; one input per replica), each on its device's worker (replica 0 on the calling
/// thread). Errors as DataParallel's (Note [replica errors]).
template <class M, class A>
auto parallel_apply(Replicas<M>& replicas, const std::vector<A>& inputs) {
  // Every replica is wired into backward (its gradients are awaited): one input each.
  CHORUS_CHECK(inputs.size() == replicas.size(), "parallel_apply: ", inputs.size(), " inputs for ", replicas.size(),
               " replicas; replicate onto as many devices as scatter made pieces (PyTorch's replicate(module, "
               "devices[:len(inputs)]))");
  const std::vector<Device>& devices = replicas.devices();
  auto stats = std::make_shared<ReplicaStatsGroup>(static_cast<int>(inputs.size()));
  return parallel_apply(detail::replica_streams(devices, true), [&](std::size_t r) {
    StatsReducerScope sync(stats->member(static_cast<int>(r)));
    try {
      if constexpr (detail::is_std_tuple<A>::value)
        return std::apply([&](const auto&... a) { return detail::call_forward(replicas[r], a...); }, inputs[r]);
      else
        return detail::call_forward(replicas[r], inputs[r]);
    } catch (...) {
      stats->cancel(static_cast<int>(r));
      throw;
    }
  });
}

/// torch.nn.parallel.data_parallel: one DataParallel forward of `module` on `inputs` (a
/// std::tuple is the argument list, as PyTorch's inputs tuple; anything else one argument).
template <class M, class A>
auto data_parallel(M& module, const A& inputs, DataParallelOptions options = {}) {
  DataParallel<std::remove_const_t<M>> dp(module, std::move(options));  // a copy shares the module's tensors
  if constexpr (detail::is_std_tuple<A>::value) return std::apply([&](const auto&... a) { return dp(a...); }, inputs);
  else return dp(inputs);
}
/// data_parallel(module, inputs, device_ids, output_device, dim), PyTorch's positional form.
template <class M, class A>
auto data_parallel(M& module, const A& inputs, std::vector<Device> devices,
                   std::optional<Device> output_device = std::nullopt, std::int64_t dim = 0) {
  return data_parallel(module, inputs,
                       DataParallelOptions{.devices = std::move(devices), .output_device = output_device, .dim = dim});
}

}  // namespace parallel
CHORUS_NAMESPACE_END
