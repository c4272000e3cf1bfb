// Attention and Transformers against LibTorch (Debian libtorch-dev 1.13.1) in float64: LibTorch's
// parameters are copied into chorus by name (the two name lists must be equal, in order), then
// the outputs and ALL gradients (inputs and every parameter) must agree to 1e-10. LibTorch 1.13's
// C++ API lacks scaled_dot_product_attention, norm_first, batch_first, layer_norm_eps and 3-D
// attention masks in MultiheadAttention, and reads a boolean attn_mask as a number: those cases
// are checked against references written here with LibTorch's operators and modules (with
// PyTorch's parameter names). Skips where LibTorch was not found.
#include <functional>
#include <limits>

#include "libtorch_util.hpp"


#if CHORUS_HAVE_LIBTORCH
namespace {
using chorus::testing::from_torch;
using chorus::testing::sizes_of;
using chorus::testing::to_torch;
using namespace chorus;
using CL = std::vector<Tensor<double>>;
using TL = std::vector<torch::Tensor>;
using I64 = std::vector<std::int64_t>;
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kTol = 1e-10;


::testing::AssertionResult same(const Tensor<double>& ours, const torch::Tensor& theirs, const std::string& what) {
  if (sizes_of(ours.shape()) != theirs.sizes().vec())
    return ::testing::AssertionFailure() << what << ": shape " << ours.shape() << " vs LibTorch's " << theirs.sizes();
  auto a = ours.to_vector();
  auto b = theirs.detach().contiguous().to(torch::kFloat64);
  const double* pb = b.data_ptr<double>();
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i] == pb[i]) continue;  // also equal infinities
    if (!(std::abs(a[i] - pb[i]) <= kTol * (1 + std::abs(pb[i]))))
      return ::testing::AssertionFailure() << what << ": element " << i << ": " << a[i] << " vs LibTorch's " << pb[i];
  }
  return ::testing::AssertionSuccess();
}

Tensor<double> r(const Shape& s, std::uint64_t seed, double lo = -1, double hi = 1) {
  Generator g(seed);
  return rand<double>(s, Device::cpu(), lo, hi, g);
}
Tensor<mask_t> ids(const I64& v, const Shape& s) { return from_vector<mask_t>(v, s); }
/// An additive mask: -inf where `m` is nonzero, else 0 (plus `extra`, when given).
Tensor<double> additive(const Tensor<mask_t>& m, const Tensor<double>& extra = {}) {
  auto a = masked_fill(zeros<double>(m.shape()), m, -kInf);
  return extra.defined() ? a + extra : a;
}

/// Randomises LibTorch's parameters (its zero biases would hide nothing, but random ones show more).
void randomise(torch::nn::Module& m, std::uint64_t seed) {
  torch::manual_seed(seed);
  torch::NoGradGuard g;
  for (auto& p : m.named_parameters()) p.value().uniform_(-0.6, 0.6);
}

/// Copies every LibTorch parameter into the chorus parameter of the same name: the name lists
/// (PyTorch's state_dict order) must be equal, and so the shapes.
void copy_parameters(torch::nn::Module& from, nn::Module& to) {
  std::vector<std::string> theirs, ours;
  for (auto& p : from.named_parameters()) theirs.push_back(p.key());
  for (auto& p : to.named_parameters()) ours.push_back(p.name);
  ASSERT_EQ(ours, theirs);
  NoGradGuard g;
  for (auto& p : from.named_parameters()) {
    auto& c = to.find_tensor(p.key()).as<double>();
    ASSERT_EQ(sizes_of(c.shape()), p.value().sizes().vec()) << p.key();
    c.copy_(from_torch(p.value()));
  }
}

using Ours = std::function<CL(const CL&)>;
using Theirs = std::function<TL(const TL&)>;

