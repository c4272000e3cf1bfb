#pragma once
// Image transforms (torchvision's CIFAR recipe): Normalize, RandomCrop with zero padding,
// RandomHorizontalFlip, and Compose. They act on one float image [C, H, W] on the host, with a
// generator the dataset seeds per example and epoch (Note [deterministic workers]).
#include <algorithm>
#include <cstdint>
#include <functional>
#include <vector>

#include "../compiled.hpp"
#include "../core/host_engine.hpp"
#include "../core/shape.hpp"
#include "../error.hpp"

CHORUS_NAMESPACE_BEGIN
namespace data {

/// One image on the host, channels-first.
struct Image {
  std::int64_t channels = 0, height = 0, width = 0;
  std::vector<float> pixels;  // [channels][height][width]
  float& at(std::int64_t c, std::int64_t y, std::int64_t x) { return pixels[(c * height + y) * width + x]; }
  float at(std::int64_t c, std::int64_t y, std::int64_t x) const { return pixels[(c * height + y) * width + x]; }
};

namespace detail {
/// Checks an image's sizes against its pixels before a transform indexes them (a hand-built
/// Image may disagree; the product is checked, Note [checked sizes]).
CHORUS_INLINE void check_image(const Image& img, const char* what);
}  // namespace detail

/// The generator a transform draws from: std::mt19937_64's numbers (Note [host engine]).
using TransformRng = HostEngine;
/// A transform: an image (and a generator) to an image.
using Transform = std::function<Image(Image, TransformRng&)>;

namespace transforms {

/// (x - mean[c]) / std[c] per channel.
struct Normalize {
  std::vector<float> mean, std;
  Normalize(std::vector<float> mean_, std::vector<float> std_);
  Image operator()(Image img, TransformRng&) const;
};

/// Pads each side with `padding` zeros, then crops a size × size window at a random offset.
struct RandomCrop {
  std::int64_t size, padding;
  explicit RandomCrop(std::int64_t size_, std::int64_t padding_ = 0);
  Image operator()(const Image& img, TransformRng& rng) const;
};

/// Mirrors the image left-right with probability p.
struct RandomHorizontalFlip {
  double p = 0.5;
  Image operator()(Image img, TransformRng& rng) const;
};

/// Applies transforms in order.
struct Compose {
  std::vector<Transform> transforms;
  Image operator()(Image img, TransformRng& rng) const;
};

}  // namespace transforms
}  // namespace data
CHORUS_NAMESPACE_END

#if !CHORUS_COMPILED
#include "transforms_impl.hpp"
#endif
