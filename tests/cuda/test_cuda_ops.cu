// The sequence-model operators' CUDA kernels (issue 18, item 1) against the CPU backend:
// every op's forward and the gradients of its inputs (check_op), the indices of selections,
// and bad indices found by the kernels (Note [device-side validation]). Skips without a GPU.
#include <cmath>
#include <limits>
#include <tuple>

#include "cuda_test_util.cuh"

using namespace chorus;
using chorus::testing::all_close;
using chorus::testing::check_op;
using chorus::testing::kGpu;
using chorus::testing::r;
using chorus::testing::throws_with;
using I64 = std::vector<std::int64_t>;

namespace {
Tensor<std::int64_t> ids(const I64& v, const Shape& s, Device d) { return from_vector<std::int64_t>(v, s, d); }

/// Integer results (indices, masks) of `f` on the CPU and on the GPU must be equal.
template <class T>
void check_ints(const char* name, const std::function<Tensor<std::int64_t>(const Tensor<T>&)>& f, const Tensor<T>& x) {
  SCOPED_TRACE(name);
  auto c = f(x);
  auto g = f(x.to(kGpu));
  ASSERT_EQ(g.device(), kGpu);
  EXPECT_EQ(g.shape(), c.shape());
  EXPECT_EQ(g.to_vector(), c.to_vector());
}

/// Rounded values: many ties, so that the tie-breaking of the kernels is compared too.
template <class T>
Tensor<T> ties(const Shape& s, std::uint64_t seed) {
  auto v = r<T>(s, seed, -4, 4).to_vector();
  for (auto& x : v) x = std::round(x);
  return from_vector<T>(v, s);
}
}  // namespace

template <class T>
class CudaSeqOps : public ::testing::Test {};
TYPED_TEST_SUITE(CudaSeqOps, chorus::testing::FloatTypes);

TYPED_TEST(CudaSeqOps, MatmulBroadcastingAndBmm) {
  REQUIRE_GPU();
  using T = TypeParam;
  using L = std::vector<Tensor<T>>;
  auto mm = [](const L& x) { return matmul(x[0], x[1]); };
  check_op<T>("dot", mm, {r<T>({40}, 1), r<T>({40}, 2)});
  check_op<T>("vec-mat", mm, {r<T>({16}, 3), r<T>({4, 16, 8}, 4)});
  check_op<T>("mat-vec", mm, {r<T>({3, 20, 16}, 5), r<T>({16}, 6)});
  check_op<T>("broadcast", mm, {r<T>({2, 1, 12, 16}, 7), r<T>({3, 16, 10}, 8)});
  check_op<T>("2d-batched", mm, {r<T>({12, 16}, 9), r<T>({5, 16, 10}, 10)});
  check_op<T>("bmm", [](const L& x) { return bmm(x[0], x[1]); }, {r<T>({8, 64, 32}, 11), r<T>({8, 32, 48}, 12)});
  check_op<T>("bmm-transposed", [](const L& x) { return bmm(x[0].transpose(1, 2), x[1].permute({1, 0, 2})); },
              {r<T>({4, 16, 8}, 13), r<T>({16, 4, 6}, 14)});
  check_op<T>("expanded", [](const L& x) { return matmul(x[0], x[1].expand({3, 16, 10})); },
              {r<T>({3, 12, 16}, 15), r<T>({1, 16, 10}, 16)});
  check_op<T>("attention-shaped", [](const L& x) { return matmul(x[0], x[1].transpose(-2, -1)); },
              {r<T>({2, 4, 33, 16}, 17), r<T>({2, 4, 33, 16}, 18)});
}

