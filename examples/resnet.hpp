#pragma once
// ResNet-20 for CIFAR-10 (He et al. 2016, "Deep Residual Learning for Image Recognition",
// section 4.2): a 3x3 convolution to 16 channels, three stages of three basic blocks with
// 16, 32 and 64 channels (the first block of stages 2 and 3 halves the resolution), global
// average pooling and a 10-way linear layer: 269,722 parameters (the paper's "0.27M").
//
// Note [option A shortcut]
// Where a block changes shape, the shortcut is the paper's option A for CIFAR: the input is
// subsampled (stride 2) and zero-padded with half the new channel count on each side, with no
// parameters (option B's 1x1 convolutions would add ~12k parameters and aren't what the paper
// used for its CIFAR networks). Parameter and buffer names match the common PyTorch
// implementation (conv1, bn1, layer1.0.conv1, …, fc), so checkpoints move both ways.
//
// Shared by examples/train_resnet.cpp and the benchmarks.
#include <chorus/chorus.hpp>

namespace examples {

template <class T = float>
struct BasicBlockImpl : chorus::nn::Module {
  chorus::nn::Conv2dT<T> conv1, conv2;
  chorus::nn::BatchNorm2dT<T> bn1, bn2;
  std::int64_t in_planes, planes, stride;

  BasicBlockImpl(std::int64_t in_planes, std::int64_t planes, std::int64_t stride)
      : conv1(register_module("conv1",
                              chorus::nn::Conv2dT<T>(in_planes, planes, 3, {.stride = stride, .padding = 1, .bias = false}))),
        conv2(register_module("conv2", chorus::nn::Conv2dT<T>(planes, planes, 3, {.padding = 1, .bias = false}))),
        bn1(register_module("bn1", chorus::nn::BatchNorm2dT<T>(planes))),
        bn2(register_module("bn2", chorus::nn::BatchNorm2dT<T>(planes))),
        in_planes(in_planes),
        planes(planes),
        stride(stride) {}

  chorus::Tensor<T> forward(const chorus::Tensor<T>& x) const {
    auto out = chorus::relu(bn1(conv1(x)));
    out = bn2(conv2(out));
    return chorus::relu(out + shortcut(x));
  }

  // See Note [option A shortcut].
  chorus::Tensor<T> shortcut(const chorus::Tensor<T>& x) const {
    if (stride == 1 && in_planes == planes) return x;
    auto sub = chorus::avg_pool2d(x, 1, stride);  // x[:, :, ::s, ::s]
    const std::int64_t pad = (planes - in_planes) / 2;
    auto s = sub.shape();
    auto zeros = chorus::zeros<T>(chorus::Shape{s[0], pad, s[2], s[3]}, x.device());
    return chorus::cat(std::vector<chorus::Tensor<T>>{zeros, sub, zeros}, 1);
  }
  std::string name() const override { return "BasicBlock"; }
};
template <class T = float>
using BasicBlock = chorus::nn::ModuleHolder<BasicBlockImpl<T>>;

template <class T = float>
struct ResNet20 : chorus::nn::Module {
  chorus::nn::Conv2dT<T> conv1;
  chorus::nn::BatchNorm2dT<T> bn1;
  chorus::nn::SequentialT<T> layer1, layer2, layer3;
  chorus::nn::LinearT<T> fc;

  explicit ResNet20(int num_classes = 10)
      : conv1(register_module("conv1", chorus::nn::Conv2dT<T>(3, 16, 3, {.padding = 1, .bias = false}))),
        bn1(register_module("bn1", chorus::nn::BatchNorm2dT<T>(16))),
        layer1(register_module("layer1", stage(16, 16, 1))),
        layer2(register_module("layer2", stage(16, 32, 2))),
        layer3(register_module("layer3", stage(32, 64, 2))),
        fc(register_module("fc", chorus::nn::LinearT<T>(64, num_classes))) {
    // He initialisation for the convolutions and the classifier, as the paper (and the usual
    // PyTorch CIFAR ResNets) do; batch norms start at weight 1, bias 0.
    for (auto& p : named_parameters())
      if (p.name.ends_with("conv1.weight") || p.name.ends_with("conv2.weight") || p.name == "fc.weight")
        chorus::nn::init::kaiming_normal_(p.tensor.template as<T>());
  }

  chorus::Tensor<T> forward(const chorus::Tensor<T>& x) const {
    auto out = chorus::relu(bn1(conv1(x)));
    out = layer3(layer2(layer1(out)));
    out = chorus::adaptive_avg_pool2d(out, 1).flatten(1);
    return fc(out);
  }

 private:
  static chorus::nn::SequentialT<T> stage(std::int64_t in, std::int64_t out, std::int64_t stride) {
    chorus::nn::SequentialT<T> s;
    s->push_back(BasicBlock<T>(in, out, stride));
    s->push_back(BasicBlock<T>(out, out, 1));
    s->push_back(BasicBlock<T>(out, out, 1));
    return s;
  }
};

}  // namespace examples
