// Forward values of the operations, broadcasting and argument errors.
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>

#include "test_util.hpp"

using namespace chorus;
using chorus::testing::throws_with;
using chorus::testing::values_are;

template <class T>
class OpsTyped : public ::testing::Test {};
TYPED_TEST_SUITE(OpsTyped, chorus::testing::FloatTypes);

TYPED_TEST(OpsTyped, ElementwiseWithBroadcasts) {
  using T = TypeParam;
  auto a = from_vector<T>({1, 2, 3, 4, 5, 6}, {2, 3});
  auto row = from_vector<T>({10, 20, 30});
  auto col = from_vector<T>({1, 2}, {2, 1});
  EXPECT_TRUE(values_are(a + row, {11, 22, 33, 14, 25, 36}));
  EXPECT_TRUE(values_are(a - col, {0, 1, 2, 2, 3, 4}));
  EXPECT_TRUE(values_are(a * scalar_tensor<T>(2), {2, 4, 6, 8, 10, 12}));
  EXPECT_TRUE(values_are(row / a, {10, 10, 10, 2.5, 4, 5}));
  EXPECT_TRUE(values_are(a * 2.0, {2, 4, 6, 8, 10, 12}));
  EXPECT_TRUE(values_are(1.0 - a, {0, -1, -2, -3, -4, -5}));
  EXPECT_TRUE(values_are(6.0 / a, {6, 3, 2, 1.5, 1.2, 1}));
  EXPECT_TRUE(values_are(-a + 1.0, {0, -1, -2, -3, -4, -5}));
  EXPECT_TRUE(values_are(a.t() + col.t(), {2, 6, 3, 7, 4, 8}));  // strided operands
  EXPECT_TRUE(throws_with([&] { (void)(a + from_vector<T>({1, 2})); }, {"add", "[2, 3]", "[2]"}));
}

TYPED_TEST(OpsTyped, Activations) {
  using T = TypeParam;
  auto x = from_vector<T>({-2, -0.5, 0, 0.5, 2});
  std::vector<T> relu_v, gelu_v, tanh_v, sig_v;
  for (auto v : x.to_vector()) {
    relu_v.push_back(v > 0 ? v : 0);
    gelu_v.push_back(T(0.5 * v * (1 + std::erf(v / std::sqrt(2.0)))));
    tanh_v.push_back(std::tanh(v));
    sig_v.push_back(T(1 / (1 + std::exp(-double(v)))));
  }
  EXPECT_TRUE(values_are(relu(x), relu_v));
  EXPECT_TRUE(values_are(gelu(x), gelu_v));
  EXPECT_TRUE(values_are(chorus::tanh(x), tanh_v));
  EXPECT_TRUE(values_are(sigmoid(x), sig_v));
  EXPECT_TRUE(values_are(chorus::exp(from_vector<T>({0, 1})), {1, T(std::exp(1.0))}));
  EXPECT_TRUE(values_are(chorus::log(from_vector<T>({1, 4})), {0, T(std::log(4.0))}));
  EXPECT_TRUE(values_are(chorus::sqrt(from_vector<T>({4, 9})), {2, 3}));
  EXPECT_TRUE(values_are(chorus::pow(from_vector<T>({2, 3}), 3.0), {8, 27}));
}

TYPED_TEST(OpsTyped, Reductions) {
  using T = TypeParam;
  auto x = arange<T>(6).reshape({2, 3});
  EXPECT_EQ(x.sum().item(), T(15));
  EXPECT_EQ(x.sum().shape(), Shape{});
  EXPECT_TRUE(values_are(x.sum(0), {3, 5, 7}));
  EXPECT_TRUE(values_are(x.sum(1), {3, 12}));
  EXPECT_EQ(x.sum(1, true).shape(), (Shape{2, 1}));
  EXPECT_TRUE(values_are(x.mean(0), {1.5, 2.5, 3.5}));
  EXPECT_NEAR(x.mean().item(), 2.5, 1e-6);
  EXPECT_TRUE(values_are(x.t().sum(1), {3, 5, 7}));
  EXPECT_TRUE(values_are(zeros<T>({0, 3}).sum(0), {0, 0, 0}));
  EXPECT_TRUE(std::isnan(zeros<T>({0}).mean().item()));
  EXPECT_THROW(x.sum(2), Error);
}

