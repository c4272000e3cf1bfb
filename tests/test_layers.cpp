// Convolution, pooling, normalisation, embedding and the other CNN/transformer layers:
// forward values against direct loops, gradients against float64 central differences,
// PyTorch's initialisation, parameter/buffer names and running statistics.
#include <cmath>
#include <mutex>
#include <set>
#include <thread>

#include "test_util.hpp"
// After chorus, so that the test does not compile if chorus's libgomp declarations
// (backend/cpu/parallel.hpp) disagree with <omp.h>'s.
#include <omp.h>

using namespace chorus;
using chorus::testing::all_close;
using chorus::testing::gradcheck;
using chorus::testing::throws_with;
using TL = std::vector<Tensor<double>>;

namespace {
template <class T = double>
Tensor<T> r(const Shape& s, std::uint64_t seed, double lo = -1, double hi = 1) {
  Generator g(seed);
  return rand<T>(s, Device::cpu(), lo, hi, g);
}

/// Direct 7-loop convolution (the definition) for checking the im2col path.
template <class T>
Tensor<T> conv_reference(const Tensor<T>& x, const Tensor<T>& w, const Tensor<T>& b, Pair s, Pair p, Pair d,
                         std::int64_t groups) {
  const auto N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  const auto O = w.size(0), Cg = w.size(1), kh = w.size(2), kw = w.size(3);
  const auto OH = (H + 2 * p[0] - d[0] * (kh - 1) - 1) / s[0] + 1, OW = (W + 2 * p[1] - d[1] * (kw - 1) - 1) / s[1] + 1;
  auto xv = x.to_vector(), wv = w.to_vector();
  std::vector<T> bv = b.defined() ? b.to_vector() : std::vector<T>(O, T(0));
  std::vector<T> out(N * O * OH * OW);
  const auto Og = O / groups;
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t o = 0; o < O; ++o)
      for (std::int64_t oh = 0; oh < OH; ++oh)
        for (std::int64_t ow = 0; ow < OW; ++ow) {
          double acc = bv[o];
          const auto g = o / Og;
          for (std::int64_t c = 0; c < Cg; ++c)
            for (std::int64_t i = 0; i < kh; ++i)
              for (std::int64_t j = 0; j < kw; ++j) {
                const auto h = oh * s[0] - p[0] + i * d[0], ww = ow * s[1] - p[1] + j * d[1];
                if (h < 0 || h >= H || ww < 0 || ww >= W) continue;
                acc += double(xv[((n * C + g * Cg + c) * H + h) * W + ww]) * double(wv[((o * Cg + c) * kh + i) * kw + j]);
              }
          out[((n * O + o) * OH + oh) * OW + ow] = static_cast<T>(acc);
        }
  return from_vector<T>(out, Shape{N, O, OH, OW});
}
}  // namespace

template <class T>
class LayersTyped : public ::testing::Test {};
TYPED_TEST_SUITE(LayersTyped, chorus::testing::FloatTypes);

TYPED_TEST(LayersTyped, Conv2dMatchesTheDefinition) {
  using T = TypeParam;
  struct Case {
    Shape x, w;
    Pair s, p, d;
    std::int64_t groups;
    bool bias;
  };
  for (const auto& c : {Case{{2, 3, 7, 6}, {4, 3, 3, 3}, {1, 1}, {1, 1}, {1, 1}, 1, true},
                        Case{{2, 4, 9, 8}, {6, 2, 3, 2}, {2, 1}, {1, 0}, {1, 2}, 2, true},
                        Case{{1, 4, 5, 5}, {4, 1, 3, 3}, {1, 1}, {2, 2}, {2, 2}, 4, false},  // depthwise
                        Case{{3, 8, 4, 4}, {5, 8, 1, 1}, {1, 1}, {0, 0}, {1, 1}, 1, true},   // 1x1 direct path
                        Case{{2, 3, 8, 8}, {2, 3, 1, 1}, {2, 2}, {0, 0}, {1, 1}, 1, false}}) {  // 1x1 stride 2
    auto x = r<T>(c.x, 1), w = r<T>(c.w, 2), b = c.bias ? r<T>({c.w[0]}, 3) : Tensor<T>();
    auto y = conv2d(x, w, b, c.s, c.p, c.d, c.groups);
    EXPECT_TRUE(all_close(y, conv_reference(x, w, b, c.s, c.p, c.d, c.groups), std::is_same_v<T, float> ? 1e-5 : 1e-12,
                          std::is_same_v<T, float> ? 1e-5 : 1e-12))
        << "x " << c.x << " w " << c.w;
  }
}

TEST(LayersGradcheck, Conv2d) {
  auto f = [](Pair s, Pair p, Pair d, std::int64_t g) {
    return [=](const TL& x) { return conv2d(x[0], x[1], x.size() > 2 ? x[2] : Tensor<double>(), s, p, d, g); };
  };
  EXPECT_TRUE(gradcheck(f({1, 1}, {1, 1}, {1, 1}, 1), {r({2, 3, 5, 4}, 1), r({2, 3, 3, 3}, 2), r({2}, 3)}));
  EXPECT_TRUE(gradcheck(f({2, 1}, {1, 0}, {1, 2}, 2), {r({2, 4, 6, 7}, 4), r({4, 2, 2, 3}, 5), r({4}, 6)}));
  EXPECT_TRUE(gradcheck(f({1, 1}, {0, 0}, {1, 1}, 1), {r({2, 3, 3, 3}, 7), r({4, 3, 1, 1}, 8)}));
  EXPECT_TRUE(gradcheck(f({2, 2}, {2, 1}, {2, 1}, 3), {r({1, 3, 7, 6}, 9), r({3, 1, 3, 2}, 10), r({3}, 11)}));
}