TYPED_TEST(CudaSeqOps, ViewsAndTriangles) {
  REQUIRE_GPU();
  using T = TypeParam;
  using L = std::vector<Tensor<T>>;
  check_op<T>("permute", [](const L& x) { return x[0].permute({2, 0, 1}).contiguous(); }, {r<T>({3, 4, 5}, 1)});
  check_op<T>("movedim", [](const L& x) { return movedim(x[0], 0, -1) * 2.0; }, {r<T>({3, 4, 5}, 2)});
  check_op<T>("expand", [](const L& x) { return x[0].expand({6, 4, 5}) * x[1]; }, {r<T>({4, 1}, 3), r<T>({6, 4, 5}, 4)});
  check_op<T>("tril", [](const L& x) { return tril(x[0], -2); }, {r<T>({3, 40, 37}, 5)});
  check_op<T>("triu", [](const L& x) { return triu(x[0].transpose(0, 1), 3); }, {r<T>({37, 40}, 6)});
  auto causal = triu(ones<std::int64_t>({33, 33}, kGpu), 1);
  EXPECT_EQ(causal.to_vector(), triu(ones<std::int64_t>({33, 33}), 1).to_vector());
}

TYPED_TEST(CudaSeqOps, MasksAndComparisons) {
  REQUIRE_GPU();
  using T = TypeParam;
  using L = std::vector<Tensor<T>>;
  auto cond = randint(0, 2, {7, 1, 9});
  auto cond_g = cond.to(kGpu);
  auto pick = [&](const Tensor<T>& x) { return x.device().is_cuda() ? cond_g : cond; };
  check_op<T>("where", [&](const L& x) { return where(pick(x[0]), x[0], x[1]); }, {r<T>({7, 5, 9}, 1), r<T>({5, 1}, 2)});
  check_op<T>("where-scalar", [&](const L& x) { return where(pick(x[0]), x[0], -2.0); }, {r<T>({7, 5, 9}, 3)});
  check_op<T>("masked_fill", [&](const L& x) { return masked_fill(x[0], pick(x[0]), -1e4); }, {r<T>({7, 5, 9}, 4)});
  check_op<T>("masked_fill-tensor", [&](const L& x) { return masked_fill(x[0], pick(x[0]), x[1]); },
              {r<T>({5, 9}, 5), r<T>({}, 6)});
  auto a = ties<T>({7, 5, 9}, 7);
  auto b = ties<T>({5, 1}, 8);
  auto bg = b.to(kGpu);
  auto other = [&](const Tensor<T>& x) { return x.device().is_cuda() ? bg : b; };
  check_ints<T>("eq", [&](const Tensor<T>& x) { return eq(x, other(x)); }, a);
  check_ints<T>("ne", [&](const Tensor<T>& x) { return ne(x, other(x)); }, a);
  check_ints<T>("lt", [&](const Tensor<T>& x) { return lt(x, other(x)); }, a);
  check_ints<T>("le", [&](const Tensor<T>& x) { return le(x, 1.0); }, a);
  check_ints<T>("gt", [&](const Tensor<T>& x) { return gt(x.transpose(0, 2), other(x)); }, a);
  check_ints<T>("ge", [&](const Tensor<T>& x) { return ge(x, 0.0); }, a);
}