/// Runs both on the same inputs: every output, then (through one random weighting of all
/// outputs) the gradient of every input and of every parameter.
void cross(const std::string& what, nn::Module& cm, torch::nn::Module& tm, const CL& inputs, const Ours& ours,
           const Theirs& theirs) {
  SCOPED_TRACE(what);
  CL a;
  TL b;
  for (const auto& x : inputs) {
    a.push_back(x.detach().clone().requires_grad_(true));
    b.push_back(to_torch(x).requires_grad_(true));
  }
  cm.zero_grad();
  tm.zero_grad();
  auto oa = ours(a);
  auto ob = theirs(b);
  ASSERT_EQ(oa.size(), ob.size());
  Tensor<double> la = zeros<double>({});
  torch::Tensor lb = torch::zeros({}, torch::kFloat64);
  for (std::size_t i = 0; i < oa.size(); ++i) {
    ASSERT_TRUE(same(oa[i].detach(), ob[i], "output " + std::to_string(i)));
    auto w = r(oa[i].shape(), 100 + i, -1, 1);
    la = la + sum(oa[i] * w);
    lb = lb + (ob[i] * to_torch(w)).sum();
  }
  la.backward();
  lb.backward();
  for (std::size_t i = 0; i < a.size(); ++i) {
    ASSERT_TRUE(a[i].grad().defined() && b[i].grad().defined()) << "input " << i << " has no gradient";
    EXPECT_TRUE(same(a[i].grad(), b[i].grad(), "gradient of input " + std::to_string(i)));
  }
  for (auto& p : tm.named_parameters()) {
    auto g = cm.find_tensor(p.key()).as<double>().grad();
    ASSERT_TRUE(g.defined() && p.value().grad().defined()) << p.key() << " has no gradient";
    EXPECT_TRUE(same(g, p.value().grad(), "gradient of " + p.key()));
  }
}

void use_float64() { torch::set_default_dtype(caffe2::TypeMeta::Make<double>()); }

/// softmax(q kᵀ·scale + mask) v written with LibTorch's operators, zero for rows whose scores are
/// all -inf (PyTorch 2.5's _safe_softmax, the same formula chorus uses: Note [fully masked rows]).
torch::Tensor torch_sdpa(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                         const torch::Tensor& add_mask, double scale) {
  auto s = torch::matmul(q, k.transpose(-2, -1)) * scale;
  if (add_mask.defined()) s = s + add_mask;
  auto dead = std::get<0>(s.detach().max(-1, true)).eq(-kInf);
  auto zero = torch::zeros({}, torch::kFloat64);
  auto attn = torch::where(dead, zero, torch::softmax(torch::where(dead, zero, s), -1));
  return torch::matmul(attn, v);
}
struct NoModule : torch::nn::Module {};
}  // namespace