TEST(LayersGradcheck, Pooling) {
  // Distinct values so the max is unique (central differences are exact away from ties).
  auto distinct = [](const Shape& s, std::uint64_t seed) {
    auto v = r(s, seed).to_vector();
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = v[i] * 0.1 + 0.01 * double((i * 37) % v.size());
    return from_vector<double>(v, s);
  };
  EXPECT_TRUE(gradcheck([](const TL& x) { return max_pool2d(x[0], {2, 2}); }, {distinct({2, 2, 5, 4}, 1)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return max_pool2d(x[0], {3, 2}, Pair{2, 1}, {1, 1}, {1, 2}, true); },
                        {distinct({1, 3, 7, 6}, 2)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return avg_pool2d(x[0], {2, 2}); }, {r({2, 2, 5, 4}, 3)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return avg_pool2d(x[0], {3, 3}, Pair{2, 2}, {1, 1}, true, false); },
                        {r({1, 2, 6, 7}, 4)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return avg_pool2d(x[0], {3, 2}, Pair{2, 1}, {1, 1}, false, true, 5); },
                        {r({1, 2, 6, 5}, 5)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return adaptive_avg_pool2d(x[0], {1, 1}); }, {r({2, 3, 4, 5}, 6)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return adaptive_avg_pool2d(x[0], {3, 2}); }, {r({2, 2, 5, 7}, 7)}));
}

TEST(Layers, PoolingValues) {
  auto x = arange<double>(16).reshape({1, 1, 4, 4});
  EXPECT_TRUE(chorus::testing::values_are(max_pool2d(x, {2, 2}), {5, 7, 13, 15}));
  EXPECT_TRUE(chorus::testing::values_are(avg_pool2d(x, {2, 2}), {2.5, 4.5, 10.5, 12.5}));
  // Padding counted (PyTorch's default): the corner window holds x[0,0] only, divided by 4.
  EXPECT_TRUE(chorus::testing::values_are(avg_pool2d(x, {2, 2}, Pair{2, 2}, {1, 1}).narrow(2, 0, 1).narrow(3, 0, 1),
                                          {0.0}));
  EXPECT_TRUE(chorus::testing::values_are(
      avg_pool2d(x, {2, 2}, Pair{2, 2}, {1, 1}, false, true).narrow(2, 0, 1).narrow(3, 1, 1), {(1 + 2) / 4.0}));
  EXPECT_TRUE(chorus::testing::values_are(
      avg_pool2d(x, {2, 2}, Pair{2, 2}, {1, 1}, false, false).narrow(2, 0, 1).narrow(3, 1, 1), {(1 + 2) / 2.0}));
  // ceil_mode: 5 -> 3 windows of 2 (the last one partial); adaptive 4 -> 3: [0,2) [1,3) [2,4).
  EXPECT_EQ(max_pool2d(arange<double>(25).reshape({1, 1, 5, 5}), {2, 2}, std::nullopt, {0, 0}, {1, 1}, true).shape(),
            (Shape{1, 1, 3, 3}));
  EXPECT_TRUE(chorus::testing::values_are(adaptive_avg_pool2d(x, {1, 3}).reshape({3}), {6.5, 7.5, 8.5}));
  EXPECT_TRUE(throws_with([&] { max_pool2d(x, {2, 2}, std::nullopt, {2, 2}); }, {"max_pool2d", "half the kernel"}));
  EXPECT_TRUE(throws_with([&] { avg_pool2d(x.reshape({4, 4}), {2, 2}); }, {"avg_pool2d", "4-D", "[4, 4]"}));
  EXPECT_TRUE(throws_with([&] { max_pool2d(x, {5, 5}); }, {"max_pool2d", "too small"}));
}

TEST(LayersGradcheck, BatchNormTrainingAndEval) {
  for (bool affine : {true, false}) {
    EXPECT_TRUE(gradcheck(
        [affine](const TL& x) {
          return batch_norm(x[0], Tensor<double>(), Tensor<double>(), affine ? x[1] : Tensor<double>(),
                            affine ? x[2] : Tensor<double>(), true, 0.1, 1e-5);
        },
        {r({3, 2, 2, 3}, 1), r({2}, 2, 0.5, 1.5), r({2}, 3)}));
  }
  EXPECT_TRUE(gradcheck(
      [](const TL& x) {
        return batch_norm(x[0], Tensor<double>(), Tensor<double>(), x[1], x[2], true, 0.1, 1e-5);
      },
      {r({5, 3}, 4), r({3}, 5, 0.5, 1.5), r({3}, 6)}));
  auto rm = r({2}, 7), rv = r({2}, 8, 0.5, 2);
  EXPECT_TRUE(gradcheck([&](const TL& x) { return batch_norm(x[0], rm, rv, x[1], x[2], false, 0.1, 1e-5); },
                        {r({3, 2, 2, 2}, 9), r({2}, 10), r({2}, 11)}));
}

