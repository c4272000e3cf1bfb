#pragma once
// Transformer layers, as PyTorch 2.x's torch.nn.TransformerEncoderLayer, TransformerEncoder,
// TransformerDecoderLayer, TransformerDecoder and Transformer: the same options, parameter
// names (`layers.0.self_attn.in_proj_weight`, `linear1`, `norm1`, ...), initialisation and
// forward, masks as nn::MultiheadAttention reads them (AttentionMask<T>: boolean int64 with
// nonzero = masked out, or additive float).
#include <limits>
#include <string>
#include <vector>

#include "../compiled.hpp"
#include "attention.hpp"
#include "layers.hpp"
#include "module.hpp"
#include "normalization.hpp"

CHORUS_NAMESPACE_BEGIN
namespace nn {

/// The options of TransformerEncoderLayer and TransformerDecoderLayer, in PyTorch's order
/// (Note [layer options] in nn/module.hpp).
struct TransformerLayerOptions {
  std::int64_t dim_feedforward = 2048;  ///< The feed-forward network's hidden width (default 2048).
  double dropout = 0.1;                 ///< Dropout on the attention weights and every dropout sublayer (default 0.1).
  std::string activation = "relu";      ///< The feed-forward activation: "relu" (default) or "gelu" (exact, erf).
  double layer_norm_eps = 1e-5;         ///< The LayerNorms' eps (default 1e-5).
  bool batch_first = false;             ///< [N, L, E] instead of [L, N, E] (default false).
  bool norm_first = false;              ///< Pre-norm: x + f(norm(x)) instead of norm(x + f(x)) (default false).
  bool bias = true;                     ///< Biases in the Linear and LayerNorm layers and the attention projections.
  Device device = Device::cpu();        ///< Where the parameters are created (default CPU).
};
using TransformerEncoderLayerOptions = TransformerLayerOptions;  ///< PyTorch-style name of TransformerLayerOptions.
using TransformerDecoderLayerOptions = TransformerLayerOptions;  ///< PyTorch-style name of TransformerLayerOptions.

namespace detail {
enum class FeedForwardActivation { Relu, Gelu };

inline FeedForwardActivation parse_activation(const char* layer, const std::string& name) {
  if (name == "relu") return FeedForwardActivation::Relu;
  if (name == "gelu") return FeedForwardActivation::Gelu;
  CHORUS_FAIL(layer, ": activation should be relu/gelu, not '", name, "'");
}

inline void check_layer_options(const char* layer, std::int64_t d_model, std::int64_t nhead,
                                const TransformerLayerOptions& o) {
  CHORUS_CHECK(d_model > 0 && nhead > 0, layer, ": d_model and nhead must be positive, got ", d_model, " and ", nhead);
  CHORUS_CHECK(d_model % nhead == 0, layer, ": d_model must be divisible by nhead, got d_model ", d_model,
               " and nhead ", nhead);
  CHORUS_CHECK(o.dim_feedforward > 0, layer, ": dim_feedforward must be positive, got ", o.dim_feedforward);
  CHORUS_CHECK(o.dropout >= 0.0 && o.dropout <= 1.0, layer, ": dropout must be in [0, 1], got ", o.dropout);
  CHORUS_CHECK(o.layer_norm_eps > 0, layer, ": layer_norm_eps must be positive, got ", o.layer_norm_eps);
}

/// The sublayers, built from one set of options (so encoder and decoder layers agree).
template <class T>
MultiheadAttentionT<T> make_attention(std::int64_t d, std::int64_t h, const TransformerLayerOptions& o) {
  return MultiheadAttentionT<T>(
      d, h, {.dropout = o.dropout, .bias = o.bias, .batch_first = o.batch_first, .device = o.device});
}
template <class T>
LinearT<T> make_linear(std::int64_t in, std::int64_t out, const TransformerLayerOptions& o) {
  return LinearT<T>(in, out, {.bias = o.bias, .device = o.device});
}
template <class T>
LayerNormT<T> make_norm(std::int64_t d, const TransformerLayerOptions& o) {
  return LayerNormT<T>(d, {.eps = o.layer_norm_eps, .bias = o.bias, .device = o.device});
}

/// The feed-forward block's parts shared by both layers: linear1, dropout, linear2 and the
/// activation between them.
template <class T>
Tensor<T> feed_forward(FeedForwardActivation act, const LinearT<T>& linear1, const Dropout& dropout,
                       const LinearT<T>& linear2, const Tensor<T>& x) {
  auto h = linear1(x);
  h = act == FeedForwardActivation::Gelu ? gelu(h) : relu(h);
  return linear2(dropout(h));
}

/// `num_layers` deep copies of `layer` as submodules "0", "1", ..., as PyTorch's _get_clones
/// (a ModuleList of copy.deepcopy(layer)): the names are `layers.0.…`, and every copy starts
/// from the layer's weights.
template <class Holder>
class LayerListImpl : public Module {
 public:
  LayerListImpl(const Holder& layer, std::int64_t num_layers) {
    CHORUS_CHECK(!layer.is_empty(), "Transformer: the layer to copy is an empty holder");
    CHORUS_CHECK(num_layers >= 0, "Transformer: num_layers must be non-negative, got ", num_layers);
    const auto params = layer->parameters();
    const Device device = params.empty() ? Device::cpu() : params[0].device();
    for (std::int64_t i = 0; i < num_layers; ++i)
      items.push_back(register_module(std::to_string(i), nn::clone(layer, device)));
  }
  std::size_t size() const { return items.size(); }
  const Holder& operator[](std::size_t i) const {
    CHORUS_CHECK(i < items.size(), "Transformer: layer ", i, " is out of range for ", items.size(), " layers");
    return items[i];
  }
  auto begin() const { return items.begin(); }
  auto end() const { return items.end(); }
  std::string name() const override { return "ModuleList"; }

