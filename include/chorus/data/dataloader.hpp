#pragma once
// DataLoader: batches of a Dataset, in order or shuffled by a seeded generator, built on the
// calling thread or prefetched by worker threads.
//
// Note [deterministic workers]
// The batches of an epoch do not depend on the number of workers: the order is drawn on the
// loader (one permutation per epoch), batch b is always the same indices, and per-example
// randomness (transforms) is seeded from (seed, epoch, example index) by the dataset
// (set_epoch), never from a worker's own generator. Worker w builds batches w, w + W, …; the
// consumer takes them in order, so the stream of batches is identical for any W.
#include <algorithm>
#include <functional>
#include <condition_variable>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <thread>

#include "dataset.hpp"
#include "pinned.hpp"

CHORUS_NAMESPACE_BEGIN
namespace data {

struct DataLoaderOptions {
  std::int64_t batch_size = 1;  ///< an int64 like every size in the API: `{.batch_size = n}` with an int n
  bool shuffle = false;
  std::uint64_t seed = 0;          ///< seeds the shuffling; each epoch draws a new permutation
  bool drop_last = false;          ///< drop a last batch smaller than batch_size
  std::int64_t num_workers = 0;     ///< threads building batches ahead (0: on the calling thread)
  std::int64_t prefetch_factor = 2; ///< batches each worker may have ready ahead of the consumer
  bool pin_memory = false;         ///< copy batches into page-locked memory (CUDA builds with a GPU)
};

/// Something that picks the indices of an epoch (data::DistributedSampler, say).
template <class S>
concept Sampler = requires(const S& s) {
  { s.size() } -> std::convertible_to<std::size_t>;
  { s.indices() } -> std::convertible_to<std::vector<std::size_t>>;
};

/// A dataset whose per-example randomness depends on the epoch (see Note [deterministic workers]).
template <class D>
concept EpochAwareDataset = requires(D& d, std::uint64_t e) { d.set_epoch(e); };

template <Dataset D>
class DataLoader {
 public:
  using Batch = example_t<D>;

  DataLoader(D dataset, DataLoaderOptions options)
      : dataset_(std::make_shared<D>(std::move(dataset))), options_(options), rng_(options.seed) {
    CHORUS_CHECK(options_.batch_size > 0, "DataLoader: batch_size must be positive, got ", options_.batch_size);
    CHORUS_CHECK(options_.num_workers >= 0, "DataLoader: num_workers must not be negative, got ", options_.num_workers);
    CHORUS_CHECK(options_.num_workers == 0 || options_.prefetch_factor > 0,
                 "DataLoader: prefetch_factor must be positive with workers, got ", options_.prefetch_factor);
  }
  /// Batches of the indices `sampler` picks each epoch (it is read at every begin(), so a
  /// set_epoch() on it takes effect; it must outlive the loader). Excludes options.shuffle.
  template <Sampler S>
  DataLoader(D dataset, DataLoaderOptions options, const S& sampler) : DataLoader(std::move(dataset), options) {
    CHORUS_CHECK(!options_.shuffle, "DataLoader: shuffle and a sampler exclude each other (the sampler shuffles)");
    sampler_size_ = [&sampler] { return static_cast<std::size_t>(sampler.size()); };
    sampler_order_ = [&sampler] { return std::vector<std::size_t>(sampler.indices()); };
  }
  /// The loader keeps a reference to its sampler: a temporary one would dangle.
  template <Sampler S>
  DataLoader(D dataset, DataLoaderOptions options, const S&& sampler) = delete;
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;
  DataLoader(DataLoader&&) noexcept = default;
  DataLoader& operator=(DataLoader&&) noexcept = default;
  ~DataLoader() = default;  // the active epoch's destructor stops and joins its workers

  /// Batches in one epoch.
  std::size_t num_batches() const {
    // n / b rounded up without n + b - 1, which wraps for a huge batch_size.
    const std::size_t n = sampler_size_ ? sampler_size_() : dataset_->size();
    const auto b = static_cast<std::size_t>(options_.batch_size);
    return options_.drop_last ? n / b : n / b + (n % b != 0);
  }
  const D& dataset() const { return *dataset_; }
  const DataLoaderOptions& options() const { return options_; }
  /// Epochs started so far (begin() calls).
  std::uint64_t epoch() const { return epoch_; }

 private:
  // One pass over the data; owns the workers (if any) that build its batches.
  class Epoch {
   public:
    Epoch(std::shared_ptr<const D> dataset, const DataLoaderOptions& options, std::vector<std::size_t> order,
          std::size_t num_batches)
        : dataset_(std::move(dataset)), options_(options), order_(std::move(order)), num_batches_(num_batches) {
      const auto workers = static_cast<std::size_t>(options_.num_workers);
      for (std::size_t w = 0; w < workers; ++w) workers_.emplace_back([this, w] { work(w); });
    }
    ~Epoch() { stop(); }
    Epoch(const Epoch&) = delete;
    Epoch& operator=(const Epoch&) = delete;

    /// Stops the workers: each finishes at most the batch it is building.
    void stop() {
      {
        std::lock_guard lk(m_);
        stopped_ = true;
      }
      work_cv_.notify_all();
      for (auto& t : workers_)
        if (t.joinable()) t.join();
    }

