#pragma once
// DataParallel's options: devices, output device, and the dims inputs split and outputs join along.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "../core/device.hpp"

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
// longer than the arguments or outputs is an error.
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

CHORUS_NAMESPACE_END
