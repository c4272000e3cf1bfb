// Attention and Transformers on the CPU: scaled_dot_product_attention, MultiheadAttention and the
// Transformer layers against float64 central differences, their shapes, names, initialisation
// and option errors, checkpoints, DataParallel over virtual CPU devices and a small training run.
// (tests/test_libtorch_attention.cpp checks the same modules against LibTorch.)
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <limits>

#include "test_util.hpp"

using namespace chorus;
using chorus::testing::all_close;
using chorus::testing::throws_with;
using TL = std::vector<Tensor<double>>;
namespace F = chorus::nn::functional;

namespace {
constexpr double kInf = std::numeric_limits<double>::infinity();

Tensor<double> r(const Shape& s, std::uint64_t seed, double lo = -1, double hi = 1) {
  Generator g(seed);
  return rand<double>(s, Device::cpu(), lo, hi, g);
}
Tensor<mask_t> ids(const std::vector<std::int64_t>& v, const Shape& s) { return from_vector<mask_t>(v, s); }

/// test_util's gradcheck reads a NaN analytic gradient as a match (NaN > tolerance is false), and
/// a NaN is what a fully masked row gives when it is handled wrongly: every gradient must first
/// be finite.
::testing::AssertionResult gradcheck(const std::function<Tensor<double>(const TL&)>& f, TL inputs) {
  for (auto& x : inputs) {
    x.requires_grad_(true);
    x.set_grad({});
  }
  sum(f(inputs) * r(f(inputs).shape(), 77)).backward();
  for (std::size_t k = 0; k < inputs.size(); ++k) {
    if (!inputs[k].grad().defined()) continue;
    for (double v : inputs[k].grad().to_vector())
      if (!std::isfinite(v)) return ::testing::AssertionFailure() << "input " << k << " has a gradient of " << v;
  }
  for (auto& x : inputs) x.set_grad({});
  return chorus::testing::gradcheck(f, inputs);
}

/// The parameters of a module as gradcheck inputs (the same tensors: perturbing them perturbs the module).
TL params_of(const nn::Module& m) {
  TL out;
  for (auto& p : m.parameters()) out.push_back(p.as<double>());
  return out;
}
TL concat(TL a, const TL& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}
/// One tensor of everything a module returns (gradcheck takes one output).
Tensor<double> flat(const std::vector<Tensor<double>>& parts) {
  std::vector<Tensor<double>> f;
  for (const auto& p : parts) f.push_back(p.reshape({-1}));
  return cat(f);
}
std::vector<std::string> names_of(const nn::Module& m) {
  std::vector<std::string> n;
  for (auto& p : m.named_parameters()) n.push_back(p.name);
  return n;
}
}  // namespace

// ---------------------------------------------------------------- scaled_dot_product_attention

template <class T>
class SdpaTyped : public ::testing::Test {};
TYPED_TEST_SUITE(SdpaTyped, chorus::testing::FloatTypes);

TYPED_TEST(SdpaTyped, IsSoftmaxOfScaledScoresTimesValues) {
  using T = TypeParam;
  manual_seed(1);
  auto q = randn<T>({2, 3, 4, 5}), k = randn<T>({2, 3, 6, 5}), v = randn<T>({2, 3, 6, 7});
  auto expect = matmul(softmax(matmul(q, k.transpose(-2, -1)) / std::sqrt(5.0), -1), v);
  auto out = F::scaled_dot_product_attention(q, k, v);
  EXPECT_EQ(out.shape(), (Shape{2, 3, 4, 7}));
  EXPECT_TRUE(all_close(out, expect, 10 * chorus::testing::tol<T>(), 10 * chorus::testing::tol<T>()));
  // An additive mask is added to the scores; a boolean one keeps its nonzero positions; scale.
  auto fm = randn<T>({4, 6});
  auto keep = ids({1, 0, 1, 1, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 1, 0, 1, 0, 1}, {4, 6});
  auto scores = matmul(q, k.transpose(-2, -1)) * 0.25;
  EXPECT_TRUE(all_close(scaled_dot_product_attention(q, k, v, fm, 0.0, false, 0.25),
                        matmul(softmax(scores + fm, -1), v), 10 * chorus::testing::tol<T>(),
                        10 * chorus::testing::tol<T>()));
  EXPECT_TRUE(all_close(scaled_dot_product_attention(q, k, v, keep, 0.0, false, 0.25),
                        matmul(softmax(masked_fill(scores, eq(keep, 0.0), -kInf), -1), v),
                        10 * chorus::testing::tol<T>(), 10 * chorus::testing::tol<T>()));
}