  std::vector<Holder> items;  // the registered children, in order (copies remap both)
};
template <class Holder>
using LayerList = ModuleHolder<LayerListImpl<Holder>>;
}  // namespace detail

/// Self-attention and a feed-forward network, each with a residual connection and a LayerNorm,
/// as torch.nn.TransformerEncoderLayer: submodules self_attn, linear1, dropout, linear2, norm1,
/// norm2, dropout1, dropout2. src [L, N, E] ([N, L, E] with batch_first, [L, E] unbatched).
template <class T = float>
class TransformerEncoderLayerImpl : public Module {
 public:
  using Mask = AttentionMask<T>;  ///< A mask, as MultiheadAttention reads it.
  /// `nhead` heads over `d_model` features (d_model divisible by nhead), sublayers built from `options`.
  TransformerEncoderLayerImpl(std::int64_t d_model, std::int64_t nhead, TransformerLayerOptions options = {})
      : options((detail::check_layer_options("TransformerEncoderLayer", d_model, nhead, options), options)),
        act_(detail::parse_activation("TransformerEncoderLayer", options.activation)),
        self_attn(register_module("self_attn", detail::make_attention<T>(d_model, nhead, options))),
        linear1(register_module("linear1", detail::make_linear<T>(d_model, options.dim_feedforward, options))),
        dropout(register_module("dropout", Dropout(options.dropout))),
        linear2(register_module("linear2", detail::make_linear<T>(options.dim_feedforward, d_model, options))),
        norm1(register_module("norm1", detail::make_norm<T>(d_model, options))),
        norm2(register_module("norm2", detail::make_norm<T>(d_model, options))),
        dropout1(register_module("dropout1", Dropout(options.dropout))),
        dropout2(register_module("dropout2", Dropout(options.dropout))) {}

  /// As PyTorch's forward(src, src_mask, src_key_padding_mask, is_causal).
  Tensor<T> forward(const Tensor<T>& src, const Mask& src_mask = {}, const Mask& src_key_padding_mask = {},
                    bool is_causal = false) const {
    Tensor<T> x = src;
    if (options.norm_first) {
      x = add(x, sa_block(norm1(x), src_mask, src_key_padding_mask, is_causal));
      x = add(x, ff_block(norm2(x)));
    } else {
      x = norm1(add(x, sa_block(x, src_mask, src_key_padding_mask, is_causal)));
      x = norm2(add(x, ff_block(x)));
    }
    return x;
  }
  std::string name() const override { return "TransformerEncoderLayer"; }

