#pragma once
// MultiheadAttention, as torch.nn.MultiheadAttention (PyTorch 2.x): parameter names, shapes,
// initialisation, masks and outputs.
#include <optional>
#include <tuple>

#include "../ops/attention.hpp"
#include "init.hpp"
#include "layers.hpp"
#include "module.hpp"

CHORUS_NAMESPACE_BEGIN
namespace nn {

/// Fields in PyTorch's argument order (Note [layer options] in nn/module.hpp).
struct MultiheadAttentionOptions {
  double dropout = 0.0;                             ///< Dropout on the attention weights, while training (default 0).
  bool bias = true;                                 ///< Adds in_proj_bias and out_proj.bias (default true).
  bool add_bias_kv = false;                         ///< Learned bias_k and bias_v, appended as one more key and value.
  bool add_zero_attn = false;                       ///< Appends a zero key and value (per head) to the sequences.
  std::optional<std::int64_t> kdim = std::nullopt;  ///< The keys' features (default embed_dim).
  std::optional<std::int64_t> vdim = std::nullopt;  ///< The values' features (default embed_dim).
  bool batch_first = false;                         ///< [N, L, E] instead of [L, N, E] (default false).
  Device device = Device::cpu();                    ///< Where the parameters are created (default CPU).
};

/// Multi-head attention: query [L, N, E] ([N, L, E] with batch_first, [L, E] unbatched), key
/// [S, N, kdim], value [S, N, vdim]; output [L, N, E] and, with need_weights, the attention
/// weights [N, L, S] (averaged over the heads) or [N, num_heads, L, S].
///
/// Parameters as PyTorch names them: `in_proj_weight` [3E, E] (or `q_proj_weight` [E, E],
/// `k_proj_weight` [E, kdim], `v_proj_weight` [E, vdim] when kdim or vdim differ from E),
/// `in_proj_bias` [3E], `bias_k`/`bias_v` [1, 1, E] with add_bias_kv, and the submodule
/// `out_proj` (`out_proj.weight` [E, E], `out_proj.bias` [E]). Initialised as PyTorch does:
/// xavier_uniform_ on the projection weights, zeros for in_proj_bias and out_proj.bias,
/// out_proj.weight as a Linear's, xavier_normal_ on bias_k and bias_v.
///
/// Masks (AttentionMask<T>: boolean int64 or additive float, with PyTorch's meaning for MHA):
/// key_padding_mask [N, S] ([S] unbatched), a nonzero element masks that key out;
/// attn_mask [L, S] or [N·num_heads, L, S], a nonzero element forbids that query-key pair.
/// Float masks are added to the scores. A query left with no key gets zeros (Note [fully masked
/// rows] in ops/attention.hpp). is_causal is PyTorch's hint that attn_mask is the causal mask:
/// it needs attn_mask, which is then used as given.
template <class T = float>
class MultiheadAttentionImpl : public Module {
 public:
  using Mask = AttentionMask<T>;  ///< A mask: boolean (int64) or additive (T), as described above.

  /// `num_heads` heads over `embed_dim` features (embed_dim divisible by num_heads), parameters
  /// initialised by reset_parameters().
  MultiheadAttentionImpl(std::int64_t embed_dim, std::int64_t num_heads, MultiheadAttentionOptions options = {})
      : embed_dim(embed_dim),
        num_heads(num_heads),
        kdim(options.kdim.value_or(embed_dim)),
        vdim(options.vdim.value_or(embed_dim)),
        options(options) {
    CHORUS_CHECK(embed_dim > 0 && num_heads > 0, "MultiheadAttention: embed_dim and num_heads must be positive, got ",
                 embed_dim, " and ", num_heads);
    CHORUS_CHECK(embed_dim % num_heads == 0,
                 "MultiheadAttention: embed_dim must be divisible by num_heads, got embed_dim ", embed_dim,
                 " and num_heads ", num_heads);
    CHORUS_CHECK(kdim > 0 && vdim > 0, "MultiheadAttention: kdim and vdim must be positive, got ", kdim, " and ", vdim);
    CHORUS_CHECK(options.dropout >= 0.0 && options.dropout <= 1.0,
                 "MultiheadAttention: dropout must be in [0, 1], got ", options.dropout);
    head_dim = embed_dim / num_heads;
    const Device d = options.device;
    using M = MultiheadAttentionImpl;
    // Registration order gives PyTorch's state_dict order.
    if (qkv_same_embed_dim()) {
      register_parameter("in_proj_weight", &M::in_proj_weight, Tensor<T>::empty({3 * embed_dim, embed_dim}, d));
    } else {
      register_parameter("q_proj_weight", &M::q_proj_weight, Tensor<T>::empty({embed_dim, embed_dim}, d));
      register_parameter("k_proj_weight", &M::k_proj_weight, Tensor<T>::empty({embed_dim, kdim}, d));
      register_parameter("v_proj_weight", &M::v_proj_weight, Tensor<T>::empty({embed_dim, vdim}, d));
    }
    if (options.bias) register_parameter("in_proj_bias", &M::in_proj_bias, Tensor<T>::empty({3 * embed_dim}, d));
    if (options.add_bias_kv) {
      register_parameter("bias_k", &M::bias_k, Tensor<T>::empty({1, 1, embed_dim}, d));
      register_parameter("bias_v", &M::bias_v, Tensor<T>::empty({1, 1, embed_dim}, d));
    }
    out_proj = register_module("out_proj", LinearT<T>(embed_dim, embed_dim, {.bias = options.bias, .device = d}));
    reset_parameters();
  }

