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
  /// The image's sizes: channels, height and width.
  ///@{
  std::int64_t channels = 0, height = 0, width = 0;
  ///@}
  std::vector<float> pixels;  ///< The pixel values, [channels][height][width] row-major.
  /// The pixel at channel c, row y, column x (not bounds-checked).
  ///@{
  float& at(std::int64_t c, std::int64_t y, std::int64_t x) { return pixels[(c * height + y) * width + x]; }
  float at(std::int64_t c, std::int64_t y, std::int64_t x) const { return pixels[(c * height + y) * width + x]; }
  ///@}
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
  /// The per-channel means and standard deviations.
  ///@{
  std::vector<float> mean, std;
  ///@}
  /// Per-channel `mean_` and `std_`; throws unless they are non-empty, of one size, with every std > 0.
  Normalize(std::vector<float> mean_, std::vector<float> std_);
  /// Normalizes `img`; throws unless it has mean.size() channels.
  Image operator()(Image img, TransformRng&) const;
};

/// Pads each side with `padding` zeros, then crops a size × size window at a random offset.
struct RandomCrop {
  /// The crop's side, and the zeros added on each side before cropping.
  ///@{
  std::int64_t size, padding;
  ///@}
  /// Crops of side `size_` after `padding_` zeros on each side; throws unless size_ > 0, padding_ >= 0.
  explicit RandomCrop(std::int64_t size_, std::int64_t padding_ = 0);
  /// A size × size crop of the padded `img`; throws when the padded image is smaller than that.
  Image operator()(const Image& img, TransformRng& rng) const;
};

/// Mirrors the image left-right with probability p.
struct RandomHorizontalFlip {
  double p = 0.5;  ///< The probability of flipping (default 0.5).
  /// `img`, mirrored with probability p.
  Image operator()(Image img, TransformRng& rng) const;
};

/// Applies transforms in order.
struct Compose {
  std::vector<Transform> transforms;  ///< The transforms, in the order they are applied.
  /// `img` passed through every transform in turn.
  Image operator()(Image img, TransformRng& rng) const;
};

}  // namespace transforms
}  // namespace data
CHORUS_NAMESPACE_END

#if !CHORUS_COMPILED
#include "transforms_impl.hpp"
#endif