TEST(LibTorchAttention, ScaledDotProductAttentionMasksCausalScaleAndBroadcasting) {
  use_float64();
  nn::Module none;
  NoModule tnone;
  auto sdpa = [](const CL& x, const AttentionMask<double>& m, bool causal, std::optional<double> scale) {
    return CL{scaled_dot_product_attention(x[0], x[1], x[2], m, 0.0, causal, scale)};
  };
  const CL in = {r({2, 3, 4, 5}, 1), r({2, 3, 6, 5}, 2), r({2, 3, 6, 7}, 3)};
  const double s0 = 1 / std::sqrt(5.0);
  cross(
      "no mask", none, tnone, in, [&](const CL& x) { return sdpa(x, {}, false, std::nullopt); },
      [&](const TL& x) { return TL{torch_sdpa(x[0], x[1], x[2], {}, s0)}; });
  cross(
      "scale", none, tnone, in, [&](const CL& x) { return sdpa(x, {}, false, 0.3); },
      [&](const TL& x) { return TL{torch_sdpa(x[0], x[1], x[2], {}, 0.3)}; });
  // Boolean: nonzero takes part (PyTorch's True); broadcast [L, S] and [B, 1, L, S].
  auto keep = ids({1, 1, 0, 1, 0, 1, 0, 1, 1, 1, 1, 0, 1, 1, 1, 0, 1, 1, 1, 1, 0, 0, 1, 1}, {4, 6});
  auto keep_t = to_torch(keep).to(torch::kBool);
  auto drop_add = torch::zeros({4, 6}, torch::kFloat64).masked_fill(keep_t.logical_not(), -kInf);
  cross(
      "boolean mask", none, tnone, in, [&](const CL& x) { return sdpa(x, keep, false, std::nullopt); },
      [&](const TL& x) { return TL{torch_sdpa(x[0], x[1], x[2], drop_add, s0)}; });
  auto fmask = r({2, 1, 4, 6}, 4, -2, 2);
  cross(
      "float mask", none, tnone, in, [&](const CL& x) { return sdpa(x, fmask, false, std::nullopt); },
      [&](const TL& x) { return TL{torch_sdpa(x[0], x[1], x[2], to_torch(fmask), s0)}; });
  // Causal with L != S: top-left aligned (query i sees keys 0..i).
  auto causal_add = torch::ones({4, 6}, torch::kBool).tril().logical_not();
  cross(
      "is_causal", none, tnone, in, [&](const CL& x) { return sdpa(x, {}, true, std::nullopt); },
      [&](const TL& x) {
        return TL{
            torch_sdpa(x[0], x[1], x[2], torch::zeros({4, 6}, torch::kFloat64).masked_fill(causal_add, -kInf), s0)};
      });
  // Keys and values shared by the heads (broadcast batch dimensions), 3-D query.
  const CL bc = {r({3, 4, 5}, 5), r({1, 6, 5}, 6), r({6, 7}, 7)};
  cross(
      "broadcast batch", none, tnone, bc, [&](const CL& x) { return sdpa(x, keep, false, std::nullopt); },
      [&](const TL& x) { return TL{torch_sdpa(x[0], x[1], x[2], drop_add, s0)}; });
  // A fully masked row gives zeros and zero gradients (PyTorch >= 2.5).
  auto dead = ids({0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 1}, {4, 6});
  auto dead_add =
      torch::zeros({4, 6}, torch::kFloat64).masked_fill(to_torch(dead).to(torch::kBool).logical_not(), -kInf);
  cross(
      "fully masked rows", none, tnone, in, [&](const CL& x) { return sdpa(x, dead, false, std::nullopt); },
      [&](const TL& x) { return TL{torch_sdpa(x[0], x[1], x[2], dead_add, s0)}; });
  auto out = scaled_dot_product_attention(in[0], in[1], in[2], dead);
  for (double v : out.select(2, 0).to_vector()) EXPECT_EQ(v, 0.0);
}

namespace {
/// Key padding (nonzero = padding) and attention masks (nonzero = forbidden) for L = 4, N = 3,
/// S = 5 that leave every query at least one key.
Tensor<mask_t> padding_mask() { return ids({0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0}, {3, 5}); }
Tensor<mask_t> forbidden_mask() { return ids({0, 1, 0, 1, 0, 0, 0, 1, 0, 1, 1, 0, 0, 0, 1, 0, 1, 0, 0, 0}, {4, 5}); }
torch::Tensor as_bool(const Tensor<mask_t>& m) { return to_torch(m).to(torch::kBool); }
Tensor<double> tr(const Tensor<double>& t) { return t.transpose(0, 1); }
}  // namespace

