#pragma once
// DataLoader: batches of a Dataset, in order or shuffled by a seeded generator.
#include <algorithm>
#include <functional>
#include <numeric>
#include <random>

#include "dataset.hpp"

CHORUS_NAMESPACE_BEGIN
namespace data {

struct DataLoaderOptions {
  std::int64_t batch_size = 1;  ///< an int64 like every size in the API: `{.batch_size = n}` with an int n
  bool shuffle = false;
  std::uint64_t seed = 0;   ///< seeds the shuffling; each epoch draws a new permutation
  bool drop_last = false;   ///< drop a last batch smaller than batch_size
};

/// Something that picks the indices of an epoch (data::DistributedSampler, say).
template <class S>
concept Sampler = requires(const S& s) {
  { s.size() } -> std::convertible_to<std::size_t>;
  { s.indices() } -> std::convertible_to<std::vector<std::size_t>>;
};

template <Dataset D>
class DataLoader {
 public:
  using Batch = example_t<D>;

  DataLoader(D dataset, DataLoaderOptions options)
      : dataset_(std::move(dataset)), options_(options), rng_(options.seed) {
    CHORUS_CHECK(options_.batch_size > 0, "DataLoader: batch_size must be positive, got ", options_.batch_size);
  }
  /// Batches of the indices `sampler` picks each epoch (it is read at every begin(), so a
  /// set_epoch() on it takes effect; it must outlive the loader). Excludes options.shuffle.
  template <Sampler S>
  DataLoader(D dataset, DataLoaderOptions options, const S& sampler) : DataLoader(std::move(dataset), options) {
    CHORUS_CHECK(!options_.shuffle, "DataLoader: shuffle and a sampler exclude each other (the sampler shuffles)");
    sampler_size_ = [&sampler] { return static_cast<std::size_t>(sampler.size()); };
    sampler_order_ = [&sampler] { return std::vector<std::size_t>(sampler.indices()); };
  }

  /// Batches in one epoch.
  std::size_t num_batches() const {
    // n / b rounded up without n + b - 1, which wraps for a huge batch_size.
    const std::size_t n = sampler_size_ ? sampler_size_() : dataset_.size();
    const auto b = static_cast<std::size_t>(options_.batch_size);
    return options_.drop_last ? n / b : n / b + (n % b != 0);
  }
  const D& dataset() const { return dataset_; }

  class Iterator {
   public:
    using value_type = Batch;
    using difference_type = std::ptrdiff_t;
    Iterator(const DataLoader* loader, std::shared_ptr<const std::vector<std::size_t>> order, std::size_t batch)
        : loader_(loader), order_(std::move(order)), batch_(batch) {}
    Batch operator*() const { return loader_->make_batch(*order_, batch_); }
    Iterator& operator++() {
      ++batch_;
      return *this;
    }
    bool operator==(const Iterator& o) const { return batch_ == o.batch_; }
    bool operator!=(const Iterator& o) const { return batch_ != o.batch_; }

   private:
    const DataLoader* loader_;
    std::shared_ptr<const std::vector<std::size_t>> order_;
    std::size_t batch_;
  };

  /// Starts an epoch (drawing a new permutation when shuffling).
  Iterator begin() {
    if (sampler_order_) return Iterator(this, std::make_shared<const std::vector<std::size_t>>(sampler_order_()), 0);
    auto order = std::make_shared<std::vector<std::size_t>>(dataset_.size());
    std::iota(order->begin(), order->end(), std::size_t{0});
    if (options_.shuffle) std::shuffle(order->begin(), order->end(), rng_);
    return Iterator(this, std::move(order), 0);
  }
  Iterator end() { return Iterator(this, nullptr, num_batches()); }

 private:
  Batch make_batch(const std::vector<std::size_t>& order, std::size_t b) const {
    const std::size_t size = static_cast<std::size_t>(options_.batch_size);
    const std::size_t start = b * size;  // b < num_batches(), so start < order.size()
    const std::size_t stop = start + std::min(size, order.size() - start);
    std::vector<std::size_t> idx(order.begin() + static_cast<std::ptrdiff_t>(start),
                                 order.begin() + static_cast<std::ptrdiff_t>(stop));
    if constexpr (BatchDataset<D>) {
      return dataset_.get_batch(idx);
    } else {
      std::vector<Batch> items;
      items.reserve(idx.size());
      for (auto i : idx) items.push_back(dataset_.get(i));
      return stack_batch(items);
    }
  }

  D dataset_;
  DataLoaderOptions options_;
  std::mt19937_64 rng_;
  std::function<std::size_t()> sampler_size_;
  std::function<std::vector<std::size_t>()> sampler_order_;
};

}  // namespace data
CHORUS_NAMESPACE_END
