// Datasets and the DataLoader.
#include <algorithm>
#include <set>
#include <numeric>
#include <random>

#include "test_util.hpp"

using namespace chorus;
using chorus::testing::throws_with;

namespace {
// The tutorial's dataset: `length` random vectors of `size` features.
struct RandomDataset {
  Tensor<float> data;
  RandomDataset(int size, int length) : data(randn<float>({length, size})) {}
  std::size_t size() const { return static_cast<std::size_t>(data.size(0)); }
  Tensor<float> get(std::size_t i) const { return data.select(0, static_cast<std::int64_t>(i)); }
};
static_assert(data::Dataset<RandomDataset>);
static_assert(!data::BatchDataset<RandomDataset>);
static_assert(data::BatchDataset<data::TensorDataset<float, std::int64_t>>);
}  // namespace

TEST(DataLoader, BatchesInOrderWithAShortLastBatch) {
  data::DataLoader loader(RandomDataset(5, 100), {.batch_size = 30});
  EXPECT_EQ(loader.num_batches(), 4u);
  std::vector<Shape> shapes;
  std::vector<float> first;
  for (auto batch : loader) {
    shapes.push_back(batch.shape());
    if (first.empty()) first = batch.to_vector();
  }
  EXPECT_EQ(shapes, (std::vector<Shape>{{30, 5}, {30, 5}, {30, 5}, {10, 5}}));
  auto expect = loader.dataset().data.narrow(0, 0, 30).to_vector();
  EXPECT_EQ(first, expect);
}

TEST(DataLoader, DropLast) {
  data::DataLoader loader(RandomDataset(5, 100), {.batch_size = 30, .drop_last = true});
  int n = 0;
  for (auto b : loader) {
    EXPECT_EQ(b.size(0), 30);
    ++n;
  }
  EXPECT_EQ(n, 3);
}

TEST(DataLoader, ShuffleIsSeededAndCoversEveryExample) {
  auto ds = data::TensorDataset<float, std::int64_t>(arange<float>(20).reshape({10, 2}), arange<std::int64_t>(10));
  auto epoch = [](data::DataLoader<data::TensorDataset<float, std::int64_t>>& l) {
    std::vector<std::int64_t> order;
    for (auto b : l) {
      auto t = b.target.to_vector();
      auto d = b.data.to_vector();
      for (std::size_t i = 0; i < t.size(); ++i) EXPECT_EQ(d[2 * i], 2.0f * t[i]);  // rows stay paired
      order.insert(order.end(), t.begin(), t.end());
    }
    return order;
  };
  data::DataLoader a(ds, {.batch_size = 3, .shuffle = true, .seed = 5});
  data::DataLoader b(ds, {.batch_size = 3, .shuffle = true, .seed = 5});
  auto a1 = epoch(a), a2 = epoch(a), b1 = epoch(b);
  EXPECT_EQ(a1, b1);
  EXPECT_NE(a1, a2);  // a new permutation each epoch
  auto sorted = a1;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(sorted, arange<std::int64_t>(10).to_vector());
  EXPECT_NE(a1, sorted);
}

TEST(DataLoader, StacksExamplesFromGet) {
  struct Pairs {
    std::size_t size() const { return 4; }
    data::Example<Tensor<double>, Tensor<std::int64_t>> get(std::size_t i) const {
      return {full<double>({3}, double(i)), full<std::int64_t>({}, std::int64_t(i))};
    }
  };
  data::DataLoader loader(Pairs{}, {.batch_size = 4});
  auto batch = *loader.begin();
  EXPECT_EQ(batch.data.shape(), (Shape{4, 3}));
  EXPECT_EQ(batch.target.shape(), (Shape{4}));
  EXPECT_EQ(batch.target.to_vector(), (std::vector<std::int64_t>{0, 1, 2, 3}));
}

TEST(DataLoader, Errors) {
  EXPECT_TRUE(throws_with([] { data::DataLoader(RandomDataset(5, 10), {.batch_size = 0}); }, {"batch_size"}));
  EXPECT_TRUE(throws_with([] { data::TensorDataset<float, float>(zeros<float>({3, 2}), zeros<float>({4})); },
                          {"[3, 2]", "[4]"}));
}

