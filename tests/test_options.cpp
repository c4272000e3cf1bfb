// The layer API a PyTorch user guesses (issue 16): per-dimension sizes from a scalar, options
// braced in every layer's constructor, Sequential indexing, item<U>(), and
// SyncBatchNorm::convert_sync_batchnorm. What must not compile is checked by the
// compile_fail_* tests (tests/compile_fail/options.cpp).
#include "test_util.hpp"

using namespace chorus;
using chorus::testing::all_close;
using chorus::testing::throws_with;

namespace {
Tensor<double> r(const Shape& s, std::uint64_t seed) {
  Generator g(seed);
  return rand<double>(s, Device::cpu(), -1, 1, g);
}
}  // namespace

// Note [expanding arrays]: a scalar means (k, k), braces exactly two values, nothing half-filled.
static_assert(Pair(3) == Pair(3, 3));
static_assert(Pair{2, 1}[0] == 2 && Pair{2, 1}[1] == 1);
static_assert(std::is_convertible_v<int, Pair> && std::is_convertible_v<std::int64_t, Pair>);
static_assert(!std::is_default_constructible_v<Pair>, "a default Pair would be a silent (0, 0)");
static_assert(!std::is_constructible_v<Pair, int, int, int>);
static_assert(!std::is_constructible_v<Pair, double> && !std::is_constructible_v<Pair, bool>,
              "1.5 must not truncate to 1, true must not be a size");

TEST(ExpandingArray, AScalarOptionMeansTheSameValueInBothDimensions) {
  // Pair was std::array<int64_t, 2>: `.padding = 1` compiled as (1, 0) and 16x16 came out 16x14.
  auto x = r({1, 3, 16, 16}, 1);
  nn::Conv2dT<double> same(3, 8, 3, nn::Conv2dOptions{.padding = 1});
  EXPECT_EQ(same->options.padding, Pair(1, 1));
  EXPECT_EQ(same(x).shape(), (Shape{1, 8, 16, 16}));
  nn::Conv2dT<double> half(3, 8, 3, nn::Conv2dOptions{.stride = 2, .padding = 1});  // was stride (2, 0): refused
  EXPECT_EQ(half(x).shape(), (Shape{1, 8, 8, 8}));
  nn::Conv2dT<double> dilated(3, 8, 3, nn::Conv2dOptions{.dilation = 2});
  EXPECT_EQ(dilated(x).shape(), (Shape{1, 8, 12, 12}));
  // The same values as the explicit pairs, and two values still mean (a, b).
  nn::Conv2dT<double> explicit_pairs(3, 8, 3, nn::Conv2dOptions{.stride = {2, 2}, .padding = {1, 1}});
  explicit_pairs->weight.detach().copy_(half->weight.detach());
  explicit_pairs->bias.detach().copy_(half->bias.detach());
  EXPECT_TRUE(all_close(explicit_pairs(x), half(x), 0, 0));
  EXPECT_EQ(nn::Conv2dT<double>(3, 8, 3, nn::Conv2dOptions{.padding = {1, 0}})(x).shape(), (Shape{1, 8, 16, 14}));
  // Pooling options and the functional forms expand the same way.
  EXPECT_EQ(nn::MaxPool2d(3, nn::MaxPool2dOptions{.stride = 1, .padding = 1})(x).shape(), (Shape{1, 3, 16, 16}));
  EXPECT_EQ(nn::AvgPool2d(3, nn::AvgPool2dOptions{.stride = 2, .padding = 1})(x).shape(), (Shape{1, 3, 8, 8}));
  EXPECT_EQ(nn::MaxPool2d(2, nn::MaxPool2dOptions{.dilation = 2})(x).shape(), (Shape{1, 3, 7, 7}));
  EXPECT_EQ(max_pool2d(x, 3, 1, 1).shape(), (Shape{1, 3, 16, 16}));
  EXPECT_EQ(avg_pool2d(x, 2).shape(), (Shape{1, 3, 8, 8}));
  EXPECT_EQ(conv2d(x, half->weight, half->bias, 2, 1).shape(), (Shape{1, 8, 8, 8}));
  EXPECT_EQ(adaptive_avg_pool2d(x, 4).shape(), (Shape{1, 3, 4, 4}));
  EXPECT_EQ(nn::AdaptiveAvgPool2d(1)(x).shape(), (Shape{1, 3, 1, 1}));
}