TEST(Sdpa, GradcheckWithMasksCausalScaleAndBroadcasting) {
  auto keep = ids({1, 0, 1, 1, 0, 1, 1, 1, 1, 0, 0, 1}, {3, 4});
  auto add = r({2, 1, 3, 4}, 9, -2, 2);
  auto sdpa = [](const TL& x, const AttentionMask<double>& m, bool causal, std::optional<double> s) {
    return scaled_dot_product_attention(x[0], x[1], x[2], m, 0.0, causal, s);
  };
  const TL in = {r({2, 2, 3, 4}, 1), r({2, 2, 4, 4}, 2), r({2, 2, 4, 3}, 3)};
  EXPECT_TRUE(gradcheck([&](const TL& x) { return sdpa(x, {}, false, std::nullopt); }, in));
  EXPECT_TRUE(gradcheck([&](const TL& x) { return sdpa(x, keep, false, 0.7); }, in));
  EXPECT_TRUE(gradcheck([&](const TL& x) { return sdpa(x, {}, true, std::nullopt); }, in));
  // A float mask receives gradients too (a learned bias).
  EXPECT_TRUE(gradcheck([&](const TL& x) { return sdpa(x, x[3], false, std::nullopt); }, concat(in, {add})));
  // Keys and values shared across the heads (broadcast batch dimensions).
  EXPECT_TRUE(gradcheck([&](const TL& x) { return sdpa(x, keep, false, std::nullopt); },
                        {r({2, 3, 3, 4}, 4), r({2, 1, 4, 4}, 5), r({4, 2}, 6)}));
}

TEST(Sdpa, FullyMaskedRowsGiveZerosAndZeroGradients) {
  // Note [fully masked rows]: PyTorch 2.5+ gives 0 (at::_safe_softmax), never NaN.
  auto keep = ids({1, 1, 0, 0, 0, 0, 0, 0, 1, 0, 1, 1}, {3, 4});  // query 1 attends no key
  const TL in = {r({2, 3, 4}, 1), r({2, 4, 4}, 2), r({2, 4, 3}, 3)};
  auto out = scaled_dot_product_attention(in[0], in[1], in[2], keep);
  for (double v : out.select(1, 1).to_vector()) EXPECT_EQ(v, 0.0);
  for (double v : out.to_vector()) EXPECT_TRUE(std::isfinite(v));
  EXPECT_TRUE(gradcheck([&](const TL& x) { return scaled_dot_product_attention(x[0], x[1], x[2], keep); }, in));
  // The same with an additive mask of -inf.
  auto add = masked_fill(zeros<double>({3, 4}), eq(keep, 0.0), -kInf);
  auto out2 = scaled_dot_product_attention(in[0], in[1], in[2], add);
  EXPECT_TRUE(all_close(out2, out, 1e-14, 1e-14));
  EXPECT_TRUE(gradcheck([&](const TL& x) { return scaled_dot_product_attention(x[0], x[1], x[2], add); }, in));
}

TEST(Sdpa, DropoutAndEmptyShapes) {
  const TL in = {r({2, 3, 4}, 1), r({2, 5, 4}, 2), r({2, 5, 3}, 3)};
  manual_seed(7);
  auto a = scaled_dot_product_attention(in[0], in[1], in[2], {}, 0.5);
  manual_seed(7);
  auto b = scaled_dot_product_attention(in[0], in[1], in[2], {}, 0.5);
  EXPECT_TRUE(all_close(a, b, 0, 0));  // the default generator decides
  EXPECT_FALSE(all_close(a, scaled_dot_product_attention(in[0], in[1], in[2]), 1e-6, 1e-6));
  for (double v : scaled_dot_product_attention(in[0], in[1], in[2], {}, 1.0).to_vector()) EXPECT_EQ(v, 0.0);
  // No keys: zeros, as PyTorch; an empty batch.
  auto none = scaled_dot_product_attention(in[0], r({2, 0, 4}, 4), r({2, 0, 3}, 5), ones<mask_t>({3, 0}));
  EXPECT_EQ(none.shape(), (Shape{2, 3, 3}));
  for (double v : none.to_vector()) EXPECT_EQ(v, 0.0);
  EXPECT_EQ(
      scaled_dot_product_attention(r({0, 3, 4}, 6), r({0, 5, 4}, 7), r({0, 5, 3}, 8), ones<mask_t>({3, 5})).shape(),
      (Shape{0, 3, 3}));
}

