#pragma once
// DataLoader: batches of a Dataset, in order, shuffled by a seeded generator, or in the order a
// sampler picks; built on the calling thread or prefetched by worker threads.
//
// Note [deterministic workers]
// The batches of an epoch do not depend on the number of workers: the order is drawn on the
// loader (one permutation per epoch), batch b is always the same indices, and per-example
// randomness (transforms) is seeded from (seed, epoch, example index) by the dataset
// (set_epoch), never from a worker's own generator. Worker w builds batches w, w + W, …; the
// consumer takes them in order, so the stream of batches is identical for any W.
//
// Note [prefetch window]
// A worker may build batch b once b - next < W * prefetch_factor (next: the batch the consumer
// waits for). The window is a saturating product and the test a difference, never next + window:
// a huge prefetch_factor (a "no limit" guess) must mean "no limit", not a wrapped sum that stops
// every worker after the first batch and hangs the consumer.
#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <thread>
#include <type_traits>
#include <typeinfo>

#include "../compiled.hpp"
#include "../core/host_engine.hpp"
#include "../core/profiler.hpp"
#include "dataset.hpp"
#include "pinned.hpp"

CHORUS_NAMESPACE_BEGIN
namespace data {

/// DataLoader's options (torch.utils.data.DataLoader's arguments).
struct DataLoaderOptions {
  std::int64_t batch_size = 1;     ///< examples per batch (> 0); an int64 like every size in the API
  bool shuffle = false;            ///< a new random order each epoch (not with a sampler)
  std::uint64_t seed = 0;          ///< seeds the shuffling; each epoch draws a new permutation
  bool drop_last = false;          ///< drop a last batch smaller than batch_size
  std::int64_t num_workers = 0;    ///< threads building batches ahead (0: on the calling thread)
  /// Batches each worker may have ready ahead of the consumer: 2 when not given; only with
  /// workers (PyTorch refuses it with num_workers = 0, where nothing is prefetched).
  std::optional<std::int64_t> prefetch_factor = std::nullopt;
  bool pin_memory = false;         ///< copy batches into page-locked memory (CUDA builds with a GPU)
};

namespace detail {
/// Checks a loader's options and returns the batches its workers may build ahead of the
/// consumer, num_workers * prefetch_factor saturated (Note [prefetch window]).
CHORUS_INLINE std::size_t checked_prefetch_window(const DataLoaderOptions& options);
}  // namespace detail

/// Something that picks the indices of an epoch (data::DistributedSampler, say).
template <class S>
concept Sampler = requires(const S& s) {
  { s.size() } -> std::convertible_to<std::size_t>;
  { s.indices() } -> std::convertible_to<std::vector<std::size_t>>;
};

/// A dataset whose per-example randomness depends on the epoch (see Note [deterministic workers]).
template <class D>
concept EpochAwareDataset = requires(D& d, std::uint64_t e) { d.set_epoch(e); };

// Note [sampler ownership]
// A loader owns its sampler (passed by value: a temporary or std::move) or shares it (a
// std::shared_ptr). A plain lvalue is refused at compile time: a copy would silently ignore a
// later sampler.set_epoch(e) on the caller's object (every epoch the same order), and a
// reference could dangle. To keep calling set_epoch, share it (`auto s = std::make_shared<…>`)
// or reach the owned one through loader.sampler<S>().
/// Iterates over batches of a dataset (torch.utils.data.DataLoader): `for (const auto& batch : loader)`
/// runs one epoch; each begin() starts a new one.
template <Dataset D>
class DataLoader {
 public:
  /// A batch: what the dataset's get() returns, stacked along a new dimension 0.
  using Batch = example_t<D>;