TYPED_TEST(OpsTyped, SoftmaxAndLogSoftmaxAreStable) {
  using T = TypeParam;
  auto x = from_vector<T>({1000, 1001, 1002, -5, 0, 5}, {2, 3});
  auto s = softmax(x, 1).to_vector();
  const double e1 = std::exp(-1.0), e2 = std::exp(-2.0), z = 1 + e1 + e2;
  EXPECT_NEAR(s[2], 1 / z, 1e-6);
  EXPECT_NEAR(s[1], e1 / z, 1e-6);
  auto ls = log_softmax(x, 1).to_vector();
  EXPECT_NEAR(ls[0], -2 - std::log(z), 1e-4);
  auto s0 = softmax(x, 0);  // along the other dimension
  EXPECT_TRUE(values_are(s0.sum(0), {1, 1, 1}));
}

TYPED_TEST(OpsTyped, MatmulAndLinear) {
  using T = TypeParam;
  auto a = from_vector<T>({1, 2, 3, 4, 5, 6}, {2, 3});
  auto b = from_vector<T>({1, 0, 0, 1, 1, 1}, {3, 2});
  EXPECT_TRUE(values_are(matmul(a, b), {4, 5, 10, 11}));
  EXPECT_TRUE(values_are(a.matmul(a.t()), {14, 32, 32, 77}));  // transposed operand without a copy
  EXPECT_TRUE(values_are(a.t().contiguous().t().matmul(b), {4, 5, 10, 11}));
  auto a3 = stack<T>({a, a}, 0);
  EXPECT_EQ(matmul(a3, b).shape(), (Shape{2, 2, 2}));
  EXPECT_TRUE(values_are(matmul(a3, stack<T>({b, b}, 0)), {4, 5, 10, 11, 4, 5, 10, 11}));
  EXPECT_TRUE(throws_with([&] { matmul(a, a); }, {"[2, 3]", "cannot be multiplied"}));
  auto w = from_vector<T>({1, 1, 1, 0, 1, 0}, {2, 3});
  auto bias = from_vector<T>({100, 200});
  EXPECT_TRUE(values_are(linear(a, w, bias), {106, 202, 115, 205}));
  EXPECT_TRUE(values_are(linear(a, w), {6, 2, 15, 5}));
  EXPECT_EQ(linear(stack<T>({a, a}, 0), w, bias).shape(), (Shape{2, 2, 2}));
  EXPECT_TRUE(values_are(linear(zeros<T>({0, 3}), w, bias), {}));
  EXPECT_TRUE(throws_with([&] { linear(b, w, bias); }, {"[3, 2]", "[2, 3]"}));
}

