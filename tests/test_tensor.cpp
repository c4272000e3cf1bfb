// Tensor<T>: shapes, factories, views, copies between devices, printing, errors.
#include <sstream>

#include "test_util.hpp"

using namespace chorus;
using chorus::testing::throws_with;
using chorus::testing::values_are;

template <class T>
class TensorTyped : public ::testing::Test {};
TYPED_TEST_SUITE(TensorTyped, chorus::testing::FloatTypes);

TEST(Shape, PrintsLikeTheTutorial) {
  std::ostringstream os;
  os << Shape{30, 5};
  EXPECT_EQ(os.str(), "[30, 5]");
  EXPECT_EQ(Shape{}.str(), "[]");
  EXPECT_EQ(numel_of(Shape{3, 0, 2}), 0);
  EXPECT_EQ(numel_of(Shape{}), 1);
}

TEST(Shape, BroadcastRulesAndErrorNamesBothShapes) {
  EXPECT_EQ(broadcast_shapes(Shape{30, 5}, Shape{5}), (Shape{30, 5}));
  EXPECT_EQ(broadcast_shapes(Shape{3, 1}, Shape{1, 4}), (Shape{3, 4}));
  EXPECT_TRUE(throws_with([] { broadcast_shapes(Shape{30, 5}, Shape{4}); }, {"[30, 5]", "[4]"}));
  EXPECT_THROW(Shape::filled(9, 1), Error);
}

TEST(Device, ParsesAndPrints) {
  EXPECT_EQ(Device::parse("cpu:3"), Device::cpu(3));
  EXPECT_EQ(Device::parse("cuda"), Device::cuda(0));
  EXPECT_EQ(Device::cuda(2).str(), "cuda:2");
  EXPECT_TRUE(throws_with([] { Device::parse("tpu:0"); }, {"tpu:0"}));
  EXPECT_THROW(Device::parse("cpu:x"), Error);
}

TYPED_TEST(TensorTyped, Factories) {
  using T = TypeParam;
  EXPECT_TRUE(values_are(zeros<T>({2, 2}), {0, 0, 0, 0}));
  EXPECT_TRUE(values_are(ones<T>({3}), {1, 1, 1}));
  EXPECT_TRUE(values_are(full<T>({2}, T(2.5)), {2.5, 2.5}));
  EXPECT_TRUE(values_are(arange<T>(0, 5, 2), {0, 2, 4}));
  EXPECT_TRUE(values_are(arange<T>(3), {0, 1, 2}));
  auto v = from_vector<T>({1, 2, 3, 4, 5, 6}, {2, 3});
  EXPECT_EQ(v.shape(), (Shape{2, 3}));
  EXPECT_EQ(v.strides(), (Strides{3, 1}));
  EXPECT_TRUE(v.is_contiguous());
  EXPECT_EQ(scalar_tensor<T>(T(7)).item(), T(7));
  EXPECT_TRUE(throws_with([] { from_vector<T>({1, 2, 3}, {2, 2}); }, {"[2, 2]"}));
}

TYPED_TEST(TensorTyped, RandomIsSeedableAndDeviceIndependent) {
  using T = TypeParam;
  set_cpu_device_count(2);
  manual_seed(7);
  auto a = randn<T>({100});
  manual_seed(7);
  auto b = randn<T>({100}, Device::cpu(1));
  EXPECT_TRUE(values_are(a, b.to_vector(), 0));
  auto u = rand<T>({1000}).to_vector();
  for (auto x : u) EXPECT_TRUE(x >= 0 && x < 1);
  double mean = 0;
  for (auto x : a.to_vector()) mean += x;
  EXPECT_LT(std::abs(mean / 100), 0.35);
  Generator g1(3), g2(3);
  EXPECT_TRUE(values_are(rand<T>({5}, Device::cpu(), 0, 1, g1), rand<T>({5}, Device::cpu(), 0, 1, g2).to_vector(), 0));
}

TYPED_TEST(TensorTyped, NarrowAndSliceAreViewsAlongDim0) {
  using T = TypeParam;
  auto x = arange<T>(12).reshape({4, 3});
  auto n = x.narrow(0, 1, 2);
  EXPECT_EQ(n.shape(), (Shape{2, 3}));
  EXPECT_TRUE(n.same_storage(x));
  EXPECT_EQ(n.storage_offset(), 3);
  EXPECT_TRUE(n.is_contiguous());
  EXPECT_TRUE(values_are(n, {3, 4, 5, 6, 7, 8}));
  EXPECT_TRUE(values_are(x.slice(0, 2, 100), {6, 7, 8, 9, 10, 11}));
  EXPECT_TRUE(values_are(x.slice(0, -1, 4), {9, 10, 11}));
  EXPECT_TRUE(values_are(x.select(0, 1), {3, 4, 5}));
  EXPECT_TRUE(values_are(x.narrow(1, 1, 1), {1, 4, 7, 10}));
  EXPECT_FALSE(x.narrow(1, 1, 1).is_contiguous());
  EXPECT_TRUE(throws_with([&] { x.narrow(0, 3, 2); }, {"[3, 5)", "size 4"}));
  EXPECT_THROW(x.select(0, 4), Error);
  EXPECT_THROW(x.narrow(2, 0, 1), Error);
}