TYPED_TEST(LayersTyped, BatchNormStatisticsAndBuffers) {
  using T = TypeParam;
  nn::BatchNorm2dT<T> bn(3);
  // PyTorch's names, initial values and dtypes.
  auto names = [](const auto& v) {
    std::vector<std::string> out;
    for (auto& t : v) out.push_back(t.name);
    return out;
  };
  EXPECT_EQ(names(bn->named_parameters()), (std::vector<std::string>{"weight", "bias"}));
  EXPECT_EQ(names(bn->named_buffers()),
            (std::vector<std::string>{"running_mean", "running_var", "num_batches_tracked"}));
  EXPECT_EQ(bn->named_buffers()[2].tensor.dtype(), DType::Int64);
  EXPECT_TRUE(chorus::testing::values_are(bn->running_var, {1, 1, 1}));
  auto x = r<T>({4, 3, 2, 5}, 1, -2, 3);
  auto y = bn(x);
  // Output: per channel mean 0, biased variance 1 (up to eps).
  const double eps = 1e-5;
  auto xv = x.to_vector(), yv = y.to_vector();
  for (int c = 0; c < 3; ++c) {
    double m = 0, m2 = 0, ym = 0, yv2 = 0;
    const int n = 4 * 10;
    for (int b = 0; b < 4; ++b)
      for (int i = 0; i < 10; ++i) {
        const double v = xv[(b * 3 + c) * 10 + i], w = yv[(b * 3 + c) * 10 + i];
        m += v / n;
        m2 += v * v / n;
        ym += w / n;
        yv2 += w * w / n;
      }
    const double var = m2 - m * m;
    EXPECT_NEAR(ym, 0.0, 1e-5);
    EXPECT_NEAR(yv2, var / (var + eps), 1e-4);
    EXPECT_NEAR(double(bn->running_mean.to_vector()[c]), 0.1 * m, 1e-5);
    EXPECT_NEAR(double(bn->running_var.to_vector()[c]), 0.9 + 0.1 * var * n / (n - 1), 1e-5);
  }
  EXPECT_EQ(bn->num_batches_tracked.item(), 1);
  bn(x);
  EXPECT_EQ(bn->num_batches_tracked.item(), 2);
  // eval(): the running statistics, no update.
  bn->eval();
  auto before = bn->running_mean.to_vector();
  auto ye = bn(x);
  EXPECT_EQ(bn->running_mean.to_vector(), before);
  EXPECT_EQ(bn->num_batches_tracked.item(), 2);
  auto rm = bn->running_mean.to_vector(), rv = bn->running_var.to_vector(), yev = ye.to_vector();
  for (int i = 0; i < 4 * 3 * 10; ++i) {
    const int c = (i / 10) % 3;
    EXPECT_NEAR(double(yev[i]), (double(xv[i]) - rm[c]) / std::sqrt(double(rv[c]) + eps), 1e-5);
  }
  // momentum = nullopt: cumulative average of the batch means.
  nn::BatchNorm1dT<T> cum(2, nn::BatchNormOptions{.momentum = std::nullopt});
  auto a = r<T>({6, 2}, 2), b = r<T>({6, 2}, 3);
  cum(a);
  cum(b);
  auto ma = a.mean(0).to_vector(), mb = b.mean(0).to_vector(), rc = cum->running_mean.to_vector();
  for (int c = 0; c < 2; ++c) EXPECT_NEAR(double(rc[c]), (double(ma[c]) + double(mb[c])) / 2, 1e-6);
  // Errors name the layer and the shape.
  EXPECT_TRUE(throws_with([&] { bn(r<T>({4, 3, 5}, 4)); }, {"BatchNorm2d", "4-D", "[4, 3, 5]"}));
  EXPECT_TRUE(throws_with([&] { cum(r<T>({4, 3}, 4)); }, {"BatchNorm1d", "3 channels, expected 2"}));
  EXPECT_TRUE(throws_with([&] { cum(r<T>({1, 2}, 4)); }, {"more than 1 value per channel", "[1, 2]"}));
  nn::BatchNorm1dT<T> plain(2, nn::BatchNormOptions{.affine = false, .track_running_stats = false});
  EXPECT_TRUE(plain->named_parameters().empty());
  EXPECT_TRUE(plain->named_buffers().empty());
  plain->eval();  // no running statistics: batch statistics in eval too
  EXPECT_NEAR(double(plain(a).mean(0).to_vector()[0]), 0.0, 1e-6);
}

// The fused CPU layer norm (Note [fused layer norm]) in float, against the double one, on rows
// whose mean is large next to their spread (where a one-pass variance loses its digits).
TEST(Layers, FloatLayerNormIsAccurateForLargeMeans) {
  Generator g(3);
  auto x = randn<float>({5, 300}, Device::cpu(), 1000.0, 0.01, g);
  auto w = randn<float>({300}, Device::cpu(), 0.0, 1.0, g), b = randn<float>({300}, Device::cpu(), 0.0, 1.0, g);
  auto want = layer_norm(x.to<double>(), Shape{300}, w.to<double>(), b.to<double>());
  auto got = layer_norm(x, Shape{300}, w, b);
  EXPECT_LT(double(amax(abs(sub(got.to<double>(), want))).item()), 1e-4);  // E[x²] - E[x]² would be off by ~1
}

TEST(LayersGradcheck, LayerNormEmbeddingSiluDropout2d) {
  EXPECT_TRUE(gradcheck([](const TL& x) { return layer_norm(x[0], Shape{4}, x[1], x[2]); },
                        {r({3, 4}, 1), r({4}, 2), r({4}, 3)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return layer_norm(x[0], Shape{2, 3}); }, {r({2, 2, 3}, 4)}));
  // Note [fused layer norm]: bias without weight; a strided input over 2 trailing dimensions.
  EXPECT_TRUE(gradcheck([](const TL& x) { return layer_norm(x[0], Shape{3}, Tensor<double>(), x[1]); },
                        {r({2, 3}, 11), r({3}, 12)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return layer_norm(x[0].transpose(0, 2), Shape{3, 2}, x[1], x[2]); },
                        {r({2, 3, 4}, 13), r({3, 2}, 14), r({3, 2}, 15)}));
  auto idx = from_vector<std::int64_t>({1, 0, 3, 1, 3, 2}, Shape{2, 3});
  EXPECT_TRUE(gradcheck([&](const TL& x) { return embedding(idx, x[0]); }, {r({4, 3}, 5)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return silu(x[0]); }, {r({7}, 6, -3, 3)}));
  EXPECT_TRUE(gradcheck(
      [](const TL& x) {
        Generator g(7);
        return dropout2d(x[0], 0.5, true, g);
      },
      {r({3, 4, 2, 2}, 8)}));
}

TEST(Layers, EmbeddingPaddingIdx) {
  nn::EmbeddingT<double> emb(5, 3, nn::EmbeddingOptions{.padding_idx = -1});
  EXPECT_EQ(emb->padding_idx, 4);
  EXPECT_TRUE(chorus::testing::values_are(emb->weight.narrow(0, 4, 1).reshape({3}), {0, 0, 0}));
  auto idx = from_vector<std::int64_t>({4, 1, 4, 2}, Shape{4});
  auto y = emb(idx);
  EXPECT_EQ(y.shape(), (Shape{4, 3}));
  y.sum().backward();
  auto g = emb->weight.grad().to_vector();
  for (int j = 0; j < 3; ++j) {
    EXPECT_EQ(g[4 * 3 + j], 0.0);  // padding row: no gradient
    EXPECT_EQ(g[1 * 3 + j], 1.0);
    EXPECT_EQ(g[0 * 3 + j], 0.0);
  }
  EXPECT_TRUE(throws_with([&] { emb(from_vector<std::int64_t>({5}, Shape{1})); }, {"index 5", "out of range"}));
  EXPECT_EQ(emb->named_parameters()[0].name, "weight");
}