TYPED_TEST(OpsTyped, Losses) {
  using T = TypeParam;
  namespace F = nn::functional;
  auto p = from_vector<T>({1, 2, 3, 4});
  auto t = from_vector<T>({1, 0, 3, 0});
  EXPECT_NEAR(F::mse_loss(p, t).item(), 5.0, 1e-6);
  EXPECT_NEAR(F::mse_loss(p, t, Reduction::Sum).item(), 20.0, 1e-6);
  EXPECT_TRUE(values_are(F::mse_loss(p, t, Reduction::None), {0, 4, 0, 16}));
  EXPECT_TRUE(throws_with([&] { F::mse_loss(p, zeros<T>({2, 2})); }, {"[4]", "[2, 2]"}));

  auto logits = from_vector<T>({1, 2, 3, 1, 1, 1}, {2, 3});
  auto target = from_vector<std::int64_t>({2, 0});
  const double l0 = -std::log(std::exp(3.0) / (std::exp(1.0) + std::exp(2.0) + std::exp(3.0)));
  const double l1 = std::log(3.0);
  EXPECT_NEAR(F::cross_entropy(logits, target).item(), (l0 + l1) / 2, 1e-6);
  EXPECT_NEAR(F::cross_entropy(logits, target, Reduction::Sum).item(), l0 + l1, 1e-6);
  EXPECT_TRUE(values_are(F::cross_entropy(logits, target, Reduction::None), {T(l0), T(l1)}));
  EXPECT_NEAR(F::cross_entropy(logits, from_vector<std::int64_t>({2, -100})).item(), l0, 1e-6);
  EXPECT_NEAR(F::nll_loss(log_softmax(logits, 1), target).item(), (l0 + l1) / 2, 1e-6);
  EXPECT_TRUE(throws_with([&] { F::cross_entropy(logits, from_vector<std::int64_t>({2, 3})); },
                          {"target 3", "index 1", "3 classes"}));
  EXPECT_TRUE(throws_with([&] { F::cross_entropy(logits, from_vector<std::int64_t>({2})); }, {"[1]", "[2, 3]"}));
}

TYPED_TEST(OpsTyped, DropoutScalesAndIsIdentityInEval) {
  using T = TypeParam;
  auto x = ones<T>({10000});
  auto y = dropout(x, 0.25, true).to_vector();
  int zeros_n = 0;
  for (auto v : y) {
    if (v == 0) ++zeros_n;
    else EXPECT_NEAR(v, 1 / 0.75, 1e-6);
  }
  EXPECT_NEAR(zeros_n / 10000.0, 0.25, 0.03);
  EXPECT_TRUE(is_same(dropout(x, 0.25, false), x));
  EXPECT_TRUE(values_are(dropout(x.narrow(0, 0, 3), 1.0, true), {0, 0, 0}));
  EXPECT_THROW(dropout(x, 1.5, true), Error);
}

// Note [vectorizable math]: the CPU loops' float exp, sigmoid and tanh against the double
// functions, in ulps of the float result, over 2^22 samples of [-20, 20] (a quarter scaled
// down by 10^3, an eighth by 2^-k to reach tiny arguments), plus the special values.
TEST(VectorizableMath, FloatExpSigmoidTanhWithinThreeUlps) {
  namespace vm = chorus::backend::cpu::vmath;
  const auto ulps = [](float got, double want) {
    if (want == 0) return got == 0 ? 0.0 : 1e30;
    int e = 0;
    std::frexp(want, &e);
    return std::fabs(got - want) / std::ldexp(1.0, e - 24);
  };
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> dist(-20.0f, 20.0f);
  double worst_exp = 0, worst_sigmoid = 0, worst_tanh = 0;
  for (int i = 0; i < (1 << 22); ++i) {
    float x = dist(gen);
    if (i % 4 == 0) x *= 1e-3f;
    if (i % 8 == 1) x = std::ldexp(x, -(i % 60));
    const double xd = x;
    worst_exp = std::max(worst_exp, ulps(vm::exp(x), std::exp(xd)));
    worst_sigmoid = std::max(worst_sigmoid, ulps(vm::sigmoid(x), 1.0 / (1.0 + std::exp(-xd))));
    worst_tanh = std::max(worst_tanh, ulps(vm::tanh(x), std::tanh(xd)));
  }
  EXPECT_LE(worst_exp, 2.0);
  EXPECT_LE(worst_sigmoid, 3.0);
  EXPECT_LE(worst_tanh, 3.0);
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(vm::exp(-inf), 0.0f);
  EXPECT_EQ(vm::exp(-87.4f), 0.0f);  // below 1.22e-38: flushed
  EXPECT_FLOAT_EQ(vm::exp(-87.2f), std::exp(-87.2f));
  EXPECT_FLOAT_EQ(vm::exp(88.7f), std::exp(88.7f));
  EXPECT_EQ(vm::exp(88.8f), inf);
  EXPECT_EQ(vm::exp(inf), inf);
  EXPECT_TRUE(std::isnan(vm::exp(nan)) && std::isnan(vm::sigmoid(nan)) && std::isnan(vm::tanh(nan)));
  EXPECT_EQ(vm::sigmoid(inf), 1.0f);
  EXPECT_EQ(vm::sigmoid(-inf), 0.0f);
  EXPECT_EQ(vm::tanh(inf), 1.0f);
  EXPECT_EQ(vm::tanh(-inf), -1.0f);
  EXPECT_TRUE(std::signbit(vm::tanh(-0.0f)));
  EXPECT_EQ(vm::tanh(1e-30f), 1e-30f);
  EXPECT_EQ(vm::exp(1.0), std::exp(1.0));  // double: the standard function
}