  TransformerLayerOptions options;  ///< The options it was built with.

 private:
  detail::FeedForwardActivation act_;

 public:
  MultiheadAttentionT<T> self_attn;  ///< Self-attention over src.
  LinearT<T> linear1;                ///< The feed-forward input projection, d_model to dim_feedforward.
  Dropout dropout;                   ///< Dropout after the feed-forward activation.
  LinearT<T> linear2;                ///< The feed-forward output projection, dim_feedforward to d_model.
  /// The LayerNorms of the self-attention and feed-forward blocks.
  ///@{
  LayerNormT<T> norm1, norm2;
  ///@}
  /// Dropout on the self-attention and feed-forward outputs, before the residual add.
  ///@{
  Dropout dropout1, dropout2;
  ///@}

 private:
  Tensor<T> sa_block(const Tensor<T>& x, const Mask& mask, const Mask& kpm, bool is_causal) const {
    return dropout1(std::get<0>(self_attn(x, x, x, kpm, /*need_weights=*/false, mask, true, is_causal)));
  }
  Tensor<T> ff_block(const Tensor<T>& x) const {
    return dropout2(detail::feed_forward(act_, linear1, dropout, linear2, x));
  }
};

/// Holder (Note [layer options]): `TransformerEncoderLayerT<T>(64, 4, {.dim_feedforward = 128, .norm_first = true})`.
template <class T = float>
class TransformerEncoderLayerT : public ModuleHolder<TransformerEncoderLayerImpl<T>> {
 public:
  using ModuleHolder<TransformerEncoderLayerImpl<T>>::ModuleHolder;
  /// Constructs the implementation: TransformerEncoderLayerImpl(d_model, nhead, options).
  explicit TransformerEncoderLayerT(std::int64_t d_model, std::int64_t nhead, TransformerLayerOptions options = {})
      : ModuleHolder<TransformerEncoderLayerImpl<T>>(
            std::make_shared<TransformerEncoderLayerImpl<T>>(d_model, nhead, std::move(options))) {}
  /// Calls TransformerEncoderLayerImpl::forward.
  Tensor<T> operator()(const Tensor<T>& src, const AttentionMask<T>& src_mask = {},
                       const AttentionMask<T>& src_key_padding_mask = {}, bool is_causal = false) const {
    return (*this)->forward(src, src_mask, src_key_padding_mask, is_causal);
  }
};
using TransformerEncoderLayer = TransformerEncoderLayerT<float>;  ///< TransformerEncoderLayerT over float tensors.

/// Self-attention, attention over the encoder's output (`memory`) and a feed-forward network,
/// each with a residual connection and a LayerNorm, as torch.nn.TransformerDecoderLayer:
/// submodules self_attn, multihead_attn, linear1, dropout, linear2, norm1, norm2, norm3,
/// dropout1, dropout2, dropout3.
template <class T = float>
class TransformerDecoderLayerImpl : public Module {
 public:
  using Mask = AttentionMask<T>;  ///< A mask, as MultiheadAttention reads it.
  /// `nhead` heads over `d_model` features (d_model divisible by nhead), sublayers built from `options`.
  TransformerDecoderLayerImpl(std::int64_t d_model, std::int64_t nhead, TransformerLayerOptions options = {})
      : options((detail::check_layer_options("TransformerDecoderLayer", d_model, nhead, options), options)),
        act_(detail::parse_activation("TransformerDecoderLayer", options.activation)),
        self_attn(register_module("self_attn", detail::make_attention<T>(d_model, nhead, options))),
        multihead_attn(register_module("multihead_attn", detail::make_attention<T>(d_model, nhead, options))),
        linear1(register_module("linear1", detail::make_linear<T>(d_model, options.dim_feedforward, options))),
        dropout(register_module("dropout", Dropout(options.dropout))),
        linear2(register_module("linear2", detail::make_linear<T>(options.dim_feedforward, d_model, options))),
        norm1(register_module("norm1", detail::make_norm<T>(d_model, options))),
        norm2(register_module("norm2", detail::make_norm<T>(d_model, options))),
        norm3(register_module("norm3", detail::make_norm<T>(d_model, options))),
        dropout1(register_module("dropout1", Dropout(options.dropout))),
        dropout2(register_module("dropout2", Dropout(options.dropout))),
        dropout3(register_module("dropout3", Dropout(options.dropout))) {}