TEST(LibTorchAttention, MultiheadAttentionMasksBatchFirstAndWeights) {
  use_float64();
  const std::int64_t E = 8, H = 2, L = 4, N = 3, S = 5;
  torch::nn::MultiheadAttention tm(torch::nn::MultiheadAttentionOptions(E, H).dropout(0.0));
  randomise(*tm, 1);
  auto kpm = padding_mask(), am = forbidden_mask();
  auto am_float = r({L, S}, 9, -1, 1);  // finite values added to the scores, and -inf where forbidden
  auto am_add = additive(am, am_float);
  for (bool batch_first : {false, true}) {
    nn::MultiheadAttentionT<double> cm(E, H, {.batch_first = batch_first});
    copy_parameters(*tm, *cm);
    auto in = [&](const Tensor<double>& x) { return batch_first ? tr(x).contiguous() : x; };
    auto out = [&](const Tensor<double>& y) { return batch_first ? tr(y) : y; };
    const std::string bf = batch_first ? " (batch_first)" : "";
    // Self-attention: one tensor as query, key and value.
    const CL self = {r({L, N, E}, 2)};
    for (bool average : {true, false})
      cross(
          "self-attention, weights" + std::string(average ? " averaged" : " per head") + bf, *cm, *tm, self,
          [&](const CL& x) {
            auto q = in(x[0]);
            auto [o, w] = cm(q, q, q, {}, true, {}, average);
            return CL{out(o), w};
          },
          [&](const TL& x) {
            auto [o, w] = tm->forward(x[0], x[0], x[0], {}, true, {}, average);
            return TL{o, w};
          });
    // Both masks, in their boolean and float forms, against LibTorch's boolean padding mask and
    // float attention mask; query, key and value distinct.
    const CL qkv = {r({L, N, E}, 3), r({S, N, E}, 4), r({S, N, E}, 5)};
    using M = AttentionMask<double>;
    const std::vector<std::tuple<std::string, M, M, torch::Tensor>> forms = {
        {"boolean masks", kpm, am, to_torch(additive(am))},
        {"float masks", additive(kpm), additive(am), to_torch(additive(am))},
        {"boolean padding, float attn_mask with values", kpm, am_add, to_torch(am_add)},
        {"padding mask only", kpm, {}, torch::Tensor()},
        {"attn_mask only", {}, am, to_torch(additive(am))}};
    for (const auto& [name, ck, ca, ta] : forms) {
      const bool has_kpm = ck.defined();
      cross(
          name + bf, *cm, *tm, qkv,
          [&, ck = ck, ca = ca](const CL& x) {
            auto [o, w] = cm(in(x[0]), in(x[1]), in(x[2]), ck, true, ca);
            return CL{out(o), w};
          },
          [&, ta = ta](const TL& x) {
            auto [o, w] = tm->forward(x[0], x[1], x[2], has_kpm ? as_bool(kpm) : torch::Tensor(), true, ta);
            return TL{o, w};
          });
    }
    // need_weights = false: an undefined weights tensor, the same output.
    auto [o, w] = cm(in(qkv[0]), in(qkv[1]), in(qkv[2]), kpm, false, am);
    EXPECT_FALSE(w.defined());
    auto [to, tw] =
        tm->forward(to_torch(qkv[0]), to_torch(qkv[1]), to_torch(qkv[2]), as_bool(kpm), false, to_torch(additive(am)));
    EXPECT_TRUE(same(out(o), to, "need_weights = false" + bf));
  }
}

TEST(LibTorchAttention, MultiheadAttentionKdimVdimBiasKvZeroAttn) {
  use_float64();
  const std::int64_t E = 6, H = 3, L = 4, N = 3, S = 5;
  auto kpm = padding_mask(), am = forbidden_mask();
  struct Case {
    std::string name;
    std::int64_t kdim, vdim;
    bool bias, bias_kv, zero_attn;
  };
  for (const auto& c :
       {Case{"kdim = vdim != embed_dim", 4, 4, true, false, false}, Case{"no bias", 6, 6, false, false, false},
        Case{"add_bias_kv", 6, 6, true, true, false}, Case{"add_zero_attn", 5, 5, true, false, true},
        Case{"add_bias_kv and add_zero_attn", 6, 6, true, true, true}}) {
    torch::nn::MultiheadAttention tm(torch::nn::MultiheadAttentionOptions(E, H)
                                         .kdim(c.kdim)
                                         .vdim(c.vdim)
                                         .bias(c.bias)
                                         .add_bias_kv(c.bias_kv)
                                         .add_zero_attn(c.zero_attn));
    randomise(*tm, 2);
    nn::MultiheadAttentionT<double> cm(
        E, H, {.bias = c.bias, .add_bias_kv = c.bias_kv, .add_zero_attn = c.zero_attn, .kdim = c.kdim, .vdim = c.vdim});
    copy_parameters(*tm, *cm);
    const CL qkv = {r({L, N, E}, 3), r({S, N, c.kdim}, 4), r({S, N, c.vdim}, 5)};
    for (bool masks : {false, true})
      cross(
          c.name + (masks ? ", masks" : ""), *cm, *tm, qkv,
          [&](const CL& x) {
            auto [o, w] = masks ? cm(x[0], x[1], x[2], kpm, true, am) : cm(x[0], x[1], x[2]);
            return CL{o, w};
          },
          [&](const TL& x) {
            auto [o, w] = masks ? tm->forward(x[0], x[1], x[2], as_bool(kpm), true, to_torch(additive(am)))
                                : tm->forward(x[0], x[1], x[2]);
            return TL{o, w};
          });
  }
}

