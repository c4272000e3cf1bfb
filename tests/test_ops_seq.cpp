// The operators recurrent networks, attention and Transformers need (issue 18, item 1):
// forward values against references, PyTorch's semantics (broadcasting, negative dims,
// keepdim, NaN, ties), argument errors, and float64 gradient checks.
#include <cmath>
#include <limits>
#include <tuple>

#include "test_util.hpp"

using namespace chorus;
using chorus::testing::gradcheck;
using chorus::testing::throws_with;
using chorus::testing::values_are;
using TL = std::vector<Tensor<double>>;
using I64 = std::vector<std::int64_t>;

namespace {
template <class T = double>
Tensor<T> r(const Shape& s, std::uint64_t seed, double lo = -1, double hi = 1) {
  Generator g(seed);
  return rand<T>(s, Device::cpu(), lo, hi, g);
}
constexpr double kInf = std::numeric_limits<double>::infinity();
const double kNan = std::numeric_limits<double>::quiet_NaN();

::testing::AssertionResult ints_are(const Tensor<std::int64_t>& t, const I64& want) {
  auto v = t.to_vector();
  if (v == want) return ::testing::AssertionSuccess();
  auto out = ::testing::AssertionFailure() << "got [";
  for (auto x : v) out << x << " ";
  return out << "]";
}
}  // namespace

template <class T>
class OpsSeq : public ::testing::Test {};
TYPED_TEST_SUITE(OpsSeq, chorus::testing::FloatTypes);

// ---- matmul / bmm ----

TYPED_TEST(OpsSeq, MatmulVectorsAndMatrices) {
  using T = TypeParam;
  auto v = from_vector<T>({1, 2, 3});
  auto w = from_vector<T>({4, 5, 6});
  auto m = from_vector<T>({1, 0, 0, 1, 1, 1}, {3, 2});   // [3, 2]
  auto mt = from_vector<T>({1, 2, 3, 4, 5, 6}, {2, 3});  // [2, 3]
  auto dot = matmul(v, w);
  EXPECT_EQ(dot.shape(), Shape{});
  EXPECT_EQ(dot.item(), T(32));
  EXPECT_EQ(matmul(v, m).shape(), Shape{2});  // row vector: [3] @ [3, 2] -> [2]
  EXPECT_TRUE(values_are(matmul(v, m), {4, 5}));
  EXPECT_EQ(matmul(mt, v).shape(), Shape{2});  // column vector: [2, 3] @ [3] -> [2]
  EXPECT_TRUE(values_are(matmul(mt, v), {14, 32}));
  auto b3 = stack<T>({mt, mt * 2.0}, 0);  // [2, 2, 3]
  EXPECT_EQ(matmul(b3, v).shape(), (Shape{2, 2}));
  EXPECT_TRUE(values_are(matmul(b3, v), {14, 32, 28, 64}));
  EXPECT_EQ(matmul(v, stack<T>({m, m}, 0)).shape(), (Shape{2, 2}));  // [3] @ [2, 3, 2] -> [2, 2]
  EXPECT_TRUE(values_are(matmul(v, stack<T>({m, m}, 0)), {4, 5, 4, 5}));
}

TYPED_TEST(OpsSeq, MatmulBroadcastsBatchDimensions) {
  using T = TypeParam;
  auto a = r<T>({2, 1, 3, 4}, 1), b = r<T>({3, 4, 5}, 2);
  auto out = matmul(a, b);
  ASSERT_EQ(out.shape(), (Shape{2, 3, 3, 5}));
  for (std::int64_t i = 0; i < 2; ++i)
    for (std::int64_t j = 0; j < 3; ++j)
      EXPECT_TRUE(chorus::testing::all_close(out[i][j], matmul(a[i][0].contiguous(), b[j].contiguous()), 1e-5, 1e-6));
  // A 2-D left operand broadcasts over the right's batch, and permuted (strided) batches read right.
  auto l = r<T>({3, 4}, 3);
  auto o2 = matmul(l, b);
  ASSERT_EQ(o2.shape(), (Shape{3, 3, 5}));
  for (std::int64_t j = 0; j < 3; ++j) EXPECT_TRUE(chorus::testing::all_close(o2[j], matmul(l, b[j].contiguous()), 1e-5, 1e-6));
  auto p = r<T>({4, 3, 5}, 4).permute({1, 0, 2});  // [3, 4, 5], batch stride 5, not contiguous
  auto o3 = matmul(r<T>({3, 2, 4}, 5), p);
  auto o3_ref = matmul(r<T>({3, 2, 4}, 5), p.contiguous());
  EXPECT_TRUE(chorus::testing::all_close(o3, o3_ref, 1e-5, 1e-6));
  auto e = expand(r<T>({1, 4, 5}, 6), {2, 3, 4, 5});  // broadcast batch dims with stride 0
  EXPECT_TRUE(chorus::testing::all_close(matmul(a, e), matmul(a, e.contiguous()), 1e-5, 1e-6));
  // Batch dimensions with no one stride (attention's heads: [N, H, L, d] views of [L, N, 3, H, d]),
  // read in place on the CPU, one GEMM per matrix; the transposed key as well.
  auto qkv = r<T>({5, 2, 3, 4, 6}, 7);  // [L, N, 3, H, d]
  auto q = qkv.select(2, 0).permute({1, 2, 0, 3}), k = qkv.select(2, 1).permute({1, 2, 0, 3});  // [N, H, L, d]
  EXPECT_TRUE(chorus::testing::all_close(matmul(q, k.transpose(-2, -1)),
                                         matmul(q.contiguous(), k.contiguous().transpose(-2, -1).contiguous()), 1e-5,
                                         1e-6));
  EXPECT_TRUE(chorus::testing::all_close(matmul(q.transpose(-2, -1), k),
                                         matmul(q.transpose(-2, -1).contiguous(), k.contiguous()), 1e-5, 1e-6));
  // Empty inner dimension: zeros.
  EXPECT_TRUE(values_are(matmul(zeros<T>({2, 3, 0}), zeros<T>({2, 0, 2})), std::vector<T>(12, T(0))));
}