TEST(Sdpa, BadInputIsNamed) {
  auto q = r({2, 3, 4}, 1), k = r({2, 5, 4}, 2), v = r({2, 5, 6}, 3);
  EXPECT_TRUE(throws_with(
      [&] {
        scaled_dot_product_attention(q, k, v, ones<mask_t>({3, 5}), 0.0, true);
      },
      {"attn_mask", "is_causal", "a boolean (int64) mask of shape [3, 5]"}));
  EXPECT_TRUE(throws_with(
      [&] {
        scaled_dot_product_attention(q, k, v, ones<mask_t>({3, 4}));
      },
      {"attn_mask", "a boolean (int64) mask", "[3, 4]", "cannot be broadcast", "[2, 3, 5]"}));
  EXPECT_TRUE(throws_with(
      [&] {
        scaled_dot_product_attention(q, k, v, zeros<double>({4, 3, 5}));
      },
      {"attn_mask", "a float mask", "[4, 3, 5]", "[2, 3, 5]"}));
  EXPECT_TRUE(throws_with(
      [&] {
        scaled_dot_product_attention(q, r({2, 5, 3}, 4), v);
      },
      {"embedding size E", "[2, 5, 3]"}));
  EXPECT_TRUE(throws_with(
      [&] {
        scaled_dot_product_attention(q, k, r({2, 4, 6}, 5));
      },
      {"sequence length S", "[2, 4, 6]"}));
  EXPECT_TRUE(throws_with(
      [&] {
        scaled_dot_product_attention(q, r({3, 5, 4}, 6), r({3, 5, 6}, 7));
      },
      {"cannot be broadcast"}));
  EXPECT_TRUE(throws_with([&] { scaled_dot_product_attention(q, k, v, {}, 1.5); }, {"dropout_p", "1.5"}));
  EXPECT_TRUE(throws_with([&] { scaled_dot_product_attention(r({4}, 8), k, v); }, {"at least 2 dimensions"}));
}

// ---------------------------------------------------------------- MultiheadAttention

TEST(MultiheadAttention, NamesShapesAndInitialisation) {
  manual_seed(3);
  nn::MultiheadAttentionT<double> mha(8, 2);
  EXPECT_EQ(names_of(*mha),
            (std::vector<std::string>{"in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"}));
  EXPECT_EQ(mha->in_proj_weight.shape(), (Shape{24, 8}));
  const double xavier = std::sqrt(6.0 / (8 + 24)), linear = 1 / std::sqrt(8.0);
  EXPECT_LE(amax(abs(mha->in_proj_weight)).item(), xavier);
  EXPECT_GT(amax(abs(mha->in_proj_weight)).item(), 0.8 * xavier);  // not the Linear bound (0.35 < 0.43)
  EXPECT_LE(amax(abs(mha->out_proj->weight)).item(), linear);
  EXPECT_EQ(amax(abs(mha->in_proj_bias)).item(), 0.0);
  EXPECT_EQ(amax(abs(mha->out_proj->bias)).item(), 0.0);

  nn::MultiheadAttentionT<double> sep(6, 3, {.bias = false, .add_bias_kv = true, .kdim = 4, .vdim = 5});
  EXPECT_EQ(names_of(*sep), (std::vector<std::string>{"q_proj_weight", "k_proj_weight", "v_proj_weight", "bias_k",
                                                      "bias_v", "out_proj.weight"}));
  EXPECT_EQ(sep->k_proj_weight.shape(), (Shape{6, 4}));
  EXPECT_EQ(sep->v_proj_weight.shape(), (Shape{6, 5}));
  EXPECT_EQ(sep->bias_k.shape(), (Shape{1, 1, 6}));
  // kdim == vdim == embed_dim given explicitly is the packed layout, as in PyTorch.
  EXPECT_EQ(names_of(nn::MultiheadAttentionImpl<double>(6, 3, {.kdim = 6, .vdim = 6}))[0], "in_proj_weight");
}