  /// Batches of `dataset` (which the loader takes) in order, or shuffled; throws on an invalid option.
  DataLoader(D dataset, DataLoaderOptions options)
      : dataset_(std::make_shared<D>(std::move(dataset))), options_(options), rng_(options.seed) {
    window_ = detail::checked_prefetch_window(options_);
  }
  /// Batches of the indices `sampler` picks each epoch, read at every begin() (so a set_epoch()
  /// on it takes effect); the loader owns it (Note [sampler ownership]). Excludes options.shuffle.
  template <class S>
    requires Sampler<S> && (!std::is_reference_v<S>)
  DataLoader(D dataset, DataLoaderOptions options, S&& sampler)
      : DataLoader(std::move(dataset), options, std::make_shared<S>(std::move(sampler))) {}
  /// The same with a sampler shared with the caller, who may go on calling set_epoch on it.
  template <Sampler S>
  DataLoader(D dataset, DataLoaderOptions options, std::shared_ptr<S> sampler)
      : DataLoader(std::move(dataset), options) {
    CHORUS_CHECK(sampler != nullptr, "DataLoader: the sampler is a null shared_ptr");
    CHORUS_CHECK(!options_.shuffle, "DataLoader: shuffle and a sampler exclude each other (the sampler shuffles)");
    const S* s = sampler.get();
    sampler_size_ = [s] { return static_cast<std::size_t>(s->size()); };
    sampler_order_ = [s] { return std::vector<std::size_t>(s->indices()); };
    sampler_type_ = &typeid(S);
    sampler_const_ = std::is_const_v<S>;
    sampler_ = std::const_pointer_cast<std::remove_const_t<S>>(std::move(sampler));
  }
  /// A sampler lvalue: std::move it (owned) or pass a std::shared_ptr (Note [sampler ownership]).
  template <Sampler S>
  DataLoader(D dataset, DataLoaderOptions options, S& sampler) = delete;
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;
  /// Moves the dataset, sampler and active epoch to another loader.
  ///@{
  DataLoader(DataLoader&&) noexcept = default;
  DataLoader& operator=(DataLoader&&) noexcept = default;
  ///@}
  ~DataLoader() = default;  // the active epoch's destructor stops and joins its workers

  /// Batches in one epoch.
  std::size_t num_batches() const {
    // n / b rounded up without n + b - 1, which wraps for a huge batch_size.
    const std::size_t n = sampler_size_ ? sampler_size_() : dataset_->size();
    const auto b = static_cast<std::size_t>(options_.batch_size);
    return options_.drop_last ? n / b : n / b + (n % b != 0);
  }
  /// The loader's dataset.
  const D& dataset() const { return *dataset_; }
  /// The loader's options.
  const DataLoaderOptions& options() const { return options_; }
  /// Epochs started so far (begin() calls).
  std::uint64_t epoch() const { return epoch_; }
  /// Whether the loader was built with a sampler.
  bool has_sampler() const { return sampler_ != nullptr; }
  /// The sampler (PyTorch's loader.sampler), as its type S: loader.sampler<DistributedSampler>().set_epoch(e).
  template <class S>
  S& sampler() const {
    CHORUS_CHECK(sampler_, "DataLoader: this loader has no sampler");
    CHORUS_CHECK(*sampler_type_ == typeid(S), "DataLoader: the sampler is a ", sampler_type_->name(), ", not a ",
                 typeid(S).name());
    CHORUS_CHECK(std::is_const_v<S> || !sampler_const_, "DataLoader: the sampler was given as const; ask for sampler<const ",
                 typeid(S).name(), ">()");
    return *static_cast<S*>(sampler_.get());
  }