TEST(LibTorchAttention, MultiheadAttentionThreeDimensionalMask) {
  // LibTorch 1.13's MultiheadAttention takes 2-D masks only: the reference is its projections and
  // the attention written with its operators.
  use_float64();
  const std::int64_t E = 8, H = 2, L = 4, N = 3, S = 5, hd = E / H;
  torch::nn::MultiheadAttention tm(torch::nn::MultiheadAttentionOptions(E, H));
  randomise(*tm, 3);
  nn::MultiheadAttentionT<double> cm(E, H);
  copy_parameters(*tm, *cm);
  auto m3 = r({N * H, L, S}, 6, -3, 1);  // per batch element and head
  auto forbid = gt(m3, 0.5);             // a boolean form of it
  auto reference = [&](const TL& x, const torch::Tensor& add) {
    auto w = tm->in_proj_weight, b = tm->in_proj_bias;
    auto q = torch::nn::functional::linear(x[0], w.slice(0, 0, E), b.slice(0, 0, E));
    auto k = torch::nn::functional::linear(x[1], w.slice(0, E, 2 * E), b.slice(0, E, 2 * E));
    auto v = torch::nn::functional::linear(x[2], w.slice(0, 2 * E), b.slice(0, 2 * E));
    auto heads = [&](const torch::Tensor& t) { return t.reshape({t.size(0), N * H, hd}).transpose(0, 1); };
    auto o = torch_sdpa(heads(q), heads(k), heads(v), add, 1 / std::sqrt(double(hd)));  // [N*H, L, hd]
    return TL{tm->out_proj(o.transpose(0, 1).reshape({L, N, E}))};
  };
  const CL qkv = {r({L, N, E}, 3), r({S, N, E}, 4), r({S, N, E}, 5)};
  cross(
      "3-D float mask", *cm, *tm, qkv,
      [&](const CL& x) { return CL{std::get<0>(cm(x[0], x[1], x[2], {}, false, m3))}; },
      [&](const TL& x) { return reference(x, to_torch(m3)); });
  cross(
      "3-D boolean mask", *cm, *tm, qkv,
      [&](const CL& x) { return CL{std::get<0>(cm(x[0], x[1], x[2], {}, false, forbid))}; },
      [&](const TL& x) { return reference(x, to_torch(additive(forbid))); });
}

namespace {
/// PyTorch 2.x's pre-norm (norm_first) encoder layer from LibTorch's modules, named as PyTorch names them.
struct TorchPreNormEncoderLayerImpl : torch::nn::Module {
  torch::nn::MultiheadAttention self_attn{nullptr};
  torch::nn::Linear linear1{nullptr}, linear2{nullptr};
  torch::nn::LayerNorm norm1{nullptr}, norm2{nullptr};
  bool gelu;
  TorchPreNormEncoderLayerImpl(int64_t d, int64_t h, int64_t ff, bool gelu, double eps) : gelu(gelu) {
    self_attn = register_module("self_attn", torch::nn::MultiheadAttention(torch::nn::MultiheadAttentionOptions(d, h)));
    linear1 = register_module("linear1", torch::nn::Linear(d, ff));
    linear2 = register_module("linear2", torch::nn::Linear(ff, d));
    norm1 = register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d}).eps(eps)));
    norm2 = register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d}).eps(eps)));
  }
  torch::Tensor ff(const torch::Tensor& x) {
    auto h = linear1(x);
    return linear2(gelu ? torch::gelu(h) : torch::relu(h));
  }
  torch::Tensor forward(torch::Tensor x, const torch::Tensor& mask, const torch::Tensor& kpm) {
    auto h = norm1(x);
    x = x + std::get<0>(self_attn(h, h, h, kpm, false, mask));
    return x + ff(norm2(x));
  }
};
TORCH_MODULE(TorchPreNormEncoderLayer);