TEST(MultiheadAttention, OutputShapesBatchFirstAndUnbatched) {
  manual_seed(4);
  const std::int64_t E = 8, H = 2, L = 4, N = 3, S = 5;
  nn::MultiheadAttentionT<double> mha(E, H, {.kdim = 6, .vdim = 7});
  auto q = r({L, N, E}, 1), k = r({S, N, 6}, 2), v = r({S, N, 7}, 3);
  auto [o, w] = mha(q, k, v);
  EXPECT_EQ(o.shape(), (Shape{L, N, E}));
  EXPECT_EQ(w.shape(), (Shape{N, L, S}));
  EXPECT_TRUE(all_close(sum(w, -1), ones<double>({N, L}), 1e-12, 1e-12));
  auto [o2, w2] = mha(q, k, v, {}, true, {}, /*average_attn_weights=*/false);
  EXPECT_EQ(w2.shape(), (Shape{N, H, L, S}));
  EXPECT_TRUE(all_close(mean(w2, 1), w, 1e-12, 1e-12));
  auto [o3, w3] = mha(q, k, v, {}, false);
  EXPECT_FALSE(w3.defined());
  EXPECT_TRUE(all_close(o3, o, 0, 0));
  // batch_first: the same module on [N, L, E].
  nn::MultiheadAttentionT<double> bf = nn::clone(mha, Device::cpu());
  bf->options.batch_first = true;
  auto [ob, wb] = bf(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1));
  EXPECT_TRUE(all_close(ob.transpose(0, 1), o, 1e-12, 1e-12));
  EXPECT_TRUE(all_close(wb, w, 1e-12, 1e-12));
  // Unbatched [L, E] is batch 1 (the key padding mask [S], a 3-D attn_mask [num_heads, L, S]).
  auto kpm = ids({0, 1, 0, 0, 1}, {S});
  auto am = gt(r({H, L, S}, 4), 0.7);
  auto [ou, wu] = mha(q.select(1, 0), k.select(1, 0), v.select(1, 0), kpm, true, am, false);
  auto [o1, w1] = mha(q.narrow(1, 0, 1), k.narrow(1, 0, 1), v.narrow(1, 0, 1), kpm.unsqueeze(0), true, am, false);
  EXPECT_EQ(ou.shape(), (Shape{L, E}));
  EXPECT_EQ(wu.shape(), (Shape{H, L, S}));
  EXPECT_TRUE(all_close(ou, o1.select(1, 0), 1e-12, 1e-12));
  EXPECT_TRUE(all_close(wu, w1.select(0, 0), 1e-12, 1e-12));
}

TEST(MultiheadAttention, Gradcheck) {
  manual_seed(5);
  const std::int64_t E = 4, H = 2, L = 3, N = 2, S = 4;
  auto kpm = ids({0, 0, 0, 0, 0, 0, 1, 1}, {N, S});
  auto am = ids({0, 1, 0, 0, 0, 0, 1, 0, 1, 0, 0, 0}, {L, S});
  {  // self-attention, both boolean masks, per-head weights
    nn::MultiheadAttentionT<double> mha(E, H);
    EXPECT_TRUE(gradcheck(
        [&](const TL& x) {
          auto [o, w] =
              mha(x[0], x[0], x[0], ids({0, 0, 0, 0, 0, 1}, {N, L}), true, tril(ones<mask_t>({L, L}), -1), false);
          return flat({o, w});
        },
        concat({r({L, N, E}, 1)}, params_of(*mha))));
  }
  {  // separate projections, float key padding mask, add_bias_kv and add_zero_attn, batch_first
    nn::MultiheadAttentionT<double> mha(
        E, H, {.add_bias_kv = true, .add_zero_attn = true, .kdim = 3, .vdim = 5, .batch_first = true});
    auto fkpm = masked_fill(r({N, S}, 7), kpm, -kInf);
    EXPECT_TRUE(gradcheck(
        [&](const TL& x) {
          auto [o, w] = mha(x[0], x[1], x[2], fkpm, true, am);
          return flat({o, w});
        },
        concat({r({N, L, E}, 2), r({N, S, 3}, 3), r({N, S, 5}, 4)}, params_of(*mha))));
  }
}

