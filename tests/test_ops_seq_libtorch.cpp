// The sequence-model operators against LibTorch (Debian libtorch-dev) in float64: the same
// inputs give the same outputs, indices and input gradients (1e-10), including PyTorch's
// conventions at ties, at 0 and at boundaries. Skips where LibTorch was not found.
#include "libtorch_util.hpp"

#include <functional>
#include <limits>


using TL = std::vector<chorus::Tensor<double>>;

#if CHORUS_HAVE_LIBTORCH
namespace {
using chorus::testing::from_torch;
using chorus::testing::sizes_of;
using chorus::testing::to_torch;
using chorus::Device;
using chorus::Generator;
using chorus::Shape;
using chorus::Tensor;
using TT = std::vector<torch::Tensor>;
using I64 = std::vector<std::int64_t>;
constexpr double kInf = std::numeric_limits<double>::infinity();


::testing::AssertionResult same(const torch::Tensor& ours, const torch::Tensor& theirs, const char* what) {
  if (ours.sizes() != theirs.sizes())
    return ::testing::AssertionFailure() << what << ": shape " << ours.sizes() << " vs LibTorch's " << theirs.sizes();
  auto a = ours.to(torch::kFloat64).contiguous(), b = theirs.to(torch::kFloat64).contiguous();
  const double* pa = a.data_ptr<double>();
  const double* pb = b.data_ptr<double>();
  for (int64_t i = 0; i < a.numel(); ++i) {
    const bool both_nan = std::isnan(pa[i]) && std::isnan(pb[i]);
    if (!both_nan && !(std::abs(pa[i] - pb[i]) <= 1e-10 * (1 + std::abs(pb[i]))))
      return ::testing::AssertionFailure() << what << ": element " << i << ": " << pa[i] << " vs LibTorch's " << pb[i];
  }
  return ::testing::AssertionSuccess();
}

/// Runs `ours` and `theirs` on the same inputs; compares the outputs and, through the same
/// random weighting of the output, every input's gradient.
void cross(const char* name, const std::function<Tensor<double>(const TL&)>& ours,
           const std::function<torch::Tensor(const TT&)>& theirs, const TL& inputs) {
  SCOPED_TRACE(name);
  TL a;
  TT b;
  for (const auto& x : inputs) {
    a.push_back(x.detach().clone().requires_grad_(true));
    b.push_back(to_torch(x).requires_grad_(true));
  }
  auto oa = ours(a);
  auto ob = theirs(b);
  ASSERT_TRUE(same(to_torch(oa.detach()), ob.detach(), "output"));
  Generator g(99);
  auto w = chorus::randn<double>(oa.shape(), Device::cpu(), 0, 1, g);
  chorus::sum(oa * w).backward();
  (ob * to_torch(w)).sum().backward();
  for (std::size_t i = 0; i < a.size(); ++i) {
    SCOPED_TRACE("gradient of input " + std::to_string(i));
    const bool ours_has = a[i].grad().defined(), theirs_has = b[i].grad().defined();
    if (!ours_has && !theirs_has) continue;
    auto ga = ours_has ? to_torch(a[i].grad()) : torch::zeros_like(b[i]);
    auto gb = theirs_has ? b[i].grad() : torch::zeros_like(b[i]);
    EXPECT_TRUE(same(ga, gb, "gradient"));
  }
}

Tensor<double> r(const Shape& s, std::uint64_t seed, double lo = -1, double hi = 1) {
  Generator g(seed);
  return chorus::rand<double>(s, Device::cpu(), lo, hi, g);
}
/// Integers in [-3, 3]: many ties.
Tensor<double> ties(const Shape& s, std::uint64_t seed) {
  auto v = r(s, seed, -3.49, 3.49).to_vector();
  for (auto& x : v) x = std::round(x);
  return chorus::from_vector<double>(v, s);
}
Tensor<std::int64_t> ids(const I64& v, const Shape& s) { return chorus::from_vector<std::int64_t>(v, s); }
}  // namespace