TYPED_TEST(CudaSeqOps, SelectionValuesIndicesAndGradients) {
  REQUIRE_GPU();
  using T = TypeParam;
  using L = std::vector<Tensor<T>>;
  // Rows (inner == 1; one long row beyond a block's threads) and columns (inner > 1).
  for (const Shape& s : {Shape{33, 1000}, Shape{5, 300, 7}, Shape{1, 5000}}) {
    // check_op accumulates the inputs' gradients: a fresh input per call.
    check_op<T>("max-dim", [](const L& v) { return std::get<0>(max(v[0], 1)); }, {r<T>(s, 1)});
    check_op<T>("min-dim-keep", [](const L& v) { return std::get<0>(v[0].min(-1, true)); }, {r<T>(s, 1)});
    check_op<T>("max-all", [](const L& v) { return max(v[0]); }, {r<T>(s, 1)});
    check_op<T>("amin", [](const L& v) { return amin(v[0], {0, 1}, true); }, {r<T>(s, 1)});
    check_op<T>("topk", [](const L& v) { return std::get<0>(topk(v[0], 5, 1)); }, {r<T>(s, 1)});
    check_op<T>("topk-smallest", [](const L& v) { return std::get<0>(topk(v[0], std::min<std::int64_t>(3, v[0].size(0)), 0, false)); },
                {r<T>(s, 1)});
    auto t = ties<T>(s, 2);
    check_ints<T>("max-indices", [](const Tensor<T>& v) { return std::get<1>(max(v, 1)); }, t);
    check_ints<T>("min-indices", [](const Tensor<T>& v) { return std::get<1>(min(v, 0)); }, t);
    check_ints<T>("argmax-flat", [](const Tensor<T>& v) { return argmax(v); }, t);
    check_ints<T>("argmin-dim", [](const Tensor<T>& v) { return argmin(v, -1, true); }, t);
    check_ints<T>("topk-indices", [](const Tensor<T>& v) { return std::get<1>(topk(v, 7, 1)); }, t);
    check_ints<T>("topk-smallest-indices", [](const Tensor<T>& v) { return std::get<1>(topk(v, 4, -1, false)); }, t);
  }
  // Ties share the gradient of max() and amax evenly, on the GPU as on the CPU.
  check_op<T>("max-all-ties", [](const L& v) { return max(v[0]); }, {ties<T>({40, 30}, 3)});
  check_op<T>("amax-ties", [](const L& v) { return amax(v[0], {1}); }, {ties<T>({40, 30}, 4)});
  // NaN: the maximum and the minimum; the largest for topk.
  auto nan = r<T>({4, 50}, 5).to_vector();
  nan[17] = nan[60] = nan[61] = std::numeric_limits<T>::quiet_NaN();
  auto xn = from_vector<T>(nan, {4, 50});
  check_ints<T>("nan-argmax", [](const Tensor<T>& v) { return argmax(v, 1); }, xn);
  check_ints<T>("nan-argmin", [](const Tensor<T>& v) { return argmin(v, 1); }, xn);
  check_ints<T>("nan-topk", [](const Tensor<T>& v) { return std::get<1>(topk(v, 3, 1)); }, xn);
  check_ints<T>("nan-topk-smallest", [](const Tensor<T>& v) { return std::get<1>(topk(v, 3, 1, false)); }, xn);
  // Integer tensors.
  auto ints = randint(-5, 5, {6, 300});
  EXPECT_EQ(argmax(ints.to(kGpu), 1).to_vector(), argmax(ints, 1).to_vector());
  EXPECT_EQ(std::get<1>(topk(ints.to(kGpu), 4)).to_vector(), std::get<1>(topk(ints, 4)).to_vector());
}