TEST(ExpandingArray, PrintsAsAShape) {
  std::ostringstream os;
  os << Pair(2, 3);
  EXPECT_EQ(os.str(), "[2, 3]");
  EXPECT_TRUE(throws_with([] { nn::Conv2d(3, 8, 3, {.stride = {1, 0}}); }, {"stride must be positive", "[1, 0]"}));
}

// Note [layer options]: every layer takes its options (and sizes, shapes) braced.
TEST(LayerOptions, EveryLayerTakesItsOptionsBraced) {
  auto x = r({2, 3, 8, 8}, 2);
  nn::Conv2dT<double> conv(3, 8, 3, {.stride = 2, .padding = 1, .bias = false});
  EXPECT_EQ(conv(x).shape(), (Shape{2, 8, 4, 4}));
  EXPECT_FALSE(conv->bias.defined());
  EXPECT_EQ(nn::Conv2dT<double>(3, 4, {3, 1}, {.padding = {1, 0}})(x).shape(), (Shape{2, 4, 8, 8}));
  EXPECT_EQ(nn::Conv2dT<double>(3, 4, 3)(x).shape(), (Shape{2, 4, 6, 6}));
  EXPECT_EQ(nn::MaxPool2d(3, {.stride = 2, .padding = 1})(x).shape(), (Shape{2, 3, 4, 4}));
  EXPECT_EQ(nn::MaxPool2d({2, 1}, {.ceil_mode = true})(r({1, 1, 5, 5}, 3)).shape(), (Shape{1, 1, 3, 5}));
  EXPECT_EQ(nn::AvgPool2d(2, {.stride = 1})(x).shape(), (Shape{2, 3, 7, 7}));
  EXPECT_EQ(nn::AdaptiveAvgPool2d({2, 1})(x).shape(), (Shape{2, 3, 2, 1}));
  EXPECT_FALSE(nn::LinearT<double>(4, 2, {.bias = false})->bias.defined());
  EXPECT_EQ(nn::BatchNorm1dT<double>(4, {.momentum = 0.2})->options.momentum, 0.2);
  EXPECT_FALSE(nn::BatchNorm2dT<double>(4, {.affine = false})->weight.defined());
  EXPECT_FALSE(nn::SyncBatchNormT<double>(4, {.track_running_stats = false})->running_mean.defined());
  nn::LayerNormT<double> ln({4, 5}, {.eps = 1e-3});
  EXPECT_EQ(ln->weight.shape(), (Shape{4, 5}));
  EXPECT_EQ(ln->options.eps, 1e-3);
  EXPECT_EQ(nn::LayerNormT<double>(5, {.elementwise_affine = false})->parameters().size(), 0u);
  nn::EmbeddingT<double> emb(6, 3, {.padding_idx = -1});
  EXPECT_EQ(emb->padding_idx, 5);
  // The float layers too, and holders still copy, share and register as before.
  nn::Conv2d c(3, 8, 3, {.padding = 1});
  nn::Conv2d shared = c;
  EXPECT_EQ(shared.get(), c.get());
  struct Net : nn::Module {
    nn::Conv2d conv{register_module("conv", nn::Conv2d(3, 4, 3, {.padding = 1}))};
    nn::BatchNorm2d bn{register_module("bn", nn::BatchNorm2d(4, {.eps = 1e-3}))};
  } net;
  EXPECT_EQ(net.named_parameters().size(), 4u);
  EXPECT_EQ(net.bn(net.conv(r({1, 3, 8, 8}, 4).to<float>())).shape(), (Shape{1, 4, 8, 8}));
}

