#pragma once
// The two character-level language models of train_lm: both map token indices [batch, seq]
// (int64, batch first, so DataParallel splits them along dim 0) to next-token logits
// [batch, seq, vocab], and both take any seq up to the one they were built for.
#include <chorus/chorus.hpp>

#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

namespace examples {

/// Embedding -> LSTM (batch_first) -> Linear.
struct CharLSTM : chorus::nn::Module {
  chorus::nn::Embedding embed;
  chorus::nn::LSTM lstm;
  chorus::nn::Linear head;

  CharLSTM(std::int64_t vocab, std::int64_t embed_dim, std::int64_t hidden, std::int64_t layers, double dropout)
      : embed(register_module("embed", chorus::nn::Embedding(vocab, embed_dim))),
        lstm(register_module("lstm", chorus::nn::LSTM(embed_dim, hidden, chorus::nn::LSTMOptions{.num_layers = layers,
                                                                           .batch_first = true,
                                                                           .dropout = layers > 1 ? dropout : 0.0}))),
        head(register_module("head", chorus::nn::Linear(hidden, vocab))) {}

  chorus::Tensor<float> forward(const chorus::Tensor<std::int64_t>& tokens) {
    auto [out, state] = lstm(embed(tokens));  // out [batch, seq, hidden]; the state starts at zero
    return head(out);
  }
  std::string name() const override { return "CharLSTM"; }
};

/// A layer as it is: CharTransformerT's default, its encoder layers stay in its encoder.
template <class Layer>
using SameLayer = Layer;

/// Token + learned position embeddings -> TransformerEncoder under a causal mask (pre-norm,
/// GELU) -> LayerNorm -> Linear: a small GPT-style decoder-only model. With `checkpoint`, each
/// encoder layer's activations are recomputed in backward instead of kept (nn::utils::checkpoint).
/// With a `Unit` wrapper (dist::FullyShard), each encoder layer is instead a Unit of its own,
/// registered as block0, block1, … (the encoder then holds none); the layers start from the same
/// values either way.
template <template <class> class Unit = SameLayer>
struct CharTransformerT : chorus::nn::Module {
  using Layer = chorus::nn::TransformerEncoderLayer;
  static constexpr bool units = !std::is_same_v<Unit<Layer>, Layer>;
  std::int64_t max_len;
  bool checkpoint;
  chorus::nn::Embedding tok, pos;
  chorus::nn::TransformerEncoder encoder;
  std::vector<Unit<Layer>> blocks;
  chorus::nn::LayerNorm norm;
  chorus::nn::Linear head;

  CharTransformerT(std::int64_t vocab, std::int64_t max_len, std::int64_t d_model, std::int64_t heads,
                   std::int64_t layers, double dropout, bool checkpoint = false)
      : CharTransformerT(vocab, max_len, d_model, layers, checkpoint,
                         Layer(d_model, heads, {.dim_feedforward = 4 * d_model,
                                                .dropout = dropout,
                                                .activation = "gelu",
                                                .batch_first = true,
                                                .norm_first = true})) {}

  chorus::Tensor<float> forward(const chorus::Tensor<std::int64_t>& tokens) {
    const std::int64_t len = tokens.size(1);
    CHORUS_CHECK(len <= max_len, "CharTransformer: a sequence of ", len, " tokens is longer than the ", max_len,
                 " positions it was built for");
    // Built here, on the replica's device (a mask argument would not be moved to the replicas).
    const auto device = tokens.device();
    auto x = tok(tokens) + pos(chorus::arange<std::int64_t>(static_cast<double>(len), device));
    auto causal = chorus::nn::generate_square_subsequent_mask<float>(len, device);
    const chorus::AttentionMask<float> none;
    if constexpr (units) {
      for (auto& block : blocks)
        x = checkpoint ? chorus::nn::utils::checkpoint(block, x, causal, none, true) : block(x, causal, none, true);
      return head(norm(x));
    } else {
      if (!checkpoint) return head(norm(encoder(x, causal, {}, /*is_causal=*/true)));
      for (const auto& layer : *encoder->layers) x = chorus::nn::utils::checkpoint(layer, x, causal, none, true);
      return head(norm(x));
    }
  }
  std::string name() const override { return "CharTransformer"; }

 private:
  CharTransformerT(std::int64_t vocab, std::int64_t max_len, std::int64_t d_model, std::int64_t layers,
                   bool checkpoint, const Layer& layer)
      : max_len(max_len),
        checkpoint(checkpoint),
        tok(register_module("tok", chorus::nn::Embedding(vocab, d_model))),
        pos(register_module("pos", chorus::nn::Embedding(max_len, d_model))),
        encoder(register_module("encoder", chorus::nn::TransformerEncoder(layer, units ? 0 : layers))),
        norm(register_module("norm", chorus::nn::LayerNorm(d_model))),
        head(register_module("head", chorus::nn::Linear(d_model, vocab))) {
    if constexpr (units)
      for (std::int64_t i = 0; i < layers; ++i)
        blocks.push_back(register_module("block" + std::to_string(i), Unit<Layer>(chorus::nn::clone(layer, chorus::Device::cpu()))));
    // GPT-2's scale: N(0, 1) embeddings would swamp the residual stream of a pre-norm stack.
    chorus::nn::init::normal_(tok->weight, 0.0, 0.02);
    chorus::nn::init::normal_(pos->weight, 0.0, 0.02);
  }
};
using CharTransformer = CharTransformerT<>;

}  // namespace examples