// ---- in-place arithmetic (Note [in-place arithmetic]) ----

/// The bits of every element of `a` equal those of `b` (NaN payloads included).
template <class T>
::testing::AssertionResult same_bits(const Tensor<T>& a, const Tensor<T>& b) {
  if (a.shape() != b.shape()) return ::testing::AssertionFailure() << a.shape() << " vs " << b.shape();
  auto x = a.to_vector(), y = b.to_vector();
  for (std::size_t i = 0; i < x.size(); ++i)
    if (std::memcmp(&x[i], &y[i], sizeof(T)) != 0)
      return ::testing::AssertionFailure() << "element " << i << ": " << x[i] << " vs " << y[i];
  return ::testing::AssertionSuccess();
}

template <class T>
class InPlaceTyped : public ::testing::Test {};
using InPlaceTypes = ::testing::Types<float, double, bfloat16>;
TYPED_TEST_SUITE(InPlaceTyped, InPlaceTypes);

// x op= y leaves x equal, bit for bit, to x op y: tensor and scalar operands, broadcasts, the
// compound assignments, and a strided (transposed) x whose base sees the writes.
TYPED_TEST(InPlaceTyped, EqualsTheOutOfPlaceFormBitForBit) {
  using T = TypeParam;
  manual_seed(11);
  const auto x = randn<T>({4, 6}), y = randn<T>({4, 6}), row = randn<T>({6}), col = randn<T>({4, 1});
  auto check = [&](auto&& inplace, const Tensor<T>& expected) {
    auto z = x.clone();
    Tensor<T>& r = inplace(z);
    EXPECT_TRUE(is_same(r, z));  // returns the tensor written
    EXPECT_TRUE(same_bits(z, expected));
  };
  check([&](Tensor<T>& z) -> Tensor<T>& { return z.add_(y); }, x + y);
  check([&](Tensor<T>& z) -> Tensor<T>& { return z.sub_(row); }, x - row);
  check([&](Tensor<T>& z) -> Tensor<T>& { return z.mul_(col); }, x * col);
  check([&](Tensor<T>& z) -> Tensor<T>& { return z.div_(y); }, x / y);
  check([&](Tensor<T>& z) -> Tensor<T>& { return z += row; }, x + row);
  check([&](Tensor<T>& z) -> Tensor<T>& { return z -= y; }, x - y);
  check([&](Tensor<T>& z) -> Tensor<T>& { return z *= y; }, x * y);
  check([&](Tensor<T>& z) -> Tensor<T>& { return z /= col; }, x / col);
  check([&](Tensor<T>& z) -> Tensor<T>& { return z.add_(0.3); }, x + 0.3);
  check([&](Tensor<T>& z) -> Tensor<T>& { return z.sub_(0.3); }, x - 0.3);
  check([&](Tensor<T>& z) -> Tensor<T>& { return z.mul_(0.3); }, x * 0.3);
  check([&](Tensor<T>& z) -> Tensor<T>& { return z.div_(0.3); }, x / 0.3);
  check([&](Tensor<T>& z) -> Tensor<T>& { return z /= 3; }, x / 3.0);
  check([&](Tensor<T>& z) -> Tensor<T>& { return z.add_(x); }, x + x);  // the operand is x itself

  // add_(y, alpha) and sub_(y, alpha): x + alpha*y in opmath, rounded to T once.
  using O = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const double alpha = -0.37;
  std::vector<T> e_add, e_sub;
  const auto xv = x.to_vector(), rv = row.to_vector();
  for (std::size_t i = 0; i < xv.size(); ++i) {
    const O a = O(xv[i]), b = O(rv[i % 6]);
    e_add.push_back(T(a + O(alpha) * b));
    e_sub.push_back(T(a + O(-alpha) * b));
  }
  check([&](Tensor<T>& z) -> Tensor<T>& { return z.add_(row, alpha); }, from_vector<T>(e_add, {4, 6}));
  check([&](Tensor<T>& z) -> Tensor<T>& { return z.sub_(row, alpha); }, from_vector<T>(e_sub, {4, 6}));

  // A strided x: written through its strides, so the base holds the transposed result.
  auto base = x.clone();
  auto xt = base.t();  // [6, 4], not contiguous
  xt.mul_(row.reshape({6, 1}));
  EXPECT_TRUE(same_bits(base, x * row));
  xt += 1.0;
  EXPECT_TRUE(same_bits(base, x * row + 1.0));
  base[1] *= 2.0;  // a row view of a temporary handle writes into base
  auto expected = x * row + 1.0;
  expected = cat(std::vector<Tensor<T>>{expected.narrow(0, 0, 1), expected.narrow(0, 1, 1) * 2.0,
                                        expected.narrow(0, 2, 2)}, 0);
  EXPECT_TRUE(same_bits(base, expected));
}