/// The pre-norm decoder layer, likewise.
struct TorchPreNormDecoderLayerImpl : TorchPreNormEncoderLayerImpl {
  torch::nn::MultiheadAttention multihead_attn{nullptr};
  torch::nn::LayerNorm norm3{nullptr};
  TorchPreNormDecoderLayerImpl(int64_t d, int64_t h, int64_t ff, bool gelu, double eps)
      : TorchPreNormEncoderLayerImpl(d, h, ff, gelu, eps) {
    multihead_attn =
        register_module("multihead_attn", torch::nn::MultiheadAttention(torch::nn::MultiheadAttentionOptions(d, h)));
    norm3 = register_module("norm3", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d}).eps(eps)));
  }
  torch::Tensor forward(torch::Tensor x, const torch::Tensor& mem, const torch::Tensor& tgt_mask,
                        const torch::Tensor& mem_mask, const torch::Tensor& tgt_kpm, const torch::Tensor& mem_kpm) {
    auto h = norm1(x);
    x = x + std::get<0>(self_attn(h, h, h, tgt_kpm, false, tgt_mask));
    x = x + std::get<0>(multihead_attn(norm2(x), mem, mem, mem_kpm, false, mem_mask));
    return x + ff(norm3(x));
  }
};
TORCH_MODULE(TorchPreNormDecoderLayer);

/// Our name order for the hand-made pre-norm modules (theirs registers in another order).
void copy_by_name(torch::nn::Module& from, nn::Module& to) {
  std::vector<std::string> theirs, ours;
  for (auto& p : from.named_parameters()) theirs.push_back(p.key());
  for (auto& p : to.named_parameters()) ours.push_back(p.name);
  std::sort(theirs.begin(), theirs.end());
  std::sort(ours.begin(), ours.end());
  ASSERT_EQ(ours, theirs);
  NoGradGuard g;
  for (auto& p : from.named_parameters()) to.find_tensor(p.key()).as<double>().copy_(from_torch(p.value()));
}
}  // namespace

TEST(LibTorchAttention, TransformerEncoderLayerPostAndPreNorm) {
  use_float64();
  const std::int64_t E = 8, H = 2, F = 12, L = 5, N = 3;
  // src [L, N, E]; masks: a float causal mask, and boolean key padding leaving each query a key.
  auto causal = nn::generate_square_subsequent_mask<double>(L);
  auto causal_bool = triu(ones<mask_t>({L, L}), 1);
  auto kpm = ids({0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1}, {N, L});
  const CL src = {r({L, N, E}, 1)};
  for (bool gelu : {false, true}) {
    const std::string act = gelu ? "gelu" : "relu";
    {  // post-norm: LibTorch's own layer
      torch::nn::TransformerEncoderLayer tm(
          torch::nn::TransformerEncoderLayerOptions(E, H).dim_feedforward(F).dropout(0.0).activation(
              gelu ? torch::nn::activation_t(torch::kGELU) : torch::nn::activation_t(torch::kReLU)));
      randomise(*tm, 4);
      for (bool batch_first : {false, true}) {
        nn::TransformerEncoderLayerT<double> cm(
            E, H, {.dim_feedforward = F, .dropout = 0.0, .activation = act, .batch_first = batch_first});
        copy_parameters(*tm, *cm);
        auto in = [&](const Tensor<double>& x) { return batch_first ? tr(x).contiguous() : x; };
        auto out = [&](const Tensor<double>& y) { return batch_first ? tr(y) : y; };
        const std::string what = "post-norm " + act + (batch_first ? ", batch_first" : "");
        cross(
            what, *cm, *tm, src, [&](const CL& x) { return CL{out(cm(in(x[0])))}; },
            [&](const TL& x) { return TL{tm->forward(x[0])}; });
        cross(
            what + ", float causal mask and boolean padding", *cm, *tm, src,
            [&](const CL& x) { return CL{out(cm(in(x[0]), causal, kpm))}; },
            [&](const TL& x) { return TL{tm->forward(x[0], to_torch(causal), as_bool(kpm))}; });
        cross(
            what + ", boolean causal mask, is_causal", *cm, *tm, src,
            [&](const CL& x) { return CL{out(cm(in(x[0]), causal_bool, {}, true))}; },
            [&](const TL& x) { return TL{tm->forward(x[0], to_torch(causal))}; });
      }
    }
    {  // pre-norm (norm_first) with another layer_norm_eps
      TorchPreNormEncoderLayer tm(E, H, F, gelu, 1e-3);
      randomise(*tm, 5);
      nn::TransformerEncoderLayerT<double> cm(
          E, H, {.dim_feedforward = F, .dropout = 0.0, .activation = act, .layer_norm_eps = 1e-3, .norm_first = true});
      copy_by_name(*tm, *cm);
      cross(
          "pre-norm " + act, *cm, *tm, src, [&](const CL& x) { return CL{cm(x[0], causal, kpm)}; },
          [&](const TL& x) { return TL{tm->forward(x[0], to_torch(causal), as_bool(kpm))}; });
    }
  }
}

