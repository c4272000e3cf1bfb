#pragma once
// Embedding: a lookup table of learned vectors.
#include <optional>

#include "../ops/nn.hpp"
#include "init.hpp"
#include "module.hpp"

CHORUS_NAMESPACE_BEGIN
namespace nn {

/// Embedding's options, braced in PyTorch's order (Note [layer options] in nn/module.hpp).
struct EmbeddingOptions {
  /// The row kept at zero and out of the gradients (default: none); negative values count from the end, as in PyTorch.
  std::optional<std::int64_t> padding_idx = std::nullopt;
  Device device = Device::cpu();  ///< Where the weight is created (default CPU).
};

/// As torch.nn.Embedding: `weight` [num_embeddings, embedding_dim] from N(0, 1), the
/// padding row zeroed and excluded from gradients.
template <class T = float>
class EmbeddingImpl : public Module {
 public:
  /// A table of `num_embeddings` vectors of `embedding_dim` (both positive), initialised by reset_parameters().
  EmbeddingImpl(std::int64_t num_embeddings, std::int64_t embedding_dim, EmbeddingOptions options = {})
      : num_embeddings(num_embeddings), embedding_dim(embedding_dim), options(options) {
    CHORUS_CHECK(num_embeddings > 0 && embedding_dim > 0, "Embedding(", num_embeddings, ", ", embedding_dim,
                 "): sizes must be positive");
    if (options.padding_idx) {
      auto p = *options.padding_idx;
      CHORUS_CHECK(p >= -num_embeddings && p < num_embeddings, "Embedding: padding_idx ", p,
                   " is out of range for ", num_embeddings, " embeddings");
      padding_idx = p < 0 ? p + num_embeddings : p;
    }
    register_parameter("weight", &EmbeddingImpl::weight,
                       Tensor<T>::empty(Shape{num_embeddings, embedding_dim}, options.device));
    reset_parameters();
  }
  /// Redraws the weight from N(0, 1) and zeroes the padding row.
  void reset_parameters() {
    init::normal_(weight);
    if (padding_idx) {
      NoGradGuard g;
      weight.detach().narrow(0, *padding_idx, 1).fill_(T(0));
    }
  }
  /// The rows of weight picked by `indices` (any shape): output indices.shape + [embedding_dim].
  Tensor<T> forward(const Tensor<std::int64_t>& indices) const { return embedding(indices, weight, padding_idx); }
  std::string name() const override {
    return "Embedding(" + std::to_string(num_embeddings) + ", " + std::to_string(embedding_dim) + ")";
  }

  /// The table's size: rows (num_embeddings) and vector length (embedding_dim).
  ///@{
  std::int64_t num_embeddings, embedding_dim;
  ///@}
  EmbeddingOptions options;                 ///< The options it was built with.
  std::optional<std::int64_t> padding_idx;  ///< The padding row, in [0, num_embeddings) when set.
  Tensor<T> weight;                         ///< The table, [num_embeddings, embedding_dim].
};
/// Holder (Note [layer options] in nn/module.hpp): `EmbeddingT<T>(10, 3, {.padding_idx = 0})`.
template <class T = float>
class EmbeddingT : public ModuleHolder<EmbeddingImpl<T>> {
 public:
  using ModuleHolder<EmbeddingImpl<T>>::ModuleHolder;
  /// Constructs the implementation: EmbeddingImpl(num_embeddings, embedding_dim, options).
  explicit EmbeddingT(std::int64_t num_embeddings, std::int64_t embedding_dim, EmbeddingOptions options = {})
      : ModuleHolder<EmbeddingImpl<T>>(std::make_shared<EmbeddingImpl<T>>(num_embeddings, embedding_dim, options)) {}
};
using Embedding = EmbeddingT<float>;  ///< EmbeddingT with a float weight.

}  // namespace nn
CHORUS_NAMESPACE_END