  /// As PyTorch's forward(tgt, memory, tgt_mask, memory_mask, tgt_key_padding_mask,
  /// memory_key_padding_mask, tgt_is_causal, memory_is_causal).
  Tensor<T> forward(const Tensor<T>& tgt, const Tensor<T>& memory, const Mask& tgt_mask = {},
                    const Mask& memory_mask = {}, const Mask& tgt_key_padding_mask = {},
                    const Mask& memory_key_padding_mask = {}, bool tgt_is_causal = false,
                    bool memory_is_causal = false) const {
    Tensor<T> x = tgt;
    if (options.norm_first) {
      x = add(x, sa_block(norm1(x), tgt_mask, tgt_key_padding_mask, tgt_is_causal));
      x = add(x, mha_block(norm2(x), memory, memory_mask, memory_key_padding_mask, memory_is_causal));
      x = add(x, ff_block(norm3(x)));
    } else {
      x = norm1(add(x, sa_block(x, tgt_mask, tgt_key_padding_mask, tgt_is_causal)));
      x = norm2(add(x, mha_block(x, memory, memory_mask, memory_key_padding_mask, memory_is_causal)));
      x = norm3(add(x, ff_block(x)));
    }
    return x;
  }
  std::string name() const override { return "TransformerDecoderLayer"; }

  TransformerLayerOptions options;  ///< The options it was built with.

 private:
  detail::FeedForwardActivation act_;

 public:
  /// The attentions: self_attn over tgt, multihead_attn from tgt over memory.
  ///@{
  MultiheadAttentionT<T> self_attn, multihead_attn;
  ///@}
  LinearT<T> linear1;  ///< The feed-forward input projection, d_model to dim_feedforward.
  Dropout dropout;     ///< Dropout after the feed-forward activation.
  LinearT<T> linear2;  ///< The feed-forward output projection, dim_feedforward to d_model.
  /// The LayerNorms of the self-attention, memory-attention and feed-forward blocks.
  ///@{
  LayerNormT<T> norm1, norm2, norm3;
  ///@}
  /// Dropout on the self-attention, memory-attention and feed-forward outputs, before the residual add.
  ///@{
  Dropout dropout1, dropout2, dropout3;
  ///@}