TEST(MultiheadAttention, FullyMaskedQueriesGiveZeroAttention) {
  // Note [fully masked rows]: the same with and without need_weights (PyTorch's MHA gives NaN
  // with need_weights, 0 without); the output row is out_proj's bias.
  manual_seed(6);
  nn::MultiheadAttentionT<double> mha(4, 2);
  {
    NoGradGuard g;
    mha->out_proj->bias.copy_(r({4}, 9));
  }
  auto x = r({3, 2, 4}, 1);
  auto pad = ids({0, 0, 0, 1, 1, 1}, {2, 3});  // batch element 1 has no keys at all
  for (const AttentionMask<double>& kpm :
       {AttentionMask<double>(pad), AttentionMask<double>(masked_fill(zeros<double>({2, 3}), pad, -kInf))}) {
    SCOPED_TRACE(kpm.describe());
    auto [o, w] = mha(x, x, x, kpm);
    auto [o2, w2] = mha(x, x, x, kpm, false);
    EXPECT_TRUE(all_close(o2, o, 0, 0));
    for (double v : w.select(0, 1).to_vector()) EXPECT_EQ(v, 0.0);
    for (int l = 0; l < 3; ++l) EXPECT_TRUE(all_close(o.select(0, l).select(0, 1), mha->out_proj->bias, 0, 0));
    EXPECT_TRUE(gradcheck(
        [&](const TL& in) {
          auto [y, a] = mha(in[0], in[0], in[0], kpm);
          return flat({y, a});
        },
        concat({x}, params_of(*mha))));
  }
}

TEST(MultiheadAttention, DropoutOnlyWhileTraining) {
  manual_seed(7);
  nn::MultiheadAttentionT<double> mha(4, 2, {.dropout = 0.5});
  auto x = r({3, 2, 4}, 1);
  auto [a, wa] = mha(x, x, x);
  mha->eval();
  auto [b, wb] = mha(x, x, x);
  auto [c, wc] = mha(x, x, x);
  EXPECT_TRUE(all_close(b, c, 0, 0));
  EXPECT_FALSE(all_close(a, b, 1e-6, 1e-6));
  EXPECT_TRUE(all_close(sum(wb, -1), ones<double>({2, 3}), 1e-12, 1e-12));
}

TEST(MultiheadAttention, BadOptionsAndMasksAreNamed) {
  EXPECT_TRUE(
      throws_with([] { nn::MultiheadAttention(6, 4); }, {"embed_dim must be divisible by num_heads", "6", "4"}));
  EXPECT_TRUE(throws_with([] { nn::MultiheadAttention(8, 0); }, {"num_heads", "positive"}));
  EXPECT_TRUE(throws_with([] { nn::MultiheadAttention(8, 2, {.dropout = 2}); }, {"dropout", "[0, 1]"}));
  nn::MultiheadAttentionT<double> mha(8, 2);
  auto q = r({4, 3, 8}, 1), k = r({5, 3, 8}, 2);
  EXPECT_TRUE(throws_with(
      [&] {
        mha(q, k, k, ones<mask_t>({5, 3}));
      },
      {"key_padding_mask", "[3, 5]", "a boolean (int64) mask of shape [5, 3]"}));
  EXPECT_TRUE(throws_with(
      [&] {
        mha(q, k, k, zeros<double>({3, 4}));
      },
      {"key_padding_mask", "a float mask of shape [3, 4]"}));
  EXPECT_TRUE(throws_with(
      [&] {
        mha(q, k, k, {}, true, ones<mask_t>({5, 4}));
      },
      {"2-D attn_mask", "[4, 5]", "a boolean (int64) mask of shape [5, 4]"}));
  EXPECT_TRUE(throws_with(
      [&] {
        mha(q, k, k, {}, true, zeros<double>({3, 4, 5}));
      },
      {"3-D attn_mask", "[6, 4, 5]", "a float mask of shape [3, 4, 5]"}));
  EXPECT_TRUE(throws_with([&] { mha(q, k, k, {}, true, zeros<double>({1, 2, 4, 5})); }, {"attn_mask", "2-D", "3-D"}));
  EXPECT_TRUE(throws_with([&] { mha(q, k, k, {}, true, {}, true, true); }, {"is_causal", "needs attn_mask"}));
  EXPECT_TRUE(throws_with([&] { mha(r({4, 3, 6}, 3), k, k); }, {"embed_dim = 8", "[4, 3, 6]"}));
  EXPECT_TRUE(throws_with([&] { mha(q, r({5, 2, 8}, 4), r({5, 2, 8}, 5)); }, {"batch size", "[5, 2, 8]"}));
  EXPECT_TRUE(throws_with([&] { mha(q, k.select(1, 0), k.select(1, 0)); }, {"3-D", "[5, 8]"}));
  EXPECT_TRUE(throws_with([&] { mha(r({8}, 6), k, k); }, {"query must be 3-D", "2-D"}));
}