TYPED_TEST(OpsSeq, BmmAndMatmulErrors) {
  using T = TypeParam;
  auto a = r<T>({2, 3, 4}, 1), b = r<T>({2, 4, 5}, 2);
  EXPECT_TRUE(chorus::testing::all_close(bmm(a, b), matmul(a, b), 1e-6, 1e-7));
  EXPECT_TRUE(chorus::testing::all_close(a.bmm(b)[1], matmul(a[1].contiguous(), b[1].contiguous()), 1e-5, 1e-6));
  EXPECT_TRUE(throws_with([&] { bmm(a, r<T>({3, 4, 5}, 3)); }, {"bmm", "[2, 3, 4]", "[3, 4, 5]"}));
  EXPECT_TRUE(throws_with([&] { bmm(a[0], b); }, {"bmm", "3-D", "[3, 4]"}));
  EXPECT_TRUE(throws_with([&] { matmul(scalar_tensor<T>(1), b); }, {"matmul", "at least 1-D", "0-D"}));
  EXPECT_TRUE(throws_with([&] { matmul(a, a); }, {"matmul", "[2, 3, 4]", "cannot be multiplied"}));
  EXPECT_TRUE(throws_with([&] { matmul(r<T>({2, 3, 4}, 4), r<T>({3, 4, 5}, 5)); }, {"matmul", "broadcast"}));
}

// ---- views ----

TYPED_TEST(OpsSeq, PermuteMovedimTransposeExpandAreViews) {
  using T = TypeParam;
  auto x = arange<T>(24).reshape({2, 3, 4});
  auto p = x.permute({2, 0, 1});
  EXPECT_EQ(p.shape(), (Shape{4, 2, 3}));
  EXPECT_TRUE(p.same_storage(x));
  EXPECT_EQ(p[1][1][2].item(), x[1][2][1].item());
  EXPECT_EQ(permute(x, {-1, 0, 1}).strides(), p.strides());
  auto mv = movedim(x, 0, -1);  // [3, 4, 2]
  EXPECT_EQ(mv.shape(), (Shape{3, 4, 2}));
  EXPECT_EQ(mv[2][3][1].item(), x[1][2][3].item());
  EXPECT_EQ(x.movedim({0, 1}, {2, 0}).shape(), (Shape{3, 4, 2}));
  EXPECT_EQ(swapaxes(x, 0, 2).shape(), (Shape{4, 3, 2}));
  EXPECT_TRUE(transpose(x, -1, 0).same_storage(x));
  auto e = from_vector<T>({1, 2, 3}, {3, 1}).expand({2, -1, 4});
  EXPECT_EQ(e.shape(), (Shape{2, 3, 4}));
  EXPECT_EQ(e.strides(), (Strides{0, 1, 0}));
  EXPECT_TRUE(values_are(e.contiguous()[1][2], {3, 3, 3, 3}));
  EXPECT_EQ(expand_as(scalar_tensor<T>(7), x).shape(), x.shape());
  EXPECT_TRUE(throws_with([&] { x.permute({0, 1}); }, {"permute", "2", "3"}));
  EXPECT_TRUE(throws_with([&] { x.permute({0, 1, 1}); }, {"permute", "dim 1", "multiple times"}));
  EXPECT_TRUE(throws_with([&] { x.permute({0, 1, 3}); }, {"permute", "dim 3", "out of range"}));
  EXPECT_TRUE(throws_with([&] { movedim(x, I64{0, 1}, I64{2}); }, {"movedim", "same number"}));
  EXPECT_TRUE(throws_with([&] { transpose(x, 0, 3); }, {"transpose", "dim 3", "out of range"}));
  EXPECT_TRUE(throws_with([&] { x.expand({2, 5, 4}); }, {"expand", "(5)", "existing size (3)", "dimension 1"}));
  EXPECT_TRUE(throws_with([&] { x.expand({3, 4}); }, {"expand", "number of sizes"}));
  EXPECT_TRUE(throws_with([&] { x.expand({-1, 2, 3, 4}); }, {"expand", "-1", "leading"}));
}

TYPED_TEST(OpsSeq, TrilTriu) {
  using T = TypeParam;
  auto x = arange<T>(1, 10).reshape({3, 3});
  EXPECT_TRUE(values_are(tril(x), {1, 0, 0, 4, 5, 0, 7, 8, 9}));
  EXPECT_TRUE(values_are(triu(x), {1, 2, 3, 0, 5, 6, 0, 0, 9}));
  EXPECT_TRUE(values_are(triu(x, 1), {0, 2, 3, 0, 0, 6, 0, 0, 0}));
  EXPECT_TRUE(values_are(tril(x, -1), {0, 0, 0, 4, 0, 0, 7, 8, 0}));
  EXPECT_TRUE(values_are(x.tril(5), x.to_vector()));
  EXPECT_TRUE(values_are(tril(x.t()), {1, 0, 0, 2, 5, 0, 3, 6, 9}));  // strided input
  auto b = stack<T>({x, x}, 0).narrow(2, 0, 2);  // batched, non-square [2, 3, 2]
  EXPECT_TRUE(values_are(triu(b), {1, 2, 0, 5, 0, 0, 1, 2, 0, 5, 0, 0}));
  // A causal mask: int64 (Note [masks are int64]).
  EXPECT_TRUE(ints_are(triu(ones<std::int64_t>({3, 3}), 1), {0, 1, 1, 0, 0, 1, 0, 0, 0}));
  EXPECT_TRUE(throws_with([&] { tril(from_vector<T>({1, 2})); }, {"tril", "at least 2 dimensions", "[2]"}));
}