 private:
  Tensor<T> sa_block(const Tensor<T>& x, const Mask& mask, const Mask& kpm, bool is_causal) const {
    return dropout1(std::get<0>(self_attn(x, x, x, kpm, /*need_weights=*/false, mask, true, is_causal)));
  }
  Tensor<T> mha_block(const Tensor<T>& x, const Tensor<T>& mem, const Mask& mask, const Mask& kpm,
                      bool is_causal) const {
    return dropout2(std::get<0>(multihead_attn(x, mem, mem, kpm, /*need_weights=*/false, mask, true, is_causal)));
  }
  Tensor<T> ff_block(const Tensor<T>& x) const {
    return dropout3(detail::feed_forward(act_, linear1, dropout, linear2, x));
  }
};

/// Holder (Note [layer options]): `TransformerDecoderLayerT<T>(64, 4, {.dropout = 0.0})`.
template <class T = float>
class TransformerDecoderLayerT : public ModuleHolder<TransformerDecoderLayerImpl<T>> {
 public:
  using ModuleHolder<TransformerDecoderLayerImpl<T>>::ModuleHolder;
  /// Constructs the implementation: TransformerDecoderLayerImpl(d_model, nhead, options).
  explicit TransformerDecoderLayerT(std::int64_t d_model, std::int64_t nhead, TransformerLayerOptions options = {})
      : ModuleHolder<TransformerDecoderLayerImpl<T>>(
            std::make_shared<TransformerDecoderLayerImpl<T>>(d_model, nhead, std::move(options))) {}
  /// Calls TransformerDecoderLayerImpl::forward.
  Tensor<T> operator()(const Tensor<T>& tgt, const Tensor<T>& memory, const AttentionMask<T>& tgt_mask = {},
                       const AttentionMask<T>& memory_mask = {}, const AttentionMask<T>& tgt_key_padding_mask = {},
                       const AttentionMask<T>& memory_key_padding_mask = {}, bool tgt_is_causal = false,
                       bool memory_is_causal = false) const {
    return (*this)->forward(tgt, memory, tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask,
                            tgt_is_causal, memory_is_causal);
  }
};
using TransformerDecoderLayer = TransformerDecoderLayerT<float>;  ///< TransformerDecoderLayerT over float tensors.

/// `num_layers` deep copies of `encoder_layer` (submodule `layers`: `layers.0`, `layers.1`, …), run in
/// order, then the optional `norm` (a LayerNorm; nullptr for none), as torch.nn.TransformerEncoder.
template <class T = float>
class TransformerEncoderImpl : public Module {
 public:
  using Mask = AttentionMask<T>;  ///< A mask, as MultiheadAttention reads it.
  /// `num_layers` deep copies of `encoder_layer` (on the device of its parameters), then `norm`, which is
  /// registered as given (shared, not copied); an empty `norm` (the default) for none.
  TransformerEncoderImpl(const TransformerEncoderLayerT<T>& encoder_layer, std::int64_t num_layers,
                         LayerNormT<T> norm = nullptr)
      : layers(register_module("layers", detail::LayerList<TransformerEncoderLayerT<T>>(encoder_layer, num_layers))),
        norm(norm.is_empty() ? norm : register_module("norm", norm)) {}

  /// As PyTorch's forward(src, mask, src_key_padding_mask, is_causal).
  Tensor<T> forward(const Tensor<T>& src, const Mask& mask = {}, const Mask& src_key_padding_mask = {},
                    bool is_causal = false) const {
    Tensor<T> x = src;
    for (const auto& layer : *layers) x = layer(x, mask, src_key_padding_mask, is_causal);
    return norm.is_empty() ? x : norm(x);
  }
  /// The number of layers.
  std::int64_t num_layers() const { return static_cast<std::int64_t>(layers->size()); }
  std::string name() const override { return "TransformerEncoder"; }

  detail::LayerList<TransformerEncoderLayerT<T>> layers;  ///< The layer copies, run in order.
  LayerNormT<T> norm;                                     ///< The final LayerNorm, or an empty holder for none.
};

/// Holder of TransformerEncoderImpl<T>: `TransformerEncoderT<T>(layer, num_layers, norm)`.
template <class T = float>
class TransformerEncoderT : public ModuleHolder<TransformerEncoderImpl<T>> {
 public:
  using ModuleHolder<TransformerEncoderImpl<T>>::ModuleHolder;
  /// Constructs the implementation: TransformerEncoderImpl(encoder_layer, num_layers, norm).
  explicit TransformerEncoderT(const TransformerEncoderLayerT<T>& encoder_layer, std::int64_t num_layers,
                               LayerNormT<T> norm = nullptr)
      : ModuleHolder<TransformerEncoderImpl<T>>(
            std::make_shared<TransformerEncoderImpl<T>>(encoder_layer, num_layers, std::move(norm))) {}
  /// Calls TransformerEncoderImpl::forward.
  Tensor<T> operator()(const Tensor<T>& src, const AttentionMask<T>& mask = {},
                       const AttentionMask<T>& src_key_padding_mask = {}, bool is_causal = false) const {
    return (*this)->forward(src, mask, src_key_padding_mask, is_causal);
  }
};
using TransformerEncoder = TransformerEncoderT<float>;  ///< TransformerEncoderT over float tensors.

/// `num_layers` deep copies of `decoder_layer`, then the optional `norm`, as torch.nn.TransformerDecoder.
template <class T = float>
class TransformerDecoderImpl : public Module {
 public:
  using Mask = AttentionMask<T>;  ///< A mask, as MultiheadAttention reads it.
  /// `num_layers` deep copies of `decoder_layer` (on the device of its parameters), then `norm`, which is
  /// registered as given (shared, not copied); an empty `norm` (the default) for none.
  TransformerDecoderImpl(const TransformerDecoderLayerT<T>& decoder_layer, std::int64_t num_layers,
                         LayerNormT<T> norm = nullptr)
      : layers(register_module("layers", detail::LayerList<TransformerDecoderLayerT<T>>(decoder_layer, num_layers))),
        norm(norm.is_empty() ? norm : register_module("norm", norm)) {}