TYPED_TEST(CudaSeqOps, PointwiseAndReductions) {
  REQUIRE_GPU();
  using T = TypeParam;
  using L = std::vector<Tensor<T>>;
  check_op<T>("abs", [](const L& x) { return chorus::abs(x[0]); }, {r<T>({300}, 1)});
  check_op<T>("clamp", [](const L& x) { return clamp(x[0], -0.5, 0.25); }, {r<T>({300}, 2)});
  check_op<T>("clamp_min", [](const L& x) { return clamp_min(x[0], 0.0); }, {r<T>({300}, 3)});
  check_op<T>("sin-cos", [](const L& x) { return chorus::sin(x[0]) + chorus::cos(x[0]); }, {r<T>({300}, 4, -4, 4)});
  check_op<T>("sum-dims", [](const L& x) { return sum(x[0], I64{0, 2}); }, {r<T>({6, 7, 8}, 5)});
  check_op<T>("mean-dims", [](const L& x) { return mean(x[0], I64{1, 2}, true); }, {r<T>({6, 7, 8}, 6)});
  check_op<T>("cumsum-rows", [](const L& x) { return cumsum(x[0], 1); }, {r<T>({5, 1000}, 7)});
  check_op<T>("cumsum-columns", [](const L& x) { return cumsum(x[0], 0); }, {r<T>({300, 40}, 8)});
  check_op<T>("cumsum-strided", [](const L& x) { return cumsum(x[0].t(), -1); }, {r<T>({70, 3}, 9)});
  check_op<T>("logsumexp", [](const L& x) { return logsumexp(x[0], 1); }, {r<T>({30, 500}, 10, -20, 20)});
  check_op<T>("logsumexp-dims", [](const L& x) { return logsumexp(x[0], I64{0, 2}, true); }, {r<T>({6, 7, 8}, 11)});
  check_op<T>("var", [](const L& x) { return var(x[0], 1); }, {r<T>({30, 500}, 12)});
  check_op<T>("var-pop", [](const L& x) { return var(x[0], I64{0, 2}, 0, true); }, {r<T>({6, 7, 8}, 13)});
  check_op<T>("std", [](const L& x) { return chorus::std(x[0], 0); }, {r<T>({300, 40}, 14)});
  for (double p : {2.0, 1.0, 3.0, 1.5, 0.5, 0.0, std::numeric_limits<double>::infinity()}) {
    SCOPED_TRACE(p);
    check_op<T>("norm-dim", [p](const L& x) { return norm(x[0], p, 1); }, {r<T>({30, 50}, 15)});
    check_op<T>("norm-all", [p](const L& x) { return norm(x[0], p); }, {r<T>({30, 50}, 16)});
  }
  check_op<T>("norm-zero", [](const L& x) { return norm(x[0] * 0.0, 2.0, 1); }, {r<T>({3, 4}, 17)});
  auto ints = randint(0, 3, {4, 600});
  EXPECT_EQ(cumsum(ints.to(kGpu), 1).to_vector(), cumsum(ints, 1).to_vector());
}

// In-place arithmetic (Note [in-place arithmetic]) on the GPU: the CPU's values (add_ with
// alpha within rounding: nvcc may fuse a + alpha*b), through broadcasts, a strided x and an
// operand overlapping x.
TYPED_TEST(CudaSeqOps, InPlaceArithmeticEqualsTheCpu) {
  REQUIRE_GPU();
  using T = TypeParam;
  const auto x = r<T>({40, 30}, 1), y = r<T>({40, 30}, 2, 0.5, 2), row = r<T>({30}, 3, 0.5, 2);
  using F = std::function<void(Tensor<T>&)>;
  auto check = [&](const char* name, const F& f, double rtol, double atol = 0) {
    SCOPED_TRACE(name);
    auto c = x.clone(), g = x.to(kGpu);
    f(c);
    f(g);
    ASSERT_EQ(g.device(), kGpu);
    EXPECT_TRUE(all_close(g.to(Device::cpu()), c, rtol, atol));
  };
  auto on = [](const Tensor<T>& t, const Tensor<T>& like) { return t.to(like.device()); };
  check("add_", [&](Tensor<T>& z) { z.add_(on(y, z)); }, 0);
  check("sub_-row", [&](Tensor<T>& z) { z -= on(row, z); }, 0);
  check("mul_", [&](Tensor<T>& z) { z *= on(y, z); }, 0);
  check("div_-row", [&](Tensor<T>& z) { z.div_(on(row, z)); }, 0);
  check("scalars", [&](Tensor<T>& z) { z.add_(0.25).mul_(3.0).sub_(1.0).div_(0.5); }, 0);
  // z + alpha * row: nvcc contracts it to one FMA (fma.rn), the CPU rounds the product first, so
  // the two differ by up to one rounding of alpha * row, which is large against a sum that
  // nearly cancels: the tolerance has an absolute term of one ulp of |alpha * row|.
  const double eps = std::numeric_limits<T>::epsilon(), alpha_row = 0.37 * 2;  // |row| <= 2
  check("alpha", [&](Tensor<T>& z) { z.add_(on(row, z), -0.37); }, 2 * eps, eps * alpha_row);
  check("strided", [&](Tensor<T>& z) { z.t().mul_(on(row, z).reshape({30, 1})); }, 0);
  check("overlap", [&](Tensor<T>& z) { z.add_(z[0]); }, 0);
}