TEST(OpsSeqLibtorch, Matmul) {
  auto mm = [](const TL& x) { return chorus::matmul(x[0], x[1]); };
  auto tmm = [](const TT& x) { return torch::matmul(x[0], x[1]); };
  const std::vector<std::pair<Shape, Shape>> cases = {
      {{4}, {4}},       {{4}, {4, 3}},       {{2, 4}, {4}},         {{2, 3, 4}, {4}},    {{4}, {2, 4, 3}},
      {{3, 4}, {4, 5}}, {{2, 3, 4}, {4, 5}}, {{2, 1, 3, 4}, {3, 4, 5}}, {{3, 4}, {2, 4, 5}}, {{5, 1, 2, 4}, {1, 6, 4, 3}}};
  for (std::size_t i = 0; i < cases.size(); ++i) cross("matmul", mm, tmm, {r(cases[i].first, 2 * i), r(cases[i].second, 2 * i + 1)});
  cross("bmm", [](const TL& x) { return chorus::bmm(x[0], x[1].transpose(1, 2)); },
        [](const TT& x) { return torch::bmm(x[0], x[1].transpose(1, 2)); }, {r({3, 4, 5}, 50), r({3, 2, 5}, 51)});
}

TEST(OpsSeqLibtorch, ViewsAndTriangles) {
  cross("permute", [](const TL& x) { return x[0].permute({2, 0, 1}) * x[1]; },
        [](const TT& x) { return x[0].permute({2, 0, 1}) * x[1]; }, {r({2, 3, 4}, 1), r({3}, 2)});
  cross("movedim", [](const TL& x) { return chorus::movedim(x[0], I64{0, -1}, I64{-1, 1}) * 1.0; },
        [](const TT& x) { return torch::movedim(x[0], {0, -1}, {-1, 1}) * 1.0; }, {r({2, 3, 4}, 3)});
  cross("expand", [](const TL& x) { return x[0].expand({2, -1, 4}) * x[1]; },
        [](const TT& x) { return x[0].expand({2, -1, 4}) * x[1]; }, {r({3, 1}, 4), r({2, 3, 4}, 5)});
  for (std::int64_t d : {-2, 0, 1, 3}) {
    cross("tril", [d](const TL& x) { return chorus::tril(x[0], d); }, [d](const TT& x) { return torch::tril(x[0], d); },
          {r({2, 3, 4}, 6)});
    cross("triu", [d](const TL& x) { return chorus::triu(x[0], d); }, [d](const TT& x) { return torch::triu(x[0], d); },
          {r({4, 3}, 7)});
  }
}

TEST(OpsSeqLibtorch, MasksAndIndexing) {
  auto c = ids({1, 0, 0, 1, 1, 0}, {2, 1, 3});
  auto tc = to_torch(c).to(torch::kBool);
  cross("where", [&](const TL& x) { return chorus::where(c, x[0], x[1]); },
        [&](const TT& x) { return torch::where(tc, x[0], x[1]); }, {r({4, 3}, 1), r({2, 4, 1}, 2)});
  cross("masked_fill", [&](const TL& x) { return chorus::masked_fill(x[0], c, -3.5); },
        [&](const TT& x) { return x[0].masked_fill(tc, -3.5); }, {r({2, 4, 3}, 3)});
  cross("masked_fill-tensor", [&](const TL& x) { return chorus::masked_fill(x[0], c, x[1]); },
        [&](const TT& x) { return x[0].masked_fill(tc, x[1]); }, {r({2, 4, 3}, 4), r({}, 5)});
  auto idx = ids({2, 0, 2, 1, 1, 1, 0, 3}, {2, 4});
  auto tidx = to_torch(idx);
  cross("gather", [&](const TL& x) { return chorus::gather(x[0], 1, idx); },
        [&](const TT& x) { return torch::gather(x[0], 1, tidx); }, {r({3, 5}, 6)});
  cross("scatter_add", [&](const TL& x) { return chorus::scatter_add(x[0], 1, idx, x[1]); },
        [&](const TT& x) { return torch::scatter_add(x[0], 1, tidx, x[1]); }, {r({2, 4}, 7), r({2, 4}, 8)});
  cross("scatter_add-dim0", [&](const TL& x) { return chorus::scatter_add(x[0], 0, idx.narrow(1, 0, 2), x[1]); },
        [&](const TT& x) { return torch::scatter_add(x[0], 0, tidx.narrow(1, 0, 2), x[1]); }, {r({3, 2}, 9), r({2, 2}, 10)});
  auto labels = ids({3, 0, 2, 2}, {2, 2});
  EXPECT_TRUE(same(to_torch(chorus::one_hot(labels, 5)), torch::nn::functional::one_hot(to_torch(labels), 5), "one_hot"));
  EXPECT_TRUE(same(to_torch(chorus::one_hot(labels)), torch::nn::functional::one_hot(to_torch(labels)), "one_hot"));
}