// ---------------------------------------------------------------- Transformer layers

TEST(Transformer, LayerNamesOptionsAndErrors) {
  nn::TransformerEncoderLayerT<double> enc(8, 2, {.dim_feedforward = 16});
  EXPECT_EQ(names_of(*enc),
            (std::vector<std::string>{"self_attn.in_proj_weight", "self_attn.in_proj_bias", "self_attn.out_proj.weight",
                                      "self_attn.out_proj.bias", "linear1.weight", "linear1.bias", "linear2.weight",
                                      "linear2.bias", "norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias"}));
  EXPECT_EQ(enc->options.dim_feedforward, 16);
  EXPECT_EQ(enc->options.dropout, 0.1);  // PyTorch's defaults
  EXPECT_EQ(nn::TransformerEncoderLayer(8, 2)->options.dim_feedforward, 2048);
  // bias = false: no bias anywhere (attention, feed-forward, norms).
  nn::TransformerDecoderLayerT<double> dec(8, 2, {.dim_feedforward = 16, .bias = false});
  EXPECT_EQ(names_of(*dec), (std::vector<std::string>{"self_attn.in_proj_weight", "self_attn.out_proj.weight",
                                                      "multihead_attn.in_proj_weight", "multihead_attn.out_proj.weight",
                                                      "linear1.weight", "linear2.weight", "norm1.weight",
                                                      "norm2.weight", "norm3.weight"}));
  EXPECT_TRUE(throws_with([] { nn::TransformerEncoderLayer(8, 2, {.activation = "tanh"}); },
                          {"TransformerEncoderLayer", "activation should be relu/gelu, not 'tanh'"}));
  EXPECT_TRUE(
      throws_with([] { nn::TransformerDecoderLayer(6, 4); }, {"TransformerDecoderLayer", "divisible", "6", "4"}));
  EXPECT_TRUE(throws_with([] { nn::TransformerEncoderLayer(8, 2, {.dim_feedforward = 0}); }, {"dim_feedforward"}));
  EXPECT_TRUE(throws_with([] { nn::TransformerEncoderLayer(8, 2, {.layer_norm_eps = 0}); }, {"layer_norm_eps"}));
  EXPECT_TRUE(throws_with([&] { enc(r({4, 3, 8}, 1), {}, {}, true); }, {"is_causal", "attn_mask"}));
}

TEST(Transformer, EncoderLayersAreDeepCopies) {
  manual_seed(8);
  nn::TransformerEncoderLayerT<double> layer(8, 2, {.dim_feedforward = 16});
  nn::TransformerEncoderT<double> enc(layer, 3, nn::LayerNormT<double>(8));
  EXPECT_EQ(enc->num_layers(), 3);
  EXPECT_EQ(names_of(*enc).size(), 3 * 12 + 2u);
  EXPECT_EQ(names_of(*enc).front(), "layers.0.self_attn.in_proj_weight");
  EXPECT_EQ(names_of(*enc).back(), "norm.bias");
  auto w0 = enc->layers[0]->linear1->weight, w1 = enc->layers[1]->linear1->weight;
  EXPECT_TRUE(all_close(w0, layer->linear1->weight, 0, 0));  // copies of the layer's weights...
  EXPECT_FALSE(is_same(w0, w1));                             // ...in tensors of their own
  {
    NoGradGuard g;
    w0.fill_(1.0);
  }
  EXPECT_FALSE(all_close(w1, w0, 0, 0));
  EXPECT_FALSE(all_close(layer->linear1->weight, w0, 0, 0));
  EXPECT_EQ(names_of(*nn::TransformerEncoderT<double>(layer, 2)).back(), "layers.1.norm2.bias");  // no norm
}