TYPED_TEST(CudaSeqOps, GatherScatterAddOneHot) {
  REQUIRE_GPU();
  using T = TypeParam;
  using L = std::vector<Tensor<T>>;
  auto idx = randint(0, 9, {7, 12});
  auto idx_g = idx.to(kGpu);
  auto pick = [&](const Tensor<T>& x) { return x.device().is_cuda() ? idx_g : idx; };
  check_op<T>("gather", [&](const L& x) { return gather(x[0], 1, pick(x[0])); }, {r<T>({7, 9}, 1)});
  check_op<T>("gather-dim0-strided", [&](const L& x) { return gather(x[0].t(), 0, pick(x[0]).narrow(0, 0, 7)); },
              {r<T>({12, 9}, 2)});
  check_op<T>("scatter_add", [&](const L& x) { return scatter_add(x[0], 1, pick(x[0]), x[1]); },
              {r<T>({7, 9}, 3), r<T>({7, 12}, 4)});
  check_op<T>("scatter_add-larger-src", [&](const L& x) { return scatter_add(x[0], 1, pick(x[0]), x[1]); },
              {r<T>({7, 9}, 5), r<T>({8, 15}, 6)});
  auto labels = randint(0, 10, {40});
  EXPECT_EQ(one_hot(labels.to(kGpu), 10).to_vector(), one_hot(labels, 10).to_vector());
  EXPECT_EQ(one_hot(labels.to(kGpu)).shape(), one_hot(labels).shape());
  EXPECT_TRUE(all_close(one_hot<T>(labels.to(kGpu), 12).to(Device::cpu()), one_hot<T>(labels, 12), 0));
  auto ints = randint(-3, 3, {7, 12});
  EXPECT_EQ(scatter_add(zeros<std::int64_t>({7, 9}, kGpu), 1, idx_g, ints.to(kGpu)).to_vector(),
            scatter_add(zeros<std::int64_t>({7, 9}), 1, idx, ints).to_vector());

  // Bad indices: found by the kernels, reported at the next synchronisation; the next call works.
  auto x = r<T>({4, 5}, 7).to(kGpu);
  EXPECT_TRUE(throws_with([&] { gather(x, 1, ids({0, 5, 1, 2}, {2, 2}, kGpu)).to_vector(); },
                          {"gather", "index 5", "position 1", "dimension 1", "size 5", "cuda:0"}));
  EXPECT_TRUE(throws_with([&] { scatter_add(x, 0, ids({0, -1}, {1, 2}, kGpu), x).to_vector(); },
                          {"scatter_add", "index -1", "position 1", "dimension 0", "size 4"}));
  EXPECT_TRUE(throws_with([&] { one_hot(ids({1, 4, 2}, {3}, kGpu), 3).to_vector(); },
                          {"one_hot", "class value 4", "position 1", "3 classes"}));
  EXPECT_TRUE(throws_with([&] { one_hot(ids({1, -4}, {2}, kGpu)); }, {"one_hot", "class value -4"}));  // inferred: host
  EXPECT_EQ(gather(x, 1, ids({4, 0}, {1, 2}, kGpu)).to_vector(),
            gather(x.to(Device::cpu()), 1, ids({4, 0}, {1, 2}, Device::cpu())).to_vector());
}