TEST(Layers, FunctionalEmbeddingPaddingIdxFollowsPyTorch) {
  // F::embedding(idx, w, -1) treated -1 as "no padding" and trained the last row; in PyTorch
  // (and nn::Embedding) -1 is the last row, which gets no gradient. None is std::nullopt.
  auto idx = from_vector<std::int64_t>({4, 1, 4, 0}, Shape{4});
  auto grad_of = [&](std::optional<std::int64_t> padding_idx) {
    auto w = ones<double>({5, 2}).requires_grad_(true);
    embedding(idx, w, padding_idx).sum().backward();
    return w.grad().to_vector();
  };
  const std::vector<double> row4_frozen{1, 1, 1, 1, 0, 0, 0, 0, 0, 0}, all{1, 1, 1, 1, 0, 0, 0, 0, 2, 2};
  EXPECT_EQ(grad_of(-1), row4_frozen);
  EXPECT_EQ(grad_of(4), row4_frozen);
  EXPECT_EQ(grad_of(-5), (std::vector<double>{0, 0, 1, 1, 0, 0, 0, 0, 2, 2}));  // -5 is row 0
  EXPECT_EQ(grad_of(std::nullopt), all);
  auto w = ones<double>({5, 2}).requires_grad_(true);
  embedding(idx, w).sum().backward();  // the default: no padding row
  EXPECT_EQ(w.grad().to_vector(), all);
  // The same as the layer with the same padding_idx.
  nn::EmbeddingT<double> emb(5, 2, {.padding_idx = -1});
  emb(idx).sum().backward();
  EXPECT_EQ(emb->weight.grad().to_vector(), row4_frozen);
}

TEST(Layers, EmbeddingPaddingIdxIsCheckedAgainstTheTable) {
  // An out-of-range padding_idx used to fail only in backward, in narrow, never naming it.
  auto idx = from_vector<std::int64_t>({1, 0}, Shape{2});
  auto w = ones<double>({5, 2}).requires_grad_(true);
  for (std::int64_t bad : {5, 7, -6}) {
    const std::string named = "padding_idx " + std::to_string(bad);
    EXPECT_TRUE(throws_with([&] { embedding(idx, w, bad); }, {"embedding", named.c_str(), "within num_embeddings", "5 rows"}));
  }
  EXPECT_TRUE(throws_with([&] { embedding(idx, w.detach(), 5); }, {"padding_idx 5"}));  // without grad too
  EXPECT_TRUE(throws_with([] { nn::Embedding(5, 2, {.padding_idx = 5}); }, {"Embedding", "padding_idx 5"}));
}

TEST(Layers, Dropout2dZeroesWholeChannels) {
  Generator g(3);
  auto x = ones<double>({4, 6, 3, 3});
  auto y = dropout2d(x, 0.5, true, g).to_vector();
  int zeros_ = 0;
  for (int p = 0; p < 24; ++p) {
    const double v = y[p * 9];
    EXPECT_TRUE(v == 0.0 || v == 2.0);
    for (int i = 1; i < 9; ++i) EXPECT_EQ(y[p * 9 + i], v);
    zeros_ += v == 0.0;
  }
  EXPECT_GT(zeros_, 0);
  EXPECT_LT(zeros_, 24);
  nn::Dropout2d d(0.5);
  d->eval();
  EXPECT_TRUE(is_same(d(x), x));
}

TEST(Layers, FlattenGeluSiluModules) {
  nn::Flatten flat;
  EXPECT_EQ(flat(ones<float>({2, 3, 4, 5})).shape(), (Shape{2, 60}));
  EXPECT_EQ(nn::Flatten(0, 1)(ones<float>({2, 3, 4})).shape(), (Shape{6, 4}));
  auto x = from_vector<double>({-1.0, 0.0, 2.0});
  EXPECT_TRUE(chorus::testing::values_are(nn::SiLU()(x), {-1.0 / (1 + std::exp(1.0)), 0.0, 2.0 / (1 + std::exp(-2.0))}));
  EXPECT_TRUE(chorus::testing::values_are(nn::GELU()(x), {-0.15865525393145707, 0.0, 1.9544997361036416}));
}

TEST(Layers, DefaultInitialisationMatchesPyTorch) {
  // Conv2d: weight and bias within ±1/sqrt(fan_in), fan_in = in/groups * kh * kw, and spread over it.
  nn::Conv2dT<double> conv(8, 16, 3, {.padding = 1, .groups = 2});
  EXPECT_EQ(conv->weight.shape(), (Shape{16, 4, 3, 3}));
  const double bound = 1.0 / std::sqrt(4.0 * 9);
  double mx = 0;
  for (double v : conv->weight.to_vector()) mx = std::max(mx, std::abs(v));
  EXPECT_LE(mx, bound);
  EXPECT_GT(mx, 0.9 * bound);
  for (double v : conv->bias.to_vector()) EXPECT_LE(std::abs(v), bound);
  std::vector<std::string> names;
  for (auto& p : conv->named_parameters()) names.push_back(p.name);
  EXPECT_EQ(names, (std::vector<std::string>{"weight", "bias"}));
  EXPECT_EQ(conv(ones<double>({2, 8, 5, 5})).shape(), (Shape{2, 16, 5, 5}));
  EXPECT_FALSE(nn::Conv2dT<double>(2, 2, 1, nn::Conv2dOptions{.bias = false})->bias.defined());
  // LayerNorm: ones and zeros; Embedding: N(0, 1).
  nn::LayerNormT<double> ln(6);
  EXPECT_TRUE(chorus::testing::values_are(ln->weight, std::vector<double>(6, 1.0)));
  EXPECT_TRUE(chorus::testing::values_are(ln->bias, std::vector<double>(6, 0.0)));
  nn::EmbeddingT<double> emb(200, 50);
  double m = 0, m2 = 0;
  for (double v : emb->weight.to_vector()) {
    m += v / 1e4;
    m2 += v * v / 1e4;
  }
  EXPECT_NEAR(m, 0.0, 0.05);
  EXPECT_NEAR(m2, 1.0, 0.05);
  EXPECT_TRUE(throws_with([] { nn::Conv2d(3, 4, 3, nn::Conv2dOptions{.groups = 2}); }, {"Conv2d(3, 4)", "groups=2"}));
  EXPECT_TRUE(throws_with([&] { conv(ones<double>({2, 3, 5, 5})); }, {"conv2d", "3 channels", "expects 8"}));
}