// A sampler whose indices() disagrees with its size(), or picks beyond the dataset, is an
// error, not a read past the end of the order.
TEST(DataLoader, ASamplerIsCheckedAgainstItselfAndTheDataset) {
  struct Lying {
    std::size_t n, count, top;
    std::size_t size() const { return n; }
    std::vector<std::size_t> indices() const {
      std::vector<std::size_t> v(count);
      std::iota(v.begin(), v.end(), top - count);
      return v;
    }
  };
  data::DataLoader a(RandomDataset(5, 10), {.batch_size = 3}, Lying{10, 4, 4});
  EXPECT_TRUE(throws_with([&] { a.begin(); }, {"4 indices", "size() says 10"}));
  data::DataLoader b(RandomDataset(5, 10), {.batch_size = 3}, Lying{3, 3, 12});
  EXPECT_TRUE(throws_with([&] { b.begin(); }, {"index 10", "10 examples"}));
  data::DataLoader c(RandomDataset(5, 10), {.batch_size = 3}, Lying{4, 4, 4});
  EXPECT_EQ(c.num_batches(), 2u);
  std::size_t rows = 0;
  for (auto batch : c) rows += static_cast<std::size_t>(batch.size(0));
  EXPECT_EQ(rows, 4u);
}

// Issue 10, item 20: batch_size is a std::int64_t like every other size, so an int (or an
// int64 from a tensor's shape) goes into the designated initialiser without a narrowing error.
TEST(DataLoader, BatchSizeIsAnInt64) {
  static_assert(std::is_same_v<decltype(data::DataLoaderOptions::batch_size), std::int64_t>);
  const int from_int = 30;
  data::DataLoader a(RandomDataset(5, 100), {.batch_size = from_int});
  EXPECT_EQ(a.num_batches(), 4u);
  RandomDataset ds(5, 100);
  data::DataLoader b(ds, {.batch_size = ds.data.size(0) / 4});  // an int64 straight from a shape
  EXPECT_EQ(b.num_batches(), 4u);
  EXPECT_EQ((*b.begin()).shape(), (Shape{25, 5}));
  EXPECT_TRUE(throws_with([] { data::DataLoader(RandomDataset(5, 10), {.batch_size = -3}); },
                          {"batch_size must be positive", "-3"}));
}

// ---- Readers: files written here byte by byte in each format ------------------------------

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