// ---------------------------------------------------------------------------------------------
// Attention and Transformers (issue 18, item 3) on the GPU against the CPU: batched GEMMs, the
// softmax kernel and the masks applied on the device, forward and every gradient.
namespace {
/// A module and its copy on the GPU: the same outputs of `f` and the same gradients of the inputs
/// and of every parameter.
template <class M>
void check_module(const char* name, M& cpu,
                  const std::function<Tensor<double>(M&, const std::vector<Tensor<double>>&)>& f,
                  std::vector<Tensor<double>> in) {
  SCOPED_TRACE(name);
  M gpu = nn::clone(cpu, kGpu);
  std::vector<Tensor<double>> in_g;
  for (auto& x : in) {
    x.requires_grad_(true);
    in_g.push_back(x.detach().to(kGpu).requires_grad_(true));
  }
  auto out_c = f(cpu, in);
  auto out_g = f(gpu, in_g);
  ASSERT_EQ(out_g.device(), kGpu);
  EXPECT_TRUE(all_close(out_g.to(Device::cpu()), out_c, 1e-10, 1e-10)) << "forward";
  auto w = r<double>(out_c.shape(), 5);
  sum(out_c * w).backward();
  sum(out_g * w.to(kGpu)).backward();
  for (std::size_t i = 0; i < in.size(); ++i)
    EXPECT_TRUE(all_close(in_g[i].grad().to(Device::cpu()), in[i].grad(), 1e-10, 1e-10)) << "gradient of input " << i;
  auto pc = nn::module_of(cpu).named_parameters(), pg = nn::module_of(gpu).named_parameters();
  for (std::size_t i = 0; i < pc.size(); ++i)
    EXPECT_TRUE(all_close(pg[i].tensor.template as<double>().grad().to(Device::cpu()),
                          pc[i].tensor.template as<double>().grad(), 1e-10, 1e-10))
        << "gradient of " << pc[i].name;
}
}  // namespace

TYPED_TEST(CudaSeqOps, ScaledDotProductAttention) {
  REQUIRE_GPU();
  using T = TypeParam;
  using L = std::vector<Tensor<T>>;
  // Fresh inputs for every check (check_op accumulates the CPU inputs' gradients).
  auto in = [] { return L{r<T>({2, 4, 33, 16}, 1), r<T>({2, 4, 40, 16}, 2), r<T>({2, 4, 40, 8}, 3)}; };
  auto keep = gt(r<T>({33, 40}, 4), -0.5);
  auto dead = ones<std::int64_t>({33, 40});
  {
    NoGradGuard g;
    dead.narrow(0, 3, 2).fill_(0);  // queries 3 and 4 attend no key
  }
  auto add = r<T>({2, 1, 33, 40}, 5, -2, 2);
  auto on = [](const Tensor<std::int64_t>& m, const Tensor<T>& x) { return m.to(x.device()); };
  check_op<T>(
      "sdpa", [](const L& x) { return scaled_dot_product_attention(x[0], x[1], x[2]); }, in());
  check_op<T>(
      "sdpa-boolean", [&](const L& x) { return scaled_dot_product_attention(x[0], x[1], x[2], on(keep, x[0])); }, in());
  check_op<T>(
      "sdpa-float", [&](const L& x) { return scaled_dot_product_attention(x[0], x[1], x[2], add.to(x[0].device())); },
      in());
  check_op<T>(
      "sdpa-causal-scale",
      [](const L& x) { return scaled_dot_product_attention(x[0], x[1], x[2], {}, 0.0, true, 0.3); }, in());
  check_op<T>(
      "sdpa-fully-masked", [&](const L& x) { return scaled_dot_product_attention(x[0], x[1], x[2], on(dead, x[0])); },
      in());
  auto out = scaled_dot_product_attention(in()[0].to(kGpu), in()[1].to(kGpu), in()[2].to(kGpu), dead.to(kGpu));
  for (double v : out.narrow(2, 3, 2).to_vector()) EXPECT_EQ(v, 0.0);
}