TEST(Layers, InitFunctions) {
  Generator g(1);
  auto w = Tensor<double>::empty({256, 128, 3, 3});
  auto stats = [&] {
    double m = 0, m2 = 0;
    auto v = w.to_vector();
    for (double x : v) {
      m += x / v.size();
      m2 += x * x / v.size();
    }
    return std::pair{m, std::sqrt(m2 - m * m)};
  };
  const double fan_in = 128 * 9, fan_out = 256 * 9;
  nn::init::kaiming_normal_(w, 0.0, nn::init::FanMode::FanIn, "relu", g);
  EXPECT_NEAR(stats().second, std::sqrt(2.0 / fan_in), 0.01 * std::sqrt(2.0 / fan_in));
  nn::init::kaiming_normal_(w, 0.0, nn::init::FanMode::FanOut, "relu", g);
  EXPECT_NEAR(stats().second, std::sqrt(2.0 / fan_out), 0.01 * std::sqrt(2.0 / fan_out));
  nn::init::kaiming_uniform_(w, 0.0, nn::init::FanMode::FanIn, "relu", g);
  EXPECT_NEAR(stats().second, std::sqrt(2.0 / fan_in), 0.01 * std::sqrt(2.0 / fan_in));
  nn::init::xavier_normal_(w, 1.0, g);
  EXPECT_NEAR(stats().second, std::sqrt(2.0 / (fan_in + fan_out)), 0.01 * std::sqrt(2.0 / (fan_in + fan_out)));
  nn::init::xavier_uniform_(w, 1.0, g);
  EXPECT_NEAR(stats().second, std::sqrt(2.0 / (fan_in + fan_out)), 0.01 * std::sqrt(2.0 / (fan_in + fan_out)));
  EXPECT_DOUBLE_EQ(nn::init::calculate_gain("tanh"), 5.0 / 3.0);
  EXPECT_TRUE(throws_with([] { nn::init::calculate_gain("swish"); }, {"swish"}));
}

TEST(Layers, OnednnConvolutionsEqualIm2col) {
  if (!backend::cpu::onednn_available()) GTEST_SKIP() << "chorus was built without oneDNN (libdnnl-dev not found)";
  struct Case {
    Shape x, w;
    Pair s, p, d;
    std::int64_t groups;
    bool bias;
  };
  for (const auto& c : {Case{{4, 16, 12, 10}, {32, 16, 3, 3}, {1, 1}, {1, 1}, {1, 1}, 1, false},
                        Case{{2, 4, 9, 8}, {6, 2, 3, 2}, {2, 1}, {1, 0}, {1, 2}, 2, true},
                        Case{{3, 8, 7, 7}, {8, 1, 3, 3}, {2, 2}, {1, 1}, {1, 1}, 8, true},
                        Case{{3, 8, 8, 8}, {16, 8, 1, 1}, {2, 2}, {0, 0}, {1, 1}, 1, false},
                        Case{{2, 3, 8, 7}, {4, 3, 3, 3}, {3, 2}, {0, 0}, {1, 1}, 1, true}}) {  // floor drops columns
    SCOPED_TRACE(::testing::Message() << "x " << c.x << " w " << c.w);
    std::vector<Tensor<float>> grads[2];
    Tensor<float> outs[2];
    for (int use : {0, 1}) {
      backend::cpu::set_onednn_enabled(use == 1);
      auto x = r<float>(c.x, 1).requires_grad_(true), w = r<float>(c.w, 2).requires_grad_(true);
      auto b = c.bias ? r<float>({c.w[0]}, 3).requires_grad_(true) : Tensor<float>();
      outs[use] = conv2d(x, w, b, c.s, c.p, c.d, c.groups);
      (outs[use] * r<float>(outs[use].shape(), 4)).sum().backward();
      grads[use] = {x.grad(), w.grad()};
      if (c.bias) grads[use].push_back(b.grad());
    }
    backend::cpu::set_onednn_enabled(true);
    EXPECT_TRUE(all_close(outs[1], outs[0], 1e-5, 1e-5));
    for (std::size_t i = 0; i < grads[0].size(); ++i) EXPECT_TRUE(all_close(grads[1][i], grads[0][i], 1e-5, 1e-5)) << i;
  }
}


// chorus::set_num_threads (Note [oneDNN threads]): the calling thread's oneDNN team and
// OpenBLAS's threads; another thread keeps its own count; the results equal one thread's.
TEST(Layers, SetNumThreadsSizesThisThreadsOnednnTeamAndBlas) {
  EXPECT_TRUE(throws_with([] { set_num_threads(0); }, {"set_num_threads(0)", "at least one thread"}));
  const int before = get_num_threads();
  auto x = r<float>({4, 16, 12, 10}, 1), w = r<float>({32, 16, 3, 3}, 2);
  set_num_threads(1);
  const auto one = conv2d(x, w, Tensor<float>(), 1, 1);
  EXPECT_EQ(backend::cpu::blas_threads(), 1);
  set_num_threads(2);
  EXPECT_EQ(get_num_threads(), 2);
  if (std::thread::hardware_concurrency() >= 2) {
    EXPECT_EQ(backend::cpu::blas_threads(), 2);
  }
  int other = 0;
  std::thread([&] {
    set_num_threads(1);
    other = get_num_threads();
  }).join();
  EXPECT_EQ(other, 1);
  EXPECT_EQ(get_num_threads(), 2);  // this thread's count is its own
  const auto two = conv2d(x, w, Tensor<float>(), 1, 1);
#if CHORUS_ONEDNN_API && DNNL_CPU_RUNTIME == DNNL_RUNTIME_OMP
  EXPECT_EQ(omp_get_max_threads(), 2);  // the team oneDNN's convolution ran with
#endif
  EXPECT_TRUE(all_close(two, one, 1e-5, 1e-5));
#if CHORUS_ONEDNN_API
  // A plan (oneDNN primitives) belongs to the team size it was made under: oneDNN fixes the work
  // split at creation, so a plan made with one thread must not serve two (resnet20 ran its
  // 2-thread steps on one thread after a 1-thread configuration had made the plans).
  backend::cpu::OnednnConv c{{}, 4, 32, 1, false};
  c.g.C = 16, c.g.H = 12, c.g.W = 10, c.g.kh = c.g.kw = 3, c.g.sh = c.g.sw = 1, c.g.ph = c.g.pw = 1;
  c.g.dh = c.g.dw = 1, c.g.OH = 12, c.g.OW = 10;
  set_num_threads(1);
  const auto* p1 = &backend::cpu::onednn::plan(c);
  set_num_threads(2);
  const auto* p2 = &backend::cpu::onednn::plan(c);
  EXPECT_NE(p1, p2);
  EXPECT_EQ(p2, &backend::cpu::onednn::plan(c));
  set_num_threads(1);
  EXPECT_EQ(p1, &backend::cpu::onednn::plan(c));
#endif
  set_num_threads(before);
  backend::cpu::set_blas_threads(1);
}