TYPED_TEST(TensorTyped, ReshapeTransposeContiguous) {
  using T = TypeParam;
  auto x = arange<T>(6).reshape({2, 3});
  auto t = x.t();
  EXPECT_EQ(t.shape(), (Shape{3, 2}));
  EXPECT_FALSE(t.is_contiguous());
  EXPECT_TRUE(values_are(t.contiguous(), {0, 3, 1, 4, 2, 5}));
  EXPECT_TRUE(values_are(t.reshape({6}), {0, 3, 1, 4, 2, 5}));
  EXPECT_TRUE(throws_with([&] { t.view({6}); }, {"not contiguous"}));
  EXPECT_EQ(x.reshape({-1, 2}).shape(), (Shape{3, 2}));
  EXPECT_EQ(x.unsqueeze(0).shape(), (Shape{1, 2, 3}));
  EXPECT_EQ(x.unsqueeze(-1).shape(), (Shape{2, 3, 1}));
  EXPECT_EQ(x.unsqueeze(0).squeeze(0).shape(), (Shape{2, 3}));
  EXPECT_EQ(zeros<T>({2, 3, 4}).flatten(1).shape(), (Shape{2, 12}));
  EXPECT_TRUE(throws_with([&] { x.reshape({4, 2}); }, {"[4, 2]", "[2, 3]"}));
  auto c = x.clone();
  EXPECT_FALSE(c.same_storage(x));
}

TYPED_TEST(TensorTyped, IndexSelectCatStackChunk) {
  using T = TypeParam;
  auto x = arange<T>(12).reshape({4, 3});
  auto idx = from_vector<std::int64_t>({3, 0, 3});
  auto s = x.index_select(0, idx);
  EXPECT_FALSE(s.same_storage(x));
  EXPECT_TRUE(values_are(s, {9, 10, 11, 0, 1, 2, 9, 10, 11}));
  EXPECT_TRUE(values_are(x.index_select(1, from_vector<std::int64_t>({2})), {2, 5, 8, 11}));
  EXPECT_TRUE(throws_with([&] { x.index_select(0, from_vector<std::int64_t>({4})); }, {"index 4", "size 4"}));
  auto c = cat<T>({x.narrow(0, 0, 1), x.narrow(0, 3, 1)}, 0);
  EXPECT_TRUE(values_are(c, {0, 1, 2, 9, 10, 11}));
  auto c1 = cat<T>({x, x}, 1);
  EXPECT_EQ(c1.shape(), (Shape{4, 6}));
  EXPECT_TRUE(values_are(c1.select(0, 1), {3, 4, 5, 3, 4, 5}));
  EXPECT_TRUE(throws_with([&] { cat<T>({x, zeros<T>({2, 2})}, 0); }, {"[2, 2]", "[4, 3]"}));
  auto st = stack<T>({ones<T>({2}), zeros<T>({2})}, 0);
  EXPECT_EQ(st.shape(), (Shape{2, 2}));
  EXPECT_TRUE(values_are(st, {1, 1, 0, 0}));
  EXPECT_EQ(stack<T>({ones<T>({2}), zeros<T>({2})}, 1).shape(), (Shape{2, 2}));
  // torch.chunk semantics: 10 rows in 3 chunks -> 4, 4, 2; 10 rows in 8 chunks -> 5 chunks of 2.
  auto ch = chunk(zeros<T>({10, 5}), 3);
  ASSERT_EQ(ch.size(), 3u);
  EXPECT_EQ(ch[2].shape(), (Shape{2, 5}));
  EXPECT_EQ(chunk(zeros<T>({10, 5}), 8).size(), 5u);
  EXPECT_EQ(chunk(zeros<T>({30, 5}), 8).back().shape(), (Shape{2, 5}));
}

TYPED_TEST(TensorTyped, CopiesBetweenVirtualDevicesAreRealCopies) {
  using T = TypeParam;
  set_cpu_device_count(3);
  auto before = memory_stats(Device::cpu(2)).allocated;
  auto x = arange<T>(6).reshape({2, 3});
  auto y = x.to(Device::cpu(2));
  EXPECT_EQ(y.device(), Device::cpu(2));
  EXPECT_FALSE(y.same_storage(x));
  EXPECT_EQ(memory_stats(Device::cpu(2)).allocated, before + 6 * static_cast<std::int64_t>(sizeof(T)));
  EXPECT_TRUE(values_are(y, x.to_vector(), 0));
  {
    NoGradGuard g;
    x.fill_(T(1));
  }
  EXPECT_TRUE(values_are(y, {0, 1, 2, 3, 4, 5}, 0));
  auto back = y.t().to(Device::cpu(0));  // non-contiguous source
  EXPECT_TRUE(values_are(back, {0, 3, 1, 4, 2, 5}, 0));
  EXPECT_TRUE(throws_with([&] { x.to(Device::cpu(7)); }, {"cpu:7", "3 virtual CPU devices"}));
  EXPECT_TRUE(throws_with([&] { (void)(x + y); }, {"cpu:0", "cpu:2"}));
  y = Tensor<T>();
  EXPECT_EQ(memory_stats(Device::cpu(2)).allocated, before);
}