TEST(CudaAttention, MultiheadAttentionAndTransformerLayers) {
  REQUIRE_GPU();
  manual_seed(1);
  const std::int64_t E = 32, H = 4, L = 17, S = 23, N = 3;
  auto kpm = zeros<std::int64_t>({N, S});
  {
    NoGradGuard g;
    kpm.narrow(0, 1, 1).narrow(1, 20, 3).fill_(1);
    kpm.narrow(0, 2, 1).fill_(1);  // batch element 2 has no keys: zero attention
  }
  auto on = [](const Tensor<std::int64_t>& m, const Tensor<double>& x) { return m.to(x.device()); };
  using MHA = nn::MultiheadAttentionT<double>;
  MHA mha(E, H, {.add_bias_kv = true, .kdim = 24, .vdim = 24, .batch_first = true});
  check_module<MHA>(
      "MultiheadAttention", mha,
      [&](MHA& m, const std::vector<Tensor<double>>& x) {
        auto [o, w] = m(x[0], x[1], x[2], on(kpm, x[0]), true, on(triu(ones<std::int64_t>({L, S}), 5), x[0]));
        return cat(std::vector<Tensor<double>>{o.reshape({-1}), w.reshape({-1})});
      },
      {r<double>({N, L, E}, 1), r<double>({N, S, 24}, 2), r<double>({N, S, 24}, 3)});
  using Enc = nn::TransformerEncoderT<double>;
  Enc enc(nn::TransformerEncoderLayerT<double>(E, H, {.dim_feedforward = 64, .dropout = 0.0, .activation = "gelu"}), 2,
          nn::LayerNormT<double>(E));
  auto src_kpm = zeros<std::int64_t>({N, L});
  check_module<Enc>("TransformerEncoder", enc,
                    [&](Enc& m, const std::vector<Tensor<double>>& x) {
                      return m(x[0], nn::generate_square_subsequent_mask<double>(L, x[0].device()), on(src_kpm, x[0]),
                               true);
                    },
                    {r<double>({L, N, E}, 4)});
  using Dec = nn::TransformerDecoderLayerT<double>;
  Dec dec(E, H, {.dim_feedforward = 64, .dropout = 0.0, .batch_first = true, .norm_first = true});
  check_module<Dec>("TransformerDecoderLayer", dec,
                    [&](Dec& m, const std::vector<Tensor<double>>& x) {
                      return m(x[0], x[1], nn::generate_square_subsequent_mask<double>(L, x[0].device()), {}, {},
                               on(kpm, x[0]), true);
                    },
                    {r<double>({N, L, E}, 5), r<double>({N, S, E}, 6)});
}

#include "test_cuda_lowp.cuh"  // the 16-bit types under nvcc (issue 19)

// The optimizer step sharded over a DataParallel's GPUs (Note [sharded optimizer step]: each
// shard's gradients and parameters copied to its device, stepped there, copied back): bitwise
// the plain step, with each shard's state on its own device. One GPU: the set {cuda:0, cuda:0}.
TEST(Cuda, TheShardedOptimizerStepEqualsThePlainStep) {
  REQUIRE_GPU();
  struct Two : nn::Module {
    nn::Linear fc1, fc2;
    Two() : fc1(register_module("fc1", nn::Linear(8, 32))), fc2(register_module("fc2", nn::Linear(32, 4))) {}
    Tensor<float> forward(const Tensor<float>& x) { return fc2(relu(fc1(x))); }
  };
  const std::vector<Device> devices = cuda_device_count() > 1 ? available_devices() : std::vector<Device>{kGpu, kGpu};
  manual_seed(5);
  Two init;
  DataParallel<Two> plain_dp(nn::clone(init, kGpu), devices), sharded_dp(nn::clone(init, kGpu), devices);
  optim::Adam plain(plain_dp.parameters(), {.lr = 1e-2});
  parallel::ShardedOptimizer<optim::Adam> sharded(sharded_dp, {.lr = 1e-2});
  auto x = randn<float>({16, 8}), y = randn<float>({16, 4});
  for (int step = 0; step < 3; ++step) {
    for (auto* dp : {&plain_dp, &sharded_dp}) {
      dp->zero_grad();
      nn::functional::mse_loss((*dp)(x), y.to(kGpu)).backward();
    }
    plain.step();
    sharded.step();
    auto p = plain_dp.parameters(), q = sharded_dp.parameters();
    for (std::size_t i = 0; i < p.size(); ++i)
      ASSERT_EQ(q[i].as<float>().to(Device::cpu()).to_vector(), p[i].as<float>().to(Device::cpu()).to_vector())
          << "parameter " << i << ", step " << step;
  }
  for (std::size_t i = 0; i < sharded.state().size(); ++i)
    for (const auto& [key, v] : sharded.state()[i])
      if (key != "step") EXPECT_EQ(v.device(), devices[sharded.shard_of(i)]) << key;
  synchronize(kGpu);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}