    const Batch& get(std::size_t b) {
      if (current_ && current_index_ == b) return *current_;
      if (workers_.empty()) {
        current_ = make_batch(b);
      } else {
        std::unique_lock lk(m_);
        CHORUS_CHECK(!stopped_, "DataLoader: this epoch was ended by a newer begin() or by the loader's destruction");
        CHORUS_CHECK(b >= next_, "DataLoader: batch ", b, " was requested after batch ", next_ - 1,
                     "; batches are consumed in order");
        next_ = b;  // lets the workers run ahead of b
        work_cv_.notify_all();
        ready_cv_.wait(lk, [&] { return ready_.count(b) > 0; });
        Slot slot = std::move(ready_.at(b));
        ready_.erase(b);
        next_ = b + 1;
        lk.unlock();
        work_cv_.notify_all();
        if (!slot.batch) CHORUS_FAIL(slot.error);
        current_ = std::move(slot.batch);
      }
      current_index_ = b;
      return *current_;
    }

   private:
    struct Slot {
      std::optional<Batch> batch;
      std::string error;
    };

    void work(std::size_t w) {
      const auto W = static_cast<std::size_t>(options_.num_workers);
      const std::size_t ahead = W * static_cast<std::size_t>(options_.prefetch_factor);
      for (std::size_t b = w; b < num_batches_; b += W) {
        {
          std::unique_lock lk(m_);
          work_cv_.wait(lk, [&] { return stopped_ || b < next_ + ahead; });
          if (stopped_) return;
        }
        Slot slot;
        try {
          slot.batch = make_batch(b);
        } catch (const std::exception& e) {
          slot.error = "DataLoader worker " + std::to_string(w) + " failed on batch " + std::to_string(b) + ": " +
                       e.what();
        } catch (...) {
          slot.error = "DataLoader worker " + std::to_string(w) + " failed on batch " + std::to_string(b) +
                       " with an exception that is not a std::exception";
        }
        {
          std::lock_guard lk(m_);
          ready_.emplace(b, std::move(slot));
        }
        ready_cv_.notify_all();
      }
    }

    Batch make_batch(std::size_t b) const {
      const auto size = static_cast<std::size_t>(options_.batch_size);
      const std::size_t start = b * size;  // b < num_batches, so start < order_.size()
      const std::size_t stop = start + std::min(size, order_.size() - start);
      std::vector<std::size_t> idx(order_.begin() + static_cast<std::ptrdiff_t>(start),
                                   order_.begin() + static_cast<std::ptrdiff_t>(stop));
      Batch batch = [&] {
        if constexpr (BatchDataset<D>) {
          return dataset_->get_batch(idx);
        } else {
          std::vector<Batch> items;
          items.reserve(idx.size());
          for (auto i : idx) items.push_back(dataset_->get(i));
          return stack_batch(items);
        }
      }();
      if (options_.pin_memory) batch = pin_batch(std::move(batch));
      return batch;
    }

    std::shared_ptr<const D> dataset_;
    DataLoaderOptions options_;
    std::vector<std::size_t> order_;
    std::size_t num_batches_;
    std::vector<std::thread> workers_;
    std::mutex m_;
    std::condition_variable work_cv_, ready_cv_;
    std::map<std::size_t, Slot> ready_;
    std::size_t next_ = 0;  // the batch the consumer waits for next
    bool stopped_ = false;
    std::optional<Batch> current_;
    std::size_t current_index_ = 0;
  };

 public:
  class Iterator {
   public:
    using value_type = Batch;
    using difference_type = std::ptrdiff_t;
    Iterator(std::shared_ptr<Epoch> epoch, std::size_t batch) : epoch_(std::move(epoch)), batch_(batch) {}
    const Batch& operator*() const { return epoch_->get(batch_); }
    Iterator& operator++() {
      ++batch_;
      return *this;
    }
    bool operator==(const Iterator& o) const { return batch_ == o.batch_; }
    bool operator!=(const Iterator& o) const { return batch_ != o.batch_; }

   private:
    std::shared_ptr<Epoch> epoch_;
    std::size_t batch_;
  };

  /// Starts an epoch: ends the previous one (stopping its workers), draws a new permutation
  /// when shuffling, tells an epoch-aware dataset the epoch, and starts the workers.
  Iterator begin() {
    if (auto old = active_.lock()) old->stop();
    if constexpr (EpochAwareDataset<D>) dataset_->set_epoch(epoch_);
    ++epoch_;
    std::vector<std::size_t> order;
    if (sampler_order_) {
      order = sampler_order_();
      CHORUS_CHECK(order.size() == sampler_size_(), "DataLoader: the sampler's indices() has ", order.size(),
                   " indices but its size() says ", sampler_size_());
      for (auto i : order)
        CHORUS_CHECK(i < dataset_->size(), "DataLoader: the sampler picked index ", i, ", the dataset has ",
                     dataset_->size(), " examples");
    } else {
      order.resize(dataset_->size());
      std::iota(order.begin(), order.end(), std::size_t{0});
      if (options_.shuffle) std::shuffle(order.begin(), order.end(), rng_);
    }
    auto epoch = std::make_shared<Epoch>(dataset_, options_, std::move(order), num_batches());
    active_ = epoch;
    return Iterator(std::move(epoch), 0);
  }
  Iterator end() { return Iterator(nullptr, num_batches()); }

 private:
  std::shared_ptr<D> dataset_;
  DataLoaderOptions options_;
  std::mt19937_64 rng_;
  std::uint64_t epoch_ = 0;
  std::weak_ptr<Epoch> active_;
  std::function<std::size_t()> sampler_size_;
  std::function<std::vector<std::size_t>()> sampler_order_;
};

}  // namespace data
CHORUS_NAMESPACE_END