// ---- masks ----

TYPED_TEST(OpsSeq, WhereMaskedFillAndComparisons) {
  using T = TypeParam;
  auto a = from_vector<T>({1, 2, 3, 4, 5, 6}, {2, 3});
  auto b = from_vector<T>({-1, -2, -3});
  auto cond = from_vector<std::int64_t>({1, 0}, {2, 1});
  EXPECT_TRUE(values_are(where(cond, a, b), {1, 2, 3, -1, -2, -3}));
  EXPECT_TRUE(values_are(where(cond, a, 0.5), {1, 2, 3, 0.5, 0.5, 0.5}));
  EXPECT_TRUE(values_are(where(from_vector<std::int64_t>({0, 7, 0}), 9.0, a), {1, 9, 3, 4, 9, 6}));
  auto mask = from_vector<std::int64_t>({0, 1, 1});
  const T ninf = T(-kInf);
  EXPECT_TRUE(values_are(masked_fill(a, mask, -kInf), {1, ninf, ninf, 4, ninf, ninf}));
  EXPECT_TRUE(values_are(a.masked_fill(from_vector<std::int64_t>({1, 0}, {2, 1}), 0), {0, 0, 0, 4, 5, 6}));
  EXPECT_EQ(masked_fill(b, cond, 0).shape(), (Shape{2, 3}));  // the mask broadcasts the input, as in PyTorch
  EXPECT_TRUE(values_are(masked_fill(a, mask, scalar_tensor<T>(-1)), {1, -1, -1, 4, -1, -1}));
  EXPECT_TRUE(ints_are(gt(a, T(3)), {0, 0, 0, 1, 1, 1}));
  EXPECT_TRUE(ints_are(eq(a, from_vector<T>({1, 0, 6}, {3})), {1, 0, 0, 0, 0, 1}));
  EXPECT_TRUE(ints_are(le(b, b), {1, 1, 1}));
  EXPECT_TRUE(ints_are(ne(from_vector<T>({T(kNan), 1}), 1.0), {1, 0}));
  EXPECT_TRUE(ints_are(lt(b, a), {1, 1, 1, 1, 1, 1}));
  EXPECT_TRUE(ints_are(ge(a, a.t().contiguous().t()), {1, 1, 1, 1, 1, 1}));
  EXPECT_TRUE(throws_with([&] { where(from_vector<std::int64_t>({1, 0}), a, b); }, {"where", "[2]", "[2, 3]"}));
  EXPECT_TRUE(throws_with([&] { masked_fill(a, from_vector<std::int64_t>({1, 0}), 0); }, {"masked_fill", "[2, 3]"}));
  EXPECT_TRUE(throws_with([&] { masked_fill(a, mask, from_vector<T>({1, 2})); }, {"masked_fill", "0-dimensional"}));
  EXPECT_TRUE(throws_with([&] { eq(a, from_vector<T>({1, 2})); }, {"eq", "[2, 3]", "[2]"}));
}

// ---- selection ----

TYPED_TEST(OpsSeq, MaxMinArgmaxPropagateNanAndPickTheFirstTie) {
  using T = TypeParam;
  auto x = from_vector<T>({3, 1, 3, 2, 5, 5, 0, T(kNan), 4}, {3, 3});
  auto [v, i] = max(x, 1);
  auto vv = v.to_vector();
  EXPECT_EQ(vv[0], T(3));
  EXPECT_EQ(vv[1], T(5));
  EXPECT_TRUE(std::isnan(vv[2]));
  EXPECT_TRUE(ints_are(i, {0, 1, 1}));  // first of the tied 3s and 5s; the NaN
  auto [mv, mi] = x.min(0, true);
  EXPECT_EQ(mv.shape(), (Shape{1, 3}));
  EXPECT_TRUE(ints_are(mi, {2, 2, 0}));  // NaN is the minimum too
  EXPECT_TRUE(std::isnan(mv.to_vector()[1]));
  EXPECT_TRUE(ints_are(argmax(x, -1), {0, 1, 1}));
  EXPECT_TRUE(ints_are(argmin(x, 1, true), {1, 0, 1}));
  EXPECT_EQ(argmin(x, 1, true).shape(), (Shape{3, 1}));
  EXPECT_TRUE(std::isnan(max(x).item()));
  auto y = from_vector<T>({2, 7, 7, -1}, {2, 2});
  EXPECT_EQ(max(y).item(), T(7));
  EXPECT_EQ(y.min().item(), T(-1));
  EXPECT_EQ(argmax(y).item(), 1);  // into the flattened tensor, first tie
  EXPECT_EQ(argmax(y, std::nullopt, true).shape(), (Shape{1, 1}));
  EXPECT_TRUE(values_are(amax(y, {0}), {7, 7}));
  EXPECT_TRUE(values_are(amin(y, {0, 1}, true), {-1}));
  EXPECT_EQ(amin(y, {0, 1}, true).shape(), (Shape{1, 1}));
  EXPECT_TRUE(ints_are(argmax(from_vector<std::int64_t>({4, 9, 9})), {1}));  // integer tensors too
  auto [sv, si] = max(scalar_tensor<T>(4), 0);  // a 0-dim tensor reduces to itself
  EXPECT_EQ(sv.shape(), Shape{});
  EXPECT_EQ(si.item(), 0);
  EXPECT_TRUE(throws_with([&] { max(x, 2); }, {"max", "dim 2", "out of range"}));
  EXPECT_TRUE(throws_with([&] { max(zeros<T>({2, 0}), 1); }, {"max", "dimension 1", "size 0"}));
  EXPECT_TRUE(throws_with([&] { max(zeros<T>({0})); }, {"max", "empty"}));
  EXPECT_TRUE(throws_with([&] { argmin(zeros<T>({0, 3})); }, {"argmin", "empty"}));
  EXPECT_EQ(std::get<0>(max(zeros<T>({0, 3}), 1)).numel(), 0);
}