TEST(SequentialIndexing, IndexPtrAndAtAsInPyTorch) {
  nn::SequentialT<double> seq(nn::LinearT<double>(4, 3), nn::ReLU(), nn::LinearT<double>(3, 2));
  EXPECT_EQ(seq[0]->name(), "Linear(4, 3)");
  EXPECT_EQ(seq[1]->name(), "ReLU");
  EXPECT_EQ(seq[-1]->name(), "Linear(3, 2)");  // negative counts from the end, as seq[-1] in Python
  EXPECT_EQ(seq->ptr(2).get(), seq[2].get());
  auto first = seq->ptr<nn::LinearImpl<double>>(0);
  EXPECT_EQ(first->weight.shape(), (Shape{3, 4}));
  EXPECT_EQ(&seq->at<nn::LinearImpl<double>>(-1), seq->ptr(2).get());
  // The module is the one the Sequential runs: changing it changes the output.
  auto x = r({5, 4}, 5);
  auto before = seq(x);
  {
    NoGradGuard g;
    seq->at<nn::LinearImpl<double>>(2).bias.fill_(10.0);
  }
  EXPECT_FALSE(all_close(seq(x), before, 1e-6));
  EXPECT_TRUE(throws_with([&] { seq[3]; }, {"Sequential", "index 3", "out of range", "3 module"}));
  EXPECT_TRUE(throws_with([&] { seq->ptr(-4); }, {"Sequential", "index -4", "out of range"}));
  EXPECT_TRUE(throws_with([&] { seq->ptr<nn::LinearImpl<double>>(1); }, {"Sequential", "module 1", "ReLU"}));
  EXPECT_TRUE(throws_with([&] { seq->at<nn::LinearImpl<float>>(0); }, {"Sequential", "module 0", "Linear(4, 3)"}));
  EXPECT_TRUE(throws_with([] { nn::Sequential()[0]; }, {"index 0", "0 module"}));
}

TEST(TensorItem, ConvertsToTheRequestedTypeWithAnOverflowCheck) {
  EXPECT_EQ(full<double>({}, 2.75).item<float>(), 2.75f);
  EXPECT_EQ(full<double>({1}, -2.75).item<std::int64_t>(), -2);  // truncates toward zero, as static_cast
  EXPECT_EQ(full<float>({1, 1}, 3.5f).item<double>(), 3.5);
  EXPECT_EQ(full<std::int64_t>({}, 7).item<double>(), 7.0);
  EXPECT_EQ(full<std::int64_t>({}, 7).item<int>(), 7);
  EXPECT_TRUE(full<double>({}, 0.5).item<bool>());
  EXPECT_TRUE(std::isinf(full<double>({}, INFINITY).item<float>()));  // an infinity is representable
  EXPECT_TRUE(std::isnan(full<double>({}, NAN).item<float>()));
  // What the type cannot hold is an error (PyTorch: "value cannot be converted ... without overflow").
  EXPECT_TRUE(throws_with([] { full<double>({}, NAN).item<std::int64_t>(); }, {"item()", "nan", "overflow"}));
  EXPECT_TRUE(throws_with([] { full<double>({}, 1e19).item<std::int64_t>(); }, {"item()", "overflow"}));
  EXPECT_TRUE(throws_with([] { full<double>({}, -INFINITY).item<int>(); }, {"item()", "overflow"}));
  EXPECT_TRUE(throws_with([] { full<double>({}, 1e300).item<float>(); }, {"item()", "overflow"}));
  EXPECT_TRUE(throws_with([] { full<std::int64_t>({}, std::int64_t(1) << 40).item<int>(); }, {"item()", "overflow"}));
  EXPECT_TRUE(throws_with([] { full<std::int64_t>({}, -1).item<unsigned>(); }, {"item()", "overflow"}));
  EXPECT_EQ(full<double>({}, -0.5).item<unsigned>(), 0u);
  EXPECT_EQ(full<double>({}, 9223372036854774784.0).item<std::int64_t>(), 9223372036854774784);
  EXPECT_TRUE(throws_with([] { full<double>({}, 9223372036854775808.0).item<std::int64_t>(); }, {"overflow"}));
  EXPECT_EQ(full<double>({}, -9223372036854775808.0).item<std::int64_t>(), INT64_MIN);
  EXPECT_TRUE(throws_with([] { zeros<double>({2}).item<float>(); }, {"item()", "2 elements"}));
}

