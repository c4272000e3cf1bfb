#pragma once
// DataParallel's options: devices, output device, and the dims inputs split and outputs join along;
// the defaults of its gradient buckets and of its small steps.
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "../core/device.hpp"
#include "../error.hpp"

CHORUS_NAMESPACE_BEGIN

// Note [scatter and gather dims]
// PyTorch's DataParallel splits every tensor along one `dim` and joins every output along it.
// A sequence model needs more: an LSTM's input (batch, seq, feature) splits along 0 but its
// state (h0, c0), (layers, batch, hidden), along 1, and so do the outputs. So the options say
// it once, per forward argument and per output:
//   DataParallel<Model> dp(model, {.devices = devices, .scatter_dims = {0, 1}, .gather_dims = {0, 1}});
//   auto [out, state] = dp(x, std::make_tuple(h0, c0));  // x along 0; h0 and c0 along 1
// scatter_dims[i] is the split dim of every tensor inside forward argument i (Note [nested
// arguments]); gather_dims[i] the join dim of every tensor inside element i of the returned
// tuple or pair (a forward returning anything else: gather_dims[0] for all of it). Arguments
// and outputs past the lists, or with empty lists, use `dim`. A negative dim counts from each
// tensor's last. Every split tensor must have the same size along its dim (the batch); a list
// longer than the arguments or outputs is an error. An argument whose dim is kBroadcast is not
// split: each replica gets all of it, on its device (an attention mask [L, L] beside a batch
// [N, L]; its gradient, if it needs one, is the replicas' summed):
//   DataParallel<Model> dp(model, {.scatter_dims = {0, kBroadcast}});
//   auto out = dp(x, mask);  // x along 0; mask whole to every replica
/// The scatter dim of an argument that every replica gets whole (Note [scatter and gather dims]).
inline constexpr std::int64_t kBroadcast = std::numeric_limits<std::int64_t>::min();


/// DataParallel's options (Note [scatter and gather dims]), with designated initializers:
/// DataParallel<M> dp(module, {.devices = {...}, .scatter_dims = {0, 1}}).
struct DataParallelOptions {
  std::vector<Device> devices = {};                     ///< default: all GPUs, else the virtual CPU devices
  std::optional<Device> output_device = std::nullopt;   ///< default: devices[0]
  std::int64_t dim = 0;                                 ///< split and join dim where the lists say nothing
  std::vector<std::int64_t> scatter_dims = {};          ///< per forward argument
  std::vector<std::int64_t> gather_dims = {};           ///< per element of the returned tuple
  std::optional<std::size_t> bucket_bytes = std::nullopt;  ///< Note [gradient buckets]
};

/// Default size of a gradient bucket on GPUs (Note [gradient buckets]).
inline constexpr std::size_t kDefaultBucketBytes = std::size_t{8} << 20;
/// Default size of a gradient bucket on CPU devices: 0, one bucket per parameter. A CPU
/// bucket is handed over without a copy (Note [host aliases]), so a bucket costs only its node
/// (microseconds), and small ones let the primary add each layer's gradients as soon as that
/// layer is done instead of at the end of backward (Note [gradient buckets]).
inline constexpr std::size_t kDefaultCpuBucketBytes = 0;

// Note [inline small steps]
// Handing a replica's forward to its device's worker costs a wake-up when the worker sleeps:
// a few microseconds on one VM, 100 us on another (a tutorial batch measured
// 130 us on a 2-vCPU VM where a single Linear(5, 2) takes 2 us). A step whose replicas
// 1 … k-1 together have less work than that runs them on the calling thread instead, one
// after another, on CPU devices: each still under its own stream (so autograd sends its
// backward to its device as usual), with its own parameters, copied by the caller. The work
// is estimated as rows × (2 × parameter elements) + input elements, for the rows that would
// leave the caller; at or below the threshold (default kDefaultInlineWork, about 10-50 us
// of one core's small-op work) the step stays on the caller. 0 turns it off. A module with a
// layer that meets the other replicas inside forward (SyncBatchNorm: nn::Module::
// meets_other_replicas) never runs inline: its replicas must run at the same time.
/// The default inline-work threshold, 2^16 (Note [inline small steps]).
inline constexpr std::int64_t kDefaultInlineWork = std::int64_t{1} << 16;

namespace parallel {
namespace detail {
inline std::atomic<std::int64_t>& inline_work_default() {
  static std::atomic<std::int64_t> v{kDefaultInlineWork};
  return v;
}
}  // namespace detail
/// The inline-work threshold new DataParallels start with (Note [inline small steps]).
inline void set_inline_work_default(std::int64_t work) {
  CHORUS_CHECK(work >= 0, "set_inline_work_default: work must be >= 0, got ", work);
  detail::inline_work_default().store(work);
}
/// The inline-work threshold new DataParallels start with: kDefaultInlineWork until set_inline_work_default.
inline std::int64_t inline_work_default() { return detail::inline_work_default().load(); }
}  // namespace parallel

CHORUS_NAMESPACE_END