TEST(LibTorchAttention, TransformerDecoderLayerPostAndPreNorm) {
  use_float64();
  const std::int64_t E = 8, H = 2, F = 12, T = 4, S = 5, N = 3;
  auto tgt_mask = nn::generate_square_subsequent_mask<double>(T);
  auto mem_mask = forbidden_mask();  // [T = 4, S = 5]
  auto tgt_kpm = ids({0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 1, 1}, {N, T});
  auto mem_kpm = padding_mask();  // [N = 3, S = 5]
  const CL in = {r({T, N, E}, 1), r({S, N, E}, 2)};
  for (bool gelu : {false, true}) {
    const std::string act = gelu ? "gelu" : "relu";
    torch::nn::TransformerDecoderLayer tm(
        torch::nn::TransformerDecoderLayerOptions(E, H).dim_feedforward(F).dropout(0.0).activation(
            gelu ? torch::nn::activation_t(torch::kGELU) : torch::nn::activation_t(torch::kReLU)));
    randomise(*tm, 6);
    nn::TransformerDecoderLayerT<double> cm(E, H, {.dim_feedforward = F, .dropout = 0.0, .activation = act});
    copy_parameters(*tm, *cm);
    cross(
        "post-norm " + act, *cm, *tm, in, [&](const CL& x) { return CL{cm(x[0], x[1])}; },
        [&](const TL& x) { return TL{tm->forward(x[0], x[1])}; });
    cross(
        "post-norm " + act + ", all four masks", *cm, *tm, in,
        [&](const CL& x) { return CL{cm(x[0], x[1], tgt_mask, mem_mask, tgt_kpm, mem_kpm)}; },
        [&](const TL& x) {
          return TL{tm->forward(x[0], x[1], to_torch(tgt_mask), to_torch(additive(mem_mask)), as_bool(tgt_kpm),
                                as_bool(mem_kpm))};
        });
    TorchPreNormDecoderLayer tp(E, H, F, gelu, 1e-5);
    randomise(*tp, 7);
    nn::TransformerDecoderLayerT<double> cp(
        E, H, {.dim_feedforward = F, .dropout = 0.0, .activation = act, .norm_first = true});
    copy_by_name(*tp, *cp);
    cross(
        "pre-norm " + act + ", all four masks", *cp, *tp, in,
        [&](const CL& x) { return CL{cp(x[0], x[1], tgt_mask, mem_mask, tgt_kpm, mem_kpm)}; },
        [&](const TL& x) {
          return TL{tp->forward(x[0], x[1], to_torch(tgt_mask), to_torch(additive(mem_mask)), as_bool(tgt_kpm),
                                as_bool(mem_kpm))};
        });
  }
}