TEST(Transformer, GradcheckEncoderAndDecoderLayers) {
  manual_seed(9);
  const std::int64_t E = 4, H = 2, L = 3, S = 4, N = 2;
  auto causal = nn::generate_square_subsequent_mask<double>(L);
  auto kpm = ids({0, 0, 0, 0, 1, 1}, {N, L});
  for (bool norm_first : {false, true}) {
    SCOPED_TRACE(norm_first ? "pre-norm" : "post-norm");
    nn::TransformerEncoderLayerT<double> enc(
        E, H, {.dim_feedforward = 6, .dropout = 0.0, .activation = "gelu", .norm_first = norm_first});
    EXPECT_TRUE(gradcheck([&](const TL& x) { return enc(x[0], causal, kpm, true); },
                          concat({r({L, N, E}, 1)}, params_of(*enc))));
    nn::TransformerDecoderLayerT<double> dec(
        E, H,
        {.dim_feedforward = 6, .dropout = 0.0, .activation = "gelu", .batch_first = true, .norm_first = norm_first});
    auto mem_kpm = ids({0, 0, 0, 1, 0, 1, 0, 0}, {N, S});
    EXPECT_TRUE(gradcheck([&](const TL& x) { return dec(x[0], x[1], causal, {}, kpm, mem_kpm, true); },
                          concat({r({N, L, E}, 2), r({N, S, E}, 3)}, params_of(*dec))));
  }
}

TEST(Transformer, TransformerAndUnbatchedInput) {
  manual_seed(10);
  nn::TransformerT<double> t({.d_model = 8,
                              .nhead = 2,
                              .num_encoder_layers = 2,
                              .num_decoder_layers = 1,
                              .dim_feedforward = 16,
                              .dropout = 0.0,
                              .batch_first = true});
  auto names = names_of(*t);
  EXPECT_EQ(names.front(), "encoder.layers.0.self_attn.in_proj_weight");
  EXPECT_EQ(names.back(), "decoder.norm.bias");
  // Every matrix re-drawn with xavier_uniform_ (PyTorch's Transformer._reset_parameters): the
  // attention projections' biases stay zero.
  EXPECT_LE(amax(abs(t->encoder->layers[0]->linear1->weight)).item(), std::sqrt(6.0 / 24));
  EXPECT_EQ(amax(abs(t->encoder->layers[0]->self_attn->in_proj_bias)).item(), 0.0);
  auto src = r({2, 5, 8}, 1), tgt = r({2, 4, 8}, 2);
  auto mask = nn::Transformer::generate_square_subsequent_mask(4).to<double>();
  auto y = t(src, tgt, {}, mask, {}, {}, {}, {}, false, true);
  EXPECT_EQ(y.shape(), (Shape{2, 4, 8}));
  auto yu = t(src.select(0, 1), tgt.select(0, 1), {}, mask, {}, {}, {}, {}, false, true);  // unbatched
  EXPECT_TRUE(all_close(yu, y.select(0, 1), 1e-12, 1e-12));
  EXPECT_TRUE(throws_with([&] { t(src, r({3, 4, 8}, 3)); }, {"batch number of src and tgt", "[3, 4, 8]"}));
  EXPECT_TRUE(throws_with([&] { t(src, r({2, 4, 6}, 4)); }, {"feature number", "d_model = 8"}));
  // The causal mask: 0 on and below the diagonal, -inf above.
  EXPECT_TRUE(chorus::testing::values_are(nn::generate_square_subsequent_mask<double>(3),
                                          std::vector<double>{0, -kInf, -kInf, 0, 0, -kInf, 0, 0, 0}));
}

TEST(Transformer, SaveAndLoadUsePyTorchsNames) {
  manual_seed(11);
  nn::TransformerEncoderT<double> a(nn::TransformerEncoderLayerT<double>(8, 2, {.dim_feedforward = 16, .dropout = 0.0}),
                                    2, nn::LayerNormT<double>(8));
  nn::TransformerEncoderT<double> b(nn::TransformerEncoderLayerT<double>(8, 2, {.dim_feedforward = 16, .dropout = 0.0}),
                                    2, nn::LayerNormT<double>(8));
  {
    NoGradGuard g;
    for (auto& p : a->parameters()) p.as<double>().copy_(randn<double>(p.shape()));  // non-default values
  }
  const auto path =
      (std::filesystem::temp_directory_path() / ("chorus_attention_" + std::to_string(::getpid()) + ".safetensors"))
          .string();
  save(a, path);
  auto file = io::read(path);
  std::vector<std::string> keys;
  for (auto& [k, rec] : file.tensors) keys.push_back(k);
  auto want = names_of(*a);
  std::sort(want.begin(), want.end());
  EXPECT_EQ(keys, want);
  EXPECT_NE(std::find(keys.begin(), keys.end(), "layers.1.self_attn.out_proj.weight"), keys.end());
  auto x = r({5, 3, 8}, 1);
  EXPECT_FALSE(all_close(b(x), a(x), 1e-6, 1e-6));
  load(b, path);
  EXPECT_TRUE(all_close(b(x), a(x), 0, 0));
  std::filesystem::remove(path);
}