TEST(OpsSeqLibtorch, SelectionWithTies) {
  auto x = ties({4, 6}, 1);
  for (std::int64_t d : {0, 1, -1}) {
    for (bool keep : {false, true}) {
      cross("max-dim", [=](const TL& v) { return std::get<0>(chorus::max(v[0], d, keep)); },
            [=](const TT& v) { return std::get<0>(torch::max(v[0], d, keep)); }, {x});
      cross("min-dim", [=](const TL& v) { return std::get<0>(chorus::min(v[0], d, keep)); },
            [=](const TT& v) { return std::get<0>(torch::min(v[0], d, keep)); }, {x});
      EXPECT_TRUE(same(to_torch(std::get<1>(chorus::max(x, d, keep))), std::get<1>(torch::max(to_torch(x), d, keep)),
                       "max indices"));
      EXPECT_TRUE(same(to_torch(chorus::argmin(x, d, keep)), torch::argmin(to_torch(x), d, keep), "argmin"));
    }
  }
  EXPECT_TRUE(same(to_torch(chorus::argmax(x)), torch::argmax(to_torch(x)), "argmax"));
  cross("max-all", [](const TL& v) { return chorus::max(v[0]); }, [](const TT& v) { return v[0].max(); }, {x});
  cross("min-all", [](const TL& v) { return chorus::min(v[0]); }, [](const TT& v) { return v[0].min(); }, {x});
  cross("amax", [](const TL& v) { return chorus::amax(v[0], {1}); }, [](const TT& v) { return torch::amax(v[0], {1}); },
        {x});
  cross("amin-keep", [](const TL& v) { return chorus::amin(v[0], {0, 1}, true); },
        [](const TT& v) { return torch::amin(v[0], {0, 1}, true); }, {x});
  for (bool largest : {true, false})  // distinct values: LibTorch does not fix the order of ties
    cross("topk", [=](const TL& v) { return std::get<0>(chorus::topk(v[0], 3, 0, largest)); },
          [=](const TT& v) { return std::get<0>(torch::topk(v[0], 3, 0, largest)); }, {r({5, 4}, 2)});
}

TEST(OpsSeqLibtorch, PointwiseAtTheirKinks) {
  auto x = chorus::from_vector<double>({-2, -1, -0.5, 0, 0.5, 1, 2, 0.25});
  cross("abs", [](const TL& v) { return chorus::abs(v[0]); }, [](const TT& v) { return torch::abs(v[0]); }, {x});
  cross("clamp", [](const TL& v) { return chorus::clamp(v[0], -1.0, 1.0); },
        [](const TT& v) { return torch::clamp(v[0], -1.0, 1.0); }, {x});
  cross("clamp_min", [](const TL& v) { return chorus::clamp_min(v[0], 0.0); },
        [](const TT& v) { return torch::clamp_min(v[0], 0.0); }, {x});
  cross("clamp-inverted", [](const TL& v) { return chorus::clamp(v[0], 1.0, -1.0); },
        [](const TT& v) { return torch::clamp(v[0], 1.0, -1.0); }, {x});
  cross("sin-cos", [](const TL& v) { return chorus::sin(v[0]) * chorus::cos(v[0]); },
        [](const TT& v) { return torch::sin(v[0]) * torch::cos(v[0]); }, {x});
}