TYPED_TEST(OpsSeq, Topk) {
  using T = TypeParam;
  auto x = from_vector<T>({1, 5, 3, 5, 2, 9, T(kNan), 0}, {2, 4});
  auto [v, i] = topk(x, 2);
  auto vv = v.to_vector();
  EXPECT_EQ(vv[0], T(5));
  EXPECT_EQ(vv[1], T(5));
  EXPECT_TRUE(std::isnan(vv[2]));  // NaN counts as the largest, as in PyTorch
  EXPECT_EQ(vv[3], T(9));
  EXPECT_TRUE(ints_are(i, {1, 3, 2, 1}));  // ties in index order
  auto [sv, si] = x.topk(3, 1, false);
  EXPECT_TRUE(values_are(sv.narrow(0, 0, 1), {1, 3, 5}));
  EXPECT_TRUE(ints_are(si, {0, 2, 1, 3, 0, 1}));  // smallest: NaN last
  auto [cv, ci] = topk(x, 1, 0);
  EXPECT_EQ(cv.shape(), (Shape{1, 4}));
  EXPECT_TRUE(ints_are(ci, {1, 1, 1, 0}));
  EXPECT_EQ(std::get<0>(topk(x, 0)).shape(), (Shape{2, 0}));
  EXPECT_TRUE(throws_with([&] { topk(x, 5); }, {"topk", "k (5)", "size 4"}));
  EXPECT_TRUE(throws_with([&] { topk(x, -1); }, {"topk", "k (-1)"}));
}

TYPED_TEST(OpsSeq, GatherScatterAddOneHot) {
  using T = TypeParam;
  auto x = from_vector<T>({1, 2, 3, 4, 5, 6}, {2, 3});
  auto idx = from_vector<std::int64_t>({2, 0, 1, 1}, {2, 2});
  EXPECT_TRUE(values_are(gather(x, 1, idx), {3, 1, 5, 5}));
  EXPECT_TRUE(values_are(x.gather(0, from_vector<std::int64_t>({1, 0, 1}, {1, 3})), {4, 2, 6}));
  EXPECT_TRUE(values_are(gather(x.t(), -1, from_vector<std::int64_t>({1, 1, 0}, {3, 1})), {4, 5, 3}));  // strided
  auto z = zeros<T>({2, 3});
  EXPECT_TRUE(values_are(scatter_add(z, 1, idx, from_vector<T>({10, 20, 30, 40}, {2, 2})), {20, 0, 10, 0, 70, 0}));
  auto big_src = arange<T>(1, 7).reshape({2, 3});  // src larger than index: only index's shape is used
  EXPECT_TRUE(values_are(x.scatter_add(0, from_vector<std::int64_t>({1, 1}, {1, 2}), big_src), {1, 2, 3, 5, 7, 6}));
  EXPECT_TRUE(throws_with([&] { gather(x, 1, from_vector<std::int64_t>({0, 3}, {1, 2})); },
                          {"gather", "index 3", "position 1", "dimension 1", "size 3"}));
  EXPECT_TRUE(throws_with([&] { gather(x, 1, from_vector<std::int64_t>({-1}, {1, 1})); }, {"gather", "index -1"}));
  EXPECT_TRUE(throws_with([&] { gather(x, 1, from_vector<std::int64_t>({0, 1})); }, {"gather", "same number", "[2]"}));
  EXPECT_TRUE(throws_with([&] { gather(x, 1, zeros<std::int64_t>({3, 1})); }, {"gather", "[3, 1]", "dimension 0"}));
  EXPECT_TRUE(throws_with([&] { gather(x, 2, idx); }, {"gather", "dim 2"}));
  EXPECT_TRUE(throws_with([&] { scatter_add(z, 0, from_vector<std::int64_t>({2, 0}, {1, 2}), x); },
                          {"scatter_add", "index 2", "dimension 0", "size 2"}));
  EXPECT_TRUE(throws_with([&] { scatter_add(z, 1, zeros<std::int64_t>({2, 2}), zeros<T>({2, 1})); },
                          {"scatter_add", "src", "[2, 1]"}));

  auto labels = from_vector<std::int64_t>({2, 0, 1});
  EXPECT_TRUE(ints_are(one_hot(labels), {0, 0, 1, 1, 0, 0, 0, 1, 0}));
  EXPECT_EQ(one_hot(labels, 5).shape(), (Shape{3, 5}));
  EXPECT_EQ(one_hot(labels.reshape({3, 1}), 4).shape(), (Shape{3, 1, 4}));
  EXPECT_TRUE(values_are(one_hot<T>(labels, 3).sum(0), {1, 1, 1}));
  EXPECT_TRUE(throws_with([&] { one_hot(labels, 2); }, {"one_hot", "class value 2", "position 0", "2 classes"}));
  EXPECT_TRUE(throws_with([&] { one_hot(from_vector<std::int64_t>({-1})); }, {"one_hot", "class value -1"}));
  EXPECT_TRUE(throws_with([&] { one_hot(zeros<std::int64_t>({0})); }, {"one_hot", "empty"}));
  EXPECT_TRUE(throws_with([&] { one_hot(labels, -3); }, {"one_hot", "-3"}));
}