// Note [intra-op threads]: with set_num_threads(2) chorus's own loops run on an OpenMP team of
// two (the calling thread and one more), and every result is bit for bit the one-thread result:
// batch norm's statistics, running statistics and gradients, pooling, elementwise ops.
TEST(Layers, IntraOpThreadsRunChorusLoopsOnATeamWithOneThreadsResults) {
  const int before = get_num_threads();
  auto threads_used = [](std::int64_t n, std::int64_t grain) {
    std::mutex m;
    std::set<std::thread::id> ids;
    std::int64_t covered = 0;
    backend::cpu::parallel_for(n, grain, [&](std::int64_t b, std::int64_t e) {
      std::lock_guard<std::mutex> lock(m);
      ids.insert(std::this_thread::get_id());
      covered += e - b;
    });
    EXPECT_EQ(covered, n);
    return ids.size();
  };
  set_num_threads(1);
  EXPECT_EQ(threads_used(std::int64_t{1} << 20, backend::cpu::kParallelGrain), 1u);
  set_num_threads(2);
  EXPECT_EQ(threads_used(std::int64_t{1} << 20, backend::cpu::kParallelGrain), CHORUS_HAS_GOMP ? 2u : 1u);
  EXPECT_EQ(threads_used(16, 8), CHORUS_HAS_GOMP ? 2u : 1u);  // 16 items of a grain of 8
  EXPECT_EQ(threads_used(15, 8), 1u);                           // less than two grains: the caller alone

  // A ResNet block's worth of work, once per thread count: [32, 16, 24, 24] has 2^17 values per
  // 8 channels, enough to split every loop below.
  auto step = [](int threads) {
    set_num_threads(threads);
    auto x = r<float>({32, 16, 24, 24}, 7).requires_grad_(true);
    auto w = r<float>({16}, 8).requires_grad_(true), b = r<float>({16}, 9).requires_grad_(true);
    auto rm = zeros<float>({16}), rv = ones<float>({16});
    auto y = relu(batch_norm(x, rm, rv, w, b, true, 0.1, 1e-5));
    auto z = max_pool2d(y, 2) + avg_pool2d(y, 2) * 0.5;
    auto loss = (adaptive_avg_pool2d(z, 3) * r<float>({32, 16, 3, 3}, 10)).sum();
    loss.backward();
    return std::vector<Tensor<float>>{y.detach(), z.detach(), rm, rv, x.grad(), w.grad(), b.grad()};
  };
  const auto one = step(1), two = step(2);
  for (std::size_t i = 0; i < one.size(); ++i)
    EXPECT_EQ(one[i].to_vector(), two[i].to_vector()) << "result " << i;
  // Float products of a thread with two intra-op threads run in oneDNN's sgemm on the same team
  // (Note [one pool of threads]): every transpose combination and a strided operand against
  // OpenBLAS's one-thread products (their sums are ordered differently: close, not equal).
  auto products = [](int threads) {
    set_num_threads(threads);
    auto a = r<float>({37, 53}, 11), b = r<float>({53, 29}, 12), c = r<float>({29, 53}, 13), d = r<float>({37, 29}, 14);
    auto wide = r<float>({53, 60}, 15);
    return std::vector<Tensor<float>>{a.matmul(b), a.t().contiguous().t().matmul(b), a.matmul(c.t()),
                                      a.t().matmul(d), a.matmul(wide.narrow(1, 3, 29)),
                                      r<float>({4, 37, 53}, 16).matmul(r<float>({4, 53, 29}, 17))};
  };
  const auto p1 = products(1), p2 = products(2);
  for (std::size_t i = 0; i < p1.size(); ++i) EXPECT_TRUE(all_close(p2[i], p1[i], 1e-5, 1e-5)) << "product " << i;
  set_num_threads(before);
  backend::cpu::set_blas_threads(1);
}

// ==== Batch-norm statistics and gradient clipping on the device (issue 17) ====
// The host/device pieces the CUDA kernels are made of, run on the CPU: the Welford combine, the
// reduction plan and the kernels' walks over x (every value exactly once, in its own channel),
// the finishing with momentum=None read through a pointer, SyncBatchNorm's two-reduction
// combine; then the CPU paths they replaced.

namespace {
/// Two-pass reference statistics of channel c of x [N, C, S] (long double).
std::pair<long double, long double> ref_stats(const std::vector<double>& x, std::int64_t N, std::int64_t C,
                                              std::int64_t S, std::int64_t c) {
  long double s = 0, q = 0;
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t i = 0; i < S; ++i) s += x[(n * C + c) * S + i];
  const long double m = s / (N * S);
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t i = 0; i < S; ++i) q += (x[(n * C + c) * S + i] - m) * (x[(n * C + c) * S + i] - m);
  return {m, q};
}
}  // namespace

TEST(BatchNormStats, WelfordCombineOfAnySplitEqualsTheWhole) {
  Generator g(17);
  std::vector<double> v(1000);
  g.uniform(v.data(), 1000, 1e4, 1e4 + 3);  // a large offset: sums of squares would cancel
  auto whole = [&](std::size_t a, std::size_t b) {
    long double s = 0, q = 0;
    for (std::size_t i = a; i < b; ++i) s += v[i];
    const long double m = s / (b - a);
    for (std::size_t i = a; i < b; ++i) q += (v[i] - m) * (v[i] - m);
    return std::pair<double, double>{double(m), double(q)};
  };
  auto stats = [&](std::size_t a, std::size_t b) {  // shifted sums around the first value, as a thread does
    double s1 = 0, s2 = 0;
    for (std::size_t i = a; i < b; ++i) {
      s1 += v[i] - v[a];
      s2 += (v[i] - v[a]) * (v[i] - v[a]);
    }
    return backend::welford_from_shifted<double>(double(b - a), v[a], s1, s2);
  };
  const auto [m, q] = whole(0, 1000);
  for (std::size_t cut : {1u, 7u, 500u, 999u}) {
    auto w = backend::welford_combine(stats(0, cut), stats(cut, 1000));
    EXPECT_EQ(w.n, 1000);
    EXPECT_NEAR(w.mean, m, 1e-10);
    EXPECT_NEAR(w.m2, q, 1e-8 * q);
  }
  backend::Welford<double> empty;
  auto one = stats(3, 4);
  EXPECT_EQ(backend::welford_combine(empty, one).mean, one.mean);  // empty sides change nothing
  EXPECT_EQ(backend::welford_combine(one, empty).m2, 0.0);
  EXPECT_EQ(backend::welford_from_shifted<double>(0, 5.0, 0, 0).n, 0);
}