  /// True when kdim == vdim == embed_dim: one packed in_proj_weight (PyTorch's _qkv_same_embed_dim).
  bool qkv_same_embed_dim() const { return kdim == embed_dim && vdim == embed_dim; }

  /// Re-initialises every parameter as PyTorch does (see above).
  void reset_parameters() {
    if (qkv_same_embed_dim()) {
      init::xavier_uniform_(in_proj_weight);
    } else {
      init::xavier_uniform_(q_proj_weight);
      init::xavier_uniform_(k_proj_weight);
      init::xavier_uniform_(v_proj_weight);
    }
    if (in_proj_bias.defined()) {
      init::zeros_(in_proj_bias);
      init::zeros_(out_proj->bias);
    }
    if (bias_k.defined()) init::xavier_normal_(bias_k);
    if (bias_v.defined()) init::xavier_normal_(bias_v);
  }

  /// (attention output, attention weights or an undefined tensor without need_weights), as
  /// PyTorch's forward(query, key, value, key_padding_mask, need_weights, attn_mask,
  /// average_attn_weights, is_causal).
  std::tuple<Tensor<T>, Tensor<T>> forward(const Tensor<T>& query, const Tensor<T>& key, const Tensor<T>& value,
                                           const Mask& key_padding_mask = {}, bool need_weights = true,
                                           const Mask& attn_mask = {}, bool average_attn_weights = true,
                                           bool is_causal = false) const;

  std::string name() const override {
    return "MultiheadAttention(embed_dim=" + std::to_string(embed_dim) + ", num_heads=" + std::to_string(num_heads) +
           ")";
  }

  /// Sizes: embed_dim E, num_heads H, kdim and vdim (the keys' and values' features), head_dim E / H.
  ///@{
  std::int64_t embed_dim, num_heads, kdim, vdim, head_dim = 0;
  ///@}
  MultiheadAttentionOptions options;  ///< The options it was built with.
  /// The parameters described above; those the options leave out are undefined.
  ///@{
  Tensor<T> in_proj_weight, q_proj_weight, k_proj_weight, v_proj_weight, in_proj_bias, bias_k, bias_v;
  ///@}
  LinearT<T> out_proj{nullptr};  ///< The output projection, Linear(E, E).