// ---- pointwise ----

TYPED_TEST(OpsSeq, AbsClampSinCos) {
  using T = TypeParam;
  auto x = from_vector<T>({-2, -0.5, 0, 0.5, 2, T(kNan)});
  auto a = chorus::abs(x).to_vector();
  EXPECT_EQ(a[0], T(2));
  EXPECT_EQ(a[2], T(0));
  EXPECT_FALSE(std::signbit(chorus::abs(from_vector<T>({T(-0.0)})).item()));
  EXPECT_TRUE(std::isnan(a[5]));
  auto c = clamp(x, -1.0, 1.0).to_vector();
  EXPECT_EQ(c[0], T(-1));
  EXPECT_EQ(c[1], T(-0.5));
  EXPECT_EQ(c[4], T(1));
  EXPECT_TRUE(std::isnan(c[5]));  // NaN stays NaN
  EXPECT_TRUE(values_are(clamp_min(x.narrow(0, 0, 5), 0.0), {0, 0, 0, 0.5, 2}));
  EXPECT_TRUE(values_are(clamp(x.narrow(0, 0, 5), std::nullopt, 0.0), {-2, -0.5, 0, 0, 0}));
  EXPECT_TRUE(values_are(clamp(x.narrow(0, 0, 5), 1.0, -1.0), {-1, -1, -1, -1, -1}));  // min > max: max
  EXPECT_TRUE(throws_with([&] { clamp(x, std::nullopt, std::nullopt); }, {"clamp", "at least one"}));
  EXPECT_TRUE(values_are(chorus::sin(from_vector<T>({0, T(M_PI / 2)})), {0, 1}));
  EXPECT_TRUE(values_are(chorus::cos(from_vector<T>({0, T(M_PI)})), {1, -1}));
}

// ---- reductions ----

TYPED_TEST(OpsSeq, SumMeanOverSeveralDimsAndCumsum) {
  using T = TypeParam;
  auto x = arange<T>(24).reshape({2, 3, 4});
  EXPECT_TRUE(values_are(sum(x, I64{0, 2}), {60, 92, 124}));
  EXPECT_EQ(x.sum(I64{0, -1}, true).shape(), (Shape{1, 3, 1}));
  EXPECT_TRUE(values_are(mean(x, I64{1, 2}), {5.5, 17.5}));
  EXPECT_EQ(sum(x, I64{0, 1, 2}).shape(), Shape{});
  // Braced lists (Note [braced dim lists]): {} is every dim, never dim 0; {2} is dim 2.
  EXPECT_EQ(sum(x, {}).shape(), Shape{});
  EXPECT_EQ(x.sum({}).item(), T(276));
  EXPECT_EQ(x.mean({}, true).shape(), (Shape{1, 1, 1}));
  EXPECT_TRUE(values_are(x.sum({2}), x.sum(2).to_vector()));
  EXPECT_EQ(chorus::var(x, {}).shape(), Shape{});
  EXPECT_EQ(x.norm(2, {}).shape(), Shape{});
  EXPECT_EQ(logsumexp(x, {}, true).shape(), (Shape{1, 1, 1}));
  EXPECT_EQ(x.std({0, 1}, 0).shape(), (Shape{4}));
  EXPECT_TRUE(throws_with([&] { sum(x, I64{1, -2}); }, {"sum", "multiple times"}));
  auto c = cumsum(from_vector<T>({1, 2, 3, 4, 5, 6}, {2, 3}), 1);
  EXPECT_TRUE(values_are(c, {1, 3, 6, 4, 9, 15}));
  EXPECT_TRUE(values_are(from_vector<T>({1, 2, 3, 4, 5, 6}, {2, 3}).cumsum(0), {1, 2, 3, 5, 7, 9}));
  EXPECT_TRUE(values_are(cumsum(arange<T>(6).reshape({3, 2}).t(), -1), {0, 2, 6, 1, 4, 9}));  // strided
  EXPECT_TRUE(ints_are(cumsum(from_vector<std::int64_t>({1, 0, 1, 1}), 0), {1, 1, 2, 3}));  // positions from a mask
  EXPECT_TRUE(throws_with([&] { cumsum(x, 3); }, {"cumsum", "dim 3"}));
}

TYPED_TEST(OpsSeq, LogsumexpIsStable) {
  using T = TypeParam;
  auto x = from_vector<T>({1000, 1000, T(-kInf), T(-kInf), 0, T(std::log(3.0))}, {3, 2});
  auto l = logsumexp(x, 1).to_vector();
  EXPECT_NEAR(l[0], 1000 + std::log(2.0), 1e-3);
  EXPECT_EQ(l[1], T(-kInf));  // all -inf: -inf, not NaN
  EXPECT_NEAR(l[2], std::log(4.0), 1e-6);
  EXPECT_EQ(x.logsumexp(0, true).shape(), (Shape{1, 2}));
  EXPECT_EQ(logsumexp(from_vector<T>({T(kInf), 0}), 0).item(), T(kInf));
  EXPECT_NEAR(logsumexp(arange<T>(4).reshape({2, 2}), I64{0, 1}).item(), std::log(1 + std::exp(1.0) + std::exp(2.0) + std::exp(3.0)), 1e-5);
}