TEST(BatchNormStats, PlanAndKernelWalksVisitEveryValueOnceInItsChannel) {
  struct Case {
    std::int64_t N, C, S;
  };
  for (auto [N, C, S] : {Case{1, 1, 1}, Case{0, 3, 40}, Case{2, 3, 32}, Case{5, 4, 33}, Case{3, 2, 1000},
                         Case{64, 16, 1024}, Case{7, 5, 1}, Case{100, 3, 5}, Case{1000, 40, 1}, Case{2, 3, 0},
                         Case{1, 1, 100000}, Case{300, 2, 31}}) {
    SCOPED_TRACE(::testing::Message() << "[" << N << ", " << C << ", " << S << "]");
    const auto p = backend::bn_reduce_plan(N, C, S);
    EXPECT_EQ(p.planar, S >= backend::kBnPlanarMinS);
    EXPECT_GE(p.splits, 1);
    EXPECT_LE(p.splits, 65535);
    std::vector<int> seen(static_cast<std::size_t>(N * C * S), 0);
    std::vector<int> partial_of(static_cast<std::size_t>(std::max<std::int64_t>(p.partials(), 1)), 0);
    bool wrong_channel = false;
    if (p.planar) {
      for (std::int64_t c = 0; c < C; ++c)
        for (std::int64_t bx = 0; bx < p.splits; ++bx)
          for (std::int64_t t = 0; t < backend::kBnThreads; ++t)
            backend::planar_walk(p, c, bx, t, backend::kBnThreads, [&](std::int64_t o) {
              ++seen[o];
              wrong_channel |= (o / S) % C != c;
            });
    } else {
      for (std::int64_t tile = 0; tile < p.tiles; ++tile)
        for (std::int64_t by = 0; by < p.splits; ++by)
          for (int tx = 0; tx < backend::kBnColTile; ++tx)
            for (int ty = 0; ty < backend::kBnColLanes; ++ty)
              backend::column_walk(p, tile, by, tx, ty, [&](std::int64_t o) {
                ++seen[o];
                const std::int64_t j = tile * backend::kBnColTile + tx;  // the column this thread owns
                wrong_channel |= o % (C * S) != j;
                const std::int64_t n = o / (C * S);
                wrong_channel |= n < by * p.chunk || n >= (by + 1) * p.chunk;
              });
    }
    EXPECT_FALSE(wrong_channel);
    EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), static_cast<std::ptrdiff_t>(seen.size()));
    // The combining kernel's entries: each partial once, in the channel that wrote it.
    for (std::int64_t c = 0; c < C; ++c)
      for (std::int64_t k = 0; k < p.entries(); ++k) {
        const std::int64_t idx = p.entry(c, k);
        ASSERT_GE(idx, 0);
        ASSERT_LT(idx, p.partials());
        ++partial_of[idx];
        EXPECT_EQ(p.planar ? idx / p.splits : (idx % (C * S)) / S, c);
      }
    if (p.partials() > 0) {
      EXPECT_EQ(std::count(partial_of.begin(), partial_of.end(), 1), static_cast<std::ptrdiff_t>(p.partials()));
    }
  }
  // Many blocks for few channels (the ResNet-20 case): not one block per channel.
  const auto r20 = backend::bn_reduce_plan(128, 16, 1024);
  EXPECT_GE(r20.splits * 16, 512);
  const auto mlp = backend::bn_reduce_plan(4096, 64, 1);
  EXPECT_GE(mlp.splits * mlp.tiles, 32);
}

TEST(BatchNormStats, PlanarCursorMatchesTheDefinition) {
  for (std::int64_t S : {1, 3, 32, 255, 256, 257, 1000})
    for (std::int64_t step : {1, 7, 256}) {
      const std::int64_t C = 3, c = 1, N = 5;
      std::int64_t e = 2;
      auto cur = backend::planar_cursor(C, S, c, e, step);
      for (; e < N * S; e += step, backend::advance(cur))
        ASSERT_EQ(cur.off, ((e / S) * C + c) * S + e % S) << "S " << S << " step " << step << " e " << e;
    }
}

TYPED_TEST(LayersTyped, BatchNormStatsOnePassMatchesTwoPass) {
  using T = TypeParam;
  const std::int64_t N = 6, C = 3, S = 7;
  auto x = r<T>({N, C, S}, 3, 1e3, 1e3 + 2);  // large mean, small spread
  auto xv = x.to_vector();
  std::vector<double> xd(xv.begin(), xv.end());
  std::vector<double> mean(C), m2(C);
  backend::cpu::bn_stats(x.data(), N, C, S, mean.data(), m2.data(), static_cast<const backend::BnFinish<T>*>(nullptr));
  for (std::int64_t c = 0; c < C; ++c) {
    const auto [m, q] = ref_stats(xd, N, C, S, c);
    EXPECT_NEAR(mean[c], double(m), 1e-10);
    EXPECT_NEAR(m2[c], double(q), 1e-9 * double(q));
  }
}

TEST(BatchNormStats, FinishReadsMomentumNoneThroughTheCounter) {
  double mean = 0, invstd = 0, rm = 1, rv = 2;
  std::int64_t batches = 4;
  backend::BnFinish<double> f;
  f.count = 5, f.eps = 0, f.mean = &mean, f.invstd = &invstd, f.running_mean = &rm, f.running_var = &rv;
  f.momentum = 0.9;  // ignored: num_batches is given
  f.num_batches = &batches;
  backend::bn_finish_channel(f, 0, 3.0, 20.0);
  EXPECT_DOUBLE_EQ(mean, 3.0);
  EXPECT_DOUBLE_EQ(invstd, 1.0 / 2.0);                 // var = 20 / 5
  EXPECT_DOUBLE_EQ(rm, 0.75 * 1 + 0.25 * 3.0);         // momentum 1/4
  EXPECT_DOUBLE_EQ(rv, 0.75 * 2 + 0.25 * (20.0 / 4));  // unbiased
  batches = 1;                                         // read at the time of the call
  backend::bn_finish_channel(f, 0, 7.0, 8.0);
  EXPECT_DOUBLE_EQ(rm, 7.0);
  EXPECT_DOUBLE_EQ(rv, 2.0);
}