namespace {
/// Doubles every sum: a layer that reduces through it shows it in its output.
class CountingReducer final : public StatsReducer {
 public:
  void all_reduce_sum(Tensor<float>& t) override { twice(t); }
  void all_reduce_sum(Tensor<double>& t) override { twice(t); }
  std::int64_t all_reduce_sum(std::int64_t c) override {
    ++calls;
    return 2 * c;
  }
  int size() const override { return 2; }
  int calls = 0;

 private:
  template <class T>
  void twice(Tensor<T>& t) {
    ++calls;
    backend::unary(t, t, backend::fn::MulScalar{2.0});
  }
};

struct Tree : nn::Module {
  nn::Conv2dT<double> conv{register_module("conv", nn::Conv2dT<double>(2, 3, 3, {.padding = 1}))};
  nn::BatchNorm2dT<double> bn{register_module("bn", nn::BatchNorm2dT<double>(3, {.momentum = 0.3}))};
  nn::SequentialT<double> head{register_module(
      "head", nn::SequentialT<double>(nn::Flatten(), nn::LinearT<double>(12, 4), nn::BatchNorm1dT<double>(4)))};
  nn::LayerNormT<double> ln{register_module("ln", nn::LayerNormT<double>(4))};
  Tensor<double> forward(const Tensor<double>& x) { return ln(head(bn(conv(x)))); }
};
}  // namespace

TEST(ConvertSyncBatchNorm, MakesEveryBatchNormInTheTreeASyncBatchNormInPlace) {
  Tree model;
  auto before = model.named_tensors();
  auto* bn1 = model.head->ptr<nn::BatchNorm1dT<double>::ImplType>(2).get();
  EXPECT_FALSE(model.bn->is_sync() || bn1->is_sync() || model.any_meets_other_replicas());
  auto& same = nn::SyncBatchNorm::convert_sync_batchnorm(model);
  EXPECT_EQ(&same, &model);  // returns the module
  EXPECT_TRUE(model.bn->is_sync() && bn1->is_sync() && model.any_meets_other_replicas());
  EXPECT_EQ(model.bn->name(), "SyncBatchNorm(3)");
  EXPECT_EQ(model.bn->options.momentum, 0.3);
  auto after = model.named_tensors();  // the same parameters and buffers, by identity
  ASSERT_EQ(before.size(), after.size());
  for (std::size_t i = 0; i < before.size(); ++i) {
    EXPECT_EQ(before[i].name, after[i].name);
    EXPECT_EQ(before[i].tensor.impl_key(), after[i].tensor.impl_key()) << before[i].name;
  }
  // Synchronised now: the statistics go through the thread's reducer (before: never).
  auto reducer = std::make_shared<CountingReducer>();
  {
    StatsReducerScope scope(reducer);
    model.forward(r({4, 2, 2, 2}, 6));
  }
  EXPECT_EQ(reducer->calls, 6);  // count, mean and variance in each of the two layers
  // A holder converts as well and is returned, and a SyncBatchNorm accepts any [N, C, *].
  auto seq = nn::SyncBatchNormT<double>::convert_sync_batchnorm(nn::SequentialT<double>(nn::BatchNorm1dT<double>(3)));
  EXPECT_EQ(seq[0]->name(), "SyncBatchNorm(3)");
  EXPECT_EQ(seq(r({4, 3, 2, 2}, 7)).shape(), (Shape{4, 3, 2, 2}));
}

TEST(ConvertSyncBatchNorm, UnderDataParallelEqualsOneDeviceWithTheWholeBatch) {
  set_cpu_device_count(std::max(cpu_device_count(), 2));
  manual_seed(4);
  Tree reference;
  manual_seed(4);
  Tree converted;
  nn::SyncBatchNorm::convert_sync_batchnorm(converted);
  DataParallel<Tree> dp(std::move(converted), {Device::cpu(0), Device::cpu(1)});
  auto x = r({6, 2, 2, 2}, 8);
  EXPECT_TRUE(all_close(dp(x), reference.forward(x), 1e-10, 1e-10));
  auto rm = dp.module().bn->running_mean, expected = reference.bn->running_mean;
  EXPECT_TRUE(all_close(rm, expected, 1e-10, 1e-10));
}