TYPED_TEST(OpsSeq, VarStdWithCorrection) {
  using T = TypeParam;
  auto x = from_vector<T>({1, 2, 3, 4, 2, 2, 2, 6}, {2, 4});
  EXPECT_TRUE(values_are(var(x, 1), {5.0 / 3, 4}));
  EXPECT_TRUE(values_are(var(x, 1, 0), {1.25, 3}));           // correction 0: population
  EXPECT_TRUE(values_are(var(x, 1, false), {1.25, 3}));       // unbiased = false, the same
  EXPECT_TRUE(values_are(x.var(I64{0}, 1, true), {0.5, 0, 0.5, 2}));
  EXPECT_EQ(x.var(I64{0}, 1, true).shape(), (Shape{1, 4}));
  EXPECT_NEAR(var(x).item(), 2.5, 1e-6);
  EXPECT_NEAR(var(x, false).item(), 2.1875, 1e-6);
  EXPECT_NEAR(x.var(false).item(), 2.1875, 1e-6);
  EXPECT_TRUE(values_are(chorus::std(x, 1, 0), {T(std::sqrt(1.25)), T(std::sqrt(3.0))}));
  EXPECT_NEAR(x.std().item(), std::sqrt(2.5), 1e-6);
  EXPECT_TRUE(std::isinf(var(from_vector<T>({1, 2}), 0, 2).item()));  // N - correction = 0
  EXPECT_TRUE(std::isnan(var(from_vector<T>({1})).item()));           // 0 / 0
}

TYPED_TEST(OpsSeq, Norms) {
  using T = TypeParam;
  auto x = from_vector<T>({3, -4, 0, 1, 0, -2}, {2, 3});
  EXPECT_NEAR(norm(x).item(), std::sqrt(30.0), 1e-5);
  EXPECT_TRUE(values_are(norm(x, 2, 1), {5, T(std::sqrt(5.0))}));
  EXPECT_TRUE(values_are(norm(x, 1, 0), {4, 4, 2}));
  EXPECT_TRUE(values_are(norm(x, kInf, 1, true), {4, 2}));
  EXPECT_EQ(norm(x, kInf, 1, true).shape(), (Shape{2, 1}));
  EXPECT_TRUE(values_are(norm(x, -kInf, 0), {1, 0, 0}));
  EXPECT_TRUE(values_are(norm(x, 0, 1), {2, 2}));
  EXPECT_NEAR(norm(x, 3, I64{0, 1}).item(), std::cbrt(27 + 64 + 1 + 8.0), 1e-5);
  EXPECT_NEAR(x.norm(0.5, 1).to_vector()[0], std::pow(std::sqrt(3.0) + 2, 2), 1e-4);
  EXPECT_EQ(norm(zeros<T>({0, 3}), 2, 0).to_vector(), std::vector<T>(3, T(0)));
  EXPECT_TRUE(throws_with([&] { norm(zeros<T>({2, 0}), kInf, 1); }, {"norm", "size 0"}));
}

// ---- gradients: float64 central differences ----

TEST(OpsSeqGradcheck, MatmulBroadcastingAndBmm) {
  EXPECT_TRUE(gradcheck([](const TL& x) { return matmul(x[0], x[1]); }, {r({3}, 1), r({3}, 2)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return matmul(x[0], x[1]); }, {r({3}, 3), r({3, 2}, 4)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return matmul(x[0], x[1]); }, {r({2, 3}, 5), r({3}, 6)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return matmul(x[0], x[1]); }, {r({2, 2, 3}, 7), r({3}, 8)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return matmul(x[0], x[1]); }, {r({3}, 9), r({2, 3, 2}, 10)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return matmul(x[0], x[1]); }, {r({2, 1, 3, 4}, 11), r({3, 4, 2}, 12)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return matmul(x[0], x[1]); }, {r({3, 4}, 13), r({2, 4, 2}, 14)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return matmul(x[0].permute({1, 0, 2}), x[1]); },
                        {r({3, 2, 4}, 15), r({1, 4, 2}, 16)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return bmm(x[0], x[1].transpose(1, 2)); }, {r({2, 3, 4}, 17), r({2, 5, 4}, 18)}));
  EXPECT_TRUE(gradcheck(  // heads of one [L, N, 2, H, d] projection: batch dimensions with no one stride
      [](const TL& x) {
        auto q = x[0].select(2, 0).permute({1, 2, 0, 3}), k = x[0].select(2, 1).permute({1, 2, 0, 3});
        return matmul(q, k.transpose(-2, -1));
      },
      {r({3, 2, 2, 2, 4}, 19)}));
}

TEST(OpsSeqGradcheck, ViewsAndTriangles) {
  EXPECT_TRUE(gradcheck([](const TL& x) { return x[0].permute({2, 0, 1}) * 2.0; }, {r({2, 3, 4}, 1)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return movedim(x[0], I64{0, 2}, I64{1, 0}); }, {r({2, 3, 4}, 2)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return x[0].expand({2, 3, 4}) * x[1]; }, {r({3, 1}, 3), r({2, 3, 4}, 4)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return tril(x[0], -1); }, {r({2, 3, 3}, 5)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return triu(x[0].t(), 1); }, {r({4, 3}, 6)}));
}