// ---------------------------------------------------------------- DataParallel and training

namespace {
/// A batch_first encoder whose causal mask is made inside forward, on the replica's device: the
/// mask is not an argument, so DataParallel only splits the batch.
struct CausalEncoder : nn::Module {
  nn::TransformerEncoderT<double> enc;
  CausalEncoder()
      : enc(register_module("enc", nn::TransformerEncoderT<double>(
                                       nn::TransformerEncoderLayerT<double>(
                                           8, 2, {.dim_feedforward = 16, .dropout = 0.0, .batch_first = true}),
                                       2, nn::LayerNormT<double>(8)))) {}
  Tensor<double> forward(const Tensor<double>& x) {
    return enc(x, nn::generate_square_subsequent_mask<double>(x.shape()[1], x.device()), {}, true);
  }
};
}  // namespace

TEST(AttentionDataParallel, EncoderGradientsEqualTheSingleDeviceRun) {
  set_cpu_device_count(std::max(cpu_device_count(), 3));
  manual_seed(12);
  CausalEncoder reference;
  for (int k = 1; k <= 3; ++k) {
    SCOPED_TRACE(std::to_string(k) + " devices");
    std::vector<Device> devices;
    for (int i = 0; i < k; ++i) devices.push_back(Device::cpu(i));
    DataParallel<CausalEncoder> dp(nn::clone(reference, Device::cpu(0)), devices);
    dp.set_inline_work(0);  // each replica on its device's worker thread
    for (std::int64_t batch : {5, 7}) {
      auto x = r({batch, 6, 8}, 20 + batch), w = r({batch, 6, 8}, 30 + batch);
      reference.zero_grad();
      dp.zero_grad();
      auto ref = reference.forward(x);
      auto out = dp(x);
      EXPECT_TRUE(all_close(out, ref, 1e-12, 1e-12));
      sum(ref * w).backward();
      sum(out * w).backward();
      auto pa = reference.named_parameters(), pb = dp.named_parameters();
      ASSERT_EQ(pa.size(), pb.size());
      for (std::size_t i = 0; i < pa.size(); ++i)
        EXPECT_TRUE(all_close(pb[i].tensor.as<double>().grad(), pa[i].tensor.as<double>().grad(), 1e-11, 1e-11))
            << pa[i].name;
    }
  }
  // A mask passed as an argument is not split or moved to the replicas' devices (per-argument
  // scattering is a later item): refused with the reason, not used wrongly.
  DataParallel<nn::TransformerEncoderT<double>> dp(nn::clone(reference.enc, Device::cpu(0)),
                                                   {Device::cpu(0), Device::cpu(1)});
  auto mask = nn::generate_square_subsequent_mask<double>(6);
  EXPECT_TRUE(throws_with([&] { dp(r({4, 6, 8}, 40), AttentionMask<double>(mask)); }, {"attn_mask", "cpu:0", "cpu:1"}));
}

TEST(AttentionTraining, LossFalls) {
  // Each position must predict the mean of its sequence: only attention can see the others.
  manual_seed(13);
  struct Net : nn::Module {
    nn::Linear embed, head;
    nn::TransformerEncoder enc;
    Net()
        : embed(register_module("embed", nn::Linear(3, 16))),
          head(register_module("head", nn::Linear(16, 3))),
          enc(register_module(
              "enc", nn::TransformerEncoder(
                         nn::TransformerEncoderLayer(
                             16, 2, {.dim_feedforward = 32, .dropout = 0.0, .batch_first = true, .norm_first = true}),
                         1))) {}
    Tensor<float> forward(const Tensor<float>& x) { return head(enc(embed(x))); }
  } net;
  optim::Adam opt(net.parameters(), {.lr = 3e-3});
  auto x = randn<float>({64, 6, 3});
  auto y = mean(x, 1, true).expand({64, 6, 3}).contiguous();
  float first = 0, last = 0;
  for (int step = 0; step < 150; ++step) {
    auto loss = F::mse_loss(net.forward(x), y);
    opt.zero_grad();
    loss.backward();
    opt.step();
    (step == 0 ? first : last) = loss.item();
  }
  EXPECT_LT(last, 0.2f * first) << "loss " << first << " -> " << last;
}