  /// As PyTorch's forward(tgt, memory, tgt_mask, memory_mask, tgt_key_padding_mask,
  /// memory_key_padding_mask, tgt_is_causal, memory_is_causal).
  Tensor<T> forward(const Tensor<T>& tgt, const Tensor<T>& memory, const Mask& tgt_mask = {},
                    const Mask& memory_mask = {}, const Mask& tgt_key_padding_mask = {},
                    const Mask& memory_key_padding_mask = {}, bool tgt_is_causal = false,
                    bool memory_is_causal = false) const {
    Tensor<T> x = tgt;
    for (const auto& layer : *layers)
      x = layer(x, memory, tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask, tgt_is_causal,
                memory_is_causal);
    return norm.is_empty() ? x : norm(x);
  }
  /// The number of layers.
  std::int64_t num_layers() const { return static_cast<std::int64_t>(layers->size()); }
  std::string name() const override { return "TransformerDecoder"; }

  detail::LayerList<TransformerDecoderLayerT<T>> layers;  ///< The layer copies, run in order.
  LayerNormT<T> norm;                                     ///< The final LayerNorm, or an empty holder for none.
};

/// Holder of TransformerDecoderImpl<T>: `TransformerDecoderT<T>(layer, num_layers, norm)`.
template <class T = float>
class TransformerDecoderT : public ModuleHolder<TransformerDecoderImpl<T>> {
 public:
  using ModuleHolder<TransformerDecoderImpl<T>>::ModuleHolder;
  /// Constructs the implementation: TransformerDecoderImpl(decoder_layer, num_layers, norm).
  explicit TransformerDecoderT(const TransformerDecoderLayerT<T>& decoder_layer, std::int64_t num_layers,
                               LayerNormT<T> norm = nullptr)
      : ModuleHolder<TransformerDecoderImpl<T>>(
            std::make_shared<TransformerDecoderImpl<T>>(decoder_layer, num_layers, std::move(norm))) {}
  /// Calls TransformerDecoderImpl::forward.
  Tensor<T> operator()(const Tensor<T>& tgt, const Tensor<T>& memory, const AttentionMask<T>& tgt_mask = {},
                       const AttentionMask<T>& memory_mask = {}, const AttentionMask<T>& tgt_key_padding_mask = {},
                       const AttentionMask<T>& memory_key_padding_mask = {}, bool tgt_is_causal = false,
                       bool memory_is_causal = false) const {
    return (*this)->forward(tgt, memory, tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask,
                            tgt_is_causal, memory_is_causal);
  }
};
using TransformerDecoder = TransformerDecoderT<float>;  ///< TransformerDecoderT over float tensors.

/// The additive causal mask [sz, sz] of torch.nn.Transformer.generate_square_subsequent_mask:
/// -inf above the diagonal (query i may not see key j > i), 0 on and below it. Made on `device`.
template <class T = float>
Tensor<T> generate_square_subsequent_mask(std::int64_t sz, Device device = Device::cpu()) {
  CHORUS_CHECK(sz >= 0, "generate_square_subsequent_mask: size must be non-negative, got ", sz);
  return triu(full<T>({sz, sz}, -std::numeric_limits<T>::infinity(), device), 1);
}

/// Fields in PyTorch's order (custom_encoder/custom_decoder are not offered).
struct TransformerOptions {
  std::int64_t d_model = 512;           ///< The features E of src, tgt and the output (default 512).
  std::int64_t nhead = 8;               ///< The attention heads; they must divide d_model (default 8).
  std::int64_t num_encoder_layers = 6;  ///< The encoder's layers (default 6).
  std::int64_t num_decoder_layers = 6;  ///< The decoder's layers (default 6).
  std::int64_t dim_feedforward = 2048;  ///< As TransformerLayerOptions::dim_feedforward.
  double dropout = 0.1;                 ///< As TransformerLayerOptions::dropout.
  std::string activation = "relu";      ///< As TransformerLayerOptions::activation.
  double layer_norm_eps = 1e-5;         ///< The eps of every LayerNorm, the final ones included (default 1e-5).
  bool batch_first = false;             ///< As TransformerLayerOptions::batch_first.
  bool norm_first = false;              ///< As TransformerLayerOptions::norm_first.
  bool bias = true;                     ///< As TransformerLayerOptions::bias (the final LayerNorms included).
  Device device = Device::cpu();        ///< Where the parameters are created (default CPU).
};

/// Encoder and decoder with final LayerNorms, as torch.nn.Transformer (submodules `encoder`
/// and `decoder`; every parameter with more than one dimension re-drawn with xavier_uniform_,
/// as PyTorch's _reset_parameters does).
template <class T = float>
class TransformerImpl : public Module {
 public:
  using Mask = AttentionMask<T>;  ///< A mask, as MultiheadAttention reads it.
  /// Builds encoder and decoder from `options`, then reset_parameters().
  explicit TransformerImpl(TransformerOptions options = {})
      : options(options),
        encoder(register_module(
            "encoder",
            TransformerEncoderT<T>(TransformerEncoderLayerT<T>(options.d_model, options.nhead, layer_options(options)),
                                   options.num_encoder_layers, final_norm(options)))),
        decoder(register_module(
            "decoder",
            TransformerDecoderT<T>(TransformerDecoderLayerT<T>(options.d_model, options.nhead, layer_options(options)),
                                   options.num_decoder_layers, final_norm(options)))) {
    reset_parameters();
  }
  /// Re-draws every parameter with more than one dimension with xavier_uniform_ (PyTorch's _reset_parameters).
  void reset_parameters() {
    for (auto& p : parameters())
      if (p.dim() > 1) init::xavier_uniform_(p.template as<T>());
  }

