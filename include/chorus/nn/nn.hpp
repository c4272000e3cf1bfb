#pragma once
// Modules, layers, losses and initialisation.
#include "../compiled.hpp"
#include "attention.hpp"
#include "checkpoint.hpp"
#include "conv.hpp"
#include "embedding.hpp"
#include "functional.hpp"
#include "init.hpp"
#include "layers.hpp"
#include "module.hpp"
#include "normalization.hpp"
#include "rnn.hpp"
#include "transformer.hpp"
#include "utils.hpp"

// The instances chorus::compiled holds (Note [compiled chorus] in compiled.hpp): the layers
// (their members are defined in their classes, so a unit still instantiates those it inlines,
// but none of what they call).
#define CHORUS_NN_LAYER_INSTANCES(X, T)                                                               \
  X(class nn::LinearImpl<T>) X(class nn::Conv2dImpl<T>) X(class nn::EmbeddingImpl<T>)                \
  X(class nn::SequentialImpl<T>) X(class nn::BatchNormImpl<T, 1>) X(class nn::BatchNormImpl<T, 2>)    \
  X(class nn::BatchNormImpl<T, 0, true>) X(class nn::LayerNormImpl<T>)                                \
  X(class nn::detail::RNNImplBase<T>) X(class nn::RNNImpl<T>) X(class nn::LSTMImpl<T>)                \
  X(class nn::GRUImpl<T>) X(class nn::detail::RNNCellImplBase<T>) X(class nn::RNNCellImpl<T>)         \
  X(class nn::LSTMCellImpl<T>) X(class nn::GRUCellImpl<T>) X(class nn::MultiheadAttentionImpl<T>)     \
  X(class nn::TransformerEncoderLayerImpl<T>) X(class nn::TransformerDecoderLayerImpl<T>)             \
  X(class nn::TransformerEncoderImpl<T>) X(class nn::TransformerDecoderImpl<T>) X(class nn::TransformerImpl<T>)
CHORUS_EXTERN_INSTANCES(CHORUS_NN_LAYER_INSTANCES, CHORUS_FLOATING_DTYPES)
