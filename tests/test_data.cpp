// Datasets and the DataLoader.
#include <algorithm>
#include <set>

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