 private:
  // One pass over the data; owns the workers (if any) that build its batches.
  class Epoch {
   public:
    Epoch(std::shared_ptr<const D> dataset, const DataLoaderOptions& options, std::vector<std::size_t> order,
          std::size_t num_batches, std::size_t window)
        : dataset_(std::move(dataset)),
          options_(options),
          order_(std::move(order)),
          num_batches_(num_batches),
          stride_(static_cast<std::size_t>(options_.num_workers)),
          window_(window) {
      // Worker w builds batches w, w + W, …: workers beyond the epoch's batch count would have
      // none, so a huge num_workers starts no more threads than there are batches.
      const std::size_t threads = std::min(stride_, num_batches_);
#if CHORUS_CUDA
      // Note [pinning workers' device]: a new thread's current CUDA device is 0, and a worker's
      // first cudaHostAlloc would create a context there: every rank of a DDP job on GPU r
      // would hold one more context on GPU 0. The workers pin on the consumer's device.
      if (options_.pin_memory && pinning_available()) CHORUS_CUDA_CHECK(cudaGetDevice(&consumer_device_));
#endif
      workers_.reserve(threads);
      try {
        for (std::size_t w = 0; w < threads; ++w) workers_.emplace_back([this, w] {
            profiler::set_thread_name("loader worker " + std::to_string(w));
            work(w);
          });
      } catch (const std::exception& e) {
        stop();  // the started workers are joined: a joinable std::thread's destructor would terminate
        CHORUS_FAIL("DataLoader: could not start worker thread ", workers_.size(), " of ", threads, ": ", e.what());
      }
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
      // Past the end no worker would ever build the batch (a hang), nor does the order hold it.
      CHORUS_CHECK(b < num_batches_, "DataLoader: batch ", b, " requested from an epoch of ", num_batches_,
                   " batches (an iterator at or past end())");
      const profiler::Scope span(profiler::Category::data, [&] { return "batch " + std::to_string(b); });
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
        // b, and any batch the consumer skipped while a worker was already building it.
        ready_.erase(ready_.begin(), ready_.upper_bound(b));
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
#if CHORUS_CUDA
      if (consumer_device_ >= 0 && cuda::tolerate(cudaSetDevice(consumer_device_)) != cudaSuccess) {
        {
          std::lock_guard lk(m_);
          Slot slot;
          slot.error = "DataLoader worker " + std::to_string(w) + ": cudaSetDevice(" +
                       std::to_string(consumer_device_) + ") failed, so it cannot pin batches";
          for (std::size_t b = w; b < num_batches_; b += stride_) ready_.emplace(b, slot);
        }
        ready_cv_.notify_all();
        return;
      }
#endif
      // b + stride_ cannot wrap: stride_ is an int64 option and b < num_batches_ <= order_.size(),
      // the length of a vector (both below 2^63).
      for (std::size_t b = w; b < num_batches_; b += stride_) {
        {
          std::unique_lock lk(m_);
          // b - next_ < window_, never b < next_ + window_ (Note [prefetch window]).
          work_cv_.wait(lk, [&] { return stopped_ || b < next_ || b - next_ < window_; });
          if (stopped_) return;
          if (b < next_) continue;  // the consumer skipped it (it asks only for b >= next_)
        }
        Slot slot;
        try {
          const profiler::Scope span(profiler::Category::other, [&] { return "build batch " + std::to_string(b); });
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
    std::size_t stride_;  // W: worker w builds batches w, w + W, …
    std::size_t window_;  // Note [prefetch window]
    int consumer_device_ = -1;  // the CUDA device the workers pin on (Note [pinning workers' device])
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
  /// An input iterator over one epoch's batches; batches must be read in order.
  class Iterator {
   public:
    using value_type = Batch;                ///< A batch.
    using difference_type = std::ptrdiff_t;  ///< A distance in batches.
    /// Internal: made by begin() and end() (a null epoch: the end).
    Iterator(std::shared_ptr<Epoch> epoch, std::size_t batch) : epoch_(std::move(epoch)), batch_(batch) {}
    /// The current batch, waiting for a worker to build it if need be; valid until the next batch is read.
    const Batch& operator*() const {
      CHORUS_CHECK(epoch_ != nullptr, "DataLoader: dereferencing end(), which holds no batch");
      return epoch_->get(batch_);
    }
    /// Moves to the next batch.
    Iterator& operator++() {
      ++batch_;
      return *this;
    }
    /// Compares batch positions only (not epochs).
    ///@{
    bool operator==(const Iterator& o) const { return batch_ == o.batch_; }
    bool operator!=(const Iterator& o) const { return batch_ != o.batch_; }
    ///@}

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
      CHORUS_CHECK(dataset_->size() <= order.max_size(), "DataLoader: the dataset's size() is ", dataset_->size(),
                   ", more indices than a vector holds");
      order.resize(dataset_->size());
      std::iota(order.begin(), order.end(), std::size_t{0});
      if (options_.shuffle) std::shuffle(order.begin(), order.end(), rng_);
    }
    auto epoch = std::make_shared<Epoch>(dataset_, options_, std::move(order), num_batches(), window_);
    active_ = epoch;
    return Iterator(std::move(epoch), 0);
  }
  /// The position past the last batch of an epoch.
  Iterator end() { return Iterator(nullptr, num_batches()); }

 private:
  std::shared_ptr<D> dataset_;
  DataLoaderOptions options_;
  HostEngine rng_;  // std::mt19937_64's numbers (Note [host engine])
  std::uint64_t epoch_ = 0;
  std::size_t window_ = 0;  // batches the workers may build ahead (Note [prefetch window])
  std::weak_ptr<Epoch> active_;
  // The sampler, type-erased so that one DataLoader<D> type takes any (Note [sampler ownership]).
  std::shared_ptr<void> sampler_;
  const std::type_info* sampler_type_ = nullptr;
  bool sampler_const_ = false;
  std::function<std::size_t()> sampler_size_;
  std::function<std::vector<std::size_t>()> sampler_order_;
};

}  // namespace data
CHORUS_NAMESPACE_END

#if !CHORUS_COMPILED
#include "dataloader_impl.hpp"
#endif
