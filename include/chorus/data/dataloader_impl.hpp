#pragma once
// The definitions of data/dataloader.hpp's non-template parts: compiled into chorus::compiled
// (src/data/loader.cpp), included by dataloader.hpp itself only in the header-only form (Note
// [compiled chorus]). DataLoader<Dataset> itself stays in the header: it is a template over the
// user's dataset.
#include "dataloader.hpp"

CHORUS_NAMESPACE_BEGIN
namespace data {
namespace detail {

CHORUS_INLINE std::size_t checked_prefetch_window(const DataLoaderOptions& options) {
  CHORUS_CHECK(options.batch_size > 0, "DataLoader: batch_size must be positive, got ", options.batch_size);
  CHORUS_CHECK(options.num_workers >= 0, "DataLoader: num_workers must not be negative, got ", options.num_workers,
               " (0 builds the batches on the calling thread)");
  CHORUS_CHECK(options.num_workers > 0 || !options.prefetch_factor,
               "DataLoader: prefetch_factor (", options.prefetch_factor.value_or(0),
               ") needs num_workers > 0; without workers nothing is prefetched");
  CHORUS_CHECK(options.prefetch_factor.value_or(2) > 0, "DataLoader: prefetch_factor must be positive, got ",
               options.prefetch_factor.value_or(0));
  // Saturating: Note [prefetch window].
  const auto w = static_cast<std::uint64_t>(options.num_workers);
  const auto f = static_cast<std::uint64_t>(options.prefetch_factor.value_or(2));
  return w != 0 && f > std::numeric_limits<std::size_t>::max() / w ? std::numeric_limits<std::size_t>::max()
                                                                    : static_cast<std::size_t>(w * f);
}

}  // namespace detail
}  // namespace data
CHORUS_NAMESPACE_END