TEST(OpsSeqGradcheck, MasksAndIndexing) {
  auto cond = from_vector<std::int64_t>({1, 0, 0, 1, 1, 0}, {2, 3});
  EXPECT_TRUE(gradcheck([&](const TL& x) { return where(cond, x[0], x[1]); }, {r({2, 3}, 1), r({3}, 2)}));
  EXPECT_TRUE(gradcheck([&](const TL& x) { return where(cond.narrow(0, 0, 1), x[0], x[1]); }, {r({2, 1}, 3), r({2, 3}, 4)}));
  EXPECT_TRUE(gradcheck([&](const TL& x) { return masked_fill(x[0], cond, -5.0); }, {r({2, 3}, 5)}));
  EXPECT_TRUE(gradcheck([&](const TL& x) { return masked_fill(x[0], cond, x[1]); }, {r({2, 3}, 6), r({}, 7)}));
  auto idx = from_vector<std::int64_t>({2, 0, 2, 1, 1, 1}, {2, 3});
  EXPECT_TRUE(gradcheck([&](const TL& x) { return gather(x[0], 1, idx); }, {r({2, 4}, 8)}));
  EXPECT_TRUE(gradcheck([&](const TL& x) { return gather(x[0], 0, idx.narrow(1, 0, 2)); }, {r({3, 2}, 9)}));
  EXPECT_TRUE(gradcheck([&](const TL& x) { return scatter_add(x[0], 1, idx, x[1]); }, {r({2, 3}, 10), r({2, 3}, 11)}));
  EXPECT_TRUE(gradcheck([&](const TL& x) { return scatter_add(x[0], 0, idx.narrow(1, 0, 2), x[1]); },
                        {r({3, 2}, 12), r({2, 4}, 13)}));  // src larger than index
}

TEST(OpsSeqGradcheck, SelectionReductions) {
  EXPECT_TRUE(gradcheck([](const TL& x) { return std::get<0>(max(x[0], 1)); }, {r({3, 4}, 1)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return std::get<0>(x[0].min(0, true)); }, {r({3, 4}, 2)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return max(x[0]); }, {r({3, 4}, 3)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return amin(x[0], {0, 2}); }, {r({2, 3, 2}, 4)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return std::get<0>(topk(x[0], 2, 0)); }, {r({4, 3}, 5)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return std::get<0>(topk(x[0], 3, -1, false)); }, {r({2, 5}, 6)}));
}

TEST(OpsSeqGradcheck, PointwiseAndReductions) {
  EXPECT_TRUE(gradcheck([](const TL& x) { return chorus::abs(x[0]); }, {from_vector<double>({-1, -0.3, 0.2, 0.9})}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return clamp(x[0], -0.5, 0.5); }, {from_vector<double>({-0.9, -0.2, 0.3, 0.8})}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return chorus::sin(x[0]) * chorus::cos(x[0] * 2.0); }, {r({6}, 1, -3, 3)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return cumsum(x[0], 1); }, {r({2, 4, 3}, 2)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return cumsum(x[0].t(), 0); }, {r({3, 5}, 3)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return logsumexp(x[0], 1); }, {r({3, 4}, 4, -3, 3)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return logsumexp(x[0], I64{0, 2}, true); }, {r({2, 3, 2}, 5)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return var(x[0], 1); }, {r({3, 4}, 6)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return var(x[0], I64{0, 1}, 0, true); }, {r({3, 4}, 7)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return chorus::std(x[0], 0); }, {r({3, 4}, 8)}));
  EXPECT_TRUE(gradcheck([](const TL& x) { return sum(x[0], I64{0, 2}) + mean(x[0], I64{2, 1}, true).sum(); }, {r({2, 3, 4}, 9)}));
  for (double p : {2.0, 1.0, 3.0, 1.5, 0.5, kInf, -kInf}) {
    SCOPED_TRACE(p);
    // |x| in [0.2, 1] with mixed signs: away from 0, where |x|^(p-1) is steep for p < 1.
    auto signs = from_vector<double>({1, -1, 1, 1, -1, 1, -1, -1, 1, 1, -1, 1}, {3, 4});
    EXPECT_TRUE(gradcheck([p](const TL& x) { return norm(x[0], p, 1); }, {r({3, 4}, 10, 0.2, 1) * signs}));
    EXPECT_TRUE(gradcheck([p](const TL& x) { return norm(x[0], p); }, {r({2, 3}, 12, 0.2, 1) * signs.narrow(0, 0, 2).narrow(1, 0, 3)}));
  }
}

// ---- the gradient conventions at non-differentiable points (PyTorch's) ----

TEST(OpsSeqGradients, TiesAbsAtZeroClampAtBoundaryNormAtZero) {
  auto grad_of = [](const Tensor<double>& x0, const std::function<Tensor<double>(const Tensor<double>&)>& f) {
    auto x = x0.clone().requires_grad_(true);  // a fresh leaf per call: gradients would accumulate
    f(x).sum().backward();
    return x.grad();
  };
  auto ties = from_vector<double>({1, 3, 3, 0, 2, 2}, {2, 3});
  // max along a dim: all of the gradient to the returned (first) index.
  EXPECT_TRUE(values_are(grad_of(ties, [](auto& x) { return std::get<0>(max(x, 1)); }), {0, 1, 0, 0, 1, 0}));
  // max()/amax: shared evenly among the tied elements.
  EXPECT_TRUE(values_are(grad_of(ties, [](auto& x) { return max(x); }), {0, 0.5, 0.5, 0, 0, 0}));
  EXPECT_TRUE(values_are(grad_of(ties, [](auto& x) { return amax(x, {1}); }), {0, 0.5, 0.5, 0, 0.5, 0.5}));
  EXPECT_TRUE(values_are(grad_of(ties, [](auto& x) { return amin(x, {0}); }), {0, 0, 0, 1, 1, 1}));
  EXPECT_TRUE(values_are(grad_of(ties, [](auto& x) { return std::get<0>(topk(x, 2, 1)); }), {0, 1, 1, 0, 1, 1}));
  // abs at 0: 0. clamp at its boundaries: the gradient passes.
  EXPECT_TRUE(values_are(grad_of(from_vector<double>({-2, 0, 3}), [](auto& x) { return chorus::abs(x); }), {-1, 0, 1}));
  EXPECT_TRUE(values_are(grad_of(from_vector<double>({-1, 0, 1, 2}), [](auto& x) { return clamp(x, -1.0, 1.0); }),
                         {1, 1, 1, 0}));
  // norm at 0: 0, for every p (not NaN).
  for (double p : {2.0, 1.0, 3.0, 1.5, 0.5, kInf})
    EXPECT_TRUE(values_are(grad_of(zeros<double>({2, 2}), [p](auto& x) { return norm(x, p, 1); }), {0, 0, 0, 0}))
        << "p = " << p;
  // inf-norm ties: shared evenly with the signs.
  EXPECT_TRUE(values_are(grad_of(from_vector<double>({-2, 2, 1}), [](auto& x) { return norm(x, kInf); }),
                         {-0.5, 0.5, 0}));
  // cumsum's gradient is the reversed cumulative sum.
  EXPECT_TRUE(values_are(grad_of(zeros<double>({3}), [](auto& x) { return cumsum(x, 0); }), {3, 2, 1}));
}

