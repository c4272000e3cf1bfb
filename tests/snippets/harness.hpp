#pragma once
// What the C++ blocks of README.md and docs/ take from the text around them (a model called
// Model, a batch x, a loader...): each block marked `<!-- snippet: C -->` in the Markdown is the
// body of a member function of a class derived from context C below, so it reads these members
// by the names the prose uses and may declare its own (which hide them). tests/snippets/extract.py
// writes the blocks out; CMake compiles them (target doc_snippets), so a block that no longer
// compiles against the library fails the build. Nothing here runs: the members are never made.
#include <chorus/chorus.hpp>
#include <chorus/distributed.hpp>

#include <cstdint>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

using namespace chorus;
namespace F = chorus::nn::functional;

namespace chorus_snippets {

/// The model of the README and the guides.
struct Model : nn::Module {
  nn::Linear fc1, fc2;
  Model(int in, int out) : Model(in, 16, out) {}
  Model(int in, int hidden, int out)
      : fc1(register_module("fc1", nn::Linear(in, hidden))), fc2(register_module("fc2", nn::Linear(hidden, out))) {}
  Tensor<float> forward(const Tensor<float>& x) { return fc2(relu(fc1(x))); }
};

/// A classifier in any floating dtype (the mixed-precision guide's NetT<half>).
template <class T>
struct NetT : nn::Module {
  nn::LinearT<T> fc;
  NetT() : fc(register_module("fc", nn::LinearT<T>(8, 4))) {}
  Tensor<T> forward(const Tensor<T>& x) { return fc(x); }
};

/// A language model taking token ids and a mask (the mixed-precision guide's GptT<bfloat16>).
template <class T>
struct GptT : nn::Module {
  nn::EmbeddingT<T> embed;
  GptT() : embed(register_module("embed", nn::EmbeddingT<T>(64, 16))) {}
  Tensor<T> forward(const Tensor<std::int64_t>& ids, const Tensor<T>& mask) { return embed(ids) + mask.sum(); }
};

/// A block to checkpoint (the DataParallel guide's Block(256)), held as TORCH_MODULE holds.
struct BlockImpl : nn::Module {
  nn::Linear fc;
  explicit BlockImpl(int width) : fc(register_module("fc", nn::Linear(width, width))) {}
  Tensor<float> forward(const Tensor<float>& x, const Tensor<float>& mask) { return relu(fc(x)) * mask; }
};
CHORUS_MODULE(Block);

using Regression = data::TensorDataset<float, float>;
using Classification = data::TensorDataset<float, std::int64_t>;

/// One process, tensors and a plain model: the guides' first steps.
struct Tensors {
  Model model{5, 2};
  Tensor<float> x, y, input, output, mask;
  Tensor<std::int64_t> padding;
  std::int64_t L = 8;
  Block block{256};
  optim::SGD opt{model.parameters(), {.lr = 0.1}};
};

/// DataParallel over Model with class labels: losses on the replicas, ZeRO in one process.
struct Classify {
  DataParallel<Model> model{Model(5, 2)};
  Tensor<float> x;
  Tensor<std::int64_t> y;
};

/// One process of a distributed job (DistributedDataParallel over Model).
struct Distributed {
  dist::ProcessGroup& pg;
  Device dev;
  Regression dataset;
  int epochs = 2;
  DistributedDataParallel<Model> ddp;
  optim::SGD opt;
  optim::StepLR sched;
  std::int64_t total_steps = 1000, steps_per_epoch = 100;
  std::shared_ptr<data::DistributedSampler> sampler;
  data::DataLoader<Regression> loader;
};

/// Mixed precision: a loader of (features, class) batches and a language model's inputs.
struct Amp {
  data::DataLoader<Classification> loader;
  Tensor<std::int64_t> ids, next;
  Tensor<bfloat16> causal_mask;
  std::int64_t vocab = 64;
  NetT<float> model;
};

}  // namespace chorus_snippets