namespace {
namespace fs = std::filesystem;
struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() /
           ("chorus_data_" + std::to_string(::getpid()) + "_" + std::to_string(reinterpret_cast<std::uintptr_t>(this)));
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

void write_file(const std::string& path, const std::vector<std::uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

// A CIFAR-10 record: label, then pixel k of the record is (seed + k) mod 256.
std::vector<std::uint8_t> cifar_record(std::uint8_t label, int seed) {
  std::vector<std::uint8_t> r{label};
  for (int k = 0; k < 3072; ++k) r.push_back(static_cast<std::uint8_t>((seed + k) % 256));
  return r;
}

std::vector<std::uint8_t> idx_header(std::uint8_t type, std::vector<std::uint32_t> dims) {
  std::vector<std::uint8_t> h{0, 0, type, static_cast<std::uint8_t>(dims.size())};
  for (auto d : dims)
    for (int s = 24; s >= 0; s -= 8) h.push_back(static_cast<std::uint8_t>(d >> s));
  return h;
}
}  // namespace

TEST(Cifar10, ReadsTheBinaryFormat) {
  TempDir dir;
  fs::create_directories(dir.path / "cifar-10-batches-bin");
  for (int f = 1; f <= 5; ++f) {
    auto bytes = cifar_record(static_cast<std::uint8_t>(f), f);
    auto second = cifar_record(static_cast<std::uint8_t>(9 - f), 100 + f);
    bytes.insert(bytes.end(), second.begin(), second.end());
    write_file((dir.path / "cifar-10-batches-bin" / ("data_batch_" + std::to_string(f) + ".bin")).string(), bytes);
  }
  write_file((dir.path / "cifar-10-batches-bin" / "test_batch.bin").string(), cifar_record(0, 7));
  auto train = data::read_cifar10(dir.path.string(), true);
  ASSERT_EQ(train.size(), 10u);
  EXPECT_EQ(train.labels, (std::vector<std::int64_t>{1, 8, 2, 7, 3, 6, 4, 5, 5, 4}));
  EXPECT_EQ(train.channels, 3);
  EXPECT_EQ(train.pixels[3072 * 3 + 0], 100 + 2);  // file 2, record 2, first red pixel
  auto test = data::read_cifar10((dir.path / "cifar-10-batches-bin").string(), false);
  ASSERT_EQ(test.size(), 1u);
  data::ImageDataset ds(test);
  auto ex = ds.get(0);
  EXPECT_EQ(ex.data.shape(), (Shape{3, 32, 32}));
  EXPECT_EQ(ex.target.item(), 0);
  auto v = ex.data.to_vector();
  EXPECT_FLOAT_EQ(v[0], 7 / 255.0f);                       // red (0, 0)
  EXPECT_FLOAT_EQ(v[1024 + 33], ((7 + 1024 + 33) % 256) / 255.0f);  // green (1, 1)
  // The writer produces the same bytes as the hand-written file.
  data::write_cifar10_file(dir.file("copy.bin"), test);
  EXPECT_EQ(data::detail::read_bytes(dir.file("copy.bin"), "t"), cifar_record(0, 7));
}

TEST(Cifar10, BadFilesAreRefused) {
  TempDir dir;
  data::ImageSet set;
  auto rec = cifar_record(3, 0);
  rec.pop_back();
  write_file(dir.file("short.bin"), rec);
  EXPECT_TRUE(throws_with([&] { data::read_cifar10_file(dir.file("short.bin"), set); },
                          {"short.bin", "3072 bytes", "3073-byte record"}));
  write_file(dir.file("label.bin"), cifar_record(10, 0));
  EXPECT_TRUE(throws_with([&] { data::read_cifar10_file(dir.file("label.bin"), set); },
                          {"label.bin", "record 0", "label 10"}));
  EXPECT_TRUE(throws_with([&] { data::read_cifar10(dir.path.string(), false); }, {"test_batch.bin", "does not exist"}));
  EXPECT_TRUE(throws_with([&] { data::read_cifar10_file(dir.file("missing.bin"), set); }, {"cannot open", "missing"}));
}

TEST(Mnist, ReadsTheIdxFormat) {
  TempDir dir;
  auto images = idx_header(0x08, {3, 4, 5});
  for (int k = 0; k < 60; ++k) images.push_back(static_cast<std::uint8_t>(k * 4));
  auto labels = idx_header(0x08, {3});
  labels.insert(labels.end(), {7, 0, 9});
  write_file(dir.file("train-images-idx3-ubyte"), images);
  write_file(dir.file("train-labels-idx1-ubyte"), labels);
  auto set = data::read_mnist(dir.path.string(), true);
  EXPECT_EQ(set.size(), 3u);
  EXPECT_EQ(set.labels, (std::vector<std::int64_t>{7, 0, 9}));
  EXPECT_EQ(set.height, 4);
  EXPECT_EQ(set.width, 5);
  auto batch = data::ImageDataset(set).get_batch({2, 0});
  EXPECT_EQ(batch.data.shape(), (Shape{2, 1, 4, 5}));
  EXPECT_FLOAT_EQ(batch.data.to_vector()[1], 41 * 4 / 255.0f);
  EXPECT_EQ(batch.target.to_vector(), (std::vector<std::int64_t>{9, 7}));
}

TEST(Mnist, BadFilesAreRefused) {
  TempDir dir;
  auto f = dir.file("x");
  auto good_labels = idx_header(0x08, {2});
  good_labels.insert(good_labels.end(), {1, 2});
  write_file(dir.file("labels"), good_labels);
  write_file(f, {0, 1, 8, 1, 0, 0, 0, 1, 5});
  EXPECT_TRUE(throws_with([&] { data::read_idx(f); }, {"not an IDX file", "0, 1"}));
  auto floats = idx_header(0x0D, {1});
  floats.insert(floats.end(), {0, 0, 0, 0});
  write_file(f, floats);
  EXPECT_TRUE(throws_with([&] { data::read_idx(f); }, {"element type 0xd", "unsigned bytes"}));
  auto shortdata = idx_header(0x08, {2, 2, 2});
  shortdata.insert(shortdata.end(), {1, 2, 3});
  write_file(f, shortdata);
  EXPECT_TRUE(throws_with([&] { data::read_idx(f); }, {"3 bytes of data", "[2, 2, 2]", "need 8"}));
  write_file(f, {0, 0, 8, 3, 0, 0});
  EXPECT_TRUE(throws_with([&] { data::read_idx(f); }, {"truncated", "needs 16"}));
  auto three = idx_header(0x08, {3, 1, 1});
  three.insert(three.end(), {1, 2, 3});
  write_file(f, three);
  EXPECT_TRUE(throws_with([&] { data::read_mnist(f, dir.file("labels")); }, {"3 images", "2 labels"}));
  auto bad_label = idx_header(0x08, {3});
  bad_label.insert(bad_label.end(), {1, 12, 3});
  write_file(dir.file("labels"), bad_label);
  EXPECT_TRUE(throws_with([&] { data::read_mnist(f, dir.file("labels")); }, {"label 1 is 12"}));
}

// ---- Transforms --------------------------------------------------------------------------------

namespace {
data::Image ramp(std::int64_t c, std::int64_t h, std::int64_t w) {
  data::Image img{c, h, w, std::vector<float>(static_cast<std::size_t>(c * h * w))};
  for (std::size_t k = 0; k < img.pixels.size(); ++k) img.pixels[k] = static_cast<float>(k + 1);
  return img;
}
}  // namespace

TEST(Transforms, Normalize) {
  data::TransformRng rng(0);
  auto out = data::transforms::Normalize({1, 2}, {2, 4})(ramp(2, 1, 2), rng);
  EXPECT_EQ(out.pixels, (std::vector<float>{0, 0.5, 0.25, 0.5}));
  EXPECT_TRUE(throws_with([&] { data::transforms::Normalize({1}, {2})(ramp(2, 1, 2), rng); }, {"2 channels"}));
  EXPECT_TRUE(throws_with([&] { data::transforms::Normalize({1}, {0}); }, {"standard deviation of 0"}));
}

TEST(Transforms, RandomCropWithPaddingCoversEveryOffset) {
  const auto img = ramp(2, 4, 4);
  data::transforms::RandomCrop crop(4, 1);
  std::set<std::pair<int, int>> offsets;
  for (std::uint64_t seed = 0; seed < 200; ++seed) {
    data::TransformRng rng(seed);
    auto out = crop(img, rng);
    ASSERT_EQ(out.height, 4);
    // Find the offset: the output is the padded image shifted by (dy, dx) in [-1, 1].
    bool found = false;
    for (int dy = -1; dy <= 1 && !found; ++dy)
      for (int dx = -1; dx <= 1 && !found; ++dx) {
        bool match = true;
        for (int c = 0; c < 2; ++c)
          for (int y = 0; y < 4; ++y)
            for (int x = 0; x < 4; ++x) {
              const int sy = y + dy, sx = x + dx;
              const float want = (sy < 0 || sy >= 4 || sx < 0 || sx >= 4) ? 0.f : img.at(c, sy, sx);
              match = match && out.at(c, y, x) == want;
            }
        if (match) {
          offsets.insert({dy, dx});
          found = true;
        }
      }
    EXPECT_TRUE(found) << "seed " << seed;
    data::TransformRng again(seed);
    EXPECT_EQ(crop(img, again).pixels, out.pixels);  // seeded: reproducible
  }
  EXPECT_EQ(offsets.size(), 9u);
}

TEST(Transforms, HorizontalFlipAndCompose) {
  const auto img = ramp(1, 2, 3);
  data::TransformRng rng(1);
  auto always = data::transforms::RandomHorizontalFlip{1.0}(img, rng);
  EXPECT_EQ(always.pixels, (std::vector<float>{3, 2, 1, 6, 5, 4}));
  EXPECT_EQ(data::transforms::RandomHorizontalFlip{0.0}(img, rng).pixels, img.pixels);
  int flipped = 0;
  for (int i = 0; i < 400; ++i) flipped += data::transforms::RandomHorizontalFlip{}(img, rng).pixels[0] == 3;
  EXPECT_GT(flipped, 150);
  EXPECT_LT(flipped, 250);
  data::transforms::Compose both{{data::transforms::RandomHorizontalFlip{1.0}, data::transforms::Normalize({1}, {2})}};
  EXPECT_EQ(both(img, rng).pixels, (std::vector<float>{1, 0.5, 0, 2.5, 2, 1.5}));
}

// ---- DataLoader workers -----------------------------------------------------------------------

namespace {
data::ImageSet random_images(std::size_t n) {
  data::ImageSet set{3, 8, 8, {}, {}};
  std::mt19937 gen(1);
  for (std::size_t i = 0; i < n * 192; ++i) set.pixels.push_back(static_cast<std::uint8_t>(gen()));
  for (std::size_t i = 0; i < n; ++i) set.labels.push_back(static_cast<std::int64_t>(i % 10));
  return set;
}
data::ImageDataset augmented(std::size_t n) {
  return data::ImageDataset(random_images(n),
                            data::transforms::Compose{{data::transforms::RandomCrop(8, 2),
                                                       data::transforms::RandomHorizontalFlip{},
                                                       data::transforms::Normalize({0.5, 0.5, 0.5}, {0.2, 0.2, 0.2})}},
                            42);
}
std::vector<std::vector<float>> epochs_of(std::int64_t workers, int epochs, bool pin = false) {
  data::DataLoader loader(augmented(50), {.batch_size = 7, .shuffle = true, .seed = 3, .num_workers = workers,
                                          .pin_memory = pin});
  std::vector<std::vector<float>> out;
  for (int e = 0; e < epochs; ++e)
    for (const auto& b : loader) {
      out.push_back(b.data.to_vector());
      auto t = b.target.to_vector();
      out.back().insert(out.back().end(), t.begin(), t.end());
    }
  return out;
}
}  // namespace

TEST(DataLoaderWorkers, SameBatchesForAnyNumberOfWorkers) {
  auto serial = epochs_of(0, 2);
  ASSERT_EQ(serial.size(), 16u);
  EXPECT_NE(serial[0], serial[8]);  // epochs differ (order and augmentation)
  for (std::int64_t w : {1, 2, 3, 8}) EXPECT_EQ(epochs_of(w, 2), serial) << w << " workers";
  EXPECT_EQ(epochs_of(2, 2, /*pin=*/true), serial);  // pinning changes where, not what
  // Augmentation depends on the epoch, not only on the order: same example, other epoch, other pixels.
  auto ds = augmented(5);
  auto a = ds.image(3).pixels;
  ds.set_epoch(1);
  EXPECT_NE(ds.image(3).pixels, a);
  ds.set_epoch(0);
  EXPECT_EQ(ds.image(3).pixels, a);
}

namespace {
struct Flaky {
  std::size_t n = 40;
  std::size_t bad = 23;
  std::shared_ptr<std::atomic<int>> built = std::make_shared<std::atomic<int>>(0);
  int delay_us = 0;
  std::size_t size() const { return n; }
  Tensor<float> get(std::size_t i) const {
    if (delay_us) std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
    ++*built;
    CHORUS_CHECK(i != bad, "example ", i, " is corrupt");
    return full<float>({2}, static_cast<float>(i));
  }
};
}  // namespace

TEST(DataLoaderWorkers, AWorkersExceptionSurfacesInTheConsumer) {
  for (std::int64_t w : {0, 1, 3}) {
    data::DataLoader loader(Flaky{}, {.batch_size = 4, .num_workers = w});
    std::size_t good = 0;
    std::string message;
    try {
      for (const auto& b : loader) {
        EXPECT_EQ(b.to_vector()[0], static_cast<float>(4 * good));
        ++good;
      }
    } catch (const Error& e) {
      message = e.what();
    }
    EXPECT_EQ(good, 5u) << w << " workers";  // batches 0..4 arrive, batch 5 holds example 23
    EXPECT_NE(message.find("example 23 is corrupt"), std::string::npos) << message;
    if (w > 0) {  // batch b is built by worker b mod W
      EXPECT_NE(message.find("worker " + std::to_string(5 % w) + " failed on batch 5"), std::string::npos) << message;
    }
  }
}

TEST(DataLoaderWorkers, EndingAnEpochEarlyDoesNotHangAndBoundsPrefetch) {
  Flaky slow{.n = 400, .bad = 1000};
  slow.delay_us = 2000;
  auto built = slow.built;
  {
    data::DataLoader loader(slow, {.batch_size = 4, .num_workers = 3, .prefetch_factor = 2});
    for (const auto& b : loader) {
      EXPECT_EQ(b.size(0), 4);
      break;  // the iterator dies here: the workers stop after their current batch
    }
    // At most (3 workers x 2 ahead + 1 consumed + 3 in flight) batches of 4 were built, not 100.
    EXPECT_LE(built->load(), 4 * 10);
    auto it = loader.begin();  // a new epoch mid-way through another ends the old one
    EXPECT_EQ((*it).size(0), 4);
    auto it2 = loader.begin();
    EXPECT_TRUE(throws_with([&] { ++it; *it; }, {"ended by a newer begin()"}));
    (void)it2;
  }  // the loader and its running epoch are destroyed mid-epoch
  SUCCEED();
}

// ---- Issue 16: options checked, sizes that wrap, hangs, the sampler's ownership -----------------

#include <cstdio>
#include <cstdlib>
#include <future>
#include <limits>

namespace {
// Runs `body` on a thread of its own: a hang becomes a clear failure (and an abort, since a hung
// loader's workers cannot be joined) instead of a test that never ends.
void finishes_within(int seconds, std::function<void()> body, const char* what) {
  std::packaged_task<void()> task(std::move(body));
  auto done = task.get_future();
  std::thread t(std::move(task));
  if (done.wait_for(std::chrono::seconds(seconds)) == std::future_status::timeout) {
    std::fprintf(stderr, "HUNG: %s did not finish within %d s\n", what, seconds);
    std::abort();
  }
  t.join();
  done.get();  // the body's exception, if any
}
std::vector<float> firsts(data::DataLoader<Flaky>& loader) {
  std::vector<float> out;
  for (const auto& b : loader) out.push_back(b.to_vector()[0]);
  return out;
}
}  // namespace

// `W * prefetch_factor` and `b < next + W * prefetch_factor` wrapped: a huge prefetch_factor (a
// "no limit" guess) stopped every worker after the first batch or before any.
TEST(DataLoaderWorkers, AHugePrefetchFactorMeansNoLimitNotAHang) {
  const std::vector<float> want{0, 4, 8, 12, 16, 20, 24, 28, 32, 36};
  for (auto [w, f] : {std::pair<std::int64_t, std::int64_t>{2, INT64_MAX}, {4, std::int64_t{1} << 62},
                      {3, INT64_MAX / 3 + 1}, {1, INT64_MAX}}) {
    finishes_within(60, [&, w = w, f = f] {
      data::DataLoader loader(Flaky{.bad = 1000}, {.batch_size = 4, .num_workers = w, .prefetch_factor = f});
      EXPECT_EQ(firsts(loader), want) << w << " workers, prefetch_factor " << f;
      EXPECT_EQ(firsts(loader), want) << "second epoch";
    }, "a DataLoader with a huge prefetch_factor");
  }
}

// Worker w builds batches w, w + W, …: a num_workers beyond the batch count starts no more
// threads than there are batches (it used to try 2^40 threads, and a failed start terminated).
TEST(DataLoaderWorkers, AHugeNumWorkersStartsNoMoreThreadsThanBatches) {
  finishes_within(60, [] {
    data::DataLoader loader(Flaky{.n = 12, .bad = 1000}, {.batch_size = 4, .num_workers = std::int64_t{1} << 40});
    EXPECT_EQ(firsts(loader), (std::vector<float>{0, 4, 8}));
  }, "a DataLoader with num_workers = 2^40");
}

// Nonsense options are refused when the loader is made, with PyTorch's rules.
TEST(DataLoader, OptionsAreCheckedAtConstruction) {
  auto make = [](data::DataLoaderOptions o) { data::DataLoader(RandomDataset(2, 10), o); };
  EXPECT_TRUE(throws_with([&] { make({.num_workers = 2, .prefetch_factor = 0}); },
                          {"prefetch_factor must be positive", "0"}));
  EXPECT_TRUE(throws_with([&] { make({.num_workers = 2, .prefetch_factor = -4}); }, {"prefetch_factor", "-4"}));
  EXPECT_TRUE(throws_with([&] { make({.num_workers = -1}); }, {"num_workers must not be negative", "-1"}));
  // PyTorch: "prefetch_factor option could only be specified in multiprocessing".
  EXPECT_TRUE(throws_with([&] { make({.num_workers = 0, .prefetch_factor = 4}); },
                          {"prefetch_factor (4) needs num_workers > 0"}));
  EXPECT_NO_THROW(make({.num_workers = 2}));  // prefetch_factor 2 by default
  EXPECT_NO_THROW(make({.num_workers = 2, .prefetch_factor = 1}));
  // A size() beyond what the order can hold: a chorus::Error at begin(), not std::length_error.
  struct Endless {
    std::size_t size() const { return std::numeric_limits<std::size_t>::max(); }
    Tensor<float> get(std::size_t) const { return zeros<float>({1}); }
  };
  data::DataLoader endless(Endless{}, {.batch_size = 1 << 20});
  EXPECT_TRUE(throws_with([&] { endless.begin(); }, {"size() is 18446744073709551615", "more indices than"}));
}

// An iterator at or past end() used to wait forever for a batch no worker builds (or, without
// workers, to read past the order); skipping batches still works.
TEST(DataLoaderWorkers, AnIteratorPastTheLastBatchIsAnErrorNotAHang) {
  for (std::int64_t w : {0, 2}) {
    finishes_within(60, [w] {
      data::DataLoader loader(Flaky{.n = 12, .bad = 1000}, {.batch_size = 4, .num_workers = w});
      auto it = loader.begin();
      ++it;
      ++it;
      EXPECT_EQ((*it).to_vector()[0], 8.0f);  // batches 0 and 1 skipped
      ++it;
      EXPECT_TRUE(it == loader.end());
      EXPECT_TRUE(throws_with([&] { *it; }, {"batch 3 requested from an epoch of 3 batches"})) << w;
      EXPECT_TRUE(throws_with([&] { *loader.end(); }, {"dereferencing end()"}));
    }, "dereferencing a DataLoader iterator at end()");
  }
}

namespace {
struct Fixed {  // a sampler: these indices every epoch
  std::vector<std::size_t> order;
  std::size_t size() const { return order.size(); }
  std::vector<std::size_t> indices() const { return order; }
};
struct Rotating {  // a sampler whose order depends on its epoch
  std::size_t n = 6;
  std::uint64_t epoch = 0;
  void set_epoch(std::uint64_t e) { epoch = e; }
  std::size_t size() const { return n; }
  std::vector<std::size_t> indices() const {
    std::vector<std::size_t> v(n);
    for (std::size_t i = 0; i < n; ++i) v[i] = (i + epoch) % n;
    return v;
  }
};
using Ids = data::TensorDataset<float, std::int64_t>;
Ids ids(std::int64_t n) { return Ids(arange<float>(n).view({n, 1}), arange<std::int64_t>(n)); }
std::vector<std::int64_t> targets(data::DataLoader<Ids>& loader) {
  std::vector<std::int64_t> out;
  for (const auto& b : loader)
    for (auto t : b.target.to_vector()) out.push_back(t);
  return out;
}
}  // namespace

// One DataLoader<D> type with or without a sampler; the sampler owned (by value) or shared
// (std::shared_ptr); an lvalue refused at compile time (Note [sampler ownership]).
TEST(DataLoader, OneTypeOwnsOrSharesItsSampler) {
  using L = data::DataLoader<Ids>;
  static_assert(std::is_constructible_v<L, Ids, data::DataLoaderOptions, Fixed&&>);
  static_assert(std::is_constructible_v<L, Ids, data::DataLoaderOptions, std::shared_ptr<Fixed>>);
  static_assert(std::is_constructible_v<L, Ids, data::DataLoaderOptions, std::shared_ptr<const Fixed>>);
  static_assert(!std::is_constructible_v<L, Ids, data::DataLoaderOptions, Fixed&>);  // a copy would miss set_epoch
  static_assert(!std::is_constructible_v<L, Ids, data::DataLoaderOptions, const Fixed&>);
  data::DataLoader plain(ids(6), {.batch_size = 4});
  data::DataLoader owned(ids(6), {.batch_size = 2}, Fixed{{5, 0, 3}});
  static_assert(std::is_same_v<decltype(plain), decltype(owned)>);
  EXPECT_FALSE(plain.has_sampler());
  EXPECT_EQ(owned.num_batches(), 2u);
  EXPECT_EQ(targets(owned), (std::vector<std::int64_t>{5, 0, 3}));
  owned.sampler<Fixed>().order = {1};  // PyTorch's loader.sampler
  EXPECT_EQ(targets(owned), (std::vector<std::int64_t>{1}));
  EXPECT_TRUE(throws_with([&] { owned.sampler<Rotating>(); }, {"the sampler is a", "not a"}));
  EXPECT_TRUE(throws_with([&] { plain.sampler<Fixed>(); }, {"has no sampler"}));

  // Shared: the caller's set_epoch reaches the loader, as in PyTorch's loop.
  auto rotating = std::make_shared<Rotating>();
  data::DataLoader shared(ids(6), {.batch_size = 4, .num_workers = 2}, rotating);
  EXPECT_EQ(targets(shared), (std::vector<std::int64_t>{0, 1, 2, 3, 4, 5}));
  rotating->set_epoch(2);
  EXPECT_EQ(targets(shared), (std::vector<std::int64_t>{2, 3, 4, 5, 0, 1}));
  EXPECT_EQ(&shared.sampler<Rotating>(), rotating.get());
  data::DataLoader read_only(ids(6), {.batch_size = 4}, std::shared_ptr<const Fixed>(new Fixed{{2}}));
  EXPECT_EQ(read_only.sampler<const Fixed>().order, (std::vector<std::size_t>{2}));
  EXPECT_TRUE(throws_with([&] { read_only.sampler<Fixed>(); }, {"given as const"}));
  EXPECT_TRUE(throws_with([] { data::DataLoader(ids(6), {}, std::shared_ptr<Fixed>()); }, {"null shared_ptr"}));
  EXPECT_TRUE(throws_with([] { data::DataLoader(ids(6), {.shuffle = true}, Fixed{{1}}); }, {"shuffle and a sampler"}));
  // A moved loader keeps its sampler.
  data::DataLoader moved = std::move(owned);
  EXPECT_EQ(targets(moved), (std::vector<std::int64_t>{1}));
}

// read_idx checked the element count after each multiplication: dims whose product wraps
// (65536 x 131072 x 2^31 = 2^64 = 0 mod 2^64) passed with no data at all.
TEST(Mnist, DimensionsWhoseProductWrapsAreRefused) {
  TempDir dir;
  write_file(dir.file("wrap"), idx_header(0x08, {65536, 131072, 2147483648u}));
  EXPECT_TRUE(throws_with([&] { data::read_idx(dir.file("wrap")); },
                          {"wrap", "[65536, 131072, 2147483648]", "too many elements"}));
  auto labels = idx_header(0x08, {65536});
  labels.resize(labels.size() + 65536, 1);
  write_file(dir.file("labels"), labels);
  EXPECT_TRUE(throws_with([&] { data::read_mnist(dir.file("wrap"), dir.file("labels")); }, {"too many elements"}));
  write_file(dir.file("big"), idx_header(0x08, {4294967295u, 4294967295u}));  // 2^64 - 2^33 + 1 does not wrap
  EXPECT_TRUE(throws_with([&] { data::read_idx(dir.file("big")); }, {"too many elements"}));
  // A size of 0 holds nothing however large the others are (as a tensor's shape).
  write_file(dir.file("empty"), idx_header(0x08, {0, 4294967295u, 4294967295u}));
  EXPECT_EQ(data::read_idx(dir.file("empty")).dims, (std::vector<std::int64_t>{0, 4294967295, 4294967295}));
}

// ImageDataset checked pixels.size() == size() * image_bytes() in wrapping arithmetic: 4 images
// of 2^62 bytes "need" 0 bytes, and every image(i) then read far outside the buffer.
TEST(ImageDataset, ASizeCheckThatWouldWrapIsRefused) {
  const std::int64_t big = std::int64_t{1} << 31;
  EXPECT_TRUE(throws_with([&] { data::ImageDataset(data::ImageSet{1, big, big, {}, {0, 0, 0, 0}}); },
                          {"ImageDataset", "4 images of 1x2147483648x2147483648", "more than a size_t counts"}));
  EXPECT_TRUE(throws_with([&] { data::ImageDataset(data::ImageSet{1, big * big, 4, {}, {0}}); },
                          {"more elements than an int64"}));
  EXPECT_TRUE(throws_with([] { data::ImageDataset(data::ImageSet{-1, -1, 1, {7}, {0}}); },
                          {"ImageDataset", "negative size", "-1x-1x1"}));
  EXPECT_TRUE(throws_with([] { data::ImageDataset(data::ImageSet{1, 2, 2, {1, 2, 3}, {0}}); },
                          {"3 pixel bytes for 1 images of 1x2x2 (4 bytes)"}));
  EXPECT_EQ(data::ImageDataset(data::ImageSet{}).size(), 0u);  // an empty set is fine
}

// read_cifar10_file appends: appending 3x32x32 records to other images relabelled them all.
TEST(Cifar10, AppendingToImagesOfAnotherSizeIsRefused) {
  TempDir dir;
  write_file(dir.file("one.bin"), cifar_record(4, 0));
  data::ImageSet mnist_like{1, 28, 28, std::vector<std::uint8_t>(784), {3}};
  EXPECT_TRUE(throws_with([&] { data::read_cifar10_file(dir.file("one.bin"), mnist_like); },
                          {"cannot append", "one.bin", "1x28x28"}));
  EXPECT_EQ(mnist_like.channels, 1);  // unchanged
  data::ImageSet torn{3, 32, 32, std::vector<std::uint8_t>(100), {3}};
  EXPECT_TRUE(throws_with([&] { data::read_cifar10_file(dir.file("one.bin"), torn); }, {"100 pixel bytes"}));
  data::ImageSet set;
  data::read_cifar10_file(dir.file("one.bin"), set);
  data::read_cifar10_file(dir.file("one.bin"), set);
  EXPECT_EQ(set.size(), 2u);
  EXPECT_EQ(set.pixels.size(), 2u * 3072);
}

// A hand-built Image whose sizes disagree with its pixels was indexed out of bounds; a huge
// RandomCrop padding overflowed an int64.
TEST(Transforms, ImagesAreCheckedBeforeTheyAreIndexed) {
  data::TransformRng rng(0);
  const data::Image torn{3, 4, 4, std::vector<float>(10)};
  EXPECT_TRUE(throws_with([&] { data::transforms::Normalize({0, 0, 0}, {1, 1, 1})(torn, rng); },
                          {"Normalize", "3x4x4 image needs 48 pixels, it holds 10"}));
  EXPECT_TRUE(throws_with([&] { data::transforms::RandomCrop(2)(torn, rng); }, {"RandomCrop", "needs 48"}));
  EXPECT_TRUE(throws_with([&] { data::transforms::RandomHorizontalFlip{1.0}(torn, rng); },
                          {"RandomHorizontalFlip", "needs 48"}));
  EXPECT_TRUE(throws_with([&] { data::transforms::RandomCrop(4, INT64_MAX / 2 + 1)(ramp(1, 4, 4), rng); },
                          {"RandomCrop: padding", "overflows an int64"}));
  EXPECT_TRUE(throws_with([&] { data::transforms::RandomCrop(4, INT64_MAX / 2 - 1)(ramp(1, 4, 4), rng); },
                          {"overflows an int64"}));  // 2 * padding fits, + the height does not
}

// PyTorch's `dataset.tensors`: the data and the targets, the same tensors.
TEST(TensorDataset, TensorsGivesTheDataAndTheTargets) {
  auto x = randn<float>({5, 3});
  auto y = from_vector<std::int64_t>({0, 1, 0, 1, 1});
  data::TensorDataset ds(x, y);
  auto [dx, dy] = ds.tensors();
  EXPECT_EQ(dx.impl(), x.impl());
  EXPECT_EQ(dy.impl(), y.impl());
}
