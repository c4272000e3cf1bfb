#pragma once
// The language-model workloads (benchmarks/README.md), shared by chorus_bench.cpp and
// chorus_gpu_bench.cu; libtorch_bench.cpp and pytorch_gpu_bench.py define the same models.
#include <chorus/chorus.hpp>

namespace bench {
namespace nn = chorus::nn;
using chorus::Device;
using chorus::Tensor;

// The language models (benchmarks/README.md, the same in libtorch_bench.cpp): tokens [B, L] of a
// 96-symbol vocabulary -> Embedding(96, 256) -> the model -> Linear(256, 96) -> logits [B, L, 96],
// cross-entropy over all B*L positions against random targets, Adam.
constexpr std::int64_t kLmVocab = 96, kLmWidth = 256;

/// lstm-lm: Embedding -> LSTM(256, 256, num_layers 2, batch_first) -> Linear; batch 64, sequence 64.
struct LstmLm : nn::Module {
  nn::Embedding embed;
  nn::LSTM lstm;
  nn::Linear head;
  LstmLm()
      : embed(register_module("embed", nn::Embedding(kLmVocab, kLmWidth))),
        lstm(register_module("lstm", nn::LSTM(kLmWidth, kLmWidth, nn::LSTMOptions{.num_layers = 2, .batch_first = true}))),
        head(register_module("head", nn::Linear(kLmWidth, kLmVocab))) {}
  Tensor<float> forward(const Tensor<std::int64_t>& tokens) { return head(std::get<0>(lstm(embed(tokens)))); }
};

/// transformer-lm: token Embedding + a learned position embedding (Embedding(128, 256), positions
/// 0..L-1) -> 4 x TransformerEncoderLayer(256, 4 heads, dim_feedforward 1024, dropout 0, ReLU,
/// post-norm; sequence-first inside) under the causal mask -> Linear; batch 32, sequence 128.
/// T = bfloat16: the same model in 16 bits (chorus_bench --bf16: mixed precision, master weights).
template <class T = float>
struct TransformerLmT : nn::Module {
  static constexpr std::int64_t kSeq = 128;
  nn::EmbeddingT<T> embed, pos;
  nn::TransformerEncoderT<T> encoder;
  nn::LinearT<T> head;
  TransformerLmT()
      : embed(register_module("embed", nn::EmbeddingT<T>(kLmVocab, kLmWidth))),
        pos(register_module("pos", nn::EmbeddingT<T>(kSeq, kLmWidth))),
        encoder(register_module(
            "encoder", nn::TransformerEncoderT<T>(nn::TransformerEncoderLayerT<T>(kLmWidth, 4, {.dim_feedforward = 1024,
                                                                                                .dropout = 0.0}),
                                                  4))),
        head(register_module("head", nn::LinearT<T>(kLmWidth, kLmVocab))) {}
  Tensor<T> forward(const Tensor<std::int64_t>& tokens) {
    const std::int64_t len = tokens.shape()[1];
    const Device dev = tokens.device();
    auto x = chorus::add(embed(tokens), pos(chorus::arange<std::int64_t>(0, len, 1, dev)));  // [B, L, E]
    auto mask = nn::generate_square_subsequent_mask<T>(len, dev);
    return head(encoder(x.transpose(0, 1), mask).transpose(0, 1));
  }
};
using TransformerLm = TransformerLmT<float>;

}  // namespace bench