TEST(BatchNormStats, SyncCombineOfParticipantsEqualsTheWhole) {
  Generator g(9);
  std::vector<double> a(40), b(25);
  g.uniform(a.data(), 40, -1, 1);
  g.uniform(b.data(), 25, 50, 52);  // a participant far from the other: the correction term matters
  auto local = [](const std::vector<double>& v) {
    double m = 0, q = 0;
    for (double x : v) m += x;
    m /= v.size();
    for (double x : v) q += (x - m) * (x - m);
    return std::pair<double, double>{m, q};
  };
  std::vector<double> all(a);
  all.insert(all.end(), b.begin(), b.end());
  const auto [ma, qa] = local(a);
  const auto [mb, qb] = local(b);
  const auto [m, q] = local(all);
  double sum_a = ma * 40 + mb * 25, sum_b = sum_a, m2a = qa, m2b = qb;  // after the first all-reduce
  backend::bn_sync_channel(ma, 40, 65, sum_a, m2a);
  backend::bn_sync_channel(mb, 25, 65, sum_b, m2b);
  EXPECT_NEAR(sum_a, m, 1e-12);
  EXPECT_EQ(sum_a, sum_b);
  EXPECT_NEAR(m2a + m2b, q, 1e-10 * q);  // the second all-reduce
}

TYPED_TEST(LayersTyped, BatchNormMomentumNoneIsTheCumulativeAverage) {
  using T = TypeParam;
  nn::BatchNorm1dT<T> bn(3, nn::BatchNormOptions{.momentum = std::nullopt});
  std::vector<std::vector<T>> means, vars;
  for (int step = 0; step < 4; ++step) {
    auto x = r<T>({5, 3}, 40 + step, -2, 3);
    bn(x);
    auto xv = x.to_vector();
    std::vector<T> m(3), v(3);
    for (int c = 0; c < 3; ++c) {
      double s = 0, q = 0;
      for (int n = 0; n < 5; ++n) s += xv[n * 3 + c];
      for (int n = 0; n < 5; ++n) q += (xv[n * 3 + c] - s / 5) * (xv[n * 3 + c] - s / 5);
      m[c] = T(s / 5);
      v[c] = T(q / 4);
    }
    means.push_back(m);
    vars.push_back(v);
  }
  EXPECT_EQ(bn->num_batches_tracked.item(), 4);
  auto rm = bn->running_mean.to_vector(), rv = bn->running_var.to_vector();
  for (int c = 0; c < 3; ++c) {  // PyTorch: the plain average of the batch statistics (the initial 0 / 1 weigh nothing)
    double sm = 0, sv = 0;
    for (int s = 0; s < 4; ++s) sm += means[s][c], sv += vars[s][c];
    EXPECT_NEAR(rm[c], sm / 4, 10 * chorus::testing::tol<T>());
    EXPECT_NEAR(rv[c], sv / 4, 10 * chorus::testing::tol<T>());
  }
}

// SyncBatchNorm over replicas whose chunks have very different means: the global variance comes
// from the replicas' M2 around the global mean (Note [batch-norm statistics]).
TEST(BatchNormStats, SyncBatchNormOverFarApartReplicasEqualsOneBatchNorm) {
  set_cpu_device_count(std::max(cpu_device_count(), 3));
  nn::SyncBatchNormT<double> single(2);
  auto x = r<double>({9, 2, 4}, 12, -1, 1);
  auto xv = x.to_vector();
  for (std::size_t i = 0; i < xv.size(); ++i)
    if (i >= 3 * 8) xv[i] += 1e3 * double(i / 24);  // rows 3.. shifted by 1e3, rows 6.. by 2e3
  x = from_vector<double>(xv, x.shape());
  auto ref = single(x.detach().requires_grad_());
  DataParallel<nn::SyncBatchNormT<double>> dp(nn::SyncBatchNormT<double>(2),
                                              {Device::cpu(0), Device::cpu(1), Device::cpu(2)});
  auto xd = x.detach().requires_grad_();
  auto y = dp(xd);
  EXPECT_TRUE(all_close(y, ref, 1e-9, 1e-9));
  EXPECT_TRUE(all_close(dp.module().running_var, single->running_var, 1e-9));
  EXPECT_TRUE(all_close(dp.module().running_mean, single->running_mean, 1e-9));
}

TYPED_TEST(LayersTyped, ClipGradNormOverDevicesAndDtypes) {
  using T = TypeParam;
  set_cpu_device_count(std::max(cpu_device_count(), 2));
  auto a = zeros<T>({2}, Device::cpu(0)).requires_grad_();
  auto b = zeros<double>({2, 2}, Device::cpu(1)).requires_grad_();  // another (virtual) device and dtype
  a.set_grad(from_vector<T>({3, 4}));
  b.set_grad(from_vector<double>({1, 3, 2, 4}, Shape{2, 2}, Device::cpu(1)));
  std::vector<AnyTensor> ps{a, b};
  const double norm = std::sqrt(9.0 + 16 + 1 + 4 + 9 + 16);
  auto total = nn::utils::clip_grad_norm_(ps, 1.0);
  EXPECT_EQ(total.tensor().dim(), 0);  // a 0-dim tensor on the first gradient's device
  EXPECT_EQ(total.tensor().device(), Device::cpu(0));
  EXPECT_NEAR(double(total), norm, 1e-12);
  const double coef = 1.0 / (norm + 1e-6);
  EXPECT_TRUE(chorus::testing::values_are(a.grad(), {T(3 * coef), T(4 * coef)}, chorus::testing::tol<T>()));
  EXPECT_TRUE(chorus::testing::values_are(b.grad(), {1 * coef, 3 * coef, 2 * coef, 4 * coef}, 1e-12));
  EXPECT_EQ(b.grad().device(), Device::cpu(1));
  nn::utils::clip_grad_value_(ps, 0.3);
  EXPECT_TRUE(chorus::testing::values_are(b.grad(), {1 * coef, 0.3, 2 * coef, 0.3}, 1e-12));
  EXPECT_EQ(nn::utils::grad_norm({}), 0.0);
  EXPECT_EQ(double(nn::utils::clip_grad_norm_({}, 1.0)), 0.0);
}