  /// As PyTorch's forward(src, tgt, src_mask, tgt_mask, memory_mask, src_key_padding_mask,
  /// tgt_key_padding_mask, memory_key_padding_mask, src_is_causal, tgt_is_causal, memory_is_causal).
  Tensor<T> forward(const Tensor<T>& src, const Tensor<T>& tgt, const Mask& src_mask = {}, const Mask& tgt_mask = {},
                    const Mask& memory_mask = {}, const Mask& src_key_padding_mask = {},
                    const Mask& tgt_key_padding_mask = {}, const Mask& memory_key_padding_mask = {},
                    bool src_is_causal = false, bool tgt_is_causal = false, bool memory_is_causal = false) const {
    ops::detail::check_defined("Transformer", src, "src");
    ops::detail::check_defined("Transformer", tgt, "tgt");
    const bool batched = src.dim() == 3;
    const int bd = options.batch_first ? 0 : 1;
    CHORUS_CHECK(!batched || tgt.dim() != 3 || src.shape()[bd] == tgt.shape()[bd],
                 "Transformer: the batch number of src and tgt must be equal, got src of shape ", src.shape(),
                 " and tgt of shape ", tgt.shape(), options.batch_first ? " (batch_first)" : " (batch_first is off)");
    CHORUS_CHECK(src.dim() >= 1 && tgt.dim() >= 1 && src.shape().back() == options.d_model &&
                     tgt.shape().back() == options.d_model,
                 "Transformer: the feature number of src and tgt must be equal to d_model = ", options.d_model,
                 ", got src of shape ", src.shape(), " and tgt of shape ", tgt.shape());
    auto memory = encoder(src, src_mask, src_key_padding_mask, src_is_causal);
    return decoder(tgt, memory, tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask, tgt_is_causal,
                   memory_is_causal);
  }
  /// The additive causal mask [sz, sz] (nn::generate_square_subsequent_mask).
  static Tensor<T> generate_square_subsequent_mask(std::int64_t sz, Device device = Device::cpu()) {
    return nn::generate_square_subsequent_mask<T>(sz, device);
  }
  std::string name() const override { return "Transformer"; }