TEST(OpsSeq, SavedTensorsAreVersionChecked) {
  auto x = r({3, 4}, 1).requires_grad_(true);
  auto idx = from_vector<std::int64_t>({1, 0, 2}, {3, 1});
  auto y = gather(x, 1, idx);
  idx.fill_(0);  // the index autograd saved changed: backward must refuse, as PyTorch does
  EXPECT_TRUE(throws_with([&] { y.sum().backward(); }, {"modified by an inplace operation"}));
}

// Tensor's method forms (LibTorch's x.abs(), x.exp(), ...) are the free functions, with their
// gradients.
TEST(OpsSeq, MethodFormsAreTheFreeFunctions) {
  using F = std::function<Tensor<double>(const Tensor<double>&)>;
  const std::vector<std::tuple<const char*, F, F>> pairs = {
      {"neg", [](auto& x) { return x.neg(); }, [](auto& x) { return neg(x); }},
      {"abs", [](auto& x) { return x.abs(); }, [](auto& x) { return abs(x); }},
      {"exp", [](auto& x) { return x.exp(); }, [](auto& x) { return exp(x); }},
      {"log", [](auto& x) { return x.abs().log(); }, [](auto& x) { return log(abs(x)); }},
      {"sqrt", [](auto& x) { return x.abs().sqrt(); }, [](auto& x) { return sqrt(abs(x)); }},
      {"square", [](auto& x) { return x.square(); }, [](auto& x) { return square(x); }},
      {"pow", [](auto& x) { return x.pow(3.0); }, [](auto& x) { return pow(x, 3.0); }},
      {"sin", [](auto& x) { return x.sin(); }, [](auto& x) { return sin(x); }},
      {"cos", [](auto& x) { return x.cos(); }, [](auto& x) { return cos(x); }},
      {"tanh", [](auto& x) { return x.tanh(); }, [](auto& x) { return tanh(x); }},
      {"sigmoid", [](auto& x) { return x.sigmoid(); }, [](auto& x) { return sigmoid(x); }},
      {"relu", [](auto& x) { return x.relu(); }, [](auto& x) { return relu(x); }},
      {"gelu", [](auto& x) { return x.gelu(); }, [](auto& x) { return gelu(x); }},
      {"clamp", [](auto& x) { return x.clamp(-0.5, 0.5); }, [](auto& x) { return clamp(x, -0.5, 0.5); }},
      {"clamp_min", [](auto& x) { return x.clamp_min(0.1); }, [](auto& x) { return clamp_min(x, 0.1); }},
      {"clamp_max", [](auto& x) { return x.clamp_max(0.1); }, [](auto& x) { return clamp_max(x, 0.1); }},
      {"softmax", [](auto& x) { return x.softmax(1); }, [](auto& x) { return softmax(x, 1); }},
      {"log_softmax", [](auto& x) { return x.log_softmax(-1); }, [](auto& x) { return log_softmax(x, -1); }},
  };
  Generator g(4);
  const auto base = randn<double>({3, 4}, Device::cpu(), 0, 1, g);
  for (const auto& [name, method, free] : pairs) {
    auto a = base.clone().requires_grad_(), b = base.clone().requires_grad_();
    auto ya = method(a), yb = free(b);
    EXPECT_EQ(ya.to_vector(), yb.to_vector()) << name;
    (ya * base).sum().backward();
    (yb * base).sum().backward();
    EXPECT_EQ(a.grad().to_vector(), b.grad().to_vector()) << name;
  }
}

// cross_entropy's options refuse what PyTorch refuses, naming it.
TEST(OpsSeq, CrossEntropyOptionsAreChecked) {
  namespace F = nn::functional;
  auto x = zeros<double>({2, 3});
  auto t = from_vector<std::int64_t>({0, 2});
  EXPECT_TRUE(throws_with([&] { F::cross_entropy(x, t, {.weight = ones<double>({2})}); }, {"weight must be [3]"}));
  EXPECT_TRUE(throws_with([&] { F::cross_entropy(x, t, {.label_smoothing = 1.5}); }, {"label_smoothing", "[0, 1]"}));
  EXPECT_TRUE(throws_with([&] { F::cross_entropy(zeros<double>({2, 3, 4}), t, {}); },
                          {"target of shape [2]", "expected [2, 4]"}));
  EXPECT_TRUE(throws_with([&] { F::cross_entropy(x, from_vector<std::int64_t>({0, 3}), {.label_smoothing = 0.1}); },
                          {"target 3", "out of range"}));
  // Label smoothing 1 on 3 classes: the loss of the uniform target, log 3, whatever the class.
  EXPECT_NEAR(F::cross_entropy(x, t, {.label_smoothing = 1.0}).item(), std::log(3.0), 1e-15);
}