TEST(OpsSeqLibtorch, Reductions) {
  cross("cumsum", [](const TL& v) { return chorus::cumsum(v[0], 1); }, [](const TT& v) { return torch::cumsum(v[0], 1); },
        {r({2, 5, 3}, 1)});
  cross("logsumexp", [](const TL& v) { return chorus::logsumexp(v[0], I64{0, 2}); },
        [](const TT& v) { return torch::logsumexp(v[0], at::IntArrayRef{0, 2}); }, {r({2, 5, 3}, 2, -5, 5)});
  // LibTorch's var(x, dim, 2, keepdim) would take 2 as `unbiased`: the correction goes in an optional.
  for (std::int64_t c : {0, 1, 2}) {
    cross("var", [=](const TL& v) { return chorus::var(v[0], I64{1}, static_cast<double>(c), true); },
          [=](const TT& v) { return torch::var(v[0], at::IntArrayRef{1}, c10::optional<int64_t>(c), true); }, {r({3, 4}, 3)});
    cross("std", [=](const TL& v) { return chorus::std(v[0], I64{0, 1}, static_cast<double>(c)); },
          [=](const TT& v) { return torch::std(v[0], at::IntArrayRef{0, 1}, c10::optional<int64_t>(c)); }, {r({3, 4}, 4)});
  }
  for (double p : {2.0, 1.0, 3.0, 1.5, 0.5, 0.0, kInf, -kInf}) {
    SCOPED_TRACE(p);
    cross("norm", [=](const TL& v) { return chorus::norm(v[0], p, 1, true); },
          [=](const TT& v) { return torch::linalg_vector_norm(v[0], p, {1}, true); }, {r({3, 4}, 5)});
    // At zero (and a zero row next to a nonzero one): PyTorch's gradients, never NaN.
    auto z = chorus::from_vector<double>({0, 0, 0, 3, 0, -4}, {2, 3});
    cross("norm-at-zero", [=](const TL& v) { return chorus::norm(v[0], p, 1); },
          [=](const TT& v) { return torch::linalg_vector_norm(v[0], p, {1}); }, {z});
  }
  cross("norm-inf-ties", [](const TL& v) { return chorus::norm(v[0], kInf); },
        [](const TT& v) { return torch::linalg_vector_norm(v[0], kInf); }, {chorus::from_vector<double>({-2, 2, 1, -2})});
}
// cross_entropy with PyTorch's keyword arguments (class weight, ignore_index, label smoothing,
// each reduction) and inputs of rank 1, 2, 3 and 4: values and the logits' gradients.
TEST(OpsSeqLibtorch, CrossEntropyWithItsOptions) {
  namespace F = chorus::nn::functional;
  namespace TF = torch::nn::functional;
  using R = chorus::Reduction;
  struct Case {
    const char* name;
    Shape logits;
    I64 target;
    Shape target_shape;
    bool weight;
    std::int64_t ignore;
    double smoothing;
    R reduction;
  };
  const Case cases[] = {
      {"weight-ignore-mean", {4, 5}, {1, 2, 4, 0}, {4}, true, 2, 0.0, R::Mean},
      {"smoothing-mean", {4, 5}, {1, -100, 4, 0}, {4}, false, -100, 0.2, R::Mean},
      {"weight-smoothing-sum", {4, 5}, {3, 3, 4, 0}, {4}, true, -100, 0.1, R::Sum},
      {"rank3-none", {2, 5, 3}, {0, 4, 2, 1, 1, 3}, {2, 3}, true, 1, 0.3, R::None},
      {"rank4-plain-mean", {2, 5, 2, 2}, {0, 4, 2, 1, 1, 3, 0, 0}, {2, 2, 2}, false, -100, 0.0, R::Mean},
      {"one-example", {5}, {3}, {}, true, -100, 0.1, R::Mean},
  };
  const auto weight = r({5}, 6, 0.2, 2);
  for (const auto& c : cases) {
    const auto target = ids(c.target, c.target_shape);
    const auto tt = to_torch(target);
    cross(c.name,
          [&](const TL& v) {
            return F::cross_entropy(v[0], target,
                                    {.weight = c.weight ? weight : Tensor<double>(), .ignore_index = c.ignore,
                                     .reduction = c.reduction, .label_smoothing = c.smoothing});
          },
          [&](const TT& v) {
            auto o = TF::CrossEntropyFuncOptions().ignore_index(c.ignore).label_smoothing(c.smoothing);
            if (c.weight) o = o.weight(to_torch(weight));
            if (c.reduction == R::Sum) o = o.reduction(torch::kSum);
            if (c.reduction == R::None) o = o.reduction(torch::kNone);
            return TF::cross_entropy(v[0], tt, o);
          },
          {r(c.logits, 5, -2, 2)});
  }
}

#else
TEST(OpsSeqLibtorch, Skipped) { GTEST_SKIP() << CHORUS_LIBTORCH_SKIP; }
#endif