 private:
  /// Rows [i·E, (i+1)·E) of the packed projection (weight or bias), or the separate weight.
  Tensor<T> proj_weight(int i) const {
    if (!qkv_same_embed_dim()) return i == 0 ? q_proj_weight : i == 1 ? k_proj_weight : v_proj_weight;
    return in_proj_weight.narrow(0, i * embed_dim, embed_dim);
  }
  Tensor<T> proj_bias(int i) const {
    return in_proj_bias.defined() ? in_proj_bias.narrow(0, i * embed_dim, embed_dim) : Tensor<T>();
  }
};

namespace detail {
/// `mask` with a zero column appended to its last dimension (for bias_k/bias_v and
/// add_zero_attn: the extra key is attended by every query).
template <class T>
AttentionMask<T> pad_key(const AttentionMask<T>& mask) {
  if (!mask.defined()) return mask;
  Shape s = mask.shape();
  s[s.size() - 1] = 1;
  if (mask.is_bool()) return cat(std::vector<Tensor<mask_t>>{mask.bool_mask(), zeros<mask_t>(s, mask.device())}, -1);
  return cat(std::vector<Tensor<T>>{mask.float_mask(), zeros<T>(s, mask.device())}, -1);
}
}  // namespace detail

template <class T>
std::tuple<Tensor<T>, Tensor<T>> MultiheadAttentionImpl<T>::forward(const Tensor<T>& query, const Tensor<T>& key,
                                                                    const Tensor<T>& value,
                                                                    const Mask& key_padding_mask, bool need_weights,
                                                                    const Mask& attn_mask, bool average_attn_weights,
                                                                    bool is_causal) const {
  constexpr const char* op = "MultiheadAttention";
  ops::detail::check_defined(op, query, "query");
  ops::detail::check_defined(op, key, "key");
  ops::detail::check_defined(op, value, "value");
  ops::detail::check_same_device(op, query, key);
  ops::detail::check_same_device(op, query, value);
  const bool batched = query.dim() == 3;
  CHORUS_CHECK(batched || query.dim() == 2, op, ": query must be 3-D (batched: [L, N, E], or [N, L, E] with ",
               "batch_first) or 2-D (unbatched: [L, E]), got shape ", query.shape());
  CHORUS_CHECK(key.dim() == query.dim() && value.dim() == query.dim(), op, ": for ",
               batched ? "a batched (3-D)" : "an unbatched (2-D)", " query, key and value must be ", query.dim(),
               "-D too, got key of shape ", key.shape(), " and value of shape ", value.shape());
  CHORUS_CHECK(!is_causal || attn_mask.defined(), op, ": is_causal is a hint that attn_mask is the causal mask and ",
               "needs attn_mask (make one with nn::Transformer::generate_square_subsequent_mask(L))");
  // Canonical 3-D layout: batch dimension bd (0 with batch_first), sequence dimension 1 - bd.
  const int bd = batched && options.batch_first ? 0 : 1, sd = 1 - bd;
  const Tensor<T> q_in = batched ? query : query.unsqueeze(1);
  const Tensor<T> k_in = batched ? key : key.unsqueeze(1);
  const Tensor<T> v_in = batched ? value : value.unsqueeze(1);
  const std::int64_t L = q_in.shape()[sd], N = q_in.shape()[bd], E = embed_dim, H = num_heads;
  std::int64_t S = k_in.shape()[sd];
  CHORUS_CHECK(q_in.shape()[2] == E, op, ": expected the query's last dimension to be embed_dim = ", E,
               ", got query of shape ", query.shape());
  CHORUS_CHECK(k_in.shape()[2] == kdim && v_in.shape()[2] == vdim, op, ": expected key [..., kdim = ", kdim,
               "] and value [..., vdim = ", vdim, "], got key of shape ", key.shape(), " and value of shape ",
               value.shape());
  CHORUS_CHECK(k_in.shape()[bd] == N && v_in.shape()[bd] == N && v_in.shape()[sd] == S, op,
               ": query, key and value disagree in batch size or key and value in sequence length: query of shape ",
               query.shape(), ", key ", key.shape(), ", value ", value.shape(),
               options.batch_first ? " (batch_first: [N, L, E])" : " ([L, N, E]; batch_first is off)");

  // Masks against the shapes PyTorch documents, named with their kind.
  Mask kpm = key_padding_mask, am = attn_mask;
  if (kpm.defined()) {
    const Shape want = batched ? Shape{N, S} : Shape{S};
    CHORUS_CHECK(kpm.shape() == want, op, ": key_padding_mask must have shape ", want, batched ? " ([N, S])" : " ([S])",
                 ", got ", kpm.describe());
    if (!batched) kpm = kpm.reshape({1, S});
  }
  if (am.defined()) {
    CHORUS_CHECK(am.dim() == 2 || am.dim() == 3, op, ": attn_mask must be 2-D [L, S] or 3-D [N*num_heads, L, S], got ",
                 am.describe());
    const Shape want = am.dim() == 2 ? Shape{L, S} : Shape{N * H, L, S};
    CHORUS_CHECK(am.shape() == want, op, ": the ", am.dim(), "-D attn_mask must have shape ", want,
                 am.dim() == 2 ? " ([L, S])" : " ([N*num_heads, L, S])", ", got ", am.describe());
  }

  // Projections: one GEMM for self-attention (query, key and value one tensor), else one each.
  Tensor<T> q, k, v;  // [.., .., E] in the canonical layout
  if (qkv_same_embed_dim() && is_same(query, key) && is_same(key, value)) {
    auto y = ops::detail::unflatten_last(linear(q_in, in_proj_weight, in_proj_bias), 3, E);
    q = y.select(2, 0);
    k = y.select(2, 1);
    v = y.select(2, 2);
  } else {
    q = linear(q_in, proj_weight(0), proj_bias(0));
    k = linear(k_in, proj_weight(1), proj_bias(1));
    v = linear(v_in, proj_weight(2), proj_bias(2));
  }
  if (bias_k.defined()) {  // one more key and value, the same for every batch element
    Shape s{1, 1, E};
    s[bd] = N;
    k = cat(std::vector<Tensor<T>>{k, bias_k.expand(s)}, sd);
    v = cat(std::vector<Tensor<T>>{v, bias_v.expand(s)}, sd);
    kpm = detail::pad_key(kpm);
    am = detail::pad_key(am);
    ++S;
  }
  // [.., .., E] -> [N, H, len, head_dim]
  auto heads = [&](const Tensor<T>& x) {
    auto x4 = ops::detail::unflatten_last(x, H, head_dim);
    return bd == 0 ? x4.permute({0, 2, 1, 3}) : x4.permute({1, 2, 0, 3});
  };
  auto qh = heads(q), kh = heads(k), vh = heads(v);
  if (options.add_zero_attn) {
    auto z = zeros<T>({N, H, 1, head_dim}, query.device());
    kh = cat(std::vector<Tensor<T>>{kh, z}, 2);
    vh = cat(std::vector<Tensor<T>>{vh, z}, 2);
    kpm = detail::pad_key(kpm);
    am = detail::pad_key(am);
    ++S;
  }

  std::vector<ops::detail::ScoreMask<T>> masks;
  if (am.defined())
    masks.push_back(ops::detail::ScoreMask<T>::from(am.dim() == 2 ? am : am.reshape({N, H, L, S}), "attn_mask", false));
  if (kpm.defined())
    masks.push_back(ops::detail::ScoreMask<T>::from(kpm.reshape({N, 1, 1, S}), "key_padding_mask", false));
  const double p = is_training() ? options.dropout : 0.0;
  auto [out, weights] =
      ops::detail::attend(op, qh, kh, vh, masks, p, 1.0 / std::sqrt(static_cast<double>(head_dim)));  // [N, H, L, hd]

  out = (bd == 0 ? out.permute({0, 2, 1, 3}).reshape({N, L, E}) : out.permute({2, 0, 1, 3}).reshape({L, N, E}));
  out = out_proj(out);
  if (!batched) out = out.squeeze(1);
  if (!need_weights) return {out, Tensor<T>()};
  if (average_attn_weights) weights = mean(weights, 1);  // [N, L, S]
  if (!batched) weights = weights.squeeze(0);
  return {out, weights};
}

/// Holder (Note [layer options] in nn/module.hpp): `MultiheadAttentionT<T>(16, 4, {.batch_first = true})`.
/// Its call takes the masks as AttentionMask<T>, so `mha(q, k, v, {}, false)` compiles (a
/// variadic call could not deduce the braces).
template <class T = float>
class MultiheadAttentionT : public ModuleHolder<MultiheadAttentionImpl<T>> {
 public:
  using ModuleHolder<MultiheadAttentionImpl<T>>::ModuleHolder;
  /// Constructs the implementation: MultiheadAttentionImpl(embed_dim, num_heads, options).
  explicit MultiheadAttentionT(std::int64_t embed_dim, std::int64_t num_heads, MultiheadAttentionOptions options = {})
      : ModuleHolder<MultiheadAttentionImpl<T>>(
            std::make_shared<MultiheadAttentionImpl<T>>(embed_dim, num_heads, options)) {}
  /// Calls MultiheadAttentionImpl::forward: (attention output, attention weights or undefined).
  std::tuple<Tensor<T>, Tensor<T>> operator()(const Tensor<T>& query, const Tensor<T>& key, const Tensor<T>& value,
                                              const AttentionMask<T>& key_padding_mask = {}, bool need_weights = true,
                                              const AttentionMask<T>& attn_mask = {}, bool average_attn_weights = true,
                                              bool is_causal = false) const {
    return (*this)->forward(query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
                            is_causal);
  }
};
using MultiheadAttention = MultiheadAttentionT<float>;  ///< MultiheadAttentionT over float tensors.

}  // namespace nn
CHORUS_NAMESPACE_END