  TransformerOptions options;      ///< The options it was built with.
  TransformerEncoderT<T> encoder;  ///< The encoder: num_encoder_layers layers, then a LayerNorm.
  TransformerDecoderT<T> decoder;  ///< The decoder: num_decoder_layers layers, then a LayerNorm.

 private:
  static TransformerLayerOptions layer_options(const TransformerOptions& o) {
    return {.dim_feedforward = o.dim_feedforward,
            .dropout = o.dropout,
            .activation = o.activation,
            .layer_norm_eps = o.layer_norm_eps,
            .batch_first = o.batch_first,
            .norm_first = o.norm_first,
            .bias = o.bias,
            .device = o.device};
  }
  static LayerNormT<T> final_norm(const TransformerOptions& o) {
    return LayerNormT<T>(o.d_model, {.eps = o.layer_norm_eps, .bias = o.bias, .device = o.device});
  }
};

/// Holder: `nn::TransformerT<T>({.d_model = 64, .nhead = 4})`;
/// `nn::Transformer::generate_square_subsequent_mask(L)` makes the causal mask.
template <class T = float>
class TransformerT : public ModuleHolder<TransformerImpl<T>> {
 public:
  using ModuleHolder<TransformerImpl<T>>::ModuleHolder;
  /// Constructs the implementation: TransformerImpl(options).
  explicit TransformerT(TransformerOptions options = {})
      : ModuleHolder<TransformerImpl<T>>(std::make_shared<TransformerImpl<T>>(std::move(options))) {}
  /// Calls TransformerImpl::forward.
  Tensor<T> operator()(const Tensor<T>& src, const Tensor<T>& tgt, const AttentionMask<T>& src_mask = {},
                       const AttentionMask<T>& tgt_mask = {}, const AttentionMask<T>& memory_mask = {},
                       const AttentionMask<T>& src_key_padding_mask = {},
                       const AttentionMask<T>& tgt_key_padding_mask = {},
                       const AttentionMask<T>& memory_key_padding_mask = {}, bool src_is_causal = false,
                       bool tgt_is_causal = false, bool memory_is_causal = false) const {
    return (*this)->forward(src, tgt, src_mask, tgt_mask, memory_mask, src_key_padding_mask, tgt_key_padding_mask,
                            memory_key_padding_mask, src_is_causal, tgt_is_causal, memory_is_causal);
  }
  /// The additive causal mask [sz, sz] (nn::generate_square_subsequent_mask).
  static Tensor<T> generate_square_subsequent_mask(std::int64_t sz, Device device = Device::cpu()) {
    return nn::generate_square_subsequent_mask<T>(sz, device);
  }
};
using Transformer = TransformerT<float>;  ///< TransformerT over float tensors.

}  // namespace nn
CHORUS_NAMESPACE_END

// The instances chorus::compiled holds (Note [compiled chorus] in compiled.hpp).
#define CHORUS_NN_TRANSFORMER_INSTANCES(X, T)                               \
  X(Tensor<T> nn::generate_square_subsequent_mask<T>(std::int64_t, Device))
CHORUS_EXTERN_INSTANCES(CHORUS_NN_TRANSFORMER_INSTANCES, CHORUS_ALL_DTYPES)