TEST(InPlace, IntegerTensors) {
  auto x = from_vector<std::int64_t>({1, 2, 3, 4, 5, 6}, {2, 3});
  x.add_(from_vector<std::int64_t>({10, 20, 30}));
  x -= from_vector<std::int64_t>({1, 2}, {2, 1});
  x *= 2;
  x.add_(1);
  EXPECT_EQ(x.to_vector(), (std::vector<std::int64_t>{21, 43, 65, 25, 47, 69}));
  EXPECT_TRUE(throws_with([&] { x.add_(x, 2); }, {"add_", "alpha must be 1", "integer"}));
  EXPECT_EQ(x.to_vector()[0], 21);  // refused: nothing written
  // A scalar that is not a whole number would be truncated (PyTorch promotes to float instead):
  // refused, in place and out of place, with nothing written.
  EXPECT_TRUE(throws_with([&] { x *= 0.5; }, {"mul_", "int64", "0.5", "not a whole number", "to<float>"}));
  EXPECT_TRUE(throws_with([&] { (void)(x * 0.5); }, {"mul", "0.5"}));
  EXPECT_TRUE(throws_with([&] { (void)(x / 2.0); }, {"mul", "0.5"}));
  EXPECT_TRUE(throws_with([&] { (void)(x + 0.25); }, {"add", "0.25"}));
  EXPECT_TRUE(throws_with([&] { x.sub_(1.5); }, {"sub_", "1.5"}));
  EXPECT_TRUE(throws_with([&] { x.add_(std::nan("")); }, {"add_", "nan"}));
  EXPECT_EQ(x.to_vector()[0], 21);
  EXPECT_EQ((x * 3.0).to_vector()[0], 63);  // whole numbers are fine
}

// An expanded view has several elements at one address: a write to it is refused, as PyTorch's
// "more than one element of the written-to tensor refers to a single memory location".
TEST(InPlace, AnExpandedViewCannotBeWritten) {
  auto base = from_vector<float>({1});
  auto e = base.expand({4});
  for (auto write : std::vector<std::function<void()>>{[&] { e.add_(from_vector<float>({1, 2, 3, 4})); },
                                                       [&] { e.mul_(2.0); }, [&] { e.fill_(3); },
                                                       [&] { e.copy_(zeros<float>({4})); }})
    EXPECT_TRUE(throws_with(write, {"more than one element", "single memory location", "stride 0"}));
  EXPECT_TRUE(values_are(base, {1}));
  auto one = base.expand({1, 1});  // a new dimension of size 1: stride 0 is harmless there
  EXPECT_NO_THROW(one.add_(1.0));
  EXPECT_TRUE(values_are(base, {2}));
}

