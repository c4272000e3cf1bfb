#pragma once
// Embedding: a lookup table of learned vectors.
#include <optional>

#include "../ops/nn.hpp"
#include "init.hpp"
#include "module.hpp"

CHORUS_NAMESPACE_BEGIN
namespace nn {

struct EmbeddingOptions {
  std::optional<std::int64_t> padding_idx = std::nullopt;  // negative values count from the end, as in PyTorch
  Device device = Device::cpu();
};

/// As torch.nn.Embedding: `weight` [num_embeddings, embedding_dim] from N(0, 1), the
/// padding row zeroed and excluded from gradients.
template <class T = float>
class EmbeddingImpl : public Module {
 public:
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
  void reset_parameters() {
    init::normal_(weight);
    if (padding_idx) {
      NoGradGuard g;
      weight.detach().narrow(0, *padding_idx, 1).fill_(T(0));
    }
  }
  Tensor<T> forward(const Tensor<std::int64_t>& indices) const { return embedding(indices, weight, padding_idx); }
  std::string name() const override {
    return "Embedding(" + std::to_string(num_embeddings) + ", " + std::to_string(embedding_dim) + ")";
  }

  std::int64_t num_embeddings, embedding_dim;
  EmbeddingOptions options;
  std::optional<std::int64_t> padding_idx;  // in [0, num_embeddings) when set
  Tensor<T> weight;
};
/// Holder (Note [layer options] in nn/module.hpp): `EmbeddingT<T>(10, 3, {.padding_idx = 0})`.
template <class T = float>
class EmbeddingT : public ModuleHolder<EmbeddingImpl<T>> {
 public:
  using ModuleHolder<EmbeddingImpl<T>>::ModuleHolder;
  explicit EmbeddingT(std::int64_t num_embeddings, std::int64_t embedding_dim, EmbeddingOptions options = {})
      : ModuleHolder<EmbeddingImpl<T>>(std::make_shared<EmbeddingImpl<T>>(num_embeddings, embedding_dim, options)) {}
};
using Embedding = EmbeddingT<float>;

}  // namespace nn
CHORUS_NAMESPACE_END