TEST(LibTorchAttention, EncoderDecoderStacksAndTransformer) {
  use_float64();
  const std::int64_t E = 8, H = 2, F = 12, T = 4, S = 5, N = 3;
  auto tgt_mask = nn::generate_square_subsequent_mask<double>(T);
  EXPECT_TRUE(same(tgt_mask, torch::nn::TransformerImpl::generate_square_subsequent_mask(T), "causal mask"));
  EXPECT_TRUE(same(nn::Transformer::generate_square_subsequent_mask(3).to<double>(),
                   torch::nn::TransformerImpl::generate_square_subsequent_mask(3), "float causal mask"));
  auto src_kpm = padding_mask();  // [N, S]
  auto tgt_kpm = ids({0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 1, 1}, {N, T});
  {
    torch::nn::TransformerEncoder tm(
        torch::nn::TransformerEncoderOptions(
            torch::nn::TransformerEncoderLayer(
                torch::nn::TransformerEncoderLayerOptions(E, H).dim_feedforward(F).dropout(0.0)),
            2)
            .norm(torch::nn::AnyModule(torch::nn::LayerNorm(torch::nn::LayerNormOptions({E})))));
    randomise(*tm, 8);
    nn::TransformerEncoderT<double> cm(
        nn::TransformerEncoderLayerT<double>(E, H, {.dim_feedforward = F, .dropout = 0.0}), 2,
        nn::LayerNormT<double>(E));
    copy_parameters(*tm, *cm);
    cross(
        "encoder of 2 layers and a norm", *cm, *tm, {r({S, N, E}, 1)},
        [&](const CL& x) { return CL{cm(x[0], {}, src_kpm)}; },
        [&](const TL& x) { return TL{tm->forward(x[0], {}, as_bool(src_kpm))}; });
  }
  {
    torch::nn::TransformerDecoder tm(
        torch::nn::TransformerDecoderOptions(
            torch::nn::TransformerDecoderLayer(
                torch::nn::TransformerDecoderLayerOptions(E, H).dim_feedforward(F).dropout(0.0)),
            2)
            .norm(torch::nn::AnyModule(torch::nn::LayerNorm(torch::nn::LayerNormOptions({E})))));
    randomise(*tm, 9);
    nn::TransformerDecoderT<double> cm(
        nn::TransformerDecoderLayerT<double>(E, H, {.dim_feedforward = F, .dropout = 0.0}), 2,
        nn::LayerNormT<double>(E));
    copy_parameters(*tm, *cm);
    cross(
        "decoder of 2 layers and a norm", *cm, *tm, {r({T, N, E}, 1), r({S, N, E}, 2)},
        [&](const CL& x) { return CL{cm(x[0], x[1], tgt_mask, {}, tgt_kpm, src_kpm)}; },
        [&](const TL& x) {
          return TL{tm->forward(x[0], x[1], to_torch(tgt_mask), {}, as_bool(tgt_kpm), as_bool(src_kpm))};
        });
  }
  {
    torch::nn::Transformer tm(torch::nn::TransformerOptions(E, H, 2, 1).dim_feedforward(F).dropout(0.0));
    randomise(*tm, 10);
    nn::TransformerT<double> cm({.d_model = E,
                                 .nhead = H,
                                 .num_encoder_layers = 2,
                                 .num_decoder_layers = 1,
                                 .dim_feedforward = F,
                                 .dropout = 0.0});
    copy_parameters(*tm, *cm);
    cross(
        "Transformer", *cm, *tm, {r({S, N, E}, 1), r({T, N, E}, 2)},
        [&](const CL& x) { return CL{cm(x[0], x[1], {}, tgt_mask, {}, src_kpm, tgt_kpm, src_kpm)}; },
        [&](const TL& x) {
          return TL{tm->forward(x[0], x[1], {}, to_torch(tgt_mask), {}, as_bool(src_kpm), as_bool(tgt_kpm),
                                as_bool(src_kpm))};
        });
  }
}
#else
TEST(LibTorchAttention, Skipped) { GTEST_SKIP() << CHORUS_LIBTORCH_SKIP; }
#endif