// An operand sharing x's storage is read whole before the first element is written.
TEST(InPlace, AnOverlappingOperandIsReadBeforeAnyWrite) {
  auto m = from_vector<double>({1, 2, 3, 4}, {2, 2});
  m.add_(m[0]);  // row 0 broadcast over m, row 0 included
  EXPECT_TRUE(values_are(m, {2, 4, 4, 6}));
  auto v = from_vector<double>({1, 2, 3, 4});
  v.narrow(0, 1, 3).add_(v.narrow(0, 0, 3));  // a shifted slice of itself
  EXPECT_TRUE(values_are(v, {1, 3, 5, 7}));
  v.narrow(0, 0, 3).mul_(v.narrow(0, 1, 3));
  EXPECT_TRUE(values_are(v, {3, 15, 35, 7}));
  m.mul_(m);  // the same elements: each reads only itself
  EXPECT_TRUE(values_are(m, {4, 16, 16, 36}));
}

// Autograd records no in-place operation: refused where it would have to, with nothing
// written; allowed under NoGradGuard and on detach(), where a graph that saved the tensor is
// refused at backward.
TEST(InPlace, AutogradRefusesWhatItWouldHaveToRecord) {
  auto w = from_vector<double>({1, 2, 3}).requires_grad_();
  auto c = from_vector<double>({1, 1, 1});
  EXPECT_TRUE(throws_with([&] { w.add_(c); }, {"add_", "leaf", "NoGradGuard"}));
  EXPECT_TRUE(throws_with([&] { w *= 2.0; }, {"mul_", "leaf"}));
  EXPECT_TRUE(throws_with([&] { c.add_(w); }, {"add_", "other operand requires grad"}));
  auto h = w * 2.0;
  EXPECT_TRUE(throws_with([&] { h.sub_(1.0); }, {"sub_", "autograd"}));
  EXPECT_TRUE(values_are(w, {1, 2, 3}));
  EXPECT_TRUE(values_are(c, {1, 1, 1}));
  EXPECT_TRUE(values_are(h, {2, 4, 6}));
  {
    NoGradGuard g;
    w.add_(c, -0.5);  // a manual SGD step
    c.add_(w);
  }
  EXPECT_TRUE(values_are(w, {0.5, 1.5, 2.5}));
  EXPECT_TRUE(values_are(c, {1.5, 2.5, 3.5}));
  EXPECT_TRUE(w.requires_grad() && w.is_leaf());

  auto y = (w * w).sum();  // saves w
  w.detach().mul_(2.0);    // writes w's storage: the saved w is stale
  EXPECT_TRUE(values_are(w, {1, 3, 5}));
  EXPECT_TRUE(throws_with([&] { y.backward(); }, {"modified by an inplace operation", "saved by MulBackward"}));
}

TEST(InPlace, ShapesThatCannotBeWrittenAreErrors) {
  auto x = zeros<float>({3});
  EXPECT_TRUE(throws_with([&] { x.add_(ones<float>({2, 3})); }, {"add_", "[2, 3]", "cannot be written", "[3]"}));
  EXPECT_TRUE(throws_with([&] { x.mul_(ones<float>({4})); }, {"mul_", "[3]", "[4]"}));
  EXPECT_TRUE(throws_with([&] { x.div_(Tensor<float>()); }, {"div_", "undefined"}));
  EXPECT_TRUE(throws_with([&] { Tensor<float>().add_(1.0); }, {"add_", "undefined"}));
  EXPECT_TRUE(values_are(x, {0, 0, 0}));
}