TYPED_TEST(TensorTyped, DtypeConversionAndItem) {
  using T = TypeParam;
  auto x = from_vector<T>({1.5, -2.25});
  auto i = x.template to<std::int64_t>();
  EXPECT_EQ(i.to_vector(), (std::vector<std::int64_t>{1, -2}));
  EXPECT_TRUE(throws_with([&] { x.item(); }, {"2 elements"}));
  EXPECT_EQ(x.narrow(0, 1, 1).item(), T(-2.25));
}

TEST(Tensor, PrintsValuesShapeAndDevice) {
  std::ostringstream os;
  os << from_vector<float>({1, 2, 3, 4}, {2, 2});
  EXPECT_EQ(os.str(), "tensor([[1, 2],\n        [3, 4]], shape=[2, 2], dtype=float32, device=cpu:0)");
  std::ostringstream big;
  big << zeros<float>({100, 100});
  EXPECT_NE(big.str().find("..."), std::string::npos);
}

TEST(Tensor, UndefinedTensorErrors) {
  Tensor<float> t;
  EXPECT_FALSE(t.defined());
  EXPECT_TRUE(throws_with([&] { (void)t.shape(); }, {"undefined"}));
}

TEST(Tensor, InPlaceOnLeafRequiringGradIsRefused) {
  auto w = ones<float>({2}).requires_grad_();
  EXPECT_TRUE(throws_with([&] { w.fill_(0); }, {"leaf", "NoGradGuard"}));
  NoGradGuard g;
  w.fill_(3);
  EXPECT_TRUE(values_are(w, {3, 3}));
}

// Issue 10, item 17: a loop over parameters() reads as it does in PyTorch.
TEST(AnyTensor, HasTheDtypeIndependentHalfOfTensorsInterface) {
  nn::Linear fc(5, 2);
  auto loss = fc(ones<float>({3, 5})).sum();
  loss.backward();
  std::int64_t total = 0;
  for (auto& p : fc->parameters()) {
    total += p.numel();
    EXPECT_EQ(p.device(), Device::cpu(0));
    EXPECT_EQ(p.dtype(), DType::Float32);
    EXPECT_TRUE(p.requires_grad());
    EXPECT_TRUE(p.is_leaf());
    AnyTensor g = p.grad();
    ASSERT_TRUE(g.defined());
    EXPECT_EQ(g.shape(), p.shape());
    EXPECT_EQ(g.dtype(), DType::Float32);
    EXPECT_TRUE(is_same(g.as<float>(), p.as<float>().grad()));
  }
  EXPECT_EQ(total, 5 * 2 + 2);
  AnyTensor w = fc->weight;
  EXPECT_EQ(w.dim(), 2);
  EXPECT_EQ(w.size(0), 2);
  EXPECT_EQ(w.size(-1), 5);
  // The weight's gradient is 3 (three rows of ones) everywhere.
  EXPECT_TRUE(values_are(w.grad().as<float>(), std::vector<float>(10, 3.0f)));
  w.set_grad(AnyTensor());  // clears, like zero_grad(set_to_none)
  EXPECT_FALSE(w.grad().defined());
  w.set_grad(AnyTensor(zeros<float>({2, 5})));
  EXPECT_TRUE(values_are(fc->weight.grad(), std::vector<float>(10, 0.0f)));
  EXPECT_TRUE(throws_with([&] { w.set_grad(AnyTensor(zeros<double>({2, 5}))); }, {"float64", "float32"}));
  AnyTensor i = arange<std::int64_t>(0, 3);
  EXPECT_TRUE(throws_with([&] { i.requires_grad_(); }, {"floating-point"}));
  AnyTensor d = zeros<double>({4});
  EXPECT_TRUE(d.requires_grad_().requires_grad());
  EXPECT_TRUE(throws_with([&] { (void)d.as<float>(); }, {"float64", "not float32"}));
}

// Item 18: t[i] is select(0, i).
TYPED_TEST(TensorTyped, SubscriptSelectsARowOfDim0) {
  using T = TypeParam;
  auto t = arange<T>(0, 12).view({3, 4});
  EXPECT_TRUE(values_are(t[1], std::vector<T>{4, 5, 6, 7}));
  EXPECT_TRUE(values_are(t[-1], std::vector<T>{8, 9, 10, 11}));
  EXPECT_EQ(t[2].shape(), (Shape{4}));
  EXPECT_TRUE(t[0].same_storage(t));  // a view, like select
  EXPECT_EQ(t[1][2].item(), T(6));
  auto x = arange<T>(0, 6).view({2, 3}).requires_grad_();
  (x[1] * T(2)).sum().backward();
  EXPECT_TRUE(values_are(x.grad(), std::vector<T>{0, 0, 0, 2, 2, 2}));
  EXPECT_TRUE(throws_with([&] { (void)t[3]; }, {"3"}));
}
